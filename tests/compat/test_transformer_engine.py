"""ropekit.compat.transformer_engine against TransformerEngine's formula and layouts.

TE (NVIDIA/TransformerEngine, transformer_engine/pytorch/attention/rope.py) is not installed here; the
reference is its unfused formula written out in float64: ``t * cos(freqs) + rotate_half(t) * sin(freqs)`` on
the first d2 features, with freqs built as its ``RotaryPositionEmbedding`` builds them, rows picked per token
as its ``start_positions`` and context-parallel split (``_get_freqs_on_this_cp_rank``) pick them.
"""

from __future__ import annotations

import pytest
import torch

from ropekit.compat.transformer_engine import apply_fused_qkv_rotary_pos_emb, apply_rotary_pos_emb

from .conftest import NO_DEFAULT, signature_of

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2)}


def te_freqs(d2: int, rows: int, interleaved: bool) -> torch.Tensor:
    """TE's RotaryPositionEmbedding(d2, interleaved=...)(rows): angles (rows, 1, 1, d2) in float32."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d2, 2, dtype=torch.float32) / d2))
    freqs = torch.outer(torch.arange(rows, dtype=torch.float32), inv_freq)  # (rows, d2 / 2)
    emb = torch.stack((freqs, freqs), dim=-1).flatten(1) if interleaved else torch.cat((freqs, freqs), dim=-1)
    return emb.reshape(rows, 1, 1, d2)


def te_formula(
    t: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """TE's unfused rotation in float64 of t (..., h, d) whose tokens sit at positions (t.shape[:-2])."""
    d2 = freqs.shape[-1]
    f = freqs[:, 0, 0, :].double()[positions].unsqueeze(-2)  # (..., 1, d2)
    x, rest = t.double()[..., :d2], t.double()[..., d2:]
    if interleaved:
        turned = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        turned = torch.cat((-x[..., d2 // 2 :], x[..., : d2 // 2]), dim=-1)
    return torch.cat((x * f.cos() + turned * f.sin(), rest), dim=-1)


def cp_positions(length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """TE's _get_freqs_on_this_cp_rank: chunks cp_rank and 2 cp_size - 1 - cp_rank of the sequence."""
    chunk = length // 2
    full = cp_size * length
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange(full - (cp_rank + 1) * chunk, full - cp_rank * chunk)
    return torch.cat([first, second])


def _input(shape, dtype, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("d2", [16, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_start", [False, True])
def test_sbhd_and_bshd_match_tes_formula(tensor_format, interleaved, d2, dtype, with_start):
    b, s, h, d = 2, 5, 3, 16
    t = _input((s, b, h, d) if tensor_format == "sbhd" else (b, s, h, d), dtype)
    freqs = te_freqs(d2, 32, interleaved)
    start = torch.tensor([0, 9]) if with_start else None
    before = t.clone()
    out = apply_rotary_pos_emb(t, freqs, tensor_format, start_positions=start, interleaved=interleaved)
    positions = torch.arange(s).expand(b, s) + (0 if start is None else start[:, None])  # (b, s)
    x = t.transpose(0, 1) if tensor_format == "sbhd" else t
    want = te_formula(x, freqs, positions, interleaved)
    want = want.transpose(0, 1) if tensor_format == "sbhd" else want
    assert out.shape == t.shape and out.dtype == dtype and torch.equal(t, before)
    torch.testing.assert_close(out.double(), want, **TOL[dtype])


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("with_start", [False, True])
def test_thd_packs_sequences_from_position_zero(interleaved, with_start):
    cu_seqlens = torch.tensor([0, 3, 7, 8], dtype=torch.int32)
    t = _input((8, 2, 16), torch.float32)
    freqs = te_freqs(16, 32, interleaved)
    start = torch.tensor([1, 0, 20]) if with_start else None
    out = apply_rotary_pos_emb(t, freqs, "thd", start_positions=start, interleaved=interleaved,
                               cu_seqlens=cu_seqlens)  # fmt: skip
    positions = torch.tensor([0, 1, 2, 0, 1, 2, 3, 0])
    if with_start:
        positions = positions + torch.tensor([1, 1, 1, 0, 0, 0, 0, 20])
    torch.testing.assert_close(
        out.double(), te_formula(t, freqs, positions, interleaved), **TOL[torch.float32]
    )


@pytest.mark.parametrize("cp_rank", [0, 1])
def test_context_parallel_ranks_take_tes_two_chunks(cp_rank):
    cp_size, b, s, h, d = 2, 2, 4, 2, 8
    freqs = te_freqs(d, 64, False)
    t = _input((b, s, h, d), torch.float32)
    out = apply_rotary_pos_emb(t, freqs, "bshd", cp_size=cp_size, cp_rank=cp_rank)
    positions = cp_positions(s, cp_size, cp_rank).expand(b, s)
    torch.testing.assert_close(out.double(), te_formula(t, freqs, positions, False), **TOL[torch.float32])
    # thd: cu_seqlens are the global padded lengths (4 and 8); each rank holds half of each sequence
    cu_seqlens = torch.tensor([0, 4, 12], dtype=torch.int32)
    packed = _input((6, h, d), torch.float32, seed=1)
    out = apply_rotary_pos_emb(packed, freqs, "thd", cu_seqlens=cu_seqlens, cp_size=cp_size, cp_rank=cp_rank)
    positions = torch.cat([cp_positions(2, cp_size, cp_rank), cp_positions(4, cp_size, cp_rank)])
    torch.testing.assert_close(
        out.double(), te_formula(packed, freqs, positions, False), **TOL[torch.float32]
    )


def test_gradient_is_tes_formulas_gradient():
    t = _input((4, 2, 3, 16), torch.float64).requires_grad_(True)
    freqs = te_freqs(16, 8, True).double()
    grad = _input((4, 2, 3, 16), torch.float64, seed=2)
    (got,) = torch.autograd.grad(apply_rotary_pos_emb(t, freqs, "sbhd", interleaved=True), t, grad)
    x = t.transpose(0, 1)
    want_out = te_formula(x, freqs, torch.arange(4).expand(2, 4), True).transpose(0, 1)
    (want,) = torch.autograd.grad(want_out, t, grad)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_fused_qkv_splits_megatron_groups_and_rotates_q_and_k(tensor_format, interleaved):
    s, b, groups, q_per_group, d, v_dim = 5, 2, 2, 3, 16, 8
    lead = (s, b) if tensor_format == "sbhd" else (b, s)
    qkv = _input((*lead, groups, q_per_group * d + d + v_dim), torch.float32)
    before = qkv.clone()
    q_freqs, k_freqs = te_freqs(d, 16, interleaved), te_freqs(8, 16, interleaved)  # k rotates 8 of 16
    start = torch.tensor([2, 0])
    split = [q_per_group * d, d, v_dim]
    q, k, v = apply_fused_qkv_rotary_pos_emb(
        qkv, q_freqs, k_freqs, split, tensor_format, start_positions=start, interleaved=interleaved
    )
    assert q.shape == (*lead, groups * q_per_group, d) and k.shape == (*lead, groups, d)
    assert v.shape == (*lead, groups, v_dim) and torch.equal(qkv, before)
    positions = torch.arange(s).expand(b, s) + start[:, None]  # (b, s)
    as_bshd = (lambda x: x.transpose(0, 1)) if tensor_format == "sbhd" else (lambda x: x)
    q_in = qkv[..., : q_per_group * d].reshape(*lead, groups * q_per_group, d)
    k_in = qkv[..., q_per_group * d : q_per_group * d + d]
    want_q = te_formula(as_bshd(q_in), q_freqs, positions, interleaved)
    want_k = te_formula(as_bshd(k_in), k_freqs, positions, interleaved)
    torch.testing.assert_close(as_bshd(q).double(), want_q, **TOL[torch.float32])
    torch.testing.assert_close(as_bshd(k).double(), want_k, **TOL[torch.float32])
    assert torch.equal(v, qkv[..., q_per_group * d + d :])


def test_signatures_are_tes():
    backend = ("backend", "auto")  # ropekit's keyword-only addition, after TE's parameters
    assert signature_of(apply_rotary_pos_emb) == [
        ("t", NO_DEFAULT), ("freqs", NO_DEFAULT), ("tensor_format", "sbhd"), ("start_positions", None),
        ("interleaved", False), ("fused", False), ("cu_seqlens", None), ("cp_size", 1), ("cp_rank", 0),
        backend,
    ]  # fmt: skip
    assert signature_of(apply_fused_qkv_rotary_pos_emb) == [
        ("qkv", NO_DEFAULT), ("q_freqs", NO_DEFAULT), ("k_freqs", NO_DEFAULT),
        ("qkv_split_arg_list", NO_DEFAULT), ("tensor_format", "sbhd"), ("start_positions", None),
        ("interleaved", False), ("cu_seqlens", None), ("cp_size", 1), ("cp_rank", 0), backend,
    ]  # fmt: skip


def _bad_calls():
    t, freqs = _input((4, 2, 3, 16), torch.float32), te_freqs(16, 8, False)
    yield "tensor_format", lambda: apply_rotary_pos_emb(t, freqs, "hbsd")
    yield "cu_seqlens", lambda: apply_rotary_pos_emb(t[:, 0], freqs, "thd")
    yield "t", lambda: apply_rotary_pos_emb(t[0], freqs, "sbhd")
    yield "freqs", lambda: apply_rotary_pos_emb(t, freqs[:, 0], "sbhd")
    yield "freqs", lambda: apply_rotary_pos_emb(t, te_freqs(16, 8, True), "sbhd", interleaved=False)
    yield "freqs", lambda: apply_rotary_pos_emb(t, te_freqs(16, 3, False), "sbhd")  # 3 rows, 4 positions
    yield "freqs", lambda: apply_rotary_pos_emb(t, te_freqs(32, 8, False), "sbhd")  # d2 > d
    yield "cp_rank", lambda: apply_rotary_pos_emb(t, freqs, "sbhd", cp_size=2, cp_rank=2)
    yield "start_positions", lambda: apply_rotary_pos_emb(t, freqs, "sbhd", torch.tensor([0, 1]), cp_size=2)
    yield "start_positions", lambda: apply_rotary_pos_emb(t, freqs, "sbhd", torch.tensor([0, 1, 2]))
    qkv = _input((4, 2, 2, 3 * 16), torch.float32)
    yield "qkv_split_arg_list", lambda: apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, [16, 16, 8])
    yield "qkv_split_arg_list", lambda: apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, [20, 16, 12])
    yield "tensor_format", lambda: apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, [16, 16, 16], "thd")


@pytest.mark.parametrize(("name", "call"), list(_bad_calls()))
def test_errors_name_tes_arguments(name, call):
    with pytest.raises(ValueError, match=rf"^{name}: "):
        call()


def test_fused_qkv_gradient_flows_back_into_the_packed_buffer():
    s, b, groups, d = 3, 2, 2, 8
    qkv = _input((s, b, groups, 2 * d + d + d), torch.float64).requires_grad_(True)
    freqs = te_freqs(d, 8, False).double()
    q, k, v = apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, [2 * d, d, d])
    grads = [_input(t.shape, torch.float64, seed=i) for i, t in enumerate((q, k, v))]
    (got,) = torch.autograd.grad((q, k, v), qkv, grads)
    positions = torch.arange(s).expand(b, s)
    q_want = te_formula(
        qkv[..., : 2 * d].reshape(s, b, 2 * groups, d).transpose(0, 1), freqs, positions, False
    )
    k_want = te_formula(qkv[..., 2 * d : 3 * d].transpose(0, 1), freqs, positions, False)
    outs = (q_want.transpose(0, 1), k_want.transpose(0, 1), qkv[..., 3 * d :])
    (want,) = torch.autograd.grad(outs, qkv, grads)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    ("position", "t_dtype", "atol"), [(1e6, torch.float32, 1e-5), (1000, torch.float64, 1e-12)]
)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("fused_qkv", [False, True])
def test_float64_angles_take_cos_and_sin_in_float64(position, t_dtype, atol, interleaved, fused_qkv):
    """Issue 24, defect 5: float64 angles were rounded to float32 before cos / sin (error 0.027 at position
    1e6; 2.2e-5 at position 1000 with float64 t). As compat.megatron: cos / sin in the angles' dtype, then
    cast to the math dtype. The float64 reference (ropekit.reference) bounds the result by t's rounding."""
    import numpy as np

    from ropekit import reference as ref

    d2 = 16
    theta = ref.inv_freq(d2)  # float64 (d2 / 2,)
    positions = np.array([position, position + 1, 3 * position + 7])  # (s,)
    angles = torch.from_numpy(positions[:, None] * theta)  # (s, d2 / 2) float64
    pair = torch.stack((angles, angles), -1).flatten(1) if interleaved else torch.cat((angles, angles), -1)
    freqs = pair[:, None, None, :]  # (s, 1, 1, d2) float64
    rotate = ref.rotate_interleaved if interleaved else ref.rotate_half
    if fused_qkv:
        qkv = _input((3, 1, 2, 3 * d2), t_dtype, seed=9)  # (s, b, h, q + k + v), one q head per group
        q, k, _ = apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, [d2, d2, d2], interleaved=interleaved)
        pairs = ((q, qkv[..., :d2]), (k, qkv[..., d2 : 2 * d2]))
    else:
        t = _input((3, 1, 2, d2), t_dtype, seed=9)  # (s, b, h, d)
        pairs = ((apply_rotary_pos_emb(t, freqs, interleaved=interleaved), t),)
    for got, t in pairs:
        want = rotate(t.double().transpose(0, 1).numpy(), positions[None, :, None], theta)  # (b, s, h, d)
        np.testing.assert_allclose(got.transpose(0, 1).double().numpy(), want, rtol=0, atol=atol)
