"""Hugging Face's ``apply_rotary_pos_emb`` (transformers 5.x, ``models/llama/modeling_llama.py``) on the core.

Migration: ``from transformers.models.llama.modeling_llama import apply_rotary_pos_emb`` becomes
``from ropekit.compat.hf import apply_rotary_pos_emb``; the call stays as it is.

HF's rotary modules return per-token tables: ``cos, sin = rotary_emb(x, position_ids)``, each
(B, S, D) with duplicated halves (``cat(freqs, freqs)``, times the schedule's attention scaling), in x's
dtype. ropekit reads them as they are: the first D/2 values of each row, through a view (no table is rebuilt,
nothing is copied), one row per token, shared by every head.

Shape notation: B batch, S sequence, H heads (Hq, Hk for q and k), D head_dim.

Same semantics as HF: pairs (i, i + D/2) (``rotate_half``), q and k never modified, outputs in q's and k's
layout and dtype. Differences:

- Math runs in float32 with one rounding to the output dtype; HF multiplies in the input dtype, so bfloat16
  results differ from HF's by about one bfloat16 ulp (ropekit's are the closer to the exact rotation).
- Only the first half of each row is read: a table whose halves differ is not HF's and is not detected, and
  a gradient with respect to cos / sin (HF's tables carry none; a learnable table would) reaches only that
  first half.
- Shapes HF would broadcast into something else (a table of another width, a sequence axis of 1 for S > 1)
  are a ValueError.
- Outputs have q's and k's dtype. HF's rotary modules return tables in that dtype already; given tables of a
  wider dtype, HF's arithmetic would promote its outputs to it.
"""

from __future__ import annotations

import torch

from ropekit.backends.plan import launch_planned
from ropekit.compat._common import peer_names
from ropekit.functional import apply_rotary_qk
from ropekit.validation import check_int, describe

__all__ = ["apply_rotary_pos_emb"]


def _head_axis(cos: torch.Tensor, unsqueeze_dim: object) -> int:
    """The axis of a 4-D q that ``cos.unsqueeze(unsqueeze_dim)`` broadcasts over: 1 (B, H, S, D) or 2.

    HF right-aligns the unsqueezed table with q; the inserted axis of size 1 is the heads axis.
    """
    if not isinstance(cos, torch.Tensor) or cos.dim() not in (2, 3):
        raise ValueError(
            f"cos: expected per-token rows of shape (batch, seq, head_dim) or (seq, head_dim), "
            f"got {describe(cos)}"
        )
    rank = cos.dim() + 1  # after unsqueeze
    expected = f"an int in [{-rank}, {rank - 1}] (cos has {cos.dim()} axes)"
    unsqueeze_dim = check_int(
        "unsqueeze_dim", unsqueeze_dim, minimum=-rank, maximum=rank - 1, expected=expected
    )
    inserted = unsqueeze_dim + rank if unsqueeze_dim < 0 else unsqueeze_dim
    axis = inserted + 4 - rank  # the same axis counted on q
    if axis not in (1, 2):
        raise ValueError(
            f"unsqueeze_dim: {unsqueeze_dim} makes cos {tuple(cos.shape)} broadcast over axis {axis} of q; "
            f"expected the heads axis, 1 for q (batch, heads, seq, head_dim) or 2 for (batch, seq, heads, "
            f"head_dim) (unsqueeze_dim {1 if cos.dim() == 3 else 0} or {2 if cos.dim() == 3 else 1})"
        )
    return axis


