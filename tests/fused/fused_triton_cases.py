"""The fused serving kernel under Triton's interpreter: the same checks as the torch and cpu backends.

Run only by test_fused_triton.py, in a subprocess with TRITON_INTERPRET=1 (see tests/triton_interpreter.py).
The interpreter is slow, so the grid covers each switch of the kernel once rather than every product.
"""

from __future__ import annotations

import pytest
import torch
from fused_cases import (
    FP8,
    LAYOUTS,
    check_cache_write,
    check_cache_write_fp8,
    check_duplicate_slots_are_refused,
    check_errors_write_nothing,
    check_fp8,
    check_fp8_mla,
    check_memory_rule,
    check_shift,
    check_wide_heads,
)

from ropekit.backends.triton.rotary import interpreter_enabled

pytestmark = pytest.mark.skipif(
    not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (test_fused_triton.py)"
)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", ["offsets", "cu_seqlens", "positions"])
def test_triton_cache_write_matches_the_reference(layout, mode):
    check_cache_write("triton", mode, layout, torch.float32, interleaved=mode == "positions", inplace=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_cache_write_half_precision_partial(dtype):
    check_cache_write("triton", "offsets_per_seq", "nhd", dtype, True, False, partial=True)


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_triton_fp8_cache(fp8_dtype):
    check_cache_write_fp8("triton", "hnd", fp8_dtype, per_head=True)


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("interleaved", [False, True])
def test_triton_fp8_contract_bit_for_bit(fp8_dtype, interleaved):
    check_fp8("triton", "positions", fp8_dtype, interleaved, per_head=interleaved, partial=not interleaved)


def test_triton_fp8_mla():
    check_fp8_mla("triton", torch.float8_e4m3fn)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("with_slots", [False, True])
def test_triton_shift(layout, with_slots):
    check_shift("triton", layout, torch.float32, -9, interleaved=False, with_slots=with_slots)


def test_triton_errors_write_nothing():
    check_errors_write_nothing("triton")


def test_triton_memory_rule():
    check_memory_rule("triton")


def test_triton_duplicate_slots_are_refused():
    check_duplicate_slots_are_refused("triton")


def test_triton_wide_heads_are_refused_and_auto_serves_them():
    check_wide_heads("triton")


@pytest.mark.parametrize("bad", ["row", "slot"])
def test_triton_kernel_fails_a_launch_with_a_row_or_slot_out_of_range_itself(monkeypatch, bad):
    """With the host check off, the fused kernel's own check: a table row past the table (clamped to row 0)
    or a slot past the cache (its writes skipped) fails the launch with no separate assert kernel (under the
    interpreter the launcher raises when the kernel returns; compiled, the kernel traps); the other token's
    slot is written, and nothing is written past the cache."""
    from ropekit.backends.fused_launch import Channel, FusedLaunch
    from ropekit.backends.triton import fused as fused_triton
    from ropekit.backends.triton import rotary as triton_backend
    from rotary_reference import reference_tables

    monkeypatch.setattr(triton_backend, "HOST_CHECKS", False)
    cos, sin = reference_tables(8, 16)
    k = torch.randn(1, 2, 1, 8)  # (batch, seq, heads, head_dim)
    cache = torch.zeros(1, 4, 1, 8)  # (pages, page_size, heads, head_dim): 4 slots
    positions = torch.tensor([3, 16 if bad == "row" else 4])
    slots = torch.tensor([1, 4 if bad == "slot" else 2])
    channel = Channel(src=k, dst=cache, rotate=True, by_slot=True)
    launch = FusedLaunch(1, 2, cos, sin, positions, 0, slots, False, False, (None, channel, None))
    with pytest.raises(RuntimeError, match="outside the cos/sin table or a slot outside the cache"):
        fused_triton.launch(launch, checked=True)
    assert cache[0, 1].abs().sum() > 0  # the good token was written
    if bad == "slot":
        assert cache[0, 2:].abs().sum() == 0  # the bad slot wrote nothing (and nothing went past the cache)
    fused_triton.launch(launch._replace(positions=torch.tensor([3, 4]), slots=torch.tensor([1, 2])))
