"""Megatron-Core's unfused rotary functions (``models/common/embeddings/rope_utils.py``, Megatron-Core 0.13)
on the core, in Megatron's sequence-first (sbhd) layout.

Migration: ``from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb`` becomes
``from ropekit.compat.megatron import apply_rotary_pos_emb``; the third argument may stay the
TransformerConfig that Megatron-Core passes (only its ``rotary_interleaved`` is read) or be that bool, as in
older releases.

Shape notation: S sequence, B batch, H heads, D head_dim, R rotary_dim <= D.

Megatron's ``RotaryEmbedding`` returns angles, not cos/sin: ``freqs`` of shape (S, 1, 1, R) (or (S, B, 1, R)
with per-sample positions), each pair's angle written for both its features: ``cat(f, f)`` for half pairing,
``f.repeat_interleave(2)`` when ``rotary_interleaved``. Only one angle per pair is read (a view), and its cos
and sin form an (S, R/2) table, 1/(B H D / R) of t's size; t itself is read and written where it lies (a
transposed view, no copy).

Same semantics as Megatron: pairs (i, i + R/2), or (2i, 2i+1) with rotary_interleaved; features past R pass
through; cos and sin are taken in freqs' own dtype (float64 angles stay float64), ``mscale`` multiplies
them; t is not modified. Differences: math runs in float32 and rounds
once to t's dtype (Megatron casts cos and sin to t's dtype first and multiplies in it, so bfloat16 results
differ by about one ulp); freqs that do not match t's sequence and batch are a ValueError; the packed (thd)
form with cu_seqlens and context parallelism is not mapped (use :func:`ropekit.apply_rotary` with cu_seqlens).
"""

from __future__ import annotations

import torch

from ropekit.compat._common import peer_names
from ropekit.functional import apply_rotary
from ropekit.tables import half_width
from ropekit.validation import check_bool, check_positive, describe

__all__ = ["apply_rotary_pos_emb", "apply_rotary_pos_emb_with_cos_sin"]


def _check_t(t: object) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        raise ValueError(f"t: expected a 4-D tensor (seq, batch, heads, head_dim), got {describe(t)}")


def apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    rotary_interleaved: bool = False,
    *,
    mscale: float = 1.0,
    backend: str = "auto",
) -> torch.Tensor:
    """Mirrors Megatron-Core's ``apply_rotary_pos_emb`` (its unfused bshd path) for sbhd input.

    Args:
        t: (S, B, H, D).
        freqs: angles, (S, 1, 1, R) or (S, B, 1, R), full width (one angle per feature, duplicated per pair).
        rotary_interleaved: pairing: False (i, i + R/2), True (2i, 2i+1); also how freqs duplicates angles.
            Megatron-Core 0.8+ passes its TransformerConfig here instead; any object with a bool
            ``rotary_interleaved`` attribute is read that way.
        mscale: factor on cos and sin (YaRN's attention scaling).
        backend: ropekit's backend ("auto", "torch", "cpu" or "triton").

    Returns:
        The rotated tensor, (S, B, H, D) like t.

    Raises:
        ValueError: t not 4-D, freqs not (S, 1 or B, 1, R) with even R <= D, mscale not a finite number.
    """
    _check_t(t)
    seq, batch = t.shape[:2]
    if (
        not isinstance(freqs, torch.Tensor)
        or not freqs.is_floating_point()
        or freqs.dim() != 4
        or freqs.shape[0] != seq
        or freqs.shape[2] != 1
    ):
        raise ValueError(
            f"freqs: expected angles of shape (seq = {seq}, 1 or batch, 1, rotary_dim), got {describe(freqs)}"
        )
    if freqs.shape[1] not in (1, batch):
        raise ValueError(f"freqs: expected a batch axis of 1 or {batch}, got shape {tuple(freqs.shape)}")
    mscale = check_positive("mscale", mscale)
    if not isinstance(rotary_interleaved, bool) and hasattr(rotary_interleaved, "rotary_interleaved"):
        rotary_interleaved = rotary_interleaved.rotary_interleaved  # a TransformerConfig
    check_bool("rotary_interleaved", rotary_interleaved)
    angles, _ = half_width(freqs, freqs, interleaved=rotary_interleaved)  # (S, B', 1, R/2) view
    angles = angles[:, :, 0].transpose(0, 1)  # (B', S, R/2)
    # As Megatron: cos and sin in the angles' own dtype (float64 angles at position 1e6 lose ~0.03 rad if
    # cast to float32 first), then cast, here to the math dtype (float32, or float64 for float64 t).
    cos, sin = torch.cos(angles), torch.sin(angles)
    if mscale != 1.0:
        cos, sin = cos * mscale, sin * mscale
    compute = torch.float64 if t.dtype == torch.float64 else torch.float32
    cos, sin = cos.to(compute), sin.to(compute)
    with peer_names({"x": "t", "cos": "freqs"}):
        out = apply_rotary(
            t.transpose(0, 1), cos, sin, per_token=True, interleaved=rotary_interleaved, backend=backend
        )
    return out.transpose(0, 1)  # back to (S, B, H, D)


def apply_rotary_pos_emb_with_cos_sin(
    t: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotary_interleaved: bool = False,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Mirrors Megatron-Core's ``apply_rotary_pos_emb_with_cos_sin`` (its flash-attn path).

    Args:
        t: (S, B, H, D).
        cos, sin: (L, R/2) tables with L >= S; token s uses row s.
        rotary_interleaved: pairing: False (i, i + R/2), True (2i, 2i+1).
        backend: ropekit's backend.

    Raises:
        ValueError: t not 4-D, cos / sin not (L, R/2) with L >= S and R <= D, or anything
            :func:`ropekit.apply_rotary` rejects.
    """
    _check_t(t)
    with peer_names({"x": "t"}):
        out = apply_rotary(t.transpose(0, 1), cos, sin, interleaved=rotary_interleaved, backend=backend)
    return out.transpose(0, 1)
