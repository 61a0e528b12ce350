"""The backend contract every RoPE implementation (torch, CPU fast path, Triton) fulfils.

A backend rotates q (and optionally k) given cos/sin tables and *resolved* positions (see
:mod:`ropekit.positions`): an int64 tensor of shape x.shape[:-2], one table row per token, shared by all
heads, or None and an int ``offset``: rows ``offset + arange(seq)`` for every batch row of 4-D input.

Contract of :meth:`Backend.rotate_qk`:
    q: (..., q_heads, head_dim); k: (..., k_heads, head_dim) or None; the leading axes of q and k match
        positions.shape. q and k may be non-contiguous views (HF's bhsd layout arrives transposed).
    cos, sin: (table_len, rotary_dim // 2), same dtype and device as each other, on q's device.
    interleaved: False pairs (i, i + d/2) (GPT-NeoX / HF); True pairs (2i, 2i+1) (GPT-J / Meta).
    conjugate: rotate by -theta instead of +theta (the backward pass, and the inverse).
    inplace: write into q and k and return them; otherwise return new tensors and leave the inputs untouched.
    offset: with positions None, the row of each sequence's first token.
    A row outside the table is an error (a ValueError where it is checked on the host, a device-side assert
    otherwise), never a read outside the table.
    Features past rotary_dim are copied unchanged. Math runs in float32 (float64 if q is float64); outputs
    have the input dtype.

The same object runs every other op, when it has the kernels (the built-in three do; a registered
third-party backend may have rotate_qk alone, and :func:`ropekit.backends.select_backend` then refuses it by
name for a fused op, and skips it for "auto"):
    ``launch_fused(launch, *, checked, written=())``: a
    :class:`~ropekit.backends.fused_launch.FusedLaunch` (RoPE + KV-cache write, RoPE + FP8, cache shift);
    ``launch_qk_norm(qkv, q_weight, k_weight, cos, sin, positions, offset, spec, *, written=())``: QK-RMSNorm
    + RoPE on a packed (B, S, W) qkv in place;
    ``fused_unavailable_reason(op, *, widest=0, spec=None)``: None, or why it cannot run ``op`` ("fused",
    "qk_norm") for these heads. ``written``: the tensors whose version counters a kernel that writes through
    pointers bumps.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["Backend", "served_numerics"]


class Backend(Protocol):
    name: str

    def unavailable_reason(self, q: torch.Tensor, cos: torch.Tensor) -> str | None:
        """None if this backend can serve these inputs, else a short human-readable reason."""
        ...

    def rotate_qk(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor | None,
        *,
        interleaved: bool,
        conjugate: bool,
        inplace: bool,
        offset: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


def served_numerics(backend: object) -> tuple[str, ...]:
    """The arithmetic modes a backend computes (:data:`ropekit.validation.NUMERICS`), as it declares them in
    a ``numerics`` attribute: "exact" alone for a backend that declares none."""
    return tuple(getattr(backend, "numerics", ("exact",)))
