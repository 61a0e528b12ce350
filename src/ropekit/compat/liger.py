"""Liger-Kernel's ``liger_rotary_pos_emb`` (``liger_kernel.transformers.rope``, Liger-Kernel 0.6) on the core.

Migration: ``from liger_kernel.transformers.rope import liger_rotary_pos_emb`` becomes
``from ropekit.compat.liger import liger_rotary_pos_emb``; the call stays as it is.

Liger's function is a drop-in for HF's ``apply_rotary_pos_emb`` on Llama-style models: q (B, Hq, S, D) and
k (B, Hk, S, D), HF's per-token tables cos, sin of shape (1, S, D) or (B, S, D) with duplicated halves, of
which only the first D/2 values per row are read. So does ropekit, through a view.

Same semantics as Liger: pairs (i, i + D/2); ``position_ids`` is accepted and unused (the tables are already
per token); for an odd head_dim D, pairs (i, i + D // 2) rotate and the last feature passes through.
Differences:

- q and k are never written. Liger's kernel rotates in the storage of ``q.transpose(1, 2).contiguous()``,
  which is q's own storage in HF's usual layout (a transposed (B, S, H, D) projection), so Liger overwrites
  its inputs there and not otherwise. The returned tensors are equal either way.
- ``unsqueeze_dim`` other than 1 is a ValueError: Liger ignores it and always reads q as (B, H, S, D).
- Tables whose width is not head_dim are a ValueError (Liger's kernel would read past each row).
"""

from __future__ import annotations

import torch

from ropekit.compat._common import peer_names
from ropekit.functional import apply_rotary_qk
from ropekit.validation import describe

__all__ = ["liger_rotary_pos_emb"]


def liger_rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mirrors ``liger_kernel.transformers.rope.liger_rotary_pos_emb``.

    Args:
        q: (B, Hq, S, D).
        k: (B, Hk, S, D).
        cos, sin: (1, S, D) or (B, S, D), duplicated halves (HF's rotary modules' output).
        position_ids: unused, as in Liger.
        unsqueeze_dim: must be 1 (the only layout Liger reads).

    Returns:
        (q_rotated, k_rotated), shaped and laid out like q and k.

    Raises:
        ValueError: q or k not 4-D, cos / sin not (1 or B, S, D), unsqueeze_dim other than 1, or anything
            :func:`ropekit.apply_rotary_qk` rejects.
    """
    if unsqueeze_dim != 1 or isinstance(unsqueeze_dim, bool):
        raise ValueError(
            f"unsqueeze_dim: expected 1 (Liger reads q as (batch, heads, seq, head_dim)), "
            f"got {unsqueeze_dim!r}"
        )
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(
                f"{name}: expected a 4-D tensor (batch, heads, seq, head_dim), got {describe(t)}"
            )
    head_dim = q.shape[-1]
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[-1] != head_dim:
            raise ValueError(
                f"{name}: expected shape (1 or batch, seq, head_dim = {head_dim}), got {describe(t)}"
            )
    even = head_dim // 2 * 2  # an odd head_dim leaves its last feature unrotated, as Liger's kernel does
    with peer_names({"x": "q"}):
        q_out, k_out = apply_rotary_qk(
            q.transpose(1, 2),  # (B, S, Hq, D) view
            k.transpose(1, 2),
            cos[..., :even],
            sin[..., :even],
            per_token=True,
            full_width=True,
        )
    return q_out.transpose(1, 2), k_out.transpose(1, 2)  # back to (B, H, S, D)
