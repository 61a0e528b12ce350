"""ropekit.integrations.sglang without SGLang: the hooks' work on a module shaped like SGLang's.

The plugin against the real SGLang is tests/engines/test_sglang_plugin.py (run in .venv-engines).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ropekit import RopeConfig
from ropekit.integrations import sglang as plugin


def _module(head_size=64, rows=32):
    cos, sin = RopeConfig(head_size, 10000.0).cos_sin(rows)
    return SimpleNamespace(cos_sin_cache=torch.cat([cos, sin], -1), head_size=head_size, is_neox_style=True)


def _never(*args, **kwargs):
    raise AssertionError("SGLang's own method was called for a call ropekit serves")


def test_fused_write_stores_the_rotated_key_and_the_value_at_cache_loc():
    module = _module()
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 32, (4,), generator=g)
    query, key, value = (torch.randn(4, 64, generator=g) for _ in range(3))
    k_buffer, v_buffer = torch.zeros(10, 64), torch.zeros(10, 64)
    loc = torch.tensor([9, 0, 4, 2])
    fused = SimpleNamespace(value=value, k_buffer=k_buffer, v_buffer=v_buffer, cache_loc=loc)
    want_q, want_k = plugin.forward_native(_never, module, positions, query, key)
    q, k = query.clone(), key.clone()
    out = plugin.forward_inplace(_never, module, positions, q, k, None, fused)
    assert out[0] is q and torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(k_buffer[loc], want_k) and torch.equal(v_buffer[loc], value)
    assert not k_buffer[[1, 3, 5, 6, 7, 8]].any()


def test_native_path_refuses_the_fused_argument():
    module = _module()
    fused = SimpleNamespace()
    with pytest.raises(ValueError, match="fused_set_kv_buffer_arg"):
        plugin.forward_native(_never, module, torch.zeros(1, dtype=torch.long), torch.randn(1, 64),
                              torch.randn(1, 64), None, fused)  # fmt: skip


def test_calls_ropekit_does_not_serve_go_to_sglangs_method():
    module = _module()
    module.sin_cos_cache = torch.zeros(1)  # SGLang's precomputed per-token rows
    sentinel = object()
    got = plugin.forward_native(lambda *a: sentinel, module, torch.zeros(1, dtype=torch.long), None, None)
    assert got is sentinel
    glm = SimpleNamespace(mrope_section=[8, 12, 12], mrope_interleaved_glm=True)
    positions = torch.zeros(3, 2, dtype=torch.long)
    assert plugin.mrope_forward_native(lambda *a: sentinel, glm, positions, None, None) is sentinel
