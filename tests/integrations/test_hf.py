"""ropekit.integrations.hf: patched tiny HF models match unpatched ones for every family and rope_type.

Models are built from configs with random weights (nothing is downloaded): hidden 64, 2 layers, vocab 128.
max_position_embeddings is 32 and inputs run to 40 tokens, so length-dependent schedules (dynamic, longrope)
switch frequencies inside the tests.
"""

import sys

import pytest
import torch
import transformers

from ropekit import RopeConfig
from ropekit.integrations import hf, hf_probe
from ropekit.tools import hf_coverage

VOCAB, MAX_POS, SEQ = 128, 32, 40
HEAD_DIM = 16  # 64 hidden / 4 heads


def longrope(partial=1.0):
    n = int(HEAD_DIM * partial) // 2
    return {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(n)],
        "long_factor": [1.0 + 0.5 * i for i in range(n)],
        "original_max_position_embeddings": 16,
        **({"partial_rotary_factor": partial} if partial != 1.0 else {}),
    }


YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16}
CASES = {
    "llama": [
        {"rope_type": "default"},
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "dynamic", "factor": 2.0},
        YARN,
        {**YARN, "beta_fast": 16.0, "mscale": 1.2, "mscale_all_dim": 0.8},
        {
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ],
    "mistral": [{"rope_type": "default"}, YARN],
    "qwen2": [{"rope_type": "default"}, YARN, {"rope_type": "dynamic", "factor": 2.0}],
    "qwen3": [{"rope_type": "default"}, YARN],
    "phi3": [{"rope_type": "default"}, longrope(), longrope(partial=0.75)],
    "gpt_neox": [
        {"rope_type": "default", "partial_rotary_factor": 0.25},
        {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.25},
        {"rope_type": "dynamic", "factor": 2.0, "partial_rotary_factor": 0.25},
    ],
    "gemma2": [{"rope_type": "default"}],
    "gemma3_text": [
        {"sliding_attention": {"rope_type": "default"}, "full_attention": {"rope_type": "default"}},
        {
            "sliding_attention": {"rope_type": "default"},
            "full_attention": {"rope_type": "linear", "factor": 8.0},
        },
    ],
}
CONFIGS = {
    "llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
    "phi3": "Phi3Config", "gpt_neox": "GPTNeoXConfig", "gemma2": "Gemma2Config",
    "gemma3_text": "Gemma3TextConfig",
}  # fmt: skip
THETA = {"sliding_attention": 10000.0, "full_attention": 1e6}


def make_model(model_type, rope_parameters):
    if "full_attention" in rope_parameters:
        rope_parameters = {t: {**p, "rope_theta": THETA[t]} for t, p in rope_parameters.items()}
    else:
        rope_parameters = {**rope_parameters, "rope_theta": 500.0}  # a small base: positions matter more
    config = getattr(transformers, CONFIGS[model_type])(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=MAX_POS,
        rope_parameters=rope_parameters,
        pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    if model_type in ("gemma2", "gemma3_text"):
        config.head_dim, config.sliding_window = HEAD_DIM, 8
        config.layer_types = ["sliding_attention", "full_attention"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # Gemma zero-initialises its norms; random scales make every layer matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def forbid_hf_rotary(monkeypatch, model):
    """Make the model's own rotation function raise: a patched model must never need it."""

    def fail(*args, **kwargs):
        raise AssertionError("HF's apply_rotary_pos_emb was called on a patched model")

    module = sys.modules[type(model).__module__]
    held = module.apply_rotary_pos_emb  # transformers >= 5.25: a kernels function module around it
    monkeypatch.setattr(hf_probe.model_function(held), "__code__", fail.__code__)


def inputs():
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, SEQ))
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, :7] = 0  # row 1 is left-padded: per-row position ids
    ids[1, :7] = 0
    return ids, mask


def run(model):
    ids, mask = inputs()
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
        prompt, prompt_mask = ids[:, :28], mask[:, :28]  # generation crosses MAX_POS
        tokens = model.generate(
            prompt, attention_mask=prompt_mask, max_new_tokens=8, do_sample=False, pad_token_id=0
        )
    return logits, tokens


