"""ropekit.compat.megatron against the cases of Megatron-Core's own tests.

Follows Megatron-LM's ``tests/unit_tests/transformer/test_rope.py`` (NVIDIA/Megatron-LM, commit 00caa53,
Megatron-Core 0.13): ``RotaryEmbedding(kv_channels, rotary_percent)`` angles of shape (seq, 1, 1, kv_channels)
in float32, applied by ``apply_rotary_pos_emb`` to sequence-first q and k cut from one packed qkv projection
(strided views, ``torch.split`` along the last axis) and compared with the reference. Megatron's test runs
only on CUDA with its fused kernel; here the reference is ropekit's float64 rotation, and the cases add what
``_apply_rotary_pos_emb_bshd`` covers: rotary_percent < 1 (the tail passes through), rotary_interleaved
(angles duplicated per pair), per-sample angles (seq, batch, 1, R), and mscale. Sizes: seq 64 -> 16,
kv_channels 128 -> 32.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ropekit.compat.megatron import apply_rotary_pos_emb, apply_rotary_pos_emb_with_cos_sin

from .conftest import NO_DEFAULT, as_table, signature_of

SEQ, BATCH, HEADS, KV_CHANNELS = 16, 2, 3, 32


def megatron_freqs(seq: int, rotary_dim: int, interleaved: bool, offsets=None) -> torch.Tensor:
    """Megatron's RotaryEmbedding.forward: angles (seq, 1, 1, R), each pair's angle for both its features."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    pos = torch.arange(seq, dtype=torch.float32)[:, None]  # (seq, 1)
    if offsets is not None:
        pos = pos + offsets[None, :]  # (seq, batch): per-sample positions
    freqs = pos[..., None] * inv_freq  # (seq, 1 or batch, R/2)
    if interleaved:
        emb = torch.stack([freqs, freqs], dim=-1).flatten(-2)  # f0 f0 f1 f1 ...
    else:
        emb = torch.cat([freqs, freqs], dim=-1)  # f0 f1 ... f0 f1 ...
    return emb[:, :, None, :]  # (seq, 1 or batch, 1, R)


