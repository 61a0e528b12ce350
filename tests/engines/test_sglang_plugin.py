"""ropekit's SGLang plugin against the real SGLang 0.5.23 (its Python package, on the CPU; docs/engines.md).

The plugin is loaded as SGLang loads it: ``sglang.srt.plugins.load_plugins()`` finds the
``sglang.srt.plugins`` entry point in ropekit's installed metadata and applies the hooks through its hook
registry. The oracle is SGLang's own method (the hook's ``__wrapped__`` original) on the same module, and the
float64 rotation by the module's cache rows.
"""

from __future__ import annotations

import importlib.metadata
import os

import pytest
import torch
from sglang.kernels.ops.attention.rope import FusedSetKVBufferArg
from sglang.srt.layers.rotary_embedding import base as sglang_base
from sglang.srt.layers.rotary_embedding import get_rope
from sglang.srt.layers.rotary_embedding import mrope as sglang_mrope
from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins, load_plugins_by_group

from ropekit.integrations import sglang as plugin
from rotary_reference import reference_rotation, tolerance

pytestmark = pytest.mark.engine

# (id, SGLang class, head_size, is_neox_style, rope_scaling, max_position)
FAMILIES = [
    ("default", "RotaryEmbedding", 64, True, None, 64),
    ("default-gptj", "RotaryEmbedding", 64, False, None, 64),
    ("linear", "LinearScalingRotaryEmbedding", 64, True, {"rope_type": "linear", "factor": 2.0}, 64),
    ("dynamic", "DynamicNTKScalingRotaryEmbedding", 64, True, {"rope_type": "dynamic", "factor": 2.0}, 64),
    ("ntk-alpha", "DynamicNTKAlphaRotaryEmbedding", 64, True, {"rope_type": "dynamic", "alpha": 1000.0}, 64),
    (
        "yarn",
        "YaRNScalingRotaryEmbedding",
        64,
        True,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        128,
    ),
    (
        "llama3",
        "Llama3RotaryEmbedding",
        64,
        True,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        64,
    ),
    ("mrope", "MRotaryEmbedding", 32, True, {"rope_type": "default", "mrope_section": [4, 6, 6]}, 16),
    (
        "mrope-interleaved",
        "MRotaryEmbedding",
        64,
        True,
        {"rope_type": "default", "mrope_section": [8, 12, 12], "mrope_interleaved": True},
        16,
    ),
]
DTYPES = [torch.float32, torch.bfloat16]
METHODS = ("forward_native", "forward_cpu", "forward_cuda")


@pytest.fixture(scope="module", autouse=True)
def loaded():
    os.environ.pop("SGLANG_PLUGINS", None)
    load_plugins()


def _original(cls: type, method: str):
    """SGLang's own method under ropekit's hook."""
    return getattr(cls, method).__wrapped__


def _inputs(name, head_size, rows, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = 9
    shape = (3, tokens) if name == "MRotaryEmbedding" else (tokens,)
    positions = torch.randint(0, rows, shape, generator=g)
    query = torch.randn(tokens, 4 * head_size, generator=g).to(dtype)  # (T, Hq * D)
    key = torch.randn(tokens, 2 * head_size, generator=g).to(dtype)  # (T, Hk * D)
    return positions, query, key


def _exact(module, positions, x):
    cache = module.cos_sin_cache.double()
    half = cache.shape[1] // 2
    heads = x.reshape(x.shape[0], -1, module.head_size)  # (T, H, D)
    out = reference_rotation(
        heads, cache[:, :half], cache[:, half:], positions.numpy(), interleaved=not module.is_neox_style
    )
    return out.reshape(x.shape)


def test_entry_point_is_in_ropekits_metadata():
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    assert {ep.name: ep.value for ep in eps}.get("ropekit") == "ropekit.integrations.sglang:register"


@pytest.mark.parametrize("method", METHODS)
def test_hooks_wrap_sglangs_methods(method):
    for cls in (sglang_base.RotaryEmbedding, sglang_mrope.MRotaryEmbedding):
        hooked = cls.__dict__[method]
        assert hooked.__wrapped__ is not hooked and hooked.__module__ == cls.__module__  # functools.wraps


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("family", "name", "head_size", "neox", "scaling", "max_position"), FAMILIES)
def test_forwards_equal_sglangs_own(family, name, head_size, neox, scaling, max_position, dtype):
    module = get_rope(head_size, head_size, max_position, 10000, neox, scaling, dtype)
    assert type(module).__name__ == name
    rows = module.cos_sin_cache.shape[0]
    positions, query, key = _inputs(name, head_size, rows, dtype)
    q0, k0 = query.clone(), key.clone()

    got_q, got_k = module.forward_native(positions, query, key)
    assert torch.equal(query, q0) and torch.equal(key, k0), "forward_native modified its inputs"
    cls = sglang_mrope.MRotaryEmbedding if name == "MRotaryEmbedding" else sglang_base.RotaryEmbedding
    want_q, want_k = _original(cls, "forward_native")(module, positions, q0.clone(), k0.clone())
    for method in ("forward_cpu", "forward_cuda"):  # in place, the same tensors back
        q, k = query.clone(), key.clone()
        out_q, out_k = getattr(module, method)(positions, q, k)
        assert out_q is q and out_k is k
        assert torch.equal(q, got_q) and torch.equal(k, got_k)
    via_q, _ = module(positions, query.clone(), key.clone())  # SGLang's own dispatch
    assert torch.equal(via_q, got_q)

    scale = float(query.abs().max())
    if dtype == torch.float32:
        torch.testing.assert_close(got_q, want_q, **tolerance(dtype, scale))
        torch.testing.assert_close(got_k, want_k, **tolerance(dtype, scale))
    elif name == "MRotaryEmbedding":
        tol = {"rtol": 0.0, "atol": 4 * torch.finfo(dtype).eps * scale}
        torch.testing.assert_close(got_q.float(), want_q.float(), **tol)
        torch.testing.assert_close(got_k.float(), want_k.float(), **tol)
    else:
        for got, want, x in ((got_q, want_q, q0), (got_k, want_k, k0)):
            exact = _exact(module, positions, x)
            ours, theirs = (got.double() - exact).abs().max(), (want.double() - exact).abs().max()
            assert ours <= theirs + torch.finfo(dtype).eps * scale, (ours, theirs)


