"""M-RoPE sections: which axis drives each pair, in Qwen2-VL's chunked and Qwen3-VL's interleaved layouts."""

from __future__ import annotations

import pytest
import torch

from ropekit import RopeConfig
from ropekit.schedules import mrope_axis_of_pair


def test_chunked_sections_are_contiguous_and_interleaved_ones_cycle():
    assert mrope_axis_of_pair([2, 3, 3], False).tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert mrope_axis_of_pair([4, 2, 2], True).tolist() == [0, 1, 2, 0, 1, 2, 0, 0]
    assert torch.bincount(mrope_axis_of_pair([24, 20, 20], True)).tolist() == [24, 20, 20]


@pytest.mark.parametrize(
    "scaling",
    [
        {"type": "mrope", "mrope_section": [16, 24, 24]},
        {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True},
    ],
)
def test_text_tokens_reduce_exactly_to_1d_rope(scaling):
    config = RopeConfig(128, 1e6, scaling=scaling)
    text = torch.randint(0, 100_000, (2, 7))  # (B, S)
    cos3, sin3 = config.cos_sin(text.expand(3, 2, 7))  # t = h = w
    cos1, sin1 = RopeConfig(128, 1e6).cos_sin(text)
    assert torch.equal(cos3, cos1) and torch.equal(sin3, sin1)


def test_each_pair_takes_the_angle_of_its_own_axis():
    config = RopeConfig(16, 1e4, scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    positions = torch.tensor([5, 7, 11]).reshape(3, 1, 1)  # one token at t=5, h=7, w=11
    cos, _ = config.cos_sin(positions, dtype=torch.float64)
    theta = config.inv_freq()
    want = torch.cos(torch.tensor([5, 5, 7, 7, 7, 11, 11, 11], dtype=torch.float64) * theta)
    torch.testing.assert_close(cos[0, 0], want, rtol=0, atol=1e-15)


def test_bad_sections_are_rejected():
    with pytest.raises(ValueError, match="summing to rotary_dim / 2 = 8"):
        RopeConfig(16, scaling={"type": "mrope", "mrope_section": [2, 2, 2]})
    with pytest.raises(ValueError, match="cannot be interleaved"):
        RopeConfig(16, scaling={"mrope_section": [2, 0, 6], "mrope_interleaved": True})
