"""Autograd for the rotation: the backward pass is the same backend run with the conjugate rotation.

A rotation R is orthogonal, so dL/dx = R^T dL/dy = R(-theta) dL/dy. Nothing but the tables and the positions is
saved for backward: no activations.
"""

from __future__ import annotations

import torch

from ropekit.backends import Backend

__all__ = ["RotaryFunction"]


class RotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        q: torch.Tensor,
        k: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        backend: Backend,
        interleaved: bool,
        inplace: bool,
    ):
        q_out, k_out = backend.rotate_qk(
            q, k, cos, sin, positions, interleaved=interleaved, conjugate=False, inplace=inplace
        )
        ctx.save_for_backward(cos, sin, positions)
        ctx.backend, ctx.interleaved = backend, interleaved
        if inplace:
            ctx.mark_dirty(*(t for t in (q, k) if t is not None))
        return q_out, k_out

    @staticmethod
    def backward(ctx, grad_q: torch.Tensor | None, grad_k: torch.Tensor | None):
        cos, sin, positions = ctx.saved_tensors
        kw = dict(interleaved=ctx.interleaved, conjugate=True, inplace=False)
        if grad_q is None:  # only k's output was used
            gq, gk = None, (None if grad_k is None else ctx.backend.rotate_qk(grad_k, None, cos, sin, positions, **kw)[0])
        else:
            gq, gk = ctx.backend.rotate_qk(grad_q, grad_k, cos, sin, positions, **kw)
        return gq, gk, None, None, None, None, None, None