@pytest.mark.parametrize("mscale", [1.0, 1.25])
@pytest.mark.parametrize("per_sample", [False, True])
@pytest.mark.parametrize("rotary_percent", [1.0, 0.5])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_packed_qkv_slices_rotate_as_the_reference(
    backend, assert_matches_reference, dtype, interleaved, rotary_percent, per_sample, mscale
):
    g = torch.Generator().manual_seed(123)
    rotary_dim = int(KV_CHANNELS * rotary_percent)
    offsets = torch.tensor([0.0, 5.0]) if per_sample else None
    freqs = megatron_freqs(SEQ, rotary_dim, interleaved, offsets)
    qkv = torch.randn(SEQ, BATCH, HEADS, KV_CHANNELS * 6, generator=g).to(dtype)
    query_in, key_in, _ = torch.split(qkv, [KV_CHANNELS * 4, KV_CHANNELS, KV_CHANNELS], dim=3)
    query_in = query_in.reshape(SEQ, BATCH, -1, KV_CHANNELS)  # (seq, batch, 4 * heads, kv_channels) view
    qkv_before = qkv.clone()
    half = freqs[..., : rotary_dim // 2] if not interleaved else freqs[..., ::2]
    angles = half[:, :, 0].transpose(0, 1).double()  # (1 or batch, seq, R/2)
    cos, sin, pos = as_table(angles.cos() * mscale, angles.sin() * mscale, (BATCH, SEQ))
    for t in (query_in, key_in):
        out = apply_rotary_pos_emb(t, freqs, rotary_interleaved=interleaved, mscale=mscale)
        assert out.shape == t.shape and out.dtype == dtype
        assert_matches_reference(
            out.transpose(0, 1), t.transpose(0, 1), cos, sin, pos, interleaved=interleaved
        )
    assert torch.equal(qkv, qkv_before)  # t is never written
    assert backend.calls > 0


def test_gradient_is_the_inverse_rotation(backend, assert_matches_reference):
    g = torch.Generator().manual_seed(1)
    t = torch.randn(SEQ, BATCH, HEADS, KV_CHANNELS, generator=g, requires_grad=True)
    freqs = megatron_freqs(SEQ, KV_CHANNELS, False)
    out = apply_rotary_pos_emb(t, freqs)
    upstream = torch.randn(out.shape, generator=g)
    out.backward(upstream)
    angles = freqs[:, :, 0, : KV_CHANNELS // 2].transpose(0, 1).double()
    cos, sin, pos = as_table(angles.cos(), angles.sin(), (BATCH, SEQ))
    assert_matches_reference(
        t.grad.transpose(0, 1), upstream.transpose(0, 1), cos, sin, pos, interleaved=False, conjugate=True
    )


@pytest.mark.parametrize("interleaved", [False, True])
def test_with_cos_sin_reads_rows_zero_to_seq(backend, assert_matches_reference, interleaved):
    """apply_rotary_pos_emb_with_cos_sin: (L, R/2) tables with L >= seq; token s reads row s."""
    g = torch.Generator().manual_seed(2)
    t = torch.randn(SEQ, BATCH, HEADS, KV_CHANNELS, generator=g)
    angles = torch.rand(SEQ + 5, 8, generator=g) * 6.28  # more rows than tokens, R = 16 < head_dim
    out = apply_rotary_pos_emb_with_cos_sin(t, angles.cos(), angles.sin(), rotary_interleaved=interleaved)
    pos = torch.arange(SEQ).expand(BATCH, SEQ).numpy()
    assert_matches_reference(
        out.transpose(0, 1), t.transpose(0, 1), angles.cos(), angles.sin(), pos, interleaved=interleaved
    )


def test_errors_name_megatron_arguments():
    t = torch.randn(SEQ, BATCH, HEADS, KV_CHANNELS)
    freqs = megatron_freqs(SEQ, KV_CHANNELS, False)
    with pytest.raises(ValueError, match=r"^freqs: expected angles of shape \(seq = 16, 1 or batch, 1"):
        apply_rotary_pos_emb(t, freqs[:8])
    with pytest.raises(ValueError, match=r"^freqs: expected a batch axis of 1 or 2"):
        apply_rotary_pos_emb(t, freqs.expand(SEQ, 3, 1, KV_CHANNELS))
    with pytest.raises(ValueError, match=r"^t: expected a 4-D tensor \(seq, batch, heads, head_dim\)"):
        apply_rotary_pos_emb(t[0], freqs)
    with pytest.raises(ValueError, match=r"^mscale: expected a finite number"):
        apply_rotary_pos_emb(t, freqs, mscale=float("nan"))
    with pytest.raises(ValueError, match=r"rotary_dim 64; expected 0 < rotary_dim <= head_dim \(32\)"):
        apply_rotary_pos_emb(t, torch.cat([freqs, freqs], -1))


def test_signature_keeps_megatrons_leading_arguments():
    assert signature_of(apply_rotary_pos_emb)[:3] == [
        ("t", NO_DEFAULT),
        ("freqs", NO_DEFAULT),
        ("rotary_interleaved", False),
    ]


def test_a_transformer_config_in_third_place_is_read_for_its_rotary_interleaved():
    """Megatron-Core 0.8+ passes its TransformerConfig where older releases passed rotary_interleaved."""

    class Config:  # the one field apply_rotary_pos_emb reads
        rotary_interleaved = True

    t = torch.randn(SEQ, BATCH, HEADS, KV_CHANNELS)
    freqs = megatron_freqs(SEQ, KV_CHANNELS, True)
    assert torch.equal(apply_rotary_pos_emb(t, freqs, Config()), apply_rotary_pos_emb(t, freqs, True))
    Config.rotary_interleaved = "yes"
    with pytest.raises(ValueError, match=r"^rotary_interleaved: expected a bool"):
        apply_rotary_pos_emb(t, freqs, Config())


def test_float64_angles_take_cos_and_sin_in_float64_before_the_cast():
    """Issue 17, repro 1: float64 freqs were cast to float32 before cos/sin, a 0.03 error at position 1e6.
    Megatron takes cos/sin in the angles' dtype, then casts; the float64 reference bounds the result."""
    from ropekit import reference as ref

    rotary = 16
    theta = ref.inv_freq(rotary)  # float64 (R/2,)
    positions = np.array([1e6, 1e6 + 1, 3e6 + 7])  # (S,)
    angles = torch.from_numpy(positions[:, None] * theta)  # (S, R/2) float64
    freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :]  # (S, 1, 1, R) float64
    t = torch.randn(3, 1, 2, rotary)  # (S, B, H, D) float32
    got = apply_rotary_pos_emb(t, freqs)
    want = ref.rotate_half(
        t.double().transpose(0, 1).numpy(), positions[None, :, None], theta
    )  # (B, S, H, D)
    np.testing.assert_allclose(got.transpose(0, 1).numpy(), want, rtol=0, atol=1e-5)  # float32's rounding


@pytest.mark.c_compiler
@pytest.mark.parametrize("interleaved", [False, True])
def test_a_steady_decode_step_is_planned_and_equals_its_checked_first_call(
    interleaved, assert_matches_reference
):
    """Issue 25: Megatron's per-token angles of one decode token (1, 1, 1, R) reach the core's gate as a
    plain table (ropekit.tables.plain_tables): the steady step is its launch plan (19 ropekit calls; 34
    before, the checked path every step; interleaved rows are every other value, a strided table the plan's
    run converts as the checked path does), bit for bit its first call and the reference."""
    from call_count import assert_planned, steady_step

    t = torch.randn(1, BATCH, HEADS, KV_CHANNELS, generator=torch.Generator().manual_seed(3))  # (S, B, H, D)
    freqs = megatron_freqs(1, KV_CHANNELS, interleaved, offsets=torch.tensor([1000.0]))  # (1, 1, 1, R)
    calls, first, planned = steady_step(lambda: apply_rotary_pos_emb(t, freqs, interleaved, backend="cpu"))
    assert_planned(calls, 20)
    assert torch.equal(planned, first)
    angles = freqs[0, 0, 0, 0::2] if interleaved else freqs[0, 0, 0, : KV_CHANNELS // 2]  # (R/2,)
    cos, sin = angles.double().cos()[None].float(), angles.double().sin()[None].float()
    assert_matches_reference(
        planned.transpose(0, 1),
        t.transpose(0, 1),
        cos,
        sin,
        np.zeros((BATCH, 1), int),
        interleaved=interleaved,
    )
