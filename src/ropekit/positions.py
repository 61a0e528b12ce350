"""Turning the caller's position arguments into one integer index per token.

Every backend receives ``positions`` resolved here: an int64 tensor of shape x.shape[:-2] (``(batch, seq)``,
or ``(total_tokens,)`` for packed input), each entry a row of the cos/sin tables. Resolving once, here, is
what lets one kernel serve plain, offset, per-sequence-offset, packed (cu_seqlens) and arbitrary-id inputs.
"""

from __future__ import annotations

import itertools
import numbers

import torch

from ropekit.validation import describe, is_compiling

__all__ = ["check_cu_seqlens", "resolve_positions"]


def _is_integer_tensor(t: object) -> bool:
    return isinstance(t, torch.Tensor) and not (
        t.is_floating_point() or t.is_complex() or t.dtype == torch.bool
    )


def check_cu_seqlens(cu_seqlens: object, total_tokens: int) -> torch.Tensor:
    """cu_seqlens: int32/int64, shape (n+1,), starts at 0, non-decreasing, ends at total_tokens."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens: expected an int32 or int64 tensor, got {describe(cu_seqlens)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens: expected shape (num_seqs + 1,) with num_seqs >= 1, got {tuple(cu_seqlens.shape)}"
        )
    if not is_compiling():
        values = cu_seqlens.tolist()
        if values[0] != 0 or values[-1] != total_tokens or any(b < a for a, b in itertools.pairwise(values)):
            raise ValueError(
                f"cu_seqlens: expected non-decreasing offsets from 0 to total_tokens ({total_tokens}), "
                f"got {values[:8]}{'...' if len(values) > 8 else ''}"
            )
    return cu_seqlens


def _offsets_tensor(offsets: int | torch.Tensor, n: int, what: str, device: torch.device) -> torch.Tensor:
    """offsets as a non-negative int64 tensor of shape (n,)."""
    if isinstance(offsets, torch.Tensor):
        if not _is_integer_tensor(offsets):
            raise ValueError(f"offsets: expected an int or an integer tensor, got {describe(offsets)}")
        if offsets.dim() != 1 or offsets.shape[0] != n:
            raise ValueError(
                f"offsets: expected an int or a tensor of shape ({n},) (one per {what}), "
                f"got shape {tuple(offsets.shape)}"
            )
        if n and not is_compiling() and int(offsets.min()) < 0:
            raise ValueError(f"offsets: expected values >= 0, got a minimum of {int(offsets.min())}")
        return offsets.to(device=device, dtype=torch.int64)
    if isinstance(offsets, bool) or not isinstance(offsets, numbers.Integral) or offsets < 0:
        raise ValueError(
            f"offsets: expected a non-negative int or an integer tensor, got {describe(offsets)}"
        )
    return torch.full((n,), int(offsets), dtype=torch.int64, device=device)


def resolve_positions(
    x: torch.Tensor,
    *,
    positions: torch.Tensor | None,
    offsets: int | torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    table_len: int | None,
) -> torch.Tensor:
    """Return int64 positions of shape x.shape[:-2] (see the module docstring), validated against table_len.

    Args:
        x: (B, S, H, D), or (T, H, D) when cu_seqlens is given; only its shape and device are read.
        positions: None, or an integer tensor of shape x.shape[:-2] giving every token's position directly.
        offsets: an int or an integer tensor with one entry per sequence, added to each sequence's arange.
        cu_seqlens: None, or the (N + 1,) cumulative lengths of a packed batch.
        table_len: rows in the cos/sin table; positions must lie in [0, table_len).

    Raises:
        ValueError: positions not an integer tensor of shape x.shape[:-2], negative or >= table_len; offsets
            non-zero together with positions, negative, or not one per sequence; malformed cu_seqlens.
    """
    lead = tuple(x.shape[:-2])  # (batch, seq) or (total_tokens,)
    cu = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, lead[0])
    if positions is not None:
        if not _is_integer_tensor(positions):
            raise ValueError(f"positions: expected an integer tensor, got {describe(positions)}")
        if tuple(positions.shape) != lead:
            want = "(total_tokens,)" if cu is not None else "(batch, seq)"
            raise ValueError(f"positions: expected shape {want} = {lead}, got {tuple(positions.shape)}")
        if isinstance(offsets, torch.Tensor) or offsets != 0:
            raise ValueError(
                f"offsets: expected 0 when positions is given (positions are absolute), "
                f"got {describe(offsets)}"
            )
        pos = positions.to(device=x.device, dtype=torch.int64)
    elif cu is not None:
        total = lead[0]
        cu = cu.to(device=x.device, dtype=torch.int64)
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
        lo, hi = torch.stack(torch.aminmax(pos)).tolist()  # one device sync, not two
        if lo < 0:
            raise ValueError(f"positions: expected values >= 0, got a minimum of {lo}")
        if hi >= table_len:
            raise ValueError(
                f"positions: largest position {hi} is past the cos/sin table (table_len {table_len}); "
                f"expected positions < table_len, so build a table with at least {hi + 1} rows"
            )
    return pos