def apply_rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mirrors transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` (Llama and most).

    Args:
        q: (B, Hq, S, D) with unsqueeze_dim=1 (HF's layout), or (B, S, Hq, D) with unsqueeze_dim=2.
        k: like q, with Hk heads.
        cos, sin: per-token rows (B, S, D) or (1, S, D), full width with duplicated halves, as HF's rotary
            modules return; (S, D) with unsqueeze_dim 0 (bhsd) or 1 (bshd) as HF broadcasts it.
        unsqueeze_dim: where HF unsqueezes cos / sin to broadcast them over the heads axis.

    Returns:
        (q_embed, k_embed), shaped and laid out like q and k.

    Raises:
        ValueError: tables of another width or token shape, an unsqueeze_dim that does not land on a heads
            axis, or anything :func:`ropekit.apply_rotary_qk` rejects.
    """
    out = _direct(q, k, cos, sin, unsqueeze_dim)
    if out is not None:
        return out
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D tensor, got {describe(t)}")
    axis = _head_axis(cos, unsqueeze_dim)
    if cos.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"cos: expected rows as wide as head_dim ({q.shape[-1]}) with duplicated halves, as HF's rotary "
            f"modules return, got shape {tuple(cos.shape)}"
        )
    if axis == 1:
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, S, H, D) views
    with peer_names({"x": "q"}):
        q_out, k_out = apply_rotary_qk(q, k, cos, sin, per_token=True, full_width=True)
    if axis == 1:
        q_out, k_out = q_out.transpose(1, 2), k_out.transpose(1, 2)  # back to (B, H, S, D)
    return q_out, k_out


# (batch, seq, device) -> arange(0, batch * seq, seq): where each batch row's per-token rows start in the
# flattened table. Kept (a few per process), so a steady call builds no tensor.
_starts: dict[tuple, torch.Tensor] = {}


def _row_starts(batch: int, seq: int, device: torch.device) -> torch.Tensor:
    key = (batch, seq, device)
    starts = _starts.get(key)
    if starts is None:
        if len(_starts) >= 64:
            _starts.clear()
        starts = _starts[key] = torch.arange(0, batch * seq, seq, device=device)  # (batch,)
    return starts


def _direct(q, k, cos, sin, unsqueeze_dim):
    """HF's usual call, 3-D tables of q's sequence length and head_dim, as the core call it amounts to: a
    (rows, D/2) view of the tables and each batch row's first row (an int 0 when the rows are shared by the
    batch). In the steady state that is the core's launch plan (:mod:`ropekit.backends.plan`) with no other
    check: everything HF's shapes rely on is compared here, the rest is in the plan's key. None for any
    other call (the checked path below then names what is wrong)."""
    if type(unsqueeze_dim) is not int or (unsqueeze_dim != 1 and unsqueeze_dim != 2):
        return None
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(cos) is not torch.Tensor:
        return None
    q_shape, rows = q.shape, cos.shape
    if len(q_shape) != 4 or len(rows) != 3 or type(sin) is not torch.Tensor or sin.shape != rows:
        return None
    batch, seq, width = q_shape[0], q_shape[unsqueeze_dim ^ 3], q_shape[3]  # seq: axis 2 (bhsd) or 1 (bshd)
    if (
        rows[1] != seq
        or rows[2] != width
        or width % 2
        or len(k.shape) != 4
        or k.shape[unsqueeze_dim ^ 3] != seq
    ):
        return None
    half = width // 2
    if rows[0] == 1 or batch == 1 or (cos.stride(0) == 0 and sin.stride(0) == 0):
        cos_rows, sin_rows, starts = cos[0, :, :half], sin[0, :, :half], 0  # (S, D/2): row s, token s
    elif rows[0] == batch and cos.is_contiguous() and sin.is_contiguous():
        cos_rows = cos.view(batch * seq, width)[:, :half]  # (B * S, D/2): row b * S + s, token (b, s)
        sin_rows = sin.view(batch * seq, width)[:, :half]
        starts = _row_starts(batch, seq, q.device)
    else:
        return None
    if unsqueeze_dim == 1:
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, S, H, D) views
    out = launch_planned(q, k, cos_rows, sin_rows, starts, False, False, "auto", False)
    if out is None:
        with peer_names({"x": "q"}):
            out = apply_rotary_qk(q, k, cos_rows, sin_rows, offsets=starts)
    if unsqueeze_dim == 2:
        return out
    return out[0].transpose(1, 2), out[1].transpose(1, 2)  # back to (B, H, S, D)
