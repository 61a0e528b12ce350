"""RotaryEmbedding: layouts, one-tensor and in-place calls, argument checks, torch.compile.

Its table policy is tested in test_table_cache.py."""

from __future__ import annotations

import copy
import inspect
import pickle

import numpy as np
import pytest
import torch
from torch import nn

from call_count import ropekit_calls
from ropekit import RopeConfig, RotaryEmbedding, apply_rotary, apply_rotary_qk
from ropekit.backends.plan import clear_plans
from ropekit.functional import apply_resolved

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


# inverse= and rotary_position= reach the kernels through functional.apply_resolved (the boundary branch adds
# both keywords there); until it has them these tests skip, and run by themselves once it does.
_APPLY_TAKES_FLAGS = {"inverse", "rotary_position"} <= set(inspect.signature(apply_resolved).parameters)
needs_flags = pytest.mark.skipif(
    not _APPLY_TAKES_FLAGS, reason="functional.apply_resolved has no inverse / rotary_position keywords yet"
)


@needs_flags
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "thd"])
def test_inverse_undoes_the_rotation(layout):
    g = torch.Generator().manual_seed(8)
    shape = (7, 3, HEAD_DIM) if layout == "thd" else (2, 5, 3, HEAD_DIM)
    q, k = (
        torch.randn(shape, generator=g, dtype=torch.float64),
        torch.randn(shape, generator=g, dtype=torch.float64),
    )
    kw = {"cu_seqlens": torch.tensor([0, 3, 7])} if layout == "thd" else {"offsets": 11}
    rope = RotaryEmbedding(head_dim=HEAD_DIM, layout=layout)
    rotated = rope(q, k, **kw)
    back = rope(*rotated, inverse=True, **kw)
    for got, want, r in zip(back, (q, k), rotated, strict=True):
        assert not torch.allclose(r, want)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@needs_flags
def test_inverse_is_the_rotation_by_negative_angles():
    from ropekit import reference as ref

    x = torch.randn(1, 4, 2, HEAD_DIM, dtype=torch.float64)
    got = RotaryEmbedding(head_dim=HEAD_DIM)(x, offsets=3, inverse=True)
    positions = np.arange(3, 7)[None, :, None]  # (B, S, 1)
    want = ref.rotate_half(x.numpy(), -positions, ref.inv_freq(HEAD_DIM, 10000.0))
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-12)


@needs_flags
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_position_last_rotates_the_trailing_features_and_keeps_the_leading_ones(interleaved):
    """A rope part appended after the position-free part of each head (DeepSeek's MLA layout)."""
    rotary = 4
    x = torch.randn(2, 5, 3, HEAD_DIM, dtype=torch.float64)
    rope = RotaryEmbedding(
        head_dim=HEAD_DIM, rotary_dim=rotary, interleaved=interleaved, rotary_position="last"
    )
    got = rope(x, offsets=2)
    whole = RotaryEmbedding(head_dim=rotary, interleaved=interleaved)(
        x[..., -rotary:].contiguous(), offsets=2
    )
    assert torch.equal(got[..., :-rotary], x[..., :-rotary])
    torch.testing.assert_close(got[..., -rotary:], whole, rtol=0, atol=1e-12)


def test_inverse_must_be_a_bool():
    x = torch.randn(1, 2, 1, HEAD_DIM)
    with pytest.raises(ValueError, match=r"^inverse: expected a bool, got 1"):
        RotaryEmbedding(head_dim=HEAD_DIM)(x, inverse=1)


def test_rotary_position_must_be_first_or_last():
    with pytest.raises(
        ValueError, match=r"^rotary_position: expected one of \('first', 'last'\), got 'middle'"
    ):
        RotaryEmbedding(head_dim=HEAD_DIM, rotary_position="middle")
    assert RopeConfig(HEAD_DIM).rotary_position == "first"


def _decode_step(batch: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, 1, 4, 16, generator=g), torch.randn(batch, 1, 2, 16, generator=g)


@pytest.mark.c_compiler
@pytest.mark.parametrize("inplace", [False, True])
def test_per_sequence_offsets_take_the_launch_plan_and_equal_the_functional_call(inplace):
    """Issue 25: a decode step with one offset per sequence (a tensor) was resolved, looked up and checked in
    full on every call; now the second call of a kind is the plan (no resolve) and gives the same answer."""
    rope = RotaryEmbedding(head_dim=16)
    q, k = _decode_step()
    offsets = torch.tensor([5, 0, 900])
    want = apply_rotary_qk(q, k, rope.cos, rope.sin, offsets=offsets)
    qi, ki = q.clone(), k.clone()
    rope(qi, ki, offsets=offsets, inplace=inplace)  # checked in full; plans the next call

    def step():
        return rope(qi, ki, offsets=offsets, inplace=inplace) if inplace else rope(q, k, offsets=offsets)

    qi.copy_(q), ki.copy_(k)
    calls = ropekit_calls(step)
    assert "resolve" not in calls and "lookup" not in calls and "run" in calls, calls
    qi.copy_(q), ki.copy_(k)
    got = step()
    assert (got[0] is qi and got[1] is ki) if inplace else True
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("inplace", [False, True])
def test_an_int_offset_decode_step_is_served_by_the_modules_own_plan(inplace):
    """Issue 25: the module's steady step is one lookup in its own gate and the plan's run: nothing resolved,
    no table lookup, and no second lookup through the functional call's gate."""
    rope = RotaryEmbedding(head_dim=16)
    q, k = _decode_step()
    want = apply_rotary_qk(q, k, rope.cos, rope.sin, offsets=7)
    rope(q.clone(), k.clone(), offsets=3, inplace=inplace)  # checked in full; plans the next call

    def step():
        return rope(q.clone(), k.clone(), offsets=7, inplace=inplace)

    calls = ropekit_calls(step)
    assert "resolve" not in calls and "apply_resolved" not in calls and "run" in calls, calls
    got = step()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_per_sequence_offsets_past_the_table_grow_it_and_rotate_by_the_right_rows(assert_matches_reference):
    """The planned C loop checks every row against the table before it writes: a row the 2048-row table
    does not hold misses the plan, the checked path grows the table, and the rows are the right ones."""
    rope = RotaryEmbedding(head_dim=16)
    q, k = _decode_step()
    rope(q, k, offsets=torch.tensor([1, 2, 3]))
    rope(q, k, offsets=torch.tensor([1, 2, 3]))  # planned
    assert rope.cos.shape[0] == 2048
    far = torch.tensor([7, 2047, 5000])
    out_q, out_k = rope(q, k, offsets=far)
    assert rope.cos.shape[0] >= 5001
    cos, sin = rope.config.cos_sin(5001)
    assert_matches_reference(out_q, q, cos, sin, far.numpy()[:, None], interleaved=False)
    assert_matches_reference(out_k, k, cos, sin, far.numpy()[:, None], interleaved=False)


