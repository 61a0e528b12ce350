"""ropekit's vLLM plugin against the real vLLM 0.33 (its Python package, on the CPU; see docs/engines.md).

The plugin is loaded as vLLM loads it in a deployment: ``vllm.plugins.load_general_plugins()`` finds the
``vllm.general_plugins`` entry point in ropekit's installed metadata. The oracle is vLLM's own
``forward_native``, run on the same module (same cache), and the float64 rotation by that cache's rows.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import subprocess
import sys

import pytest
import torch
import vllm.model_executor.layers.rotary_embedding as vllm_rope
from torch import nn
from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor import custom_op

from ropekit.integrations import vllm as plugin
from rotary_reference import reference_rotation, tolerance

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("vllm_plugin_loaded")]

# (id, vLLM class, head_size, is_neox_style, rope_parameters, max_position)
FAMILIES = [
    ("default", "RotaryEmbedding", 64, True, {"rope_type": "default", "rope_theta": 10000.0}, 64),
    ("default-gptj", "RotaryEmbedding", 64, False, {"rope_type": "default", "rope_theta": 10000.0}, 64),
    ("partial", "RotaryEmbedding", 64, True, {"rope_theta": 10000.0, "partial_rotary_factor": 0.5}, 64),
    ("linear", "LinearScalingRotaryEmbedding", 64, True, {"rope_type": "linear", "factor": 2.0}, 64),
    ("ntk", "NTKScalingRotaryEmbedding", 64, True, {"rope_type": "ntk", "factor": 2.0}, 64),
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
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        64,
    ),
    (
        "deepseek-yarn",
        "DeepseekScalingRotaryEmbedding",
        64,
        False,
        {
            "rope_type": "deepseek_yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
        },
        128,
    ),
    (
        "gemma4",
        "Gemma4RotaryEmbedding",
        64,
        True,
        {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
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
    (
        "mrope-yarn",
        "MRotaryEmbedding",
        32,
        True,
        {
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 16,
            "mrope_section": [4, 6, 6],
        },
        16,
    ),
]
LLAMA4_VISION = {"rope_type": "mllama4", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
# Every dtype vLLM builds caches in for serving.
DTYPES = [torch.float32, torch.bfloat16]


def _vllm_class(module: nn.Module) -> type:
    """The vLLM class a ropekit class stands in for."""
    return next(c for c in type(module).__mro__ if c.__module__.startswith("vllm."))


def _inputs(name, head_size, rows, dtype, seed=0):
    """positions, query, key in the layout vLLM's callers pass for this class."""
    g = torch.Generator().manual_seed(seed)
    tokens = 9
    if name == "MRotaryEmbedding":
        positions = torch.randint(0, rows, (3, tokens), generator=g)  # (axes, T): temporal, height, width
    else:
        positions = torch.randint(0, rows, (tokens,), generator=g)
    if name == "DeepseekScalingRotaryEmbedding":  # MLA passes (T, H, rope_dim) slices
        query = torch.randn(tokens, 4, head_size, generator=g).to(dtype)
        key = torch.randn(tokens, 1, head_size, generator=g).to(dtype)
    else:
        query = torch.randn(tokens, 4 * head_size, generator=g).to(dtype)  # (T, Hq * D)
        key = torch.randn(tokens, 2 * head_size, generator=g).to(dtype)  # (T, Hk * D)
    return positions, query, key


def _exact(module, positions, x):
    """The float64 rotation of x (T, H*D or T, H, D) by rows ``positions`` of the module's own cache."""
    cache = module.cos_sin_cache.double()
    half = cache.shape[1] // 2
    heads = x.reshape(x.shape[0], -1, module.head_size)  # (T, H, D)
    out = reference_rotation(
        heads, cache[:, :half], cache[:, half:], positions.numpy(), interleaved=not module.is_neox_style
    )
    return out.reshape(x.shape)


