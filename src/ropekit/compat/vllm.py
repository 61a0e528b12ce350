"""vLLM's and FlashInfer's rotary calls on the core: flat tokens, a [cos | sin] cache, rotation in place.

Migration: ``from vllm.model_executor.layers.rotary_embedding import get_rope`` becomes
``from ropekit.compat.vllm import get_rope``; ``vllm._custom_ops.rotary_embedding(...)`` becomes
``ropekit.compat.vllm.rotary_embedding(...)``; ``from flashinfer.rope import apply_rope_with_cos_sin_cache``
(and ``_inplace``) becomes ``from ropekit.compat.vllm import ...``. The calls stay as they are.

Shape notation: T tokens, Hq / Hk heads, D head_size, R rotary_dim <= D, P cache rows (max positions).

The convention (vLLM 0.11 ``RotaryEmbedding`` / ``_custom_ops.rotary_embedding``, FlashInfer 0.4
``apply_rope_with_cos_sin_cache``): ``positions`` holds one position per token (any shape, T entries);
``query`` is (T, Hq * D), (T, Hq, D) or any shape whose leading axes hold the T tokens in order
((B, S, Hq * D), (B, S, Hq, D)), possibly a strided view; ``key`` likewise with Hk heads, or None;
``cos_sin_cache`` is (P, R), row p = [cos(p theta) | sin(p theta)]. ``is_neox=True`` pairs (i, i + R/2)
(GPT-NeoX), False pairs (2i, 2i+1) (GPT-J). Features past R pass through. The cache halves are read as views;
nothing is gathered or copied.

Differences: a position outside [0, P) is a ValueError (the peers read past the cache); any float cache dtype
is accepted (FlashInfer requires float32) and math runs in float32; ``key=None`` works in every function.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch._C import _increment_version
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ropekit.backends import select_backend
from ropekit.backends.c.rotary import pointer_launch
from ropekit.backends.kernel_op import jit_tracing as _jit_tracing
from ropekit.backends.kernel_op import register_op
from ropekit.backends.plan import MAX_PLANS, gate, keep, launch_rotary_positions, rotary_plan, span
from ropekit.compat._common import check_backend_name, peer_names, renamed
from ropekit.config import RopeConfig
from ropekit.dtensor_inputs import check_no_dtensor
from ropekit.functional import apply_resolved
from ropekit.positions import resolve
from ropekit.validation import check_bool, check_int, describe, shares_memory

__all__ = [
    "RotaryEmbedding",
    "apply_rope_with_cos_sin_cache",
    "apply_rope_with_cos_sin_cache_inplace",
    "get_rope",
    "rotary_embedding",
]

_NAMES = {"x": "query", "q": "query", "k": "key", "cos": "cos_sin_cache", "sin": "cos_sin_cache"}
# vLLM's in-place call, its own launch-plan gate (ropekit.backends.plan.gate): no (T, H, D) views on a hit.
_launch_planned = gate(
    "compat.vllm.rotary_embedding",
    "positions query key? cos_sin_cache",
    "head_size:int is_neox:bool backend:str numerics:str",
)


def _token_heads(name: str, t: torch.Tensor, tokens: int, head_size: int) -> torch.Tensor:
    """The (1, T, H, D) view of a tensor holding T tokens of H heads of width head_size."""
    if isinstance(t, torch.Tensor):  # the decode path: a few attribute reads, then the view
        shape = t.shape
        if len(shape) >= 2 and not shape[-1] % head_size and _holds(shape, tokens, head_size):
            # No tokens: -1 cannot be inferred from 0 elements; any head count views an empty tensor.
            heads = -1 if tokens else max(shape[-1] // head_size, 1)
            try:
                return t.view(1, tokens, heads, head_size)  # (1, T, H, D)
            except RuntimeError:
                pass
    raise _token_heads_error(name, t, tokens, head_size)


def _token_heads_error(name: str, t: object, tokens: int, head_size: int) -> ValueError:
    """What is wrong with a tensor :func:`_token_heads` could not view."""
    if not isinstance(t, torch.Tensor):
        return ValueError(f"{name}: expected a torch.Tensor, got {describe(t)}")
    if t.dim() < 2 or t.shape[-1] % head_size or not _holds(t.shape, tokens, head_size):
        return ValueError(
            f"{name}: expected (num_tokens, num_heads * head_size) or (num_tokens, num_heads, head_size) "
            f"with num_tokens = {tokens} (positions) and head_size = {head_size}, got shape {tuple(t.shape)}"
        )
    return ValueError(
        f"{name}: its strides {t.stride()} do not allow a (num_tokens, num_heads, head_size) view, which "
        f"rotating in place needs; pass a tensor whose token and head axes can be merged"
    )


def _holds(shape: torch.Size, tokens: int, head_size: int) -> bool:
    """Whether a tensor of this shape holds exactly ``tokens`` tokens on its leading axes: (..., H * D) with
    the leading axes' product ``tokens``, or (..., H, D) with the product of the axes before the heads
    ``tokens`` (vLLM's two forms; a 2-D tensor is always the first). Divisibility alone is not enough: (2, 16)
    with one position and head_size 8 would be read as one token of 4 heads."""
    return math.prod(shape[:-1]) == tokens or (
        len(shape) > 2 and shape[-1] == head_size and math.prod(shape[:-2]) == tokens
    )


def _halves(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin): the (P, R/2) halves of a [cos | sin] cache, as views with row stride R.

    A decode step passes the same cache every time, and two slices cost more than all the checks of the
    call, so the views are kept on the cache tensor itself (they live and die with it), keyed by everything
    the views depend on: data pointer, shape, strides, dtype and device. An in-place change of any
    (``t_()``, ``set_()``, ``.data =``) takes the slices afresh, never stale views. A write to the cache's
    values needs no key (the views show it), so the version counter is not part of it (inference tensors
    have none). Under torch.compile the slices are taken afresh: dynamo cannot trace a tensor's
    ``__dict__``, and a compiled graph pays nothing for two views.
    """
    if torch.compiler.is_compiling():
        half = cache.shape[1] // 2
        return cache[:, :half], cache[:, half:]
    key = (cache.data_ptr(), cache.shape, cache.stride(), cache.dtype, cache.device)
    memo = cache.__dict__.get("_ropekit_halves")
    if memo is None or memo[0] != key:
        half = cache.shape[1] // 2
        memo = key, (cache[:, :half], cache[:, half:])
        cache.__dict__["_ropekit_halves"] = memo
    return memo[1]


def _rotate(
    positions, query, key, head_size, cos_sin_cache, is_neox, inplace, backend="auto", numerics="exact"
):
    plan_key = None
    if inplace:  # a decode step seen before: vLLM's call as its launch plan, no views built
        out, plan_key = _launch_planned(
            positions, query, key, cos_sin_cache, head_size=head_size, is_neox=is_neox, backend=backend,
            numerics=numerics,
        )  # fmt: skip
        if out is not None:
            return None
    if type(head_size) is not int:
        head_size = check_int("head_size", head_size, minimum=1, expected="a positive int")
    if type(is_neox) is not bool:
        check_bool("is_neox", is_neox)
    if not isinstance(positions, torch.Tensor):
        raise ValueError(f"positions: expected an integer tensor, got {describe(positions)}")
    c = cos_sin_cache
    if not isinstance(c, torch.Tensor) or c.dim() != 2 or c.shape[1] % 2 or not 0 < c.shape[1] <= head_size:
        raise ValueError(
            f"cos_sin_cache: expected shape (max_position, rotary_dim) holding [cos | sin], rotary_dim even "
            f"and <= head_size ({head_size}), got {describe(c)}"
        )
    tokens = positions.numel()
    q = _token_heads("query", query, tokens, head_size)
    k = None if key is None else _token_heads("key", key, tokens, head_size)
    cos, sin = _halves(c)
    interleaved = not is_neox
    rows = positions.view(1, tokens) if positions.is_contiguous() else positions.reshape(1, tokens)
    positions_key = None
    if not inplace:  # out of place (vLLM's forward_native): the core's positions gate, on these views
        out, positions_key = launch_rotary_positions(
            q, k, cos, sin, rows, None, interleaved=interleaved, inplace=False, backend=backend,
            conjugate=False, numerics=numerics,
        )  # fmt: skip
        if out is not None:
            return out
    try:  # not peer_names: a context manager costs a decode step more than all the checks above
        # The functional API's own two steps (apply_rotary_qk minus its table forms, which vLLM has none of).
        pos = resolve(q, positions=rows, name="query")
        out = apply_resolved(
            q, k, cos, sin, pos, interleaved=interleaved, inplace=inplace, backend=backend,
            gated=positions_key is not None, plan_key=positions_key, positions=rows, numerics=numerics,
        )  # fmt: skip
    except ValueError as err:
        raise renamed(err, _NAMES, within=True) from None
    if plan_key is not None:  # checked and served: later steps of this kind take the plan
        flat = positions.dtype == torch.int64 and positions.is_contiguous()  # the loop reads it as it lies
        impl = select_backend(backend, q, cos, numerics=numerics)
        plan = _plan(impl, query, key, q, k, cos, sin, positions, interleaved, numerics) if flat else None
        keep(plan_key, plan)
    return out


def _plan(impl, query, key, q, k, cos, sin, positions, interleaved, numerics):
    """run(positions, query, key, cache) -> query once it has rotated query and key in place (None: nothing
    written; the checked path serves the call). On the C loop: the loop on the call's data pointers, each
    token's row read from positions by the loop, which checks it; on another backend: its plan for
    per-sequence offsets (:func:`_views_plan`). None when the backend has no plan for this kind."""
    # Each token as a sequence of its own, (T, 1, H, D) views, whose offset is its position: the core's
    # plan for per-sequence offsets proves the backend takes these views and table as they are.
    q_tok, k_tok = q.transpose(0, 1), None if k is None else k.transpose(0, 1)  # (T, 1, H, D)
    if impl.name != "cpu":
        return _views_plan(impl, q_tok, k_tok, cos, sin, positions, interleaved, numerics)
    flags = dict(interleaved=interleaved, conjugate=False, per_sequence=True, numerics=numerics)
    if q_tok.numel() == 0 or impl.plan(q_tok, k_tok, cos, sin, **flags, inplace=True) is None:
        return None  # the core's C plan proves the loop takes these views and table as they are
    call = pointer_launch(q_tok, k_tok, q_tok, k_tok, cos, sin, **flags)
    sin_bytes = sin.data_ptr() - cos.data_ptr()  # sin is the cache's second half, a fixed step from cos
    q_span, k_span = span(query), 0 if key is None else span(key)
    shared: dict[int, bool] = {}  # k - q byte distance -> whether query and key share an element

    def run(positions, query, key, cache):
        if (query.is_inference() or (key is not None and key.is_inference())) and (
            not torch.is_inference_mode_enabled()
        ):
            return None  # PyTorch refuses this write: the checked path says so
        q = query.data_ptr()
        c, p = cache.data_ptr(), positions.data_ptr()
        # The memory rule: query and key (written) meet neither the cache nor positions (read); where byte
        # ranges meet, the checked path decides exactly.
        if not cache.is_contiguous():
            return None
        c_end = c + cache.numel() * cache.element_size()
        p_end = p + positions.numel() * positions.element_size()
        if (c < q + q_span and q < c_end) or (p < q + q_span and q < p_end):
            return None
        k = None
        if key is not None:
            k = key.data_ptr()
            if (c < k + k_span and k < c_end) or (p < k + k_span and k < p_end):
                return None
            if -k_span < k - q < q_span:  # the spans meet (views of one qkv buffer): exactly, once a distance
                meet = shared.get(k - q)
                if meet is None:
                    meet = shares_memory(query, key)
                    if len(shared) < MAX_PLANS:  # bounded: a workload of ever new distances recomputes
                        shared[k - q] = meet
                if meet:
                    return None
        return query if call(q, q, k, k, c, c + sin_bytes, p, 0) == -1 else None

    return run


def _views_plan(impl, q_tok, k_tok, cos, sin, positions, interleaved, numerics):
    """run(positions, query, key, cache) on a backend other than the C loop: the (T, 1, H, D) views of the
    checked path, then the core's plan for per-sequence offsets (:func:`ropekit.backends.plan.rotary_plan`:
    its value checks, then the backend's launch); None when the backend has no such plan."""
    tokens, head_size = q_tok.shape[0], q_tok.shape[3]
    core = rotary_plan(impl, q_tok, k_tok, cos, sin, positions.view(tokens), interleaved=interleaved,
                       inplace=True, conjugate=False, numerics=numerics)  # fmt: skip
    if core is None:
        return None

    def run(positions, query, key, cache):
        q = _token_heads("query", query, tokens, head_size).transpose(0, 1)  # (T, 1, H, D)
        k = None if key is None else _token_heads("key", key, tokens, head_size).transpose(0, 1)
        cos, sin = _halves(cache)
        return None if core(q, k, cos, sin, positions.view(tokens)) is None else query

    return run


def _rotary_embedding_op(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    backend: str = "auto",
    numerics: str = "exact",
) -> None:
    """The kernel of ``torch.ops.ropekit.rotary_embedding``: every check, then the in-place rotation."""
    _rotate(positions, query, key, head_size, cos_sin_cache, is_neox, True, backend, numerics)


def _rotary_embedding_fake(
    positions, query, key, head_size, cos_sin_cache, is_neox, backend="auto", numerics="exact"
):
    """Shapes only: the same views as the kernel, so a traced call fails where an eager one would."""
    head_size = check_int("head_size", head_size, minimum=1, expected="a positive int")
    tokens = positions.numel()
    _token_heads("query", query, tokens, head_size)
    if key is not None:
        _token_heads("key", key, tokens, head_size)


# vLLM's op signature (csrc/torch_bindings.cpp: ``rotary_embedding(Tensor positions, Tensor! query,
# Tensor!? key, int head_size, Tensor cos_sin_cache, bool is_neox) -> ()``) plus ropekit's backend and
# numerics choices.
rotary_embedding_op = register_op(
    "rotary_embedding",
    _rotary_embedding_op,
    _rotary_embedding_fake,
    mutates_args=("query", "key"),
    schema=(
        "(Tensor positions, Tensor(a!) query, Tensor(b!)? key, SymInt head_size, Tensor cos_sin_cache, "
        "bool is_neox, str backend='auto', str numerics='exact') -> ()"
    ),
)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    *,
    backend: str = "auto",
    numerics: str = "exact",
) -> None:
    """Mirrors vLLM's ``_custom_ops.rotary_embedding``: rotate query and key in place; returns None.

    ``numerics`` as in :func:`ropekit.apply_rotary`: "vllm" gives the bits of vLLM's ``forward_native``
    (``x1 * cos - x2 * sin`` in query's dtype, the cache cast to it), written in place.

    The work is ``torch.ops.ropekit.rotary_embedding`` (vLLM's op signature, in-place on query and key, passes
    ``torch.library.opcheck``). Plain eager tensors call the op's kernel directly and bump query's and key's
    version counters themselves, as the dispatcher would: the dispatcher's Python layers cost more than the
    rotation at decode size. Anything that traces (torch.compile, fake tensors, dispatch modes) goes through
    the registered op.

    Raises:
        ValueError: shapes that do not hold ``positions.numel()`` tokens of head_size-wide heads, a cache that
            is not (P, R) with even R <= head_size, positions outside [0, P), a query or key whose strides
            allow no (tokens, heads, head_size) view.
    """
    # kernel_op.plain_eager's questions, inline (a decode step spares the call): anything that traces
    # (torch.compile, torch.jit.trace, fake tensors, dispatch modes) takes the registered op
    if (
        torch.compiler.is_compiling()
        or type(query) is not torch.Tensor
        or _get_current_dispatch_mode()
        or _jit_tracing()
    ):
        check_no_dtensor(
            "compat.vllm.rotary_embedding",
            ("positions", "query", "key", "cos_sin_cache"),
            (positions, query, key, cos_sin_cache),
            "rotate each rank's local tensors (t.to_local()), or DTensors with ropekit.apply_rotary_qk",
        )
        torch.ops.ropekit.rotary_embedding(
            positions, query, key, head_size, cos_sin_cache, is_neox, backend=backend, numerics=numerics
        )
        return
    _rotate(positions, query, key, head_size, cos_sin_cache, is_neox, True, backend, numerics)
    # What the dispatcher's ADInplaceOrView step does for the op (torch.autograd.graph.increment_version's
    # own body, without its per-call tuple building).
    _increment_version([query] if key is None else [query, key])


