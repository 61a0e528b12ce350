"""flash-attn's rotary functions (``flash_attn.layers.rotary``, flash-attn 2.8) on the ropekit core.

Migration: ``from flash_attn.layers.rotary import apply_rotary_emb`` (or ``RotaryEmbedding``) becomes
``from ropekit.compat.flash_attn import apply_rotary_emb``; the calls stay as they are. Every function and
the module also take ropekit's ``backend=`` (keyword only).

Shape notation: B batch, S sequence, T packed tokens, H heads, D head_dim, R rotary_dim, L table rows
(flash-attn's seqlen_ro). Tables are flash-attn's: cos, sin of shape (L, R/2), row p for position p.

Pairing: interleaved=False rotates features (i, i + R/2) together (GPT-NeoX style); interleaved=True rotates
(2i, 2i+1) (GPT-J style). Features past R pass through unchanged.

Same semantics as flash-attn: which tensor is written (``apply_rotary_emb(inplace=True)``, ``*_qkv_``,
``*_kv_`` write into their input and return it; nothing else is modified), the positions
(``seqlen_offsets`` + index within the sequence; each packed sequence starts at 0), and the gradients (the
in-place functions train, the input may be a leaf that requires grad). Differences, all where flash-attn
asserts or reads past its table:

- A position past the table is a ValueError. flash-attn asserts for an int offset, and for a tensor of offsets
  rotates those tokens by the identity (its masked load returns cos = 1, sin = 0).
- x and the tables may have different dtypes (flash-attn asserts they match); math runs in float32.
- head_dim is not limited to 256, and ``max_seqlen`` is accepted but not needed (cu_seqlens says it all).
- In-place calls leave the incoming gradient as it is in backward (flash-attn rotates it in place).
"""

from __future__ import annotations

import torch
from torch import nn

from ropekit.compat._common import check_backend_name, in_place, peer_names
from ropekit.config import RopeConfig
from ropekit.functional import apply_rotary, apply_rotary_qk
from ropekit.multiaxis import xpos_cos_sin
from ropekit.validation import check_bool, check_int, check_positive, describe

__all__ = ["RotaryEmbedding", "apply_rotary_emb", "apply_rotary_emb_kv_", "apply_rotary_emb_qkv_"]

_NAMES = {"offsets": "seqlen_offsets"}


def _flip(sin: torch.Tensor, conjugate: bool) -> torch.Tensor:
    return -sin if conjugate else sin  # R(-theta): the backward pass (docs/math.md)


