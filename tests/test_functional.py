"""apply_rotary / apply_rotary_qk against the float64 reference: outputs and gradients over the whole grid.

Grid: layout (bshd, bhsd as a transposed view, packed thd with cu_seqlens) x dtype x partial rotary x position
kind (none, int offset, per-sequence offsets, explicit positions) x GQA x inplace x pair layout x backend.
Shapes are tiny so the grid stays fast; the reference is independent code (ropekit.reference, NumPy float64).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from boundary_checks import (
    check_inference_tensor_is_refused_before_writing,
    check_table_aliasing_the_input_is_refused,
    check_view_of_a_leaf_is_refused_before_writing,
)
from c_compiler import CPU
from ropekit import RopeConfig, apply_rotary, apply_rotary_qk
from ropekit import reference as ref
from rotary_reference import PEER_ROTATIONS, assert_matches_reference, hf_rotation, reference_rotation

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
BATCH, SEQ, TABLE_LEN = 2, 5, 32
SEQ_LENS = [3, 0, 4]  # packed batch with an empty sequence in the middle
POSITION_KINDS = ["none", "int", "tensor", "positions"]
# The torch backend and whatever "auto" picks (the fused CPU path here); float64 always runs on torch.
DTYPE_BACKENDS = [(d, b) for d in DTYPES for b in ("torch", "auto") if (d, b) != (torch.float64, "auto")]


def make_case(layout, dtype, head_dim, heads, position_kind, seed=0):
    """Return (x, kwargs, positions): x in the layout apply_rotary expects, the position kwargs, and the
    int64 positions (shape x.shape[:-2]) the reference should use, computed independently of ropekit."""
    g = torch.Generator().manual_seed(seed)
    if layout == "thd":
        total = sum(SEQ_LENS)
        x = torch.randn(total, heads, head_dim, generator=g).to(dtype)  # (total_tokens, heads, head_dim)
        kwargs = {"cu_seqlens": torch.tensor(np.cumsum([0, *SEQ_LENS]), dtype=torch.int32)}
        starts = {"none": [0, 0, 0], "int": [3] * 3, "tensor": [5, 1, 9], "positions": None}[position_kind]
        if position_kind == "positions":
            want = torch.randint(0, TABLE_LEN, (total,), generator=g).numpy()
        else:
            want = np.concatenate([np.arange(n) + s for n, s in zip(SEQ_LENS, starts, strict=True)])
    else:
        x = torch.randn(BATCH, heads, SEQ, head_dim, generator=g).to(dtype)  # (batch, heads, seq, head_dim)
        x = x.transpose(1, 2) if layout == "bhsd" else x.transpose(1, 2).contiguous()  # (B, S, H, D)
        starts = {"none": [0, 0], "int": [3, 3], "tensor": [7, 2], "positions": None}[position_kind]
        if position_kind == "positions":
            want = torch.randint(0, TABLE_LEN, (BATCH, SEQ), generator=g).numpy()
        else:
            want = np.arange(SEQ)[None, :] + np.array(starts)[:, None]
        kwargs = {}
    if position_kind == "int":
        kwargs["offsets"] = 3
    elif position_kind == "tensor":
        kwargs["offsets"] = torch.tensor(starts)
    elif position_kind == "positions":
        kwargs["positions"] = torch.from_numpy(want)
    return x, kwargs, want


def tables(rotary_dim, dtype):
    table_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return RopeConfig(rotary_dim).cos_sin(TABLE_LEN, dtype=table_dtype)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("inplace", [False, True], ids=["outofplace", "inplace"])
@pytest.mark.parametrize("kv_heads", [3, 1], ids=["mha", "gqa"])
@pytest.mark.parametrize("position_kind", POSITION_KINDS)
@pytest.mark.parametrize("head_dim,rotary_dim", [(8, 8), (12, 8)], ids=["full", "partial"])
@pytest.mark.parametrize("dtype,backend", DTYPE_BACKENDS, ids=[f"{d}-{b}" for d, b in DTYPE_BACKENDS])
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "thd"])
def test_apply_rotary_qk_outputs_and_gradients_match_reference(
    assert_matches_reference,
    layout,
    dtype,
    head_dim,
    rotary_dim,
    position_kind,
    kv_heads,
    inplace,
    interleaved,
    backend,
):
    q0, kwargs, positions = make_case(layout, dtype, head_dim, 3, position_kind, seed=1)
    k0, _, _ = make_case(layout, dtype, head_dim, kv_heads, position_kind, seed=2)
    cos, sin = tables(rotary_dim, dtype)
    q_leaf, k_leaf = q0.clone().requires_grad_(True), k0.clone().requires_grad_(True)
    # In-place needs non-leaf inputs; clone() keeps the layout's strides so bhsd stays a strided view.
    q_in, k_in = (q_leaf.clone(), k_leaf.clone()) if inplace else (q_leaf, k_leaf)
    q_out, k_out = apply_rotary_qk(
        q_in, k_in, cos, sin, interleaved=interleaved, inplace=inplace, backend=backend, **kwargs
    )
    assert (q_out is q_in) == inplace and (k_out is k_in) == inplace
    assert_matches_reference(q_out, q0, cos, sin, positions, interleaved=interleaved)
    assert_matches_reference(k_out, k0, cos, sin, positions, interleaved=interleaved)

    g = torch.Generator().manual_seed(3)
    gq, gk = torch.randn(q0.shape, generator=g).to(dtype), torch.randn(k0.shape, generator=g).to(dtype)
    torch.autograd.backward([q_out, k_out], [gq, gk])
    assert_matches_reference(q_leaf.grad, gq, cos, sin, positions, interleaved=interleaved, conjugate=True)
    assert_matches_reference(k_leaf.grad, gk, cos, sin, positions, interleaved=interleaved, conjugate=True)
    if not inplace:  # the inputs are untouched
        assert torch.equal(q_leaf.detach(), q0) and torch.equal(k_leaf.detach(), k0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_apply_rotary_alone_matches_apply_rotary_qk(layout, dtype):
    x, kwargs, _ = make_case(layout, dtype, 8, 2, "tensor")
    cos, sin = tables(8, dtype)
    alone = apply_rotary(x, cos, sin, **kwargs)
    together, _ = apply_rotary_qk(x, x[..., :1, :], cos, sin, **kwargs)
    assert torch.equal(alone, together)


@given(
    half_dim=st.integers(1, 12),
    tail=st.integers(0, 4),
    base=st.floats(2.0, 1e6),
    seq=st.integers(1, 6),
    offset=st.integers(0, 2000),
    interleaved=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_float64_apply_rotary_equals_reference_rotation(half_dim, tail, base, seq, offset, interleaved, seed):
    """Production path = the reference's own formulas (not its table path), for random dims and bases."""
    d = 2 * half_dim
    config = RopeConfig(d + tail, base, rotary_dim=d)
    cos, sin = config.cos_sin(offset + seq, dtype=torch.float64)
    x = torch.randn(1, seq, 2, d + tail, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    got = apply_rotary(x, cos, sin, offsets=offset, interleaved=interleaved)
    rotate = ref.rotate_interleaved if interleaved else ref.rotate_half
    pos = (offset + np.arange(seq))[None, :, None]  # broadcast over (batch, seq, heads)
    want = rotate(x.numpy(), pos, ref.inv_freq(d, base))
    np.testing.assert_allclose(got.numpy(), want, atol=1e-9, rtol=0)


def test_half_layout_on_permuted_features_equals_interleaved_layout_permuted():
    d, tail = 8, 4
    x = torch.randn(2, 5, 3, d + tail, dtype=torch.float64)
    cos, sin = RopeConfig(d + tail, rotary_dim=d).cos_sin(8, dtype=torch.float64)
    to_half = torch.from_numpy(
        np.concatenate([ref.interleaved_to_half_permutation(d), np.arange(d, d + tail)])
    )
    half = apply_rotary(x[..., to_half], cos, sin, interleaved=False)
    interleaved = apply_rotary(x, cos, sin, interleaved=True)
    torch.testing.assert_close(half, interleaved[..., to_half], rtol=0, atol=1e-15)


def test_matches_transformers_llama_apply_rotary_pos_emb():
    modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    head_dim, seq = 16, 7
    q, k = torch.randn(2, 4, seq, head_dim), torch.randn(2, 2, seq, head_dim)  # HF layout (B, H, S, D)
    config = RopeConfig(head_dim, 500000.0)
    cos, sin = config.cos_sin(seq)
    hf_cos, hf_sin = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]  # (1, S, D)
    hf_k = modeling_llama.apply_rotary_pos_emb(q, k, hf_cos, hf_sin)
    ours = apply_rotary_qk(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    for want, got in zip(hf_k, ours, strict=True):
        torch.testing.assert_close(got.transpose(1, 2), want, rtol=1e-6, atol=1e-6)


def test_low_precision_math_runs_in_float32():
    """bf16 input rotated in float32 then rounded once: exactly the float32 result cast to bf16."""
    x = torch.randn(1, 6, 2, 16).to(torch.bfloat16)
    cos, sin = RopeConfig(16).cos_sin(6)
    got = apply_rotary(x, cos, sin, backend="torch")
    want = apply_rotary(x.float(), cos, sin, backend="torch").to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)


