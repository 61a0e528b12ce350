"""torch.jit.trace over ropekit's calls records their kernels (the registered ops), never a graph that returns
the outputs unwritten.

A kernel called through pointers (the C loop, a launch plan) is invisible to torch.jit.trace: before, a traced
``apply_rotary_qk`` on CPU recorded the two ``empty_like`` of its outputs and nothing else, so the traced
function returned uninitialised memory for any input, with no error (silent wrong answers). While the tracer
records, every call takes the registered op (``backends.kernel_op.plain_eager``) and no plan serves it
(``backends.plan.gate``). Each case traces a call, then replays the trace on new inputs against eager calls.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import ropekit
from ropekit.compat.vllm import rotary_embedding

HEAD = 64


def _trace(fn, inputs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's warnings about Python values it takes as constants
        return torch.jit.trace(fn, inputs, check_trace=False)


def _tables(rows: int = 32):
    return ropekit.RopeConfig(head_dim=HEAD).cos_sin(rows)


def _qk(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 8, 4, HEAD, generator=g), torch.randn(2, 8, 2, HEAD, generator=g)


@pytest.mark.parametrize("backend", ["auto", "cpu"])
@pytest.mark.parametrize("planned", [False, True], ids=["first call", "after a plan"])
def test_a_traced_rotation_replays_the_rotation(backend, planned):
    cos, sin = _tables()

    def f(q, k):
        return ropekit.apply_rotary_qk(q, k, cos, sin, offsets=3, backend=backend)

    q, k = _qk(0)
    if planned:  # a plan exists for this key: the gate must not serve the traced call
        f(q, k), f(q, k)
    traced = _trace(f, (q, k))
    q2, k2 = _qk(1)
    got, want = traced(q2, k2), f(q2, k2)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_traced_in_place_rotation_writes_its_inputs():
    cos, sin = _tables()

    def f(q, k):
        return ropekit.apply_rotary_qk(q, k, cos, sin, inplace=True)

    q, k = _qk(0)
    f(q.clone(), k.clone()), f(q.clone(), k.clone())  # planned
    traced = _trace(f, (q.clone(), k.clone()))
    q2, k2 = _qk(1)
    want = ropekit.apply_rotary_qk(q2, k2, cos, sin)
    a, b = q2.clone(), k2.clone()
    traced(a, b)
    assert torch.equal(a, want[0]) and torch.equal(b, want[1])


def test_a_traced_module_replays_the_rotation():
    rope = ropekit.RotaryEmbedding(head_dim=HEAD)
    q, k = _qk(0)
    rope(q, k), rope(q, k)
    traced = _trace(rope, (q, k))
    q2, k2 = _qk(1)
    got, want = traced(q2, k2), rope(q2, k2)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_traced_vllm_call_replays_the_rotation():
    cos, sin = _tables()
    cache = torch.cat([cos, sin], dim=-1)
    positions = torch.arange(16) % 7

    def f(query, key):
        query, key = query.clone(), key.clone()
        rotary_embedding(positions, query, key, HEAD, cache, True)
        return query, key

    q, k = (t.reshape(16, -1) for t in _qk(0))
    f(q, k), f(q, k)
    traced = _trace(f, (q, k))
    q2, k2 = (t.reshape(16, -1) for t in _qk(1))
    got, want = traced(q2, k2), f(q2, k2)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_traced_fp8_call_replays_the_quantisation():
    cos, sin = _tables()

    def f(q, k):
        return ropekit.apply_rotary_qk_fp8(q, k, cos, sin, q_scale=0.05, k_scale=0.05, offsets=2)

    q, k = _qk(0)
    f(q, k), f(q, k)
    traced = _trace(f, (q, k))
    q2, k2 = _qk(1)
    got, want = traced(q2, k2), f(q2, k2)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want, strict=True))


def test_a_traced_cache_write_replays_the_write():
    cos, sin = _tables()
    slots = torch.tensor([3, 0, 5, 9, 1, 2, 7, 4, 8, 6, 10, 11, 12, 13, 14, 15]).view(2, 8)

    def f(q, k, v, k_cache, v_cache):
        out = ropekit.apply_rotary_qk_and_cache(
            q, k, v, cos, sin, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots, cache_layout="flat"
        )
        return out, k_cache, v_cache

    def inputs(seed):
        q, k = _qk(seed)
        v = _qk(seed + 10)[1]
        return q, k, v, torch.zeros(16, 2, HEAD), torch.zeros(16, 2, HEAD)

    f(*inputs(0)), f(*inputs(0))
    traced = _trace(f, inputs(0))
    got, want = traced(*inputs(1)), f(*inputs(1))
    assert len(_tensors(got)) == len(_tensors(want)) >= 3
    assert all(torch.equal(a, b) for a, b in zip(_tensors(got), _tensors(want), strict=True))


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for part in (value or ()) for t in _tensors(part)]


def test_a_traced_qk_norm_call_writes_its_input():
    cos, sin = _tables()
    heads_q, heads_k = 4, 2
    weights = torch.rand(HEAD) + 0.5, torch.rand(HEAD) + 0.5

    def f(qkv):
        ropekit.qk_norm_rotary_(
            qkv, *weights, cos, sin, num_q_heads=heads_q, num_kv_heads=heads_k, head_dim=HEAD, eps=1e-6
        )
        return qkv

    def qkv(seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(2, 8, (heads_q + 2 * heads_k) * HEAD, generator=g)

    f(qkv(0)), f(qkv(0))
    traced = _trace(f, (qkv(0),))
    got, want = qkv(1), qkv(1)
    traced(got), f(want)
    assert torch.equal(got, want)
    assert not torch.equal(got, qkv(1))  # written