def test_entry_point_is_in_ropekits_metadata():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert {ep.name: ep.value for ep in eps}.get("ropekit") == "ropekit.integrations.vllm:register"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("family", "name", "head_size", "neox", "params", "max_position"), FAMILIES)
def test_get_rope_builds_ropekit_class_equal_to_vllms_forward(
    family, name, head_size, neox, params, max_position, dtype
):
    module = vllm_rope.get_rope(head_size, max_position, neox, params, dtype)
    assert type(module) is plugin.registered()[name]
    assert _vllm_class(module) is getattr(vllm_rope, name)
    rows = module.cos_sin_cache.shape[0]
    positions, query, key = _inputs(name, head_size, rows, dtype)
    q0, k0 = query.clone(), key.clone()

    got_q, got_k = module.forward_native(positions, query, key)
    assert torch.equal(query, q0) and torch.equal(key, k0), "forward_native modified its inputs"
    want_q, want_k = _vllm_class(module).forward_native(module, positions, q0.clone(), k0.clone())
    assert got_q.shape == query.shape and got_k.shape == key.shape and got_q.dtype == dtype

    # The enabled op (forward_cpu, forward_cuda's twin): in place, returns the same tensors.
    inplace_q, inplace_k = query.clone(), key.clone()
    out_q, out_k = module.forward_cpu(positions, inplace_q, inplace_k)
    assert out_q is inplace_q and out_k is inplace_k
    assert torch.equal(inplace_q, got_q) and torch.equal(inplace_k, got_k)
    # vLLM's dispatch (a disabled op under this config: forward_native) reaches ropekit too.
    via_q, via_k = module(positions, query.clone(), key.clone())
    assert torch.equal(via_q, got_q) and torch.equal(via_k, got_k)

    scale = float(query.abs().max())
    if dtype == torch.float32:
        torch.testing.assert_close(got_q, want_q, **tolerance(dtype, scale))
        torch.testing.assert_close(got_k, want_k, **tolerance(dtype, scale))
    elif name == "MRotaryEmbedding":  # vLLM rounds each product to bf16; ropekit rounds once
        tol = {"rtol": 0.0, "atol": 4 * torch.finfo(dtype).eps * scale}
        torch.testing.assert_close(got_q.float(), want_q.float(), **tol)
        torch.testing.assert_close(got_k.float(), want_k.float(), **tol)
    else:  # bf16: as close to the exact rotation by the same (bf16) cache rows as vLLM, or closer
        for got, want, x in ((got_q, want_q, q0), (got_k, want_k, k0)):
            exact = _exact(module, positions, x)
            ours, theirs = (got.double() - exact).abs().max(), (want.double() - exact).abs().max()
            assert ours <= theirs + torch.finfo(dtype).eps * scale, (ours, theirs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_llama4_vision_equals_vllms_forward(dtype):
    # vLLM's Llama 4 vision attention: a 4x4 patch grid plus the class token, complex cache, pairs (2i, 2i+1).
    module = vllm_rope.get_rope(64, 16, False, LLAMA4_VISION, torch.complex64)
    assert type(module) is plugin.registered()["Llama4VisionRotaryEmbedding"]
    g = torch.Generator().manual_seed(1)
    query = torch.randn(2, 17, 3, 64, generator=g).to(dtype)  # (B, S, H, D)
    key = torch.randn(2, 17, 3, 64, generator=g).to(dtype)
    q0, k0 = query.clone(), key.clone()
    got_q, got_k = module(query, key)
    assert torch.equal(query, q0) and torch.equal(key, k0)
    want_q, want_k = _vllm_class(module).forward_native(module, q0, k0)
    tol = tolerance(dtype, float(query.abs().max()))
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_k, want_k, **tol)


def test_llama4_vision_refuses_a_patch_count_vllms_forward_refuses():
    # Issue 39, defect 8: 16 tokens given to the 4x4-patch module (17 rows with the class token) were rotated
    # by the cache's first 16 rows; vLLM's forward cannot view its cache against them and raises.
    module = vllm_rope.get_rope(64, 16, False, LLAMA4_VISION, torch.complex64)
    query = torch.randn(2, 16, 3, 64)
    with pytest.raises(Exception):  # noqa: B017 - vLLM's own error, whatever its type
        _vllm_class(module).forward_native(module, query, query.clone())
    with pytest.raises(ValueError, match=r"query: expected \(batch, 17 tokens, heads, 64\)"):
        module(query, query.clone())


def test_deepseek_offsets_form_adds_offsets_to_positions():
    params = dict(FAMILIES[9][4])
    module = vllm_rope.get_rope(64, 128, False, params, torch.float32)
    positions, query, key = _inputs("DeepseekScalingRotaryEmbedding", 64, 64, torch.float32)
    offsets = torch.full_like(positions, 50)
    got_q, got_k = module.forward_native(positions, query, key, offsets)
    want_q, want_k = _vllm_class(module).forward_native(module, positions, query, key, offsets)
    torch.testing.assert_close(got_q, want_q, **tolerance(torch.float32, 4.0))
    torch.testing.assert_close(got_k, want_k, **tolerance(torch.float32, 4.0))
    plain_q, _ = module.forward_native(positions, query, key)
    assert not torch.allclose(got_q, plain_q), "offsets were ignored"