def test_float64_input_keeps_float64_math_even_with_a_float32_table():
    x = torch.randn(1, 3, 1, 4, dtype=torch.float64)
    cos, sin = RopeConfig(4).cos_sin(3, dtype=torch.float32)
    got = apply_rotary(x, cos, sin)
    assert got.dtype == torch.float64
    want = apply_rotary(x, cos.double(), sin.double())  # the float32 table values, float64 arithmetic
    torch.testing.assert_close(got, want, rtol=0, atol=1e-15)


@pytest.mark.parametrize("inplace", [False, True])
def test_features_past_rotary_dim_pass_through_unchanged(inplace):
    x = torch.randn(2, 4, 3, 10)
    before = x.clone()
    cos, sin = RopeConfig(10, rotary_dim=6).cos_sin(4)
    out = apply_rotary(x, cos, sin, inplace=inplace)
    assert torch.equal(out[..., 6:], before[..., 6:])
    assert not torch.allclose(out[..., :6], before[..., :6])


def test_inplace_writes_into_x_and_returns_it():
    x = torch.randn(2, 4, 3, 8)
    expected = apply_rotary(x, *RopeConfig(8).cos_sin(4))
    out = apply_rotary(x, *RopeConfig(8).cos_sin(4), inplace=True)
    assert out is x
    assert torch.equal(x, expected)


