"""Dynamic NTK: unchanged up to max_position_embeddings, then the NTK base for the current length."""

from __future__ import annotations

import torch

from ropekit import RopeConfig


def test_dynamic_is_plain_rope_up_to_the_context_length_and_ntk_beyond():
    config = RopeConfig(
        64, 1e4, scaling={"rope_type": "dynamic", "factor": 4.0}, max_position_embeddings=2048
    )
    plain = RopeConfig(64, 1e4).inv_freq()
    for seq_len in (None, 1, 2048):
        torch.testing.assert_close(config.inv_freq(seq_len), plain, rtol=0, atol=0)
    # At 4x the context the base is base * (4 * 4 - 3)^(d / (d - 2)).
    want = RopeConfig(64, 1e4 * 13 ** (64 / 62)).inv_freq()
    torch.testing.assert_close(config.inv_freq(8192), want, rtol=1e-14, atol=0)
    assert config.length_dependent and config.schedule.keeps_longest
