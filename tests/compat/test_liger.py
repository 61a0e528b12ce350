"""ropekit.compat.liger against the cases of Liger-Kernel's own tests.

Follows Liger-Kernel's ``test/transformers/test_rope.py`` (linkedin/Liger-Kernel, commit 00fb8bf, 0.6):
``test_correctness`` (HF's ``apply_rotary_pos_emb`` and ``LlamaRotaryEmbedding`` tables as the reference;
(bsz, seq, q heads, kv heads, head_dim) with equal heads, GQA and odd-sized shapes; position ids (1, S) or
expanded to (B, S); float32 with atol = rtol = 1e-5 and bfloat16 with atol 1e-1, rtol 1e-5; outputs and q / k
gradients) and ``test_functional_correctness`` (the small and odd shapes (1, 2, 2, 2, 8), (1, 2, 1, 2, 8),
(9, 7, 41, 41, 41), where head_dim 41 rotates pairs (i, i + 20) and keeps feature 40). Sizes scaled for a
2-core CPU (32 heads -> 8, 128 tokens -> 24, 423 -> 23).

Liger-Kernel 0.8's additions to the same file are followed too: ``test_vision_2d_cos_sin`` (a (seq, head_dim)
vision table against HF fed the (1, seq, head_dim) one), ``test_partial_rope_transformers_correctness``
(rows of width rotary_dim < head_dim, GPT-NeoX / Phi-2 / StableLM / 50 % shapes, against HF's partial
rotation), ``test_gpt_oss_rope_matches_hf`` (GPT-OSS's half-width rows through
``liger_rotary_pos_emb_gpt_oss``) and ``test_functional_correctness`` (``liger_rotary_pos_emb`` and
``LigerRopeFunction.apply`` agree, outputs and gradients). When liger-kernel is installed, the same cases
also run against the real Liger kernel under Triton's interpreter (liger_peer_cases.py, a fresh process).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ropekit import RopeConfig
from ropekit.compat.liger import (
    LigerRopeFunction,
    liger_rotary_pos_emb,
    liger_rotary_pos_emb_gpt_oss,
    liger_rotary_pos_emb_vision,
)
from triton_interpreter import run_interpreter_cases

from .conftest import NO_DEFAULT, as_table, llama_tables, signature_of

SHAPES = [(1, 24, 8, 8, 16), (2, 24, 8, 8, 16), (1, 24, 8, 2, 16), (2, 24, 8, 2, 16), (3, 23, 7, 21, 20)]
DTYPE_TOL = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 1e-1, 1e-5)]


@pytest.mark.parametrize("expand_position_ids", [True, False])
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPE_TOL, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("bsz", "seq_len", "q_heads", "kv_heads", "head_dim"), SHAPES)
def test_correctness_against_transformers(
    backend, bsz, seq_len, q_heads, kv_heads, head_dim, dtype, atol, rtol, expand_position_ids
):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(bsz, seq_len, q_heads, head_dim, generator=g).transpose(1, 2).to(dtype)
    k = torch.randn(bsz, seq_len, kv_heads, head_dim, generator=g).transpose(1, 2).to(dtype)
    q1, k1 = q.clone().requires_grad_(), k.clone().requires_grad_()
    q2, k2 = q.clone().requires_grad_(), k.clone().requires_grad_()
    cos, sin = llama_tables(head_dim, bsz, seq_len, expand_position_ids, dtype)
    hf_q, hf_k = apply_rotary_pos_emb(q1, k1, cos, sin)
    tt_q, tt_k = liger_rotary_pos_emb(q2, k2, cos, sin)
    assert torch.allclose(hf_q, tt_q, atol=atol, rtol=rtol)
    assert torch.allclose(hf_k, tt_k, atol=atol, rtol=rtol)
    dq, dk = torch.randn(hf_q.shape, generator=g).to(dtype), torch.randn(hf_k.shape, generator=g).to(dtype)
    q1_grad, k1_grad = torch.autograd.grad((hf_q, hf_k), (q1, k1), (dq, dk))
    q2_grad, k2_grad = torch.autograd.grad((tt_q, tt_k), (q2, k2), (dq.clone(), dk.clone()))
    assert torch.allclose(q1_grad, q2_grad, atol=atol, rtol=rtol)
    assert torch.allclose(k1_grad, k2_grad, atol=atol, rtol=rtol)
    assert backend.calls > 0


@pytest.mark.parametrize("expand_position_ids", [True, False])
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPE_TOL, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("bsz", "seq_len", "q_heads", "kv_heads", "head_dim"), [
    (1, 2, 2, 2, 8), (1, 2, 1, 2, 8), (9, 7, 41, 41, 41),
])  # fmt: skip
def test_small_and_odd_shapes_rotate_pairs_i_and_i_plus_half(
    backend, assert_matches_reference, bsz, seq_len, q_heads, kv_heads, head_dim, dtype, atol, rtol,
    expand_position_ids,
):  # fmt: skip
    """Liger's kernel pairs (i, i + D // 2) for i < D // 2 and leaves an odd head_dim's last feature alone."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(bsz, q_heads, seq_len, head_dim, generator=g).to(dtype)
    k = torch.randn(bsz, kv_heads, seq_len, head_dim, generator=g).to(dtype)
    angles = torch.rand(seq_len, head_dim // 2, generator=g) * 6.28
    half_cos, half_sin = angles.cos(), angles.sin()
    rows = bsz if expand_position_ids else 1
    # HF-style rows (rows, S, D): duplicated halves, plus one unread value when D is odd.
    cos = torch.cat([half_cos, half_cos, half_cos[:, :1]], -1)[:, :head_dim].expand(rows, -1, -1)
    sin = torch.cat([half_sin, half_sin, half_sin[:, :1]], -1)[:, :head_dim].expand(rows, -1, -1)
    got_q, got_k = liger_rotary_pos_emb(q, k, cos.to(dtype), sin.to(dtype))
    rows_cos, rows_sin, pos = as_table(half_cos.to(dtype)[None], half_sin.to(dtype)[None], (bsz, seq_len))
    for got, x in ((got_q, q), (got_k, k)):
        got, x = got.transpose(1, 2), x.transpose(1, 2)  # (batch, seq, heads, head_dim)
        assert_matches_reference(got, x, rows_cos, rows_sin, pos, interleaved=False)
        if head_dim % 2:
            assert torch.equal(got[..., -1], x[..., -1])


def test_inputs_are_never_written_and_position_ids_are_ignored(backend):
    """Liger writes into q's storage in HF's usual layout; ropekit does not (docs/compat.md)."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 6, 4, 16, generator=g).transpose(1, 2)  # HF: a transposed (B, S, H, D) projection
    k = torch.randn(2, 6, 2, 16, generator=g).transpose(1, 2)
    q_before, k_before = q.clone(), k.clone()
    cos, sin = llama_tables(16, 2, 6, True, torch.float32)
    plain = liger_rotary_pos_emb(q, k, cos, sin)
    with_ids = liger_rotary_pos_emb(q, k, cos, sin, position_ids=torch.randint(0, 50, (2, 6), generator=g))
    assert torch.equal(q, q_before) and torch.equal(k, k_before)
    assert torch.equal(plain[0], with_ids[0]) and torch.equal(plain[1], with_ids[1])
    assert plain[0].stride() == q.stride()  # the output keeps Liger's (transposed) layout


def test_errors_name_the_argument():
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    cos, sin = llama_tables(8, 1, 5, False, torch.float32)
    with pytest.raises(ValueError, match=r"^unsqueeze_dim: expected 1"):
        liger_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    with pytest.raises(ValueError, match=r"^cos: expected shape \(seq, width\), \(1 or batch, seq, width\)"):
        liger_rotary_pos_emb(q, k, cos[0, 0], sin[0, 0])
    with pytest.raises(ValueError, match=r"^rotary_dim: expected an even int in \[2, 8\], got 3"):
        liger_rotary_pos_emb(q, k, cos, sin, rotary_dim=3)
    with pytest.raises(ValueError, match=r"^cos: expected rows of at least rotary_dim / 2 = 4 values"):
        liger_rotary_pos_emb(q, k, cos[..., :3], sin[..., :3], rotary_dim=8)
    with pytest.raises(ValueError, match=r"^q: expected a 4-D tensor"):
        liger_rotary_pos_emb(q[0], k, cos, sin)
    with pytest.raises(ValueError, match=r"^cos: expected per-token rows"):
        liger_rotary_pos_emb(q, k, cos[:, :4], sin[:, :4])


def test_signature_is_ligers():
    assert signature_of(liger_rotary_pos_emb) == [
        ("q", NO_DEFAULT),
        ("k", NO_DEFAULT),
        ("cos", NO_DEFAULT),
        ("sin", NO_DEFAULT),
        ("position_ids", None),
        ("unsqueeze_dim", 1),
        ("rotary_dim", None),
        ("backend", "auto"),  # ropekit's keyword-only addition
    ]
    # the Function's forward takes the same arguments after ctx, backend positional (apply takes no keywords)
    assert signature_of(LigerRopeFunction.forward)[1:] == signature_of(liger_rotary_pos_emb)


@pytest.mark.parametrize(("dtype", "atol", "rtol"), [*DTYPE_TOL, (torch.float16, 1e-2, 1e-5)], ids=str)
@pytest.mark.parametrize(("seq_len", "num_heads", "head_dim"), [(24, 4, 16), (23, 7, 20)])
def test_vision_2d_cos_sin(backend, seq_len, num_heads, head_dim, dtype, atol, rtol):
    """A (seq, head_dim) vision table gives what HF gives with the (1, seq, head_dim) one; gradients too."""
    g = torch.Generator().manual_seed(7)
    to_4d = lambda x: x.unsqueeze(0).transpose(1, 2).contiguous()  # noqa: E731  (1, H, S, D)
    q_ = torch.randn(seq_len, num_heads, head_dim, generator=g).to(dtype)
    k_ = torch.randn(seq_len, num_heads, head_dim, generator=g).to(dtype)
    q_hf, k_hf = to_4d(q_).requires_grad_(), to_4d(k_).requires_grad_()
    q_tt, k_tt = to_4d(q_).requires_grad_(), to_4d(k_).requires_grad_()
    cos_3d, sin_3d = llama_tables(head_dim, 1, seq_len, False, dtype)
    hf_q, hf_k = apply_rotary_pos_emb(q_hf, k_hf, cos_3d, sin_3d)
    tt_q, tt_k = liger_rotary_pos_emb(q_tt, k_tt, cos_3d[0], sin_3d[0])
    assert torch.allclose(hf_q, tt_q, atol=atol, rtol=rtol)
    assert torch.allclose(hf_k, tt_k, atol=atol, rtol=rtol)
    dq, dk = torch.randn(hf_q.shape, generator=g).to(dtype), torch.randn(hf_k.shape, generator=g).to(dtype)
    hf_grads = torch.autograd.grad((hf_q, hf_k), (q_hf, k_hf), (dq, dk))
    tt_grads = torch.autograd.grad((tt_q, tt_k), (q_tt, k_tt), (dq.clone(), dk.clone()))
    for want, got in zip(hf_grads, tt_grads, strict=True):
        assert torch.allclose(want, got, atol=atol, rtol=rtol)
    # the vision entry point takes (seq, heads, head_dim) and gives the same rotation
    vis_q, vis_k = liger_rotary_pos_emb_vision(q_, k_, cos_3d[0], sin_3d[0])
    assert vis_q.shape == q_.shape and vis_q.dtype == dtype
    assert torch.allclose(vis_q, hf_q.detach()[0].transpose(0, 1), atol=atol, rtol=rtol)
    assert torch.allclose(vis_k, hf_k.detach()[0].transpose(0, 1), atol=atol, rtol=rtol)


def hf_partial_rope(q, k, cos, sin):
    """HF's partial rotation (GPT-NeoX, Phi-2, StableLM): rotate_half on the first cos.shape[-1] features."""
    from transformers.models.llama.modeling_llama import rotate_half

    cos_u, sin_u = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos_u.shape[-1]
    out = []
    for x in (q, k):
        x_rot, x_pass = x[..., :r], x[..., r:]
        out.append(torch.cat([x_rot * cos_u + rotate_half(x_rot) * sin_u, x_pass], dim=-1))
    return tuple(out)


@pytest.mark.parametrize(("dtype", "atol", "rtol"), [*DTYPE_TOL, (torch.float16, 1e-2, 1e-5)], ids=str)
@pytest.mark.parametrize(
    ("bsz", "seq_len", "q_heads", "kv_heads", "head_dim", "rotary_dim"),
    [(2, 16, 4, 4, 64, 16), (2, 16, 4, 4, 80, 20), (2, 16, 4, 2, 64, 16), (2, 16, 4, 2, 64, 32)],
)  # GPT-NeoX, Phi-2, StableLM, 50 % partial (Liger's shapes, 128 tokens and 32 heads scaled down)
def test_partial_rope_transformers_correctness(
    backend, bsz, seq_len, q_heads, kv_heads, head_dim, rotary_dim, dtype, atol, rtol
):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(bsz, q_heads, seq_len, head_dim, generator=g).to(dtype)
    k = torch.randn(bsz, kv_heads, seq_len, head_dim, generator=g).to(dtype)
    q1, k1, q2, k2 = (t.clone().requires_grad_() for t in (q, k, q, k))
    freqs = torch.randn(bsz, seq_len, rotary_dim // 2, generator=g)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    ref_q, ref_k = hf_partial_rope(q1, k1, cos, sin)
    tt_q, tt_k = liger_rotary_pos_emb(q2, k2, cos, sin)
    assert torch.allclose(ref_q, tt_q, atol=atol, rtol=rtol)
    assert torch.allclose(ref_k, tt_k, atol=atol, rtol=rtol)
    assert torch.equal(tt_q[..., rotary_dim:], q[..., rotary_dim:])  # features past rotary_dim pass through
    dq, dk = torch.randn(ref_q.shape, generator=g).to(dtype), torch.randn(ref_k.shape, generator=g).to(dtype)
    want = torch.autograd.grad((ref_q, ref_k), (q1, k1), (dq, dk))
    got = torch.autograd.grad((tt_q, tt_k), (q2, k2), (dq.clone(), dk.clone()))
    for w, t in zip(want, got, strict=True):
        assert torch.allclose(w, t, atol=atol, rtol=rtol)


@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPE_TOL, ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("bsz", "seq_len", "q_heads", "kv_heads", "head_dim"), [(1, 16, 4, 4, 32), (2, 16, 4, 2, 32)]
)
def test_gpt_oss_rope_matches_hf(backend, bsz, seq_len, q_heads, kv_heads, head_dim, dtype, atol, rtol):
    modeling_gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig

    config = GptOssConfig(
        hidden_size=q_heads * head_dim,
        head_dim=head_dim,
        num_attention_heads=q_heads,
        num_key_value_heads=kv_heads,
    )
    rotary_emb = modeling_gpt_oss.GptOssRotaryEmbedding(config)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(bsz, q_heads, seq_len, head_dim, generator=g).to(dtype)
    k = torch.randn(bsz, kv_heads, seq_len, head_dim, generator=g).to(dtype)
    q1, k1, q2, k2 = (t.clone().requires_grad_() for t in (q, k, q, k))
    cos, sin = rotary_emb(k1, torch.arange(seq_len).unsqueeze(0).expand(bsz, -1))
    assert cos.shape[-1] == head_dim // 2
    hf_q, hf_k = modeling_gpt_oss.apply_rotary_pos_emb(q1, k1, cos, sin)
    tt_q, tt_k = liger_rotary_pos_emb_gpt_oss(q2, k2, cos, sin)
    assert torch.allclose(hf_q, tt_q, atol=atol, rtol=rtol)
    assert torch.allclose(hf_k, tt_k, atol=atol, rtol=rtol)
    dq, dk = torch.randn(hf_q.shape, generator=g).to(dtype), torch.randn(hf_k.shape, generator=g).to(dtype)
    torch.autograd.backward((hf_q, hf_k), (dq, dk))
    torch.autograd.backward((tt_q, tt_k), (dq.clone(), dk.clone()))
    assert torch.allclose(q1.grad, q2.grad, atol=atol, rtol=rtol)
    assert torch.allclose(k1.grad, k2.grad, atol=atol, rtol=rtol)


@pytest.mark.parametrize("table_rank", [2, 3, 4])
@pytest.mark.parametrize(
    ("bsz", "seq_len", "q_heads", "kv_heads", "head_dim"), [(1, 2, 2, 2, 8), (3, 7, 5, 5, 20)]
)
def test_functional_correctness(backend, bsz, seq_len, q_heads, kv_heads, head_dim, table_rank):
    """``liger_rotary_pos_emb`` and ``LigerRopeFunction.apply`` agree: outputs and the gradients of q, k."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(bsz, q_heads, seq_len, head_dim, generator=g)
    k = torch.randn(bsz, kv_heads, seq_len, head_dim, generator=g)
    cos, sin = llama_tables(head_dim, bsz, seq_len, False, torch.float32)  # (1, S, D)
    if table_rank == 2:
        cos, sin = cos[0], sin[0]
    elif table_rank == 4:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q1, k1, q2, k2 = (t.clone().requires_grad_() for t in (q, k, q, k))
    f_q, f_k = liger_rotary_pos_emb(q1, k1, cos, sin)
    c_q, c_k = LigerRopeFunction.apply(q2, k2, cos, sin)
    torch.testing.assert_close(f_q, c_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(f_k, c_k, atol=1e-6, rtol=1e-6)
    dq, dk = torch.randn(f_q.shape, generator=g), torch.randn(f_k.shape, generator=g)
    want = torch.autograd.grad((f_q, f_k), (q1, k1), (dq, dk))
    got = torch.autograd.grad((c_q, c_k), (q2, k2), (dq.clone(), dk.clone()))
    for w, t in zip(want, got, strict=True):
        torch.testing.assert_close(w, t, atol=1e-6, rtol=1e-6)
    assert torch.equal(q2.detach(), q) and torch.equal(k2.detach(), k)  # inputs never written


@pytest.mark.proof
def test_agrees_with_real_liger_kernel_under_the_interpreter():
    """liger_peer_cases.py: ropekit against the installed liger-kernel, TRITON_INTERPRET=1, fresh process.
    A proof since 2026-12-08 (its fast cover was 10 CPU-s; ropekit's kernel has its own interpreter suite in
    the fast tier, and this file's other tests hold the peer's conventions there)."""
    tier = "full"
    pytest.importorskip("liger_kernel")
    here = Path(__file__).parent
    run_interpreter_cases(here / "liger_peer_cases.py", cwd=here.parent.parent, timeout=600, tier=tier)


@pytest.mark.c_compiler
@pytest.mark.parametrize("rows", ["batch", "shared"])
def test_a_steady_decode_step_is_planned_and_equals_its_checked_first_call(rows):
    """Issue 25: Liger's per-token rows (B, 1, D) or (1, 1, D) reach the core's gate as a plain table
    (ropekit.tables.plain_tables): a steady decode step is its launch plan (13 ropekit calls; 75 and 27
    before, the checked path every step), bit for bit its first (checked) call, and HF's answer."""
    from call_count import assert_planned, steady_step

    table_cos, table_sin = RopeConfig(head_dim=64).cos_sin(4096)
    at = torch.tensor([1000, 7, 4000, 300] if rows == "batch" else [1000])  # each sequence's position
    cos = torch.cat([table_cos[at]] * 2, -1)[:, None]  # (B or 1, 1, D): HF's full-width rows
    sin = torch.cat([table_sin[at]] * 2, -1)[:, None]
    g = torch.Generator().manual_seed(8)
    q, k = torch.randn(4, 8, 1, 64, generator=g), torch.randn(4, 2, 1, 64, generator=g)  # (B, H, 1, D)
    calls, first, planned = steady_step(lambda: liger_rotary_pos_emb(q, k, cos, sin, backend="cpu"))
    assert_planned(calls, 14)
    want = apply_rotary_pos_emb(q, k, cos, sin)
    for got, again, w in zip(planned, first, want, strict=True):
        assert torch.equal(got, again)
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)