def test_out_of_place_never_modifies_inputs():
    q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 1, 8)
    cos, sin = RopeConfig(8).cos_sin(16)
    offsets, positions = torch.tensor([1, 2]), torch.tensor([[0, 5, 2, 9], [1, 1, 1, 1]])
    saved = [t.clone() for t in (q, k, cos, sin, offsets, positions)]
    apply_rotary_qk(q, k, cos, sin, offsets=offsets)
    apply_rotary_qk(q, k, cos, sin, positions=positions, interleaved=True)
    for before, after in zip(saved, (q, k, cos, sin, offsets, positions), strict=True):
        assert torch.equal(before, after)


def test_position_zero_is_the_identity():
    x = torch.randn(1, 1, 2, 8, dtype=torch.float64)
    assert torch.equal(apply_rotary(x, *RopeConfig(8).cos_sin(1, dtype=torch.float64)), x)


def test_offsets_equal_explicit_positions():
    """KV-cache decoding: offset o is the same as positions o + arange(seq)."""
    x = torch.randn(2, 3, 2, 8)
    cos, sin = RopeConfig(8).cos_sin(16)
    by_offsets = apply_rotary(x, cos, sin, offsets=torch.tensor([4, 9]))
    by_positions = apply_rotary(x, cos, sin, positions=torch.tensor([[4, 5, 6], [9, 10, 11]]))
    assert torch.equal(by_offsets, by_positions)


def test_positions_with_cu_seqlens_override_the_per_sequence_arange():
    x = torch.randn(5, 2, 8)
    cos, sin = RopeConfig(8).cos_sin(16)
    positions = torch.tensor([7, 3, 0, 11, 2])
    got = apply_rotary(x, cos, sin, positions=positions, cu_seqlens=torch.tensor([0, 2, 5]))
    want = apply_rotary(x[None], cos, sin, positions=positions[None])[0]
    assert torch.equal(got, want)


def test_packed_sequences_each_start_at_position_zero():
    """Packing two sequences equals rotating each on its own."""
    a, b = torch.randn(1, 3, 2, 8), torch.randn(1, 4, 2, 8)
    cos, sin = RopeConfig(8).cos_sin(8)
    packed = apply_rotary(torch.cat([a[0], b[0]]), cos, sin, cu_seqlens=torch.tensor([0, 3, 7]))
    separate = torch.cat([apply_rotary(a, cos, sin)[0], apply_rotary(b, cos, sin)[0]])
    assert torch.equal(packed, separate)


def test_learnable_tables_receive_gradients():
    x = torch.randn(1, 3, 2, 4, dtype=torch.float64)
    cos, sin = RopeConfig(4).cos_sin(3, dtype=torch.float64)
    cos.requires_grad_(True), sin.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda c, s: apply_rotary(x, c, s), (cos, sin))


def test_empty_sequence_is_returned_empty():
    x = torch.randn(2, 0, 3, 8)
    out = apply_rotary(x, *RopeConfig(8).cos_sin(4))
    assert out.shape == x.shape


META_CASES = {
    "default": {},
    "int offset": {"offsets": 3},
    "per-sequence offsets": {"offsets": torch.tensor([1, 7])},
    "positions": {"positions": torch.tensor([[0, 5, 9, 2, 1], [3, 3, 3, 3, 31]])},
}


@pytest.mark.parametrize("case", META_CASES)
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_functional_path_reads_no_tensor_value_on_the_host(case, inplace, backend):
    """The stand-in for "no device-to-host sync on CUDA": on meta tensors any .item() / .tolist() / int(t) /
    bool(t) raises, so the whole path (validation, resolution, range checks, dispatch, backward) must run on
    shapes alone and leave value checks to the device."""
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in META_CASES[case].items()}
    cos, sin = (t.to("meta") for t in tables(8, torch.float32))
    q = torch.randn(2, 5, 4, 12, device="meta", requires_grad=not inplace)
    k = torch.randn(2, 5, 2, 12, device="meta", requires_grad=not inplace)
    out_q, out_k = apply_rotary_qk(q, k, cos, sin, inplace=inplace, backend=backend, **meta)
    assert out_q.is_meta and out_q.shape == q.shape and out_k.shape == k.shape
    if not inplace:
        (out_q.sum() + out_k.sum()).backward()
        assert q.grad.shape == q.shape


