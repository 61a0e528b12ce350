"""Reading HF configs: input kinds, both config forms, per-layer-type RoPE, and errors for invalid ones."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from ropekit import RopeConfig
from ropekit.hf_config import fope_basis_kwargs, load_hf_config, rope_kwargs, rope_layer_types
from ropekit.presets import get_preset

# Llama 3.1 8B's published config (legacy form), as embedded in the presets.
LLAMA31 = get_preset("llama-3.1-8b").config


def test_dict_path_folder_and_pretrained_config_give_the_same_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(LLAMA31))
    from_dict = RopeConfig.from_hf(LLAMA31)
    assert RopeConfig.from_hf(tmp_path / "config.json") == from_dict
    assert RopeConfig.from_hf(str(tmp_path)) == from_dict
    pretrained = transformers.LlamaConfig(**{k: v for k, v in LLAMA31.items() if k != "model_type"})
    assert RopeConfig.from_hf(pretrained) == from_dict
    assert from_dict.head_dim == 128 and from_dict.base == 500000.0 and from_dict.rope_type == "llama3"


def test_v5_rope_parameters_form_equals_the_legacy_form():
    params = {**LLAMA31["rope_scaling"], "rope_theta": 500000.0}
    v5 = {k: v for k, v in LLAMA31.items() if k not in ("rope_theta", "rope_scaling")} | {
        "rope_parameters": params
    }
    assert RopeConfig.from_hf(v5) == RopeConfig.from_hf(LLAMA31)


def test_head_dim_key_wins_over_hidden_size_over_heads():
    cfg = {"hidden_size": 3584, "num_attention_heads": 16, "head_dim": 256}
    assert rope_kwargs(cfg)["head_dim"] == 256
    assert rope_kwargs({"hidden_size": 3584, "num_attention_heads": 16})["head_dim"] == 224


def test_gpt_neox_rotary_pct_and_rotary_emb_base():
    kw = rope_kwargs(
        {"hidden_size": 6144, "num_attention_heads": 64, "rotary_pct": 0.25, "rotary_emb_base": 1e4}
    )
    assert (kw["head_dim"], kw["rotary_dim"], kw["base"], kw["scaling"]) == (96, 24, 1e4, None)


def test_gptj_rotary_dim_is_interleaved():
    kw = rope_kwargs(
        {"model_type": "gptj", "n_embd": 4096, "n_head": 16, "rotary_dim": 64, "n_positions": 2048}
    )
    assert (kw["head_dim"], kw["rotary_dim"], kw["interleaved"], kw["max_position_embeddings"]) == (
        256,
        64,
        True,
        2048,
    )


def test_phi3_top_level_original_length_overrides_rope_scaling():
    cfg = {
        "model_type": "phi3",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "max_position_embeddings": 1024,
        "original_max_position_embeddings": 128,
        "rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
    }
    config = RopeConfig.from_hf(cfg)
    assert config.rope_type == "longrope"
    assert config.scaling["original_max_position_embeddings"] == 128
    assert not config.inv_freq(129).equal(config.inv_freq(128))


def test_gemma3_legacy_and_v5_per_layer_types():
    legacy = {
        "model_type": "gemma3_text",
        "hidden_size": 2560,
        "num_attention_heads": 8,
        "head_dim": 256,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }
    assert rope_layer_types(legacy) == ["full_attention", "sliding_attention"]
    full = RopeConfig.from_hf(legacy, layer_type="full_attention")
    sliding = RopeConfig.from_hf(legacy, layer_type="sliding_attention")
    assert (full.base, full.rope_type, sliding.base, sliding.rope_type) == (1e6, "linear", 1e4, "default")
    v5 = {
        "hidden_size": 2560,
        "num_attention_heads": 8,
        "head_dim": 256,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    }
    assert RopeConfig.from_hf(v5, layer_type="full_attention") == full
    with pytest.raises(ValueError, match=r"layer_type.*\['full_attention', 'sliding_attention'\]"):
        RopeConfig.from_hf(v5)
    with pytest.raises(ValueError, match="layer_type: expected one of"):
        RopeConfig.from_hf(v5, layer_type="global")


def test_modernbert_global_and_local_theta():
    cfg = {
        "hidden_size": 768,
        "num_attention_heads": 12,
        "global_rope_theta": 160000.0,
        "local_rope_theta": 1e4,
    }
    assert RopeConfig.from_hf(cfg, layer_type="full_attention").base == 160000.0
    assert RopeConfig.from_hf(cfg, layer_type="sliding_attention").base == 1e4


def test_multimodal_text_config_is_unwrapped():
    cfg = {
        "model_type": "llava",
        "text_config": {**LLAMA31, "model_type": "llama"},
        "vision_config": {},
    }
    assert RopeConfig.from_hf(cfg) == RopeConfig.from_hf(LLAMA31)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rope_scaling": {"rope_type": "warp", "factor": 2.0}}, r"unknown rope_type 'warp'"),
        ({"rope_scaling": {"rope_type": "linear"}}, r"rope_scaling'\]: rope_type 'linear' requires.*factor"),
        ({"rope_scaling": {"rope_type": "yarn"}}, r"rope_type 'yarn' requires the keys \['factor'\]"),
        ({"rope_scaling": {"rope_type": "dynamic"}}, r"rope_type 'dynamic' requires the keys \['factor'\]"),
        (
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
            r"parameters'\]: rope_type 'llama3' requires the keys \['high_freq_factor', 'low_freq_factor'\]",
        ),
        (
            {"rope_scaling": {"rope_type": "longrope", "long_factor": [1.0] * 4}},
            r"requires the keys \['short_factor'\]",
        ),
        (
            {"rope_scaling": {"rope_type": "linear", "factor": 0.0}},
            r"scaling\['factor'\]: expected a finite number >= 1, got 0.0",
        ),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": -2.0}}, r"factor'\]: expected .*>= 1, got -2.0"),
        ({"rope_scaling": {"rope_type": "linear", "factor": None}}, r"factor'\]: expected .*>= 1, got None"),
        ({"rope_scaling": "linear"}, r"config\['rope_scaling'\]: expected a dict .* got 'linear'"),
        ({"rope_parameters": "yarn"}, r"config\['rope_parameters'\]: expected a dict .* got 'yarn'"),
        ({"rope_scaling": {"rope_type": 3, "factor": 2.0}}, r"rope_type'\]: expected a string, got 3"),
        (
            {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 4}},
            r"short_factor'\]: expected a list of length 4",
        ),
        (
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8,
                    "low_freq_factor": 4,
                    "high_freq_factor": 1,
                }
            },
            r"high_freq_factor'\]: expected > low_freq_factor",
        ),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4, "beta_fast": 1, "beta_slow": 32}}, r"beta_fast"),
        ({"rope_theta": -5.0}, r"base: expected a finite number > 1"),
        ({"hidden_size": None}, r"missing \['hidden_size'\]"),
        ({"partial_rotary_factor": 1.5}, r"partial_rotary_factor'\]: expected a number in \(0, 1\]"),
        ({"rope_scaling": {"type": "mrope"}}, r"mrope_section"),
        ({"rope_scaling": {"type": "mrope", "mrope_section": [1, 2, 3]}}, r"summing to rotary_dim / 2 = 4"),
    ],
)
def test_invalid_configs_raise_value_errors_that_name_the_problem(change, message):
    cfg = {"hidden_size": 32, "num_attention_heads": 4, "max_position_embeddings": 64, **change}
    with pytest.raises(ValueError, match=message):
        RopeConfig.from_hf(cfg)


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 0.5},
        {"rope_type": "dynamic", "factor": 0.5},
        {"rope_type": "yarn", "factor": 0.5},
        {"rope_type": "llama3", "factor": 0.5, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
        {"rope_type": "longrope", "factor": 0.5, "short_factor": [1.0] * 4, "long_factor": [1.0] * 4},
    ],
)
def test_a_factor_below_one_is_rejected_where_transformers_only_warns(scaling):
    """A factor < 1 shrinks the context: HF logs a warning and computes it; ropekit refuses."""
    cfg = {"hidden_size": 32, "num_attention_heads": 4, "max_position_embeddings": 64}
    cfg["rope_scaling"] = scaling
    with pytest.raises(ValueError, match=r"scaling\['factor'\]: expected a finite number >= 1, got 0.5"):
        RopeConfig.from_hf(cfg)


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "yarn"},
        {"rope_type": "yarn", "factor": 4.0},
        {"rope_type": "linear"},
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "dynamic"},
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "llama3", "factor": 8.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
        {"rope_type": "longrope", "short_factor": [1.0] * 4},
        {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4},
        {"type": "yarn", "original_max_position_embeddings": 16},
    ],
)
def test_from_hf_rejects_exactly_the_configs_transformers_rejects(scaling):
    """Missing required keys: HF raises KeyError while building the config; ropekit raises ValueError."""
    transformers = pytest.importorskip("transformers")
    kwargs = {"hidden_size": 32, "num_attention_heads": 4, "max_position_embeddings": 64}
    try:
        transformers.LlamaConfig(**kwargs, rope_scaling=dict(scaling))
    except KeyError:
        hf_rejects = True
    else:
        hf_rejects = False
    if hf_rejects:
        with pytest.raises(ValueError, match="requires the keys"):
            RopeConfig.from_hf({**kwargs, "rope_scaling": scaling})
    else:
        RopeConfig.from_hf({**kwargs, "rope_scaling": scaling})


@pytest.mark.parametrize("rope_type", ["yarn", "llama3", "longrope"])
def test_original_length_defaults_to_max_position_embeddings_as_in_transformers(rope_type):
    transformers = pytest.importorskip("transformers")
    scaling = {
        "yarn": {"rope_type": "yarn", "factor": 4.0},
        "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
        "longrope": {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4},
    }[rope_type]
    kwargs = {"hidden_size": 32, "num_attention_heads": 4, "max_position_embeddings": 4096}
    hf = transformers.LlamaConfig(**kwargs, rope_scaling=dict(scaling)).rope_parameters
    config = RopeConfig.from_hf({**kwargs, "rope_scaling": scaling})
    assert hf["original_max_position_embeddings"] == 4096
    assert config.scaling["original_max_position_embeddings"] == 4096


def test_unknown_keys_are_logged_and_ignored_like_transformers(caplog):
    cfg = {"hidden_size": 32, "num_attention_heads": 4, "max_position_embeddings": 64}
    clean = RopeConfig.from_hf({**cfg, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    with caplog.at_level(logging.WARNING, logger="ropekit.hf_config"):
        stray = RopeConfig.from_hf({**cfg, "rope_scaling": {"rope_type": "linear", "factor": 2.0, "beta": 1}})
    assert stray == clean
    assert "beta" not in stray.scaling
    assert any("ignoring keys ['beta']" in r.getMessage() for r in caplog.records)


def test_from_hf_keeps_no_reference_to_the_source_dict():
    scaling = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
    cfg = {"hidden_size": 32, "num_attention_heads": 4, "max_position_embeddings": 64}
    cfg["rope_scaling"] = scaling
    config = RopeConfig.from_hf(cfg)
    before = config.inv_freq(seq_len=128).clone()
    scaling["long_factor"][0] = 100.0
    scaling["rope_type"] = "linear"
    assert config.scaling["long_factor"][0] == 2.0
    torch.testing.assert_close(config.inv_freq(seq_len=128), before, rtol=0, atol=0)


def test_unreadable_inputs_raise_value_errors(tmp_path):
    with pytest.raises(ValueError, match=r"config\.json file or a folder"):
        load_hf_config(tmp_path / "missing")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="as JSON"):
        load_hf_config(tmp_path)
    with pytest.raises(ValueError, match="expected a PretrainedConfig, a dict"):
        load_hf_config(42)


def test_qwen_vl_configs_without_sections_get_hf_module_defaults():
    base = {"hidden_size": 4096, "num_attention_heads": 32, "rope_theta": 1e6}
    qwen2 = RopeConfig.from_hf({**base, "model_type": "qwen2_vl"})
    qwen3 = RopeConfig.from_hf(
        {**base, "model_type": "qwen3_vl_text", "rope_scaling": {"mrope_section": [24, 20, 20]}}
    )
    assert (qwen2.mrope_section, qwen2.mrope_interleaved) == ((16, 24, 24), False)
    assert (qwen3.mrope_section, qwen3.mrope_interleaved) == ((24, 20, 20), True)  # HF always interleaves it


@pytest.mark.parametrize("rope_type", ["yarn", "longrope"])
def test_a_config_naming_no_context_length_fails_at_from_hf_naming_the_key(rope_type):
    """Issue 17, repro 6: yarn was accepted at from_hf and failed only when a table was built. transformers
    fills the length from its config class's default max_position_embeddings, which a dict does not carry."""
    scaling = {
        "yarn": {"rope_type": "yarn", "factor": 4.0},
        "longrope": {
            "rope_type": "longrope",
            "short_factor": [1.0] * 4,
            "long_factor": [2.0] * 4,
            "factor": 2.0,
        },
    }[rope_type]
    kwargs = {"hidden_size": 32, "num_attention_heads": 4, "rope_scaling": scaling}
    with pytest.raises(ValueError, match=r"max_position_embeddings'\]: .*(needs|expected) the pre-training"):
        RopeConfig.from_hf(kwargs)
    # Given the length another way, it builds tables at once.
    RopeConfig.from_hf(kwargs, max_position_embeddings=1024).cos_sin(4)
    RopeConfig.from_hf({**kwargs, "max_position_embeddings": 1024}).cos_sin(4)