def test_ropekit_serves_the_call_not_sglang():
    # A position past the cache: ropekit refuses it by name; SGLang's own path would index out of range.
    module = get_rope(64, 64, 32, 10000, True, None, torch.float32)
    positions, query, key = _inputs("RotaryEmbedding", 64, 32, torch.float32)
    positions[3] = 32
    for method in METHODS:
        with pytest.raises(ValueError, match="position"):
            getattr(module, method)(positions, query.clone(), key.clone())


def test_fused_kv_buffer_write_stores_rotated_key_and_value():
    module = get_rope(64, 64, 64, 10000, True, None, torch.float32)
    positions, query, key = _inputs("RotaryEmbedding", 64, 64, torch.float32)
    value = torch.randn(key.shape)
    slots = 20
    k_buffer, v_buffer = torch.zeros(slots, key.shape[1]), torch.zeros(slots, key.shape[1])  # (slots, Hk*D)
    loc = torch.tensor([3, 7, 1, 19, 0, 12, 5, 8, 15])
    fused = FusedSetKVBufferArg(value=value, k_buffer=k_buffer, v_buffer=v_buffer, cache_loc=loc)
    want_q, want_k = _original(sglang_base.RotaryEmbedding, "forward_native")(module, positions, query, key)
    q, k = query.clone(), key.clone()
    module.forward_cpu(positions, q, k, fused_set_kv_buffer_arg=fused)
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k_buffer[loc], want_k)
    torch.testing.assert_close(v_buffer[loc], value)
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[loc] = False
    assert not k_buffer[untouched].any() and not v_buffer[untouched].any()
    with pytest.raises(ValueError, match="fused_set_kv_buffer_arg"):
        module.forward_native(positions, query, key, fused_set_kv_buffer_arg=fused)


def test_glm_interleaved_mrope_is_left_to_sglang():
    module = get_rope(64, 64, 16, 10000, True, {"rope_type": "default", "mrope_section": [8, 12, 12]})
    module.mrope_interleaved_glm = True
    positions, query, key = _inputs("MRotaryEmbedding", 64, 16, torch.float32)
    got = module.forward_native(positions, query, key)
    want = _original(sglang_mrope.MRotaryEmbedding, "forward_native")(module, positions, query, key)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_sglang_plugins_filters_ropekit():
    os.environ["SGLANG_PLUGINS"] = "some_other_plugin"
    try:
        assert "ropekit" not in load_plugins_by_group(GENERAL_PLUGINS_GROUP)
        os.environ["SGLANG_PLUGINS"] = "ropekit"
        assert "ropekit" in load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    finally:
        os.environ.pop("SGLANG_PLUGINS", None)


def test_second_register_changes_nothing():
    from sglang.srt.plugins.hook_registry import HookRegistry

    before = {m: sglang_base.RotaryEmbedding.__dict__[m] for m in METHODS}
    plugin.register()
    HookRegistry.apply_hooks()
    assert {m: sglang_base.RotaryEmbedding.__dict__[m] for m in METHODS} == before


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(("family", "name", "head_size", "neox", "scaling", "max_position"), FAMILIES)
def test_numerics_vllm_equals_sglangs_forward_native_bit_for_bit(
    family, name, head_size, neox, scaling, max_position, dtype, vllm_numerics
):
    module = get_rope(head_size, head_size, max_position, 10000, neox, scaling, dtype)
    positions, query, key = _inputs(name, head_size, module.cos_sin_cache.shape[0], dtype)
    query, key = 8 * query, 8 * key
    cls = sglang_mrope.MRotaryEmbedding if name == "MRotaryEmbedding" else sglang_base.RotaryEmbedding
    want_q, want_k = _original(cls, "forward_native")(module, positions, query.clone(), key.clone())
    for _ in range(2):  # the checked path, then its launch plan
        got_q, got_k = module.forward_native(positions, query, key)
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
        q, k = query.clone(), key.clone()
        module.forward_cpu(positions, q, k)
        assert torch.equal(q, want_q) and torch.equal(k, want_k)