def apply_rope_with_cos_sin_cache_inplace(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    *,
    backend: str = "auto",
    numerics: str = "exact",
) -> None:
    """Mirrors ``flashinfer.rope.apply_rope_with_cos_sin_cache_inplace``: as :func:`rotary_embedding`."""
    rotary_embedding(
        positions, query, key, head_size, cos_sin_cache, is_neox, backend=backend, numerics=numerics
    )


def apply_rope_with_cos_sin_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    *,
    backend: str = "auto",
    numerics: str = "exact",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mirrors ``flashinfer.rope.apply_rope_with_cos_sin_cache``: new rotated tensors, shaped like the inputs.

    query and key are not modified. Errors as :func:`rotary_embedding` (``numerics`` as there: "vllm" is
    vLLM's ``forward_native``, bit for bit).
    """
    q, k = _rotate(positions, query, key, head_size, cos_sin_cache, is_neox, False, backend, numerics)
    return q.reshape(query.shape), None if k is None else k.reshape(key.shape)


class RotaryEmbedding(nn.Module):
    """Mirrors vLLM's ``RotaryEmbedding`` (``model_executor/layers/rotary_embedding/base.py``).

    Holds ``cos_sin_cache`` (max_position_embeddings, rotary_dim) in ``dtype``, as vLLM does, built from a
    :class:`~ropekit.RopeConfig` (float64 angles, then cast). :meth:`forward` rotates query and key in place
    and returns them (vLLM's CUDA path); :meth:`forward_native` returns new tensors (vLLM's reference path).
    Build it through :func:`get_rope`, or from a config with :meth:`from_config`.

    Args:
        head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype: as in vLLM.
        backend: ropekit's backend for every call ("auto", "torch", "cpu" or "triton").
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        dtype: torch.dtype,
        *,
        backend: str = "auto",
    ) -> None:
        interleaved = not check_bool("is_neox_style", is_neox_style)
        config = RopeConfig(head_size, base, rotary_dim=rotary_dim, interleaved=interleaved)
        self._init_from(config, max_position_embeddings, dtype, backend)

    @classmethod
    def from_config(
        cls, config: RopeConfig, max_positions: int, dtype: torch.dtype, *, backend: str = "auto"
    ) -> RotaryEmbedding:
        """A module whose cache holds ``max_positions`` rows of ``config``'s cos and sin, in ``dtype``."""
        module = cls.__new__(cls)
        module._init_from(config, max_positions, dtype, backend)
        return module

    def _init_from(self, config: RopeConfig, max_positions: int, dtype: torch.dtype, backend: str) -> None:
        nn.Module.__init__(self)
        self.backend = check_backend_name(backend)
        rows = check_int("max_position_embeddings", max_positions, minimum=1, expected="a positive int")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype: expected a floating-point torch.dtype, got {dtype!r}")
        self.config = config
        self.head_size, self.rotary_dim = config.head_dim, config.rotary_dim
        self.max_position_embeddings, self.base = rows, config.base
        self.is_neox_style, self.dtype = not config.interleaved, dtype
        # Length-dependent schedules (vLLM's dynamic NTK) build the cache once, for its full length.
        seq_len = rows if config.length_dependent else None
        cos, sin = config.cos_sin(rows, dtype=torch.float64, seq_len=seq_len)
        cache = torch.cat([cos, sin], dim=-1).to(dtype)  # (max_positions, rotary_dim) = [cos | sin]
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rotate query and key in place (vLLM's custom-op path) and return them."""
        cache, neox = self._cache(query), self.is_neox_style
        rotary_embedding(positions, query, key, self.head_size, cache, neox, backend=self.backend)
        return query, key

    def forward_native(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """New rotated tensors, shaped like query and key, which are not modified."""
        cache = self._cache(query)
        return apply_rope_with_cos_sin_cache(
            positions, query, key, self.head_size, cache, self.is_neox_style, backend=self.backend
        )

    def _cache(self, query: torch.Tensor) -> torch.Tensor:
        if isinstance(query, torch.Tensor) and self.cos_sin_cache.device != query.device:
            self.cos_sin_cache = self.cos_sin_cache.to(query.device)  # once: follow the queries' device
        return self.cos_sin_cache

    def get_cos_sin(self, seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of positions 0 .. seqlen - 1, each (seqlen, rotary_dim / 2), views of the cache."""
        rows = self.cos_sin_cache[:seqlen]
        return rows[:, : self.rotary_dim // 2], rows[:, self.rotary_dim // 2 :]

    def extra_repr(self) -> str:
        return (
            f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, max_position_embeddings="
            f"{self.max_position_embeddings}, base={self.base}, is_neox_style={self.is_neox_style}"
        )


# vLLM's rope types whose cache holds (length) * factor rows; yarn's length is the original one.
_GROWS_WITH_FACTOR = ("linear", "dynamic", "yarn")
_SUPPORTED = (
    "default", "linear", "dynamic", "yarn", "llama3", "deepseek_yarn", "deepseek_llama_scaling", "mllama4",
    "bailing_mrope", "xdrope", "telechat3-yarn",
)  # fmt: skip
# FoPE's keys (vLLM 0.33 reads them when rope_parameters["use_fope"] is true).
_FOPE_KEYS = ("num_key_value_heads", "num_inv_freq", "fope_sep_head", "fope_init_factor")
_ROPE_CACHE: dict[tuple, nn.Module] = {}


def _hashable(value: Any) -> Any:
    """A cache key for a parameter value, with its type: 1, 1.0 and True are equal keys but not equal
    arguments (a check may refuse one and take another)."""
    if isinstance(value, (list, tuple)):
        return type(value).__name__, tuple(_hashable(v) for v in value)
    return type(value).__name__, value


def get_rope(
    head_size: int,
    max_position: int,
    is_neox_style: bool = True,
    rope_parameters: Mapping[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    dual_chunk_attention_config: Mapping[str, Any] | None = None,
    mrope_positions_factor: int = 4,
    *,
    backend: str = "auto",
) -> nn.Module:
    """Mirrors vLLM's ``get_rope`` (the signature of vLLM 0.33): one cached module per configuration.

    ``rope_parameters`` uses HF's v5 vocabulary, as vLLM does: ``rope_theta``, ``rope_type``,
    ``partial_rotary_factor`` (rotary_dim = int(head_size * factor)) and the schedule's keys (``factor``,
    ``original_max_position_embeddings``, ``low_freq_factor``, ...). The same arguments return the same module
    object; different ones never share one. The class and cache rows follow vLLM's dispatch:

    * default / linear / dynamic (``factor``) / yarn / llama3: :class:`RotaryEmbedding`, max_position rows
      (max_position * factor for linear and dynamic, original_max_position_embeddings * factor for yarn);
      dynamic with ``alpha`` (HunYuan): NTK-alpha, max_position rows.
    * ``mrope_section`` (default or yarn), ``bailing_mrope`` (Ling / Bailing: [T, H, W], H / W alternating),
      ``xdrope`` (HunYuan-VL: ``alpha``, ``xdrope_section``):
      :class:`~ropekit.compat.vllm_variants.MRotaryEmbedding`, positions (T,) or (axes, T);
      max_position * mrope_positions_factor rows (bailing: * 4; xdrope: * 1).
    * ``use_fope``: :class:`~ropekit.compat.vllm_variants.FourierRotaryEmbedding` (its coefficients are
      parameters, loaded as vLLM loads them).
    * deepseek_yarn / deepseek_llama_scaling: YaRN whose tables carry mscale(f, mscale) /
      mscale(f, mscale_all_dim) (defaults 1 and 0); ``is_deepseek_v4``:
      :class:`~ropekit.compat.vllm_variants.DeepseekV4ScalingRotaryEmbedding`.
    * telechat3-yarn: YaRN with 0.07 ln(factor) + 1 (times ``attn_factor``) in the tables.
    * mllama4: :class:`~ropekit.compat.vllm_variants.Llama4VisionRotaryEmbedding` (max_position = patches).
    * ``dual_chunk_attention_config``: :class:`~ropekit.compat.vllm_variants.DualChunkRotaryEmbedding`.

    vLLM's older form ``get_rope(head_size, rotary_dim, max_position, base, ...)`` is not read: its third
    argument, an int, is not a bool, so such a call is a ValueError naming is_neox_style.

    ``backend`` (keyword only, ropekit's) is the module's backend for every call, and part of the cache key.

    Raises:
        ValueError: a rope_type vLLM 0.33 has and ropekit does not mirror (longrope, ntk, proportional,
            openpangu), a list of several linear factors, unknown or invalid schedule keys (from
            :class:`~ropekit.RopeConfig`), bad head_size / max_position, an is_neox_style that is not a bool,
            FoPE with is_neox_style=False or fope_sep_head=False.
    """
    if not isinstance(is_neox_style, bool):  # also before the cache: 1 == True would find a cached module
        raise ValueError(
            f"is_neox_style: expected a bool, got {describe(is_neox_style)} (the third argument of vLLM >= "
            "0.11's get_rope(head_size, max_position, is_neox_style, rope_parameters, ...); the older form "
            "with rotary_dim and base is not read: put them in rope_parameters as partial_rotary_factor "
            "and rope_theta)"
        )
    if dual_chunk_attention_config is not None and not isinstance(dual_chunk_attention_config, Mapping):
        raise ValueError(
            f"dual_chunk_attention_config: expected a dict with chunk_size and local_size or None, "
            f"got {describe(dual_chunk_attention_config)}"
        )
    if rope_parameters is not None and not isinstance(rope_parameters, Mapping):
        raise ValueError(
            f"rope_parameters: expected a dict of HF v5 RoPE parameters or None, "
            f"got {describe(rope_parameters)}"
        )
    mrope_positions_factor = check_int("mrope_positions_factor", mrope_positions_factor)
    return _cached_rope(
        head_size, max_position, is_neox_style, rope_parameters, dtype, backend, dual_chunk_attention_config,
        mrope_positions_factor,
    )  # fmt: skip


def _cached_rope(
    head_size: int,
    max_position: int,
    is_neox_style: bool,
    rope_parameters: Mapping[str, Any] | None,
    dtype: torch.dtype | None,
    backend: str = "auto",
    dual_chunk: Mapping[str, Any] | None = None,
    mrope_positions_factor: int = 4,
) -> nn.Module:
    """get_rope's work: the module for this configuration, built once.

    The arguments are checked before the cache is read, and its key holds each value's type: a value refused
    in a fresh process (16.0, True, a factor of True) is refused after an equal one (16, 1) was cached too.
    """
    head_size = check_int("head_size", head_size, minimum=1, expected="a positive int")
    max_position = check_int("max_position", max_position, minimum=1, expected="a positive int")
    backend = check_backend_name(backend)
    if dtype is None:
        dtype = torch.get_default_dtype()
    params = dict(rope_parameters or {})
    items = tuple((k, _hashable(v)) for k, v in params.items())
    chunks = None if dual_chunk is None else tuple((k, _hashable(v)) for k, v in dual_chunk.items())
    key = (head_size, max_position, is_neox_style, items, dtype, backend, chunks, mrope_positions_factor)
    try:
        hash(key)
    except TypeError:
        raise ValueError(
            f"rope_parameters: expected numbers, strings and lists of them as values, got {params!r:.120}"
        ) from None
    if key in _ROPE_CACHE:
        return _ROPE_CACHE[key]
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _SUPPORTED:
        raise ValueError(f"rope_parameters['rope_type']: expected one of {_SUPPORTED}, got {kind!r}")
    factor = params.get("factor")
    if isinstance(factor, (list, tuple)):  # vLLM's linear scaling takes a list of factors
        if len(factor) != 1:
            raise ValueError(
                f"rope_parameters['factor']: expected one number (several linear factors are not supported), "
                f"got {factor!r}"
            )
        params["factor"] = factor = factor[0]
    module = _build_rope(head_size, max_position, is_neox_style, params, kind, dtype, backend, dual_chunk,
                         mrope_positions_factor)  # fmt: skip
    _ROPE_CACHE[key] = module
    return module


def _rotary_dim(head_size: int, params: Mapping[str, Any]) -> int:
    """vLLM's rotary_dim: rope_dim when given, else int(head_size * partial_rotary_factor)."""
    if params.get("rope_dim"):
        return check_int("rope_parameters['rope_dim']", params["rope_dim"])
    partial = params.get("partial_rotary_factor", 1.0)
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0.0 < partial <= 1.0:
        raise ValueError(
            f"rope_parameters['partial_rotary_factor']: expected a number in (0, 1], got {describe(partial)}"
        )
    return int(head_size * partial)


def _build_rope(head_size, max_position, is_neox_style, params, kind, dtype, backend, dual_chunk, factor4):
    """The module vLLM's get_rope dispatch builds for these arguments (see :func:`get_rope`)."""
    from ropekit.compat import vllm_variants as v  # the variant classes sit on this module

    base = float(params.get("rope_theta", 10000.0))
    rotary_dim = _rotary_dim(head_size, params)
    interleaved = not is_neox_style
    if dual_chunk is not None:
        missing = [k for k in ("chunk_size", "local_size") if dual_chunk.get(k) is None]
        if missing:
            raise ValueError(
                f"dual_chunk_attention_config: expected chunk_size and local_size, missing {missing} "
                f"in {dict(dual_chunk)!r:.120}"
            )
        sizes = {k: dual_chunk[k] for k in ("chunk_size", "local_size")}
        return v.DualChunkRotaryEmbedding(
            head_size, rotary_dim, max_position, base, is_neox_style, dtype, **sizes, backend=backend
        )
    if kind == "mllama4":
        return v.Llama4VisionRotaryEmbedding(
            head_size, rotary_dim, max_position, base, is_neox_style, dtype, backend=backend
        )
    if kind in ("default", "yarn", "bailing_mrope", "xdrope") and (
        "mrope_section" in params or kind in ("bailing_mrope", "xdrope")
    ):
        config = v.multiaxis_config(head_size, rotary_dim, base, is_neox_style, params, kind, factor4)
        if kind == "yarn":
            rows = math.ceil(params["original_max_position_embeddings"] * factor4 * float(factor_of(params)))
        else:
            rows = max_position * {"bailing_mrope": 4, "xdrope": 1}.get(kind, factor4)
        return v.MRotaryEmbedding.from_config(config, rows, dtype, backend=backend)
    if kind == "default" and params.get("use_fope"):
        fope = {k: params[k] for k in _FOPE_KEYS if params.get(k) is not None}
        if "num_key_value_heads" not in fope:
            raise ValueError("rope_parameters['num_key_value_heads']: FoPE needs the key-value head count")
        return v.FourierRotaryEmbedding(
            head_size, rotary_dim, max_position, base, is_neox_style, dtype, **fope, backend=backend
        )
    scaling: dict[str, Any] = {"rope_type": kind}
    rows, cls = max_position, RotaryEmbedding
    if kind in ("deepseek_yarn", "deepseek_llama_scaling", "telechat3-yarn"):
        from ropekit.schedules.yarn import telechat3_attention_factor, yarn_mscale

        f, original = float(factor_of(params)), params.get("original_max_position_embeddings")
        if original is None:
            raise ValueError(
                f"rope_parameters['original_max_position_embeddings']: {kind} needs it, got none"
            )
        original = check_int("rope_parameters['original_max_position_embeddings']", original)
        if kind == "telechat3-yarn":
            attention = telechat3_attention_factor(f, params.get("attn_factor", 1.0))
            for key in ("extrapolation_factor",):
                if params.get(key, 1) != 1:
                    raise ValueError(f"rope_parameters[{key!r}]: only 1 is supported, got {params[key]!r}")
        else:
            attention = yarn_mscale(f, params.get("mscale", 1.0)) / yarn_mscale(
                f, params.get("mscale_all_dim", 0.0)
            )
        scaling = {"rope_type": "yarn", "factor": f, "original_max_position_embeddings": original}
        scaling.update({k: params[k] for k in ("beta_fast", "beta_slow", "truncate") if k in params})
        scaling["attention_factor"] = attention
        rows = math.ceil(original * f)
        if params.get("is_deepseek_v4"):
            cls = v.DeepseekV4ScalingRotaryEmbedding
        config = RopeConfig(head_size, base, rotary_dim=rotary_dim, interleaved=interleaved, scaling=scaling)
        return cls.from_config(config, rows, dtype, backend=backend)
    if kind == "dynamic" and params.get("alpha") is not None:  # HunYuan's NTK-alpha: max_position rows
        config = RopeConfig(head_size, base, rotary_dim=rotary_dim, interleaved=interleaved,
                            scaling={"rope_type": "ntk_alpha", "alpha": params["alpha"]})  # fmt: skip
        return RotaryEmbedding.from_config(config, max_position, dtype, backend=backend)
    params = {k: v for k, v in params.items() if k != "rope_dim"}  # read above, as vLLM reads it
    hf = {"head_dim": head_size, "rope_parameters": params, "max_position_embeddings": max_position}
    config = RopeConfig.from_hf(hf, interleaved=interleaved, rotary_dim=rotary_dim)
    if kind in _GROWS_WITH_FACTOR:
        length = max_position
        if kind == "yarn":
            length = params.get("original_max_position_embeddings", max_position)
        rows = math.ceil(length * float(factor_of(params)))
    return RotaryEmbedding.from_config(config, rows, dtype, backend=backend)


def factor_of(params: Mapping[str, Any]) -> float:
    """rope_parameters['factor'], which the scaling types that grow the cache need."""
    factor = params.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        raise ValueError(f"rope_parameters['factor']: expected a number, got {describe(factor)}")
    return factor


# ---- vLLM's fused QK-norm + RoPE -------------------------------------------------------------------------

_QK_NORM_NAMES = {"positions": "position_ids", "num_q_heads": "num_heads_q", "num_kv_heads": "num_heads_k"}


def fused_qk_norm_rope(
    qkv: torch.Tensor,
    num_heads_q: int,
    num_heads_k: int,
    num_heads_v: int,
    head_dim: int,
    eps: float,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    position_ids: torch.Tensor,
    *,
    backend: str = "auto",
) -> None:
    """Mirrors vLLM's ``_custom_ops.fused_qk_norm_rope`` (Qwen3's attention): in place; returns None.

    qkv is (T, (Hq + Hk + Hv) * D) laid out [q | k | v]; q and k are RMS-normalised per head with q_weight
    and k_weight (D,), then rotated with the [cos | sin] cache (P, R) at position_ids (T,); v is untouched.
    is_neox=True pairs (i, i + R/2), False pairs (2i, 2i+1). Runs :func:`ropekit.qk_norm_rotary_` with the
    Qwen3 RMSNorm (the normalised value rounded to qkv's dtype before the weight, as vLLM's ``RMSNorm`` that
    its fused kernel is tested against does). ``backend`` (keyword only, ropekit's): "auto", "torch", "cpu" or
    "triton", as for :func:`ropekit.qk_norm_rotary_`.

    Differences: vLLM's CUDA kernel keeps the norm's float32 result through the rotation, so in bfloat16 the
    two may differ by an ulp; a position outside [0, P) is a ValueError; num_heads_v must equal num_heads_k
    (the packing ropekit serves).

    Raises:
        ValueError: as :func:`ropekit.qk_norm_rotary_`, and for a cache that is not (P, R) with even
            R <= head_dim, position_ids that are not (T,), or num_heads_v != num_heads_k.
    """
    from ropekit.fused.qk_norm import qk_norm_rotary_

    check_bool("is_neox", is_neox)
    for name, value in (("num_heads_q", num_heads_q), ("num_heads_k", num_heads_k), ("head_dim", head_dim)):
        check_int(name, value, minimum=1, expected="a positive int")  # head_dim=None was a TypeError from <=
    num_heads_v = check_int("num_heads_v", num_heads_v, minimum=1, expected="a positive int")
    if num_heads_v != num_heads_k:
        raise ValueError(
            f"num_heads_v: expected num_heads_k ({num_heads_k}) value heads (ropekit packs q, k and v with "
            f"as many value as key heads), got {num_heads_v}"
        )
    c = cos_sin_cache
    if not isinstance(c, torch.Tensor) or c.dim() != 2 or c.shape[1] % 2 or not 0 < c.shape[1] <= head_dim:
        raise ValueError(
            f"cos_sin_cache: expected shape (max_position, rotary_dim) holding [cos | sin], rotary_dim even "
            f"and <= head_dim ({head_dim}), got {describe(c)}"
        )
    half = c.shape[1] // 2
    with peer_names(_QK_NORM_NAMES):
        qk_norm_rotary_(
            qkv, q_weight, k_weight, c[:, :half], c[:, half:], num_q_heads=num_heads_q,
            num_kv_heads=num_heads_k, head_dim=head_dim, eps=eps, positions=position_ids,
            interleaved=not is_neox, backend=backend,
        )  # fmt: skip


__all__ += ["fused_qk_norm_rope"]