def test_packed_path_reads_no_tensor_value_on_the_host():
    cos, sin = (t.to("meta") for t in tables(8, torch.float32))
    x = torch.randn(7, 2, 8, device="meta")
    cu = torch.tensor([0, 3, 7], device="meta")
    out = apply_rotary(x, cos, sin, cu_seqlens=cu, offsets=torch.tensor([2, 5], device="meta"))
    assert out.is_meta and out.shape == x.shape


@pytest.mark.c_compiler
def test_compiled_call_past_the_table_raises_instead_of_returning_garbage():
    """Issue repro: compiled, an offset past the table gave inf (and a segfault further out)."""
    cos, sin = RopeConfig(64).cos_sin(2048)
    q, k = torch.randn(1, 8, 4, 64), torch.randn(1, 8, 2, 64)
    compiled = torch.compile(lambda q, k, o: apply_rotary_qk(q, k, cos, sin, offsets=o), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, 5), apply_rotary_qk(q, k, cos, sin, offsets=5))
    with pytest.raises(ValueError, match=r"position 100007 is outside the cos/sin table \(table_len 2048\)"):
        compiled(q, k, 100000)


@pytest.mark.c_compiler
def test_compiled_module_past_its_table_raises_instead_of_returning_garbage():
    """Issue repro: torch.compile(RotaryEmbedding(head_dim=64))(q, k, offsets=100000) returned inf."""
    from ropekit import RotaryEmbedding

    rope = RotaryEmbedding(head_dim=64)
    q, k = torch.randn(1, 4, 2, 64), torch.randn(1, 4, 2, 64)
    try:
        out_q, out_k = torch.compile(rope)(q, k, offsets=100000)
    except (ValueError, RuntimeError) as err:  # the kernel refuses rows past the table
        assert "100000" in str(err) or "outside" in str(err)
    else:  # or the table was grown to serve the call: then the result must be right
        want_q, want_k = RotaryEmbedding(head_dim=64)(q, k, offsets=100000)
        torch.testing.assert_close(out_q, want_q)
        torch.testing.assert_close(out_k, want_k)


