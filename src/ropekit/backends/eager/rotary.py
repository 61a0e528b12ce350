"""The plain-PyTorch backend: the readable baseline every fast path is tested against.

It works on any device and dtype and traces cleanly under torch.compile (no data-dependent branches). The
pair rotation it applies, (a, b) -> (a cos - b sin, b cos + a sin), is derived in docs/math.md.
"""

from __future__ import annotations

import torch

from ropekit.validation import NUMERICS

__all__ = ["EagerBackend", "rotate"]


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


class EagerBackend:
    """Plain PyTorch: serves every op on any device and dtype, and traces under torch.compile."""

    name = "torch"
    numerics = NUMERICS  # every arithmetic mode (a backend without this attribute serves "exact" alone)

    def unavailable_reason(self, q: torch.Tensor, cos: torch.Tensor) -> str | None:
        return None

    def fused_unavailable_reason(self, op: str, *, widest: int = 0, spec=None) -> str | None:
        return None  # tensor ops: any head width, any packing

    def launch_fused(self, launch, *, checked: bool, written=()) -> None:
        """A fused serving launch (:class:`~ropekit.backends.fused_launch.FusedLaunch`) with tensor ops, which
        tell autograd what they wrote themselves (``written`` is not needed)."""
        from ropekit.backends.eager import fused as fused_eager  # it builds on this file's rotation

        fused_eager.launch(launch, checked=checked)

    def launch_qk_norm(
        self, qkv, q_weight, k_weight, cos, sin, positions, offset, spec, *, written=()
    ) -> None:
        """QK-RMSNorm + RoPE on qkv (B, S, W) in place (:mod:`ropekit.backends.eager.qk_norm`); tensor ops
        bump the version counters themselves."""
        from ropekit.backends.eager import qk_norm as qk_norm_eager

        qk_norm_eager.launch(qkv, q_weight.detach(), k_weight.detach(), cos, sin, positions, offset, spec)

    def rotate_qk(
        self, q, k, cos, sin, positions, *, interleaved, conjugate, inplace, offset=0, numerics="exact"
    ):
        positions = table_rows(positions, offset, q, cos.shape[0])
        kw = dict(interleaved=interleaved, conjugate=conjugate, inplace=inplace, numerics=numerics)
        q_out = rotate(q, cos, sin, positions, **kw)
        k_out = None if k is None else rotate(k, cos, sin, positions, **kw)
        return q_out, k_out