@pytest.mark.cover(every=2)  # fast tier: every 2nd case; the others: make proofs
@pytest.mark.parametrize(
    ("model_type", "rope_parameters"),
    [(t, p) for t, cases in CASES.items() for p in cases],
    ids=[f"{t}-{i}" for t, cases in CASES.items() for i in range(len(cases))],
)
def test_patched_model_matches_hf_and_never_calls_hf_rotary(model_type, rope_parameters, monkeypatch):
    model = make_model(model_type, rope_parameters)
    want_logits, want_tokens = run(model)
    assert hf.patch(model) == 2
    forbid_hf_rotary(monkeypatch, model)
    got_logits, got_tokens = run(model)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=0)
    assert torch.equal(got_tokens, want_tokens)


def test_unpatch_restores_hf_code(monkeypatch):
    model = make_model("llama", {"rope_type": "default"})
    hf.patch(model)
    assert hf.patch(model) == 2  # idempotent
    assert hf.unpatch(model) == 2
    assert not hf.patched_layers(model)
    forbid_hf_rotary(monkeypatch, model)
    with pytest.raises(AssertionError, match="was called"):
        run(model)


def spy_backends(monkeypatch):
    """Record the backend= of every ropekit rotation a patched layer runs."""
    seen = []
    real = hf_probe.apply_rotary_qk

    def spy(*args, **kwargs):
        seen.append(kwargs["backend"])
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_probe, "apply_rotary_qk", spy)
    return seen


def test_patched_layers_rotate_with_the_requested_backend(monkeypatch):
    model = make_model("qwen3", {"rope_type": "default"})
    hf.patch(model, backend="torch")
    seen = spy_backends(monkeypatch)
    run(model)
    assert seen and set(seen) == {"torch"}
    with pytest.raises(ValueError, match="backend"):
        hf.patch(model, backend="no-such-backend")


def test_model_without_rope_is_refused_saying_nothing_to_patch():
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB)
    model = transformers.GPT2LMHeadModel(config)
    with pytest.raises(ValueError, match="nothing to patch in GPT2LMHeadModel"):
        hf.patch(model)


def test_layers_are_found_from_the_code_not_the_model_type():
    model = make_model("llama", {"rope_type": "default"})
    model.config.model_type = "brand_new_architecture"
    assert hf.patch(model) == 2


