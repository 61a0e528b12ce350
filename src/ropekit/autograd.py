"""Autograd for the rotation: the backward pass is the same backend run with the conjugate rotation.

A rotation R is orthogonal, so dL/dx = R^T dL/dy = R(-theta) dL/dy (docs/math.md). Nothing but the tables
and the positions is saved for backward: no activations.
"""

from __future__ import annotations

from typing import Any

import torch

from ropekit.backends import Backend

__all__ = ["RotaryFunction"]


class RotaryFunction(torch.autograd.Function):
    """Rotate q (and k) by the tables' angles; backward rotates the incoming gradients by the negated angles.

    Called as ``RotaryFunction.apply(q, k, cos, sin, positions, backend, interleaved, inplace)`` with
    positions already resolved (:mod:`ropekit.positions`); k may be None. The tables are constants here:
    learnable tables take the plain torch path in :mod:`ropekit.functional` instead.
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        backend: Backend,
        interleaved: bool,
        inplace: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        q_out, k_out = backend.rotate_qk(
            q, k, cos, sin, positions, interleaved=interleaved, conjugate=False, inplace=inplace
        )
        ctx.save_for_backward(cos, sin, positions)
        ctx.backend, ctx.interleaved = backend, interleaved
        if inplace:
            ctx.mark_dirty(*(t for t in (q, k) if t is not None))
        return q_out, k_out

    @staticmethod
    def backward(ctx: Any, grad_q: torch.Tensor, grad_k: torch.Tensor | None) -> tuple[Any, ...]:
        # Gradients are materialised (zeros for an unused output), so grad_q is a tensor; grad_k is None
        # exactly when k was None.
        cos, sin, positions = ctx.saved_tensors
        grad_q, grad_k = ctx.backend.rotate_qk(
            grad_q, grad_k, cos, sin, positions, interleaved=ctx.interleaved, conjugate=True, inplace=False
        )
        return grad_q, grad_k, None, None, None, None, None, None
