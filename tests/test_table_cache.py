"""CosSinCache, the table a RotaryEmbedding owns: lazy growth, far rows, precision and device, torch.compile
(no graph break, fullgraph holds), meta-device construction and to_empty."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from ropekit import RopeConfig, RotaryEmbedding, apply_rotary_qk
from ropekit.table_cache import DEFAULT_TABLE_LEN, CosSinCache

HEAD_DIM = 8


def _to_layout(x_bshd: torch.Tensor, layout: str) -> torch.Tensor:
    """(B, S, H, D) -> (B, H, S, D) for bhsd; other layouts are built directly."""
    return x_bshd.transpose(1, 2).contiguous() if layout == "bhsd" else x_bshd


def _from_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x.transpose(1, 2) if layout == "bhsd" else x


def test_table_starts_at_max_position_embeddings_when_small_and_grows_past_its_end():
    rope = RotaryEmbedding(head_dim=HEAD_DIM, max_position_embeddings=16)
    assert rope.cos.shape == (16, HEAD_DIM // 2)
    q = torch.randn(1, 4, 1, HEAD_DIM, dtype=torch.float64)
    q_out, _ = rope(q, q, offsets=30)  # positions 30..33, past the 16-row table
    assert rope.cos.shape[0] >= 34
    cos, sin = rope.config.cos_sin(34, dtype=torch.float64)
    torch.testing.assert_close(q_out, apply_rotary_qk(q, q, cos, sin, offsets=30)[0], rtol=0, atol=1e-15)
    rows = rope.cos.shape[0]
    rope(q, q, positions=torch.tensor([[rows - 1, 0, 1, 2]]))  # within the table: no regrowth
    assert rope.cos.shape[0] == rows


def test_grown_table_rows_equal_a_table_built_at_that_size():
    rope = RotaryEmbedding(head_dim=HEAD_DIM, max_position_embeddings=4)
    q = torch.randn(1, 1, 1, HEAD_DIM)
    rope(q, q, offsets=100)
    cos, sin = rope.config.cos_sin(rope.cos.shape[0])
    assert torch.equal(rope.cos, cos) and torch.equal(rope.sin, sin)


def test_table_is_lazy_it_does_not_start_at_a_large_max_position_embeddings():
    rope = RotaryEmbedding(head_dim=128, max_position_embeddings=1 << 22)
    assert rope.cos.shape == (DEFAULT_TABLE_LEN, 64)
    q = torch.randn(1, 2, 1, 128)
    rope(q, q, offsets=5000)  # rows up to 5001: the next power of two, not 2^22
    assert rope.cos.shape[0] == 8192


def test_table_grows_to_the_next_power_of_two_capped_at_max_position_embeddings():
    rope = RotaryEmbedding(head_dim=HEAD_DIM, max_position_embeddings=3000)
    q = torch.randn(1, 1, 1, HEAD_DIM)
    rope(q, q, offsets=2100)  # next power of two is 4096, but the model's context is 3000
    assert rope.cos.shape[0] == 3000
    rope(q, q, offsets=3000)  # past the context: grows on (the call is still served)
    assert rope.cos.shape[0] == 4096


def test_growing_computes_only_the_new_rows_and_keeps_the_old_ones(monkeypatch):
    rope = RotaryEmbedding(head_dim=HEAD_DIM, max_position_embeddings=16)
    old_cos = rope.cos.clone()
    asked = []
    cos_sin = RopeConfig.cos_sin

    def recording(self, positions, **kw):
        asked.append(positions.clone() if isinstance(positions, torch.Tensor) else positions)
        return cos_sin(self, positions, **kw)

    monkeypatch.setattr(RopeConfig, "cos_sin", recording)
    q = torch.randn(1, 1, 1, HEAD_DIM)
    rope(q, q, offsets=40)  # 16 -> 64 rows
    assert rope.cos.shape[0] == 64
    computed = torch.cat([a.reshape(-1) for a in asked])
    assert computed.tolist() == list(range(16, 64))  # rows 0..15 were copied, not recomputed
    assert torch.equal(rope.cos[:16], old_cos)
    want_cos, want_sin = cos_sin(rope.config, 64)
    assert torch.equal(rope.cos, want_cos) and torch.equal(rope.sin, want_sin)


_PEAK_RSS_SCRIPT = """
import resource, sys, torch
from ropekit import RotaryEmbedding
torch.set_num_threads(1)
x = torch.randn(1, 1, 1, 128)
RotaryEmbedding(head_dim=128)(x, x)  # warm up the allocator and the code paths
def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
before = peak_mb()
rope = RotaryEmbedding(head_dim=128, max_position_embeddings=1 << 22)
{action}
print(peak_mb() - before, rope.cos.nbytes * 2 / 2**20)
"""


def _peak_rss_mb(action: str) -> tuple[float, float]:
    """(peak resident memory gained in MB, final table MB) of a fresh process building a module."""
    code = _PEAK_RSS_SCRIPT.format(action=action)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    peak, table = map(float, done.stdout.split())
    return peak, table


def test_constructing_for_a_4m_token_context_takes_under_64_mb():
    peak, _ = _peak_rss_mb("pass")
    assert peak < 64


def test_growing_a_table_peaks_near_one_and_a_half_times_its_size():
    # 2^17 rows, then 2^18 rows (128 MB): during the second growth the old half and the new table coexist.
    peak, table = _peak_rss_mb("rope(x, x, offsets=(1 << 17) - 1); rope(x, x, offsets=(1 << 18) - 1)")
    assert table == 128
    assert peak < 1.5 * table + 24  # a float64 intermediate of the new rows alone would add 128 MB


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "thd"])
def test_far_away_positions_rotate_exactly_without_allocating_a_table_that_large(layout):
    from ropekit import reference as ref

    rope = RotaryEmbedding(head_dim=HEAD_DIM, layout=layout)
    far = torch.tensor([[10**10, 3, 2**40]])  # (B, S)
    x = torch.randn(1, 3, 2, HEAD_DIM, dtype=torch.float64)  # (B, S, H, D)
    if layout == "thd":
        q, _ = rope(x[0], x[0], positions=far[0])
        got = q[None]
    else:
        q, _ = rope(_to_layout(x, layout), _to_layout(x, layout), positions=far)
        got = _from_layout(q, layout)
    assert rope.cos.shape[0] <= 4096  # the cached table did not grow toward 2**40 rows
    theta = ref.inv_freq(HEAD_DIM, rope.config.base)
    want = ref.rotate_half(x.numpy(), far.numpy()[..., None], theta)
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-9)


def test_far_away_negative_position_is_still_a_value_error():
    rope = RotaryEmbedding(head_dim=HEAD_DIM)
    x = torch.randn(1, 2, 1, HEAD_DIM)
    with pytest.raises(ValueError, match="positions: expected values >= 0"):
        rope(x, x, positions=torch.tensor([[-1, 2**40]]))


def test_table_is_a_non_persistent_buffer():
    rope = RotaryEmbedding(head_dim=HEAD_DIM)
    assert {"cache.cos", "cache.sin"} <= {name for name, _ in rope.named_buffers()}
    assert rope.cos is rope.cache.cos and rope.sin is rope.cache.sin
    assert rope.state_dict() == {}
    model = nn.Sequential(nn.Linear(4, 4), rope)
    assert set(model.state_dict()) == {"0.weight", "0.bias"}
    fresh = nn.Sequential(nn.Linear(4, 4), RotaryEmbedding(head_dim=HEAD_DIM))
    fresh.load_state_dict(model.state_dict(), strict=True)  # checkpoints carry no table


def test_table_follows_the_input_precision():
    rope = RotaryEmbedding(head_dim=HEAD_DIM)
    assert rope.cos.dtype == torch.float32
    q = torch.randn(1, 3, 1, HEAD_DIM, dtype=torch.float64)
    rope(q, q)
    assert rope.cos.dtype == torch.float64  # float64 inputs get float64 tables
    torch.testing.assert_close(rope.cos, rope.config.cos_sin(rope.cos.shape[0], dtype=torch.float64)[0])
    q16 = torch.randn(1, 3, 1, HEAD_DIM, dtype=torch.float16)
    out, _ = rope(q16, q16)
    assert rope.cos.dtype == torch.float32 and out.dtype == torch.float16  # math in float32


def test_module_to_dtype_moves_the_buffers_and_forward_rebuilds_them_exactly():
    rope = RotaryEmbedding(head_dim=HEAD_DIM).to(torch.float16)
    assert rope.cos.dtype == torch.float16
    q = torch.randn(1, 3, 1, HEAD_DIM)
    rope(q, q)
    assert rope.cos.dtype == torch.float32
    assert torch.equal(rope.cos, rope.config.cos_sin(rope.cos.shape[0])[0])  # rebuilt, not upcast from fp16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none in this environment)")
def test_table_follows_the_input_device():
    rope = RotaryEmbedding(head_dim=HEAD_DIM)
    q = torch.randn(1, 3, 2, HEAD_DIM, device="cuda")
    q_out, _ = rope(q, q)
    assert rope.cos.device.type == "cuda" and q_out.device.type == "cuda"
    cpu_out, _ = RotaryEmbedding(head_dim=HEAD_DIM)(q.cpu(), q.cpu())
    torch.testing.assert_close(q_out.cpu(), cpu_out)


@pytest.mark.parametrize(
    ("shape", "offsets"),
    [((1, 4, 2, 64), 100000), ((1, 3000, 2, 64), 0)],
    ids=["offset-past-the-table", "prefill-past-the-table"],
)
def test_compiled_call_past_the_table_computes_its_rows_in_the_graph_and_matches_eager(shape, offsets):
    """The repros of issue 9: under torch.compile these returned inf and NaN from rows past the table. Now
    the graph computes the rows itself (no graph break: fullgraph holds) and the next eager call grows it."""
    torch.manual_seed(0)
    q, k = torch.randn(shape), torch.randn((*shape[:2], 1, 64))
    rope = RotaryEmbedding(head_dim=64)
    got = torch.compile(rope, backend="aot_eager", fullgraph=True)(q, k, offsets=offsets)
    want = RotaryEmbedding(head_dim=64)(q, k, offsets=offsets)
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert rope.cos.shape[0] == DEFAULT_TABLE_LEN  # no buffer was resized inside the graph
    rope(q, k, offsets=offsets)
    assert rope.cos.shape[0] >= offsets + shape[1]  # the eager call grows it


def test_fullgraph_dynamic_compile_with_an_int_offset_past_the_default_table_works():
    """Issue 17, repro 7: dynamic=True with an int offset past the 2048-row table raised dynamo's
    Unsupported (a graph break under fullgraph); the offset is symbolic, so one graph serves both sides."""
    rope, eager = RotaryEmbedding(head_dim=HEAD_DIM), RotaryEmbedding(head_dim=HEAD_DIM)
    step = torch.compile(rope, backend="aot_eager", fullgraph=True, dynamic=True)
    for offset in (5, 2046, 2047, 2048, 4000, 70000):
        q, k = torch.randn(2, 3, 4, HEAD_DIM), torch.randn(2, 3, 2, HEAD_DIM)
        for g, w in zip(step(q, k, offsets=offset), eager(q, k, offsets=offset), strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_compiled_call_with_tensor_positions_past_the_table_is_an_error():
    rope = RotaryEmbedding(head_dim=64)  # 2048 rows; tensor positions are not read while tracing
    q, k = torch.randn(1, 1, 2, 64), torch.randn(1, 1, 1, 64)
    with pytest.raises((ValueError, RuntimeError)):
        torch.compile(rope, backend="aot_eager")(q, k, positions=torch.tensor([[5000]]))


def test_compiled_decode_loop_matches_eager_as_the_offset_walks_past_the_table():
    rope = RotaryEmbedding(head_dim=HEAD_DIM, max_position_embeddings=16)
    eager = RotaryEmbedding(head_dim=HEAD_DIM, max_position_embeddings=16)
    step = torch.compile(rope, backend="aot_eager")
    for offset in (0, 9, 15, 16, 40, 41, 200):
        q, k = torch.randn(2, 1, 4, HEAD_DIM), torch.randn(2, 1, 2, HEAD_DIM)
        for g, w in zip(step(q, k, offsets=offset), eager(q, k, offsets=offset), strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_cpu_tensor_positions_grow_the_table_only_as_far_as_they_reach():
    rope = RotaryEmbedding(head_dim=HEAD_DIM, max_position_embeddings=1 << 20)
    x = torch.randn(1, 3, 1, HEAD_DIM)
    rope(x, x, positions=torch.tensor([[5, 2999, 7]]))
    assert rope.cos.shape[0] == 4096  # read on the host (free on the CPU): the next power of two


# name: (layout, keyword arguments, the table rows the module must hold for the call)
META_CALLS = {
    "int offset": ("bshd", lambda q: {"offsets": 2500}),
    "tensor offsets": ("bshd", lambda q: {"offsets": torch.tensor([5, 7], device="meta")}),
    "positions": ("bshd", lambda q: {"positions": torch.zeros(2, 1, dtype=torch.long, device="meta")}),
    "bhsd positions": ("bhsd", lambda q: {"positions": torch.zeros(2, 1, dtype=torch.long, device="meta")}),
    "cu_seqlens": ("thd", lambda q: {"cu_seqlens": torch.tensor([0, 1, 2], device="meta"), "offsets": 9}),
}


def _meta_inputs(layout):
    shape = {"bshd": (2, 1, 8, 64), "bhsd": (2, 8, 1, 64), "thd": (2, 8, 64)}[layout]
    kv = list(shape)
    kv[1 if layout == "bhsd" else -2] = 2  # 2 key heads
    return torch.empty(shape, device="meta"), torch.empty(kv, device="meta")


@pytest.mark.parametrize("call", list(META_CALLS))
def test_module_reads_no_tensor_data_on_the_host_for_device_inputs(monkeypatch, call):
    """Meta tensors have no data: any host read of a value (a GPU sync) raises. The module's own part (table
    sizing, layouts) runs on them; the functional call is stubbed to record the table it receives."""
    import ropekit.module

    layout, kwargs = META_CALLS[call]
    received = []

    def record(q, k, cos, sin, pos, **kw):
        received.append(cos)
        return q, k

    monkeypatch.setattr(ropekit.module, "apply_resolved", record)
    rope = RotaryEmbedding(head_dim=64, max_position_embeddings=8192, layout=layout)
    q, k = _meta_inputs(layout)
    q_out, k_out = rope(q, k, **kwargs(q))
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.device.type == "meta"
    (cos,) = received
    assert cos.device.type == "meta"
    # An int offset bounds the rows on the host (2501 -> 4096); resolved tensor positions (offsets, packed
    # sequences) do not, so the table covers the model's context.
    want = {"int offset": 4096}.get(call, 8192)
    assert cos.shape[0] == want


@pytest.mark.parametrize("call", list(META_CALLS))
def test_module_runs_end_to_end_on_meta_tensors(call):
    layout, kwargs = META_CALLS[call]
    rope = RotaryEmbedding(head_dim=64, max_position_embeddings=4096, layout=layout)
    q, k = _meta_inputs(layout)
    q_out, k_out = rope(q, k, **kwargs(q))
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.device.type == "meta"


def _garbage(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(float("nan"))


def test_module_built_on_meta_runs_on_meta_and_rebuilds_for_a_real_input():
    """Issue 17, repro 3: a meta-built module's first call raised NotImplementedError (copy out of meta)."""
    with torch.device("meta"):
        rope = RotaryEmbedding(head_dim=HEAD_DIM)
    assert rope.cos.is_meta
    q_meta = torch.empty(1, 3, 2, HEAD_DIM, device="meta")
    assert rope(q_meta, q_meta)[0].is_meta  # shapes only, as every meta op
    q = torch.randn(1, 3, 2, HEAD_DIM)
    got = rope(q, q)
    want = RotaryEmbedding(head_dim=HEAD_DIM)(q, q)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert rope.cos.device.type == "cpu"