@pytest.mark.parametrize("built", ["outside", "inside"])
@pytest.mark.parametrize("backend", [CPU, "torch"])
def test_compiled_in_place_on_packed_qkv_views_gives_eager_gradients(backend, built):
    """Issue 17, repro 4: aot_eager of in-place apply_rotary_qk on views of a packed fp16 qkv, then backward:
    with qkv built outside the compiled function a gradient off by 5.7, inside it an internal assert."""
    cos, sin = RopeConfig(16).cos_sin(16)
    x = torch.randn(1, 6, 3, 2, 16)
    w = torch.randn(1, 6, 3, 2, 16, requires_grad=True)

    def rotate(qkv):
        apply_rotary_qk(qkv[:, :, 0], qkv[:, :, 1], cos, sin, inplace=True, backend=backend)
        return (qkv.float() ** 2).sum()

    def build_and_rotate(x, w):
        return rotate((x * w).half())  # (batch, seq, 3, heads, head_dim)

    grads = []
    for compiled in (False, True):
        w.grad = None
        if built == "outside":
            fn = torch.compile(rotate, backend="aot_eager") if compiled else rotate
            fn((x * w).half()).backward()
        else:
            fn = torch.compile(build_and_rotate, backend="aot_eager") if compiled else build_and_rotate
            fn(x, w).backward()
        grads.append(w.grad.clone())
    w.grad = None
    qkv = (x * w).half()
    q, k = apply_rotary_qk(qkv[:, :, 0], qkv[:, :, 1], cos, sin, backend="torch")
    (q.float() ** 2).sum().add((k.float() ** 2).sum()).add((qkv[:, :, 2].float() ** 2).sum()).backward()
    torch.testing.assert_close(grads[0], w.grad, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(grads[1], w.grad, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("backend", ["torch", CPU])
def test_compiled_in_place_with_q_and_k_the_same_tensor_is_a_value_error(backend):
    """Found by the fuzzer: compiled, the torch backend (no op to check as the graph runs) rotated a tensor
    passed as both q and k twice, in place, with no error."""
    cos, sin = RopeConfig(2).cos_sin(16)
    x = torch.randn(1, 5, 1, 2)
    before = x.clone()
    step = torch.compile(
        lambda q, k: apply_rotary_qk(q, k, cos, sin, inplace=True, backend=backend), backend="aot_eager"
    )
    with pytest.raises(ValueError, match=r"k: inplace=True writes q and k, which share memory"):
        step(x, x)
    assert torch.equal(x, before)


@pytest.mark.parametrize("meta", ["per-token tables", "tables", "positions", "offsets", "cu_seqlens"])
def test_a_meta_tensor_beside_a_cpu_x_is_a_value_error_naming_it(meta):
    """Issue 17, item 7: PyTorch's NotImplementedError ("Cannot copy out of meta tensor") from inside the
    call becomes a ValueError naming the argument."""
    x, (cos, sin) = torch.randn(1, 3, 2, 8), tables(8, torch.float32)
    on_meta = lambda t: t.to("meta")  # noqa: E731
    calls = {
        "per-token tables": lambda: apply_rotary(
            x, on_meta(cos[:3].repeat(1, 2)), on_meta(sin[:3].repeat(1, 2)), per_token=True, full_width=True
        ),
        "tables": lambda: apply_rotary(x, on_meta(cos), on_meta(sin)),
        "positions": lambda: apply_rotary(
            x, cos, sin, positions=on_meta(torch.zeros(1, 3, dtype=torch.long))
        ),
        "offsets": lambda: apply_rotary(x, cos, sin, offsets=on_meta(torch.zeros(1, dtype=torch.long))),
        "cu_seqlens": lambda: apply_rotary(x[0], cos, sin, cu_seqlens=on_meta(torch.tensor([0, 3]))),
    }
    name = {"per-token tables": "cos", "tables": "cos"}.get(meta, meta)
    with pytest.raises(
        ValueError, match=rf"^{name}: expected a tensor with values, on x's device cpu, got a meta"
    ):
        calls[meta]()


@pytest.mark.parametrize("backend", ["torch", CPU])
def test_in_place_with_a_table_that_aliases_the_input_is_a_value_error(backend):
    """Issue 24, repro 1 (the cpu backend was off by 6.3): see boundary_checks."""
    check_table_aliasing_the_input_is_refused(backend)


@pytest.mark.parametrize("backend", ["torch", CPU])
def test_in_place_on_a_view_of_a_leaf_that_requires_grad_raises_before_writing(backend):
    check_view_of_a_leaf_is_refused_before_writing(backend)


@pytest.mark.parametrize("backend", ["torch", CPU, "auto"])
def test_in_place_on_an_inference_tensor_outside_inference_mode_raises_before_writing(backend):
    check_inference_tensor_is_refused_before_writing(backend)


class _PackedPlanner:
    """A backend that rotates on torch and plans packed calls: its run records the offsets and cu_seqlens it
    was handed and rotates through the torch backend with them (the stand-in for the Triton kernel)."""

    name = "packed_planner"

    def __init__(self):
        self.runs = []

    def unavailable_reason(self, q, cos):
        return None

    def rotate_qk(self, *args, **kwargs):
        from ropekit.backends import BACKENDS

        return BACKENDS["torch"].rotate_qk(*args, **kwargs)

    def plan(self, q, k, cos, sin, *, interleaved, conjugate, inplace, per_sequence=False, cu_seqlens=None):
        if cu_seqlens is None:
            return None

        def run(q, k, cos, sin, offset, cu_seqlens):
            self.runs.append((offset, cu_seqlens))
            token = torch.arange(q.shape[0])  # (T,)
            seq = torch.searchsorted(cu_seqlens[1:].long(), token, right=True)  # each token's sequence
            shift = offset[seq] if isinstance(offset, torch.Tensor) else offset
            rows = token - cu_seqlens.long()[seq] + shift
            flags = dict(interleaved=interleaved, conjugate=conjugate, inplace=inplace)
            return self.rotate_qk(q, k, cos, sin, rows, **flags)

        return run


@pytest.fixture
def packed_planner(monkeypatch):
    from ropekit import backends

    monkeypatch.setattr(backends, "BACKENDS", dict(backends.BACKENDS))
    planner = _PackedPlanner()
    backends.register_backend(planner)
    yield planner
    backends.clear_backend_cache()


@pytest.mark.parametrize("form", ["int", "per_sequence"])
def test_a_repeated_packed_call_is_served_by_its_plan_with_this_calls_offsets_and_cu_seqlens(
    monkeypatch, packed_planner, form
):
    """apply_rotary_qk with cu_seqlens goes through the packed gate: the first call is checked and plans the
    key, later calls of the same shapes reach the plan's run with their own offsets and cu_seqlens (no
    positions resolved), and each answer is the reference's."""
    from ropekit import functional

    cos, sin = RopeConfig(head_dim=8).cos_sin(TABLE_LEN)
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(7, 2, 8, generator=g), torch.randn(7, 1, 8, generator=g)  # (T, heads, head_dim)
    steps = [([0, 3, 3, 7], [1, 5, 2]), ([0, 1, 6, 7], [4, 0, 9])]  # (cu_seqlens, per-sequence offsets)
    for step, (cu_values, offsets) in enumerate(steps):
        cu = torch.tensor(cu_values, dtype=torch.int32)
        off = 2 + step if form == "int" else torch.tensor(offsets)
        if step:
            monkeypatch.setattr(functional, "resolve", None)  # a planned step never resolves positions
        out_q, out_k = apply_rotary_qk(q, k, cos, sin, offsets=off, cu_seqlens=cu, backend="packed_planner")
        per_seq = [off] * 3 if form == "int" else offsets
        rows = np.concatenate(
            [np.arange(b - a) + o for a, b, o in zip(cu_values[:-1], cu_values[1:], per_seq, strict=True)]
        )
        assert_matches_reference(out_q, q, cos, sin, rows, interleaved=False)
        assert_matches_reference(out_k, k, cos, sin, rows, interleaved=False)
    ((offset, cu_seen),) = packed_planner.runs  # the second step only, with its own arguments
    assert cu_seen is cu and (offset is off if form == "per_sequence" else offset == 3)


def test_packed_calls_with_positions_never_take_the_packed_gate(packed_planner):
    """Explicit positions with cu_seqlens are rows already: they take the positions gate, never the packed
    one; a backend whose plan takes no ``positions`` (this one) has no plan for them, so the checked path
    serves every call."""
    from call_count import ropekit_calls
    from ropekit.backends import plan

    plan.clear_plans()
    cos, sin = RopeConfig(head_dim=8).cos_sin(TABLE_LEN)
    x, cu, pos = torch.randn(5, 2, 8), torch.tensor([0, 2, 5]), torch.tensor([4, 5, 0, 1, 2])
    for _ in range(2):
        calls = ropekit_calls(
            lambda: apply_rotary(x, cos, sin, positions=pos, cu_seqlens=cu, backend="packed_planner")
        )
        assert "resolve" in calls
    assert packed_planner.runs == []
    kinds = {key[0]: run for key, run in plan._plans.items()}
    assert "rotary_packed" not in kinds and kinds["rotary_positions"] is None


def _positions_step(backend, inplace, seed=6):
    """A prefill-like call with explicit (B, S) positions, out of order and repeated."""
    cos, sin = RopeConfig(head_dim=16).cos_sin(TABLE_LEN)
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(BATCH, SEQ, 4, 16, generator=g), torch.randn(BATCH, SEQ, 2, 16, generator=g)
    positions = torch.randint(0, TABLE_LEN, (BATCH, SEQ), generator=g)
    positions[0, :2] = torch.tensor([TABLE_LEN - 1, TABLE_LEN - 1])
    return q, k, cos, sin, positions


@pytest.mark.c_compiler
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("backend", ["auto", CPU])
def test_a_repeated_call_with_positions_is_served_by_its_plan_and_equals_the_checked_path(backend, inplace):
    """Issue 25: explicit positions take the positions gate; the second call of a kind is the plan (no
    resolve, no checks), equal to the first (checked) call bit for bit and to the float64 reference."""
    from call_count import ropekit_calls

    q, k, cos, sin, positions = _positions_step(backend, inplace)
    kw = dict(positions=positions, backend=backend)
    checked = [t.clone() for t in (q, k)]
    first = apply_rotary_qk(*checked, cos, sin, **kw, inplace=inplace)
    planned = [t.clone() for t in (q, k)]
    calls = ropekit_calls(lambda: apply_rotary_qk(*planned, cos, sin, **kw, inplace=inplace))
    assert "launch_planned" in calls and "run" in calls and "resolve" not in calls, calls
    again = apply_rotary_qk(*[t.clone() for t in (q, k)], cos, sin, **kw, inplace=inplace)
    for got, want, x in zip(again, first, (q, k), strict=True):
        assert torch.equal(got, want)
        assert_matches_reference(got, x, cos, sin, positions.numpy(), interleaved=False)
    if inplace:  # the profiled call wrote its own inputs, as the checked call did
        assert torch.equal(planned[0], checked[0]) and torch.equal(planned[1], checked[1])


@pytest.mark.c_compiler
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("bad", ["past", "negative"])
def test_a_planned_positions_call_raises_the_checked_paths_error_and_writes_nothing(bad, inplace):
    """A position past the table or negative, after its key was planned: exactly the checked path's
    ValueError (the torch backend's, which has no positions plan), and neither q nor k changed."""
    q, k, cos, sin, positions = _positions_step("cpu", inplace)
    apply_rotary_qk(q.clone(), k.clone(), cos, sin, positions=positions, inplace=inplace, backend="cpu")
    positions[1, 2] = TABLE_LEN if bad == "past" else -3
    want = "largest position 32 is past" if bad == "past" else "expected values >= 0, got a minimum of -3"
    before = (q.clone(), k.clone())
    messages = []
    for backend in ("torch", "cpu"):
        with pytest.raises(ValueError, match=want) as err:
            apply_rotary_qk(q, k, cos, sin, positions=positions, inplace=inplace, backend=backend)
        messages.append(str(err.value))
    assert messages[0] == messages[1]
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])


