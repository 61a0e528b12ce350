"""RotaryEmbedding: layouts, its cos/sin table (grows, non-persistent, follows the input), torch.compile."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from ropekit import RopeConfig, RotaryEmbedding, apply_rotary_qk
from ropekit.module import DEFAULT_TABLE_LEN

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
HEAD_DIM = 8
SEQ_LENS = [3, 0, 2]


def _to_layout(x_bshd: torch.Tensor, layout: str) -> torch.Tensor:
    """(B, S, H, D) -> (B, H, S, D) for bhsd; other layouts are built directly."""
    return x_bshd.transpose(1, 2).contiguous() if layout == "bhsd" else x_bshd


def _from_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x.transpose(1, 2) if layout == "bhsd" else x


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("position_kind", ["none", "int", "tensor", "positions"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "thd"])
def test_module_outputs_and_gradients_match_reference(
    assert_matches_reference, layout, dtype, position_kind, interleaved
):
    rope = RotaryEmbedding(head_dim=HEAD_DIM, rotary_dim=6, interleaved=interleaved, layout=layout)
    g = torch.Generator().manual_seed(0)
    if layout == "thd":
        total = sum(SEQ_LENS)
        q = torch.randn(total, 4, HEAD_DIM, generator=g).to(dtype)  # (total_tokens, heads, head_dim)
        k = torch.randn(total, 2, HEAD_DIM, generator=g).to(dtype)
        kwargs = {"cu_seqlens": torch.tensor(np.cumsum([0, *SEQ_LENS]))}
        starts = {"none": [0, 0, 0], "int": [4] * 3, "tensor": [2, 0, 7]}.get(position_kind)
        lead = (total,)
    else:
        q = torch.randn(2, 5, 4, HEAD_DIM, generator=g).to(dtype)  # (batch, seq, heads, head_dim)
        k = torch.randn(2, 5, 2, HEAD_DIM, generator=g).to(dtype)
        kwargs = {}
        starts = {"none": [0, 0], "int": [4, 4], "tensor": [2, 7]}.get(position_kind)
        lead = (2, 5)
    if position_kind == "positions":
        want = torch.randint(0, 40, lead, generator=g)
        kwargs["positions"] = want
        want = want.numpy()
    else:
        if position_kind == "int":
            kwargs["offsets"] = 4
        elif position_kind == "tensor":
            kwargs["offsets"] = torch.tensor(starts)
        if layout == "thd":
            want = np.concatenate([np.arange(n) + s for n, s in zip(SEQ_LENS, starts, strict=True)])
        else:
            want = np.arange(5)[None, :] + np.array(starts)[:, None]
    q_in = _to_layout(q, layout).requires_grad_(True)
    k_in = _to_layout(k, layout).requires_grad_(True)
    q_out, k_out = rope(q_in, k_in, **kwargs)
    assert q_out.shape == q_in.shape and k_out.shape == k_in.shape
    table_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    cos, sin = rope.config.cos_sin(64, dtype=table_dtype)
    assert_matches_reference(_from_layout(q_out, layout), q, cos, sin, want, interleaved=interleaved)
    assert_matches_reference(_from_layout(k_out, layout), k, cos, sin, want, interleaved=interleaved)
    gq, gk = torch.randn_like(q_out), torch.randn_like(k_out)
    torch.autograd.backward([q_out, k_out], [gq, gk])
    for grad, upstream in ((q_in.grad, gq), (k_in.grad, gk)):
        got, upstream = _from_layout(grad, layout), _from_layout(upstream, layout)
        assert_matches_reference(got, upstream, cos, sin, want, interleaved=interleaved, conjugate=True)


def test_layouts_agree_on_the_same_tokens():
    q, k = torch.randn(1, 6, 4, HEAD_DIM), torch.randn(1, 6, 2, HEAD_DIM)  # (1, seq, heads, head_dim)
    bshd = RotaryEmbedding(head_dim=HEAD_DIM, layout="bshd")(q, k)
    bhsd = RotaryEmbedding(head_dim=HEAD_DIM, layout="bhsd")(q.transpose(1, 2), k.transpose(1, 2))
    thd = RotaryEmbedding(head_dim=HEAD_DIM, layout="thd")(q[0], k[0], cu_seqlens=torch.tensor([0, 6]))
    thd_positions = RotaryEmbedding(head_dim=HEAD_DIM, layout="thd")(q[0], k[0], positions=torch.arange(6))
    for i in range(2):
        assert torch.equal(bhsd[i].transpose(1, 2), bshd[i])
        assert torch.equal(thd[i], bshd[i][0])
        assert torch.equal(thd_positions[i], bshd[i][0])


def test_bhsd_output_is_the_same_memory_layout_contract_as_the_input():
    rope = RotaryEmbedding(head_dim=HEAD_DIM, layout="bhsd")
    q = torch.randn(2, 4, 5, HEAD_DIM)  # (batch, heads, seq, head_dim)
    q_out, _ = rope(q, q)
    assert q_out.shape == (2, 4, 5, HEAD_DIM)


def test_config_object_and_keywords_build_the_same_module():
    a = RotaryEmbedding(RopeConfig(HEAD_DIM, 500000.0, interleaved=True))
    b = RotaryEmbedding(head_dim=HEAD_DIM, base=500000.0, interleaved=True)
    assert a.config == b.config
    assert torch.equal(a.cos, b.cos) and torch.equal(a.sin, b.sin)


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
    assert {"cos", "sin"} <= {name for name, _ in rope.named_buffers()}
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


class TinyAttention(nn.Module):
    """A minimal causal attention block with GQA, the way models call RotaryEmbedding."""

    def __init__(self, dim=32, heads=4, kv_heads=2) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.rope = RotaryEmbedding(head_dim=self.head_dim, max_position_embeddings=64)

    def forward(self, x: torch.Tensor, offsets: int = 0) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.heads, self.head_dim)  # (B, S, H, D)
        k, v = self.wkv(x).view(batch, seq, 2, self.kv_heads, self.head_dim).unbind(2)  # (B, S, Hk, D) each
        q, k = self.rope(q, k, offsets=offsets)
        out = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )  # (B, H, S, D)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


def test_compiles_with_fullgraph_and_no_graph_breaks():
    torch.manual_seed(0)
    block = TinyAttention()
    x = torch.randn(2, 8, 32, requires_grad=True)
    # fullgraph=True turns any graph break into an error; aot_eager also traces the backward graph.
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    got = compiled(x, offsets=3)
    want = block(x, offsets=3)
    torch.testing.assert_close(got, want)
    (grad_got,) = torch.autograd.grad(got.sum(), x)
    (grad_want,) = torch.autograd.grad(want.sum(), x)
    torch.testing.assert_close(grad_got, grad_want)


@pytest.mark.parametrize("which", ["q", "k"])
def test_head_dim_other_than_the_configs_is_a_value_error_naming_both(which):
    rope = RotaryEmbedding(head_dim=64)
    right, wrong = torch.randn(1, 2, 2, 64), torch.randn(1, 2, 2, 96)
    q, k = (wrong, right) if which == "q" else (right, wrong)
    with pytest.raises(ValueError, match=rf"{which}: expected head_dim 64 .* got 96"):
        rope(q, k)


@pytest.mark.parametrize(
    ("shape", "offsets"),
    [((1, 4, 2, 64), 100000), ((1, 3000, 2, 64), 0)],
    ids=["offset-past-the-table", "prefill-past-the-table"],
)
def test_compiled_call_past_the_table_grows_it_and_matches_eager(shape, offsets):
    """The repros of issue 9: under torch.compile these returned inf and NaN from rows past the table."""
    torch.manual_seed(0)
    q, k = torch.randn(shape), torch.randn((*shape[:2], 1, 64))
    rope = RotaryEmbedding(head_dim=64)
    got = torch.compile(rope, backend="aot_eager")(q, k, offsets=offsets)
    want = RotaryEmbedding(head_dim=64)(q, k, offsets=offsets)
    assert rope.cos.shape[0] >= offsets + shape[1]
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
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
    # An int offset bounds the rows on the host (2501 -> 4096; 9 + 2 packed tokens fit the first 2048 rows);
    # tensor positions and offsets do not, so the table covers the model's context.
    want = {"int offset": 4096, "cu_seqlens": DEFAULT_TABLE_LEN}.get(call, 8192)
    assert cos.shape[0] == want


@pytest.mark.parametrize("call", list(META_CALLS))
def test_module_runs_end_to_end_on_meta_tensors(call):
    layout, kwargs = META_CALLS[call]
    rope = RotaryEmbedding(head_dim=64, max_position_embeddings=4096, layout=layout)
    q, k = _meta_inputs(layout)
    q_out, k_out = rope(q, k, **kwargs(q))
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.device.type == "meta"


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sbhd"])
def test_sbhd_and_every_layout_rotate_the_same_tokens_through_views(layout):
    """sbhd (Megatron's sequence-first form) is a transposed view like bhsd: same tokens, same result."""
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 6, 4, HEAD_DIM, generator=g), torch.randn(2, 6, 2, HEAD_DIM, generator=g)  # bshd
    want = RotaryEmbedding(head_dim=HEAD_DIM)(q, k, offsets=torch.tensor([1, 4]))
    axes = {"bshd": None, "bhsd": (1, 2), "sbhd": (0, 1)}[layout]
    view = (lambda t: t) if axes is None else (lambda t: t.transpose(*axes))
    rope = RotaryEmbedding(head_dim=HEAD_DIM, layout=layout)
    q_in, k_in = view(q).contiguous(), view(k).contiguous()  # laid out as the layout says
    got = rope(q_in, k_in, offsets=torch.tensor([1, 4]))
    for a, b, x in zip(got, want, (q_in, k_in), strict=True):
        assert a.shape == x.shape and a.stride() == x.stride()
        assert torch.equal(view(a), b)


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sbhd", "thd"])
def test_one_tensor_call_equals_the_pair_call(layout):
    """rope(q) with k omitted rotates q alone (a query, or a key on its way into a cache)."""
    g = torch.Generator().manual_seed(6)
    shape = (7, 3, HEAD_DIM) if layout == "thd" else (2, 5, 3, HEAD_DIM)
    q, k = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    kw = {"cu_seqlens": torch.tensor([0, 3, 7])} if layout == "thd" else {"offsets": 3}
    rope = RotaryEmbedding(head_dim=HEAD_DIM, interleaved=True, layout=layout)
    pair = rope(q, k, **kw)
    single = rope(k, **kw)
    assert isinstance(single, torch.Tensor)
    assert torch.equal(single, pair[1])


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sbhd"])
def test_in_place_call_writes_into_the_callers_tensors_and_trains(layout):
    g = torch.Generator().manual_seed(7)
    shape = (
        (2, 5, 3, HEAD_DIM) if layout == "bshd" else (5, 2, 3, HEAD_DIM) if layout == "sbhd" else (2, 3, 5, 8)
    )
    q0, k0 = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    rope = RotaryEmbedding(head_dim=HEAD_DIM, layout=layout)
    want_q, want_k = rope(q0, k0)
    wq, wk = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    q_leaf, k_leaf = q0.clone().requires_grad_(), k0.clone().requires_grad_()
    q, k = q_leaf * 1.0, k_leaf * 1.0  # non-leaf tensors, as in a model
    out_q, out_k = rope(q, k, inplace=True)
    assert out_q is q and out_k is k
    torch.testing.assert_close(q, want_q, atol=0, rtol=0)
    torch.testing.assert_close(k, want_k, atol=0, rtol=0)
    ((out_q * wq).sum() + (out_k * wk).sum()).backward()
    ref_q, ref_k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
    rq, rk = rope(ref_q, ref_k)
    ((rq * wq).sum() + (rk * wk).sum()).backward()
    torch.testing.assert_close(q_leaf.grad, ref_q.grad)
    torch.testing.assert_close(k_leaf.grad, ref_k.grad)
    single = k0.clone()
    assert rope(single, inplace=True) is single and torch.equal(single, want_k)


def test_inplace_must_be_a_bool():
    with pytest.raises(ValueError, match=r"^inplace: expected a bool"):
        RotaryEmbedding(head_dim=HEAD_DIM)(torch.randn(1, 2, 1, HEAD_DIM), inplace=1)
    with pytest.raises(ValueError, match=r"^layout: expected one of \('bshd', 'bhsd', 'sbhd', 'thd'\)"):
        RotaryEmbedding(head_dim=HEAD_DIM, layout="hbsd")
