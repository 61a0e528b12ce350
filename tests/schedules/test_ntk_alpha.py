"""NTK-alpha (HunYuan): base * alpha^(d / (d - 2)), equal to HunYuan's own rotary module in transformers."""

from __future__ import annotations

import pytest
import torch

from ropekit import RopeConfig
from ropekit.reference import inv_freq

transformers = pytest.importorskip("transformers")


def _hunyuan_config(alpha: float, head_dim: int = 16):
    from transformers.models.hunyuan_v1_dense.configuration_hunyuan_v1_dense import HunYuanDenseV1Config

    return HunYuanDenseV1Config(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=head_dim,
        num_hidden_layers=1,
        intermediate_size=64,
        vocab_size=32,
        rope_parameters={"rope_type": "dynamic", "alpha": alpha, "factor": 1.0, "rope_theta": 10000.0},
    )


@pytest.mark.parametrize("alpha", [1000.0, 2.5, 1.0])
@pytest.mark.parametrize("head_dim", [16, 128])
def test_from_hf_equals_hunyuans_rotary_module(alpha, head_dim):
    from transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense import HunYuanDenseV1RotaryEmbedding

    config = _hunyuan_config(alpha, head_dim)
    hf = HunYuanDenseV1RotaryEmbedding(config)
    ours = RopeConfig.from_hf(config, hf_float32_inv_freq=True)
    assert ours.rope_type == "ntk_alpha" and not ours.length_dependent
    assert torch.equal(ours.inv_freq().float(), hf.inv_freq)  # bit for bit in HF's float32 arithmetic
    positions = torch.arange(0, 2048, 37)[None]  # HF forms float32 angles: keep them small
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), positions)  # (1, n, head_dim), halves
    got_cos, got_sin = RopeConfig.from_hf(config).cos_sin(positions)
    torch.testing.assert_close(got_cos, cos[..., : head_dim // 2], rtol=0, atol=2e-4)
    torch.testing.assert_close(got_sin, sin[..., : head_dim // 2], rtol=0, atol=2e-4)


def test_frequencies_follow_the_published_formula_and_ignore_the_length():
    config = RopeConfig(128, 1e4, scaling={"rope_type": "ntk_alpha", "alpha": 1000.0})
    want = torch.from_numpy(inv_freq(128, 1e4 * 1000.0 ** (128 / 126)))
    torch.testing.assert_close(config.inv_freq(), want, rtol=1e-13, atol=0)
    assert torch.equal(config.inv_freq(10), config.inv_freq(10**6))
    assert config.attention_scaling() == 1.0


def test_hunyuan_preset_reads_dynamic_with_alpha_as_ntk_alpha():
    config = RopeConfig.preset("hunyuan-a13b")
    assert config.rope_type == "ntk_alpha" and dict(config.scaling) == {
        "rope_type": "ntk_alpha",
        "alpha": 1000.0,
    }


@pytest.mark.parametrize(
    ("scaling", "match"),
    [
        ({"rope_type": "ntk_alpha"}, "missing keys"),
        ({"rope_type": "ntk_alpha", "alpha": 0.5}, r"scaling\['alpha'\]: expected a finite number >= 1"),
        ({"rope_type": "ntk_alpha", "alpha": float("nan")}, r"scaling\['alpha'\]"),
    ],
)
def test_bad_alpha_is_a_value_error_naming_the_key(scaling, match):
    with pytest.raises(ValueError, match=match):
        RopeConfig(64, scaling=scaling)
