"""The QK-norm + RoPE cases on the Triton kernel, through Triton's CPU interpreter.

Run only by test_qk_norm.py, in a subprocess with TRITON_INTERPRET=1 (Triton reads it when the kernel module
is imported). The interpreter is slow, so each case is one small call: every form and dtype once, every
position form, both pair layouts with partial rotary, the gradients, and a bad row.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from qk_norm_cases import (
    FORMS,
    LAYOUTS,
    check_bad_row_writes_nothing,
    check_gradients_match_unfused,
    check_matches_reference,
)

from ropekit.backends.triton.rotary import interpreter_enabled

pytestmark = pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (the runner)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", list(FORMS))
def test_triton_each_form_matches_the_float64_composition(dtype, form):
    check_matches_reference("triton", dtype, form, "offsets_per_seq")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_every_position_form(layout):
    check_matches_reference("triton", torch.float32, "qwen3", layout)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("form", ["qwen3", "olmo2"])
def test_triton_pair_layouts_with_partial_rotary(interleaved, form):
    check_matches_reference("triton", torch.float32, form, "positions", interleaved=interleaved, rotary_dim=8)


@pytest.mark.parametrize("form", list(FORMS))
def test_triton_gradients_equal_the_unfused_compositions(form):
    check_gradients_match_unfused("triton", torch.float32, form)


def test_triton_bad_row_writes_nothing():
    check_bad_row_writes_nothing("triton")


def test_triton_kernel_fails_a_launch_with_a_row_outside_the_table_itself(monkeypatch):
    """With the host check off, the QK-norm kernel's own check: a row past the table reads row 0 instead and
    fails the launch (the interpreter's launcher raises when the kernel returns; compiled, the kernel
    traps)."""
    from ropekit.backends.c.qk_norm import NormSpec
    from ropekit.backends.triton import qk_norm as qk_norm_triton
    from ropekit.backends.triton import rotary as triton_backend
    from rotary_reference import reference_tables

    monkeypatch.setattr(triton_backend, "HOST_CHECKS", False)
    cos, sin = reference_tables(8, 16)
    spec = NormSpec(2, 1, 8, 1e-6, 0.0, False, True, False)
    qkv = torch.randn(1, 2, 4 * 8)  # (batch, seq, (q_heads + 2 * k_heads) * head_dim)
    weight = torch.ones(8)
    with pytest.raises(RuntimeError, match="outside the cos/sin table"):
        qk_norm_triton.launch(qkv, weight, weight, cos, sin, torch.tensor([2, 16]), 0, spec)
    qk_norm_triton.launch(qkv, weight, weight, cos, sin, torch.tensor([2, 15]), 0, spec)  # the flag was reset


PREFILL_SEQ = 131  # 2 x 131 = 262 tokens: a prefill grid (PREFILL_BLOCK_T a program) with a short last block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("form", ["qwen3", "olmo2"])
def test_triton_prefill_grid_matches_the_float64_composition_and_the_torch_backend(form, interleaved, dtype):
    """Issue 25: a prefill of 262 tokens takes PREFILL_BLOCK_T tokens a program; every token, the short last
    block's too, equals the float64 composition to the dtype's tolerance and the torch backend's result (to
    rounding); v is untouched."""
    from qk_norm_cases import reference, tolerance

    from ropekit import qk_norm_rotary_
    from ropekit.backends.triton import fused as fused_triton
    from ropekit.backends.triton.rotary_kernel import PREFILL_TOKENS
    from rotary_reference import reference_tables

    assert 2 * PREFILL_SEQ >= PREFILL_TOKENS and 2 * PREFILL_SEQ % fused_triton.PREFILL_BLOCK_T != 0
    head_dim, q_heads, k_heads = 16, 4, 2
    g = torch.Generator().manual_seed(5)
    qkv = (torch.randn(2, PREFILL_SEQ, (q_heads + 2 * k_heads) * head_dim, generator=g) * 3).to(dtype)
    norm = "all_heads" if form == "olmo2" else "head"
    features = (q_heads * head_dim, k_heads * head_dim) if norm == "all_heads" else (head_dim, head_dim)
    q_weight, k_weight = ((1 + 0.5 * torch.randn(f, generator=g)).to(dtype) for f in features)
    cos, sin = reference_tables(head_dim, 256)
    kw = dict(num_q_heads=q_heads, num_kv_heads=k_heads, head_dim=head_dim, eps=1e-6, norm=norm)
    kw |= dict(weight_offset=0.0, offsets=torch.tensor([3, 100]), interleaved=interleaved)
    positions = np.arange(PREFILL_SEQ)[None] + np.array([[3], [100]])
    want = reference(qkv, q_weight, k_weight, cos, sin, kw, positions, interleaved=interleaved)
    torch_result = qk_norm_rotary_(qkv.clone(), q_weight, k_weight, cos, sin, backend="torch", **kw)
    v_start = (q_heads + k_heads) * head_dim
    before = qkv.clone()
    qk_norm_rotary_(qkv, q_weight, k_weight, cos, sin, backend="triton", **kw)
    assert torch.equal(qkv[..., v_start:], before[..., v_start:])
    torch.testing.assert_close(qkv.double(), want, **tolerance(dtype, float(want.abs().max())))
    torch.testing.assert_close(qkv, torch_result, **tolerance(dtype, float(want.abs().max())))
