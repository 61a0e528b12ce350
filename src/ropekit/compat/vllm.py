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

from ropekit.compat._common import peer_names
from ropekit.config import RopeConfig
from ropekit.functional import apply_rotary, apply_rotary_qk
from ropekit.validation import check_bool, check_int, describe

__all__ = [
    "RotaryEmbedding",
    "apply_rope_with_cos_sin_cache",
    "apply_rope_with_cos_sin_cache_inplace",
    "get_rope",
    "rotary_embedding",
]

_NAMES = {"x": "query", "q": "query", "k": "key"}


def _token_heads(name: str, t: torch.Tensor, tokens: int, head_size: int) -> torch.Tensor:
    """The (1, T, H, D) view of a tensor holding T tokens of H heads of width head_size."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {describe(t)}")
    if t.dim() < 2 or t.shape[-1] % head_size or t.numel() % max(tokens * head_size, 1):
        raise ValueError(
            f"{name}: expected (num_tokens, num_heads * head_size) or (num_tokens, num_heads, head_size) "
            f"with num_tokens = {tokens} (positions) and head_size = {head_size}, got shape {tuple(t.shape)}"
        )
    try:
        return t.view(1, tokens, -1, head_size)  # (1, T, H, D)
    except RuntimeError:
        raise ValueError(
            f"{name}: its strides {t.stride()} do not allow a (num_tokens, num_heads, head_size) view, which "
            f"rotating in place needs; pass a tensor whose token and head axes can be merged"
        ) from None


def _rotate(positions, query, key, head_size, cos_sin_cache, is_neox, inplace):
    head_size = check_int("head_size", head_size, minimum=1, expected="a positive int")
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
    half = c.shape[1] // 2
    cos, sin = c[:, :half], c[:, half:]  # (P, R/2) views with row stride R
    kw = dict(positions=positions.reshape(1, tokens), interleaved=not is_neox, inplace=inplace)
    with peer_names(_NAMES):
        if k is None:
            return apply_rotary(q, cos, sin, **kw), None
        return apply_rotary_qk(q, k, cos, sin, **kw)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """Mirrors vLLM's ``_custom_ops.rotary_embedding``: rotate query and key in place; returns None.

    Raises:
        ValueError: shapes that do not hold ``positions.numel()`` tokens of head_size-wide heads, a cache that
            is not (P, R) with even R <= head_size, positions outside [0, P), a query or key whose strides
            allow no (tokens, heads, head_size) view.
    """
    _rotate(positions, query, key, head_size, cos_sin_cache, is_neox, inplace=True)


def apply_rope_with_cos_sin_cache_inplace(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    """Mirrors ``flashinfer.rope.apply_rope_with_cos_sin_cache_inplace``: as :func:`rotary_embedding`."""
    _rotate(positions, query, key, head_size, cos_sin_cache, is_neox, inplace=True)


def apply_rope_with_cos_sin_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mirrors ``flashinfer.rope.apply_rope_with_cos_sin_cache``: new rotated tensors, shaped like the inputs.

    query and key are not modified. Errors as :func:`rotary_embedding`.
    """
    q, k = _rotate(positions, query, key, head_size, cos_sin_cache, is_neox, inplace=False)
    return q.reshape(query.shape), None if k is None else k.reshape(key.shape)


