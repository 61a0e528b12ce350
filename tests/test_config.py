"""RopeConfig core: defaults, inv_freq, attention_scaling, cos_sin shapes and float64 angles.

Scaling schedules and HF configs are tested under tests/schedules and tests/test_hf_config.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ropekit import RopeConfig
from ropekit import reference as ref


def test_defaults():
    config = RopeConfig(64)
    assert (config.head_dim, config.base, config.rotary_dim) == (64, 10000.0, 64)
    assert (config.interleaved, config.scaling, config.max_position_embeddings) == (False, None, None)
    assert config.rope_type == "default" and not config.length_dependent
    assert config.attention_scaling() == 1.0


def test_config_is_frozen_and_compares_by_value():
    config = RopeConfig(64, rotary_dim=32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.base = 1e6
    assert config == RopeConfig(64, 10000.0, rotary_dim=32)
    assert config != RopeConfig(64, 10000.0, rotary_dim=32, interleaved=True)


@given(st.integers(1, 64).map(lambda h: 2 * h), st.floats(1.5, 1e7))
def test_inv_freq_is_float64_base_to_the_minus_2i_over_rotary_dim(rotary_dim, base):
    inv_freq = RopeConfig(rotary_dim + 2, base, rotary_dim=rotary_dim).inv_freq()
    assert inv_freq.dtype == torch.float64 and inv_freq.shape == (rotary_dim // 2,)
    np.testing.assert_allclose(inv_freq.numpy(), ref.inv_freq(rotary_dim, base), rtol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_cos_sin_of_int_n_is_the_table_for_arange_n(dtype):
    config = RopeConfig(16, rotary_dim=12)
    cos, sin = config.cos_sin(5, dtype=dtype)
    assert cos.shape == sin.shape == (5, 6) and cos.dtype == sin.dtype == dtype
    angle = torch.arange(5, dtype=torch.float64)[:, None] * config.inv_freq()[None, :]  # (5, 6)
    # Angles and cos/sin in float64, then one cast: exactly the float64 values rounded to dtype.
    assert torch.equal(cos, torch.cos(angle).to(dtype))
    assert torch.equal(sin, torch.sin(angle).to(dtype))


def test_cos_sin_keeps_the_shape_of_a_positions_tensor():
    positions = torch.tensor([[0, 3, 7], [2, 2, 9]])
    cos, sin = RopeConfig(8).cos_sin(positions)
    assert cos.shape == sin.shape == (2, 3, 4)
    full_cos, full_sin = RopeConfig(8).cos_sin(10)
    assert torch.equal(cos, full_cos[positions]) and torch.equal(sin, full_sin[positions])


def test_large_positions_are_accurate_because_angles_are_float64():
    """Near m = 1e6, float32 angles are off by up to 1/32 rad; the cast-after-float64 table by < 1e-7."""
    config = RopeConfig(64)
    m = 1_000_003
    cos, _ = config.cos_sin(torch.tensor([m]))
    exact = np.cos(m * ref.inv_freq(64))
    np.testing.assert_allclose(cos[0].double().numpy(), exact, atol=1e-7)
    naive = torch.cos(torch.tensor([float(m)]) * config.inv_freq().float())
    assert np.max(np.abs(naive.double().numpy() - exact)) > 1e-3  # what float32 angles would give


def test_cos_sin_lands_on_the_requested_device_and_has_unit_norm():
    cos, sin = RopeConfig(8).cos_sin(300, dtype=torch.float64, device="cpu")
    assert cos.device.type == "cpu"
    torch.testing.assert_close(cos**2 + sin**2, torch.ones_like(cos), rtol=0, atol=1e-15)
