"""Trainer = engine (issue 36): with the default numerics, a transformers model patched by ropekit and the
same RoPE served by ropekit's vLLM plugin rotate q and k to identical bits; so do torchtitan's override and
the HF patch.

The HF side is a tiny model (one decoder layer, head_dim 32) patched by ``ropekit.integrations.hf.patch``;
its attention's rotation is recorded where the patched layer calls ropekit (the q and k it rotates and the
results). The engine side is vLLM's ``get_rope`` with the model's RoPE parameters, under the plugin, fed the
same q and k as vLLM packs them: (tokens, heads * head_dim), one position per token. Both read ropekit's
table (angles in float64, rounded to float32, then to the model's dtype) and rotate in float32, so
``torch.equal`` holds, for one sequence, a ragged batch (padded on the HF side, packed on vLLM's) and a decode
step at each sequence's offset.
"""

from __future__ import annotations

import copy
import functools
from typing import NamedTuple

import pytest
import torch
import transformers
import vllm.model_executor.layers.rotary_embedding as vllm_rope

from ropekit.integrations import hf, hf_probe
from ropekit.integrations import vllm as plugin

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("vllm_plugin_loaded")]

HEAD_DIM, MAX_POS, VOCAB = 32, 256, 64
LENGTHS = (5, 11, 8)  # the ragged batch: three sequences, padded by HF, packed by vLLM
DTYPES = [torch.float32, torch.bfloat16]


