"""Liger-Kernel's rotary calls (``liger_kernel.transformers.rope`` and ``liger_kernel.ops.rope``, Liger-Kernel
0.8) on the core.

Migration: ``from liger_kernel.transformers.rope import liger_rotary_pos_emb`` (or
``liger_rotary_pos_emb_vision`` / ``liger_rotary_pos_emb_gpt_oss``, or
``from liger_kernel.ops.rope import LigerRopeFunction``) becomes ``from ropekit.compat.liger import ...``;
the calls stay as they are. Each also takes ropekit's ``backend`` (keyword only for the functions; the last
positional argument of ``LigerRopeFunction.apply``).

Shape notation: B batch, H heads (Hq, Hk for q and k), S sequence, D head_dim, W table width, R rotary_dim.

Liger's functions are drop-ins for HF's ``apply_rotary_pos_emb``: q (B, Hq, S, D) and k (B, Hk, S, D), and
HF's per-token tables cos, sin of shape (1, S, W), (B, S, W), (S, W) (how Liger serves vision RoPE, one row
per patch shared by the batch) or (1 or B, 1, S, W) (already unsqueezed over the heads). Pairs (i, i + R/2)
rotate (GPT-NeoX / HF pairing) and features past R pass through. R is ``rotary_dim`` if given, else
min(W, D) (rows in HF's duplicated-halves form, ``cat(freqs, freqs)``); only the first R/2 values of each
row are read, through a view. An odd R rotates pairs (i, i + R // 2) and passes the last rotary feature
through, as Liger's kernel does. ``position_ids`` is accepted and unused (the tables are already per token).

Differences:

- q and k are never written. Liger's kernel rotates in the storage of ``q.transpose(1, 2).contiguous()``,
  which is q's own storage in HF's usual layout (a transposed (B, S, H, D) projection), so Liger overwrites
  its inputs there and not otherwise. The returned tensors are equal either way.
- ``unsqueeze_dim`` other than 1 is a ValueError: Liger ignores it (beyond squeezing 4-D tables) and always
  reads q as (B, H, S, D).
- Tables of another batch, or too narrow for rotary_dim, are ValueErrors (Liger's kernel reads past them).
"""

from __future__ import annotations

from typing import Any

import torch

from ropekit.compat._common import peer_names
from ropekit.functional import apply_rotary_qk
from ropekit.validation import check_int, describe

__all__ = [
    "LigerRopeFunction",
    "liger_rotary_pos_emb",
    "liger_rotary_pos_emb_gpt_oss",
    "liger_rotary_pos_emb_vision",
]


def _half_tables(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: object, rotary_dim
) -> tuple[torch.Tensor, torch.Tensor]:
    """Liger's accepted table forms as per-token rows (1 or B, S, R // 2) or (S, R // 2): views, no copy."""
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
    tables = []
    for name, t in (("cos", cos), ("sin", sin)):
        if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[1] == 1:
            t = t.squeeze(1)  # (1 or B, 1, S, W): HF's tables already unsqueezed over the heads
        if not isinstance(t, torch.Tensor) or t.dim() not in (2, 3):
            raise ValueError(
                f"{name}: expected shape (seq, width), (1 or batch, seq, width) or (1 or batch, 1, seq, "
                f"width), got {describe(t)}"
            )
        tables.append(t)
    width = tables[0].shape[-1]
    if rotary_dim is None:
        rotary = min(width, head_dim)  # duplicated halves: the row is as wide as the rotated part
    else:
        rotary = check_int(
            "rotary_dim", rotary_dim, minimum=2, maximum=head_dim, expected=f"an even int in [2, {head_dim}]"
        )
        if rotary % 2:
            raise ValueError(f"rotary_dim: expected an even int in [2, {head_dim}], got {rotary}")
        if width < rotary // 2:
            raise ValueError(
                f"cos: expected rows of at least rotary_dim / 2 = {rotary // 2} values, got shape "
                f"{tuple(tables[0].shape)}"
            )
    if rotary < 2:
        raise ValueError(f"cos: expected rows of at least 2 values (one pair), got shape {tuple(cos.shape)}")
    half = rotary // 2
    return tables[0][..., :half], tables[1][..., :half]  # (..., S, R // 2) views


