"""p-RoPE: the first share of the pairs rotates with full-width exponents; the rest have frequency zero."""

from __future__ import annotations

import torch

from ropekit import RopeConfig


def test_proportional_rotates_a_share_and_freezes_the_rest():
    config = RopeConfig(64, 1e4, scaling={"rope_type": "proportional", "partial_rotary_factor": 0.25})
    got = config.inv_freq()
    assert got.shape == (32,)
    torch.testing.assert_close(got[:8], RopeConfig(64, 1e4).inv_freq()[:8], rtol=0, atol=0)
    assert torch.all(got[8:] == 0)
    cos, sin = config.cos_sin(torch.tensor([12345]))
    assert torch.all(cos[0, 8:] == 1) and torch.all(sin[0, 8:] == 0)