@pytest.mark.parametrize("inplace", [False, True])
def test_negative_per_sequence_offsets_are_a_value_error_on_the_planned_path_too(inplace):
    rope = RotaryEmbedding(head_dim=16)
    q, k = _decode_step()
    rope(q, k, offsets=torch.tensor([1, 2, 3]), inplace=inplace)
    rope(q, k, offsets=torch.tensor([1, 2, 3]), inplace=inplace)  # planned
    before_q, before_k = q.clone(), k.clone()
    with pytest.raises(ValueError, match=r"^offsets: expected values >= 0, got a minimum of -4"):
        rope(q, k, offsets=torch.tensor([1, -4, 3]), inplace=inplace)
    assert torch.equal(q, before_q) and torch.equal(k, before_k)  # nothing written


def test_a_plan_made_elsewhere_for_a_wider_head_never_serves_the_module():
    """The plan key holds shapes, not the module's head_dim: a plan for a 24-wide head rotated partially with
    a table shaped like this module's must not let the module accept that head."""
    rope = RotaryEmbedding(head_dim=16)
    g = torch.Generator().manual_seed(2)
    wide_q, wide_k = torch.randn(1, 1, 4, 24, generator=g), torch.randn(1, 1, 2, 24, generator=g)
    cos, sin = rope.cos.clone(), rope.sin.clone()  # another table of the module's shape
    for _ in range(2):  # planned for the wide head
        apply_rotary_qk(wide_q, wide_k, cos, sin, offsets=3)
    with pytest.raises(
        ValueError, match=r"^q: expected head_dim 16 \(this RotaryEmbedding's config\), got 24"
    ):
        rope(wide_q, wide_k, offsets=3)


# Issue 25, one gate for every layout: bhsd / sbhd keys hold the caller's tensors (views of bshd), thd's hold
# cu_seqlens; each form's planned call must be the checked path's answer, bit for bit, strides included.
PLAN_LAYOUTS = ["bshd", "bhsd", "sbhd", "thd"]
PACKED_LENS = [1, 2, 3]  # thd: three sequences, T = 6


def _layout_step(layout: str, *, qkv: bool = False, dtype=torch.float32, seed: int = 3):
    """q, k in the layout's shape, the keyword arguments it needs, and the (B, S) or (T,) view back:
    ``bshd(out)`` is out as (B, S, H, D), or (T, H, D) for thd. With qkv, q and k are slices of one buffer
    (not dense: empty_like lays their outputs out otherwise than their views')."""
    g = torch.Generator().manual_seed(seed)
    if layout == "thd":
        total = sum(PACKED_LENS)
        both = torch.randn(total, 6, 16, generator=g).to(dtype)  # (T, Hq + Hk, D)
        cu = torch.tensor(np.cumsum([0, *PACKED_LENS]))
        return both[:, :4], both[:, 4:], {"cu_seqlens": cu}, lambda t: t
    axes = {"bshd": (3, 1, 6, 16), "bhsd": (3, 6, 1, 16), "sbhd": (1, 3, 6, 16)}[layout]
    both = torch.randn(*axes, generator=g).to(dtype)  # the heads axis holds q's 4 heads, then k's 2
    head_axis = 1 if layout == "bhsd" else 2
    q, k = both.split([4, 2], dim=head_axis)
    if not qkv:
        q, k = q.contiguous(), k.contiguous()
    swap = {"bhsd": (1, 2), "sbhd": (0, 1)}.get(layout)
    return q, k, {}, (lambda t: t) if swap is None else (lambda t: t.transpose(*swap))


def _positions(layout: str, offsets) -> np.ndarray:
    """Each token's table row, in the (B, S) or (T,) order of the layout's bshd / thd view."""
    if layout == "thd":
        starts = [offsets] * 3 if isinstance(offsets, int) else offsets.tolist()
        return np.concatenate([np.arange(n) + s for n, s in zip(PACKED_LENS, starts, strict=True)])
    starts = [offsets] * 3 if isinstance(offsets, int) else offsets.tolist()
    return np.array(starts)[:, None]  # (B, 1): one token each


def _offsets(form: str):
    return 7 if form == "int" else torch.tensor([5, 0, 900])


def _call(rope, q, k, kwargs, offsets, inplace, pair):
    """One module call on fresh copies (in place) or on q and k themselves; returns (outputs, inputs)."""
    if inplace:
        q, k = q.clone(), k.clone()
    out = rope(q, k if pair else None, offsets=offsets, inplace=inplace, **kwargs)
    return (out if pair else (out,)), (q, k)