def apply_rotary_emb(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    inplace: bool = False,
    seqlen_offsets: int | torch.Tensor = 0,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Mirrors ``flash_attn.layers.rotary.apply_rotary_emb``: rotate the first R features of x.

    Args:
        x: (B, S, H, D), or (T, H, D) when cu_seqlens is given.
        cos, sin: (L, R/2) tables, R <= D.
        interleaved: pairing (module docstring).
        inplace: write into x and return it.
        seqlen_offsets: int, or a (B,) integer tensor (one per packed sequence with cu_seqlens): each
            sequence's positions start there (KV-cache decoding).
        cu_seqlens: (B + 1,) int32 cumulative lengths of a packed batch.
        max_seqlen: accepted for flash-attn's signature; not needed.
        backend: ropekit's backend ("auto", "torch", "cpu" or "triton"), keyword only.

    Returns:
        The rotated tensor, shaped like x (x itself when inplace).

    Raises:
        ValueError: wrong shapes or dtypes, positions past the table, malformed cu_seqlens (see
            :func:`ropekit.apply_rotary`), a max_seqlen that is not a positive int.
    """
    if max_seqlen is not None:
        check_int("max_seqlen", max_seqlen, minimum=1, expected="a positive int or None")
    kw = dict(offsets=seqlen_offsets, cu_seqlens=cu_seqlens, interleaved=interleaved, backend=backend)
    with peer_names(_NAMES):
        if not check_bool("inplace", inplace):
            return apply_rotary(x, cos, sin, **kw)
        return in_place(x, lambda t, conj: apply_rotary(t, cos, _flip(sin, conj), **kw, inplace=True))


def _qkv_heads(t: torch.Tensor, num_heads_q: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the q and k heads of a packed (B, S, 3, H, D) or (B, S, Hq + 2 Hk, D) tensor."""
    if t.dim() == 5:
        return t[:, :, 0], t[:, :, 1]  # (B, S, H, D) each
    return t[:, :, :num_heads_q], t[:, :, num_heads_q : (t.shape[2] + num_heads_q) // 2]


def _check_packed(name: str, t: object, count: int, num_heads_q: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {describe(t)}")
    if t.dim() == 5:
        if t.shape[2] != count:
            raise ValueError(
                f"{name}: expected shape (batch, seq, {count}, heads, head_dim), got {tuple(t.shape)}"
            )
        return
    if count == 3 and t.dim() == 4:
        if num_heads_q is None:
            raise ValueError(
                f"num_heads_q: expected an int for a 4-D qkv (batch, seq, num_heads_q + 2 * num_heads_k, "
                f"head_dim) {tuple(t.shape)}, got None"
            )
        check_int("num_heads_q", num_heads_q, minimum=1, expected="a positive int")
        k_heads, odd = divmod(t.shape[2] - num_heads_q, 2)
        if odd or k_heads < 1:
            raise ValueError(
                f"num_heads_q: {num_heads_q} leaves {t.shape[2] - num_heads_q} of qkv's {t.shape[2]} heads, "
                f"expected a positive even number (num_heads_k heads of k, then of v)"
            )
        return
    want = "(batch, seq, 3, heads, head_dim) or (batch, seq, num_heads_q + 2 * num_heads_k, head_dim)"
    if count == 2:
        want = "(batch, seq, 2, heads, head_dim)"
    raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")


def apply_rotary_emb_qkv_(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cos_k: torch.Tensor | None = None,
    sin_k: torch.Tensor | None = None,
    interleaved: bool = False,
    seqlen_offsets: int | torch.Tensor = 0,
    num_heads_q: int | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Mirrors ``flash_attn.layers.rotary.apply_rotary_emb_qkv_``: rotate q and k of a packed qkv in place.

    Args:
        qkv: (B, S, 3, H, D), or (B, S, Hq + 2 Hk, D) for GQA / MQA with num_heads_q = Hq (q heads first,
            then k, then v). v is never touched.
        cos, sin: (L, R/2) tables for q (and k, unless cos_k / sin_k are given).
        cos_k, sin_k: optional (L, R/2) tables for k (each defaults to cos / sin).
        interleaved: pairing (module docstring).
        seqlen_offsets: int or (B,) integer tensor added to every position.
        num_heads_q: the number of q heads of a 4-D qkv; ignored for a 5-D one.
        backend: ropekit's backend, keyword only.

    Returns:
        qkv itself, rotated. It trains: gradients equal those of the out-of-place rotation.

    Raises:
        ValueError: a qkv of another shape, a missing or inconsistent num_heads_q, or anything
            :func:`ropekit.apply_rotary_qk` rejects.
    """
    _check_packed("qkv", qkv, 3, num_heads_q)
    kw = dict(offsets=seqlen_offsets, interleaved=interleaved, inplace=True, backend=backend)
    cos_k, sin_k = (cos if cos_k is None else cos_k), (sin if sin_k is None else sin_k)
    shared = cos_k is cos and sin_k is sin

    def rotate(t: torch.Tensor, conjugate: bool) -> None:
        q, k = _qkv_heads(t, num_heads_q)
        if shared:  # one launch for q and k
            apply_rotary_qk(q, k, cos, _flip(sin, conjugate), **kw)
        else:
            apply_rotary(q, cos, _flip(sin, conjugate), **kw)
            apply_rotary(k, cos_k, _flip(sin_k, conjugate), **kw)

    with peer_names(_NAMES):
        return in_place(qkv, rotate)


def apply_rotary_emb_kv_(
    kv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    seqlen_offsets: int | torch.Tensor = 0,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Mirrors ``flash_attn.layers.rotary.apply_rotary_emb_kv_``: rotate k of a packed kv in place.

    Args:
        kv: (B, S, 2, H, D); kv[:, :, 0] (k) rotates, kv[:, :, 1] (v) is never touched.
        cos, sin: (L, R/2) tables.
        interleaved: pairing (module docstring).
        seqlen_offsets: int or (B,) integer tensor added to every position.
        backend: ropekit's backend, keyword only.

    Returns:
        kv itself, rotated. It trains: gradients equal those of the out-of-place rotation.

    Raises:
        ValueError: a kv of another shape, or anything :func:`ropekit.apply_rotary` rejects.
    """
    _check_packed("kv", kv, 2)
    kw = dict(offsets=seqlen_offsets, interleaved=interleaved, inplace=True, backend=backend)
    with peer_names(_NAMES):
        return in_place(kv, lambda t, conj: apply_rotary(t[:, :, 0], cos, _flip(sin, conj), **kw))


class RotaryEmbedding(nn.Module):
    """Mirrors ``flash_attn.layers.rotary.RotaryEmbedding``: RoFormer's rotation (Su et al. 2021), optionally
    with xPos (Sun et al. 2022), applied in place to a packed qkv or to q and a packed kv.

    Args:
        dim: rotary_dim R: the first R features of each head rotate (head_dim may be larger).
        base: RoPE base; frequencies base^(-2i/R), computed in float32 as flash-attn does.
        interleaved: pairing (module docstring).
        scale_base: None, or xPos's scale base (flash-attn recommends 512): queries are scaled by
            zeta_i^((p - L//2) / scale_base) and keys by its inverse, zeta_i = (2i/R + 0.4) / 1.4, where L is
            the length the tables were last built for (flash-attn centres them there; so does ropekit).
        pos_idx_in_fp32: accepted for older flash-attn's signature. Positions are exact either way
            (flash-attn with False formed them in inv_freq's dtype, which a bfloat16 model rounds).
        device: where inv_freq (and the tables, until a call moves them) live.
        backend: ropekit's backend for every call, keyword only.

    The tables (``_cos_cached``, ``_sin_cached``, and ``_cos_k_cached`` / ``_sin_k_cached`` for xPos) are
    kept in qkv's dtype and rebuilt, as flash-attn's, when a call needs more rows than they hold, or comes
    on another device or in another dtype, or trains on tables made under inference mode. Differences:
    their angles are formed in float64 from the float32 frequencies and rounded once to the dtype
    (flash-attn: float32, then cast), so each value is within one rounding of flash-attn's; a tensor
    ``seqlen_offset`` past the tables without ``max_seqlen`` is a ValueError (flash-attn rotates those tokens
    by the identity).

    Raises:
        ValueError: dim not a positive even int, base not a number > 1, scale_base not positive, a flag
            that is not a bool, or an unknown backend.
    """

    def __init__(
        self,
        dim: int,
        base: float = 10000.0,
        interleaved: bool = False,
        scale_base: float | None = None,
        pos_idx_in_fp32: bool = True,
        device: torch.device | str | None = None,
        *,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.config = RopeConfig(dim, base, interleaved=interleaved, hf_float32_inv_freq=True)
        self.dim, self.base, self.interleaved = dim, float(base), interleaved
        if scale_base is not None:
            check_positive("scale_base", scale_base)
        self.scale_base = scale_base
        self.pos_idx_in_fp32 = check_bool("pos_idx_in_fp32", pos_idx_in_fp32)
        self.backend = check_backend_name(backend)
        inv_freq = self.config.inv_freq().to(device=device, dtype=torch.float32)  # (R/2,)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        scale = None
        if scale_base is not None:  # xPos's zeta_i, flash-attn's ``scale`` buffer
            scale = (torch.arange(0, dim, 2, device=device, dtype=torch.float32) + 0.4 * dim) / (1.4 * dim)
        self.register_buffer("scale", scale, persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = self._sin_cached = self._cos_k_cached = self._sin_k_cached = None

    def _update_cos_sin_cache(
        self, seqlen: int, device: torch.device | None = None, dtype: torch.dtype | None = None
    ) -> None:
        """(Re)build the tables for positions 0 .. seqlen - 1 in dtype (None: float32) when flash-attn
        would: more rows, another device or dtype, or training on tables made under inference mode."""
        dtype = torch.float32 if dtype is None else dtype
        cached = self._cos_cached
        if (
            cached is not None
            and seqlen <= self._seq_len_cached
            and cached.device == device
            and cached.dtype == dtype
            and not (self.training and cached.is_inference())
        ):
            return
        self._seq_len_cached = seqlen
        if self.scale_base is None:
            self._cos_cached, self._sin_cached = self.config.cos_sin(seqlen, dtype=dtype, device=device)
            return
        (cos_q, sin_q), (cos_k, sin_k) = xpos_cos_sin(
            self.config, seqlen, scale_base=self.scale_base, center=seqlen // 2, dtype=torch.float64
        )  # (L, R/2) each; rounded once to dtype below
        self._cos_cached, self._sin_cached = cos_q.to(device, dtype), sin_q.to(device, dtype)
        self._cos_k_cached, self._sin_k_cached = cos_k.to(device, dtype), sin_k.to(device, dtype)

    def forward(
        self,
        qkv: torch.Tensor,
        kv: torch.Tensor | None = None,
        seqlen_offset: int | torch.Tensor = 0,
        max_seqlen: int | None = None,
        num_heads_q: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Rotate in place, as flash-attn: qkv (B, S, 3, H, D) (or (B, S, Hq + 2 Hk, D) with num_heads_q)
        when kv is None, returning qkv; else q = qkv (B, S, H, D) and kv (B, S, 2, H, D), returning (q, kv).

        seqlen_offset: int or (B,) integer tensor added to every position (KV-cache decoding); with a
        tensor, pass max_seqlen so the tables cover it. v is never touched.

        Raises:
            ValueError: packed tensors of another shape, positions past the tables, a bad max_seqlen, or
                anything :func:`apply_rotary_emb_qkv_` / :func:`apply_rotary_emb` reject.
        """
        if not isinstance(qkv, torch.Tensor) or qkv.dim() < 2:
            raise ValueError(f"qkv: expected a packed (batch, seq, ...) tensor, got {describe(qkv)}")
        where = dict(device=qkv.device, dtype=qkv.dtype)  # the tables follow qkv, as flash-attn's
        if max_seqlen is not None:
            length = check_int("max_seqlen", max_seqlen, minimum=1, expected="a positive int or None")
            self._update_cos_sin_cache(length, **where)
        elif isinstance(seqlen_offset, int) and not isinstance(seqlen_offset, bool):
            self._update_cos_sin_cache(qkv.shape[1] + max(seqlen_offset, 0), **where)
        else:  # tensor offsets: the rows held (at least seqlen), now on qkv's device and in its dtype
            self._update_cos_sin_cache(max(self._seq_len_cached, qkv.shape[1]), **where)
        cos, sin = self._cos_cached, self._sin_cached
        xpos = self.scale_base is not None
        cos_k, sin_k = (self._cos_k_cached, self._sin_k_cached) if xpos else (cos, sin)
        kw = dict(interleaved=self.interleaved, seqlen_offsets=seqlen_offset, backend=self.backend)
        if kv is None:
            return apply_rotary_emb_qkv_(qkv, cos, sin, cos_k, sin_k, num_heads_q=num_heads_q, **kw)
        q = apply_rotary_emb(qkv, cos, sin, inplace=True, **kw)
        return q, apply_rotary_emb_kv_(kv, cos_k, sin_k, **kw)

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, base={self.base}, interleaved={self.interleaved}, scale_base={self.scale_base}"
        )