@pytest.mark.parametrize("grown", [False, True], ids=["fresh", "grown"])
def test_to_empty_rebuilds_the_table_instead_of_returning_nan(grown):
    """Issue 17, repro 3: to_empty left uninitialised non-persistent buffers and forward returned NaN."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), RotaryEmbedding(head_dim=HEAD_DIM, max_position_embeddings=64))
    rope = model[1]
    if grown:
        rope(torch.empty(1, 1, 1, HEAD_DIM, device="meta"), offsets=100)  # 101 rows -> 128 on meta
    model.to_empty(device="cpu")
    reference = RotaryEmbedding(head_dim=HEAD_DIM, max_position_embeddings=64)
    want_cos, want_sin = reference.config.cos_sin(rope.cos.shape[0])
    assert torch.equal(rope.cos, want_cos) and torch.equal(rope.sin, want_sin)
    q = torch.randn(1, 4, 2, HEAD_DIM)
    got, want = rope(q, offsets=7), reference(q, offsets=7)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_reset_parameters_on_a_meta_module_builds_the_tables_as_torchtune_rope_init_does():
    """torchtune's test_rope_init_meta_device pattern: build on meta, re-init, compare every buffer."""
    on_device = RotaryEmbedding(head_dim=HEAD_DIM, max_position_embeddings=128)
    with torch.device("meta"):
        meta = RotaryEmbedding(head_dim=HEAD_DIM, max_position_embeddings=128)
    meta.reset_parameters()
    for (name, a), (_, b) in zip(on_device.named_buffers(), meta.named_buffers(), strict=True):
        assert not b.is_meta, name
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_reset_parameters_recomputes_a_table_overwritten_in_place():
    rope = RotaryEmbedding(head_dim=HEAD_DIM, base=500.0)
    _garbage(rope.cos), _garbage(rope.sin)
    rope.reset_parameters()
    want_cos, want_sin = rope.config.cos_sin(rope.cos.shape[0])
    assert torch.equal(rope.cos, want_cos) and torch.equal(rope.sin, want_sin)


def test_to_float64_recomputes_the_table_rather_than_upcasting_float32_rows():
    rope = RotaryEmbedding(head_dim=HEAD_DIM).double()
    want, _ = rope.config.cos_sin(rope.cos.shape[0], dtype=torch.float64)
    assert rope.cos.dtype == torch.float64 and torch.equal(rope.cos, want)


def test_length_dependent_rebuild_after_to_empty_keeps_the_frequencies_of_the_table():
    config = RopeConfig(HEAD_DIM, scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=16)
    rope = RotaryEmbedding(config)
    q = torch.randn(1, 40, 1, HEAD_DIM)
    rope(q, q)  # seq_len 40 > 16: dynamic NTK's larger base
    before_cos = rope.cos.clone()
    rope.to_empty(device="cpu")
    assert torch.equal(rope.cos, before_cos)


def test_cache_can_be_used_on_its_own():
    cache = CosSinCache(RopeConfig(HEAD_DIM, max_position_embeddings=32))
    assert cache.cos.shape == (32, HEAD_DIM // 2)
    assert "table_len=32" in repr(cache)
