"""Turning the caller's position arguments into one integer index per token.

Every backend receives ``positions`` resolved here: an int64 tensor of shape x.shape[:-2] (``(batch, seq)``, or
``(total_tokens,)`` for packed input), each entry a row of the cos/sin tables. Resolving once, here, is what lets
one kernel serve plain, offset, per-sequence-offset, packed (cu_seqlens) and arbitrary-id inputs.
"""

from __future__ import annotations

import torch

from ropekit.validation import is_compiling

__all__ = ["resolve_positions", "check_cu_seqlens"]


def check_cu_seqlens(cu_seqlens: object, total_tokens: int) -> torch.Tensor:
    """cu_seqlens: int32/int64, shape (n+1,), starts at 0, non-decreasing, ends at total_tokens."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens: expected an int32 or int64 tensor, got {cu_seqlens!r:.80}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens: expected shape (num_seqs + 1,) with num_seqs >= 1, got {tuple(cu_seqlens.shape)}"
        )
    if not is_compiling():
        values = cu_seqlens.tolist()
        if values[0] != 0 or values[-1] != total_tokens or any(b < a for a, b in zip(values, values[1:])):
            raise ValueError(
                f"cu_seqlens: expected non-decreasing offsets from 0 to total_tokens ({total_tokens}), "
                f"got {values[:8]}{'...' if len(values) > 8 else ''}"
            )
    return cu_seqlens


def _offsets_tensor(offsets: int | torch.Tensor, n: int, what: str, device: torch.device) -> torch.Tensor:
    """offsets as an int64 tensor of shape (n,)."""
    if isinstance(offsets, torch.Tensor):
        if offsets.is_floating_point() or offsets.is_complex() or offsets.dtype == torch.bool:
            raise ValueError(f"offsets: expected an int or an integer tensor, got dtype {offsets.dtype}")
        if offsets.dim() != 1 or offsets.shape[0] != n:
            raise ValueError(
                f"offsets: expected an int or a tensor of shape ({n},) (one per {what}), "
                f"got shape {tuple(offsets.shape)}"
            )
        return offsets.to(device=device, dtype=torch.int64)
    if isinstance(offsets, bool) or not isinstance(offsets, int):
        raise ValueError(f"offsets: expected an int or an integer tensor, got {offsets!r}")
    return torch.full((n,), offsets, dtype=torch.int64, device=device)


def resolve_positions(
    x: torch.Tensor,
    *,
    positions: torch.Tensor | None,
    offsets: int | torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    table_len: int | None,
) -> torch.Tensor:
    """Return int64 positions of shape x.shape[:-2] (see the module docstring), validated against table_len."""
    lead = tuple(x.shape[:-2])  # (batch, seq) or (total_tokens,)
    if positions is not None:
        if not isinstance(positions, torch.Tensor) or positions.is_floating_point() or positions.dtype == torch.bool:
            raise ValueError(f"positions: expected an integer tensor, got {positions!r:.80}")
        if tuple(positions.shape) != lead:
            want = "(total_tokens,)" if cu_seqlens is not None else "(batch, seq)"
            raise ValueError(f"positions: expected shape {want} = {lead}, got {tuple(positions.shape)}")
        if not (isinstance(offsets, int) and not isinstance(offsets, bool) and offsets == 0):
            raise ValueError(
                f"offsets: must be 0 when positions is given (positions are absolute), got {offsets!r}"
            )
        pos = positions.to(device=x.device, dtype=torch.int64)
    elif cu_seqlens is not None:
        total = lead[0]
        cu = check_cu_seqlens(cu_seqlens, total).to(device=x.device, dtype=torch.int64)
        n = cu.shape[0] - 1
        token = torch.arange(total, device=x.device)  # (total_tokens,)
        seq_id = torch.searchsorted(cu[1:], token, right=True)  # which packed sequence holds each token
        seq_id = seq_id.clamp(max=n - 1)
        pos = token - cu[seq_id] + _offsets_tensor(offsets, n, "packed sequence", x.device)[seq_id]
    else:
        batch, seq = lead
        off = _offsets_tensor(offsets, batch, "batch row", x.device)
        pos = off[:, None] + torch.arange(seq, device=x.device)[None, :]  # (batch, seq)
    if table_len is not None and pos.numel() and not is_compiling():
        lo, hi = int(pos.min()), int(pos.max())
        if lo < 0:
            raise ValueError(f"positions: expected values >= 0, got a minimum of {lo}")
        if hi >= table_len:
            raise ValueError(
                f"positions: largest position {hi} is past the cos/sin table (table_len {table_len}); "
                f"build a table with at least {hi + 1} rows"
            )
    return pos
