"""YaRN: fast pairs kept, slow pairs interpolated, a ramp between; the attention factor forms."""

from __future__ import annotations

import math

import pytest
import torch

from ropekit import RopeConfig


def _yarn(**keys) -> RopeConfig:
    scaling = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096, **keys}
    return RopeConfig(128, 1e4, scaling=scaling)


def test_pairs_with_many_rotations_are_kept_and_slow_pairs_divided_by_factor():
    plain = RopeConfig(128, 1e4).inv_freq()
    ratio = _yarn().inv_freq() / plain
    rotations = 4096 * plain / (2 * math.pi)
    assert torch.all(ratio[rotations > 32] == 1.0)
    torch.testing.assert_close(ratio[rotations < 1], torch.full_like(ratio[rotations < 1], 1 / 16))
    assert torch.all(ratio[1:] <= ratio[:-1])  # monotone ramp from kept to interpolated


def test_attention_factor_forms():
    assert _yarn().attention_scaling() == pytest.approx(0.1 * math.log(16) + 1)
    deepseek = _yarn(mscale=0.707, mscale_all_dim=1.0).attention_scaling()
    assert deepseek == pytest.approx((0.0707 * math.log(16) + 1) / (0.1 * math.log(16) + 1))
    assert _yarn(attention_factor=1.5).attention_scaling() == 1.5


def test_a_null_factor_defaults_to_the_length_ratio():
    implicit = RopeConfig(
        64,
        1e4,
        scaling={"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 4096},
        max_position_embeddings=65536,
    )
    explicit = RopeConfig(
        64, 1e4, scaling={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096}
    )
    torch.testing.assert_close(implicit.inv_freq(), explicit.inv_freq(), rtol=0, atol=0)


def test_telechat3_attention_factor_is_yarn_with_0_07():
    from ropekit.schedules.yarn import telechat3_attention_factor

    assert telechat3_attention_factor(4.0) == pytest.approx(0.07 * math.log(4.0) + 1.0, rel=1e-15)
    assert telechat3_attention_factor(4.0, 2.0) == pytest.approx(2 * (0.07 * math.log(4.0) + 1.0), rel=1e-15)
    assert telechat3_attention_factor(1.0) == 1.0  # no extension, no temperature


@pytest.mark.parametrize(
    ("factor", "attn_factor", "match"),
    [("4", 1.0, "factor"), (4.0, "2", "attn_factor"), (4.0, float("nan"), "attn_factor"),
     (0.0, 1.0, "factor"), (True, 1.0, "factor")],
)  # fmt: skip
def test_telechat3_attention_factor_of_a_value_that_is_not_a_positive_number_is_a_value_error(
    factor, attn_factor, match
):
    from ropekit.schedules.yarn import telechat3_attention_factor

    with pytest.raises(ValueError, match=rf"rope_parameters\['{match}'\]: expected a finite number > 0"):
        telechat3_attention_factor(factor, attn_factor)
    params = {"rope_type": "telechat3-yarn", "factor": factor, "attn_factor": attn_factor, "rope_theta": 1e4,
              "original_max_position_embeddings": 4096}  # fmt: skip
    with pytest.raises(ValueError, match=match):
        RopeConfig.from_hf({"head_dim": 64, "max_position_embeddings": 16384, "rope_parameters": params})
