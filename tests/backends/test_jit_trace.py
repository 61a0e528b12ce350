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
from c_compiler import CPU
from ropekit.compat.vllm import rotary_embedding

HEAD = 64


def _trace(fn, inputs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's warnings about Python values it takes as constants
        return torch.jit.trace(fn, inputs, check_trace=False)


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for part in (value or ()) for t in _tensors(part)]


def _assert_trace_replays(f, inputs, *, planned: bool = True):
    """Trace f on inputs(0) (after two eager calls, the second served by a plan, when planned), then replay
    the trace on inputs(1): its outputs equal f's eager ones byte for byte. Returns the trace."""
    if planned:
        f(*inputs(0)), f(*inputs(0))
    traced = _trace(f, inputs(0))
    got, want = _tensors(traced(*inputs(1))), _tensors(f(*inputs(1)))
    assert len(got) == len(want) > 0
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want, strict=True))
    return traced


def _tables(rows: int = 32):
    return ropekit.RopeConfig(head_dim=HEAD).cos_sin(rows)


def _qk(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 8, 4, HEAD, generator=g), torch.randn(2, 8, 2, HEAD, generator=g)


@pytest.mark.parametrize("backend", ["auto", CPU])
@pytest.mark.parametrize("planned", [False, True], ids=["first call", "after a plan"])
def test_a_traced_rotation_replays_the_rotation(backend, planned):
    cos, sin = _tables()

    def f(q, k):
        return ropekit.apply_rotary_qk(q, k, cos, sin, offsets=3, backend=backend)

    _assert_trace_replays(f, _qk, planned=planned)  # planned: the gate must not serve the traced call


def test_a_traced_in_place_rotation_writes_its_inputs():
    cos, sin = _tables()

    def f(q, k):
        ropekit.apply_rotary_qk(q, k, cos, sin, inplace=True)
        return q, k

    traced = _assert_trace_replays(f, _qk)
    q, k = _qk(1)
    want = ropekit.apply_rotary_qk(q, k, cos, sin)
    traced(q, k)  # the caller's own tensors, written
    assert torch.equal(q, want[0]) and torch.equal(k, want[1])


def test_a_traced_module_replays_the_rotation():
    _assert_trace_replays(ropekit.RotaryEmbedding(head_dim=HEAD), _qk)


def test_a_traced_vllm_call_replays_the_rotation():
    cos, sin = _tables()
    cache = torch.cat([cos, sin], dim=-1)
    positions = torch.arange(16) % 7

    def f(query, key):
        query, key = query.clone(), key.clone()
        rotary_embedding(positions, query, key, HEAD, cache, True)
        return query, key

    traced = _assert_trace_replays(f, lambda seed: tuple(t.reshape(16, -1) for t in _qk(seed)))
    assert "ropekit::rotary_embedding" in str(traced.graph)  # vLLM's own op, as torch.compile records it


def test_a_traced_fp8_call_replays_the_quantisation():
    cos, sin = _tables()

    def f(q, k):
        return ropekit.apply_rotary_qk_fp8(q, k, cos, sin, q_scale=0.05, k_scale=0.05, offsets=2)

    _assert_trace_replays(f, _qk)


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

    _assert_trace_replays(f, inputs)


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
        return (torch.randn(2, 8, (heads_q + 2 * heads_k) * HEAD, generator=g),)

    traced = _assert_trace_replays(f, qkv)
    (got,) = qkv(1)
    traced(got)
    assert not torch.equal(got, qkv(1)[0])  # the caller's own tensor, written
