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
from ropekit.integrations import hf

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
    """Make HF's apply_rotary_pos_emb raise in the model's modeling module."""

    def fail(*args, **kwargs):
        raise AssertionError("HF's apply_rotary_pos_emb was called on a patched model")

    monkeypatch.setattr(sys.modules[type(hf._rotary_layers(model)[0]).__module__], hf.HF_FUNCTION, fail)


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
    assert not any(hf.ROTARY_ATTR in m._modules for m in model.modules())
    forbid_hf_rotary(monkeypatch, model)
    with pytest.raises(AssertionError, match="was called"):
        run(model)


def test_patched_layers_use_the_requested_backend():
    model = make_model("qwen3", {"rope_type": "default"})
    hf.patch(model, backend="torch")
    ropes = {id(m._modules[hf.ROTARY_ATTR]): m._modules[hf.ROTARY_ATTR] for m in hf._rotary_layers(model)}
    assert [r.backend for r in ropes.values()] == ["torch"]
    with pytest.raises(ValueError, match="backend"):
        hf.patch(model, backend="no-such-backend")


def test_unsupported_architecture_is_named():
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB)
    model = transformers.GPT2LMHeadModel(config)
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        hf.patch(model)


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
    layer = hf._rotary_layers(model)[0]
    torch.manual_seed(2)
    x = torch.randn(2, 10, 64)
    cos_sin = model.gpt_neox.rotary_emb(x, torch.arange(3, 13)[None])  # positions 3..12; no position_ids
    with torch.no_grad():
        want = layer(x, attention_mask=None, position_embeddings=cos_sin)[0]
        hf.patch(model)
        forbid_hf_rotary(monkeypatch, model)
        got = layer(x, attention_mask=None, position_embeddings=cos_sin)[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
