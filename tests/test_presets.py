"""Presets: every entry builds, cites its source, and carries the facts its model card / config.json state."""

from __future__ import annotations

import math

import pytest
import torch

from ropekit import RopeConfig
from ropekit.presets import PRESETS, get_preset

REQUIRED = [
    "llama-2-7b", "llama-3-8b", "llama-3.1-8b", "mistral-7b", "qwen2.5-7b", "qwen2-vl-7b", "phi-3-mini-128k",
    "deepseek-v3", "gpt-neox-20b", "gpt-j-6b", "gemma-2-9b",
]  # fmt: skip


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_and_cites_a_hub_config(name):
    preset = get_preset(name)
    assert preset.source.startswith(f"https://huggingface.co/{preset.model}/")
    config = RopeConfig.preset(name)
    assert config.inv_freq().shape == (config.rotary_dim // 2,)


def test_the_required_models_are_all_there():
    assert set(REQUIRED) <= set(PRESETS)


@pytest.mark.parametrize(
    ("name", "facts"),
    [
        (
            "llama-2-7b",
            {"head_dim": 128, "base": 1e4, "rope_type": "default", "max_position_embeddings": 4096},
        ),
        (
            "llama-3-8b",
            {"head_dim": 128, "base": 5e5, "rope_type": "default", "max_position_embeddings": 8192},
        ),
        (
            "llama-3.1-8b",
            {"head_dim": 128, "base": 5e5, "rope_type": "llama3", "max_position_embeddings": 131072},
        ),
        ("mistral-7b", {"head_dim": 128, "base": 1e4, "max_position_embeddings": 32768}),
        ("qwen2.5-7b", {"head_dim": 128, "base": 1e6, "rope_type": "yarn"}),
        (
            "qwen2-vl-7b",
            {"head_dim": 128, "base": 1e6, "mrope_section": (16, 24, 24), "mrope_interleaved": False},
        ),
        ("phi-3-mini-128k", {"head_dim": 96, "rope_type": "longrope", "max_position_embeddings": 131072}),
        ("deepseek-v3", {"head_dim": 64, "rope_type": "yarn", "interleaved": True}),
        ("gpt-neox-20b", {"head_dim": 96, "rotary_dim": 24, "interleaved": False}),
        ("gpt-j-6b", {"head_dim": 256, "rotary_dim": 64, "interleaved": True, "base": 1e4}),
        ("gemma-2-9b", {"head_dim": 256, "base": 1e4, "max_position_embeddings": 8192}),
    ],
)
def test_preset_facts(name, facts):
    config = RopeConfig.preset(name)
    for key, value in facts.items():
        assert getattr(config, key) == value, key


def test_phi3_has_48_short_and_long_factors_and_its_documented_attention_factor():
    config = RopeConfig.preset("phi-3-mini-128k")
    assert len(config.scaling["short_factor"]) == len(config.scaling["long_factor"]) == 48
    assert config.attention_scaling() == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))


def test_qwen25_yarn_x4_and_deepseek_mscale():
    qwen = RopeConfig.preset("qwen2.5-7b")
    assert qwen.scaling["factor"] == 4.0 and qwen.scaling["original_max_position_embeddings"] == 32768
    assert qwen.attention_scaling() == pytest.approx(0.1 * math.log(4) + 1)
    deepseek = RopeConfig.preset("deepseek-v3")
    assert deepseek.scaling["mscale"] == deepseek.scaling["mscale_all_dim"] == 1.0
    assert deepseek.attention_scaling() == 1.0  # the ratio of equal mscales


def test_overrides_and_unknown_names():
    assert RopeConfig.preset("LLAMA-3-8B", hf_float32_inv_freq=True).hf_float32_inv_freq
    with pytest.raises(ValueError, match=r"unknown preset 'llama-9'; expected one of \["):
        RopeConfig.preset("llama-9")


