"""ropekit.compat.hf against transformers' own ``apply_rotary_pos_emb``.

Follows transformers 5.24 (installed): ``models/llama/modeling_llama.py``'s ``apply_rotary_pos_emb`` and
``LlamaRotaryEmbedding`` are the reference, run on the same inputs. transformers has no test file of its
own for the function; its users' test is Liger-Kernel's ``test/transformers/test_rope.py`` (commit 00fb8bf),
whose cases are used here: (bsz, seq, q heads, kv heads, head_dim) including GQA and an odd-sized shape,
position ids of batch 1 or expanded to the batch, float32 (atol = rtol = 1e-5) and bfloat16 (atol 1e-1),
forward outputs and q / k gradients against HF's. Sizes are scaled down for a 2-core CPU.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_apply_rotary_pos_emb

from ropekit.compat.hf import apply_rotary_pos_emb

from .conftest import as_table, force_backend, llama_tables, signature_of, spy_cpu_kernel

# (bsz, seq_len, num_q_heads, num_kv_heads, head_dim): Liger's grid, scaled (32 -> 8 heads, 128 -> 24 tokens).
SHAPES = [(1, 24, 8, 8, 16), (2, 24, 8, 8, 16), (1, 24, 8, 2, 16), (2, 24, 8, 2, 16), (3, 23, 7, 5, 20)]
DTYPE_TOL = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 1e-1, 1e-5)]


@pytest.mark.parametrize("expand_position_ids", [True, False])
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPE_TOL, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("bsz", "seq_len", "q_heads", "kv_heads", "head_dim"), SHAPES)
def test_outputs_and_gradients_match_transformers(
    backend, bsz, seq_len, q_heads, kv_heads, head_dim, dtype, atol, rtol, expand_position_ids
):
    g = torch.Generator().manual_seed(0)
    # HF's layout: (bsz, heads, seq, head_dim) views of (bsz, seq, heads, head_dim) projections.
    q = torch.randn(bsz, seq_len, q_heads, head_dim, generator=g).transpose(1, 2).to(dtype)
    k = torch.randn(bsz, seq_len, kv_heads, head_dim, generator=g).transpose(1, 2).to(dtype)
    cos, sin = llama_tables(head_dim, bsz, seq_len, expand_position_ids, dtype)
    q1, k1 = q.clone().requires_grad_(), k.clone().requires_grad_()
    q2, k2 = q.clone().requires_grad_(), k.clone().requires_grad_()
    hf_q, hf_k = hf_apply_rotary_pos_emb(q1, k1, cos, sin)
    got_q, got_k = apply_rotary_pos_emb(q2, k2, cos, sin)
    assert got_q.dtype == dtype and got_q.shape == hf_q.shape and got_q.stride() == q2.stride()
    assert torch.allclose(got_q, hf_q, atol=atol, rtol=rtol)
    assert torch.allclose(got_k, hf_k, atol=atol, rtol=rtol)
    dq, dk = torch.randn(hf_q.shape, generator=g).to(dtype), torch.randn(hf_k.shape, generator=g).to(dtype)
    want = torch.autograd.grad((hf_q, hf_k), (q1, k1), (dq, dk))
    got = torch.autograd.grad((got_q, got_k), (q2, k2), (dq, dk))
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, atol=atol, rtol=rtol)
    assert torch.equal(q2, q) and torch.equal(k2, k)  # inputs untouched
    assert backend.calls > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_result_is_the_float64_rotation_by_the_tables_first_halves(backend, assert_matches_reference, dtype):
    """Closer to exact than HF's bf16 arithmetic: one rounding of float32 math, reading cos[..., :D/2]."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 9, 16, generator=g).to(dtype)  # (batch, heads, seq, head_dim)
    k = torch.randn(2, 2, 9, 16, generator=g).to(dtype)
    cos, sin = llama_tables(16, 2, 9, True, dtype)
    got_q, got_k = apply_rotary_pos_emb(q, k, cos, sin)
    rows_cos, rows_sin, pos = as_table(cos[..., :8], sin[..., :8], (2, 9))
    for got, x in ((got_q, q), (got_k, k)):
        assert_matches_reference(
            got.transpose(1, 2), x.transpose(1, 2), rows_cos, rows_sin, pos, interleaved=False
        )