class Family(NamedTuple):
    """A rope family as a transformers model writes it and as vLLM's model code asks get_rope for it."""

    config: str  # the transformers config class
    rope: dict  # its rope_parameters
    neox: bool = True  # vLLM's is_neox_style for the model
    fields: dict | None = None  # other config fields
    engine_rope: dict | None = None  # what vLLM's model passes get_rope, where it rewrites rope_parameters
    # HF's function copies pairs (2i, 2i + 1) to halves (i, i + D/2) and rotates those (DeepSeek's
    # apply_rotary_pos_emb_interleave): its q and k leave in halves order, vLLM's in pairs order.
    halves_copy: bool = False


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
DEEPSEEK_YARN = {**YARN, "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
LLAMA3 = dict(
    rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=32,
)  # fmt: skip
PROPORTIONAL = {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25}
FAMILIES = {
    "default": Family("LlamaConfig", {"rope_type": "default", "rope_theta": 10000.0}),
    "partial": Family("GPTNeoXConfig", {"rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    "gptj-pairs": Family("CohereConfig", {"rope_type": "default", "rope_theta": 10000.0}, neox=False),
    "linear": Family("LlamaConfig", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "dynamic": Family("LlamaConfig", {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
    # HunYuan's checkpoints write NTK-alpha as "dynamic" with an alpha (and a factor vLLM does not read).
    "ntk-alpha": Family(
        "HunYuanDenseV1Config",
        {"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0, "factor": 1.0},
    ),
    "yarn": Family("LlamaConfig", YARN),
    # torchtitan's YaRN: a pure rotation (it folds mscale into its softmax scale).
    "yarn-rotation": Family("LlamaConfig", {**YARN, "attention_factor": 1.0}),
    "llama3": Family("LlamaConfig", LLAMA3),
    # Gemma 4's global layers: p-RoPE on a quarter of the pairs.
    "proportional": Family(
        "Gemma4TextConfig",
        {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": PROPORTIONAL,
        },
        fields={"layer_types": ["full_attention"], "global_head_dim": HEAD_DIM},
        engine_rope=PROPORTIONAL,
    ),
    # DeepSeek-V3's MLA: the rope part of q and k (qk_rope_head_dim), pairs (2i, 2i + 1); vLLM's model asks
    # for deepseek_yarn.
    "deepseek-yarn": Family(
        "DeepseekV3Config",
        DEEPSEEK_YARN,
        neox=False,
        fields=dict(
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=HEAD_DIM,
            qk_nope_head_dim=16,
            v_head_dim=16,
            first_k_dense_replace=1,
            num_key_value_heads=2,
        ),
        engine_rope={**DEEPSEEK_YARN, "rope_type": "deepseek_yarn"},
        halves_copy=True,
    ),
}


@functools.cache
def patched_model(family: str, dtype: torch.dtype):
    """The family's tiny transformers model in dtype, patched by ropekit, each layer on ropekit's tables."""
    f = FAMILIES[family]
    fields = dict(
        hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=HEAD_DIM, vocab_size=VOCAB, max_position_embeddings=MAX_POS,
        rope_parameters=copy.deepcopy(f.rope), pad_token_id=0,
    )  # fmt: skip
    config = getattr(transformers, f.config)(**{**fields, **(f.fields or {})})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval().to(dtype)
    hf.patch(model)
    assert hf.layer_ropes(model), "the patched layers read the model's own tables, not ropekit's"
    return model


def vllm_module(family: str, dtype: torch.dtype):
    f = FAMILIES[family]
    return vllm_rope.get_rope(HEAD_DIM, MAX_POS, f.neox, dict(f.engine_rope or f.rope), dtype)


class Recorded:
    """What the patched layer's rotation received and returned: q, k, q_out, k_out, each (B, S, H, D).

    Both of ropekit's calls a patched layer makes are recorded: one for q and k, or one each (Gemma 4
    rotates them apart).
    """

    def __init__(self, monkeypatch):
        self.tensors = []  # (x, x rotated), in call order
        for name in ("apply_rotary", "apply_rotary_qk"):
            monkeypatch.setattr(hf_probe, name, self._recorder(getattr(hf_probe, name)))

    def _recorder(self, rotate):
        def record(*args, **kwargs):
            inputs = [t.clone() for t in args[: 2 if rotate.__name__ == "apply_rotary_qk" else 1]]
            out = rotate(*args, **kwargs)  # may rotate in place: the inputs are cloned first
            outs = out if isinstance(out, tuple) else (out,)
            self.tensors += [(x, y.clone()) for x, y in zip(inputs, outs, strict=True)]
            return out

        return record

    def last(self):
        assert len(self.tensors) == 2, f"expected q and k rotated once (one layer), got {len(self.tensors)}"
        (q, q_out), (k, k_out) = self.tensors
        self.tensors = []
        return q, k, q_out, k_out


def batch(lengths):
    """Right-padded token ids, attention mask and positions (B, S) of sequences of these lengths."""
    g = torch.Generator().manual_seed(len(lengths))
    width = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), width), generator=g)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()  # (B, S)
    return ids * mask, mask, torch.arange(width)[None].expand(len(lengths), width)


def packed(t, mask):
    """The valid tokens of (B, S, H, D) as vLLM packs them: (tokens, H * D), sequence after sequence."""
    return t[mask.bool()].flatten(1)


def engine_rotation(module, positions, q, k):
    """vLLM's rotation of packed q and k under the plugin, out of place and in place (the two forwards)."""
    got_q, got_k = module.forward_native(positions, q, k)
    in_q, in_k = q.clone(), k.clone()
    module.forward_cpu(positions, in_q, in_k)
    assert torch.equal(in_q, got_q) and torch.equal(in_k, got_k)
    return got_q, got_k


def runs(model, recorded):
    """(name, valid tokens (B, S), positions (B, S), (q, k, q_out, k_out) each (B, S, H, D)) for each batch
    composition: one sequence, a ragged batch (right-padded), then one decode step of that batch."""
    out = []
    with torch.no_grad():
        ids, mask, positions = batch(LENGTHS[1:2])
        model(ids, attention_mask=mask, position_ids=positions)
        out.append(("one sequence", mask, positions, recorded.last()))
        ids, mask, positions = batch(LENGTHS)
        prefill = model(ids, attention_mask=mask, position_ids=positions, use_cache=True)
        out.append(("ragged batch", mask, positions, recorded.last()))
        # One decode step: each sequence's next token at its own offset (5, 11, 8), on the prefill's cache.
        step = torch.tensor(LENGTHS)[:, None]  # (B, 1)
        mask = torch.cat([mask, torch.ones_like(step)], dim=1)
        model(ids[:, :1], attention_mask=mask, position_ids=step, past_key_values=prefill.past_key_values)
        out.append(("decode step", torch.ones_like(step), step, recorded.last()))
    return out


def compositions(model, recorded, halves_copy):
    """:func:`runs` as vLLM packs them: (name, positions (T,), q, k, q_out, k_out), the valid tokens only;
    with halves_copy, the features back in pairs order (2i, 2i + 1), where vLLM reads and writes them."""
    to_pairs = torch.stack((torch.arange(HEAD_DIM // 2), torch.arange(HEAD_DIM // 2, HEAD_DIM)), -1).flatten()
    order = to_pairs if halves_copy else slice(None)
    return [
        (name, positions[valid.bool()], *(packed(t[..., order], valid) for t in tensors))
        for name, valid, positions, tensors in runs(model, recorded)
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_patch_and_vllm_plugin_rotate_q_and_k_to_identical_bits(family, dtype, monkeypatch):
    model = patched_model(family, dtype)
    recorded = Recorded(monkeypatch)  # after patch, whose proof rotates too
    module = vllm_module(family, dtype)
    for name, positions, q, k, q_out, k_out in compositions(model, recorded, FAMILIES[family].halves_copy):
        got_q, got_k = engine_rotation(module, positions, q, k)
        assert not torch.equal(got_q, q), name  # it rotated
        assert torch.equal(got_q, q_out), (name, (got_q.float() - q_out.float()).abs().max())
        assert torch.equal(got_k, k_out), (name, (got_k.float() - k_out.float()).abs().max())


def _vllms_own_cache(module):
    """The cache vLLM's own class computes for the module, in its dtype."""
    vllm_class = next(c for c in type(module).__mro__ if c.__module__.startswith("vllm."))
    return vllm_class._compute_cos_sin_cache(module).to(module.cos_sin_cache.dtype)


def test_plugin_cache_is_ropekits_table_where_vllms_own_differs_in_float32():
    module = vllm_module("llama3", torch.float32)
    config = plugin.rope_config(module)
    cos, sin = config.cos_sin(module.cos_sin_cache.shape[0])
    assert torch.equal(module.cos_sin_cache, torch.cat([cos, sin], -1))
    assert not torch.equal(module.cos_sin_cache, _vllms_own_cache(module))  # what the plugin changes


@pytest.mark.parametrize(
    "params",
    [{"rope_type": "ntk", "factor": 2.0}, {"rope_type": "linear", "factor": 2.0}],
    ids=["vLLM's ntk (not ropekit's)", "a misread factor"],
)
def test_a_table_ropekit_cannot_prove_is_vllms_own_cache_kept(params, monkeypatch):
    if params["rope_type"] == "linear":  # a mapping that reads the wrong factor fails the proof
        monkeypatch.setitem(
            plugin.SCALINGS, "LinearScalingRotaryEmbedding", lambda m: {**params, "factor": 3.0}
        )
    vllm_rope._ROPE_DICT.clear()
    module = vllm_rope.get_rope(HEAD_DIM, 64, True, {"rope_theta": 10000.0, **params}, torch.float32)
    vllm_rope._ROPE_DICT.clear()
    assert type(module) in plugin.registered().values()
    assert torch.equal(module.cos_sin_cache, _vllms_own_cache(module))


# -- torchtitan's override against the HF patch ------------------------------------------------------------

# (HF family, torchtitan class, its scaling fields): the same RoPE.
TORCHTITAN = {
    "default": ("CosSinRoPE", {"theta": 10000.0}),
    "gptj-pairs": ("ComplexRoPE", {"theta": 10000.0}),
    "llama3": (
        "ComplexRoPE",
        {
            "theta": 500000.0,
            "scaling": "llama",
            "scaling_factor": 8.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "yarn-rotation": (
        "CosSinRoPE",
        {"theta": 10000.0, "scaling": "yarn", "rope_factor": 4.0, "original_seq_len": 64, "truncate": True},
    ),
}


@pytest.mark.parametrize("family", list(TORCHTITAN))
def test_torchtitan_override_and_hf_patch_rotate_q_and_k_to_identical_bits_in_float32(family, monkeypatch):
    """torchtitan trains in float32 RoPE: its cache stays float32 whatever q's dtype (the stock modules'
    contract), where a bfloat16 HF model reads bfloat16 rows; float32 is where the two promise the same table.
    A llama3 table is rotated in halves by HF's Llama and in pairs by torchtitan's ComplexRoPE: the HF side
    is Llama's, permuted (the rotation of each pair does not depend on where its features sit)."""
    from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE

    from ropekit.integrations.torchtitan import rope

    kind, fields = TORCHTITAN[family]
    stock = {"ComplexRoPE": ComplexRoPE, "CosSinRoPE": CosSinRoPE}[kind]
    module = rope(stock.Config(dim=HEAD_DIM, max_seq_len=MAX_POS, **fields)).build()
    model = patched_model(family, torch.float32)
    recorded = Recorded(monkeypatch)
    neox = FAMILIES[family].neox
    # HF's halves (i, i + D/2) as torchtitan's pairs (2i, 2i + 1), where the two disagree.
    to_pairs = torch.stack((torch.arange(HEAD_DIM // 2), torch.arange(HEAD_DIM // 2, HEAD_DIM)), -1).flatten()
    order = to_pairs if neox and kind == "ComplexRoPE" else slice(None)
    for name, _, positions, tensors in runs(model, recorded):
        q, k, q_out, k_out = (t[..., order] for t in tensors)
        got_q, got_k = module(q, k, positions)
        assert not torch.equal(got_q, q), name  # it rotated
        assert torch.equal(got_q, q_out), (name, (got_q - q_out).abs().max())
        assert torch.equal(got_k, k_out), (name, (got_k - k_out).abs().max())