@pytest.mark.c_compiler
def test_an_in_place_q_that_holds_the_positions_falls_through_to_the_checked_paths_error():
    """The memory rule on the planned path: positions read by the kernel as it writes q in place must not
    share q's bytes. A plan made for disjoint positions of the same layout refuses the call, and the checked
    path raises its own error (the same as the torch backend's); nothing is written."""
    q, k, cos, sin, positions = _positions_step("cpu", True)
    apply_rotary_qk(q, k, cos, sin, positions=positions, inplace=True, backend="cpu")  # plans the key
    inside = q.view(-1).view(torch.int64)[: BATCH * SEQ].view(BATCH, SEQ)  # int64 rows in q's own bytes
    inside.copy_(positions)
    before = (q.clone(), k.clone())
    messages = []
    for backend in ("torch", "cpu"):
        with pytest.raises(ValueError, match="shares memory with positions") as err:
            apply_rotary_qk(q, k, cos, sin, positions=inside, inplace=True, backend=backend)
        messages.append(str(err.value))
    assert messages[0] == messages[1]
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])


@pytest.mark.c_compiler
@pytest.mark.parametrize("form", ["batched", "packed"])
def test_a_steady_positions_decode_step_makes_as_many_ropekit_calls_as_an_int_offset_one(form):
    """Issue 25: a decode step with explicit positions ((B, 1), or a packed batch's (T,) with cu_seqlens)
    is a lookup and one launch, as the int-offset step (6 calls on the C loop; 92 and 108 before: the checked
    path every call)."""
    from call_count import ropekit_calls

    cos, sin = RopeConfig(head_dim=128).cos_sin(4096)
    q, k = torch.randn(4, 1, 32, 128), torch.randn(4, 1, 8, 128)  # Llama-3-8B heads, 4 sequences
    if form == "batched":
        kw = dict(positions=torch.tensor([[1000], [7], [4000], [300]]))
    else:
        q, k = q[:, 0], k[:, 0]  # (T, heads, head_dim)
        kw = dict(positions=torch.tensor([1000, 7, 4000, 300]), cu_seqlens=torch.arange(5, dtype=torch.int32))
    int_q, int_k = torch.randn(4, 1, 32, 128), torch.randn(4, 1, 8, 128)
    counts = {}
    for name, step in (
        ("int", lambda: apply_rotary_qk(int_q, int_k, cos, sin, offsets=1000, inplace=True)),
        ("positions", lambda: apply_rotary_qk(q, k, cos, sin, **kw, inplace=True)),
    ):
        step()
        counts[name] = len(ropekit_calls(step))
    assert counts["positions"] <= counts["int"], counts


