"""ropekit.fused.checks: cache layouts as one (pages, page_size, heads, D) view, scales."""

from __future__ import annotations

import pytest
import torch

from ropekit.fused.checks import cache_view, check_scale


@pytest.mark.parametrize(
    ("layout", "shape"), [("flat", (12, 2, 8)), ("nhd", (3, 4, 2, 8)), ("hnd", (3, 2, 4, 8))]
)
def test_every_layout_is_one_view_whose_flat_slot_is_page_times_page_size_plus_index(layout, shape):
    cache = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    view = cache_view("k_cache", cache, layout, 2, 8, torch.float32, cache.device)
    pages, page_size = view.shape[:2]
    assert pages * page_size == 12 and view.data_ptr() == cache.data_ptr()
    slot = 7
    page, index = divmod(slot, page_size)
    want = {
        "flat": lambda: cache[slot],
        "nhd": lambda: cache[page, index],
        "hnd": lambda: cache[page, :, index],
    }
    want = want[layout]()
    assert torch.equal(view[page, index], want)


def test_fp8_caches_are_viewed_as_their_bytes_and_other_dtypes_are_refused():
    cache = torch.zeros(2, 4, 1, 8, dtype=torch.float8_e5m2)
    assert cache_view("k_cache", cache, "nhd", 1, 8, torch.bfloat16, cache.device).dtype == torch.uint8
    with pytest.raises(ValueError, match=r"k_cache: expected dtype in \['torch.bfloat16'"):
        cache_view("k_cache", cache.half(), "nhd", 1, 8, torch.bfloat16, cache.device)
    with pytest.raises(ValueError, match="k_cache: expected a last axis of stride 1"):
        cache_view("k_cache", torch.zeros(2, 4, 1, 16)[..., ::2], "nhd", 1, 8, torch.float32, cache.device)


def test_scales_are_a_float_a_0d_tensor_or_one_per_head_and_positive():
    cpu = torch.device("cpu")
    assert check_scale("k_scale", 0.5, 4, cpu).tolist() == [0.5]
    assert check_scale("k_scale", torch.tensor(2.0, dtype=torch.float64), 4, cpu).dtype == torch.float32
    assert check_scale("k_scale", torch.tensor([1.0, 2.0, 3.0, 4.0]), 4, cpu).shape == (4,)
    for bad in (0.0, -1.0, float("inf"), True, torch.tensor([1.0, 2.0]), torch.tensor([1, 2, 3, 4])):
        with pytest.raises(ValueError, match="k_scale"):
            check_scale("k_scale", bad, 4, cpu)
