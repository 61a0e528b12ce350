"""ropekit.compat.flash_attn against the cases of flash-attn's own tests.

Follows flash-attn 2.8's ``tests/test_rotary.py`` (Dao-AILab/flash-attention, commit ef0bbd9): the same
parameter grid (inplace x interleaved x rotary_fraction {1.0, 0.5} x seqlen_offsets {0, int, (B,) tensor}
x fp16 / bf16, and gqa for qkv), the same inputs (random angles in [0, 2 pi) over 2 * seqlen table rows,
leaves that require grad, varlen batches unpadded from random lengths), the same reference semantics (token s
of row b at position offset_b + s; q and k rotated, v untouched; gradients through the rotation) and the
same tolerances (rtol 1e-3, atol twice the error of ``x + 0.3 - 0.3`` in the output dtype). Sizes are scaled
down for a 2-core CPU (batch 4, 3 heads, seqlen 19, head_dim 32 instead of 32, 4, 217-781, 64-128). The
reference is ropekit's float64 one, rounded to the dtype as flash-attn's float32 reference is.

The ``RotaryEmbedding`` module follows flash-attn's ``tests/layers/test_rotary.py`` (``test_rotary``,
GPT-NeoX pairing, and ``test_rotary_interleaved``, GPT-J pairing: a leaf fp16 qkv (B, S, 3, H, D) that
requires grad, seqlen_offset 0 or an int with S + offset = the table length, rotary fraction 0.5 and 1; the
module's tables against the reference tables; q and k rotated, features past rotary_dim and v equal to the
input; gradients the inverse rotation of the upstream gradient; rtol 1e-3, atol 5e-3), scaled from (8, 2048,
16 heads, 128) to (2, 48, 3, 32), offset 711 -> 17. xPos (``scale_base``), the kv form and tensor offsets with
``max_seqlen`` have no flash-attn test; they are checked against the formulas of flash-attn's module.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from ropekit.compat.flash_attn import (
    RotaryEmbedding,
    apply_rotary_emb,
    apply_rotary_emb_kv_,
    apply_rotary_emb_qkv_,
)
from rotary_reference import assert_matches_reference, reference_rotation, reference_tables

from .conftest import NO_DEFAULT, arithmetic_atol, signature_of

BATCH, HEADS, SEQ, HEAD_DIM = 4, 3, 19, 32
DTYPES = [torch.float16, torch.bfloat16]


def make_tables(seqlen: int, rotary_dim: int, dtype: torch.dtype, g: torch.Generator):
    """flash-attn's generate_cos_sin: random angles in [0, 2 pi), 2 * seqlen rows, cast to dtype."""
    angle = torch.rand(seqlen * 2, rotary_dim // 2, generator=g) * 2 * math.pi
    return torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)


def make_offsets(kind, g: torch.Generator):
    """flash-attn's generate_seqlen_offsets: 0, one int in [0, seqlen], or a (batch,) int32 tensor."""
    if kind == "zero":
        return 0
    if kind == "int":
        return int(torch.randint(0, SEQ + 1, (1,), generator=g))
    return torch.randint(0, SEQ + 1, (BATCH,), generator=g, dtype=torch.int32)


def positions_of(offsets, seqlen: int = SEQ) -> np.ndarray:
    off = offsets.numpy() if isinstance(offsets, torch.Tensor) else np.full(BATCH, offsets)
    return off[:, None] + np.arange(seqlen)[None, :]  # (batch, seq)


def rotated(x: torch.Tensor, cos, sin, pos, interleaved: bool, conjugate: bool = False) -> torch.Tensor:
    """The float64 reference rotation rounded to x's dtype (flash-attn compares against float32 math cast back
    to the dtype); conjugate rotates by -theta, the gradient's rule."""
    want = reference_rotation(x, cos, sin, pos, interleaved=interleaved, conjugate=conjugate)
    return want.to(x.dtype)