@pytest.mark.parametrize("index", ["cu_seqlens", "offsets"])
@pytest.mark.parametrize("backend", ["torch", CPU])
def test_in_place_with_cu_seqlens_or_offsets_inside_the_input_is_refused_as_plans_decline_it(backend, index):
    """Issue 39: cu_seqlens (or per-sequence offsets) lying in q's memory, rotated in place, was accepted on
    the checked path while the launch plan declines it (a kernel reading them as it writes q): the memory
    rule refuses it on every path, before anything is written."""
    cos, sin = RopeConfig(16).cos_sin(64)
    storage = torch.zeros(6 * 2 * 16)  # q (6, 2, 16); the index tensor in its first bytes
    q = storage[: 6 * 2 * 16].view(6, 2, 16)
    q.copy_(torch.randn(6, 2, 16))
    index_tensor = torch.empty(0, dtype=torch.int32).set_(storage.untyped_storage(), 0, (3,), (1,))
    index_tensor.copy_(torch.tensor([0, 2, 6] if index == "cu_seqlens" else [0, 1, 2]))
    before = storage.clone()
    if index == "cu_seqlens":
        kwargs = {"cu_seqlens": index_tensor}
        x = q
    else:  # (B, S, H, D) with one offset per batch row
        kwargs = {"offsets": index_tensor}
        x = q.view(3, 2, 2, 16)
    with pytest.raises(ValueError, match=rf"^x: it is written and shares memory with {index}"):
        apply_rotary(x, cos, sin, inplace=True, backend=backend, **kwargs)
    assert torch.equal(storage.view(torch.int32), before.view(torch.int32))


# -- numerics= (issue 36): a peer's bits on request ----------------------------------------------------------

PEER_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _peer_case(dtype, rotary_dim, seed=0):
    """x (B, S, H, 16), float32 tables (TABLE_LEN, rotary_dim / 2), explicit rows (B, S)."""
    g = torch.Generator().manual_seed(seed)
    x = (4 * torch.randn(BATCH, SEQ, 3, 16, generator=g)).to(dtype)  # scale 4: products round in bf16
    cos, sin = RopeConfig(16, rotary_dim=rotary_dim).cos_sin(TABLE_LEN)
    positions = torch.randint(0, TABLE_LEN, (BATCH, SEQ), generator=g)
    return x, cos, sin, positions


