"""Linear scaling (position interpolation): theta_i / factor, which is the same as positions / factor."""

from __future__ import annotations

import pytest
import torch

from ropekit import RopeConfig
from ropekit.reference import inv_freq


@pytest.mark.parametrize(("dim", "base", "factor"), [(64, 1e4, 4.0), (128, 5e5, 8.0), (24, 1e3, 1.5)])
def test_linear_divides_every_frequency_by_factor(dim, base, factor):
    config = RopeConfig(dim, base, scaling={"rope_type": "linear", "factor": factor})
    want = torch.from_numpy(inv_freq(dim, base)) / factor
    torch.testing.assert_close(config.inv_freq(), want, rtol=1e-15, atol=0)
    assert config.attention_scaling() == 1.0


def test_linear_angle_at_position_f_times_m_equals_the_unscaled_angle_at_m():
    factor = 4.0
    scaled = RopeConfig(64, scaling={"rope_type": "linear", "factor": factor})
    plain = RopeConfig(64)
    m = torch.arange(0, 1000, 7, dtype=torch.float64)
    cos_s, sin_s = scaled.cos_sin(m * factor, dtype=torch.float64)
    cos_p, sin_p = plain.cos_sin(m, dtype=torch.float64)
    torch.testing.assert_close(cos_s, cos_p, rtol=0, atol=1e-11)
    torch.testing.assert_close(sin_s, sin_p, rtol=0, atol=1e-11)


@pytest.mark.parametrize("factor", [0, -2.0, float("nan"), "4"])
def test_linear_rejects_a_factor_that_is_not_a_positive_number(factor):
    with pytest.raises(ValueError, match=r"scaling\['factor'\]"):
        RopeConfig(64, scaling={"rope_type": "linear", "factor": factor})


def test_linear_without_factor_names_the_missing_key():
    with pytest.raises(ValueError, match=r"missing keys \['factor'\]"):
        RopeConfig(64, scaling={"type": "linear"})