def mirror_pairing(q, k, cos, sin, unsqueeze_dim=1):
    """A rotation that pairs feature i with D-1-i: no RoPE layout ropekit knows."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return tuple(x * cos + x.flip(-1) * sin for x in (q, k))


def off_by_one_position(q, k, cos, sin, unsqueeze_dim=1):
    """HF's half pairing, but every token rotated by its predecessor's angle."""
    cos, sin = cos.roll(1, dims=-2).unsqueeze(unsqueeze_dim), sin.roll(1, dims=-2).unsqueeze(unsqueeze_dim)
    half = q.shape[-1] // 2

    def rotate(x):
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return tuple(x * cos + rotate(x) * sin for x in (q, k))


@pytest.mark.parametrize("wrong", [mirror_pairing, off_by_one_position], ids=["mirror", "off-by-one"])
def test_a_rotation_ropekit_does_not_reproduce_is_refused_before_anything_changes(wrong, monkeypatch):
    model = make_model("llama", {"rope_type": "default"})
    monkeypatch.setattr(sys.modules[type(model).__module__], "apply_rotary_pos_emb", wrong)
    with pytest.raises(ValueError, match=r"llama layer 'model.layers.0.self_attn'.*smallest difference \d"):
        hf.patch(model)
    assert not hf.patched_layers(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
    with pytest.warns(UserWarning, match="not patched"):
        assert hf.patch(model, strict=False) == 0
    assert not hf.patched_layers(model)


def test_a_layer_that_applies_no_rope_is_left_alone():
    """Llama 4 skips RoPE in chosen layers (NoPE); those layers keep HF's code."""
    config = transformers.Llama4TextConfig(
        hidden_size=64, intermediate_size=128, intermediate_size_mlp=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, num_local_experts=2,
        no_rope_layers=[1, 1, 1, 0], pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(config).eval()
    ids, _ = inputs()
    with torch.no_grad():
        want = model(ids).logits
        assert hf.patch(model) == 3
        assert "model.layers.3.self_attn" not in hf.patched_layers(model)
        torch.testing.assert_close(model(ids).logits, want, atol=1e-4, rtol=0)


def test_patched_layer_reads_the_models_table_in_place(monkeypatch):
    """No copy of cos/sin per layer: ropekit receives a view of the rotary module's own table."""
    model = make_model("llama", {"rope_type": "default"})
    hf.patch(model)
    rotate = model.model.layers[0].self_attn.__dict__[hf.STAND_INS_ATTR]["apply_rotary_pos_emb"]
    seen = []
    real = hf_probe.apply_rotary_qk

    def spy(q, k, cos, sin, **kwargs):
        seen.append(cos)
        return real(q, k, cos, sin, **kwargs)

    monkeypatch.setattr(hf_probe, "apply_rotary_qk", spy)
    q, k = torch.randn(2, 4, 10, HEAD_DIM), torch.randn(2, 2, 10, HEAD_DIM)
    cos, sin = model.model.rotary_emb(q, torch.arange(10).expand(2, 10))
    got_q, _ = rotate(q, k, cos, sin)
    assert seen and seen[0].untyped_storage().data_ptr() == cos.untyped_storage().data_ptr()
    mod = sys.modules[type(model).__module__]
    torch.testing.assert_close(got_q, mod.apply_rotary_pos_emb(q, k, cos, sin)[0], atol=1e-6, rtol=0)
    assert rotate.__wrapped_model_function__ is (hf_probe.model_function(mod.apply_rotary_pos_emb))


EXTENSIONS = [
    ("linear", 2.0, {}),
    ("ntk", 2.0, {}),
    ("dynamic", 2.0, {}),
    ("yarn", 2.0, {"beta_fast": 16.0}),
    ("llama3", 4.0, {}),
    ("longrope", 2.0, {"short_factor": [1.0] * 8, "long_factor": [1.0 + i for i in range(8)]}),
]


@pytest.mark.parametrize(("method", "factor", "params"), EXTENSIONS, ids=[e[0] for e in EXTENSIONS])
def test_extend_context_updates_config_and_both_rotary_paths(method, factor, params, monkeypatch):
    model = make_model("llama", {"rope_type": "default"})
    ids, mask = inputs()
    with torch.no_grad():
        before = model(ids, attention_mask=mask).logits
    hf.patch(model)
    new = hf.extend_context(model, method, factor, **params)
    rope = RopeConfig.from_hf(model.config)
    assert rope.rope_type == ("default" if method == "ntk" else method)
    assert model.config.rope_parameters == new
    with torch.no_grad():
        patched = model(ids, attention_mask=mask).logits
        hf.unpatch(model)
        unpatched = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(patched, unpatched, atol=1e-4, rtol=0)
    assert (unpatched - before).abs().max() > 1e-3  # the extension really changed the model


def test_extend_context_rejects_bad_requests_without_changing_the_model():
    model = make_model("llama", {"rope_type": "default"})
    old = dict(model.config.rope_parameters)
    with pytest.raises(ValueError, match="method"):
        hf.extend_context(model, "magic", 2.0)
    with pytest.raises(ValueError, match="factor"):
        hf.extend_context(model, "linear", -1.0)
    with pytest.raises(ValueError, match="long_factor"):
        hf.extend_context(model, "longrope", 2.0, short_factor=[1.0] * 8)
    assert model.config.rope_parameters == old


def test_extend_context_on_gemma3_scales_full_attention_only():
    model = make_model("gemma3_text", CASES["gemma3_text"][0])
    hf.patch(model)
    hf.extend_context(model, "linear", 8.0)
    params = model.config.rope_parameters
    assert params["full_attention"]["rope_type"] == "linear"
    assert params["sliding_attention"]["rope_type"] == "default"
    # patched again: the full-attention layer's table is model_rope's of the extended config
    ropes = {e.layer_type: e.rope for e in hf.layer_ropes(model).values()}
    assert ropes["full_attention"].scaling["factor"] == 8.0 and ropes["sliding_attention"].scaling is None
    ids, mask = inputs()
    with torch.no_grad():
        patched = model(ids, attention_mask=mask).logits
        hf.unpatch(model)
        torch.testing.assert_close(patched, model(ids, attention_mask=mask).logits, atol=1e-4, rtol=0)


def test_gemma3_multimodal_wrapper_patches_its_language_model(monkeypatch):
    text = make_model("gemma3_text", CASES["gemma3_text"][1]).config
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
        patch_size=14,
    )  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=VOCAB - 1,
        boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    ids, mask = inputs()
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        assert hf.patch(model) == 2  # the two text layers; the vision tower has no RoPE
        forbid_hf_rotary(monkeypatch, model)
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, want, atol=1e-4, rtol=0)


