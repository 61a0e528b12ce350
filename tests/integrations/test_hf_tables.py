"""ropekit.integrations.hf_tables: a patched model's tables come from model_rope, per layer type, only once
proved equal to the model's own.

Tiny models are built from configs (tests/model_rope_proof.py's, hf_coverage's); nothing is downloaded.
"""

import contextlib
import dataclasses
import inspect
import logging

import pytest
import torch

import ropekit
from model_rope_proof import build
from ropekit import RopeConfig
from ropekit.integrations import hf, hf_tables
from ropekit.tools import hf_coverage


def tiny(model_type):
    model, _ = hf_coverage._build(model_type)
    return model


def logits(model):
    ids = hf._token_ids(model, torch.device("cpu"))
    with torch.no_grad():
        return model(input_ids=ids).logits


# Models whose layers differ in RoPE: per-layer-type parameters (Gemma 3n, Gemma 4 with wider full-attention
# heads, OLMo 3), DeepSeek-V4's main / compress tables on trailing rope slices, Llama 4's chunked and NoPE
# layers, SmolLM3's NoPE layers.
PER_LAYER_TYPE = ["gemma3n_text", "gemma4_text", "olmo3", "deepseek_v4", "llama4_text", "smollm3"]


@contextlib.contextmanager
def rotary_modules_raise(model):
    """While inside, a rotary module's own code raises when asked for a layer type whose table patch serves
    from model_rope (DeepSeek-V4 also computes a "main" table no layer of the tiny model reads)."""
    served = {
        type(m): set(m.__dict__[hf_tables.TABLES_ATTR])
        for m in model.modules()
        if hf_tables.TABLES_ATTR in m.__dict__
    }
    saved = [(cls, cls.forward) for cls in served]

    def failing(cls, forward):
        signature = inspect.signature(forward)

        def fail(*args, **kwargs):
            layer_type = signature.bind(*args, **kwargs).arguments.get("layer_type")
            if layer_type in served[cls]:
                raise AssertionError(
                    f"the model's own rotary module ran for {layer_type!r} on a patched model"
                )
            return forward(*args, **kwargs)

        return fail

    try:
        for cls, forward in saved:
            cls.forward = failing(cls, forward)
        yield
    finally:
        for cls, forward in saved:
            cls.forward = forward


@pytest.mark.parametrize("model_type", PER_LAYER_TYPE)
def test_models_whose_layers_differ_get_model_ropes_table_per_layer(model_type):
    model = build(model_type)
    ids = hf._token_ids(model, torch.device("cpu"))
    plan = ropekit.model_rope(model.config)
    with torch.no_grad():
        want = model(input_ids=ids).logits
        assert hf.patch(model) >= sum(entry.rope is not None for entry in plan)
        with hf_coverage._model_functions_raise(model), rotary_modules_raise(model):
            got = model(input_ids=ids).logits
    # HF forms its angles in float32, ropekit in float64: float32 rounding of the tables, nothing more.
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
    ropes = hf.layer_ropes(model)
    patched = hf.patched_layers(model)
    assert set(ropes) == set(patched)  # every patched layer reads ropekit's tables
    for name, entry in ropes.items():
        assert entry == plan[hf._layer_index(model.get_submodule(name), name)]
    rotating = {e.index for e in plan if e.rope is not None}
    assert {entry.index for entry in ropes.values()} == rotating  # NoPE layers untouched
    assert all("tables from model_rope" in d for fns in patched.values() for d in fns.values())


def test_each_layer_type_reads_its_own_table_not_one_for_all():
    """Gemma 4: sliding layers get a 16-wide default RoPE, full-attention layers the 32-wide proportional one;
    the patched rotary module returns, for each layer type, model_rope's table of that layer's entry."""
    model = build("gemma4_text")
    hf.patch(model)
    ropes = {entry.layer_type: entry.rope for entry in hf.layer_ropes(model).values()}
    assert set(ropes) == {"sliding_attention", "full_attention"}
    assert ropes["sliding_attention"] != ropes["full_attention"]
    rotary = model.model.rotary_emb
    positions = torch.arange(20).expand(2, 20)
    x = torch.zeros(2, 20, 8)
    for layer_type, rope in ropes.items():
        cos, sin = rotary(x, positions, layer_type)
        want_cos, want_sin = rope.cos_sin(positions)  # (2, 20, R/2), float64 angles
        torch.testing.assert_close(cos, torch.cat((want_cos, want_cos), -1), atol=0, rtol=0)
        torch.testing.assert_close(sin, torch.cat((want_sin, want_sin), -1), atol=0, rtol=0)
    assert (
        rotary(x, positions, "full_attention")[0].shape[-1]
        == 2 * rotary(x, positions, "sliding_attention")[0].shape[-1]
    )


def test_a_config_model_rope_refuses_keeps_the_models_tables(monkeypatch, caplog):
    model = tiny("gemma3_text")  # sliding and full-attention layers
    want = logits(model)

    def refuse(config):
        raise ValueError("config['model_type']: model_rope does not read this layout")

    monkeypatch.setattr(hf, "model_rope", refuse)
    with caplog.at_level(logging.INFO, logger=hf.__name__):
        assert hf.patch(model) == 2
    assert "keeps its own cos/sin tables" in caplog.text
    assert hf.layer_ropes(model) == {}
    descriptions = [d for fns in hf.patched_layers(model).values() for d in fns.values()]
    assert descriptions and all(d.endswith("the model's tables") for d in descriptions)
    assert not any(hf_tables.TABLES_ATTR in m.__dict__ for m in model.modules())
    torch.testing.assert_close(logits(model), want, atol=1e-4, rtol=0)


def test_unpatch_gives_rotary_modules_their_own_code_back():
    model = tiny("gemma3_text")  # sliding and full-attention layers
    hf.patch(model)
    assert "forward" in model.model.rotary_emb.__dict__
    hf.unpatch(model)
    assert "forward" not in model.model.rotary_emb.__dict__ and hf.layer_ropes(model) == {}


def _wrong_base(plan):
    return [dataclasses.replace(e, rope=RopeConfig(e.rope.head_dim, 2 * e.rope.base)) for e in plan]


def _first_layer_nope(plan):
    return [dataclasses.replace(plan[0], rope=None), *plan[1:]]


@pytest.mark.parametrize(
    ("wrong", "reason"),
    [(_wrong_base, "rows differ from the module's by"), (_first_layer_nope, "not one RoPE")],
    ids=["wrong-base", "nope-but-rotates"],
)
def test_a_model_rope_table_unequal_to_the_models_is_not_served(wrong, reason, monkeypatch, caplog):
    """A plan whose table differs from what the model computes (another base), or that calls a rotating layer
    NoPE, is never served: the layers keep the model's tables, the reason is logged, the output is HF's."""
    model = tiny("llama")
    want = logits(model)
    real = hf.model_rope
    monkeypatch.setattr(hf, "model_rope", lambda config: wrong(real(config)))
    with caplog.at_level(logging.INFO, logger=hf.__name__):
        assert hf.patch(model) == 2
    assert reason in caplog.text
    assert hf.layer_ropes(model) == {}
    assert "forward" not in model.model.rotary_emb.__dict__
    torch.testing.assert_close(logits(model), want, atol=1e-4, rtol=0)
