"""DeepSeek-V4's shared key-value RoPE: against transformers' own functions and the float64 reference."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from c_compiler import CPU
from ropekit import RopeConfig
from ropekit import reference as ref
from ropekit.shared_kv import rotate_shared_kv, unrotate_output

HEAD_DIM, ROTARY = 48, 16  # V4-Flash: 512 and 64; the layout, not the size, is what is tested
CONFIG = RopeConfig(HEAD_DIM, 160000.0, rotary_dim=ROTARY, interleaved=True)


def _inputs(batch=2, seq=7, heads=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, HEAD_DIM, generator=g, dtype=torch.float64)
    kv = torch.randn(batch, seq, 1, HEAD_DIM, generator=g, dtype=torch.float64)
    return q, kv


@pytest.mark.parametrize("backend", ["torch", CPU])
def test_rotations_equal_transformers_deepseek_v4(backend):
    v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    q, kv = _inputs()
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [9, 10, 11, 40, 41, 42, 43]])
    cos, sin = CONFIG.cos_sin(60, dtype=torch.float32)
    q32, kv32 = q.float(), kv.float()
    got_q, got_kv = rotate_shared_kv(q32, kv32, cos, sin, positions=positions, backend=backend)
    hf_cos, hf_sin = cos[positions], sin[positions]  # (B, S, R/2), what DeepseekV4RotaryEmbedding returns
    want_q = v4.apply_rotary_pos_emb(q32.transpose(1, 2), hf_cos, hf_sin).transpose(1, 2)
    want_kv = v4.apply_rotary_pos_emb(kv32.transpose(1, 2), hf_cos, hf_sin).transpose(1, 2)
    torch.testing.assert_close(got_q, want_q, rtol=0, atol=2e-6)
    torch.testing.assert_close(got_kv, want_kv, rtol=0, atol=2e-6)
    out = torch.randn_like(q32)  # the attention output, (B, S, H, D)
    got_out = unrotate_output(out, cos, sin, positions=positions, backend=backend)
    want_out = v4.apply_rotary_pos_emb(out.transpose(1, 2), hf_cos, -hf_sin).transpose(1, 2)
    torch.testing.assert_close(got_out, want_out, rtol=0, atol=2e-6)


def test_attention_with_rotated_values_matches_reference_and_is_shift_invariant():
    q, kv = _inputs(batch=1, seq=6)
    cos, sin = CONFIG.cos_sin(200, dtype=torch.float64)
    scale = HEAD_DIM**-0.5
    outs = []
    for shift in (0, 150):
        positions = torch.arange(6)[None] + shift
        rq, rkv = rotate_shared_kv(q, kv, cos, sin, positions=positions, backend="torch")
        scores = torch.einsum("bihd,bjd->bhij", rq, rkv[:, :, 0]) * scale
        scores = scores.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
        out = torch.einsum("bhij,bjd->bihd", scores.softmax(-1), rkv[:, :, 0])
        out = unrotate_output(out, cos, sin, positions=positions, backend="torch")
        theta = ref.inv_freq(ROTARY, 160000.0)
        want = ref.shared_kv_attention(q[0].numpy(), kv[0, :, 0].numpy(), positions[0].numpy(), theta, scale)
        np.testing.assert_allclose(out[0].numpy(), want, rtol=0, atol=1e-12)
        outs.append(out)
    # Values turned by p_j and the output by -p_i: only p_j - p_i remains, so a shift changes nothing.
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-10)


def test_without_the_output_rotation_the_result_depends_on_absolute_position():
    q, kv = _inputs(batch=1, seq=4)
    cos, sin = CONFIG.cos_sin(200, dtype=torch.float64)
    outs = []
    for shift in (0, 150):
        positions = torch.arange(4)[None] + shift
        _, rkv = rotate_shared_kv(q, kv, cos, sin, positions=positions, backend="torch")
        outs.append(rkv[:, :1, 0])  # the first token's value, as the first query reads it
    assert not torch.allclose(outs[0], outs[1])


def test_the_public_api_exposes_rotate_shared_kv_and_unrotate_output():
    """`import ropekit` alone gives both: ropekit.rotate_shared_kv, ropekit.shared_kv.* (docs/scaling.md)."""
    script = (
        "import ropekit\n"
        "assert ropekit.rotate_shared_kv is ropekit.shared_kv.rotate_shared_kv\n"
        "assert ropekit.unrotate_output is ropekit.shared_kv.unrotate_output\n"
        "assert {'rotate_shared_kv', 'unrotate_output'} <= set(ropekit.__all__)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