def test_a_transformers_config_without_a_length_gets_its_class_default_as_transformers_does():
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen2Config(
        hidden_size=32, num_attention_heads=4, rope_scaling={"rope_type": "yarn", "factor": 4.0}
    )
    config = RopeConfig.from_hf(hf)
    want = hf.rope_parameters["original_max_position_embeddings"]  # the class default max_position_embeddings
    assert config.scaling["original_max_position_embeddings"] == want == hf.max_position_embeddings


def test_from_hf_rope_theta_defaults_to_10000_as_transformers_llama_does():
    """A config with no rope_theta: HF's default base. Changing ropekit's default (to 1e6, say) fails here."""
    transformers = pytest.importorskip("transformers")
    kwargs = {"hidden_size": 32, "num_attention_heads": 4}
    assert RopeConfig.from_hf(kwargs).base == 10000.0
    hf = transformers.LlamaConfig(**kwargs)
    assert hf.rope_parameters["rope_theta"] == 10000.0
    assert RopeConfig.from_hf(kwargs).base == RopeConfig.from_hf(hf).base
    torch.testing.assert_close(
        RopeConfig.from_hf(kwargs).inv_freq(),
        transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf).inv_freq.double(),
        rtol=1e-7,
        atol=0,
    )


# -- readings that were silently wrong (issue 28): each is what the model's modeling code uses --------------
def _published(model_type, **changes):
    from transformers import AutoConfig

    return {**AutoConfig.for_model(model_type).to_dict(), **changes}


