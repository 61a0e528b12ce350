"""ropekit.integrations.vllm without vLLM: what the plugin's forwards compute on a module shaped like vLLM's.

The plugin against the real vLLM is tests/engines/test_vllm_plugin.py (run in .venv-engines).
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
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


@pytest.mark.parametrize("shape", [(3, 1), (3, 3), (2, 2), (4, 2)])
def test_mrope_positions_of_another_token_count_or_axes_are_a_value_error(shape):
    """Found by the fuzzer's plugin family (issue 39): (3, T - 1) positions for T tokens were a RuntimeError
    from a view, or silently rotated when the view happened to fit."""
    module = _module(32, 16, mrope_section=[4, 6, 6], mrope_interleaved=False)
    query, key = torch.randn(2, 64), torch.randn(2, 32)
    before = query.clone()
    for forward in (plugin.MRopeForwards.forward_cpu, plugin.MRopeForwards.forward_native):
        with pytest.raises(ValueError, match=r"^positions: expected \(3, 2\) M-RoPE positions"):
            forward(module, torch.zeros(shape, dtype=torch.int64), query, key)
        assert torch.equal(query, before)
    with pytest.raises(ValueError, match=r"^key: expected query's 2 tokens"):
        plugin.mrope_rotate(module, torch.zeros(3, 2, dtype=torch.int64), query, key[:1], inplace=False)


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


def _half_ulp_bound(exact: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Per element: half a unit in the last place of ``dtype`` at the exact value (the rounding of the output)
    plus float32's error in computing two products and their sum from inputs of magnitude ``scale``."""
    _, exponent = torch.frexp(exact.abs().clamp_min(torch.finfo(dtype).tiny))
    ulp = torch.finfo(dtype).eps * torch.pow(2.0, (exponent - 1).double())
    return 0.5 * ulp + 4 * torch.finfo(torch.float32).eps * scale


DTYPE_PAIRS = [
    (c, q) for c in (torch.float32, torch.bfloat16, torch.float16) for q in (torch.float32, torch.bfloat16)
]


@pytest.mark.parametrize("mrope", [False, True], ids=["cache", "mrope"])
@pytest.mark.parametrize(("cache_dtype", "query_dtype"), DTYPE_PAIRS, ids=str)
def test_every_cache_and_query_dtype_pair_is_the_exact_rotation_rounded_once(cache_dtype, query_dtype, mrope):
    """The dtype rule (issue 39): the rotation uses the module's cache rows as they are stored (a float32
    cache with a bfloat16 query keeps its float32 rows, never cast to the query's dtype) and rounds once to
    the query's dtype: each output within half an ulp of the exact float64 rotation by those rows."""
    extra = {"mrope_section": [4, 6, 6], "mrope_interleaved": False} if mrope else {}
    module = _module(32, 64, **extra)
    module.cos_sin_cache = module.cos_sin_cache.to(cache_dtype)
    g = torch.Generator().manual_seed(3)
    tokens = 33
    positions = torch.randint(0, 64, (3, tokens) if mrope else (tokens,), generator=g)
    query = (4 * torch.randn(tokens, 2 * 32, generator=g)).to(query_dtype)
    key = (4 * torch.randn(tokens, 32, generator=g)).to(query_dtype)
    cache = module.cos_sin_cache.double()
    if mrope:  # each pair's row from its own axis: ropekit's M-RoPE layout, read from the cache
        from ropekit.schedules.mrope import mrope_axis_of_pair

        axis = mrope_axis_of_pair([4, 6, 6], False)
        rows = cache[positions].gather(0, torch.cat([axis, axis]).expand(1, tokens, 32))[0]  # (T, 32)
        cos, sin, rows_of = rows[:, :16], rows[:, 16:], np.arange(tokens)
    else:
        cos, sin, rows_of = cache[:, :16], cache[:, 16:], positions.numpy()
    forwards = plugin.MRopeForwards if mrope else plugin.CacheForwards
    native = forwards.forward_native(module, positions, query, key)
    in_place = forwards.forward_cpu(module, positions, query.clone(), key.clone())
    scale = float(query.abs().max())
    for got_native, got_in_place, x in zip(native, in_place, (query, key), strict=True):
        exact = reference_rotation(x.double().view(tokens, -1, 32), cos, sin, rows_of, interleaved=False)
        exact = exact.reshape(x.shape)
        assert got_native.dtype == query_dtype and torch.equal(got_native, got_in_place)
        error = (got_native.double() - exact).abs()
        bound = _half_ulp_bound(exact, query_dtype, scale)
        assert bool((error <= bound).all()), f"worst excess {float((error - bound).max())}"
