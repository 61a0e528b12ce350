"""vLLM's rotary classes beyond the plain rotation, on ropekit's tables and kernels.

Each class mirrors one of ``vllm/model_executor/layers/rotary_embedding/`` (vLLM 0.33 unless named): its
``cos_sin_cache`` has vLLM's shape and layout, and ``forward`` / ``forward_native`` take vLLM's arguments.
Tables are formed in float64 (:class:`~ropekit.RopeConfig`) and cast once; the rotation runs on ropekit's
backends (torch, C, Triton), which serve every class here because each is a rotation by per-token tables:
only which row a token reads, and which angle each pair takes, differ.

==================================  ======================================================================
class                               what is new
==================================  ======================================================================
:class:`MRotaryEmbedding`           positions (axes, T): pair j takes the angle of axis ``axis_of_pair[j]``
                                    (Qwen2/2.5/3-VL M-RoPE, chunked or interleaved; ``bailing_mrope``:
                                    H / W alternating, then T; ``xdrope``: HunYuan-VL's four sections on
                                    NTK-alpha frequencies, vLLM 0.11's ``XDRotaryEmbedding``)
:class:`FourierRotaryEmbedding`     FoPE: per key-value head, learned mixtures of the Fourier basis
                                    (``cos_coef`` / ``sin_coef``); not a rotation, rows padded with 1
:class:`DualChunkRotaryEmbedding`   keys at p mod chunk_len, the query once per dual-chunk role
:class:`DeepseekV4ScalingRotaryEmbedding`  the trailing rotary_dim features, ``inverse=True`` de-rotates
:class:`Llama4VisionRotaryEmbedding`  Llama 4's vision patches: column and row axes, class token last
==================================  ======================================================================

Shape notation: T tokens, H / Hk query / key heads, D head_size, R rotary_dim, P cache rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ropekit.compat.vllm import RotaryEmbedding, _halves, _token_heads
from ropekit.config import RopeConfig
from ropekit.functional import apply_rotary, apply_rotary_qk
from ropekit.multiaxis import llama4_vision_positions
from ropekit.schedules import mrope_axis_of_pair
from ropekit.validation import check_bool, check_int, describe

__all__ = [
    "DeepseekV4ScalingRotaryEmbedding",
    "DualChunkRotaryEmbedding",
    "FourierRotaryEmbedding",
    "Llama4VisionRotaryEmbedding",
    "MRotaryEmbedding",
]


def _check_rows(name: str, positions: torch.Tensor, rows: int) -> None:
    """Positions must index the cache: a ValueError here, never an IndexError (or a device assert)."""
    if not isinstance(positions, torch.Tensor) or positions.is_floating_point() or positions.is_complex():
        raise ValueError(f"{name}: expected an integer tensor, got {describe(positions)}")
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= rows):
        raise ValueError(
            f"{name}: expected positions in [0, {rows}) (the cache's rows), got values in "
            f"[{int(positions.min())}, {int(positions.max())}]"
        )


def check_patch_tokens(name: str, t: Any, tokens: int, head_size: int) -> None:
    """Llama 4 vision's query / key: (batch, tokens, heads, head_size), one row per patch and the class token.

    vLLM's ``forward_native`` views its cache as (1, tokens, 1, head_size / 2) against the query, so any other
    token count or head width fails there; the rotation would otherwise read the first rows of a longer
    table silently. Shared by :class:`Llama4VisionRotaryEmbedding` and the vLLM plugin's class.
    """
    if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[1] != tokens or t.shape[-1] != head_size:
        raise ValueError(
            f"{name}: expected (batch, {tokens} tokens, heads, {head_size}) (the {tokens - 1} patches and "
            f"the class token), got {describe(t)}"
        )


class MRotaryEmbedding(RotaryEmbedding):
    """Mirrors vLLM's ``MRotaryEmbedding``, ``BailingMRotaryEmbedding`` and ``XDRotaryEmbedding``.

    ``positions`` is (T,) for text (a plain rotation) or (axes, T) with one row per position axis, in the
    order of ``config.mrope_section``'s axes (t, h, w; XD-RoPE: its four sections' axes). Pair j of the
    cache row takes the angle of axis ``axis_of_pair[j]`` (:func:`ropekit.schedules.mrope_axis_of_pair`),
    exactly vLLM's split of the gathered rows. Build it through :func:`ropekit.compat.vllm.get_rope`.
    """

    def _init_from(self, config: RopeConfig, max_positions: int, dtype: torch.dtype, backend: str) -> None:
        if config.mrope_section is None:
            raise ValueError(f"config: expected an M-RoPE config (mrope_section), got {config!r}")
        super()._init_from(config, max_positions, dtype, backend)
        self.mrope_section = list(config.mrope_section)
        self.axis_of_pair = mrope_axis_of_pair(config.mrope_section, config.mrope_layout)  # (R/2,)

    def token_tables(self, positions: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (T, R/2): every pair's value at the position of its own axis."""
        axes = len(self.mrope_section)
        if positions.dim() != 2 or positions.shape[0] != axes:
            raise ValueError(
                f"positions: expected (num_tokens,) or ({axes}, num_tokens) for {axes} position axes, "
                f"got {describe(positions)}"
            )
        _check_rows("positions", positions, cache.shape[0])
        cos, sin = _halves(cache)  # (P, R/2) each
        axis = self.axis_of_pair.to(positions.device)
        # (T, R/2): the row each token's pair j reads, laid out by token so that the gathered rows are too
        # (a kernel reads unit-stride rows: a launch plan takes them as they are)
        rows = positions.T[:, axis]
        pair = torch.arange(axis.shape[0], device=positions.device)
        return cos[rows, pair], sin[rows, pair]

    def _multiaxis(self, positions, query, key, inplace):
        cache = self._cache(query)
        tokens = positions.shape[-1]
        cos, sin = self.token_tables(positions, cache)
        q = _token_heads("query", query, tokens, self.head_size)  # (1, T, H, D)
        opts = dict(per_token=True, interleaved=not self.is_neox_style, inplace=inplace, backend=self.backend)
        if key is None:
            return apply_rotary(q, cos, sin, **opts).reshape(query.shape), None
        k = _token_heads("key", key, tokens, self.head_size)
        q, k = apply_rotary_qk(q, k, cos, sin, **opts)
        return q.reshape(query.shape), k.reshape(key.shape)

    def forward(self, positions, query, key=None):
        """Rotate query and key in place and return them; positions (T,) or (axes, T)."""
        if isinstance(positions, torch.Tensor) and positions.dim() == 2:
            self._multiaxis(positions, query, key, True)
            return query, key
        return super().forward(positions, query, key)

    def forward_native(self, positions, query, key=None):
        """New rotated tensors, shaped like query and key; positions (T,) or (axes, T)."""
        if isinstance(positions, torch.Tensor) and positions.dim() == 2:
            return self._multiaxis(positions, query, key, False)
        return super().forward_native(positions, query, key)


