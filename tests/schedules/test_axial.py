"""Axial RoPE (rope_type "axial"): Llama 4's vision 2-D RoPE, equal to transformers'
Llama4VisionRotaryEmbedding and to its vision_apply_rotary_emb on real queries."""

from __future__ import annotations

import pytest
import torch

import ropekit
from ropekit import RopeConfig
from ropekit.multiaxis import llama4_vision_positions

transformers = pytest.importorskip("transformers")
from transformers.models.llama4 import modeling_llama4  # noqa: E402

VISION = {"hidden_size": 64, "num_attention_heads": 4, "image_size": 28, "patch_size": 7, "rope_theta": 10000}


@pytest.mark.parametrize(("image_size", "patch_size", "heads"), [(28, 7, 4), (56, 8, 2), (336, 14, 4)])
def test_tables_equal_llama4_vision_rotary_embedding(image_size, patch_size, heads):
    hf_config = transformers.Llama4VisionConfig(
        **{**VISION, "image_size": image_size, "patch_size": patch_size, "num_attention_heads": heads}
    )
    freqs = modeling_llama4.Llama4VisionRotaryEmbedding(
        hf_config
    ).freqs_ci  # (N + 1, 1, head_dim / 2) complex
    config = RopeConfig.from_hf(hf_config)
    assert config.rope_type == "axial" and config.interleaved
    cos, sin = config.cos_sin(llama4_vision_positions(image_size, patch_size)[:, None])  # (1, N + 1, R/2)
    torch.testing.assert_close(cos[0], freqs.real[:, 0], rtol=0, atol=2e-6)
    torch.testing.assert_close(sin[0], freqs.imag[:, 0], rtol=0, atol=2e-6)


def test_rotated_queries_equal_vision_apply_rotary_emb():
    hf_config = transformers.Llama4VisionConfig(**VISION)
    freqs = modeling_llama4.Llama4VisionRotaryEmbedding(hf_config).freqs_ci
    n, head_dim = freqs.shape[0], 16
    q, k = torch.randn(2, n, 4, head_dim), torch.randn(2, n, 4, head_dim)
    want_q, want_k = modeling_llama4.vision_apply_rotary_emb(q, k, freqs)
    config = RopeConfig.from_hf(hf_config)
    cos, sin = config.cos_sin(llama4_vision_positions(28, 7)[:, None])
    got_q = ropekit.apply_rotary(q, cos, sin, per_token=True, interleaved=True)
    got_k = ropekit.apply_rotary(k, cos, sin, per_token=True, interleaved=True)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)


def test_each_axis_restarts_its_frequencies_and_equals_axial_cos_sin():
    config = RopeConfig(16, 100.0, scaling={"rope_type": "axial", "mrope_section": [3, 5]})
    theta = config.inv_freq()
    torch.testing.assert_close(theta[:3], RopeConfig(6, 100.0).inv_freq(), rtol=0, atol=0)
    torch.testing.assert_close(theta[3:], RopeConfig(10, 100.0).inv_freq(), rtol=0, atol=0)
    grid = torch.meshgrid(torch.arange(4), torch.arange(6), indexing="ij")
    positions = torch.stack([g.reshape(-1) for g in grid])[:, None]  # (2, 1, 24): row, column
    cos, sin = config.cos_sin(positions, dtype=torch.float64)
    want_cos, want_sin = ropekit.axial_cos_sin((4, 6), 16, 100.0, axes_pairs=(3, 5), dtype=torch.float64)
    torch.testing.assert_close(cos[0], want_cos, rtol=0, atol=0)
    torch.testing.assert_close(sin[0], want_sin, rtol=0, atol=0)


def test_scout_vision_preset_has_22_pairs_per_axis_over_24_by_24_patches():
    config = RopeConfig.preset("llama-4-scout-vision")
    assert (config.head_dim, config.mrope_section, config.interleaved) == (88, (22, 22), True)
    positions = llama4_vision_positions(336, 14)
    assert positions.shape == (2, 577) and positions[:, -1].tolist() == [0, 0]
    assert positions[:, :2].tolist() == [[1, 2], [1, 1]]  # (column + 1, row + 1) in row-major order


@pytest.mark.parametrize(
    ("args", "match"), [((14, 28), "patch_size: expected at most image_size"), ((0, 14), "image_size")]
)
def test_bad_vision_sizes_are_value_errors(args, match):
    with pytest.raises(ValueError, match=match):
        llama4_vision_positions(*args)


def test_axial_without_sections_is_a_value_error():
    with pytest.raises(ValueError, match="missing keys"):
        RopeConfig(16, scaling={"rope_type": "axial"})
    with pytest.raises(ValueError, match="summing to rotary_dim / 2"):
        RopeConfig(16, scaling={"rope_type": "axial", "mrope_section": [3, 3]})
