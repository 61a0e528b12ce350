"""ropekit.integrations.vllm without vLLM: what the plugin's forwards compute on a module shaped like vLLM's.

The plugin against the real vLLM is tests/engines/test_vllm_plugin.py (run in .venv-engines).
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from ropekit import RopeConfig, apply_rotary
from ropekit.integrations import vllm as plugin
from rotary_reference import reference_rotation, tolerance


def _module(head_size=64, rows=32, neox=True, **extra):
    """What the forwards read from a vLLM rotary module: its [cos | sin] cache and head layout."""
    config = RopeConfig(head_size, 10000.0)
    cos, sin = config.cos_sin(rows)
    return SimpleNamespace(
        cos_sin_cache=torch.cat([cos, sin], -1), head_size=head_size, is_neox_style=neox, **extra
    )


def test_importing_the_plugins_imports_no_engine():
    code = (
        "import sys, ropekit, ropekit.integrations.vllm, ropekit.integrations.sglang\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'sglang')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_every_class_is_either_served_or_left():
    assert not set(plugin.ADAPTERS) & set(plugin.LEFT)
    for forwards in plugin.ADAPTERS.values():
        assert {"forward_native", "forward_cpu", "forward_cuda"} <= set(dir(forwards))


@pytest.mark.parametrize("neox", [True, False])
def test_cache_forwards_rotate_by_the_cache_rows(neox):
    module = _module(neox=neox)
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 32, (7,), generator=g)
    query, key = torch.randn(7, 3 * 64, generator=g), torch.randn(7, 64, generator=g)
    q0 = query.clone()
    got_q, got_k = plugin.CacheForwards.forward_native(module, positions, query, key)
    assert torch.equal(query, q0)
    cache = module.cos_sin_cache
    want = reference_rotation(
        q0.view(7, 3, 64), cache[:, :32], cache[:, 32:], positions.numpy(), interleaved=not neox
    )
    torch.testing.assert_close(got_q.view(7, 3, 64), want.float(), **tolerance(torch.float32, 4.0))
    out_q, _ = plugin.CacheForwards.forward_cuda(module, positions, query, key)  # in place
    assert out_q is query and torch.equal(query, got_q) and torch.equal(key, got_k)
    offset_q, _ = plugin.CacheForwards.forward_native(module, positions - 2, q0, key, torch.full((7,), 2))
    torch.testing.assert_close(offset_q, got_q, rtol=0, atol=0)


@pytest.mark.parametrize(("section", "interleaved"), [([4, 6, 6], False), ([24, 20, 20], True)])
def test_mrope_rotate_uses_each_pairs_axis_as_ropekits_mrope_tables(section, interleaved):
    # The oracle: ropekit's own M-RoPE tables (RopeConfig.cos_sin with (axes, batch, seq) positions).
    head = 2 * sum(section)
    params = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
    params["mrope_interleaved"] = interleaved
    config = RopeConfig.from_hf({"head_dim": head, "max_position_embeddings": 16, "rope_parameters": params})
    module = _module(head, 16, mrope_section=section, mrope_interleaved=interleaved)
    g = torch.Generator().manual_seed(1)
    positions = torch.randint(0, 16, (3, 5), generator=g)  # (axes, T)
    query, key = torch.randn(5, 2 * head, generator=g), torch.randn(5, head, generator=g)
    got_q, _ = plugin.mrope_rotate(module, positions, query, key, inplace=False)
    cos, sin = config.cos_sin(positions[:, None, :])  # (1, T, R/2)
    want_q = apply_rotary(query.view(1, 5, 2, head), cos, sin, per_token=True)
    torch.testing.assert_close(got_q, want_q.view(5, 2 * head), **tolerance(torch.float32, 4.0))
    text_only = plugin.mrope_rotate(module, positions[:1].expand(3, 5), query, None, inplace=False)[0]
    plain = plugin.CacheForwards.forward_native(module, positions[0], query, None)[0]
    torch.testing.assert_close(text_only, plain, **tolerance(torch.float32, 4.0))


def test_mrope_positions_past_the_cache_are_a_value_error_in_every_forward():
    module = _module(32, 16, mrope_section=[4, 6, 6], mrope_interleaved=False)
    positions = torch.tensor([[0, 3], [1, 16], [2, 2]])  # (axes, T): one past the 16 rows
    query = torch.randn(2, 32)
    before = query.clone()
    for forward in (plugin.MRopeForwards.forward_cpu, plugin.MRopeForwards.forward_native):
        with pytest.raises(ValueError, match=r"positions: expected positions in \[0, 16\)"):
            forward(module, positions, query, None)
        assert torch.equal(query, before)
    with pytest.raises(ValueError, match=r"positions: expected positions in \[0, 16\)"):
        plugin.MRopeForwards.forward_cpu(module, positions, query, None, offsets=torch.tensor([[0, -20]] * 3))


def _llama4_vision_module(side=4, head=16):
    """vLLM's Llama4VisionRotaryEmbedding as the plugin reads it: a complex (side^2 + 1, 1, head/2) cache."""
    from ropekit.compat.vllm import get_rope

    rope = get_rope(head, side * side, False, {"rope_type": "mllama4", "partial_rotary_factor": 0.5})
    module = type("Llama4VisionRotaryEmbedding", (plugin.Llama4VisionForwards,), {})()
    module.cos_sin_cache, module.head_size = rope.cos_sin_cache, head
    return module, rope


@pytest.mark.parametrize("shape", [(1, 16, 2, 16), (1, 18, 2, 16), (1, 17, 2, 32)])
def test_llama4_vision_forwards_refuse_a_query_that_is_not_one_row_per_patch_and_class_token(shape):
    module, _ = _llama4_vision_module()
    q = torch.randn(shape)
    with pytest.raises(ValueError, match=r"query: expected \(batch, 17 tokens, heads, 16\)"):
        plugin.Llama4VisionForwards.forward_native(module, q, q.clone())


def test_llama4_vision_forwards_equal_the_compat_class():
    module, rope = _llama4_vision_module()
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 17, 3, 16, generator=g), torch.randn(2, 17, 3, 16, generator=g)
    got = plugin.Llama4VisionForwards.forward_native(module, q, k)
    want = rope(q, k)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **tolerance(torch.float32, 4.0))
