"""ropekit.compat.liger against the real Liger-Kernel, whose Triton kernel runs on the CPU under Triton's
interpreter. Run only by test_liger.py's ``test_agrees_with_real_liger_kernel_under_the_interpreter``, in a
fresh process with TRITON_INTERPRET=1 (Triton decides at import whether kernels compile or interpret).

The cases are those of Liger's ``test/transformers/test_rope.py`` (see test_liger.py), small: every
table form Liger accepts ((S, W) vision, (1, S, W), (B, S, W), (1, 1, S, W)), partial rows, GPT-OSS's
half-width rows with rotary_dim, the vision entry point, and ``LigerRopeFunction``'s gradients. Liger
computes in float32 from float32 inputs, so the two agree to float32 rounding.
"""

from __future__ import annotations

import pytest
import torch

from ropekit.backends.triton.rotary import interpreter_enabled
from ropekit.compat import liger as ropekit_liger

pytestmark = pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (see the runner)")
liger_ops = pytest.importorskip("liger_kernel.ops.rope")
liger_transformers = pytest.importorskip("liger_kernel.transformers.rope")

TOL = dict(atol=1e-5, rtol=1e-5)


def hf_layout(g, bsz, heads, seq, head_dim):
    """A (B, H, S, D) view of a contiguous (B, S, H, D) projection, HF's usual layout."""
    return torch.randn(bsz, seq, heads, head_dim, generator=g).transpose(1, 2)


def tables(g, rows, seq, width, duplicated=True):
    angle = torch.rand(rows, seq, width // 2 if duplicated else width, generator=g) * 6.28
    if duplicated:
        angle = torch.cat([angle, angle], dim=-1)
    return angle.cos(), angle.sin()


@pytest.mark.parametrize("form", ["2d", "1sw", "bsw", "4d"])
@pytest.mark.parametrize(("width", "head_dim"), [(16, 16), (8, 16)])  # full and partial rows
def test_liger_rotary_pos_emb_matches_liger(form, width, head_dim):
    g = torch.Generator().manual_seed(11)
    bsz, seq = 2, 5
    q, k = hf_layout(g, bsz, 4, seq, head_dim), hf_layout(g, bsz, 2, seq, head_dim)
    cos, sin = tables(g, bsz if form == "bsw" else 1, seq, width)
    if form == "2d":
        cos, sin = cos[0], sin[0]
    elif form == "4d":
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    got_q, got_k = ropekit_liger.liger_rotary_pos_emb(q, k, cos, sin)
    want_q, want_k = liger_transformers.liger_rotary_pos_emb(q.clone(), k.clone(), cos, sin)
    torch.testing.assert_close(got_q, want_q, **TOL)
    torch.testing.assert_close(got_k, want_k, **TOL)


def test_gpt_oss_half_width_rows_match_liger():
    g = torch.Generator().manual_seed(12)
    q, k = hf_layout(g, 2, 4, 5, 16), hf_layout(g, 2, 2, 5, 16)
    cos, sin = tables(g, 2, 5, 8, duplicated=False)  # (B, S, D / 2): one value per pair
    got = ropekit_liger.liger_rotary_pos_emb_gpt_oss(q, k, cos, sin)
    want = liger_transformers.liger_rotary_pos_emb_gpt_oss(q.clone(), k.clone(), cos, sin)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_vision_entry_point_matches_liger():
    g = torch.Generator().manual_seed(13)
    q, k = torch.randn(6, 3, 16, generator=g), torch.randn(6, 3, 16, generator=g)
    cos, sin = tables(g, 1, 6, 16)
    got = ropekit_liger.liger_rotary_pos_emb_vision(q, k, cos[0], sin[0])
    want = liger_transformers.liger_rotary_pos_emb_vision(q.clone(), k.clone(), cos[0], sin[0])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("rank", [2, 3])
def test_rope_function_outputs_and_gradients_match_liger(rank):
    g = torch.Generator().manual_seed(14)
    q, k = hf_layout(g, 2, 4, 5, 16), hf_layout(g, 2, 2, 5, 16)
    cos, sin = tables(g, 1, 5, 16)
    if rank == 2:
        cos, sin = cos[0], sin[0]
    q1, k1 = q.contiguous().requires_grad_(), k.contiguous().requires_grad_()
    q2, k2 = q.contiguous().requires_grad_(), k.contiguous().requires_grad_()
    got = ropekit_liger.LigerRopeFunction.apply(q1, k1, cos, sin)
    # Liger's Function writes into the storage of its (contiguous) inputs: give it clones of the leaves.
    want = liger_ops.LigerRopeFunction.apply(q2.clone(), k2.clone(), cos, sin)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    dq, dk = torch.randn(q.shape, generator=g), torch.randn(k.shape, generator=g)
    torch.autograd.backward(got, (dq, dk))
    torch.autograd.backward(want, (dq.clone(), dk.clone()))
    torch.testing.assert_close(q1.grad, q2.grad, **TOL)
    torch.testing.assert_close(k1.grad, k2.grad, **TOL)