def test_gemma4_full_attention_layers_read_global_head_dim():
    d = _published("gemma4_text")
    assert RopeConfig.from_hf(d, layer_type="full_attention").head_dim == 512  # per_layer_config (to_dict)
    hub = {k: v for k, v in d.items() if k != "per_layer_config"}
    assert RopeConfig.from_hf(hub, layer_type="full_attention").head_dim == 512  # HF's default global width
    assert RopeConfig.from_hf({**hub, "global_head_dim": 384}, layer_type="full_attention").head_dim == 384
    assert RopeConfig.from_hf(hub, layer_type="sliding_attention").head_dim == 256


def test_deepseek_v4_rotates_the_trailing_64_of_its_512_wide_heads():
    d = _published("deepseek_v4")
    for label, base in (("main", 1e4), ("compress", 160000.0)):
        rope = RopeConfig.from_hf(d, layer_type=label)
        assert (rope.head_dim, rope.rotary_dim, rope.rotary_position, rope.interleaved, rope.base) == (
            512, 64, "last", True, base,
        )  # fmt: skip


def test_mistral4_rotates_all_64_qk_rope_features_interleaved():
    rope = RopeConfig.from_hf(_published("mistral4"))
    assert (rope.head_dim, rope.rotary_dim, rope.interleaved) == (64, 64, True)
    assert not RopeConfig.from_hf(_published("mistral4", rope_interleave=False)).interleaved
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        d = _published("mistral4")
        RopeConfig.from_hf({**d, "rope_parameters": {**d["rope_parameters"], "partial_rotary_factor": 0.25}})