@pytest.mark.parametrize("rope_parameters", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16, "rope_theta": 500000.0},
], ids=["yarn", "llama3"])  # fmt: skip
def test_scaled_tables_are_used_as_given(backend, rope_parameters):
    """YaRN's attention scaling lives in HF's cos / sin: the tables are read, never recomputed."""
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 4, 30, 16, generator=g), torch.randn(1, 2, 30, 16, generator=g)
    cos, sin = llama_tables(16, 1, 30, False, torch.float32, rope_parameters)
    want = hf_apply_rotary_pos_emb(q, k, cos, sin)
    got = apply_rotary_pos_emb(q, k, cos, sin)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("table_rank", [3, 2])
def test_unsqueeze_dim_selects_the_heads_axis_as_in_transformers(backend, table_rank):
    """unsqueeze_dim=2 (or 1 for an (S, D) table) is HF's (batch, seq, heads, head_dim) form."""
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 7, 4, 16, generator=g), torch.randn(2, 7, 2, 16, generator=g)  # (b, s, h, d)
    cos, sin = llama_tables(16, 2, 7, True, torch.float32)
    dim = 2
    if table_rank == 2:
        cos, sin, dim = cos[0], sin[0], 1  # (seq, head_dim), shared by the batch
    want = hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=dim)
    got = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=dim)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # and the bhsd form of a 2-D table: unsqueeze_dim=0
    if table_rank == 2:
        qt, kt = q.transpose(1, 2), k.transpose(1, 2)
        want = hf_apply_rotary_pos_emb(qt, kt, cos, sin, unsqueeze_dim=0)
        got = apply_rotary_pos_emb(qt, kt, cos, sin, unsqueeze_dim=0)
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)


def test_full_width_table_is_read_where_it_lies(monkeypatch):
    """The CPU kernel receives the caller's own table memory and q / k where they lie in HF's transposed
    layout: nothing is rebuilt or made contiguous."""
    force_backend(monkeypatch, "cpu")
    seen = spy_cpu_kernel(monkeypatch)
    q, k = torch.randn(2, 4, 9, 16), torch.randn(2, 2, 9, 16)
    cos, sin = llama_tables(16, 2, 9, True, torch.float32)
    apply_rotary_pos_emb(q, k, cos, sin)
    got = (seen["q"], seen["k"], seen["cos"], seen["sin"])
    assert got == (q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr())


def test_errors_name_the_argument_and_the_expected_shape():
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    cos, sin = llama_tables(8, 1, 5, False, torch.float32)
    with pytest.raises(ValueError, match=r"^cos: expected rows as wide as head_dim \(8\)"):
        apply_rotary_pos_emb(q, k, cos[..., :4], sin[..., :4])
    with pytest.raises(ValueError, match=r"^unsqueeze_dim: 3 makes cos"):
        apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=3)
    with pytest.raises(ValueError, match=r"^unsqueeze_dim: expected an int"):
        apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1.0)
    with pytest.raises(ValueError, match=r"^cos: expected per-token rows of shape \(batch, seq, width\)"):
        apply_rotary_pos_emb(q, k, cos[:, :3], sin[:, :3])
    with pytest.raises(ValueError, match=r"^k: expected a 4-D tensor"):
        apply_rotary_pos_emb(q, k[0], cos, sin)


def test_signature_is_transformers():
    assert signature_of(apply_rotary_pos_emb) == signature_of(hf_apply_rotary_pos_emb)


def test_compiles_with_fullgraph():
    """The mapping is views and one core call: torch.compile keeps it in one graph."""
    q, k = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16)
    cos, sin = llama_tables(16, 2, 5, True, torch.float32)
    compiled = torch.compile(apply_rotary_pos_emb, backend="aot_eager", fullgraph=True)
    for got, want in zip(compiled(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin), strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