def _rotate(q, k, cos, sin, unsqueeze_dim, rotary_dim, backend, conjugate=False):
    """q, k (B, H, S, D) rotated by Liger's tables (by -theta if conjugate: the backward pass)."""
    cos, sin = _half_tables(q, k, cos, sin, unsqueeze_dim, rotary_dim)
    if conjugate:
        sin = -sin  # R(-theta) (docs/math.md)
    with peer_names({"x": "q"}):
        q_out, k_out = apply_rotary_qk(
            q.transpose(1, 2),  # (B, S, Hq, D) view
            k.transpose(1, 2),
            cos,
            sin,
            per_token=True,
            backend=backend,
        )
    return q_out.transpose(1, 2), k_out.transpose(1, 2)  # back to (B, H, S, D)


def liger_rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    unsqueeze_dim: int = 1,
    rotary_dim: int | None = None,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mirrors ``liger_kernel.transformers.rope.liger_rotary_pos_emb``.

    Args:
        q: (B, Hq, S, D).
        k: (B, Hk, S, D).
        cos, sin: (1, S, W), (B, S, W), (S, W) or (1 or B, 1, S, W) per-token rows (module docstring).
        position_ids: unused, as in Liger.
        unsqueeze_dim: must be 1 (the only layout Liger reads).
        rotary_dim: the rotated width R when the rows are not duplicated (GPT-OSS: W = R / 2); default
            min(W, D).
        backend: ropekit's backend ("auto", "torch", "cpu" or "triton").

    Returns:
        (q_rotated, k_rotated), shaped and laid out like q and k.

    Raises:
        ValueError: q or k not 4-D, tables of another form, batch or length, unsqueeze_dim other than 1, a
            rotary_dim that is odd, past head_dim or wider than twice the rows, or anything
            :func:`ropekit.apply_rotary_qk` rejects.
    """
    return _rotate(q, k, cos, sin, unsqueeze_dim, rotary_dim, backend)


def liger_rotary_pos_emb_gpt_oss(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mirrors ``liger_kernel.transformers.rope.liger_rotary_pos_emb_gpt_oss``: GPT-OSS's rows hold one value
    per pair (width D / 2) and the whole head rotates, so rotary_dim = D."""
    head_dim = q.shape[-1] if isinstance(q, torch.Tensor) else None
    return _rotate(q, k, cos, sin, 1, head_dim, backend)


def liger_rotary_pos_emb_vision(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mirrors ``liger_kernel.transformers.rope.liger_rotary_pos_emb_vision`` (Qwen3-VL's vision tower).

    Args:
        q, k: (S, H, D): one row per patch.
        cos, sin: (S, D), duplicated halves.
        backend: ropekit's backend.

    Returns:
        (q_rotated, k_rotated), shaped like q and k, in their dtypes (Liger computes in float32 and casts
        back; so does ropekit).

    Raises:
        ValueError: q or k not 3-D, or as :func:`liger_rotary_pos_emb`.
    """
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name}: expected a 3-D tensor (seq, heads, head_dim), got {describe(t)}")
    q_out, k_out = _rotate(
        q.unsqueeze(0).transpose(1, 2), k.unsqueeze(0).transpose(1, 2), cos, sin, 1, None, backend
    )
    return q_out.transpose(1, 2).squeeze(0), k_out.transpose(1, 2).squeeze(0)  # (S, H, D)


class LigerRopeFunction(torch.autograd.Function):
    """Mirrors ``liger_kernel.ops.rope.LigerRopeFunction``: ``LigerRopeFunction.apply(q, k, cos, sin,
    position_ids=None, unsqueeze_dim=1, rotary_dim=None, backend="auto")`` returns (q_rotated, k_rotated).

    The forward pass is :func:`liger_rotary_pos_emb`; the backward pass rotates the incoming gradients by
    -theta, as Liger's ``rope_backward`` does. The tables get no gradient (Liger returns None for them). q and
    k are not written (see the module docstring).
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        unsqueeze_dim: int = 1,
        rotary_dim: int | None = None,
        backend: str = "auto",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(cos, sin)
        ctx.rotary_dim, ctx.backend = rotary_dim, backend
        return _rotate(q, k, cos, sin, unsqueeze_dim, rotary_dim, backend)

    @staticmethod
    def backward(ctx: Any, dq: torch.Tensor, dk: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        dq, dk = _rotate(dq, dk, cos, sin, 1, ctx.rotary_dim, ctx.backend, conjugate=True)
        return dq, dk, None, None, None, None, None, None