class RotaryEmbedding(nn.Module):
    """Mirrors vLLM's ``RotaryEmbedding`` (``model_executor/layers/rotary_embedding/base.py``).

    Holds ``cos_sin_cache`` (max_position_embeddings, rotary_dim) in ``dtype``, as vLLM does, built from a
    :class:`~ropekit.RopeConfig` (float64 angles, then cast). :meth:`forward` rotates query and key in place
    and returns them (vLLM's CUDA path); :meth:`forward_native` returns new tensors (vLLM's reference path).
    Build it through :func:`get_rope`, or from a config with :meth:`from_config`.

    Args:
        head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype: as in vLLM.
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        dtype: torch.dtype,
    ) -> None:
        interleaved = not check_bool("is_neox_style", is_neox_style)
        config = RopeConfig(head_size, base, rotary_dim=rotary_dim, interleaved=interleaved)
        self.__init_from(config, max_position_embeddings, dtype)

    @classmethod
    def from_config(cls, config: RopeConfig, max_positions: int, dtype: torch.dtype) -> RotaryEmbedding:
        """A module whose cache holds ``max_positions`` rows of ``config``'s cos and sin, in ``dtype``."""
        module = cls.__new__(cls)
        module.__init_from(config, max_positions, dtype)
        return module

    def __init_from(self, config: RopeConfig, max_positions: int, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
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
        rotary_embedding(positions, query, key, self.head_size, self._cache(query), self.is_neox_style)
        return query, key

    def forward_native(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """New rotated tensors, shaped like query and key, which are not modified."""
        cache = self._cache(query)
        return apply_rope_with_cos_sin_cache(positions, query, key, self.head_size, cache, self.is_neox_style)

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
_SUPPORTED = ("default", "linear", "dynamic", "yarn", "llama3")
_ROPE_CACHE: dict[tuple, RotaryEmbedding] = {}


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _legacy_parameters(base: Any, rope_scaling: Any) -> dict[str, Any]:
    """vLLM's pre-0.11 base and rope_scaling as rope_parameters."""
    if rope_scaling is not None and not isinstance(rope_scaling, Mapping):
        raise ValueError(f"rope_scaling: expected a dict or None, got {describe(rope_scaling)}")
    return {**(rope_scaling or {}), "rope_theta": 10000 if base is None else base}


def get_rope(
    head_size: int,
    max_position: int,
    is_neox_style: bool = True,
    rope_parameters: Mapping[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    dual_chunk_attention_config: Mapping[str, Any] | None = None,
    *legacy: Any,
    rotary_dim: int | None = None,
    base: float | None = None,
    rope_scaling: Mapping[str, Any] | None = None,
    partial_rotary_factor: float | None = None,
) -> RotaryEmbedding:
    """Mirrors vLLM's ``get_rope`` (0.11 signature): one cached module per configuration.

    ``rope_parameters`` uses HF's v5 vocabulary, as vLLM does: ``rope_theta``, ``rope_type``,
    ``partial_rotary_factor`` (rotary_dim = int(head_size * factor)) and the schedule's keys (``factor``,
    ``original_max_position_embeddings``, ``low_freq_factor``, ...). The same arguments return the same module
    object; different ones never share one. The cache holds max_position rows (max_position * factor for
    linear and dynamic, original_max_position_embeddings * factor for yarn, as vLLM builds them).

    vLLM before 0.11 took ``get_rope(head_size, rotary_dim, max_position, base, is_neox_style=True,
    rope_scaling=None, dtype=None, partial_rotary_factor=1.0)``, the form most model code still uses. It is
    read too: a call whose third argument is an int rather than a bool, or that names rotary_dim, base,
    rope_scaling or partial_rotary_factor (rotary_dim then becomes int(rotary_dim * partial_rotary_factor)).

    Raises:
        ValueError: a rope_type other than default, linear, dynamic, yarn and llama3 (vLLM's deepseek_yarn,
            longrope, mrope and dual-chunk variants are not mapped), a list of several linear factors, unknown
            or invalid schedule keys (from :class:`~ropekit.RopeConfig`), bad head_size / max_position, or
            both argument forms at once.
    """
    if isinstance(is_neox_style, int) and not isinstance(is_neox_style, bool):
        # The pre-0.11 positional form: (head_size, rotary_dim, max_position, base, is_neox_style,
        # rope_scaling, dtype, partial_rotary_factor).
        slots = [dtype, dual_chunk_attention_config, *legacy]
        if len(slots) > 4:
            raise ValueError(f"get_rope: expected at most 8 positional arguments, got {4 + len(slots)}")
        neox, rope_scaling, dtype, partial_rotary_factor = [*slots, None, None, None, None][:4]
        rotary_dim, max_position, base = max_position, is_neox_style, rope_parameters
        is_neox_style = True if neox is None else neox
        rope_parameters, dual_chunk_attention_config = _legacy_parameters(base, rope_scaling), None
    elif legacy:
        raise ValueError(f"get_rope: expected at most 6 positional arguments, got {6 + len(legacy)}")
    elif rotary_dim is not None or base is not None or rope_scaling is not None or partial_rotary_factor:
        if rope_parameters is not None:
            raise ValueError(
                "rope_parameters: pass it or the older rotary_dim / base / rope_scaling, not both"
            )
        rope_parameters = _legacy_parameters(base, rope_scaling)
    if rotary_dim is not None:
        rotary_dim = check_int("rotary_dim", rotary_dim, minimum=1, expected="a positive int")
        if partial_rotary_factor is not None:
            rotary_dim = int(rotary_dim * partial_rotary_factor)
    if dual_chunk_attention_config is not None:
        raise ValueError("dual_chunk_attention_config: dual-chunk attention is not supported; expected None")
    return _cached_rope(head_size, max_position, is_neox_style, rope_parameters, dtype, rotary_dim)


def _cached_rope(
    head_size: int,
    max_position: int,
    is_neox_style: bool,
    rope_parameters: Mapping[str, Any] | None,
    dtype: torch.dtype | None,
    rotary_dim: int | None,
) -> RotaryEmbedding:
    """get_rope's work, one argument form: the module for this configuration, built once."""
    if dtype is None:
        dtype = torch.get_default_dtype()
    params = dict(rope_parameters or {})
    items = tuple((k, _hashable(v)) for k, v in params.items())
    key = (head_size, max_position, is_neox_style, items, dtype, rotary_dim)
    try:
        hash(key)
    except TypeError:
        raise ValueError(
            f"rope_parameters: expected numbers, strings and lists of them as values, got {params!r:.120}"
        ) from None
    if key in _ROPE_CACHE:
        return _ROPE_CACHE[key]
    head_size = check_int("head_size", head_size, minimum=1, expected="a positive int")
    max_position = check_int("max_position", max_position, minimum=1, expected="a positive int")
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
    hf = {"head_dim": head_size, "rope_parameters": params, "max_position_embeddings": max_position}
    if rotary_dim is not None:
        hf["rotary_dim"] = rotary_dim  # read as GPT-J's config key: it wins over partial_rotary_factor
    config = RopeConfig.from_hf(hf, interleaved=not check_bool("is_neox_style", is_neox_style))
    rows = max_position
    if kind in _GROWS_WITH_FACTOR:
        length = max_position
        if kind == "yarn":
            length = params.get("original_max_position_embeddings", max_position)
        rows = math.ceil(length * float(factor))
    module = RotaryEmbedding.from_config(config, rows, dtype)
    _ROPE_CACHE[key] = module
    return module


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
) -> None:
    """Mirrors vLLM's ``_custom_ops.fused_qk_norm_rope`` (Qwen3's attention): in place; returns None.

    qkv is (T, (Hq + Hk + Hv) * D) laid out [q | k | v]; q and k are RMS-normalised per head with q_weight
    and k_weight (D,), then rotated with the [cos | sin] cache (P, R) at position_ids (T,); v is untouched.
    is_neox=True pairs (i, i + R/2), False pairs (2i, 2i+1). Runs :func:`ropekit.qk_norm_rotary_` with the
    Qwen3 RMSNorm (the normalised value rounded to qkv's dtype before the weight, as vLLM's ``RMSNorm`` that
    its fused kernel is tested against does).

    Differences: vLLM's CUDA kernel keeps the norm's float32 result through the rotation, so in bfloat16 the
    two may differ by an ulp; a position outside [0, P) is a ValueError; num_heads_v must equal num_heads_k
    (the packing ropekit serves).

    Raises:
        ValueError: as :func:`ropekit.qk_norm_rotary_`, and for a cache that is not (P, R) with even
            R <= head_dim, position_ids that are not (T,), or num_heads_v != num_heads_k.
    """
    from ropekit.fused.qk_norm import qk_norm_rotary_

    check_bool("is_neox", is_neox)
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
            interleaved=not is_neox,
        )  # fmt: skip


__all__ += ["fused_qk_norm_rope"]
