"""Autograd for the rotation: the backward pass is the same backend run with the conjugate rotation.

A rotation R is orthogonal, so dL/dx = R^T dL/dy = R(-theta) dL/dy (docs/math.md); for the inverse rotation
(``conjugate``, forward by -theta) backward rotates by +theta. Nothing but the tables
and the positions tensor (none for an int offset) is saved for backward: no activations.

Two Functions, because PyTorch allows a Function that writes into a view (a slice of a packed qkv buffer) only
if it returns a single tensor: :class:`RotaryFunction` rotates one tensor (``apply_rotary``, and each of q and
k for in-place ``apply_rotary_qk``), :class:`RotaryQKFunction` rotates q and k in one launch.
"""

from __future__ import annotations

from typing import Any

import torch

from ropekit.backends import Backend
from ropekit.dtensor_inputs import is_dtensor

__all__ = ["RotaryFunction", "RotaryQKFunction"]


def _rotate(ctx: Any, q, k, cos, sin, positions, offset, backend, interleaved, inplace, conjugate, numerics):
    """The forward rotation, saving for backward only the tables and the positions (no activations)."""
    flags = dict(interleaved=interleaved, conjugate=conjugate, inplace=inplace, offset=offset)
    if numerics != "exact":  # a backend that lists no numerics computes "exact" alone, and takes no keyword
        flags["numerics"] = numerics
    out = backend.rotate_qk(q, k, cos, sin, positions, **flags)
    ctx.save_for_backward(cos, sin, *(() if positions is None else (positions,)))
    ctx.offset, ctx.backend, ctx.interleaved, ctx.conjugate = offset, backend, interleaved, conjugate
    ctx.rounding = flags.get("numerics")
    ctx.placed = (q.device_mesh, q.placements) if is_dtensor(q) else None
    return out


def _conjugate(ctx: Any, grad_q: torch.Tensor, grad_k: torch.Tensor | None):
    cos, sin, *positions = ctx.saved_tensors
    if ctx.placed is not None:
        # A DTensor gradient may arrive placed otherwise (a sum's gradient is replicated): it is rotated where
        # the forward's outputs lay, the placements its positions were sharded alongside.
        grad_q, grad_k = (g if g is None else g.redistribute(*ctx.placed) for g in (grad_q, grad_k))
    # "hf" / "vllm": the conjugate rotation rounded per op is the peer's own backward (autograd of
    # x * cos + rotate_half(x) * sin in x's dtype)
    rounding = {} if ctx.rounding is None else {"numerics": ctx.rounding}
    return ctx.backend.rotate_qk(
        grad_q,
        grad_k,
        cos,
        sin,
        positions[0] if positions else None,
        interleaved=ctx.interleaved,
        conjugate=not ctx.conjugate,  # the forward rotation's inverse
        inplace=False,
        offset=ctx.offset,
        **rounding,
    )


class RotaryFunction(torch.autograd.Function):
    """Rotate one tensor by the tables' angles; backward rotates the incoming gradient by the negated angles.

    Called as ``RotaryFunction.apply(x, cos, sin, positions, offset, backend, interleaved, inplace,
    conjugate, numerics)`` with positions resolved (:mod:`ropekit.positions`: an int64 tensor, or None and an
    int offset). The tables are constants here: learnable tables take the plain torch path in
    :mod:`ropekit.functional` instead.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor | None,
        offset: int,
        backend: Backend,
        interleaved: bool,
        inplace: bool,
        conjugate: bool = False,
        numerics: str = "exact",
    ) -> torch.Tensor:
        out, _ = _rotate(
            ctx, x, None, cos, sin, positions, offset, backend, interleaved, inplace, conjugate, numerics
        )
        if inplace:
            ctx.mark_dirty(x)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _conjugate(ctx, grad, None)[0], None, None, None, None, None, None, None, None, None


class RotaryQKFunction(torch.autograd.Function):
    """q and k in one launch: ``RotaryQKFunction.apply(q, k, cos, sin, positions, offset, backend,
    interleaved, conjugate, numerics)``, out of place (in place, each tensor goes through
    :class:`RotaryFunction`)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor | None,
        offset: int,
        backend: Backend,
        interleaved: bool,
        conjugate: bool = False,
        numerics: str = "exact",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # A DTensor output's unused gradient stays None: autograd would materialise it as a plain tensor.
        # (Plain tensors keep zeros, so an unused output's input still gets a zero gradient.)
        ctx.set_materialize_grads(not is_dtensor(q))
        flags = (interleaved, False, conjugate, numerics)
        return _rotate(ctx, q, k, cos, sin, positions, offset, backend, *flags)

    @staticmethod
    def backward(ctx: Any, grad_q: torch.Tensor | None, grad_k: torch.Tensor | None) -> tuple[Any, ...]:
        if grad_q is None and grad_k is None:
            return (None,) * 10
        if grad_q is None or grad_k is None:  # a DTensor output unused: rotate the other alone
            grad = _conjugate(ctx, grad_k if grad_q is None else grad_q, None)[0]
            grad_q, grad_k = (None, grad) if grad_q is None else (grad, None)
        else:
            grad_q, grad_k = _conjugate(ctx, grad_q, grad_k)
        return grad_q, grad_k, None, None, None, None, None, None, None, None