def test_llama_4_scaling_beta_is_kept_with_its_length():
    rope = RopeConfig.from_hf(_published("ministral3"))
    assert rope.scaling["llama_4_scaling_beta"] == 0.1
    assert rope.attention_temperature(torch.tensor([16383, 16384])).tolist() == pytest.approx(
        [1.0, 1 + 0.1 * math.log(2)]
    )
    with pytest.raises(ValueError, match="llama_4_scaling_beta"):
        RopeConfig.from_hf(
            {"hidden_size": 64, "num_attention_heads": 4, "rope_parameters": {"rope_type": "default",
                                                                               "llama_4_scaling_beta": 0.1}}
        )  # fmt: skip


def test_qwen3_omni_thinker_text_config_is_unwrapped():
    d = _published("qwen3_omni_moe")
    d["thinker_config"]["text_config"].update(head_dim=128, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 1e6})  # fmt: skip
    assert (RopeConfig.from_hf(d).head_dim, RopeConfig.from_hf(d).base) == (128, 1e6)


@pytest.mark.parametrize("model_type", ["glm", "glm4", "helium", "cohere2_moe", "openai_privacy_filter"])
def test_families_whose_modeling_code_pairs_2i_2i_plus_1_read_as_interleaved(model_type):
    assert RopeConfig.from_hf(_published(model_type, head_dim=64)).interleaved


