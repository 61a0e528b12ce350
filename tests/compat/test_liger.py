"""ropekit.compat.liger against the cases of Liger-Kernel's own tests.

Follows Liger-Kernel's ``test/transformers/test_rope.py`` (linkedin/Liger-Kernel, commit 00fb8bf, 0.6):
``test_correctness`` (HF's ``apply_rotary_pos_emb`` and ``LlamaRotaryEmbedding`` tables as the reference;
(bsz, seq, q heads, kv heads, head_dim) with equal heads, GQA and odd-sized shapes; position ids (1, S) or
expanded to (B, S); float32 with atol = rtol = 1e-5 and bfloat16 with atol 1e-1, rtol 1e-5; outputs and q / k
gradients) and ``test_functional_correctness`` (the small and odd shapes (1, 2, 2, 2, 8), (1, 2, 1, 2, 8),
(9, 7, 41, 41, 41), where head_dim 41 rotates pairs (i, i + 20) and keeps feature 40). Sizes scaled for a
2-core CPU (32 heads -> 8, 128 tokens -> 24, 423 -> 23).
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ropekit.compat.liger import liger_rotary_pos_emb

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
    with pytest.raises(ValueError, match=r"^cos: expected shape \(1 or batch, seq, head_dim = 8\)"):
        liger_rotary_pos_emb(q, k, cos[0], sin[0])
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
    ]
