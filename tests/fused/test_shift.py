"""ropekit.fused.shift: shifting a cache by delta equals writing it at p + delta (torch and cpu backends)."""

from __future__ import annotations

import pytest
import torch
from fused_cases import LAYOUTS, check_shift, tables

import ropekit
from c_compiler import CPU


@pytest.mark.parametrize("backend", ["torch", CPU])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("delta", [7, -13])
@pytest.mark.parametrize("with_slots", [False, True])
def test_shift_by_delta_equals_writing_at_p_plus_delta(backend, layout, delta, with_slots):
    check_shift(backend, layout, torch.float32, delta, interleaved=delta < 0, with_slots=with_slots)


@pytest.mark.parametrize("backend", ["torch", CPU])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_shift_in_half_precision(backend, dtype):
    check_shift(backend, "nhd", dtype, 5, interleaved=False, with_slots=True)


@pytest.mark.c_compiler
def test_shift_there_and_back_is_the_identity_to_rounding():
    cos, sin = tables(16)
    cache = torch.randn(3, 4, 2, 16)
    before = cache.clone()
    ropekit.shift_cache_(cache, cos, sin, 11, backend="cpu")
    assert not torch.allclose(cache, before)
    ropekit.shift_cache_(cache, cos, sin, -11, backend="cpu")
    torch.testing.assert_close(cache, before, rtol=1e-6, atol=1e-6)


@pytest.mark.c_compiler
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


@pytest.mark.parametrize("backend", ["torch", CPU])
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


@pytest.mark.parametrize("backend", ["torch", CPU])
def test_a_slot_given_twice_is_refused_before_anything_rotates(backend):
    """Issue 24, defect 3: slots [3, 3] rotated slot 3 twice on the cpu backend and once on torch."""
    cos, sin = ropekit.RopeConfig(16).cos_sin(64)
    cache = torch.randn(5, 1, 16)
    before = cache.clone()
    with pytest.raises(ValueError, match=r"slots: slot 3 is given twice"):
        ropekit.shift_cache_(
            cache, cos, sin, 3, cache_layout="flat", slots=torch.tensor([3, 3]), backend=backend
        )
    assert torch.equal(cache, before)


@pytest.mark.parametrize("backend", ["torch", CPU])
def test_shift_bumps_the_version_counter_and_refuses_an_inference_cache_outside_inference_mode(backend):
    cos, sin = ropekit.RopeConfig(16).cos_sin(64)
    cache = torch.randn(5, 1, 16)
    version = cache._version
    ropekit.shift_cache_(cache, cos, sin, 3, cache_layout="flat", backend=backend)
    assert cache._version > version
    with torch.inference_mode():
        frozen = torch.randn(5, 1, 16)
    before = frozen.clone()
    with pytest.raises(RuntimeError, match=r"k_cache: an inference tensor"):
        ropekit.shift_cache_(frozen, cos, sin, 3, cache_layout="flat", backend=backend)
    assert torch.equal(frozen, before)
    with torch.inference_mode():
        ropekit.shift_cache_(frozen, cos, sin, 3, cache_layout="flat", backend=backend)
    assert not torch.equal(frozen, before)


@pytest.mark.parametrize("backend", ["torch", CPU])
@pytest.mark.parametrize("read", ["cos", "slots"])
def test_a_table_or_slots_inside_the_cache_is_a_value_error_and_nothing_rotates(backend, read):
    """Issue 24, the memory rule: the cache is rotated in place of itself; a table or the slots read from its
    own memory would be overwritten while they are read (the row |delta| rotated by itself)."""
    cos, sin = ropekit.RopeConfig(16).cos_sin(64)
    cache = torch.randn(6, 1, 16)
    kw = dict(cache_layout="flat", backend=backend)
    if read == "cos":
        cos, sin = (
            cache.view(-1)[: 4 * 8].view(4, 8),
            sin[:4],
        )  # rows 0..3 of the table: the cache's slot 0, 1
    else:
        cache.view(-1)[-2:].view(torch.int64)[0] = 1  # the last float pair holds slot id 1, as an int64
        kw["slots"] = cache.view(-1)[-2:].view(torch.int64)  # (1,): a slot that lies in the cache
    before = cache.clone()
    with pytest.raises(ValueError, match=rf"k_cache: it is written and shares memory with {read}"):
        ropekit.shift_cache_(cache, cos, sin, 3, **kw)
    assert torch.equal(cache, before)