def test_a_rotation_by_minus_angle_is_refused():
    with pytest.raises(ValueError, match="-angle"):
        RopeConfig.from_hf(_published("nanochat"))


# ---- issue 26 / 28: HunYuan-VL XD-RoPE, TeleChat3 YaRN, DeepSeek-V3.2 indexer ----

HUNYUAN_VL = {
    "model_type": "hunyuan_vl",
    "hidden_size": 256,
    "num_attention_heads": 2,
    "rope_theta": 10000.0,
    # tencent/HunyuanOCR's form: "xdrope" with xdrope_section and YaRN-style keys its RoPE never reads
    "rope_scaling": {"type": "xdrope", "alpha": 1000.0, "xdrope_section": [16, 16, 16, 16], "factor": 1.0},
}


def test_hunyuan_vl_xdrope_is_ntk_alpha_over_four_chunked_sections():
    config = RopeConfig.from_hf(HUNYUAN_VL)
    assert config.rope_type == "ntk_alpha" and config.mrope_section == (16, 16, 16, 16)
    assert config.mrope_layout == "chunked"
    theta = torch.tensor(1.0) / (10000.0 * 1000.0 ** (128 / 126)) ** (torch.arange(0, 128, 2).double() / 128)
    torch.testing.assert_close(config.inv_freq(), theta, rtol=1e-12, atol=0)
    positions = torch.tensor([[3], [5], [7], [9]])[:, :, None].expand(4, 1, 2)  # (axes, batch, seq)
    cos, _ = config.cos_sin(positions, dtype=torch.float64)
    axis = torch.arange(4).repeat_interleave(16)  # pair j follows axis j // 16
    want = torch.cos(torch.tensor([3.0, 5.0, 7.0, 9.0], dtype=torch.float64)[axis] * theta)
    torch.testing.assert_close(cos[0, 0], want, rtol=0, atol=1e-12)


def test_hunyuan_vl_text_rows_equal_transformers_and_image_rows_are_a_rotation():
    hunyuan = pytest.importorskip("transformers.models.hunyuan_vl.modeling_hunyuan_vl")
    from transformers import HunYuanVLConfig

    text = {**HUNYUAN_VL, "head_dim": 128, "rope_scaling": dict(HUNYUAN_VL["rope_scaling"])}
    hf_config = HunYuanVLConfig(text_config=text)  # its ntk_alpha reads head_dim itself
    rope = hunyuan.HunYuanVLRotaryEmbedding(hf_config.text_config)
    ours = RopeConfig.from_hf(hf_config)
    text = torch.arange(6)[None, None].expand(4, 1, 6)  # every axis equal
    hf_cos, hf_sin = rope(torch.zeros(1, dtype=torch.float32), text)
    cos, sin = ours.cos_sin(text, dtype=torch.float32)
    torch.testing.assert_close(hf_cos[..., :64], cos, rtol=0, atol=2e-5)
    torch.testing.assert_close(hf_sin[..., :64], sin, rtol=0, atol=2e-5)
    # An image token (axes differ): transformers' full-width rows give the two halves of a pair different
    # angles (its sections split the duplicated width), which is no rotation; ropekit's rows, like vLLM's
    # XDRotaryEmbedding, give each pair one angle.
    image = torch.tensor([[[2]], [[9]], [[4]], [[7]]])
    hf_cos, hf_sin = rope(torch.zeros(1, dtype=torch.float32), image)
    norm = hf_cos[..., :64] ** 2 + hf_sin[..., 64:] ** 2  # first half's cos with its partner's sin
    assert not torch.allclose(norm, torch.ones_like(norm), atol=1e-3)
    cos, sin = ours.cos_sin(image, dtype=torch.float64)
    torch.testing.assert_close(cos**2 + sin**2, torch.ones_like(cos), rtol=0, atol=1e-12)


