"""RopeConfig.softmax_scale and attention_temperature, one test per model family, against the scale each
model's own attention module in transformers applies (``self.scaling``, the indexer's ``softmax_scale``,
Llama 4's NoPE query temperature in a real forward pass)."""

from __future__ import annotations

import math

import pytest
import torch

import ropekit
from ropekit import RopeConfig
from ropekit.hf_config import indexer_rope_kwargs

transformers = pytest.importorskip("transformers")

DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
}
MLA = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "num_hidden_layers": 1,
    "max_position_embeddings": 163840,
}


def _attention_scaling(module_path: str, attention: str, config) -> float:
    module = __import__(module_path, fromlist=[attention])
    return getattr(module, attention)(config, layer_idx=0).scaling


@pytest.mark.parametrize(
    ("family", "config_class", "module", "attention", "rope_parameters"),
    [
        ("llama", "LlamaConfig", "llama", "LlamaAttention", {"rope_type": "default", "rope_theta": 1e4}),
        (
            "llama3.1",
            "LlamaConfig",
            "llama",
            "LlamaAttention",
            {
                "rope_type": "llama3",
                "rope_theta": 5e5,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
        (
            "qwen2.5 yarn",
            "Qwen2Config",
            "qwen2",
            "Qwen2Attention",
            {
                "rope_type": "yarn",
                "rope_theta": 1e6,
                "factor": 4.0,
                "original_max_position_embeddings": 32768,
            },
        ),
        (
            "hunyuan ntk-alpha",
            "HunYuanDenseV1Config",
            "hunyuan_v1_dense",
            "HunYuanDenseV1Attention",
            {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 1e4},
        ),
    ],
)
def test_plain_families_scale_by_one_over_sqrt_head_dim(
    family, config_class, module, attention, rope_parameters
):
    config = getattr(transformers, config_class)(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=1,
        rope_parameters=rope_parameters, max_position_embeddings=131072,
    )  # fmt: skip
    want = _attention_scaling(f"transformers.models.{module}.modeling_{module}", attention, config)
    assert RopeConfig.from_hf(config).softmax_scale(16) == pytest.approx(want, rel=1e-15)
    assert want == 16**-0.5


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v32"])
@pytest.mark.parametrize(
    ("factor", "mscale", "mscale_all_dim"), [(40.0, 1.0, 1.0), (16.0, 0.7, 1.0), (4.0, 1, 0)]
)
def test_deepseek_mla_multiplies_the_softmax_scale_by_mscale_squared(
    model_type, factor, mscale, mscale_all_dim
):
    rope = {**DEEPSEEK_YARN, "factor": factor, "mscale": mscale, "mscale_all_dim": mscale_all_dim}
    config = transformers.AutoConfig.for_model(model_type, **MLA, rope_parameters=rope)
    module = f"transformers.models.{model_type}.modeling_{model_type}"
    attention = "DeepseekV3Attention" if model_type == "deepseek_v3" else "DeepseekV32Attention"
    want = _attention_scaling(module, attention, config)
    ours = RopeConfig.from_hf(config)
    head_dim = MLA["qk_nope_head_dim"] + MLA["qk_rope_head_dim"]
    assert ours.softmax_scale(head_dim) == pytest.approx(want, rel=1e-14)
    if mscale_all_dim:
        temperature = 0.1 * mscale_all_dim * math.log(factor) + 1
        assert ours.softmax_scale(head_dim) == pytest.approx(temperature**2 / math.sqrt(head_dim), rel=1e-14)


def test_deepseek_v32_indexer_keeps_the_tables_but_not_the_mscale_squared():
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf

    config = transformers.DeepseekV32Config(
        **MLA, index_head_dim=32, index_n_heads=2, rope_parameters=DEEPSEEK_YARN
    )
    indexer = RopeConfig(**indexer_rope_kwargs(config))
    mla = RopeConfig.from_hf(config)
    assert indexer.softmax_scale(32) == pytest.approx(
        hf.DeepseekV32Indexer(config, 0).softmax_scale, rel=1e-15
    )
    assert (indexer.interleaved, indexer.head_dim, indexer.rotary_dim) == (False, 32, 8)
    assert mla.interleaved and mla.softmax_scale(24) > 24**-0.5 * 1.8
    positions = torch.arange(0, 1000, 17)  # transformers forms float32 angles: keep them small
    for a, b in zip(
        indexer.cos_sin(positions, dtype=torch.float64),
        mla.cos_sin(positions, dtype=torch.float64),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-15)
    # The indexer rotates the first 8 of its 32 features with half pairing, as transformers' indexer does.
    rope = hf.DeepseekV32RotaryEmbedding(config)
    cos, sin = rope(torch.zeros(1), positions[None])
    q = torch.randn(1, positions.numel(), 2, 32)
    want_rot, _ = hf.apply_rotary_pos_emb(q[..., :8], q[..., :8], cos, sin, unsqueeze_dim=2)
    c, s = indexer.cos_sin(positions)
    got = ropekit.apply_rotary(q, c, s, interleaved=False)
    torch.testing.assert_close(got[..., :8], want_rot, rtol=0, atol=2e-4)
    torch.testing.assert_close(got[..., 8:], q[..., 8:], rtol=0, atol=0)


def test_explicit_yarn_attention_factor_goes_into_the_tables_not_the_softmax():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0, "attention_factor": 1.25}
    hf_config = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=32768, rope_parameters=rope
    )
    _, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
    config = RopeConfig.from_hf(hf_config)
    assert config.attention_scaling() == hf_factor == 1.25
    assert config.softmax_scale(16) == 0.25