def test_custom_ops_switch_enables_ropekits_in_place_forward():
    # `--compilation_config.custom_ops '["+rotary_embedding"]'`: vLLM's switch for its own class works for
    # ropekit's (register_oot renames the class; the plugin keeps vLLM's op name).
    config = VllmConfig(compilation_config=CompilationConfig(custom_ops=["none", "+rotary_embedding"]))
    with set_current_vllm_config(config):
        module = vllm_rope.get_rope(64, 32, True, {"rope_type": "llama3", **FAMILIES[8][4]}, torch.float32)
    assert module._forward_method == module.forward_cpu  # CPU platform: forward_cpu, in place
    positions, query, key = _inputs("Llama3RotaryEmbedding", 64, 32, torch.float32)
    q0 = query.clone()
    out_q, _ = module(positions, query, key)
    assert out_q is query and not torch.equal(query, q0)
    torch.testing.assert_close(query, _vllm_class(module).forward_native(module, positions, q0, key)[0])


def test_second_register_changes_nothing():
    before_ours, before_vllm = plugin.registered(), dict(custom_op.op_registry_oot)
    plugin.register()
    assert plugin.registered() == before_ours
    assert custom_op.op_registry_oot == before_vllm


def test_every_vllm_rotary_class_is_replaced_or_left_with_a_reason():
    # A rotary class a later vLLM adds must be classified, not silently left.
    classes = {
        name
        for name, obj in inspect.getmembers(vllm_rope, inspect.isclass)
        if issubclass(obj, nn.Module) and "Rotary" in name and name not in ("RotaryEmbeddingBase",)
    }
    assert classes <= set(plugin.ADAPTERS) | set(plugin.LEFT), (
        classes - set(plugin.ADAPTERS) - set(plugin.LEFT)
    )
    assert not set(plugin.ADAPTERS) & set(plugin.LEFT)
    for name in plugin.LEFT:  # what is left stays vLLM's
        assert name not in plugin.registered()


def test_vllm_plugins_not_naming_ropekit_leaves_vllms_classes():
    code = (
        "import torch\n"
        "from vllm.config import VllmConfig, set_current_vllm_config\n"
        "from vllm.plugins import load_general_plugins\n"
        "from vllm.model_executor.layers.rotary_embedding import get_rope\n"
        "load_general_plugins()\n"
        "with set_current_vllm_config(VllmConfig()):\n"
        "    m = get_rope(64, 64, True, {'rope_type': 'default', 'rope_theta': 1e4}, torch.float32)\n"
        "print(type(m).__module__ + '.' + type(m).__name__)\n"
    )

    def built(plugins):
        env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_PLUGINS": plugins}
        run = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        return run.stdout.strip().splitlines()[-1]

    assert built("some_other_plugin") == "vllm.model_executor.layers.rotary_embedding.base.RotaryEmbedding"
    assert built("ropekit") == "ropekit.integrations.vllm.RopekitRotaryEmbedding"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(("family", "name", "head_size", "neox", "params", "max_position"), FAMILIES)
def test_numerics_vllm_equals_stock_forward_native_bit_for_bit(
    family, name, head_size, neox, params, max_position, dtype, vllm_numerics
):
    module = vllm_rope.get_rope(head_size, max_position, neox, params, dtype)
    assert type(module) is plugin.registered()[name] and plugin.MODE["numerics"] == "vllm"
    positions, query, key = _inputs(name, head_size, module.cos_sin_cache.shape[0], dtype)
    query, key = 8 * query, 8 * key  # larger values: more products that round differently in 16 bits
    want_q, want_k = _vllm_class(module).forward_native(module, positions, query.clone(), key.clone())
    for _ in range(2):  # the checked path, then its launch plan
        got_q, got_k = module.forward_native(positions, query, key)
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
        inplace_q, inplace_k = query.clone(), key.clone()
        module.forward_cpu(positions, inplace_q, inplace_k)  # the enabled op: in place, the same bits
        assert torch.equal(inplace_q, want_q) and torch.equal(inplace_k, want_k)


def test_an_unknown_ropekit_numerics_is_refused_by_register(monkeypatch):
    monkeypatch.setenv(plugin.NUMERICS_ENV, "fast")
    with pytest.raises(
        ValueError, match=r"ROPEKIT_NUMERICS: expected one of \['exact', 'hf', 'vllm'\], got 'fast'"
    ):
        plugin.register()
    monkeypatch.delenv(plugin.NUMERICS_ENV)
    plugin.register()
