"""The plain-PyTorch backend: the readable baseline every fast path is tested against.

It works on any device and dtype and traces cleanly under torch.compile (no data-dependent branches). The
pair rotation it applies, (a, b) -> (a cos - b sin, b cos + a sin), is derived in docs/math.md.
"""

from __future__ import annotations

import torch

__all__ = ["EagerBackend", "rotate"]


def rotate(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    interleaved: bool,
    conjugate: bool,
    inplace: bool,
) -> torch.Tensor:
    """Rotate one tensor; see :mod:`ropekit.backends.base` for the contract."""
    half = cos.shape[-1]
    rot = 2 * half
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    c = cos[positions].to(compute).unsqueeze(-2)  # (..., 1, rotary_dim/2): one row serves all heads
    s = sin[positions].to(compute).unsqueeze(-2)
    if conjugate:
        s = -s
    if interleaved:
        a, b = x[..., 0:rot:2], x[..., 1:rot:2]  # (..., heads, rotary_dim/2) each
    else:
        a, b = x[..., :half], x[..., half:rot]
    a32, b32 = a.to(compute), b.to(compute)
    ra = a32 * c - b32 * s
    rb = b32 * c + a32 * s
    out = x if inplace else torch.empty_like(x)
    if interleaved:
        out[..., 0:rot:2] = ra
        out[..., 1:rot:2] = rb
    else:
        out[..., :half] = ra
        out[..., half:rot] = rb
    if not inplace and rot < x.shape[-1]:
        out[..., rot:] = x[..., rot:]  # partial rotary: the tail passes through
    return out


class EagerBackend:
    name = "torch"

    def unavailable_reason(self, q: torch.Tensor, cos: torch.Tensor) -> str | None:
        return None

    def rotate_qk(self, q, k, cos, sin, positions, *, interleaved, conjugate, inplace):
        kw = dict(interleaved=interleaved, conjugate=conjugate, inplace=inplace)
        q_out = rotate(q, cos, sin, positions, **kw)
        k_out = None if k is None else rotate(k, cos, sin, positions, **kw)
        return q_out, k_out