class FourierRotaryEmbedding(RotaryEmbedding):
    """Mirrors vLLM 0.33's ``FourierRotaryEmbedding`` (FoPE, ``rope_parameters["use_fope"]``; InternS1-Pro).

    Frequencies theta_i = base^(-2i / R) keep the first ``num_inv_freq`` (or, when None, those above
    2 pi / max_position_embeddings); F of them. Key-value head h mixes the Fourier basis with its learned
    (F, F) coefficients: cos'[p, h] = cos(p theta) @ cos_coef[h], sin'[p, h] = sin(p theta) @ sin_coef[h],
    padded with 1 to D/2 entries (:func:`ropekit.reference.fope_tables`). Query head i uses key-value head
    i // (H / Hk); every pair (i, i + D/2) of the whole head becomes (a cos' - b sin', b cos' + a sin'), so
    the features past R are mixed by the padding, as in vLLM.

    ``cos_sin_cache`` is (P, Hk, 2 D) = [cos' cos' | sin' sin'] per head, as vLLM's. The coefficients are
    parameters (``weight_loader`` as vLLM's, for one shard); the cache is rebuilt on the first forward after
    they change (vLLM builds it once, on its first forward).

    Differences: ``is_neox_style=False`` and ``fope_sep_head=False`` are ValueErrors (vLLM pairs halves
    whatever is_neox_style says; with fope_sep_head False its einsum cannot take its own (Hk, F, F)
    coefficients); ``key=None`` is a ValueError, as vLLM's assert.
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        dtype: torch.dtype,
        init_cache: bool = False,
        *,
        num_key_value_heads: int,
        num_inv_freq: int | None = None,
        fope_sep_head: bool = True,
        fope_init_factor: float | None = None,
        backend: str = "auto",
    ) -> None:
        if not check_bool("is_neox_style", is_neox_style):
            raise ValueError(
                "is_neox_style: FoPE pairs the halves (i, i + head_size/2) whatever is_neox_style says; "
                "expected True"
            )
        if not check_bool("fope_sep_head", fope_sep_head):
            raise ValueError(
                "fope_sep_head: expected True (per key-value head coefficients; vLLM's shared-coefficient "
                "form cannot take its own (num_key_value_heads, F, F) parameters)"
            )
        config = RopeConfig(head_size, base, rotary_dim=rotary_dim)
        self._init_from(config, max_position_embeddings, dtype, backend)
        self.num_key_value_heads = check_int("num_key_value_heads", num_key_value_heads)
        self.fope_sep_head, self.fope_init_factor = True, fope_init_factor
        inv_freq = config.inv_freq()  # (R/2,) float64
        if num_inv_freq is None:  # vLLM keeps the frequencies that turn at least once over the context
            keep = inv_freq.to(torch.float32) > 2.0 * math.pi / max_position_embeddings
            inv_freq = inv_freq[keep]
        else:
            inv_freq = inv_freq[: check_int("num_inv_freq", num_inv_freq)]
        self.num_inv_freq = num_inv_freq
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        f = inv_freq.shape[0]
        self.input_dim = self.output_dim = f
        self.cos_coef = nn.Parameter(torch.zeros(self.num_key_value_heads, f, f), requires_grad=False)
        self.sin_coef = nn.Parameter(torch.zeros(self.num_key_value_heads, f, f), requires_grad=False)
        self.cos_coef.weight_loader = self.weight_loader
        self.sin_coef.weight_loader = self.weight_loader
        self.cos_sin_cache = self._fope_cache()
        self._built_for = self._coef_versions()

    def _coef_versions(self) -> tuple[int, int]:
        return self.cos_coef._version, self.sin_coef._version

    def _fope_cache(self) -> torch.Tensor:
        """(P, Hk, 2 D): [cos' cos' | sin' sin'] per key-value head, formed in float64."""
        positions = torch.arange(self.max_position_embeddings, dtype=torch.float64)
        angle = positions[:, None] * self.inv_freq.to(torch.float64).cpu()  # (P, F)
        cos = torch.einsum("pf,hfd->phd", angle.cos(), self.cos_coef.detach().cpu().double())  # (P, Hk, F)
        sin = torch.einsum("pf,hfd->phd", angle.sin(), self.sin_coef.detach().cpu().double())
        pad = (0, self.head_size // 2 - cos.shape[-1])
        cos, sin = nn.functional.pad(cos, pad, value=1.0), nn.functional.pad(sin, pad, value=1.0)
        cache = torch.cat([cos, cos, sin, sin], dim=-1)  # (P, Hk, 2 D)
        return cache.to(self.dtype).to(self.cos_coef.device)

    # The tensor-parallel shard this module holds (vLLM reads its process groups; a plugin sets these).
    tp_rank, tp_size = 0, 1

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this shard's key-value heads of a checkpoint's (total Hk, F, F) coefficients (vLLM's rule:
        heads split evenly over tp_size shards, replicated when there are fewer heads than shards).

        Raises:
            ValueError: for a loaded_weight whose shard is not the parameter's (Hk, F, F); nothing is written.
        """
        want = tuple(param.shape)  # (Hk, F, F): this shard's heads
        shard = None
        if isinstance(loaded_weight, torch.Tensor) and loaded_weight.dim() == 3 and loaded_weight.size(0):
            rank, world, heads = self.tp_rank, self.tp_size, loaded_weight.size(0)
            if heads < world:
                rank, world = rank // (world // heads), heads
            chunks = loaded_weight.chunk(world, dim=0)
            shard = chunks[rank] if rank < len(chunks) else None
        if shard is None or tuple(shard.shape) != want:
            raise ValueError(
                f"loaded_weight: expected (num_key_value_heads, {want[1]}, {want[2]}) coefficients whose "
                f"shard {self.tp_rank} of {self.tp_size} is this module's {want}, "
                f"got {describe(loaded_weight)}"
            )
        param.data.copy_(shard)
        self._built_for = None  # .data writes leave the version counter alone: rebuild on the next call

    def _cache(self, query: torch.Tensor) -> torch.Tensor:
        if self._coef_versions() != self._built_for:
            self.cos_sin_cache = self._fope_cache()
            self._built_for = self._coef_versions()
        return super()._cache(query)

    def _fope(self, positions, query, key, inplace):
        if key is None:
            raise ValueError("key: FoPE rotates queries and keys together; expected a tensor, got None")
        cache = self._cache(query)  # (P, Hk, 2 D)
        tokens, kv_heads, d = positions.numel(), self.num_key_value_heads, self.head_size
        q = _token_heads("query", query, tokens, d)  # (1, T, H, D)
        k = _token_heads("key", key, tokens, d)  # (1, T, Hk, D)
        if q.shape[2] % kv_heads or k.shape[2] != kv_heads:
            raise ValueError(
                f"key: expected {kv_heads} key-value heads (num_key_value_heads) and a query head count "
                f"divisible by it, got {k.shape[2]} and {q.shape[2]}"
            )
        _check_rows("positions", positions, cache.shape[0])
        # Each (token, key-value head) is a row of its own: row p * Hk + h of the (P * Hk, D / 2) halves.
        flat = cache.reshape(-1, 2 * d)  # (P * Hk, 2 D)
        cos, sin = flat[:, : d // 2], flat[:, d : d + d // 2]  # views, row stride 2 D
        rows = positions.reshape(tokens, 1).to(torch.int64) * kv_heads + torch.arange(
            kv_heads, device=q.device
        )
        q_rows = q.reshape(1, tokens * kv_heads, -1, d)  # (1, T * Hk, H / Hk, D): query heads by group
        k_rows = k.reshape(1, tokens * kv_heads, 1, d)  # (1, T * Hk, 1, D)
        q_out, k_out = apply_rotary_qk(
            q_rows, k_rows, cos, sin, positions=rows.reshape(1, -1), inplace=inplace, backend=self.backend
        )
        return q_out.reshape(query.shape), k_out.reshape(key.shape)

    def forward(self, positions, query, key=None):
        """Apply FoPE to query and key in place and return them."""
        self._fope(positions, query, key, True)
        return query, key

    def forward_native(self, positions, query, key=None):
        """New tensors, shaped like query and key, which are not modified."""
        return self._fope(positions, query, key, False)

    def get_cos_sin(self, seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise ValueError("seqlen: FoPE's tables are per key-value head; read cos_sin_cache (P, Hk, 2 D)")


class DeepseekV4ScalingRotaryEmbedding(RotaryEmbedding):
    """Mirrors vLLM's ``DeepseekV4ScalingRotaryEmbedding``: DeepSeek YaRN on the *trailing* rotary_dim.

    The cache stays float32 whatever ``dtype`` says, as vLLM keeps it; ``forward(..., inverse=True)``
    rotates by -theta, which DeepSeek-V4 applies to the attention output (:mod:`ropekit.shared_kv`), and
    ``key`` may be None (query only).
    """

    def _init_from(self, config: RopeConfig, max_positions: int, dtype: torch.dtype, backend: str) -> None:
        super()._init_from(config, max_positions, torch.float32, backend)
        self.dtype = dtype

    def _rotate(self, positions, query, key, offsets, inverse, inplace):
        if offsets is not None:
            positions = positions + offsets
        tokens = positions.numel()
        q = _token_heads("query", query, tokens, query.shape[-1])  # (1, T, H, D)
        cos, sin = _halves(self._cache(query))
        rows = positions.reshape(1, tokens)
        opts = dict(positions=rows, interleaved=not self.is_neox_style, inplace=inplace, inverse=inverse)
        opts.update(rotary_position="last", backend=self.backend)
        if key is None:
            return apply_rotary(q, cos, sin, **opts).reshape(query.shape), None
        k = _token_heads("key", key, tokens, key.shape[-1])
        q, k = apply_rotary_qk(q, k, cos, sin, **opts)
        return q.reshape(query.shape), k.reshape(key.shape)

    def forward(self, positions, query, key=None, offsets=None, inverse=False):
        """Rotate in place (by -theta with inverse=True) and return query and key."""
        self._rotate(positions, query, key, offsets, check_bool("inverse", inverse), True)
        return query, key

    def forward_native(self, positions, query, key=None, offsets=None, inverse=False):
        """New rotated tensors; query and key are not modified."""
        return self._rotate(positions, query, key, offsets, check_bool("inverse", inverse), False)


class DualChunkRotaryEmbedding(nn.Module):
    """Mirrors vLLM's ``DualChunkRotaryEmbedding`` (Qwen2.5-1M): keys at p mod chunk_len, five query roles.

    Holds vLLM's five caches (``cos_sin_q_cache``, ``cos_sin_qc_cache``, ``cos_sin_k_cache``,
    ``cos_sin_qc_no_clamp_cache``, ``cos_sin_q_inter_cache``), each [cos | sin] rows in ``dtype``, formed in
    float64. :meth:`forward_native` returns (query rotated for the roles intra, succ, inter, succ_critical and
    inter_critical, concatenated on the last axis: (T, 5 * H * D); key (T, Hk * D)), as vLLM's; the role
    positions are :func:`ropekit.schedules.dual_chunk_positions`. Unlike vLLM's, it is built on any device.
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        dtype: torch.dtype,
        chunk_size: int,
        local_size: int,
        *,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        scaling = {"rope_type": "dual_chunk", "chunk_size": chunk_size, "local_size": local_size}
        interleaved = not check_bool("is_neox_style", is_neox_style)
        self.config = RopeConfig(
            head_size, base, rotary_dim=rotary_dim, interleaved=interleaved, scaling=scaling
        )
        self.head_size, self.rotary_dim, self.base = head_size, rotary_dim, self.config.base
        self.max_position_embeddings = check_int("max_position_embeddings", max_position_embeddings)
        self.is_neox_style, self.dtype, self.backend = is_neox_style, dtype, backend
        self.chunk_size, self.local_size = chunk_size, local_size
        chunk_len = chunk_size - local_size
        within = torch.arange(chunk_len)
        rows = {
            "cos_sin_q_cache": within,
            "cos_sin_qc_cache": (within + chunk_len).clamp(max=chunk_size),
            "cos_sin_k_cache": torch.arange(self.max_position_embeddings) % chunk_len,
            "cos_sin_qc_no_clamp_cache": within + chunk_len,
            "cos_sin_q_inter_cache": within + chunk_size,
        }
        for name, pos in rows.items():
            cos, sin = self.config.cos_sin(pos, dtype=torch.float64)
            self.register_buffer(name, torch.cat([cos, sin], dim=-1).to(dtype), persistent=False)

    def forward_native(self, positions, query, key, offsets=None):
        """(query for the five roles, concatenated: (T, 5 * H * D); rotated key (T, Hk * D))."""
        if offsets is not None:
            positions = positions + offsets
        tokens, chunk_len = positions.numel(), self.chunk_size - self.local_size
        _check_rows("positions", positions, self.max_position_embeddings)
        q = _token_heads("query", query, tokens, self.head_size)  # (1, T, H, D)
        k = _token_heads("key", key, tokens, self.head_size)
        flat = positions.reshape(1, tokens).to(torch.int64)
        within = flat % chunk_len
        opts = dict(interleaved=not self.is_neox_style, backend=self.backend)
        key_out = apply_rotary(k, *_halves(self.cos_sin_k_cache), positions=flat, **opts)
        roles = (
            (self.cos_sin_q_cache, within),
            (self.cos_sin_qc_cache, within),
            (self.cos_sin_qc_cache, torch.full_like(within, chunk_len - 1)),
            (self.cos_sin_qc_no_clamp_cache, within),
            (self.cos_sin_q_inter_cache, within),
        )
        queries = [apply_rotary(q, *_halves(c), positions=p, **opts).reshape(tokens, -1) for c, p in roles]
        return torch.cat(queries, dim=-1), key_out.reshape(tokens, -1)

    forward = forward_native

    def extra_repr(self) -> str:
        return (
            f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, max_position_embeddings="
            f"{self.max_position_embeddings}, base={self.base}, is_neox_style={self.is_neox_style}, "
            f"chunk_size={self.chunk_size}, local_size={self.local_size}"
        )


class Llama4VisionRotaryEmbedding(nn.Module):
    """Mirrors vLLM's ``Llama4VisionRotaryEmbedding`` (``rope_type "mllama4"``): 2-D patches, class token.

    ``max_position_embeddings`` is the number of patches N (a square, side^2); ``rotary_dim`` is vLLM's
    (head_size * partial_rotary_factor, 0.5 in its vision encoder): the first R/2 interleaved pairs turn by
    (column + 1) theta_i, the next R/2 by (row + 1) theta_i, theta_i = base^(-2i / R), and the class token
    (the last of the N + 1) does not turn (RopeConfig's "axial" schedule, positions
    :func:`ropekit.multiaxis.llama4_vision_positions`). ``cos_sin_cache`` is vLLM's complex (N + 1, 1, R)
    table e^{i angle}; ``forward(query, key)`` takes (B, N + 1, H, D) and returns new tensors.
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
        super().__init__()
        patches = check_int("max_position_embeddings", max_position_embeddings)
        side = math.isqrt(patches)
        if side * side != patches:
            raise ValueError(
                f"max_position_embeddings: expected the patch count of a square image, side^2, got {patches}"
            )
        if rotary_dim % 2 or 2 * rotary_dim != head_size:
            raise ValueError(
                f"rotary_dim: expected head_size / 2 ({head_size // 2}, vLLM's partial_rotary_factor 0.5), "
                f"even, got {rotary_dim}"
            )
        half = rotary_dim // 2
        scaling = {"rope_type": "axial", "mrope_section": [half, half]}
        self.config = RopeConfig(head_size, base, interleaved=True, scaling=scaling)
        self.head_size, self.rotary_dim, self.max_position_embeddings = head_size, rotary_dim, patches
        self.base, self.is_neox_style, self.dtype, self.backend = (
            self.config.base,
            is_neox_style,
            dtype,
            backend,
        )
        positions = llama4_vision_positions(side, 1)[:, None]  # (2, 1, N + 1): column + 1, row + 1
        cos, sin = self.config.cos_sin(positions, dtype=torch.float64)  # (1, N + 1, R)
        self.register_buffer("cos", cos[0].float(), persistent=False)
        self.register_buffer("sin", sin[0].float(), persistent=False)

    @property
    def cos_sin_cache(self) -> torch.Tensor:
        """vLLM's form: complex64 (N + 1, 1, R), e^{i angle} per pair."""
        return torch.complex(self.cos, self.sin)[:, None]

    def forward(self, query, key=None):
        """(query, key) rotated: (B, N + 1, H, D) each; new tensors."""
        if key is None:
            raise ValueError("key: expected a tensor (vLLM's Llama 4 vision RoPE rotates both), got None")
        for name, t in (("query", query), ("key", key)):
            check_patch_tokens(name, t, self.cos.shape[0], self.head_size)
        cos, sin = self.cos.to(query.device), self.sin.to(query.device)
        return apply_rotary_qk(query, key, cos, sin, interleaved=True, backend=self.backend)

    forward_native = forward


def multiaxis_config(
    head_size: int,
    rotary_dim: int,
    base: float,
    is_neox_style: bool,
    params: Mapping[str, Any],
    kind: str,
    positions_factor: int = 4,
) -> RopeConfig:
    """The RopeConfig of vLLM's M-RoPE family members: ``"default"`` / ``"yarn"`` with mrope_section,
    ``"bailing_mrope"`` ([T, H, W], H == W: H / W alternate, T last, ropekit's "ernie" layout) and
    ``"xdrope"`` (``alpha`` + ``xdrope_section``: NTK-alpha frequencies, chunked sections). With yarn, the
    ramp's length is original_max_position_embeddings * positions_factor, as in vLLM."""
    section = params.get("xdrope_section" if kind == "xdrope" else "mrope_section")
    if not isinstance(section, Sequence) or isinstance(section, str):
        key = "xdrope_section" if kind == "xdrope" else "mrope_section"
        raise ValueError(
            f"rope_parameters[{key!r}]: expected a list of section sizes, got {describe(section)}"
        )
    section = list(section)
    if kind == "bailing_mrope":
        if len(section) != 3 or section[1] != section[2]:
            raise ValueError(
                f"rope_parameters['mrope_section']: Bailing M-RoPE expects [T, H, W], H == W, got {section}"
            )
        scaling = {"mrope_section": [section[1], section[2], section[0]], "mrope_layout": "ernie"}
    elif kind == "xdrope":
        scaling = {"rope_type": "ntk_alpha", "alpha": params.get("alpha"), "mrope_section": section}
    else:
        scaling = {
            "mrope_section": section,
            "mrope_interleaved": bool(params.get("mrope_interleaved", False)),
        }
        if kind == "yarn":
            keys = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale")
            keys += ("mscale_all_dim", "attention_factor", "truncate")
            scaling.update({"rope_type": "yarn", **{k: params[k] for k in keys if k in params}})
            # vLLM's MRotaryEmbedding hands YaRN its enlarged cache length (original * positions_factor) as
            # the length its ramp is measured against; Hugging Face's YaRN uses the original length.
            original = params.get("original_max_position_embeddings")
            if isinstance(original, int) and not isinstance(original, bool):
                scaling["original_max_position_embeddings"] = original * positions_factor
    return RopeConfig(head_size, base, rotary_dim=rotary_dim, interleaved=not is_neox_style, scaling=scaling)