@pytest.mark.parametrize(
    ("name", "facts"),
    [
        ("hunyuan-a13b", {"head_dim": 128, "base": 1e4, "rope_type": "ntk_alpha", "interleaved": False}),
        (
            "qwen2.5-7b-1m",
            {"head_dim": 128, "base": 1e7, "rope_type": "dual_chunk", "max_position_embeddings": 1010000},
        ),
        (
            "qwen3-vl-8b",
            {"head_dim": 128, "base": 5e6, "mrope_section": (24, 20, 20), "mrope_interleaved": True},
        ),
        (
            "ernie-4.5-vl-28b-a3b",
            {"head_dim": 128, "base": 5e5, "mrope_layout": "ernie", "interleaved": True},
        ),
        ("deepseek-v3.2", {"head_dim": 64, "rope_type": "yarn", "interleaved": True}),
        (
            "deepseek-v3.2-indexer",
            {"head_dim": 128, "rotary_dim": 64, "rope_type": "yarn", "interleaved": False},
        ),
        ("llama-4-scout", {"head_dim": 128, "base": 5e5, "rope_type": "llama3", "interleaved": True}),
        ("llama-4-scout-vision", {"head_dim": 88, "rope_type": "axial", "mrope_section": (22, 22)}),
        ("hunyuan-ocr", {"head_dim": 128, "rope_type": "ntk_alpha", "mrope_section": (16, 16, 16, 16)}),
    ],
)
def test_served_model_variant_presets(name, facts):
    test_preset_facts(name, facts)


def test_deepseek_v32_softmax_scales_mla_by_mscale_squared_and_not_the_indexer():
    mla, indexer = RopeConfig.preset("deepseek-v3.2"), RopeConfig.preset("deepseek-v3.2-indexer")
    assert mla.softmax_scale(192) == pytest.approx((0.1 * math.log(40) + 1) ** 2 / math.sqrt(192))
    assert indexer.softmax_scale(128) == pytest.approx(128**-0.5, rel=1e-15)
    assert mla.attention_scaling() == indexer.attention_scaling() == 1.0


def test_the_2026_presets_match_transformers_defaults_they_are_copied_from():
    from transformers import AutoConfig

    for name, model_type, layer_type in [
        ("gemma-4-e2b-full", "gemma4_text", "full_attention"),
        ("gemma-4-e2b-sliding", "gemma4_text", "sliding_attention"),
        ("ministral-3-8b", "ministral3", None),
        ("mistral-small-4", "mistral4", None),
        ("deepseek-v4-main", "deepseek_v4", "main"),
        ("deepseek-v4-compress", "deepseek_v4", "compress"),
    ]:
        want = RopeConfig.from_hf(AutoConfig.for_model(model_type), layer_type=layer_type)
        assert RopeConfig.preset(name) == want, name


def test_the_2026_presets_carry_their_facts():
    assert (
        RopeConfig.preset("gemma-4-e2b-full").head_dim,
        RopeConfig.preset("gemma-4-e2b-sliding").head_dim,
    ) == (
        512,
        256,
    )
    v4 = RopeConfig.preset("deepseek-v4-compress")
    assert (v4.head_dim, v4.rotary_dim, v4.rotary_position, v4.interleaved, v4.base) == (
        512,
        64,
        "last",
        True,
        160000,
    )
    m4 = RopeConfig.preset("mistral-small-4")
    assert (m4.head_dim, m4.rotary_dim, m4.interleaved) == (64, 64, True)
    assert RopeConfig.preset("ministral-3-8b").attention_temperature(
        torch.tensor([16384])
    ).item() == pytest.approx(1 + 0.1 * math.log(2))


def test_intern_s1_pro_preset_is_its_fope_basis_and_from_hf_refuses_fope():
    from ropekit.presets import preset_kwargs

    preset = get_preset("intern-s1-pro-fope-basis")
    config = RopeConfig.preset("intern-s1-pro-fope-basis")
    assert (config.head_dim, config.rotary_dim, config.base) == (128, 128, 5e6)
    assert config.max_position_embeddings == 262144 and not config.interleaved
    assert preset.part == "fope_basis" and preset_kwargs("intern-s1-pro-fope-basis")["head_dim"] == 128
    # Its published rope_scaling makes vLLM build FourierRotaryEmbedding: a RopeConfig would be a silent
    # plain rotation.
    with pytest.raises(ValueError, match="FoPE"):
        RopeConfig.from_hf(preset.config)