@pytest.mark.cover
@pytest.mark.parametrize("numerics", ["hf", "vllm"])
@pytest.mark.parametrize("backend", ["torch", CPU, "auto"])
@pytest.mark.parametrize("dtype", PEER_DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [16, 10])  # full and partial rotary
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("kind", ["positions", "offset"])
def test_numerics_mode_equals_the_peers_torch_expression_bit_for_bit(
    numerics, backend, dtype, interleaved, rotary_dim, inverse, kind
):
    x, cos, sin, positions = _peer_case(dtype, rotary_dim)
    k = x[:, :, :2].flip(-1).contiguous()  # GQA: fewer key heads
    if kind == "offset":
        positions = torch.arange(7, 7 + SEQ).expand(BATCH, SEQ)
        where = dict(offsets=7)
    else:
        where = dict(positions=positions)
    peer = PEER_ROTATIONS[numerics]
    flags = dict(interleaved=interleaved, inverse=inverse)
    want_q, want_k = (peer(t, cos, sin, positions, **flags) for t in (x, k))
    kw = dict(**where, **flags, backend=backend, numerics=numerics)
    for _ in range(2):  # the checked path, then the launch plan it kept
        q_out, k_out = apply_rotary_qk(x, k, cos, sin, **kw)
        assert torch.equal(q_out, want_q) and torch.equal(k_out, want_k)
        assert torch.equal(apply_rotary(x, cos, sin, **kw), want_q)
    q_in, k_in = x.clone(), k.clone()
    apply_rotary_qk(q_in, k_in, cos, sin, **kw, inplace=True)
    assert torch.equal(q_in, want_q) and torch.equal(k_in, want_k)


@pytest.mark.parametrize("backend", ["torch", CPU])
@pytest.mark.parametrize("numerics", ["hf", "vllm"])
def test_numerics_mode_reads_hf_full_width_per_token_tables_as_hf_does(backend, numerics):
    x, cos, sin, positions = _peer_case(torch.bfloat16, 16)
    cos_hf = torch.cat((cos, cos), -1)[positions].to(torch.bfloat16)  # (B, S, D): HF's rotary module output
    sin_hf = torch.cat((sin, sin), -1)[positions].to(torch.bfloat16)
    got = apply_rotary(x, cos_hf, sin_hf, per_token=True, full_width=True, numerics=numerics, backend=backend)
    assert torch.equal(got, hf_rotation(x, cos, sin, positions, interleaved=False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_numerics_modes_equal_exact_in_float32_and_float64(dtype):
    x, cos, sin, positions = _peer_case(dtype, 10)
    if dtype == torch.float64:
        cos, sin = cos.double(), sin.double()
    exact = apply_rotary(x, cos, sin, positions=positions)
    for numerics in ("hf", "vllm"):
        assert torch.equal(apply_rotary(x, cos, sin, positions=positions, numerics=numerics), exact)
    assert torch.equal(hf_rotation(x, cos, sin, positions, interleaved=False), exact)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_exact_is_the_default_and_rounds_once_unlike_the_peers(dtype, assert_matches_reference):
    x, cos, sin, positions = _peer_case(dtype, 16)
    default = apply_rotary(x, cos, sin, positions=positions)
    assert torch.equal(default, apply_rotary(x, cos, sin, positions=positions, numerics="exact"))
    assert_matches_reference(default, x, cos, sin, positions.numpy(), interleaved=False)
    peer = apply_rotary(x, cos, sin, positions=positions, numerics="hf")
    assert not torch.equal(peer, default)  # the modes differ in 16-bit dtypes: the tests above can fail
    exact_error = (default.double() - ref_rotation(x, cos, sin, positions)).abs().sum()
    peer_error = (peer.double() - ref_rotation(x, cos, sin, positions)).abs().sum()
    assert exact_error < peer_error  # one rounding is the closer to the exact rotation


def ref_rotation(x, cos, sin, positions):
    return reference_rotation(x, cos, sin, positions.numpy(), interleaved=False)


@pytest.mark.parametrize("numerics", ["HF", "", None, 1, "fast"])
def test_numerics_other_than_the_three_modes_is_a_value_error_naming_it(numerics):
    x, cos, sin, _ = _peer_case(torch.float32, 16)
    with pytest.raises(ValueError, match=r"numerics: expected 'exact' .*'hf' .*'vllm'.*, got"):
        apply_rotary(x, cos, sin, numerics=numerics)
    with pytest.raises(ValueError, match="numerics: expected"):
        rows = torch.zeros(BATCH, SEQ, dtype=torch.long)
        apply_rotary_qk(x, x, cos, sin, positions=rows, numerics=numerics)


@pytest.mark.parametrize("numerics", ["hf", "vllm"])
def test_triton_refuses_a_numerics_mode_it_does_not_compute_naming_the_backends_that_do(numerics):
    x, cos, sin, _ = _peer_case(torch.bfloat16, 16)
    with pytest.raises(ValueError, match=rf"backend: 'triton' cannot serve numerics='{numerics}'.*'torch'"):
        apply_rotary(x, cos, sin, numerics=numerics, backend="triton")


@pytest.mark.parametrize("numerics", ["hf", "vllm"])
def test_a_numerics_mode_rotation_has_the_peers_gradient(numerics):
    x, cos, sin, positions = _peer_case(torch.bfloat16, 10)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(x.dtype)
    mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    apply_rotary(mine, cos, sin, positions=positions, numerics=numerics).backward(grad)
    PEER_ROTATIONS[numerics](theirs, cos, sin, positions, interleaved=False).backward(grad)
    assert torch.equal(mine.grad, theirs.grad)
