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
