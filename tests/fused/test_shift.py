"""ropekit.fused.shift: shifting a cache by delta equals writing it at p + delta (torch and cpu backends)."""

from __future__ import annotations

import pytest
import torch
from fused_cases import LAYOUTS, check_shift, tables

import ropekit


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("delta", [7, -13])
@pytest.mark.parametrize("with_slots", [False, True])
def test_shift_by_delta_equals_writing_at_p_plus_delta(backend, layout, delta, with_slots):
    check_shift(backend, layout, torch.float32, delta, interleaved=delta < 0, with_slots=with_slots)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_shift_in_half_precision(backend, dtype):
    check_shift(backend, "nhd", dtype, 5, interleaved=False, with_slots=True)


def test_shift_there_and_back_is_the_identity_to_rounding():
    cos, sin = tables(16)
    cache = torch.randn(3, 4, 2, 16)
    before = cache.clone()
    ropekit.shift_cache_(cache, cos, sin, 11, backend="cpu")
    assert not torch.allclose(cache, before)
    ropekit.shift_cache_(cache, cos, sin, -11, backend="cpu")
    torch.testing.assert_close(cache, before, rtol=1e-6, atol=1e-6)


def test_shift_by_zero_leaves_the_cache_as_it_was():
    cos, sin = tables(8)
    cache = torch.randn(6, 1, 8)
    before = cache.clone()
    ropekit.shift_cache_(cache, cos, sin, 0, cache_layout="flat", backend="cpu")
    assert torch.equal(cache, before)


def test_a_meta_table_is_a_value_error_naming_it_and_writes_nothing():
    """Issue 24: a meta cos / sin was NotImplementedError ("Cannot copy out of meta tensor")."""
    cos, sin = tables(16)
    tabs = {"cos": cos.to("meta"), "sin": sin.to("meta")}
    cache = torch.randn(10, 1, 16)
    before = cache.clone()
    with pytest.raises(ValueError, match=r"^cos: expected a tensor with values.* got a meta tensor"):
        ropekit.shift_cache_(cache, tabs["cos"], tabs["sin"], 3, cache_layout="flat")
    assert torch.equal(cache, before)


def test_a_meta_cache_is_a_value_error_naming_it():
    """Issue 24: a meta k_cache was a NotImplementedError about torch.nonzero; it has no keys to shift."""
    cos, sin = tables(16)
    with pytest.raises(ValueError, match=r"^k_cache: expected a tensor with values.* got a meta tensor"):
        ropekit.shift_cache_(torch.empty(10, 1, 16, device="meta"), cos, sin, 3, cache_layout="flat")


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("bad", [10, -2])
def test_a_slot_outside_the_cache_names_slots_the_argument_of_this_call(backend, bad):
    """Issue 24: the error named slot_mapping, an argument shift_cache_ does not have."""
    cos, sin = tables(16)
    cache = torch.randn(10, 1, 16)
    before = cache.clone()
    with pytest.raises(ValueError, match=rf"^slots: slot {bad}.* is outside the cache \(10 slots\)"):
        ropekit.shift_cache_(
            cache, cos, sin, 3, cache_layout="flat", slots=torch.tensor([1, bad]), backend=backend
        )
    assert torch.equal(cache, before)
