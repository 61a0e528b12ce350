"""Turning the caller's position arguments into one table row per token.

Every backend receives positions resolved here, as a :class:`Positions`: either an int64 tensor of shape
x.shape[:-2] (``(batch, seq)``, or ``(total_tokens,)`` for packed input), each entry a row of the cos/sin
tables, or, for the common prefill / decode call with one int offset, no tensor at all: the rows are
``offset + arange(seq)`` for every batch row, and the kernels compute them. Resolving once, here, is what lets
one kernel serve plain, offset, per-sequence-offset, packed (cu_seqlens) and arbitrary-id inputs.

Where value checks run (docs/safety.md): on the host for CPU tensors in eager mode, with integer arithmetic
for an int offset, and on the device for CUDA (and meta) tensors, inside the kernels, so that no call reads a
tensor's values back to the host.
"""

from __future__ import annotations

import itertools
import numbers
from typing import NamedTuple

import torch

from ropekit.dtensor_inputs import local
from ropekit.validation import check_movable, check_x, describe, is_compiling

__all__ = ["Positions", "check_cu_seqlens", "check_offsets_beside_positions", "resolve", "resolve_positions"]

# Positions and offsets are int64 in every kernel; anything at or past this cannot be a table row.
INT64_LIMIT = 1 << 63


class Positions(NamedTuple):
    """Every token's cos/sin table row, resolved once per call by :func:`resolve`.

    Attributes:
        tensor: int64 rows of shape x.shape[:-2] on x's device, or None when the rows are
            ``offset + arange(seq)`` for every batch row (an int offset on 4-D (batch, seq, heads, head_dim)
            input).
        offset: the int offset when tensor is None; 0 otherwise.
        largest: the largest row used (-1 when there are no tokens) when it is known on the host without a
            device sync: always for an int offset, for CPU tensors in eager mode. None for tensors on other
            devices and under torch.compile, where the kernels check the rows on the device instead.
    """

    tensor: torch.Tensor | None
    offset: int
    largest: int | None

    def as_tensor(self, x: torch.Tensor) -> torch.Tensor:
        """The rows as an int64 tensor of shape x.shape[:-2] (materialising offset + arange(seq))."""
        if self.tensor is not None:
            return self.tensor
        batch, seq = x.shape[:2]
        rows = torch.arange(self.offset, self.offset + seq, device=x.device)  # (seq,)
        return rows.expand(batch, seq)  # (batch, seq)

    def check_table(self, table_len: int) -> None:
        """Raise if a host-known row is past a table of table_len rows (device-side rows: see the kernels)."""
        if self.largest is not None and self.largest >= table_len:
            raise ValueError(
                f"positions: largest position {self.largest} is past the cos/sin table (table_len "
                f"{table_len}); expected positions < table_len, so build a table with at least "
                f"{self.largest + 1} rows"
            )


def _is_integer_tensor(t: object) -> bool:
    return isinstance(t, torch.Tensor) and not (
        t.is_floating_point() or t.is_complex() or t.dtype == torch.bool
    )


def _host_checked(t: torch.Tensor) -> bool:
    """Whether t's values may be read here: CPU tensors in eager mode (no device sync, not traced)."""
    return t.device.type == "cpu" and not is_compiling()


def check_cu_seqlens(cu_seqlens: object, total_tokens: int) -> torch.Tensor:
    """cu_seqlens: int32/int64, shape (n+1,), starts at 0, non-decreasing, ends at total_tokens.

    The values are checked on the host for CPU tensors, and with a device-side assert otherwise (no sync).
    """
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens: expected an int32 or int64 tensor, got {describe(cu_seqlens)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens: expected shape (num_seqs + 1,) with num_seqs >= 1, got {tuple(cu_seqlens.shape)}"
        )
    if _host_checked(cu_seqlens):
        values = cu_seqlens.tolist()
        if values[0] != 0 or values[-1] != total_tokens or any(b < a for a, b in itertools.pairwise(values)):
            raise ValueError(
                f"cu_seqlens: expected non-decreasing offsets from 0 to total_tokens ({total_tokens}), "
                f"got {values[:8]}{'...' if len(values) > 8 else ''}"
            )
    else:
        ok = (cu_seqlens[0] == 0) & (cu_seqlens[-1] == total_tokens) & (cu_seqlens.diff() >= 0).all()
        torch._assert_async(ok, "cu_seqlens: expected non-decreasing offsets from 0 to total_tokens")
    return cu_seqlens


def _check_int_offset(offsets: object) -> int:
    if isinstance(offsets, bool) or not isinstance(offsets, (numbers.Integral, torch.SymInt)):
        raise ValueError(
            f"offsets: expected a non-negative int or an integer tensor, got {describe(offsets)}"
        )
    if isinstance(offsets, numbers.Integral) and not 0 <= offsets < INT64_LIMIT:
        raise ValueError(
            f"offsets: expected a non-negative int or an integer tensor, got {describe(offsets)}"
            + (" (past int64: no table has that many rows)" if offsets >= INT64_LIMIT else "")
        )
    return offsets if isinstance(offsets, torch.SymInt) else int(offsets)


def _offsets_tensor(offsets: int | torch.Tensor, n: int, what: str, device: torch.device) -> torch.Tensor:
    """offsets as an int64 tensor of shape (n,); negative values are caught where the rows are checked."""
    if isinstance(offsets, torch.Tensor):
        if not _is_integer_tensor(offsets):
            raise ValueError(f"offsets: expected an int or an integer tensor, got {describe(offsets)}")
        if offsets.dim() != 1 or offsets.shape[0] != n:
            raise ValueError(
                f"offsets: expected an int or a tensor of shape ({n},) (one per {what}), "
                f"got shape {tuple(offsets.shape)}"
            )
        if n and _host_checked(offsets) and int(offsets.min()) < 0:
            raise ValueError(f"offsets: expected values >= 0, got a minimum of {int(offsets.min())}")
        return offsets.to(device=device, dtype=torch.int64)
    return torch.full((n,), _check_int_offset(offsets), dtype=torch.int64, device=device)