@pytest.mark.c_compiler
@pytest.mark.parametrize("pair", [True, False], ids=["qk", "q-alone"])
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("form", ["int", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", PLAN_LAYOUTS)
def test_every_layout_and_offset_form_is_planned_and_equals_the_checked_path(
    assert_matches_reference, layout, dtype, form, inplace, pair
):
    """The second call of a kind is the module's gate and the plan's run (nothing resolved, no table
    lookup, no checked path), and returns what the checked path returned: the same values bit for bit, the
    same strides out of place, the caller's own tensors in place; both equal the float64 reference."""
    rope = RotaryEmbedding(head_dim=16, layout=layout)
    q, k, kwargs, bshd = _layout_step(layout, dtype=dtype)
    offsets = _offsets(form)
    clear_plans()
    want, _ = _call(rope, q, k, kwargs, offsets, inplace, pair)  # the checked path; plans the next call
    calls = ropekit_calls(lambda: _call(rope, q, k, kwargs, offsets, inplace, pair))
    assert "run" in calls and not {"resolve", "lookup", "apply_resolved"} & set(calls), calls
    got, given = _call(rope, q, k, kwargs, offsets, inplace, pair)
    cos, sin = rope.config.cos_sin(1024)
    for out, w, x, src in zip(got, want, given, (q, k), strict=False):
        assert torch.equal(out, w) and out.stride() == w.stride() and out.shape == src.shape
        if inplace:
            assert out is x
        assert_matches_reference(
            bshd(out), bshd(src), cos, sin, _positions(layout, offsets), interleaved=False
        )


@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("layout", ["bhsd", "sbhd", "thd"])
def test_slices_of_one_qkv_buffer_are_planned_with_the_checked_paths_strides(layout, inplace):
    """q and k sliced from one buffer are not dense: their outputs are laid out as the checked path lays
    them out (through the views), and in place the buffer's other bytes stay as they were."""
    rope = RotaryEmbedding(head_dim=16, layout=layout)
    q, k, kwargs, _ = _layout_step(layout, qkv=True)
    clear_plans()
    want, _ = _call(rope, q, k, kwargs, 7, inplace, True)
    got, given = _call(rope, q, k, kwargs, 7, inplace, True)  # planned
    for out, w, x in zip(got, want, given, strict=True):
        assert torch.equal(out, w) and out.stride() == w.stride()
        if inplace:
            assert out is x


@pytest.mark.parametrize("form", ["int", "tensor"])
@pytest.mark.parametrize("layout", PLAN_LAYOUTS)
def test_a_row_past_the_table_on_the_planned_path_grows_it_as_the_checked_path(
    assert_matches_reference, layout, form
):
    """The module's table grows where the functional call would raise: a planned module given a row past
    its 2048 rows (thd: a packed int offset whose last rows leave the table, though its first fits) serves
    it through the checked path, grows the table to the length a fresh module reaches, and rotates by the
    right rows."""
    q, k, kwargs, bshd = _layout_step(layout)
    planned = RotaryEmbedding(head_dim=16, layout=layout)
    for _ in range(2):
        planned(q, k, offsets=_offsets(form), **kwargs)
    far = 2046 if form == "int" else torch.tensor([7, 2047, 5000])  # thd int: rows 2046 .. 2048
    if layout != "thd" and form == "int":
        far = 2048
    got = planned(q, k, offsets=far, **kwargs)
    fresh = RotaryEmbedding(head_dim=16, layout=layout)
    want = fresh(q, k, offsets=far, **kwargs)
    assert planned.cos.shape[0] == fresh.cos.shape[0] > 2048
    cos, sin = rope_tables = planned.config.cos_sin(planned.cos.shape[0])
    assert rope_tables and torch.equal(planned.cos, fresh.cos)
    for out, w, src in zip(got, want, (q, k), strict=True):
        assert torch.equal(out, w)
        assert_matches_reference(bshd(out), bshd(src), cos, sin, _positions(layout, far), interleaved=False)


def test_a_table_grown_by_one_module_never_lends_its_length_to_another_modules_plan():
    """A call whose rows grew the table was looked up under the old table's shape: a plan kept under that
    key with the grown table's length would let a module with a table of the old shape read past its rows.
    Only a call served by the table its key holds plans the next one."""
    q, k, _, _ = _layout_step("bshd")
    grown, short = RotaryEmbedding(head_dim=16), RotaryEmbedding(head_dim=16)
    grown(q, k, offsets=torch.tensor([1, 2, 5000]))  # grows grown's table past 5000 rows
    far = torch.tensor([3, 4000, 6])
    out_q, out_k = short(q, k, offsets=far)  # short's table: 2048 rows, then grown for row 4000
    assert short.cos.shape[0] > 4000  # served by the checked path, not by a plan that read past 2048 rows
    want_q, want_k = apply_rotary_qk(q, k, *short.config.cos_sin(4001), offsets=far)
    assert torch.equal(out_q, want_q) and torch.equal(out_k, want_k)


@pytest.mark.parametrize("layout", PLAN_LAYOUTS)
def test_a_modules_plan_never_serves_another_head_dim_or_layout(layout):
    """Keys hold shapes, not the module's head_dim or layout: a plan proved for a 24-wide head (a table of
    the same shape: rotary_dim 16) must not let a 16-wide module accept that head."""
    g = torch.Generator().manual_seed(4)
    shape = {"bshd": (3, 1, -1, 24), "bhsd": (3, -1, 1, 24), "sbhd": (1, 3, -1, 24), "thd": (6, -1, 24)}[
        layout
    ]
    q = torch.randn(*(4 if n == -1 else n for n in shape), generator=g)  # heads at the -1
    k = torch.randn(*(2 if n == -1 else n for n in shape), generator=g)
    kwargs = {"cu_seqlens": torch.tensor([0, 1, 3, 6])} if layout == "thd" else {}
    wide = RotaryEmbedding(head_dim=24, rotary_dim=16, layout=layout)
    for _ in range(2):
        wide(q, k, offsets=3, **kwargs)  # planned for the wide head
    narrow = RotaryEmbedding(head_dim=16, layout=layout)
    with pytest.raises(
        ValueError, match=r"^q: expected head_dim 16 \(this RotaryEmbedding's config\), got 24"
    ):
        narrow(q, k, offsets=3, **kwargs)


@pytest.mark.parametrize(
    ("layout", "bad", "message"),
    [
        ("bhsd", {"offsets": -1}, r"^offsets: expected"),
        (
            "sbhd",
            {"offsets": torch.tensor([1, -4, 3])},
            r"^offsets: expected values >= 0, got a minimum of -4",
        ),
        (
            "thd",
            {"offsets": torch.tensor([1, -4, 3])},
            r"^offsets: expected values >= 0, got a minimum of -4",
        ),
        ("thd", {"offsets": -2}, r"^offsets: expected"),
        ("thd", {"offsets": torch.tensor([1, 2])}, r"^offsets: expected"),
        ("thd", {"cu_seqlens": torch.tensor([0, 1, 3, 5])}, r"^cu_seqlens: expected"),
    ],
)
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
def test_errors_on_the_planned_path_are_the_checked_paths_and_write_nothing(layout, bad, message, inplace):
    rope = RotaryEmbedding(head_dim=16, layout=layout)
    q, k, kwargs, _ = _layout_step(layout)
    clear_plans()
    messages = []
    for _ in range(2):  # unplanned, then planned
        rope(q.clone(), k.clone(), offsets=torch.tensor([1, 2, 3]), inplace=inplace, **kwargs)
        rope(q.clone(), k.clone(), offsets=5, inplace=inplace, **kwargs)
        qi, ki = q.clone(), k.clone()
        with pytest.raises(ValueError, match=message) as error:
            rope(qi, ki, **{"offsets": 0, **kwargs, **bad}, inplace=inplace)
        assert torch.equal(qi, q) and torch.equal(ki, k)  # nothing written
        messages.append(str(error.value))
        clear_plans()
    assert messages[0] == messages[1]


@pytest.mark.c_compiler
@pytest.mark.parametrize("form", ["int", "tensor", "positions"])
def test_a_steady_step_of_every_layout_takes_no_more_ropekit_calls_than_bshd_plus_two(form):
    counts = {}
    for layout in PLAN_LAYOUTS:
        rope = RotaryEmbedding(head_dim=16, layout=layout)
        q, k, kwargs, _ = _layout_step(layout)
        positions = _explicit_positions(layout)
        rows = {"positions": positions} if form == "positions" else {"offsets": _offsets(form)}
        rope(q, k, **rows, **kwargs)
        counts[layout] = len(ropekit_calls(lambda: rope(q, k, **rows, **kwargs)))  # noqa: B023
    assert all(counts[layout] <= counts["bshd"] + 2 for layout in PLAN_LAYOUTS), counts
    assert counts["bshd"] <= 5, counts


@pytest.mark.c_compiler
@pytest.mark.parametrize("form", ["offsets", "positions"])
def test_a_pickled_or_copied_module_rotates_as_the_original_and_is_planned(form):
    """The gates are made per process, outside the module (a function made at run time cannot be pickled):
    a module unpickled or deep-copied keeps rotating the same, and its steady step (an int offset, or
    explicit positions: each its own gate) is planned."""
    rope = RotaryEmbedding(head_dim=16, layout="bhsd")
    q, k, _, _ = _layout_step("bhsd")
    rows = {"offsets": 7} if form == "offsets" else {"positions": _explicit_positions("bhsd")}
    want = rope(q, k, **rows)
    for other in (pickle.loads(pickle.dumps(rope)), copy.deepcopy(rope)):
        other(q, k, **rows)
        calls = ropekit_calls(lambda: other(q, k, **rows))  # noqa: B023
        assert "run" in calls and "resolve" not in calls, calls
        got = other(q, k, **rows)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("layout", ["bhsd", "sbhd"])
def test_a_backend_whose_plan_reads_shapes_runs_on_views_of_the_callers_tensors(
    assert_matches_reference, layout, dtype, inplace
):
    """The torch backend's plan (rotate_qk with the flags bound) reads its tensors' shapes and strides: the
    run hands it (B, S, H, D) views made per call and returns what the checked path returns."""
    rope = RotaryEmbedding(head_dim=16, layout=layout, backend="torch")
    q, k, kwargs, bshd = _layout_step(layout, dtype=dtype)
    rope(q, k, offsets=7)  # float64: the table is rebuilt in float64 (a call that changes it plans nothing)
    clear_plans()
    want, _ = _call(rope, q, k, kwargs, 7, inplace, True)
    calls = ropekit_calls(lambda: _call(rope, q, k, kwargs, 7, inplace, True))
    assert "through_views" in calls and "resolve" not in calls, calls
    got, given = _call(rope, q, k, kwargs, 7, inplace, True)
    cos, sin = rope.config.cos_sin(64, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    for out, w, x, src in zip(got, want, given, (q, k), strict=True):
        assert torch.equal(out, w) and out.stride() == w.stride()
        assert out is x if inplace else out.shape == src.shape
        assert_matches_reference(bshd(out), bshd(src), cos, sin, _positions(layout, 7), interleaved=False)


# Explicit positions (torchtune-style callers pass them every step): the module's own positions gate, one per
# (layout, head_dim), serves a call whose rows its table holds; any other takes the checked path as before.
def _explicit_positions(layout: str) -> torch.Tensor:
    """(B, S) = (3, 1) rows for the 4-D layouts' decode step, (T,) = (6,) for thd's packed batch."""
    return torch.tensor([3, 0, 1, 900, 7, 2]) if layout == "thd" else torch.tensor([[5], [0], [900]])


def _call_positions(rope, q, k, kwargs, positions, inplace, pair):
    """_call with explicit positions (the offset its default, 0)."""
    return _call(rope, q, k, {**kwargs, "positions": positions}, 0, inplace, pair)


@pytest.mark.c_compiler
@pytest.mark.parametrize("pair", [True, False], ids=["qk", "q-alone"])
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", PLAN_LAYOUTS)
def test_explicit_positions_are_planned_in_every_layout_and_equal_the_checked_path(
    assert_matches_reference, layout, dtype, inplace, pair
):
    """The second call with positions of a kind is the module's positions gate and the plan's run (nothing
    resolved, no table lookup), and returns what the checked path and the functional call return: the same
    values bit for bit, the same strides out of place, the caller's own tensors in place."""
    rope = RotaryEmbedding(head_dim=16, layout=layout)
    q, k, kwargs, bshd = _layout_step(layout, dtype=dtype)
    positions = _explicit_positions(layout)
    clear_plans()
    want, _ = _call_positions(rope, q, k, kwargs, positions, inplace, pair)  # checked; plans the next call
    calls = ropekit_calls(lambda: _call_positions(rope, q, k, kwargs, positions, inplace, pair))
    assert "run" in calls and not {"resolve", "lookup", "apply_resolved"} & set(calls), calls
    got, given = _call_positions(rope, q, k, kwargs, positions, inplace, pair)
    views = (bshd(q), bshd(k))
    functional = apply_rotary_qk(*views, rope.cos, rope.sin, positions=positions, **kwargs)
    cos, sin = rope.config.cos_sin(1024)
    rows = positions.numpy()  # (B, S) or (T,)
    for out, w, f, x, src in zip(got, want, functional, given, (q, k), strict=False):
        assert torch.equal(out, w) and out.stride() == w.stride() and out.shape == src.shape
        assert torch.equal(bshd(out), f)
        if inplace:
            assert out is x
        assert_matches_reference(bshd(out), bshd(src), cos, sin, rows, interleaved=False)


@pytest.mark.c_compiler
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("layout", ["bhsd", "sbhd", "thd"])
def test_explicit_positions_with_slices_of_one_qkv_buffer_are_planned_with_the_checked_paths_strides(
    layout, inplace
):
    rope = RotaryEmbedding(head_dim=16, layout=layout)
    q, k, kwargs, _ = _layout_step(layout, qkv=True)
    positions = _explicit_positions(layout)
    clear_plans()
    want, _ = _call_positions(rope, q, k, kwargs, positions, inplace, True)
    calls = ropekit_calls(lambda: _call_positions(rope, q, k, kwargs, positions, inplace, True))
    assert "run" in calls and "resolve" not in calls, calls
    got, given = _call_positions(rope, q, k, kwargs, positions, inplace, True)
    for out, w, x in zip(got, want, given, strict=True):
        assert torch.equal(out, w) and out.stride() == w.stride()
        if inplace:
            assert out is x


@pytest.mark.c_compiler
@pytest.mark.parametrize("layout", PLAN_LAYOUTS)
def test_explicit_positions_past_the_table_on_the_planned_path_grow_it_as_the_checked_path(
    assert_matches_reference, layout
):
    """A planned module given a position its 2048 rows do not hold misses the plan (the C loop checks every
    row before it writes), grows the table to the length a fresh module reaches, rotates by the right rows;
    later calls with such rows are planned under the grown table's key and agree."""
    q, k, kwargs, bshd = _layout_step(layout)
    planned = RotaryEmbedding(head_dim=16, layout=layout)
    for _ in range(2):
        planned(q, k, positions=_explicit_positions(layout), **kwargs)
    far = torch.tensor([3, 0, 1, 5000, 7, 2047]) if layout == "thd" else torch.tensor([[7], [2047], [5000]])
    got = planned(q, k, positions=far, **kwargs)
    fresh = RotaryEmbedding(head_dim=16, layout=layout)
    want = fresh(q, k, positions=far, **kwargs)
    assert planned.cos.shape[0] == fresh.cos.shape[0] > 5000
    cos, sin = planned.config.cos_sin(planned.cos.shape[0])
    assert torch.equal(planned.cos, cos)
    rows = far.numpy()
    for out, w, src in zip(got, want, (q, k), strict=True):
        assert torch.equal(out, w)
        assert_matches_reference(bshd(out), bshd(src), cos, sin, rows, interleaved=False)
    planned(q, k, positions=far, **kwargs)  # the grown table's key: checked, plans the next call
    calls = ropekit_calls(lambda: planned(q, k, positions=far, **kwargs))  # planned on the grown table
    assert "run" in calls and "resolve" not in calls, calls
    again = planned(q, k, positions=far, **kwargs)
    assert torch.equal(again[0], got[0]) and torch.equal(again[1], got[1])


@pytest.mark.parametrize("layout", PLAN_LAYOUTS)
def test_a_table_grown_by_positions_never_lends_its_length_to_another_modules_plan(layout):
    """A call whose positions grew the table was looked up under the old table's shape: a plan kept under
    that key (with the grown table's length) would let a module whose table has the old shape read past its
    rows. Only a call served by the table its key holds plans the next one."""
    q, k, kwargs, _ = _layout_step(layout)
    grown, short = RotaryEmbedding(head_dim=16, layout=layout), RotaryEmbedding(head_dim=16, layout=layout)
    clear_plans()
    if layout == "thd":
        first, far = torch.tensor([1, 2, 5000, 3, 4, 5]), torch.tensor([3, 4000, 6, 0, 1, 2])
    else:
        first, far = torch.tensor([[1], [2], [5000]]), torch.tensor([[3], [4000], [6]])
    grown(q, k, positions=first, **kwargs)  # grows grown's table past 5000 rows
    out_q, out_k = short(q, k, positions=far, **kwargs)  # short's table: 2048 rows, then grown for row 4000
    assert short.cos.shape[0] > 4000  # served by the checked path, not by a plan that read past 2048 rows
    swap = {"bhsd": (1, 2), "sbhd": (0, 1)}.get(layout)
    view = (lambda t: t) if swap is None else (lambda t: t.transpose(*swap))
    want_q, want_k = apply_rotary_qk(view(q), view(k), *short.config.cos_sin(4001), positions=far, **kwargs)
    assert torch.equal(view(out_q), want_q) and torch.equal(view(out_k), want_k)


@pytest.mark.parametrize("layout", PLAN_LAYOUTS)
def test_a_positions_plan_never_serves_another_head_dim_or_layout(layout):
    """A positions plan proved for a 24-wide head (rotary_dim 16: a table of the same shape) must not let a
    16-wide module accept that head; another layout's module never reaches it either (its own gate)."""
    g = torch.Generator().manual_seed(4)
    shape = {"bshd": (3, 1, -1, 24), "bhsd": (3, -1, 1, 24), "sbhd": (1, 3, -1, 24), "thd": (6, -1, 24)}[
        layout
    ]
    q = torch.randn(*(4 if n == -1 else n for n in shape), generator=g)  # heads at the -1
    k = torch.randn(*(2 if n == -1 else n for n in shape), generator=g)
    kwargs = {"cu_seqlens": torch.tensor([0, 1, 3, 6])} if layout == "thd" else {}
    positions = _explicit_positions(layout)
    wide = RotaryEmbedding(head_dim=24, rotary_dim=16, layout=layout)
    for _ in range(2):
        wide(q, k, positions=positions, **kwargs)  # planned for the wide head
    narrow = RotaryEmbedding(head_dim=16, layout=layout)
    with pytest.raises(
        ValueError, match=r"^q: expected head_dim 16 \(this RotaryEmbedding's config\), got 24"
    ):
        narrow(q, k, positions=positions, **kwargs)


@pytest.mark.parametrize("call", ["positions", "offsets"])
def test_device_rows_reach_the_modules_gate_only_once_the_table_covers_its_context(call):
    """The gate's rule for rows the host does not read (a device's; here the meta device, whose tensors have
    no values and are never planned): a module whose table does not yet cover its max_position_embeddings
    grows it on the checked path before any plan may serve it, since a plan made for a table of the same
    shape by a shorter-context module would otherwise run with rows past this table (the CUDA tests below
    check the rotation itself). A spy in place of the gate's launch records whether the gate admitted."""
    module = RotaryEmbedding(head_dim=16, max_position_embeddings=8192).to("meta")
    admitted = []

    def spy(*args, **kwargs):
        admitted.append(args[4])  # the rows it was asked to serve
        return None, None  # declined: the checked path below serves the call

    module._launch_positions = module._launch = spy
    q, k = torch.empty(3, 1, 4, 16, device="meta"), torch.empty(3, 1, 2, 16, device="meta")
    rows = torch.empty(3, 1, dtype=torch.int64, device="meta") if call == "positions" else None
    kwargs = (
        {"positions": rows}
        if call == "positions"
        else {"offsets": torch.empty(3, dtype=torch.int64, device="meta")}
    )
    assert module.cos.shape[0] == 2048
    module(q, k, **kwargs)
    assert admitted == [] and module.cos.shape[0] == 8192  # grown on the checked path, the gate passed by
    module(q, k, **kwargs)
    assert len(admitted) == 1  # the table covers the context: the gate may serve device rows now


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none in this environment)")
def test_device_positions_are_planned_only_once_the_table_covers_the_modules_context():
    """Device positions are checked in the kernel (no host check that could miss the plan): a module whose
    table does not yet cover its max_position_embeddings must grow it on the checked path, never run a plan
    made by a module of a shorter context whose table has the same shape."""
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(3, 1, 4, 16, generator=g).cuda(), torch.randn(3, 1, 2, 16, generator=g).cuda()
    near, far = torch.tensor([[5], [0], [900]]).cuda(), torch.tensor([[5], [3000], [900]]).cuda()
    short = RotaryEmbedding(head_dim=16, max_position_embeddings=2048).cuda()
    for _ in range(3):
        short(q, k, positions=near)  # planned: a 2048-row table on the device
    long = RotaryEmbedding(head_dim=16, max_position_embeddings=8192).cuda()  # 2048 rows, then 8192
    got = long(q, k, positions=far)
    assert long.cos.shape[0] == 8192
    want = apply_rotary_qk(q, k, long.cos, long.sin, positions=far)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for _ in range(2):
        got = long(q, k, positions=far)  # planned on its own 8192-row table
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none in this environment)")
def test_device_offsets_are_planned_only_once_the_table_covers_the_modules_context():
    """Per-sequence offsets on a device, as positions above: a module of a longer context grows its table on
    the checked path instead of running a plan made by a module whose table has the same shape."""
    g = torch.Generator().manual_seed(8)
    q, k = torch.randn(3, 1, 4, 16, generator=g).cuda(), torch.randn(3, 1, 2, 16, generator=g).cuda()
    near, far = torch.tensor([5, 0, 900]).cuda(), torch.tensor([5, 3000, 900]).cuda()
    short = RotaryEmbedding(head_dim=16, max_position_embeddings=2048).cuda()
    for _ in range(3):
        short(q, k, offsets=near)  # planned: a 2048-row table on the device
    long = RotaryEmbedding(head_dim=16, max_position_embeddings=8192).cuda()
    got = long(q, k, offsets=far)
    assert long.cos.shape[0] == 8192
    want = apply_rotary_qk(q, k, long.cos, long.sin, offsets=far)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_positions_plans_of_two_modules_with_other_tables_are_their_own():
    """Two modules of one head_dim and layout whose tables differ (base): each call rotates by its own
    module's table, never through a plan made with the other's."""
    q, k, _, _ = _layout_step("bshd")
    positions = _explicit_positions("bshd")
    one, other = RotaryEmbedding(head_dim=16), RotaryEmbedding(head_dim=16, base=500.0)
    for _ in range(3):
        got_one, got_other = one(q, k, positions=positions), other(q, k, positions=positions)
    want_one = apply_rotary_qk(q, k, one.cos, one.sin, positions=positions)
    want_other = apply_rotary_qk(q, k, other.cos, other.sin, positions=positions)
    assert torch.equal(got_one[0], want_one[0]) and torch.equal(got_one[1], want_one[1])
    assert torch.equal(got_other[0], want_other[0]) and torch.equal(got_other[1], want_other[1])
    assert not torch.equal(got_one[0], got_other[0])


def test_packed_positions_never_take_a_plan_made_for_per_sequence_offsets_of_the_same_shape():
    """A packed batch's (T,) positions and its (N,) per-sequence offsets are both 1-D int64: with T == N a
    plan proved for the offsets must not read positions as offsets (positions: a gate of their own)."""
    rope = RotaryEmbedding(head_dim=16, layout="thd")
    g = torch.Generator().manual_seed(6)
    q, k = torch.randn(3, 4, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    cu = torch.tensor([0, 0, 1, 3])  # N = 3 sequences (lengths 0, 1, 2), T = 3 tokens
    values = torch.tensor([5, 6, 7])
    for _ in range(2):
        rope(q, k, offsets=values, cu_seqlens=cu)  # planned: rows 6, 7, 8
    got = rope(q, k, positions=values, cu_seqlens=cu)  # rows 5, 6, 7
    want = apply_rotary_qk(q, k, rope.cos, rope.sin, positions=values, cu_seqlens=cu)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    got = rope(q, k, positions=values, cu_seqlens=cu)  # planned by its own gate
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize(
    ("layout", "bad", "message"),
    [
        (
            "bshd",
            {"positions": torch.tensor([[1], [-4], [3]])},
            r"^positions: expected values >= 0, got a minim",
        ),
        (
            "bhsd",
            {"positions": torch.tensor([[1], [-4], [3]])},
            r"^positions: expected values >= 0, got a minim",
        ),
        (
            "sbhd",
            {"positions": torch.tensor([[1, 2], [3, 4], [5, 6]])},
            r"^positions: expected shape \(batch, seq",
        ),
        (
            "bshd",
            {"positions": torch.tensor([[1], [2], [3]]).t()},
            r"^positions: expected shape \(batch, seq",
        ),
        (
            "bshd",
            {"positions": torch.tensor([[1.0], [2.0], [3.0]])},
            r"^positions: expected an integer tensor",
        ),
        ("bshd", {"positions": torch.tensor([[True], [False], [True]])}, r"^positions: expected an integer"),
        ("bshd", {"positions": torch.tensor([[1], [2], [3]]), "offsets": 2}, r"^offsets: expected 0 when"),
        ("thd", {"positions": torch.tensor([1, -2, 3, 4, 5, 6])}, r"^positions: expected values >= 0"),
        (
            "thd",
            {"positions": torch.tensor([1, 2, 3, 4, 5])},
            r"^positions: expected shape \(total_tokens,\)",
        ),
        (
            "thd",
            {"positions": torch.arange(6), "cu_seqlens": torch.tensor([0, 1, 3, 5])},
            r"^cu_seqlens: expected",
        ),
    ],
)
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
def test_errors_of_explicit_positions_on_the_planned_path_are_the_checked_paths_and_write_nothing(
    layout, bad, message, inplace
):
    rope = RotaryEmbedding(head_dim=16, layout=layout)
    q, k, kwargs, _ = _layout_step(layout)
    good = _explicit_positions(layout)
    clear_plans()
    messages = []
    for _ in range(2):  # unplanned, then planned
        rope(q.clone(), k.clone(), positions=good, inplace=inplace, **kwargs)
        rope(q.clone(), k.clone(), positions=good, inplace=inplace, **kwargs)
        qi, ki = q.clone(), k.clone()
        with pytest.raises(ValueError, match=message) as error:
            rope(qi, ki, **{**kwargs, **bad}, inplace=inplace)
        assert torch.equal(qi, q) and torch.equal(ki, k)  # nothing written
        messages.append(str(error.value))
        clear_plans()
    assert messages[0] == messages[1]


@pytest.mark.parametrize(
    "build",
    [
        lambda: (RotaryEmbedding(head_dim=16), {"inverse": True}),
        lambda: (RotaryEmbedding(head_dim=16, rotary_dim=8, rotary_position="last"), {}),
        lambda: (
            RotaryEmbedding(RopeConfig(16, 1e4, scaling={"type": "mrope", "mrope_section": [2, 3, 3]})),
            {},
        ),
        lambda: (
            RotaryEmbedding(
                head_dim=16, max_position_embeddings=1024, scaling={"type": "dynamic", "factor": 2.0}
            ),
            {},
        ),
    ],
    ids=["inverse", "rotary-last", "mrope", "length-dependent"],
)
def test_explicit_positions_that_a_plan_must_not_serve_stay_on_the_checked_path(build):
    rope, flags = build()
    q, k, _, _ = _layout_step("bshd")
    positions = _explicit_positions("bshd")
    want = rope(q, k, positions=positions, **flags)
    calls = ropekit_calls(lambda: rope(q, k, positions=positions, **flags))
    assert "resolve" in calls and "run" not in calls, calls
    got = rope(q, k, positions=positions, **flags)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.c_compiler
def test_a_positions_decode_step_takes_at_most_two_ropekit_calls_more_than_an_int_offset_step():
    """Issue: a torchtune-style decode step (positions every step; bshd, B=1, S=1, 32 q / 8 kv heads, head_dim
    128) ran the whole checked path, ~60 ropekit calls; its steady step is now the plan's."""
    rope = RotaryEmbedding(head_dim=128)
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 1, 32, 128, generator=g), torch.randn(1, 1, 8, 128, generator=g)
    positions = torch.tensor([[100]])
    for _ in range(2):
        rope(q, k, positions=positions), rope(q, k, offsets=100)
    with_positions = ropekit_calls(lambda: rope(q, k, positions=positions))
    with_offset = ropekit_calls(lambda: rope(q, k, offsets=100))
    assert "run" in with_positions and "resolve" not in with_positions, with_positions
    assert len(with_positions) <= len(with_offset) + 2, (with_positions, with_offset)
    got, want = rope(q, k, positions=positions), rope(q, k, offsets=100)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


class _ThroughNNModuleCall(RotaryEmbedding):
    """RotaryEmbedding called through nn.Module.__call__ as it is now (a tracer may patch it)."""

    def __call__(self, *args, **kwargs):
        return nn.Module.__call__(self, *args, **kwargs)


def _hooked_calls(cls: type, hooks: str) -> tuple[list, list]:
    """Three calls of a module of cls with the hooks named, (outputs, what the hooks saw)."""
    rope, seen, names = cls(head_dim=16), [], hooks.split()
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 2, 16, generator=g), torch.randn(1, 2, 1, 16, generator=g)
    removers = []
    if "pre" in names:
        rope.register_forward_pre_hook(lambda m, args: seen.append(("pre", len(args))))
    if "kwargs" in names:  # rewrites the call's keywords: forward must see the hook's offsets
        rope.register_forward_pre_hook(
            lambda m, args, kw: seen.append(("kwargs", dict(kw))) or (args, {**kw, "offsets": 5}),
            with_kwargs=True,
        )
    if "post" in names:
        rope.register_forward_hook(lambda m, args, out: (out[0] * 2, out[1]))
    if "global" in names:
        removers.append(nn.modules.module.register_module_forward_hook(lambda m, a, o: seen.append("global")))
    if "global-pre" in names:
        removers.append(nn.modules.module.register_module_forward_pre_hook(lambda m, a: seen.append("gpre")))
    if "backward" in names:
        rope.register_full_backward_hook(lambda m, gi, go: seen.append(("backward", len(gi))))
    if "backward-pre" in names:
        rope.register_full_backward_pre_hook(lambda m, go: seen.append(("backward-pre", len(go))))
    if "global-backward" in names:
        removers.append(
            nn.modules.module.register_module_full_backward_hook(lambda m, gi, go: seen.append("gbackward"))
        )
    if "global-backward-pre" in names:
        removers.append(
            nn.modules.module.register_module_full_backward_pre_hook(
                lambda m, go: seen.append("gbackward-pre")
            )
        )
    if "compile" in names:  # a backend that says when torch.compile hands it a graph

        def backend(graph, inputs):
            seen.append("compiled")
            return graph.forward

        rope.compile(backend=backend)
    outs = []
    try:
        for _ in range(3):  # the first call plans the kind; the others are steady steps
            backward = any(name.startswith(("backward", "global-backward")) for name in names)
            x = q.clone().requires_grad_(backward)
            out = rope(x, k, offsets=1)
            if backward:
                out[0].sum().backward()
            outs.append([t.detach() for t in out])
    finally:
        for remove in removers:
            remove.remove()
    return outs, seen