def test_telechat3_yarn_carries_its_temperature():
    hf = {"head_dim": 64, "rope_theta": 10000.0, "max_position_embeddings": 32768}
    scaling = {"type": "telechat3-yarn", "factor": 8.0, "original_max_position_embeddings": 4096}
    config = RopeConfig.from_hf({**hf, "rope_scaling": scaling})
    assert config.rope_type == "yarn"
    assert config.attention_scaling() == pytest.approx(0.07 * math.log(8.0) + 1.0, rel=1e-15)
    plain = RopeConfig.from_hf({**hf, "rope_scaling": {**scaling, "type": "yarn"}})
    torch.testing.assert_close(config.inv_freq(), plain.inv_freq(), rtol=0, atol=0)
    assert plain.attention_scaling() == pytest.approx(0.1 * math.log(8.0) + 1.0)


def test_deepseek_v32_indexer_is_reachable_as_a_layer_type():
    from ropekit.presets import get_preset

    config = get_preset("deepseek-v3.2").config
    indexer = RopeConfig.from_hf(config, layer_type="indexer")
    assert indexer == RopeConfig.preset("deepseek-v3.2-indexer")
    assert (indexer.head_dim, indexer.rotary_dim, indexer.interleaved) == (128, 64, False)
    assert RopeConfig.from_hf(config) == RopeConfig.preset("deepseek-v3.2")  # MLA's stays the default


@pytest.mark.parametrize("key", ["use_fope", "fope_init_factor", "fope_sep_head", "num_inv_freq"])
def test_fope_keys_are_refused_not_dropped(key):
    config = {"head_dim": 64, "rope_theta": 1e4, "rope_scaling": {"rope_type": "default", key: 1}}
    with pytest.raises(ValueError, match=f"{key}.*FoPE"):
        RopeConfig.from_hf(config)
    basis = fope_basis_kwargs(config)
    assert (basis["head_dim"], basis["base"]) == (64, 1e4)
    assert config["rope_scaling"][key] == 1  # the caller's config is left as it was


@pytest.mark.parametrize("key", ["head_dim", "qk_rope_head_dim", "kv_channels"])
@pytest.mark.parametrize("bad", ["64", 64.5, 0, True])
def test_a_head_width_that_is_not_a_positive_integer_is_a_value_error_naming_its_key(key, bad):
    d = {"hidden_size": 256, "num_attention_heads": 4, "partial_rotary_factor": 0.5, key: bad}
    with pytest.raises(ValueError, match=rf"config\['{key}'\]: expected a positive integer"):
        rope_kwargs(d)


@pytest.mark.parametrize(
    ("key", "bad"), [("num_attention_heads", True), ("n_head", 2.0), ("hidden_size", "256")]
)
def test_a_head_count_or_hidden_size_that_is_not_a_positive_integer_is_a_value_error(key, bad):
    d = {"hidden_size": 256, "num_attention_heads": 4, key: bad}
    if key == "n_head":
        del d["num_attention_heads"]
    with pytest.raises(ValueError, match=rf"config\['{key}'\]: expected a positive integer"):
        rope_kwargs(d)


@pytest.mark.parametrize("bad", ["32", 31.5, float("nan"), 0])
def test_a_gptj_rotary_dim_that_is_not_a_positive_integer_is_a_value_error(bad):
    # it was read as no rotary_dim at all: the whole head rotated where GPT-J rotates its first 64 features
    d = {"model_type": "gptj", "n_embd": 256, "n_head": 4, "rotary_dim": bad}
    with pytest.raises(ValueError, match=r"config\['rotary_dim'\]: expected a positive integer"):
        rope_kwargs(d)


@pytest.mark.parametrize(
    ("key", "bad"), [("qk_nope_head_dim", "64"), ("qk_nope_head_dim", -1), ("qk_rope_head_dim", 2.5)]
)
def test_mla_widths_that_are_not_integers_are_value_errors_naming_their_key(key, bad):
    d = {"model_type": "mistral4", "head_dim": 128, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64,
         "hidden_size": 512, "num_attention_heads": 4, key: bad}  # fmt: skip
    with pytest.raises(ValueError, match=rf"config\['{key}'\]"):
        rope_kwargs(d)