def assert_close_as_flash_attn(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.allclose(got, want, rtol=1e-3, atol=arithmetic_atol(want)), (got - want).abs().max()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("offsets_kind", ["zero", "int", "tensor"])
@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
def test_rotary_emb_matches_reference_and_its_gradient_is_the_inverse_rotation(
    backend, inplace, interleaved, rotary_fraction, offsets_kind, dtype
):
    g = torch.Generator().manual_seed(42)
    x = torch.randn(BATCH, SEQ, HEADS, HEAD_DIM, generator=g).to(dtype).requires_grad_()
    x_before = x.detach().clone()
    cos, sin = make_tables(SEQ, int(rotary_fraction * HEAD_DIM), dtype, g)
    offsets = make_offsets(offsets_kind, g)
    pos = positions_of(offsets)
    out = apply_rotary_emb(x, cos, sin, seqlen_offsets=offsets, interleaved=interleaved, inplace=inplace)
    assert_close_as_flash_attn(out, rotated(x_before, cos, sin, pos, interleaved))
    upstream = torch.randn(out.shape, generator=g).to(dtype)
    upstream_before = upstream.clone()
    out.backward(upstream)
    assert_close_as_flash_attn(x.grad, rotated(upstream, cos, sin, pos, interleaved, conjugate=True))
    assert torch.equal(upstream, upstream_before)  # the incoming gradient is never written
    if inplace:
        assert out.data_ptr() == x.data_ptr()
    else:
        assert torch.equal(x.detach(), x_before)
    assert backend.calls > 0


def _qkv_reference(qkv, cos, sin, pos, interleaved, gqa, conjugate=False):
    if gqa:
        q, k, v = qkv.split([HEADS, HEADS // 2 + 1, HEADS // 2 + 1], dim=2)
        join = lambda *t: torch.cat(t, dim=2)  # noqa: E731
    else:
        q, k, v = qkv.unbind(2)
        join = lambda *t: torch.stack(t, dim=2)  # noqa: E731
    r = lambda t: rotated(t, cos, sin, pos, interleaved, conjugate)  # noqa: E731
    return join(r(q), r(k), v.detach())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("offsets_kind", ["zero", "int", "tensor"])
@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_emb_qkv_rotates_q_and_k_in_place_and_trains(
    backend, interleaved, rotary_fraction, offsets_kind, gqa, dtype
):
    g = torch.Generator().manual_seed(42)
    k_heads = HEADS // 2 + 1
    shape = (BATCH, SEQ, HEADS + 2 * k_heads, HEAD_DIM) if gqa else (BATCH, SEQ, 3, HEADS, HEAD_DIM)
    qkv = torch.randn(shape, generator=g).to(dtype).requires_grad_()  # a leaf, as in flash-attn's test
    before = qkv.detach().clone()
    cos, sin = make_tables(SEQ, int(rotary_fraction * HEAD_DIM), dtype, g)
    offsets = make_offsets(offsets_kind, g)
    pos = positions_of(offsets)
    out = apply_rotary_emb_qkv_(
        qkv, cos, sin, seqlen_offsets=offsets, interleaved=interleaved, num_heads_q=HEADS if gqa else None
    )
    assert out.data_ptr() == qkv.data_ptr()  # written in place
    assert_close_as_flash_attn(out, _qkv_reference(before, cos, sin, pos, interleaved, gqa))
    assert torch.equal(qkv.detach(), out.detach())
    upstream = torch.randn(out.shape, generator=g).to(dtype)
    out.backward(upstream)
    assert_close_as_flash_attn(qkv.grad, _qkv_reference(upstream, cos, sin, pos, interleaved, gqa, True))


@pytest.mark.parametrize("separate_k_tables", [False, True])
def test_rotary_emb_qkv_uses_cos_k_and_sin_k_for_keys(backend, separate_k_tables):
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(BATCH, SEQ, 3, HEADS, HEAD_DIM, generator=g)
    cos, sin = make_tables(SEQ, HEAD_DIM, torch.float32, g)
    cos_k, sin_k = make_tables(SEQ, HEAD_DIM, torch.float32, g) if separate_k_tables else (None, None)
    want = qkv.clone()
    pos = positions_of(0)
    want[:, :, 0] = rotated(qkv[:, :, 0], cos, sin, pos, False)
    k_tables = (cos, sin) if cos_k is None else (cos_k, sin_k)
    want[:, :, 1] = rotated(qkv[:, :, 1], *k_tables, pos, False)
    out = apply_rotary_emb_qkv_(qkv, cos, sin, cos_k, sin_k)
    torch.testing.assert_close(out, want, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("offsets_kind", ["zero", "int", "tensor"])
@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_emb_kv_rotates_only_k_in_place_and_trains(
    backend, interleaved, rotary_fraction, offsets_kind, dtype
):
    g = torch.Generator().manual_seed(42)
    kv = torch.randn(BATCH, SEQ, 2, HEADS, HEAD_DIM, generator=g).to(dtype).requires_grad_()
    before = kv.detach().clone()
    cos, sin = make_tables(SEQ, int(rotary_fraction * HEAD_DIM), dtype, g)
    offsets = make_offsets(offsets_kind, g)
    pos = positions_of(offsets)
    out = apply_rotary_emb_kv_(kv, cos, sin, seqlen_offsets=offsets, interleaved=interleaved)
    assert out.data_ptr() == kv.data_ptr()
    want = torch.stack([rotated(before[:, :, 0], cos, sin, pos, interleaved), before[:, :, 1]], dim=2)
    assert_close_as_flash_attn(out, want)
    upstream = torch.randn(out.shape, generator=g).to(dtype)
    out.backward(upstream)
    want_grad = torch.stack(
        [rotated(upstream[:, :, 0], cos, sin, pos, interleaved, conjugate=True), upstream[:, :, 1]], dim=2
    )
    assert_close_as_flash_attn(kv.grad, want_grad)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("offsets_kind", ["zero", "int", "tensor"])
@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
def test_rotary_emb_varlen_equals_the_padded_batch(
    backend, inplace, interleaved, rotary_fraction, offsets_kind, dtype
):
    g = torch.Generator().manual_seed(42)
    x = torch.randn(BATCH, SEQ, HEADS, HEAD_DIM, generator=g).to(dtype)
    lengths = torch.randint(max(1, SEQ - 5), SEQ + 1, (BATCH,), generator=g)
    keep = torch.arange(SEQ)[None, :] < lengths[:, None]  # (batch, seq) padding mask
    x_unpad = x[keep].clone().requires_grad_()  # (total_tokens, heads, head_dim)
    before = x_unpad.detach().clone()
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    cos, sin = make_tables(SEQ, int(rotary_fraction * HEAD_DIM), dtype, g)
    offsets = make_offsets(offsets_kind, g)
    out = apply_rotary_emb(
        x_unpad, cos, sin, seqlen_offsets=offsets, interleaved=interleaved, inplace=inplace,
        cu_seqlens=cu_seqlens, max_seqlen=int(lengths.max()),
    )  # fmt: skip
    want = rotated(x, cos, sin, positions_of(offsets), interleaved)[keep]
    assert_close_as_flash_attn(out, want)
    upstream = torch.randn(out.shape, generator=g).to(dtype)
    out.backward(upstream)
    padded = torch.zeros_like(x)
    padded[keep] = upstream
    want_grad = rotated(padded, cos, sin, positions_of(offsets), interleaved, conjugate=True)[keep]
    assert_close_as_flash_attn(x_unpad.grad, want_grad)
    if not inplace:
        assert torch.equal(x_unpad.detach(), before)


def test_packed_qkv_in_place_trains_like_the_out_of_place_rotation(backend):
    """qkv from a projection (not a leaf), rotated in place: the parameters get the out-of-place gradient."""
    torch.manual_seed(0)
    proj = nn.Linear(16, 3 * HEADS * HEAD_DIM)
    x = torch.randn(BATCH, SEQ, 16)
    cos, sin = make_tables(SEQ, HEAD_DIM, torch.float32, torch.Generator().manual_seed(3))
    offsets = torch.tensor([0, 3, 5, 1])

    def loss(in_place: bool) -> torch.Tensor:
        qkv = proj(x).view(BATCH, SEQ, 3, HEADS, HEAD_DIM)
        if in_place:
            qkv = apply_rotary_emb_qkv_(qkv, cos, sin, seqlen_offsets=offsets)
            q, k, v = qkv.unbind(2)
        else:
            q, k, v = qkv.unbind(2)
            q = apply_rotary_emb(q, cos, sin, seqlen_offsets=offsets)
            k = apply_rotary_emb(k, cos, sin, seqlen_offsets=offsets)
        scores = torch.einsum("bshd,bthd->bhst", q, k).softmax(-1)
        return torch.einsum("bhst,bthd->bshd", scores, v).square().sum()

    loss(False).backward()
    want = [p.grad.clone() for p in proj.parameters()]
    proj.zero_grad()
    loss(True).backward()
    for got, expected in zip((p.grad for p in proj.parameters()), want, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_in_place_calls_without_autograd_return_the_input_object(backend):
    qkv = torch.randn(1, 3, 3, 2, 8)
    cos, sin = make_tables(3, 8, torch.float32, torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert apply_rotary_emb_qkv_(qkv, cos, sin) is qkv
        kv = qkv[:, :, 1:]
        assert apply_rotary_emb_kv_(kv, cos, sin) is kv
        x = qkv[:, :, 2]
        assert apply_rotary_emb(x, cos, sin, inplace=True) is x


def test_errors_name_flash_attn_arguments():
    cos, sin = make_tables(4, 8, torch.float32, torch.Generator().manual_seed(0))
    x = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"^seqlen_offsets: .*-1"):
        apply_rotary_emb(x, cos, sin, seqlen_offsets=-1)
    with pytest.raises(ValueError, match=r"^positions: .*position 8 .*table_len 8"):
        apply_rotary_emb(x, cos, sin, seqlen_offsets=torch.tensor([5]))
    with pytest.raises(ValueError, match=r"^qkv: expected shape \(batch, seq, 3, heads, head_dim\)"):
        apply_rotary_emb_qkv_(torch.randn(1, 4, 2, 2, 8), cos, sin)
    with pytest.raises(ValueError, match=r"^num_heads_q: expected an int"):
        apply_rotary_emb_qkv_(torch.randn(1, 4, 6, 8), cos, sin)
    with pytest.raises(ValueError, match=r"^num_heads_q: 3 leaves 3"):
        apply_rotary_emb_qkv_(torch.randn(1, 4, 6, 8), cos, sin, num_heads_q=3)
    with pytest.raises(ValueError, match=r"^kv: expected shape \(batch, seq, 2, heads, head_dim\)"):
        apply_rotary_emb_kv_(torch.randn(1, 4, 3, 2, 8), cos, sin)
    with pytest.raises(ValueError, match=r"^max_seqlen: expected a positive int"):
        apply_rotary_emb(x[0], cos, sin, cu_seqlens=torch.tensor([0, 4], dtype=torch.int32), max_seqlen=0)


def test_signatures_are_flash_attns():
    assert signature_of(apply_rotary_emb) == [
        ("x", NO_DEFAULT),
        ("cos", NO_DEFAULT),
        ("sin", NO_DEFAULT),
        ("interleaved", False),
        ("inplace", False),
        ("seqlen_offsets", 0),
        ("cu_seqlens", None),
        ("max_seqlen", None),
        ("backend", "auto"),  # ropekit's keyword-only addition
    ]
    assert signature_of(apply_rotary_emb_qkv_) == [
        ("qkv", NO_DEFAULT),
        ("cos", NO_DEFAULT),
        ("sin", NO_DEFAULT),
        ("cos_k", None),
        ("sin_k", None),
        ("interleaved", False),
        ("seqlen_offsets", 0),
        ("num_heads_q", None),
        ("backend", "auto"),
    ]
    assert signature_of(apply_rotary_emb_kv_) == [
        ("kv", NO_DEFAULT),
        ("cos", NO_DEFAULT),
        ("sin", NO_DEFAULT),
        ("interleaved", False),
        ("seqlen_offsets", 0),
        ("backend", "auto"),
    ]
    assert signature_of(RotaryEmbedding.__init__) == [
        ("dim", NO_DEFAULT),
        ("base", 10000.0),
        ("interleaved", False),
        ("scale_base", None),
        ("pos_idx_in_fp32", True),
        ("device", None),
        ("backend", "auto"),
    ]
    assert signature_of(RotaryEmbedding.forward) == [
        ("qkv", NO_DEFAULT),
        ("kv", None),
        ("seqlen_offset", 0),
        ("max_seqlen", None),
        ("num_heads_q", None),
    ]


def test_compiled_qkv_in_place_equals_eager(backend):
    """flash-attn's ``compiled`` case: torch.compile(apply_rotary_emb_qkv_) on a leaf; outputs, gradients."""
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(2, 6, 3, 2, 16, generator=g).requires_grad_()
    eager_in = qkv.detach().clone().requires_grad_()
    cos, sin = make_tables(6, 16, torch.float32, g)
    offsets = torch.tensor([1, 4])
    out = torch.compile(apply_rotary_emb_qkv_, backend="aot_eager")(qkv, cos, sin, seqlen_offsets=offsets)
    want = apply_rotary_emb_qkv_(eager_in, cos, sin, seqlen_offsets=offsets)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    upstream = torch.randn(out.shape, generator=g)
    out.backward(upstream)
    want.backward(upstream)
    torch.testing.assert_close(qkv.grad, eager_in.grad, atol=0, rtol=0)


def test_in_place_on_views_of_a_projection_trains_when_read_back_from_the_buffer(backend):
    """apply_rotary_emb(qkv[:, :, 0], inplace=True): autograd sees the write, so reading q and k back out of
    qkv afterwards gives the out-of-place gradients."""
    torch.manual_seed(1)
    proj = nn.Linear(8, 3 * 2 * 16)
    x = torch.randn(2, 5, 8)
    cos, sin = make_tables(5, 16, torch.float32, torch.Generator().manual_seed(2))

    def loss(in_place: bool) -> torch.Tensor:
        qkv = proj(x).view(2, 5, 3, 2, 16)
        q = apply_rotary_emb(qkv[:, :, 0], cos, sin, inplace=in_place)
        k = apply_rotary_emb(qkv[:, :, 1], cos, sin, inplace=in_place)
        if in_place:
            q, k = qkv[:, :, 0], qkv[:, :, 1]
        return (q * k).sum() + (q * qkv[:, :, 2]).sum()

    loss(False).backward()
    want = [p.grad.clone() for p in proj.parameters()]
    proj.zero_grad()
    loss(True).backward()
    for got, expected in zip((p.grad for p in proj.parameters()), want, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_in_place_argument_checks_come_before_any_write():
    cos, sin = make_tables(4, 8, torch.float32, torch.Generator().manual_seed(0))
    x = torch.randn(1, 4, 2, 8)
    before = x.clone()
    with pytest.raises(ValueError, match=r"^inplace: expected a bool"):
        apply_rotary_emb(x, cos, sin, inplace=1)
    with pytest.raises(ValueError, match=r"^x: expected a torch.Tensor"):
        apply_rotary_emb([1.0], cos, sin, inplace=True)
    with pytest.raises(ValueError, match=r"^seqlen_offsets: "):
        apply_rotary_emb(x, cos, sin, inplace=True, seqlen_offsets=torch.tensor([1, 2]))
    assert torch.equal(x, before)


def xpos_scales(rotary_dim: int, length: int, scale_base: float) -> torch.Tensor:
    """flash-attn's xPos factor per (position, pair): zeta_i^((p - length // 2) / scale_base), float64."""
    zeta = (torch.arange(0, rotary_dim, 2, dtype=torch.float64) + 0.4 * rotary_dim) / (1.4 * rotary_dim)
    power = (torch.arange(length, dtype=torch.float64) - length // 2) / scale_base
    return zeta ** power[:, None]  # (length, R/2)


@pytest.mark.parametrize("seqlen_offset", [0, 17])
@pytest.mark.parametrize("rotary_fraction", [0.5, 1.0])
@pytest.mark.parametrize("interleaved", [False, True])
def test_module_rotates_packed_qkv_in_place_as_flash_attn(
    backend, interleaved, rotary_fraction, seqlen_offset
):
    torch.manual_seed(0)
    batch, seqlen_total, heads, head_dim = 2, 48, 3, 32
    seqlen, rotary_dim = seqlen_total - seqlen_offset, int(head_dim * rotary_fraction)
    rtol, atol = 1e-3, 5e-3
    qkv = torch.randn(batch, seqlen, 3, heads, head_dim, dtype=torch.float16, requires_grad=True)
    qkv_og = qkv.detach().clone()
    rotary = RotaryEmbedding(rotary_dim, interleaved=interleaved)
    out = rotary(qkv, seqlen_offset=seqlen_offset)
    cos, sin = reference_tables(rotary_dim, seqlen_total)
    torch.testing.assert_close(rotary._cos_cached, cos.to(torch.float16), rtol=rtol, atol=atol)
    torch.testing.assert_close(rotary._sin_cached, sin.to(torch.float16), rtol=rtol, atol=atol)
    pos = np.broadcast_to(np.arange(seqlen) + seqlen_offset, (batch, seqlen))
    for i in (0, 1):  # q and k
        want = rotated(qkv_og[:, :, i], cos, sin, pos, interleaved)
        assert torch.allclose(out[:, :, i], want, rtol=rtol, atol=atol)
    assert torch.equal(out[:, :, 0:2, :, rotary_dim:], qkv_og[:, :, 0:2, :, rotary_dim:])
    assert torch.equal(out[:, :, 2], qkv_og[:, :, 2])
    g = torch.randn_like(out)
    g_og = g.clone()
    out.backward(g)
    for i in (0, 1):
        want = rotated(g_og[:, :, i], cos, sin, pos, interleaved, conjugate=True)
        assert torch.allclose(qkv.grad[:, :, i], want, rtol=rtol, atol=atol)
    assert torch.equal(qkv.grad[:, :, 0:2, :, rotary_dim:], g_og[:, :, 0:2, :, rotary_dim:])
    assert torch.equal(qkv.grad[:, :, 2], g_og[:, :, 2])
    assert backend.calls > 0


@pytest.mark.parametrize("interleaved", [False, True])
def test_module_xpos_scales_queries_up_and_keys_down_about_the_table_centre(backend, interleaved):
    g = torch.Generator().manual_seed(3)
    batch, seqlen, heads, dim, scale_base = 2, 20, 2, 16, 8.0
    qkv = torch.randn(batch, seqlen, 3, heads, dim, generator=g)
    before = qkv.clone()
    rotary = RotaryEmbedding(dim, interleaved=interleaved, scale_base=scale_base)
    out = rotary(qkv)
    assert out is qkv
    cos, sin = reference_tables(dim, seqlen)
    scale = xpos_scales(dim, seqlen, scale_base)
    pos = np.broadcast_to(np.arange(seqlen), (batch, seqlen))
    want_q = reference_rotation(before[:, :, 0], cos * scale, sin * scale, pos, interleaved=interleaved)
    want_k = reference_rotation(before[:, :, 1], cos / scale, sin / scale, pos, interleaved=interleaved)
    torch.testing.assert_close(out[:, :, 0].double(), want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[:, :, 1].double(), want_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[:, :, 2], before[:, :, 2])
    # q . k depends on the offset between the positions only: rotation and scale cancel in pairs
    assert rotary.scale is not None and rotary.scale.shape == (dim // 2,)


def test_module_kv_form_and_tensor_offsets_with_max_seqlen(backend):
    g = torch.Generator().manual_seed(4)
    batch, seqlen, heads, dim = 3, 5, 2, 16
    q = torch.randn(batch, seqlen, heads, dim, generator=g)
    kv = torch.randn(batch, seqlen, 2, heads, dim, generator=g)
    q_before, kv_before = q.clone(), kv.clone()
    offsets = torch.tensor([0, 7, 30], dtype=torch.int32)
    rotary = RotaryEmbedding(dim)
    q_out, kv_out = rotary(q, kv, seqlen_offset=offsets, max_seqlen=40)
    assert q_out is q and kv_out is kv and rotary._seq_len_cached == 40
    cos, sin = reference_tables(dim, 40)
    pos = offsets.numpy()[:, None] + np.arange(seqlen)
    assert_matches_reference(q, q_before, cos, sin, pos, interleaved=False)
    assert_matches_reference(kv[:, :, 0], kv_before[:, :, 0], cos, sin, pos, interleaved=False)
    assert torch.equal(kv[:, :, 1], kv_before[:, :, 1])
    # a tensor offset past the tables, with no max_seqlen to grow them: a ValueError, not an identity
    with pytest.raises(ValueError, match=r"^positions: largest position 104 is past"):
        rotary(q.clone(), kv.clone(), seqlen_offset=torch.tensor([0, 0, 100]))
    with pytest.raises(ValueError, match=r"^scale_base: expected"):
        RotaryEmbedding(16, scale_base=0)
    with pytest.raises(ValueError, match=r"^backend: expected"):
        RotaryEmbedding(16, backend="cuda")


@pytest.mark.parametrize("scale_base", [None, 8.0])
def test_module_tables_follow_the_input_dtype_and_are_rebuilt_when_it_changes(scale_base):
    """Issue 24: the cached tables stayed float32, where flash-attn's layer keeps them in qkv's dtype (its
    ``_update_cos_sin_cache`` rebuilds them when the dtype changes: computed in float32, then cast), so its
    own tests (``_cos_cached`` against float16) failed. ropekit forms them in float64 and rounds once, so
    each is within one rounding of flash-attn's float32-then-cast value."""
    rotary = RotaryEmbedding(16, scale_base=scale_base)
    names = ["_cos_cached", "_sin_cached"] + (["_cos_k_cached", "_sin_k_cached"] if scale_base else [])
    seen = {}
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float16):
        qkv = torch.randn(2, 10, 3, 2, 16).to(dtype)
        rotary(qkv)
        for name in names:
            table = getattr(rotary, name)
            assert table.dtype == dtype and table.shape == (10, 8)
            seen.setdefault(name, []).append(table)
    inv = 1.0 / 10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)  # flash-attn's float32 rule
    angles = torch.outer(torch.arange(10, dtype=torch.float32), inv)
    cos32, sin32 = angles.cos(), angles.sin()
    if scale_base:
        power = (torch.arange(10, dtype=torch.float32) - 10 // 2) / scale_base
        zeta = (torch.arange(0, 16, 2, dtype=torch.float32) + 0.4 * 16) / (1.4 * 16)
        scale = zeta ** power[:, None]
        flash = [cos32 * scale, sin32 * scale, cos32 / scale, sin32 / scale]
    else:
        flash = [cos32, sin32]
    for name, want in zip(names, flash, strict=True):
        for table in seen[name]:
            eps = torch.finfo(table.dtype).eps
            torch.testing.assert_close(table.float(), want.to(table.dtype).float(), rtol=eps, atol=eps)
