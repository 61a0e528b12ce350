"""ropekit.layer_rope.model_rope: a whole model's RoPE, layer by layer, equal to what transformers' own
layers apply.

The proofs build tiny models from transformers 5.24's configs (nothing is downloaded) and compare every
decoder layer with its model_rope entry (tests/model_rope_proof.py). The fast set covers each per-layer
feature once; the sweep over every RoPE model type is in the proof tier.
"""

import copy
import dataclasses
import math
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoConfig

import model_rope_proof as proof
import ropekit
import ropekit.hf_config
from ropekit import LayerRope, RopeConfig, model_rope

HERE = Path(__file__).parent

# One model type per per-layer feature model_rope reads.
FAST = (
    "llama",  # one RoPE, every layer
    "gemma4_text",  # proportional full-attention layers with wider heads, default sliding ones
    "gemma4",  # the same through the multimodal wrapper's text_config
    "gemma3n_text",  # per-layer-type bases, sliding window
    "olmo3",  # per-layer-type parameters, sliding and full layers
    "llama4_text",  # NoPE layers with temperature, chunked RoPE layers, complex interleaved tables
    "smollm3",  # NoPE layers (no_rope_layers)
    "ministral3",  # llama_4_scaling_beta temperature on every layer
    "mistral4",  # MLA: qk_rope_head_dim interleaved, llama_4_scaling_beta
    "deepseek_v4",  # main / compress RoPE on the trailing 64 of 512 features, sliding window everywhere
    "qwen3_omni_moe_thinker",  # the thinker's nested text_config, M-RoPE tables
    "recurrent_gemma",  # a hybrid: recurrent blocks without RoPE, windowed attention rotating half the head
    "t5gemma2",  # an encoder-decoder's decoder, its merged self / cross attention
    "moonshine",  # an audio encoder-decoder's decoder (random samples in), interleaved pairs
)


def hf_dict(model_type, **changes):
    d = AutoConfig.for_model(model_type).to_dict()
    d.update(changes)
    return d


@pytest.mark.cover(every=2)  # fast tier: every 2nd type; the others: make proofs
@pytest.mark.parametrize("model_type", FAST)
def test_model_rope_equals_every_layer_of_the_tiny_model(model_type):
    problems, unmeasured = proof.prove(model_type)
    assert problems == []
    assert not [u for u in unmeasured if "temperature" in u or "interface" in u]


# Model types model_rope refuses with a ValueError rather than guess: hybrids whose attention layers come
# from keys it does not read, encoder-decoder or nested layouts without a decoder layer count, NanoChat's
# rotation by -angle.
REFUSED = frozenset(
    {
        "hrm_text", "nanochat",
        "zamba", "blt", "clvp",
        "ergo", "hy_v4", "pi05",  # transformers 5.25: refused (hf_config.UNDESCRIBED_MODEL_TYPES)
    }
)  # fmt: skip
# Model types whose layers differ from model_rope in a way it does not describe.
UNDESCRIBED = {
    "qwen4_exp": "indexed attention: its indexer's top-k hides keys the causal mask would show",
    "qwen4_exp_text": "indexed attention: its indexer's top-k hides keys the causal mask would show",
    "diffusion_gemma": "its positions are not arange(seq) on a token forward",
}


@pytest.mark.proof
@pytest.mark.parametrize("model_type", sorted(proof.hf_coverage.rope_model_types()))
def test_model_rope_equals_every_layer_for_every_rope_model_type(model_type):
    if model_type in UNDESCRIBED:
        pytest.xfail(UNDESCRIBED[model_type])
    if model_type in ropekit.layer_rope.NOT_TOKEN_STACKS:
        with pytest.raises(ValueError, match="vision or audio tower"):
            model_rope(AutoConfig.for_model(model_type))
        assert proof.hf_coverage._model_classes(model_type, AutoConfig.for_model(model_type))
        assert all(
            proof.hf_coverage._token_model(cls)
            for cls, _, _ in proof.hf_coverage._model_classes(model_type, AutoConfig.for_model(model_type))
        ), "a token model: take it off NOT_TOKEN_STACKS"
        return
    try:
        problems, _ = proof.prove(model_type)
    except proof.NotBuilt as err:
        pytest.skip(str(err))
    except ValueError as err:
        if model_type not in REFUSED:
            raise
        assert "model_rope" in str(err) or "decoder layers" in str(err) or "RopeConfig" in str(err)
        return
    assert model_type not in REFUSED, "model_rope now reads it: take it off REFUSED"
    assert problems == []