def check_offsets_beside_positions(offsets: object) -> None:
    """Positions are absolute: beside them the offset must be 0 (the rule of :func:`resolve`, and of every
    registered op that takes positions and an offset)."""
    if isinstance(offsets, torch.Tensor) or offsets != 0:
        raise ValueError(
            f"offsets: expected 0 when positions is given (positions are absolute), got {describe(offsets)}"
        )


def resolve(
    x: torch.Tensor,
    *,
    positions: torch.Tensor | None = None,
    offsets: int | torch.Tensor = 0,
    cu_seqlens: torch.Tensor | None = None,
    name: str = "x",
) -> Positions:
    """Validate the position arguments for x and resolve them into :class:`Positions` (no table check).

    Args:
        x: (B, S, H, D), or (T, H, D) when cu_seqlens is given; only its shape and device are read.
        positions: None, or an integer tensor of shape x.shape[:-2] giving every token's position directly.
        offsets: an int or an integer tensor with one entry per sequence, added to each sequence's arange.
        cu_seqlens: None, or the (N + 1,) cumulative lengths of a packed batch.
        name: x's name in error messages ("q" for apply_rotary_qk).

    Returns:
        Positions; for an int offset on 4-D x, no tensor and ``largest = offset + S - 1`` (plain integers).

    Raises:
        ValueError: x of the wrong rank; positions not an integer tensor of shape x.shape[:-2] or negative;
            offsets non-zero together with positions, negative, past int64 or not one per sequence; malformed
            cu_seqlens. Value checks of non-CPU tensors run on the device (see the module docstring).
    """
    check_x(name, x, varlen=cu_seqlens is not None)
    if cu_seqlens is None and positions is None and type(offsets) is int and 0 <= offsets < INT64_LIMIT:
        # The fast path (prefill / decode with one int offset): no tensor, the range is integer arithmetic.
        if is_compiling():  # offset may be symbolic: the kernels check the range when the graph runs
            return Positions(None, offsets, None)
        batch, seq = x.shape[0], x.shape[1]
        return Positions(None, offsets, offsets + seq - 1 if batch and seq else -1)
    lead = tuple(x.shape[:-2])  # (batch, seq) or (total_tokens,)
    for arg, value in (("positions", positions), ("offsets", offsets), ("cu_seqlens", cu_seqlens)):
        check_movable(arg, value, x.device)
    cu = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, lead[0])
    if positions is not None:
        if not _is_integer_tensor(positions):
            raise ValueError(f"positions: expected an integer tensor, got {describe(positions)}")
        if tuple(positions.shape) != lead:
            want = "(total_tokens,)" if cu is not None else "(batch, seq)"
            raise ValueError(f"positions: expected shape {want} = {lead}, got {tuple(positions.shape)}")
        if isinstance(offsets, torch.Tensor) or offsets != 0:  # the test inline: no call on the hot path
            check_offsets_beside_positions(offsets)
        pos = positions.to(device=x.device, dtype=torch.int64)
    elif cu is not None:
        total = lead[0]
        cu = cu.to(device=x.device, dtype=torch.int64)
        n = cu.shape[0] - 1
        token = torch.arange(total, device=x.device)  # (total_tokens,)
        seq_id = torch.searchsorted(cu[1:], token, right=True)  # which packed sequence holds each token
        seq_id = seq_id.clamp(max=n - 1)
        pos = token - cu[seq_id] + _offsets_tensor(offsets, n, "packed sequence", x.device)[seq_id]
    elif isinstance(offsets, torch.Tensor):
        batch, seq = lead
        off = _offsets_tensor(offsets, batch, "batch row", x.device)
        pos = off[:, None] + torch.arange(seq, device=x.device)[None, :]  # (batch, seq)
    else:
        offset = _check_int_offset(offsets)  # the fast path: no tensor, the range is integer arithmetic
        if is_compiling():  # offset may be symbolic: the kernels check the range when the graph runs
            return Positions(None, offset, None)
        return Positions(None, offset, offset + lead[1] - 1 if lead[0] and lead[1] else -1)
    largest = None
    if _host_checked(pos):
        largest = -1
        values = local(pos)  # a DTensor: this rank's rows, the ones it rotates (no collective)
        if values.numel():
            lo, largest = torch.stack(torch.aminmax(values)).tolist()  # CPU: no device sync
            if lo < 0:
                raise ValueError(f"positions: expected values >= 0, got a minimum of {lo}")
    return Positions(pos.contiguous(), 0, largest)


def resolve_positions(
    x: torch.Tensor,
    *,
    positions: torch.Tensor | None,
    offsets: int | torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    table_len: int | None,
) -> torch.Tensor:
    """:func:`resolve`, then the table check, as one int64 tensor of shape x.shape[:-2].

    Args:
        table_len: rows in the cos/sin table; host-known positions must lie in [0, table_len). None: no check.

    Raises:
        ValueError: as :func:`resolve`, and for a host-known position >= table_len.
    """
    pos = resolve(x, positions=positions, offsets=offsets, cu_seqlens=cu_seqlens)
    if table_len is not None:
        pos.check_table(table_len)
    return pos.as_tensor(x)
