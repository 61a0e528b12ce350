"""resolve_positions turns (positions | offsets | cu_seqlens) into one table row per token."""

from __future__ import annotations

import pytest
import torch

from ropekit import positions as rp
from ropekit.positions import resolve_positions


def resolve(x, *, positions=None, offsets=0, cu_seqlens=None, table_len=1000):
    return resolve_positions(
        x, positions=positions, offsets=offsets, cu_seqlens=cu_seqlens, table_len=table_len
    )


def test_default_positions_are_arange_per_batch_row():
    pos = resolve(torch.empty(2, 3, 1, 4))
    assert pos.dtype == torch.int64
    assert pos.tolist() == [[0, 1, 2], [0, 1, 2]]


def test_int_offsets_shift_every_row():
    assert resolve(torch.empty(2, 3, 1, 4), offsets=5).tolist() == [[5, 6, 7], [5, 6, 7]]


def test_tensor_offsets_shift_each_row_on_its_own():
    pos = resolve(torch.empty(2, 3, 1, 4), offsets=torch.tensor([1, 10], dtype=torch.int32))
    assert pos.tolist() == [[1, 2, 3], [10, 11, 12]]


def test_packed_sequences_restart_at_zero_plus_their_offset():
    x = torch.empty(7, 1, 4)  # (total_tokens, heads, head_dim)
    cu = torch.tensor([0, 2, 2, 7], dtype=torch.int32)  # lengths 2, 0, 5
    assert resolve(x, cu_seqlens=cu).tolist() == [0, 1, 0, 1, 2, 3, 4]
    assert resolve(x, cu_seqlens=cu, offsets=torch.tensor([4, 9, 1])).tolist() == [4, 5, 1, 2, 3, 4, 5]
    assert resolve(x, cu_seqlens=cu, offsets=2).tolist() == [2, 3, 2, 3, 4, 5, 6]


def test_explicit_positions_pass_through_as_int64():
    positions = torch.tensor([[3, 1, 4], [1, 5, 9]], dtype=torch.int16)
    pos = resolve(torch.empty(2, 3, 1, 4), positions=positions)
    assert pos.dtype == torch.int64 and pos.tolist() == positions.tolist()


def test_explicit_positions_win_over_cu_seqlens():
    pos = resolve(
        torch.empty(4, 1, 2), positions=torch.tensor([9, 8, 7, 6]), cu_seqlens=torch.tensor([0, 1, 4])
    )
    assert pos.tolist() == [9, 8, 7, 6]


def test_no_table_length_means_no_range_check():
    assert resolve(torch.empty(1, 2, 1, 2), offsets=5000, table_len=None).tolist() == [[5000, 5001]]


def test_an_int_offset_resolves_to_no_tensor():
    """The decode fast path: an int offset is carried as a number, its range checked with integers."""
    x = torch.empty(2, 3, 1, 8)
    pos = rp.resolve(x, offsets=7)
    assert pos.tensor is None and pos.offset == 7 and pos.largest == 9
    assert pos.as_tensor(x).tolist() == [[7, 8, 9], [7, 8, 9]]
    with pytest.raises(ValueError, match=r"largest position 9 is past the cos/sin table \(table_len 9\)"):
        pos.check_table(9)
    assert rp.resolve(torch.empty(0, 3, 1, 8), offsets=5000).largest == -1  # no tokens: nothing to check


def test_cpu_tensor_positions_report_their_largest_row_and_device_ones_do_not():
    x = torch.empty(2, 3, 1, 8)
    assert rp.resolve(x, offsets=torch.tensor([4, 1])).largest == 6
    assert rp.resolve(x, positions=torch.tensor([[0, 9, 2], [1, 1, 1]])).largest == 9
    on_meta = rp.resolve(x.to("meta"), positions=torch.zeros(2, 3, dtype=torch.long, device="meta"))
    assert on_meta.largest is None  # unknown without reading the device: the kernels check instead
    on_meta.check_table(1)  # nothing to check on the host


def test_negative_per_sequence_offsets_are_rejected_with_their_value():
    with pytest.raises(ValueError, match=r"offsets: expected values >= 0, got a minimum of -4"):
        rp.resolve(torch.empty(2, 3, 1, 8), offsets=torch.tensor([3, -4]))