# -- what model_rope says for the published configs (transformers' defaults are the released models') -------
def test_gemma4_full_layers_use_the_wide_proportional_head_and_sliding_layers_the_default():
    layers = model_rope(AutoConfig.for_model("gemma4"))
    full = [layer for layer in layers if layer.layer_type == "full_attention"]
    sliding = [layer for layer in layers if layer.layer_type == "sliding_attention"]
    assert [layer.index for layer in full] == [5, 11, 17, 23, 29]
    assert full[0].rope == RopeConfig(
        512, 1e6, scaling={"rope_type": "proportional", "partial_rotary_factor": 0.25},
        max_position_embeddings=131072,
    )  # fmt: skip
    assert sliding[0].rope == RopeConfig(256, 1e4, max_position_embeddings=131072)
    assert {layer.sliding_window for layer in sliding} == {512}
    assert {layer.sliding_window for layer in full} == {None}


def test_gemma4_hub_config_global_head_dim_is_read():
    d = hf_dict("gemma4_text")
    d.pop("per_layer_config")
    d["global_head_dim"] = 384
    assert RopeConfig.from_hf(d, layer_type="full_attention").head_dim == 384
    assert model_rope(d)[5].rope.head_dim == 384
    assert model_rope(d)[4].rope.head_dim == 256


def test_deepseek_v4_layers_rotate_the_trailing_64_of_512_features_with_main_or_compress():
    layers = model_rope(AutoConfig.for_model("deepseek_v4"))
    for layer in layers:
        assert (layer.rope.head_dim, layer.rope.rotary_dim) == (512, 64)
        assert layer.rope.rotary_position == "last" and layer.rope.interleaved
        want = 1e4 if layer.layer_type == "sliding_attention" else 160000.0
        assert layer.rope.base == want
        assert layer.sliding_window == 128
    d = hf_dict("deepseek_v4", layer_types=["sliding_attention"] + ["compressed_sparse_attention"] * 42)
    assert model_rope(d)[0].rope.base == 1e4
    assert RopeConfig.from_hf(d, layer_type="main").base == 1e4
    assert RopeConfig.from_hf(d, layer_type="sliding_attention") == RopeConfig.from_hf(d, layer_type="main")
    assert RopeConfig.from_hf(d, layer_type="compress").rotary_dim == 64


def test_mistral4_rotates_all_of_qk_rope_head_dim_interleaved():
    rope = RopeConfig.from_hf(AutoConfig.for_model("mistral4"))
    assert (rope.head_dim, rope.rotary_dim, rope.interleaved) == (64, 64, True)
    # MLA: the softmax scale carries DeepSeek's mscale^2 over the whole 128-wide q/k head
    assert rope.softmax_scale(128) == pytest.approx(
        128**-0.5 * (0.1 * 1.0 * torch.log(torch.tensor(128.0)).item() + 1) ** 2
    )


def test_mistral4_default_rope_over_a_partial_head_is_refused():
    d = hf_dict("mistral4")
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match="whole 128-wide head"):
        RopeConfig.from_hf(d)


def test_position_temperature_of_ministral3_and_mistral4_is_one_plus_beta_log():
    positions = torch.tensor([0, 16383, 16384, 3 * 16384, 10**6])
    want = 1 + 0.1 * torch.log1p(torch.floor(positions.double() / 16384))
    for model_type in ("ministral3",):
        layers = model_rope(AutoConfig.for_model(model_type))
        got = layers[0].attention_temperature(positions)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want.float())
        assert RopeConfig.from_hf(AutoConfig.for_model(model_type)).scaling["llama_4_scaling_beta"] == 0.1
    want4 = 1 + 0.1 * torch.log1p(torch.floor(positions.double() / 8192))
    torch.testing.assert_close(
        model_rope(AutoConfig.for_model("mistral4"))[3].attention_temperature(positions), want4.float()
    )