@pytest.mark.parametrize(
    "hooks",
    [
        "none",
        "pre",
        "kwargs",
        "post",
        "global",
        "global-pre",
        "backward",
        "backward-pre",
        "global-backward",
        "global-backward-pre",
        "compile",
        "pre kwargs post",
    ],
)
def test_a_call_runs_every_hook_and_compiled_call_as_nn_module_call_does(hooks):
    """RotaryEmbedding.__call__ calls forward itself only when nn.Module.__call__ would only call forward:
    module and global hooks, backward hooks and Module.compile() still run, each call, as they did."""
    torch._dynamo.reset()
    got, got_seen = _hooked_calls(RotaryEmbedding, hooks)
    torch._dynamo.reset()
    want, want_seen = _hooked_calls(_ThroughNNModuleCall, hooks)
    assert got_seen == want_seen
    if hooks == "compile":
        assert "compiled" in got_seen
    else:
        assert len(got_seen) == 3 * len(set(hooks.split()) - {"none", "post"})
    for g, w in zip(got, want, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(g, w, strict=True))


def test_fx_and_jit_tracers_still_see_the_module_call():
    """torch.fx patches nn.Module.__call__ while it traces (a leaf module becomes one call_module node); a
    torch.jit trace records the module's scope: both see RotaryEmbedding's calls as before."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.rope = RotaryEmbedding(head_dim=16)

        def forward(self, q, k):
            return self.rope(q, k, offsets=3)

    class LeafTracer(torch.fx.Tracer):
        def is_leaf_module(self, m, name):
            return isinstance(m, RotaryEmbedding) or super().is_leaf_module(m, name)

    graph = LeafTracer().trace(Block())
    assert [n.op for n in graph.nodes] == ["placeholder", "placeholder", "call_module", "output"]
    q, k = torch.randn(1, 2, 2, 16), torch.randn(1, 2, 1, 16)
    with pytest.warns(torch.jit.TracerWarning):
        traced = torch.jit.trace(Block(), (q, k), check_trace=False)
    assert "scope: __module.rope" in str(traced.inlined_graph)


def test_a_subclass_that_changes_call_impl_is_called_through_it():
    calls = []

    class Logged(RotaryEmbedding):
        def _call_impl(self, *args, **kwargs):
            calls.append(len(args))
            return super()._call_impl(*args, **kwargs)

    rope = Logged(head_dim=16)
    q, k = torch.randn(1, 2, 2, 16), torch.randn(1, 2, 1, 16)
    for _ in range(2):
        rope(q, k)
    assert calls == [2, 2]


def test_a_torch_whose_private_names_moved_gets_nn_module_call(monkeypatch):
    """The shortcut reads torch's private hook globals and jit trace map; where one is gone (a later torch),
    every call is nn.Module.__call__'s (hooks still run), never an AttributeError."""
    import ropekit.module as module

    monkeypatch.setattr(module, "_jit_trace", object())  # no _trace_module_map
    rope = RotaryEmbedding(head_dim=16)
    seen = []
    rope.register_forward_hook(lambda mod, args, out: seen.append(len(args)))
    q, k = torch.randn(1, 2, 2, 16), torch.randn(1, 2, 1, 16)
    want = apply_rotary_qk(q, k, rope.cos, rope.sin)
    got = rope(q, k)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)) and seen == [2]
    rope._forward_hooks.clear()
    assert all(torch.equal(a, b) for a, b in zip(rope(q, k), want, strict=True))


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("numerics", ["hf", "vllm"])
def test_a_module_built_with_numerics_rotates_in_that_mode_and_says_so(layout, numerics):
    rope = RotaryEmbedding(head_dim=32, layout=layout, numerics=numerics)
    q = (4 * torch.randn(2, 5, 3, 32)).bfloat16()  # (B, S, H, D)
    view = q if layout == "bshd" else q.transpose(1, 2)
    want = apply_rotary(q, rope.cos, rope.sin, offsets=3, numerics=numerics)
    got = rope(view, offsets=3)
    got = got if layout == "bshd" else got.transpose(1, 2)
    assert torch.equal(got, want) and not torch.equal(got, apply_rotary(q, rope.cos, rope.sin, offsets=3))
    assert f"numerics={numerics!r}" in repr(rope) and rope.numerics == numerics
    assert RotaryEmbedding(head_dim=32).numerics == "exact"


def test_a_module_refuses_numerics_other_than_the_three_modes():
    with pytest.raises(ValueError, match=r"numerics: expected 'exact'.*got 'fp32'"):
        RotaryEmbedding(head_dim=32, numerics="fp32")
