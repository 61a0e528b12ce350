"""The QK-norm + RoPE cases on the Triton kernel, through Triton's CPU interpreter.

Run only by test_qk_norm.py, in a subprocess with TRITON_INTERPRET=1 (Triton reads it when the kernel module
is imported). The interpreter is slow, so each case is one small call: every form and dtype once, every
position form, both pair layouts with partial rotary, the gradients, and a bad row.
"""

from __future__ import annotations

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