def test_patched_model_compiles_without_graph_breaks(monkeypatch):
    model = make_model("llama", {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16})
    ids, mask = inputs()
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        hf.patch(model)
        model(ids, attention_mask=mask)  # eager warm-up: tables sized, backend chosen outside the graph
        forbid_hf_rotary(monkeypatch, model)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(compiled(ids, attention_mask=mask).logits, want, atol=1e-4, rtol=0)


def test_layer_called_without_position_ids_rotates_with_hfs_tables_through_ropekit(monkeypatch):
    model = make_model("gpt_neox", CASES["gpt_neox"][0])  # partial rotary: the table is narrower than a head
    layer = model.gpt_neox.layers[0].attention
    torch.manual_seed(2)
    x = torch.randn(2, 10, 64)
    cos_sin = model.gpt_neox.rotary_emb(x, torch.arange(3, 13)[None])  # positions 3..12; no position_ids
    with torch.no_grad():
        want = layer(x, attention_mask=None, position_embeddings=cos_sin)[0]
        hf.patch(model)
        forbid_hf_rotary(monkeypatch, model)
        got = layer(x, attention_mask=None, position_embeddings=cos_sin)[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def logits(model):
    ids, mask = inputs()
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits


def test_extend_context_twice_equals_once():
    model = make_model("llama", {"rope_type": "default"})
    once = hf.extend_context(model, "yarn", 4.0)
    after_once = logits(model)
    twice = hf.extend_context(model, "yarn", 4.0)
    assert twice == once and once["original_max_position_embeddings"] == MAX_POS
    assert model.config.max_position_embeddings == 4 * MAX_POS
    torch.testing.assert_close(logits(model), after_once, atol=0, rtol=0)
    hf.extend_context(model, "linear", 2.0)  # another setting, still from the training length
    assert model.config.max_position_embeddings == 2 * MAX_POS


def test_reapplying_the_published_scaling_changes_nothing():
    """A Llama-3.1-style config: llama3 factor 8 from 16 tokens, published with a 16x max length."""
    published = {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }  # fmt: skip
    model = make_model("llama", published)
    model.config.max_position_embeddings = 256
    before_params, before = dict(model.config.rope_parameters), logits(model)
    hf.extend_context(model, "llama3", 8.0)
    assert model.config.rope_parameters == before_params
    assert model.config.max_position_embeddings == 256
    torch.testing.assert_close(logits(model), before, atol=0, rtol=0)
    new = hf.extend_context(model, "llama3", 16.0)  # a real change starts from the published 16 tokens
    assert new["original_max_position_embeddings"] == 16 and model.config.max_position_embeddings == 256


def test_extend_context_keeps_the_backend_chosen_at_patch_time(monkeypatch):
    model = make_model("llama", {"rope_type": "default"})
    hf.patch(model, backend="torch")
    hf.extend_context(model, "yarn", 2.0)
    seen = spy_backends(monkeypatch)
    logits(model)
    assert seen and set(seen) == {"torch"}
    assert len(hf.patched_layers(model)) == 2


def test_extend_context_rejects_a_shrink_without_changing_the_model():
    model = make_model("llama", {"rope_type": "default"})
    old = dict(model.config.rope_parameters)
    with pytest.raises(ValueError, match="factor"):
        hf.extend_context(model, "yarn", 0.5)
    assert model.config.rope_parameters == old and model.config.max_position_embeddings == MAX_POS


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen2_vl", "gpt_neox", "cohere", "modernbert"])
def test_extend_context_serves_other_families_patched_and_unpatched_alike(model_type):
    model, _ = hf_coverage._build(model_type)
    ids = hf._token_ids(model, torch.device("cpu"))

    def out():
        with torch.no_grad():
            return hf_coverage._main_output(model(input_ids=ids))

    before = out()
    hf.patch(model)
    new = hf.extend_context(model, "yarn", 4.0)
    assert new["rope_type"] == "yarn"
    patched = out()
    hf.unpatch(model)
    torch.testing.assert_close(patched, out(), atol=1e-4, rtol=0)
    assert (patched - before).abs().max() > 1e-4  # the extension really changed the model


def test_patch_probes_in_eval_mode_and_restores_training_mode():
    model = make_model("llama", {"rope_type": "default"}).train()
    modes = []
    model.model.register_forward_pre_hook(lambda module, args: modes.append(module.training))
    hf.patch(model)
    assert modes == [False] and model.training


def test_patched_layer_reads_no_tensor_data_on_the_host(monkeypatch):
    """A patched layer's step runs on meta tensors, where any host read of data (.item(), .tolist(),
    int(tensor): a device sync on CUDA) fails: patching adds no sync to a decode step (issue 10)."""
    model = make_model("llama", {"rope_type": "default"})
    hf.patch(model)  # proved on the CPU, then moved: the patched code is what runs on meta
    rotary, layer = model.model.rotary_emb, model.model.layers[0].self_attn
    model.to("meta")
    forbid_hf_rotary(monkeypatch, model)
    seen = spy_backends(monkeypatch)
    hidden = torch.randn(2, 1, 64, device="meta")  # (batch, seq, hidden): one decode token per row
    positions = torch.tensor([[37], [12]]).to("meta")
    out, _ = layer(hidden, position_embeddings=rotary(hidden, positions), attention_mask=None)
    assert out.device.type == "meta" and out.shape == (2, 1, 64)
    assert seen  # ropekit rotated: HF's own function would have raised


def test_patching_a_model_built_on_meta_is_a_value_error_and_changes_nothing():
    """Issue 17, repro 7: a RuntimeError from .item() deep inside the proof."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(
        ValueError, match=r"^model: LlamaForCausalLM has tensors on the meta device \('model\."
    ):
        hf.patch(model)
    assert hf.patched_layers(model) == {}


@pytest.mark.parametrize("step", [1.0, 0.5], ids=["integral", "fractional"])
def test_float_position_ids_run_as_the_unpatched_model_runs_them(step):
    """Qwen3-Omni's own get_rope_index hands its rotary module float32 position ids, which HF's rotary modules
    accept: a patched model runs them too (integral or not, through the module's own table code)."""
    model = make_model("llama", {"rope_type": "default"})
    ids, _ = inputs()
    positions = (torch.arange(SEQ, dtype=torch.float32) * step).expand(2, SEQ)
    with torch.no_grad():
        want = model(ids, position_ids=positions).logits
        hf.patch(model)
        assert hf.layer_ropes(model)  # the layers read ropekit's tables for integer positions
        got = model(ids, position_ids=positions).logits
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.cover
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("model_type", ["llama", "gpt_neox", "gemma3_text", "qwen2"])
def test_patched_with_numerics_hf_the_logits_and_generation_are_the_unpatched_models_bits(
    model_type, dtype, monkeypatch
):
    model = make_model(model_type, CASES[model_type][-1]).to(dtype)
    want_logits, want_tokens = run(model)
    assert hf.patch(model, numerics="hf") == 2
    assert hf.layer_ropes(model) == {}  # the model's own tables: the bits to reproduce
    forbid_hf_rotary(monkeypatch, model)
    got_logits, got_tokens = run(model)
    assert torch.equal(got_logits, want_logits) and torch.equal(got_tokens, want_tokens)


def test_patched_with_numerics_hf_a_float32_rotation_keeps_its_one_rounding():
    model = hf_coverage._build("cohere")[0].to(torch.bfloat16)  # Cohere rotates q.float(), then casts back
    hf.patch(model, numerics="hf")
    conventions = {c for fns in hf.patched_layers(model).values() for c in fns.values()}
    assert conventions and not any("numerics='hf'" in c for c in conventions), conventions


@pytest.mark.parametrize("numerics", ["vllm", "HF", None])
def test_patch_refuses_numerics_other_than_exact_and_hf_before_changing_the_model(numerics):
    model = make_model("llama", {"rope_type": "default"})
    with pytest.raises(ValueError, match="numerics: expected"):
        hf.patch(model, numerics=numerics)
    assert hf.patched_layers(model) == {}
