"""The schedule registry: user schedules, aliases, and key checking."""

from __future__ import annotations

import pytest
import torch

from ropekit import RopeConfig, register_schedule
from ropekit.schedules import SCHEDULES, get_schedule, split_scaling


def test_a_user_schedule_is_one_function_and_one_registration():
    @register_schedule("halve_test", required=("factor",), optional=("note",))
    def halve(spec, seq_len):
        return spec.default_inv_freq() / spec.params["factor"], 0.5

    try:
        config = RopeConfig(32, scaling={"rope_type": "halve_test", "factor": 2.0})
        torch.testing.assert_close(config.inv_freq() * 2, RopeConfig(32).inv_freq())
        assert config.attention_scaling() == 0.5
        cos, _ = config.cos_sin(1)
        assert cos[0, 0] == 0.5
    finally:
        del SCHEDULES["halve_test"]


def test_legacy_aliases_resolve():
    assert get_schedule("su").name == "longrope"
    assert get_schedule("mrope").name == "default"


def test_structural_keys_are_not_schedule_parameters_unless_declared():
    sched, params = split_scaling(
        {"type": "linear", "factor": 2, "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    )
    assert sched.name == "linear" and params == {"factor": 2}
    _, params = split_scaling({"rope_type": "proportional", "partial_rotary_factor": 0.5})
    assert params == {"partial_rotary_factor": 0.5}


def test_rope_theta_inside_scaling_must_agree_with_base():
    assert RopeConfig(64, 5e5, scaling={"rope_type": "default", "rope_theta": 5e5}).base == 5e5
    with pytest.raises(ValueError, match=r"rope_theta'\]: 10000.0 disagrees with base=500000.0"):
        RopeConfig(64, 5e5, scaling={"rope_type": "default", "rope_theta": 10000.0})


def test_partial_rotary_factor_inside_scaling_sets_rotary_dim():
    assert RopeConfig(96, scaling={"rope_type": "default", "partial_rotary_factor": 0.25}).rotary_dim == 24
    with pytest.raises(ValueError, match="rotary_dim: 32 disagrees with"):
        RopeConfig(96, rotary_dim=32, scaling={"partial_rotary_factor": 0.25})


def test_hunyuan_dynamic_with_alpha_given_directly_is_ntk_alpha():
    # Issue 26: RopeConfig refused {"rope_type": "dynamic", "alpha": ...} unless it came through from_hf.

    direct = RopeConfig(128, 10000.0, scaling={"rope_type": "dynamic", "alpha": 1000.0})
    assert direct.rope_type == "ntk_alpha" and not direct.length_dependent
    named = RopeConfig(128, 10000.0, scaling={"rope_type": "ntk_alpha", "alpha": 1000.0})
    torch.testing.assert_close(direct.inv_freq(), named.inv_freq(), rtol=0, atol=0)
    want = 1.0 / (10000.0 * 1000.0 ** (128 / 126)) ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128)
    torch.testing.assert_close(direct.inv_freq(seq_len=100_000), want, rtol=1e-14, atol=0)
    with pytest.raises(ValueError, match="unknown keys"):  # alpha's schedule takes alpha alone
        RopeConfig(128, 10000.0, scaling={"rope_type": "dynamic", "alpha": 1000.0, "factor": 2.0})