def test_position_temperature_matches_transformers_own_function():
    from transformers.models.ministral3.modeling_ministral3 import get_llama_4_attn_scale

    positions = torch.arange(0, 200_000, 997)
    theirs = get_llama_4_attn_scale(positions[None], 0.1, 16384)[0, 0, :, 0]
    ours = model_rope(AutoConfig.for_model("ministral3"))[0].attention_temperature(positions)
    torch.testing.assert_close(ours, theirs.float())


def test_llama4_nope_layers_carry_the_temperature_and_rope_layers_the_chunk():
    layers = model_rope(AutoConfig.for_model("llama4_text"))
    nope = [layer for layer in layers if layer.rope is None]
    assert [layer.index for layer in nope] == [3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47]
    assert all(layer.attention_chunk_size is None for layer in nope)
    assert {layer.attention_chunk_size for layer in layers if layer.rope is not None} == {8192}
    p = torch.tensor([0, 8190, 8191, 10**6])
    torch.testing.assert_close(
        nope[0].attention_temperature(p), (1 + 0.1 * torch.log1p(torch.floor((p + 1.0) / 8192))).float()
    )
    assert torch.equal(layers[0].attention_temperature(p), torch.ones(4))


def test_no_rope_layers_one_means_the_layer_rotates_in_llama4_and_smollm3():
    for model_type in ("llama4_text", "smollm3"):
        d = hf_dict(model_type, num_hidden_layers=3, layer_types=None)
        d["no_rope_layers"] = [0, 1, 1]
        layers = model_rope(d)
        assert [layer.rope is None for layer in layers] == [True, False, False]


def test_an_empty_no_rope_layers_is_llama4s_default_and_smollm3s_error():
    layers = model_rope(hf_dict("llama4_text", num_hidden_layers=8, layer_types=None, no_rope_layers=[]))
    assert [layer.rope is None for layer in layers] == [False, False, False, True] * 2
    with pytest.raises(ValueError, match="no_rope_layers"):
        model_rope(hf_dict("smollm3", num_hidden_layers=8, layer_types=None, no_rope_layers=[]))


def test_qwen3_omni_reads_the_thinker_text_config():
    d = hf_dict("qwen3_omni_moe")
    text = d["thinker_config"]["text_config"]
    text.update(head_dim=128, num_attention_heads=32, num_hidden_layers=4)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [24, 20, 20],
                               "mrope_interleaved": True}  # fmt: skip
    layers = model_rope(d)
    assert len(layers) == 4
    assert layers[0].rope.mrope_section == (24, 20, 20) and layers[0].rope.mrope_layout == "interleaved"
    assert RopeConfig.from_hf(d) == layers[0].rope


def test_layers_that_are_not_attention_get_no_rope():
    d = hf_dict("qwen3_next", num_hidden_layers=4)
    d["layer_types"] = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    assert [layer.rope is None for layer in model_rope(d)] == [True, True, True, False]


def test_entries_are_frozen_and_shared_between_equal_layers():
    layers = model_rope(AutoConfig.for_model("olmo3"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        layers[0].rope = None
    assert layers[0].rope is layers[1].rope
    assert isinstance(layers[0], LayerRope) and ropekit.model_rope is model_rope


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"num_hidden_layers": None}, "number of decoder layers"),
        ({"layer_types": ["full_attention"]}, "layer_types"),
        ({"no_rope_layers": [2] * 36}, "no_rope_layers"),
        ({"no_rope_layers": [1, 0]}, "no_rope_layers"),
    ],
)
def test_configs_it_cannot_read_are_a_value_error(change, match):
    with pytest.raises(ValueError, match=match):
        model_rope(hf_dict("smollm3", **change))


def test_model_rope_does_not_modify_the_config():
    d = hf_dict("gemma4_text")
    before = repr(d)
    model_rope(d)
    assert repr(d) == before


