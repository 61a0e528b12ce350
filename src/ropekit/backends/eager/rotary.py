"""The plain-PyTorch backend: the readable baseline every fast path is tested against.

It works on any device and dtype and traces cleanly under torch.compile (no data-dependent branches). The
pair rotation it applies, (a, b) -> (a cos - b sin, b cos + a sin), is derived in docs/math.md.
"""

from __future__ import annotations

import torch

__all__ = ["rotate", "rotate_qk", "table_rows"]


def table_rows(positions: torch.Tensor | None, offset: int, x: torch.Tensor, table_len: int) -> torch.Tensor:
    """The int64 table row of each token of x (x.shape[:-2]), checked to lie in [0, table_len).

    Indexing would raise for a row past the table on the CPU, but it wraps a negative row silently, and a
    compiled graph or a CUDA tensor cannot be checked on the host without a sync: there the check is a
    device-side assert (``torch._assert_async``), which fails the call instead of reading a wrong row.
    """
    if positions is None:
        batch, seq = x.shape[:2]
        positions = torch.arange(offset, offset + seq, device=x.device).expand(batch, seq)  # (batch, seq)
        if not torch.compiler.is_compiling():
            if seq and batch and not 0 <= offset <= table_len - seq:
                raise ValueError(
                    f"positions: position {offset + seq - 1} is outside the cos/sin table (table_len "
                    f"{table_len}); expected 0 <= position < table_len"
                )
            return positions
    if positions.device.type == "cpu" and not torch.compiler.is_compiling():
        if positions.numel():
            lo, hi = torch.stack(torch.aminmax(positions)).tolist()
            if lo < 0 or hi >= table_len:
                raise ValueError(
                    f"positions: position {lo if lo < 0 else hi} is outside the cos/sin table (table_len "
                    f"{table_len}); expected 0 <= position < table_len"
                )
    else:
        inside = ((positions >= 0) & (positions < table_len)).all()
        torch._assert_async(
            inside, "ropekit: a position is outside the cos/sin table (positions >= table_len)"
        )
    return positions


def rotate(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    interleaved: bool,
    conjugate: bool,
    inplace: bool,
    numerics: str = "exact",
) -> torch.Tensor:
    """Rotate one tensor; see :mod:`ropekit.backends.base` for the contract (positions already checked).

    numerics "hf" / "vllm" compute in x's own dtype: each product and sum is PyTorch's op in that dtype, the
    peers' own arithmetic (float32 and float64 then compute as "exact" does)."""
    half = cos.shape[-1]
    rot = 2 * half
    if numerics == "exact" or x.dtype == torch.float64:
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    else:
        compute = x.dtype
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


def rotate_qk(q, k, cos, sin, positions, *, interleaved, conjugate, inplace, offset=0, numerics="exact"):
    """Rotate q and k (k may be None) with the torch ops: the torch backend's ``rotate_qk`` (positions or
    offset checked against the table here)."""
    positions = table_rows(positions, offset, q, cos.shape[0])
    kw = dict(interleaved=interleaved, conjugate=conjugate, inplace=inplace, numerics=numerics)
    q_out = rotate(q, cos, sin, positions, **kw)
    k_out = None if k is None else rotate(k, cos, sin, positions, **kw)
    return q_out, k_out
