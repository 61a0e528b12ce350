"""M-RoPE sections: which axis drives each pair, in Qwen2-VL's chunked, Qwen3-VL's interleaved and
ERNIE 4.5-VL's layouts (the last equal to transformers' Ernie4_5_VLMoeTextRotaryEmbedding)."""

from __future__ import annotations

import pytest
import torch

import ropekit
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


# -- ERNIE 4.5-VL: h / w alternate over the first pairs, t takes the last ones ---------------------------


def _ernie_text_config(section=(3, 3, 2)):
    transformers = pytest.importorskip("transformers")
    return transformers.Ernie4_5_VLMoeConfig(
        text_config={
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 1,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 500000.0,
                "mrope_section": list(section),
            },
        }
    ).text_config


def test_ernie_layout_gives_h_to_even_w_to_odd_pairs_then_t():
    axis = mrope_axis_of_pair([3, 3, 2], "ernie").tolist()
    assert axis == [1, 2, 1, 2, 1, 2, 0, 0]


@pytest.mark.parametrize("section", [(3, 3, 2), (2, 2, 4), (1, 1, 6)])
def test_ernie_tables_equal_transformers_text_rotary_embedding(section):
    from transformers.models.ernie4_5_vl_moe import modeling_ernie4_5_vl_moe as hf

    hf_config = _ernie_text_config(section)
    positions = torch.randint(0, 300, (3, 2, 9))  # (t, h, w), batch, seq
    cos, sin = hf.Ernie4_5_VLMoeTextRotaryEmbedding(hf_config)(torch.zeros(1), positions)  # (2, 9, 16)
    config = RopeConfig.from_hf(hf_config)
    assert (config.mrope_layout, config.interleaved, config.mrope_section) == ("ernie", True, section)
    got_cos, got_sin = config.cos_sin(positions)
    torch.testing.assert_close(got_cos, cos[..., ::2], rtol=0, atol=2e-5)
    torch.testing.assert_close(got_sin, sin[..., ::2], rtol=0, atol=2e-5)


def test_ernie_rotated_queries_equal_transformers_apply_rotary_pos_emb():
    from transformers.models.ernie4_5_vl_moe import modeling_ernie4_5_vl_moe as hf

    hf_config = _ernie_text_config()
    positions = torch.randint(0, 50, (3, 1, 6))
    cos, sin = hf.Ernie4_5_VLMoeTextRotaryEmbedding(hf_config)(torch.zeros(1), positions)
    q, k = torch.randn(1, 4, 6, 16), torch.randn(1, 2, 6, 16)  # (batch, heads, seq, head_dim)
    want_q, want_k = hf.apply_rotary_pos_emb(q, k, cos, sin)
    config = RopeConfig.from_hf(hf_config)
    c, s = config.cos_sin(positions)  # (1, 6, 8)
    got_q = ropekit.apply_rotary(q.transpose(1, 2), c, s, per_token=True, interleaved=True).transpose(1, 2)
    got_k = ropekit.apply_rotary(k.transpose(1, 2), c, s, per_token=True, interleaved=True).transpose(1, 2)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)


def test_ernie_preset_reads_freq_allocation_from_baidus_config():
    config = RopeConfig.preset("ernie-4.5-vl-28b-a3b")
    assert (config.mrope_section, config.mrope_layout, config.interleaved) == ((22, 22, 20), "ernie", True)


@pytest.mark.parametrize(
    ("scaling", "match"),
    [
        ({"mrope_section": [3, 2, 3], "mrope_layout": "ernie"}, "s_h == s_w"),
        ({"mrope_section": [4, 4], "mrope_layout": "ernie"}, "s_h == s_w"),
        (
            {"mrope_section": [3, 3, 2], "mrope_layout": "zigzag"},
            r"scaling\['mrope_layout'\]: expected one of",
        ),
        ({"mrope_section": [3, 3, 2], "mrope_layout": "ernie", "mrope_interleaved": True}, "contradicts"),
        ({"mrope_layout": "ernie"}, "mrope_layout needs the section sizes"),
    ],
)
def test_bad_layouts_are_value_errors_naming_the_key(scaling, match):
    with pytest.raises(ValueError, match=match):
        RopeConfig(16, scaling=scaling)