def test_llama4_nope_layers_scale_queries_by_the_temperature_as_transformers_does():
    from transformers.models.llama4 import modeling_llama4 as hf

    config = transformers.Llama4TextConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=4, head_dim=8, num_hidden_layers=1,
        no_rope_layers=[0], attn_temperature_tuning=True, floor_scale=3, attn_scale=0.5,
        attention_chunk_size=64,
    )  # fmt: skip
    config._attn_implementation = "eager"
    attention = hf.Llama4TextAttention(config, layer_idx=0).eval()
    assert not attention.use_rope
    x = torch.randn(2, 12, 32)
    with torch.no_grad():
        want, _ = attention(x, None, None)
        ours = RopeConfig.from_hf(config)
        temperature = ours.attention_temperature(torch.arange(12))  # (12,)
        q = attention.q_proj(x).view(2, 12, 4, 8) * temperature[None, :, None, None]
        k = attention.k_proj(x).view(2, 12, 4, 8)
        v = attention.v_proj(x).view(2, 12, 4, 8)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * ours.softmax_scale(8)
        out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(2, 12, 32)
        got = attention.o_proj(out)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (
        temperature[:2].tolist() == [1.0, 1.0] and temperature[2] > 1.0
    )  # floor((p + 1) / 3) > 0 from p = 2


def test_temperature_follows_the_published_formula_and_is_one_without_its_keys():
    config = RopeConfig.preset("llama-4-scout")
    positions = torch.tensor([0, 8190, 8191, 100_000])
    want = [1 + 0.1 * math.log1p(math.floor((p + 1) / 8192)) for p in positions.tolist()]
    torch.testing.assert_close(
        config.attention_temperature(positions, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    )
    assert torch.equal(RopeConfig(64).attention_temperature(positions), torch.ones(4))
    off = {**transformers.Llama4TextConfig(attn_temperature_tuning=False).to_dict(), "hidden_size": 64}
    assert "floor_scale" not in (RopeConfig.from_hf(off).scaling or {})


@pytest.mark.parametrize(
    ("scaling", "match"),
    [
        ({"floor_scale": 8192}, r"scaling\['attn_scale'\]: .* together"),
        ({"floor_scale": 0, "attn_scale": 0.1}, r"scaling\['floor_scale'\]: expected a finite number > 0"),
        ({"floor_scale": 8, "attn_scale": float("inf")}, r"scaling\['attn_scale'\]"),
    ],
)
def test_bad_temperature_keys_are_value_errors_naming_them(scaling, match):
    with pytest.raises(ValueError, match=match):
        RopeConfig(64, scaling=scaling)


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="head_dim"):
        RopeConfig(64).softmax_scale(0)
    with pytest.raises(ValueError, match="positions: expected an integer tensor"):
        RopeConfig(64).attention_temperature(torch.tensor([0.5]))


MINISTRAL3 = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16384}


@pytest.mark.parametrize(
    "scaling",
    [None, {"floor_scale": 8192, "attn_scale": 0.1}, {**MINISTRAL3, "llama_4_scaling_beta": 0.1}],
)
def test_the_temperature_of_a_negative_position_is_refused_as_the_rotations_refuse_it(scaling):
    config = RopeConfig(64, scaling=scaling)
    with pytest.raises(ValueError, match="positions: expected values >= 0, got a minimum of -3"):
        config.attention_temperature(torch.tensor([[4, -3], [0, 1]]))
    with pytest.raises(ValueError, match="positions: expected values >= 0"):
        ropekit.apply_rotary(torch.ones(1, 2, 1, 64), *config.cos_sin(8), positions=torch.tensor([[0, -3]]))


def test_position_scaling_is_one_plus_beta_log_of_whole_original_lengths():
    from ropekit.schedules.softmax import attention_temperature

    scaling = {"llama_4_scaling_beta": 0.5, "original_max_position_embeddings": 100}
    positions = torch.tensor([0, 99, 100, 250, 10_000])
    want = [1.0, 1.0, 1 + 0.5 * math.log(2), 1 + 0.5 * math.log(3), 1 + 0.5 * math.log(101)]
    assert attention_temperature(scaling, positions).tolist() == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize(
    ("scaling", "match"),
    [
        ({"llama_4_scaling_beta": 0.1}, "original_max_position_embeddings"),
        ({"llama_4_scaling_beta": -1.0, "original_max_position_embeddings": 8}, "llama_4_scaling_beta"),
        (
            {
                "llama_4_scaling_beta": 0.1,
                "original_max_position_embeddings": 8,
                "floor_scale": 8,
                "attn_scale": 1,
            },
            "not both",
        ),
    ],
)
def test_position_scaling_keys_are_checked(scaling, match):
    from ropekit.schedules.softmax import check_temperature

    with pytest.raises(ValueError, match=match):
        check_temperature(scaling)