# -- the proof can fail ----------------------------------------------------------------------------------
def test_the_proof_sees_a_wrong_base_or_width():
    model = proof.build("olmo3")
    seen = proof.observe(model)
    _, fn, call = seen[0].rotations[0]
    right = model_rope(model.config)[0].rope
    assert proof.rotation_difference(right, fn, call)[0] <= proof.TOLERANCE
    for wrong in (
        RopeConfig(right.head_dim, right.base * 2),
        RopeConfig(right.head_dim, right.base, rotary_dim=right.head_dim // 2),
        RopeConfig(right.head_dim, right.base, interleaved=True),
    ):
        assert proof.rotation_difference(wrong, fn, call)[0] > 100 * proof.TOLERANCE


def test_the_proof_sees_a_wrong_window():
    layer = LayerRope(0, "sliding_attention", None, sliding_window=8)
    assert not torch.equal(proof.expected_allowed(layer), proof.expected_allowed(LayerRope(0, None, None)))
    chunked = LayerRope(0, "chunked_attention", None, attention_chunk_size=4)
    assert proof.expected_allowed(chunked).sum() < proof.expected_allowed(layer).sum()


def test_rotary_embedding_for_model_serves_each_layer_its_own_table():
    ropes = ropekit.RotaryEmbedding.for_model(AutoConfig.for_model("gemma4_text"))
    layers = model_rope(AutoConfig.for_model("gemma4_text"))
    assert len(ropes) == len(layers) == 30
    assert ropes[0] is ropes[4] and ropes[5] is ropes[11] and ropes[0] is not ropes[5]
    assert [r.config for r in ropes] == [layer.rope for layer in layers]
    q, k = torch.randn(1, 7, 2, 512, dtype=torch.float64), torch.randn(1, 7, 1, 512, dtype=torch.float64)
    got, _ = ropes[5](q, k)
    cos, sin = layers[5].rope.cos_sin(7, dtype=torch.float64)
    torch.testing.assert_close(got, ropekit.apply_rotary(q, cos, sin))
    smol = ropekit.RotaryEmbedding.for_model(AutoConfig.for_model("smollm3"))
    assert [r is None for r in smol[:4]] == [False, False, False, True]


# -- hybrids: which layers attend comes from their own keys ------------------------------------------------
def test_jamba_attends_every_eighth_layer_from_the_fifth_without_rope():
    plan = model_rope(AutoConfig.for_model("jamba", num_hidden_layers=16))
    assert [layer.index for layer in plan if layer.layer_type == "full_attention"] == [4, 12]
    assert {layer.layer_type for layer in plan} == {"full_attention", "mamba"}
    assert all(layer.rope is None for layer in plan)


def test_bamba_rotates_only_its_attention_layers():
    plan = model_rope(hf_dict("bamba", num_hidden_layers=4, attn_layer_indices=[1, 3]))
    assert [layer.rope is not None for layer in plan] == [False, True, False, True]
    assert plan[1].rope == RopeConfig.from_hf(AutoConfig.for_model("bamba"))


def test_recurrent_gemma_attention_blocks_are_windowed_and_rotate_half_the_head():
    plan = model_rope(AutoConfig.for_model("recurrent_gemma", num_hidden_layers=6))
    assert [layer.layer_type for layer in plan] == ["recurrent", "recurrent", "sliding_attention"] * 2
    attention = plan[2]
    assert attention.sliding_window == 2048 and plan[0].sliding_window is None
    assert (attention.rope.head_dim, attention.rope.rotary_dim) == (256, 128)


def test_zamba2_shared_attention_rotates_only_with_use_mem_rope():
    hybrid = [i for i, t in enumerate(AutoConfig.for_model("zamba2").layers_block_type) if t == "hybrid"]
    plan = model_rope(AutoConfig.for_model("zamba2", use_mem_rope=True))
    assert [layer.index for layer in plan if layer.rope is not None] == hybrid
    assert plan[hybrid[0]].rope.head_dim == AutoConfig.for_model("zamba2").attention_head_dim  # 2 * 2560 / 32
    assert all(layer.rope is None for layer in model_rope(AutoConfig.for_model("zamba2")))


def test_nemotron_h_attention_layers_apply_no_rope_and_its_block_list_sets_the_depth():
    config = AutoConfig.for_model("nemotron_h")
    plan = model_rope(config)
    assert len(plan) == len(config.layers_block_type)
    assert {layer.layer_type for layer in plan} >= {"mamba", "full_attention"}
    assert all(layer.rope is None for layer in plan)


@pytest.mark.parametrize("model_type", ["pixtral", "qwen2_5_vl_vision", "mimi", "gemma4_audio"])
def test_vision_and_audio_towers_are_refused(model_type):
    with pytest.raises(ValueError, match="vision or audio tower"):
        model_rope(AutoConfig.for_model(model_type))


# -- encoder-decoders: the plan is the decoder's self-attention layers --------------------------------------
def test_t5gemma_plan_is_its_decoder_layers():
    config = AutoConfig.for_model("t5gemma")
    plan = model_rope(config)
    assert len(plan) == config.decoder.num_hidden_layers
    assert [layer.layer_type for layer in plan] == list(config.decoder.layer_types)
    assert plan[0].sliding_window == config.decoder.sliding_window


def test_moonshine_decoder_rotates_interleaved_pairs_over_0_9_of_its_heads():
    config = AutoConfig.for_model("moonshine")
    plan = model_rope(config)
    assert len(plan) == config.decoder_num_hidden_layers
    head = config.hidden_size // config.decoder_num_attention_heads  # 288 / 8
    assert (plan[0].rope.head_dim, plan[0].rope.rotary_dim) == (head, int(head * 0.9) // 2 * 2)
    assert plan[0].rope.interleaved  # its rotate_half pairs (2i, 2i + 1)


def test_dia_plan_is_its_decoder_config():
    config = AutoConfig.for_model("dia")
    plan = model_rope(config)
    assert len(plan) == config.decoder_config.num_hidden_layers
    assert plan[0].rope.head_dim == config.decoder_config.head_dim


def test_muse_layers_with_layer_rope_theta_zero_are_nope_and_the_others_rotate_with_rope_theta():
    config = AutoConfig.for_model("muse_spark_text", num_hidden_layers=8)
    plan = model_rope(config)
    assert [layer.rope is None for layer in plan] == [t == 0 for t in config.layer_rope_theta]
    assert [layer.index for layer in plan if layer.rope is None] == [3, 7]
    assert {layer.rope.base for layer in plan if layer.rope is not None} == {500000.0}
    d = hf_dict("muse_spark_text", num_hidden_layers=2, layer_types=None, layer_rope_theta=[1e4, -1])
    with pytest.raises(ValueError, match="layer_rope_theta"):
        model_rope(d)


def test_zaya_hybrid_layers_rotate_with_their_layer_types_parameters():
    d = hf_dict("zaya", num_hidden_layers=2, layer_types=["hybrid", "hybrid_sliding"], sliding_window=64)
    plan = model_rope(d)
    assert [layer.rope.base for layer in plan] == [5e6, 1e4]
    assert [layer.sliding_window for layer in plan] == [None, 64]


def test_dory_released_layout_counts_attention_and_mlp_blocks():
    config = AutoConfig.for_model("dory", num_hidden_layers=8, n_input_layers=2, n_output_layers=2)
    released = config.to_dict()  # (attention, "mlp") per layer, num_hidden_layers doubled
    assert len(released["layer_types"]) == 16 and released["num_hidden_layers"] == 16
    plan = model_rope(released)
    assert [layer.layer_type for layer in plan] == list(config.layer_types)
    assert {layer.rope.base for layer in plan if layer.layer_type == "full_attention"} == {1e7}


# -- configs transformers refuses are refused, each by a ValueError naming the key, the value and the want ---
def test_an_unknown_layer_type_is_a_value_error_naming_the_layer_and_the_entry():
    types = ["full_attention", "full_attention", "full_atention", "full_attention"]
    with pytest.raises(ValueError, match=r"config\['layer_types'\]\[2\].*'full_atention'"):
        model_rope(hf_dict("llama", num_hidden_layers=4, layer_types=types))


def test_layer_types_that_are_not_strings_are_a_value_error():
    with pytest.raises(ValueError, match=r"config\['layer_types'\]\[0\].*got 0"):
        model_rope(hf_dict("llama", num_hidden_layers=4, layer_types=[0, 1, 0, 1]))


def test_legacy_and_hybrid_layer_types_are_read():
    d = hf_dict("llama", num_hidden_layers=3, layer_types=["attention", "mamba", "full_attention"])
    assert [layer.rope is not None for layer in model_rope(d)] == [True, False, True]


@pytest.mark.parametrize("window", [-5, 0, 512.7, "512", True, float("nan")])
def test_a_sliding_window_that_is_not_a_positive_integer_is_a_value_error(window):
    d = hf_dict("gemma3_text", num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    d["sliding_window"] = window
    with pytest.raises(ValueError, match=r"config\['sliding_window'\]: expected a positive integer"):
        model_rope(d)


def test_an_unused_window_is_not_read():
    # Qwen2-MoE's released config: sliding_window 0 beside use_sliding_window false (no layer is windowed)
    plan = model_rope(AutoConfig.for_model("qwen2_moe"))
    assert {layer.sliding_window for layer in plan} == {None}


@pytest.mark.parametrize(
    ("key", "value"), [("local_attention", -2), ("local_attention", 64.5), ("local_attention", 0)]
)
def test_modernbert_local_attention_that_is_not_a_positive_integer_is_a_value_error(key, value):
    with pytest.raises(ValueError, match=rf"config\['{key}'\]"):
        model_rope(hf_dict("modernbert", **{key: value}))


def test_recurrent_gemma_attention_window_size_is_checked():
    with pytest.raises(ValueError, match=r"config\['attention_window_size'\]"):
        model_rope(hf_dict("recurrent_gemma", num_hidden_layers=3, attention_window_size=-1))


@pytest.mark.parametrize("size", [8.5, -8, 0, "8192", False])
def test_an_attention_chunk_size_that_is_not_a_positive_integer_is_a_value_error(size):
    with pytest.raises(ValueError, match=r"config\['attention_chunk_size'\]: expected a positive integer"):
        model_rope(hf_dict("llama4_text", attention_chunk_size=size))


@pytest.mark.parametrize("interval", [0, -4, "4", 4.0])
def test_a_no_rope_layer_interval_that_is_not_a_positive_integer_is_a_value_error(interval):
    d = hf_dict("llama4_text", num_hidden_layers=8, layer_types=None, no_rope_layers=[])
    d["no_rope_layer_interval"] = interval
    with pytest.raises(ValueError, match=r"config\['no_rope_layer_interval'\]: expected a positive integer"):
        model_rope(d)


@pytest.mark.parametrize(
    ("period", "offset", "match"),
    [(0, 0, "attn_layer_period"), (-8, 4, "attn_layer_period"), (8, 8, "attn_layer_offset"),
     (8, -1, "attn_layer_offset"), ("8", 4, "attn_layer_period")],
)  # fmt: skip
def test_jamba_attention_period_and_offset_are_checked(period, offset, match):
    d = hf_dict("jamba", num_hidden_layers=16, attn_layer_period=period, attn_layer_offset=offset)
    with pytest.raises(ValueError, match=rf"config\['{match}'\]"):
        model_rope(d)


BROKEN = (0, -3, 2.5, "7", True, float("nan"))


def _never_valid(bad) -> bool:
    """A value no numeric field model_rope reads may hold (a string, a bool, NaN, a negative number): taken,
    it can only leave the plan as it was (the field is not read)."""
    return isinstance(bad, (str, bool)) or math.isnan(bad) or bad < 0


# Identity and dtype keys: not RoPE fields (model_type names the config; breaking it is another model).
NOT_FIELDS = {"model_type", "transformers_version", "architectures", "_name_or_path", "torch_dtype", "dtype"}


def _numeric_breaks(value):
    """A numeric field's broken values, each with whether no read field may hold it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return []
    return [(bad, _never_valid(bad)) for bad in BROKEN]


def _other_breaks(value):
    """A string's or list's broken values: "bogus" (never valid), and a list one entry short (which may be a
    valid config: a block list can set the depth, Nemotron-H)."""
    if isinstance(value, str):
        return [("bogus", True)]
    if isinstance(value, list) and value:
        return [(["bogus"] * len(value), True), (value[:-1], False)]
    return []


def _fields(d, *, rope_entries: bool):
    """(path, key, value) of each field of d and of its language model's nested config; with rope_entries,
    also of each entry of rope_parameters / rope_scaling (per layer type too) instead of the dict itself."""
    nested = [(k,) for k in ("text_config", "thinker_config") if isinstance(d.get(k), dict)]
    for path in [(), *nested]:
        fields = d if not path else d[path[0]]
        for key, value in fields.items():
            if key in NOT_FIELDS:
                continue
            if rope_entries and isinstance(value, dict) and key in ("rope_parameters", "rope_scaling"):
                for sub, entry in value.items():
                    if isinstance(entry, dict):  # per layer type
                        yield from (((*path, key, sub), k, v) for k, v in entry.items())
                    else:
                        yield (*path, key), sub, entry
            else:
                yield path, key, value


def _break_each_field(d, breaks, *, rope_entries: bool):
    """model_rope of d with each field broken in turn by ``breaks``: a ValueError that names the field, or a
    plan; for a value no read field may hold, the plan of the unbroken config (the field is not read):
    never a plan that silently took it."""
    plan = model_rope(d)
    for path, key, value in list(_fields(d, rope_entries=rope_entries)):
        for bad, never_valid in breaks(value):
            broken = copy.deepcopy(d)
            holder = broken
            for step in path:
                holder = holder[step]
            holder[key] = bad
            try:
                got = model_rope(broken)
            except ValueError as err:  # Moonshine's decoder_* keys are read without their prefix
                assert key.removeprefix("decoder_") in str(err), (path, key, bad, str(err))
                continue
            if never_valid:
                assert got == plan, f"{(*path, key)} = {bad!r} was taken: the plan changed"


def _break_each_numeric_field(d):
    """Each numeric field of the config (and of its language model's nested config) broken in turn."""
    _break_each_field(d, _numeric_breaks, rope_entries=False)


def _break_each_other_field(d):
    """Each string and list field broken in turn, rope_parameters / rope_scaling entries included."""
    _break_each_field(d, _other_breaks, rope_entries=True)


# Qwen3-Omni's default thinker config has no readable head width (2048 over 28 heads): left out.
@pytest.mark.parametrize("model_type", [t for t in FAST if t != "qwen3_omni_moe_thinker"])
def test_a_config_with_one_numeric_field_broken_gives_a_plan_or_a_value_error_naming_the_field(model_type):
    """The fuzzer's door for model_rope: each numeric field of a real config broken in turn, one at a time,
    then each string and list field (rope_parameters' entries too). A field model_rope reads is either
    refused by a ValueError that names it or does not matter; never a TypeError, ZeroDivisionError or
    IndexError, never a silent 512 for 512.7 or a "bogus" layer type taken."""
    d = AutoConfig.for_model(model_type).to_dict()
    model_rope(d)
    _break_each_numeric_field(d)
    _break_each_other_field(d)


def _without_layer_types_equals_what_transformers_builds(model_type):
    """An older release's config.json omits layer_types, which the config class derives from other keys
    (Qwen2's use_sliding_window / max_window_layers, Gemma 2's alternation): model_rope of that dict is the
    plan of the config transformers builds from it (it was every layer alike: a silent wrong window or
    RoPE)."""
    d = AutoConfig.for_model(model_type).to_dict()
    if d.get("layer_types") is None:
        pytest.skip("this config keeps its layer types elsewhere")
    released = {k: v for k, v in d.items() if k != "layer_types"}
    built = AutoConfig.for_model(model_type, **{k: v for k, v in released.items() if k != "model_type"})
    assert model_rope(released) == model_rope(built)


@pytest.mark.parametrize(
    "model_type", ["qwen2", "gemma2", "smollm3", "llama4_text", "gpt_oss", "gemma3_text"]
)
def test_a_config_json_without_layer_types_is_planned_as_transformers_builds_it(model_type):
    _without_layer_types_equals_what_transformers_builds(model_type)


@pytest.mark.proof
@pytest.mark.parametrize(
    "model_type", sorted(set(proof.hf_coverage.rope_model_types()) & ropekit.hf_config.DERIVES_LAYER_TYPES)
)
def test_every_config_json_without_layer_types_is_planned_as_transformers_builds_it(model_type):
    try:
        model_rope(AutoConfig.for_model(model_type))
    except ValueError:
        pytest.skip("model_rope refuses the default config itself")
    _without_layer_types_equals_what_transformers_builds(model_type)


def test_without_transformers_a_config_json_that_would_derive_layer_types_is_refused(monkeypatch):
    released = {k: v for k, v in hf_dict("qwen2").items() if k != "layer_types"}
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers: ImportError
    with pytest.raises(
        ValueError, match=r"config\['layer_types'\]: not given, and a 'qwen2' config derives it"
    ):
        model_rope(released)
    plain = {k: v for k, v in hf_dict("llama").items() if k != "layer_types"}
    assert len(model_rope(plain)) == plain["num_hidden_layers"]  # Llama derives none: read as it is


def test_the_list_of_model_types_that_derive_layer_types_is_transformers_own():
    """hf_config.DERIVES_LAYER_TYPES (used where transformers is not installed) holds every model type whose
    default config has layer_types, in the pinned transformers."""
    pinned = (HERE.parent / "requirements" / "constraints.txt").read_text()
    if f"transformers=={transformers.__version__}" not in pinned:
        pytest.skip(f"the list is of the pinned transformers, not {transformers.__version__}")
    derived = set()
    for model_type in proof.hf_coverage.rope_model_types():
        try:
            if AutoConfig.for_model(model_type).to_dict().get("layer_types") is not None:
                derived.add(model_type)
        except Exception:  # a config transformers cannot build by default derives nothing here
            continue
    missing = derived - ropekit.hf_config.DERIVES_LAYER_TYPES
    assert not missing, sorted(missing)


# GPT-J / CodeGen read n_positions as max_position_embeddings, ESM rope_theta as base: named by those.
ALIASED = {"gptj", "codegen", "esm"}


@pytest.mark.proof
@pytest.mark.parametrize("model_type", sorted(set(proof.hf_coverage.rope_model_types()) - ALIASED))
def test_every_model_types_config_with_one_numeric_field_broken_gives_a_plan_or_a_value_error(model_type):
    try:
        d = AutoConfig.for_model(model_type).to_dict()
        model_rope(d)
    except ValueError:
        pytest.skip("model_rope refuses the default config itself")
    _break_each_numeric_field(d)
    _break_each_other_field(d)


@pytest.mark.parametrize(("key", "value"), [("floor_scale", 0), ("attn_scale", "0.1"), ("floor_scale", -8)])
def test_llama4_temperature_keys_are_checked_where_no_layer_rotates(key, value):
    # every layer NoPE: no RopeConfig is built, so the temperature's own keys must be checked where it is
    d = hf_dict("llama4_text", num_hidden_layers=4, layer_types=None, no_rope_layers=[0, 0, 0, 0])
    d[key] = value
    with pytest.raises(ValueError, match=rf"scaling\['{key}'\]: expected a finite number > 0"):
        model_rope(d)


@pytest.mark.parametrize("model_type", ["ministral3", "llama4_text"])
def test_the_temperature_of_a_negative_position_is_a_value_error(model_type):
    layer = next(layer for layer in model_rope(AutoConfig.for_model(model_type)) if layer.temperature)
    with pytest.raises(ValueError, match="positions: expected values >= 0, got a minimum of -1"):
        layer.attention_temperature(torch.tensor([0, -1, 5]))
    assert layer.attention_temperature(torch.tensor([], dtype=torch.int64)).shape == (0,)


# -- what a layer's attention needs beyond the rotation ---------------------------------------------------
def test_deepseek_v4_layers_say_the_values_are_rotated_and_the_output_rotated_back():
    assert all(layer.shared_kv for layer in model_rope(AutoConfig.for_model("deepseek_v4")))
    assert not any(layer.shared_kv for layer in model_rope(AutoConfig.for_model("llama")))
