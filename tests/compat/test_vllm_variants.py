"""vLLM's rotary variants in ropekit.compat against the float64 reference (no vLLM needed).

The same classes are checked against vLLM 0.33's own in tests/engines/test_vllm_variants.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from c_compiler import CPU
from ropekit import reference as ref
from ropekit.compat.vllm import RotaryEmbedding, get_rope
from ropekit.compat.vllm_variants import (
    DeepseekV4ScalingRotaryEmbedding,
    DualChunkRotaryEmbedding,
    FourierRotaryEmbedding,
    Llama4VisionRotaryEmbedding,
    MRotaryEmbedding,
)

F32 = dict(rtol=0, atol=2e-5)  # float32 tables and math against float64, |x| ~ 1


def _qk(tokens, heads, kv_heads, head_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads * head_size, generator=g)
    k = torch.randn(tokens, kv_heads * head_size, generator=g)
    return q, k


def _heads(t, head_size):
    return t.double().numpy().reshape(t.shape[0], -1, head_size)


def test_fope_parameters_build_fope_not_a_plain_rotation():
    # Issue 28's reproduction: get_rope with FoPE's keys returned a plain RotaryEmbedding, the keys dropped.
    params = {"rope_type": "default", "use_fope": True, "num_key_value_heads": 2, "num_inv_freq": 4}
    params.update(fope_sep_head=True, fope_init_factor=0.1)
    rope = get_rope(16, 32, True, params, torch.float32)
    assert isinstance(rope, FourierRotaryEmbedding)
    assert tuple(rope.cos_sin_cache.shape) == (32, 2, 32)


@pytest.mark.parametrize(
    ("num_inv_freq", "backend"),
    [(3, "torch"), (None, "torch"), pytest.param(3, "cpu", marks=pytest.mark.c_compiler)],
)
def test_fope_matches_reference(num_inv_freq, backend):
    head_size, rotary_dim, kv_heads, heads, rows = 16, 12, 2, 4, 64
    rope = FourierRotaryEmbedding(
        head_size, rotary_dim, rows, 500.0, True, torch.float32, num_key_value_heads=kv_heads,
        num_inv_freq=num_inv_freq, backend=backend,
    )  # fmt: skip
    theta = ref.inv_freq(rotary_dim, 500.0)
    theta = theta[:num_inv_freq] if num_inv_freq else theta[theta > 2 * math.pi / rows]
    assert rope.inv_freq.shape[0] == theta.shape[0]
    g = torch.Generator().manual_seed(3)
    cos_coef = torch.randn(kv_heads, len(theta), len(theta), generator=g) * 0.5
    sin_coef = torch.randn(kv_heads, len(theta), len(theta), generator=g) * 0.5
    rope.weight_loader(rope.cos_coef, cos_coef)
    rope.weight_loader(rope.sin_coef, sin_coef)
    positions = torch.tensor([0, 5, 63, 17, 17])
    q, k = _qk(5, heads, kv_heads, head_size)
    q_out, k_out = rope.forward_native(positions, q, k)
    want_q = ref.rotate_fope(
        _heads(q, head_size), positions.numpy(), theta, cos_coef.numpy(), sin_coef.numpy()
    )
    want_k = ref.rotate_fope(
        _heads(k, head_size), positions.numpy(), theta, cos_coef.numpy(), sin_coef.numpy()
    )
    np.testing.assert_allclose(_heads(q_out, head_size), want_q, rtol=0, atol=1e-4)
    np.testing.assert_allclose(_heads(k_out, head_size), want_k, rtol=0, atol=1e-4)
    q2, k2 = q.clone(), k.clone()
    rope.forward(positions, q2, k2)  # in place: the same numbers
    torch.testing.assert_close(q2, q_out, rtol=0, atol=0)
    torch.testing.assert_close(k2, k_out, rtol=0, atol=0)


def test_fope_cache_follows_loaded_coefficients():
    rope = FourierRotaryEmbedding(8, 8, 16, 100.0, True, torch.float32, num_key_value_heads=1, num_inv_freq=2)
    rope.weight_loader(rope.cos_coef, torch.eye(2)[None])
    rope.weight_loader(rope.sin_coef, torch.eye(2)[None])
    q, k = _qk(1, 1, 1, 8)
    out, _ = rope.forward_native(torch.tensor([3]), q, k)  # identity coefficients: cos'/sin' are cos/sin
    half = rope.cos_sin_cache.shape[-1] // 2
    cos = rope.cos_sin_cache[3, 0, :2]
    assert torch.allclose(cos.double(), torch.cos(3 * torch.tensor(ref.inv_freq(8, 100.0)[:2])), atol=1e-6)
    assert torch.equal(rope.cos_sin_cache[3, 0, 2:4], torch.ones(2))  # vLLM pads with 1
    assert half == 8 and not torch.equal(out, q)


@pytest.mark.parametrize("shape", [(1, 3, 3), (1, 2), (1, 2, 3), (0, 2, 2)])
def test_fope_weight_loader_of_the_wrong_coefficient_shape_is_a_value_error(shape):
    rope = FourierRotaryEmbedding(8, 8, 16, 100.0, True, torch.float32, num_key_value_heads=1, num_inv_freq=2)
    before = rope.cos_coef.detach().clone()
    with pytest.raises(ValueError, match=r"loaded_weight: expected .*\(num_key_value_heads, 2, 2\)"):
        rope.weight_loader(rope.cos_coef, torch.ones(shape))
    assert torch.equal(rope.cos_coef, before)  # nothing written


def test_fope_weight_loader_takes_this_shards_heads():
    rope = FourierRotaryEmbedding(8, 8, 16, 100.0, True, torch.float32, num_key_value_heads=2, num_inv_freq=2)
    rope.tp_rank, rope.tp_size = 1, 2
    with pytest.raises(ValueError, match="loaded_weight"):
        rope.weight_loader(rope.cos_coef, torch.ones(2, 2, 2))  # 1 head for this shard, the module holds 2
    rope.weight_loader(rope.cos_coef, torch.arange(16.0).reshape(4, 2, 2))
    assert torch.equal(rope.cos_coef, torch.arange(8.0, 16.0).reshape(2, 2, 2))


def test_fope_refuses_gptj_pairing_and_shared_coefficients():
    with pytest.raises(ValueError, match="is_neox_style"):
        FourierRotaryEmbedding(8, 8, 16, 100.0, False, torch.float32, num_key_value_heads=1)
    with pytest.raises(ValueError, match="fope_sep_head"):
        FourierRotaryEmbedding(
            8, 8, 16, 100.0, True, torch.float32, num_key_value_heads=1, fope_sep_head=False
        )
    with pytest.raises(ValueError, match="num_key_value_heads"):
        get_rope(8, 16, True, {"use_fope": True, "num_inv_freq": 2}, torch.float32)


def _bailing_axes(section):
    t, h, w = section
    return np.array([1 + j % 2 if j < h + w else 0 for j in range(t + h + w)])


@pytest.mark.parametrize(
    ("params", "axes", "neox"),
    [
        ({"rope_type": "bailing_mrope", "mrope_section": [2, 3, 3], "rope_theta": 1000.0}, "bailing", False),
        (
            {"rope_type": "xdrope", "alpha": 1000.0, "xdrope_section": [3, 2, 2, 1], "rope_theta": 1000.0},
            "xd",
            True,
        ),
        ({"mrope_section": [4, 2, 2], "rope_theta": 1000.0}, "chunked", True),
    ],
)
@pytest.mark.parametrize("backend", ["torch", CPU])
def test_multiaxis_variants_match_reference(params, axes, neox, backend):
    head_size, rotary_dim = 20, 16
    params = {**params, "partial_rotary_factor": rotary_dim / head_size}
    rope = get_rope(head_size, 32, neox, params, torch.float32, backend=backend)
    assert isinstance(rope, MRotaryEmbedding)
    base = 1000.0 * (1000.0 ** (rotary_dim / (rotary_dim - 2)) if axes == "xd" else 1.0)
    theta = ref.inv_freq(rotary_dim, base)
    if axes == "bailing":
        axis_of_pair = _bailing_axes([2, 3, 3])
    else:
        section = params.get("xdrope_section", params.get("mrope_section"))
        axis_of_pair = np.repeat(np.arange(len(section)), section)
    g = torch.Generator().manual_seed(1)
    positions = torch.randint(0, 32, (len(set(axis_of_pair.tolist())), 7), generator=g)
    q, k = _qk(7, 3, 1, head_size)
    q_out, k_out = rope.forward_native(positions, q, k)
    pos = positions.numpy()[:, :, None]  # (axes, T, 1): one position per token, every head
    for got, x in ((q_out, q), (k_out, k)):
        want = ref.rotate_multiaxis(_heads(x, head_size), pos, theta, axis_of_pair, interleaved=not neox)
        np.testing.assert_allclose(_heads(got, head_size), want, **F32)
    q2, k2 = q.clone(), k.clone()
    rope.forward(positions, q2, k2)
    torch.testing.assert_close(q2, q_out, rtol=0, atol=0)
    # Text tokens (every axis equal) are the plain rotation.
    text = torch.arange(7)
    q_text, _ = rope.forward_native(text.expand(positions.shape[0], 7).contiguous(), q, k)
    q_plain, _ = rope.forward_native(text, q, k)
    torch.testing.assert_close(q_text, q_plain, rtol=0, atol=1e-6)


def test_multiaxis_positions_outside_the_cache_are_a_value_error():
    rope = get_rope(16, 8, False, {"rope_type": "bailing_mrope", "mrope_section": [4, 2, 2]}, torch.float32)
    q, k = _qk(2, 1, 1, 16)
    with pytest.raises(ValueError, match="positions"):
        rope.forward_native(torch.tensor([[0, 1], [0, 32], [0, 1]]), q, k)  # 8 * 4 rows
    with pytest.raises(ValueError, match="H == W"):
        get_rope(16, 8, False, {"rope_type": "bailing_mrope", "mrope_section": [2, 4, 2]}, torch.float32)


@pytest.mark.parametrize(
    ("kind", "extra", "temperature"),
    [
        (
            "deepseek_yarn",
            {"mscale": 0.7, "mscale_all_dim": 1.0},
            (0.07 * math.log(8) + 1) / (0.1 * math.log(8) + 1),
        ),
        ("deepseek_yarn", {"mscale_all_dim": 0.7}, (0.1 * math.log(8) + 1) / (0.07 * math.log(8) + 1)),
        ("telechat3-yarn", {}, 0.07 * math.log(8) + 1),
        ("telechat3-yarn", {"attn_factor": 2.0}, 2 * (0.07 * math.log(8) + 1)),
    ],
)
def test_yarn_variants_carry_their_temperature_in_the_cache(kind, extra, temperature):
    params = {"rope_type": kind, "factor": 8.0, "original_max_position_embeddings": 32, **extra}
    rope = get_rope(16, 256, True, params, torch.float64)
    cache = rope.cos_sin_cache
    assert cache.shape == (32 * 8, 16)  # original * factor rows, as vLLM's
    norm = (cache[:, :8] ** 2 + cache[:, 8:] ** 2).sqrt()
    torch.testing.assert_close(norm, torch.full_like(norm, temperature), rtol=1e-12, atol=0)


def test_deepseek_v4_rotates_the_trailing_slice_and_inverse_undoes_it():
    params = {"rope_type": "deepseek_yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    params.update(mscale=1.0, mscale_all_dim=1.0, is_deepseek_v4=True, rope_dim=8)  # tables of norm 1
    rope = get_rope(24, 64, False, params, torch.bfloat16)
    assert isinstance(rope, DeepseekV4ScalingRotaryEmbedding)
    assert rope.cos_sin_cache.dtype == torch.float32  # vLLM keeps V4's cache in float32
    q = _qk(5, 2, 1, 24)[0].view(5, 2, 24)  # (T, H, D): vLLM's V4 reads the head width off query's last axis
    positions = torch.tensor([0, 3, 9, 63, 1])
    out, none = rope.forward_native(positions, q)
    assert none is None
    # The angles of the cache's rows: the same YaRN frequencies, read back (norm 1 checked below).
    cos, sin = rope.cos_sin_cache[:, :4].double().numpy(), rope.cos_sin_cache[:, 4:].double().numpy()
    np.testing.assert_allclose(cos**2 + sin**2, 1.0, rtol=0, atol=1e-6)
    theta = np.arctan2(sin[1], cos[1])  # row 1: position 1 * theta
    x = _heads(q, 24)
    want = x.copy()
    want[..., 16:] = ref.rotate_interleaved(x[..., 16:], positions.numpy()[:, None], theta)
    np.testing.assert_allclose(_heads(out, 24), want, **F32)
    back, _ = rope.forward_native(positions, out, inverse=True)
    np.testing.assert_allclose(_heads(back, 24), x, **F32)
    torch.testing.assert_close(out[..., :16], q[..., :16], rtol=0, atol=0)  # the NoPE features pass


def test_llama4_vision_matches_reference_and_vllm_call():
    rope = get_rope(16, 16, False, {"rope_type": "mllama4", "partial_rotary_factor": 0.5}, torch.complex64)
    assert isinstance(rope, Llama4VisionRotaryEmbedding)
    assert rope.cos_sin_cache.shape == (17, 1, 8) and rope.cos_sin_cache.dtype == torch.complex64
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 17, 3, 16, generator=g), torch.randn(2, 17, 3, 16, generator=g)
    q_out, k_out = rope(q, k)
    patch = np.arange(16)
    cols = np.concatenate([patch % 4 + 1, [0]])  # class token last, not turned
    rows = np.concatenate([patch // 4 + 1, [0]])
    theta = np.concatenate([ref.inv_freq(8, 10000.0)] * 2)  # theta_i = base^(-2i / 8) for each axis
    axis_of_pair = np.repeat([0, 1], 4)
    positions = np.stack([cols, rows])[:, None, :, None]  # (2, 1, S, 1)
    for got, x in ((q_out, q), (k_out, k)):
        want = ref.rotate_multiaxis(x.double().numpy(), positions, theta, axis_of_pair, interleaved=True)
        np.testing.assert_allclose(got.double().numpy(), want, **F32)


@pytest.mark.parametrize("shape", [(2, 16, 3, 16), (2, 18, 3, 16), (2, 17, 3, 32), (17, 3, 16)])
def test_llama4_vision_query_that_is_not_one_row_per_patch_and_class_token_is_a_value_error(shape):
    rope = get_rope(16, 16, False, {"rope_type": "mllama4", "partial_rotary_factor": 0.5})
    q = torch.randn(shape)
    with pytest.raises(ValueError, match=r"query: expected \(batch, 17 tokens, heads, 16\)"):
        rope(q, q.clone())


def test_dual_chunk_roles_match_reference():
    head_size, chunk, local = 16, 12, 4
    rope = get_rope(
        head_size, 64, True, {"rope_theta": 500.0}, torch.float32, {"chunk_size": chunk, "local_size": local}
    )
    assert isinstance(rope, DualChunkRotaryEmbedding)
    positions = torch.tensor([0, 7, 8, 9, 30, 63])
    q, k = _qk(6, 2, 1, head_size)
    q_out, k_out = rope.forward_native(positions, q, k)
    assert q_out.shape == (6, 5 * 2 * head_size) and k_out.shape == k.shape
    theta, p, cl = ref.inv_freq(head_size, 500.0), positions.numpy()[:, None], chunk - local
    r = p % cl
    roles = [r, np.minimum(r + cl, chunk), np.full_like(r, min(2 * cl - 1, chunk)), r + cl, r + chunk]
    for i, role in enumerate(roles):
        got = q_out[:, i * 2 * head_size : (i + 1) * 2 * head_size]
        np.testing.assert_allclose(
            _heads(got, head_size), ref.rotate_half(_heads(q, head_size), role, theta), **F32
        )
    np.testing.assert_allclose(
        _heads(k_out, head_size), ref.rotate_half(_heads(k, head_size), p % cl, theta), **F32
    )


def test_hunyuan_dynamic_alpha_is_ntk_alpha_with_max_position_rows():
    rope = get_rope(
        16, 40, True, {"rope_type": "dynamic", "alpha": 1000.0, "rope_theta": 10000.0}, torch.float64
    )
    assert type(rope) is RotaryEmbedding and rope.cos_sin_cache.shape == (40, 16)
    theta = ref.inv_freq(16, 10000.0 * 1000.0 ** (16 / 14))
    want = np.cos(np.arange(40)[:, None] * theta)
    np.testing.assert_allclose(rope.cos_sin_cache[:, :8].numpy(), want, rtol=0, atol=1e-12)


def test_types_vllm_has_and_ropekit_does_not_mirror_are_refused():
    for kind in ("longrope", "ntk", "openpangu"):
        with pytest.raises(ValueError, match="rope_type"):
            get_rope(16, 16, True, {"rope_type": kind, "factor": 2.0}, torch.float32)


def test_rope_dim_sets_the_rotary_width_as_in_vllm():
    # vLLM's get_rope takes rope_dim before partial_rotary_factor; it was dropped with a log line.
    rope = get_rope(64, 32, True, {"rope_theta": 1e4, "rope_dim": 16, "partial_rotary_factor": 0.5})
    assert rope.rotary_dim == 16 and rope.cos_sin_cache.shape == (32, 16)
    want = np.cos(np.arange(32)[:, None] * ref.inv_freq(16, 1e4))
    np.testing.assert_allclose(rope.cos_sin_cache[:, :8].double().numpy(), want, rtol=0, atol=1e-6)


@pytest.mark.c_compiler
def test_steady_m_rope_dual_chunk_and_fope_steps_are_planned():
    """Issue 25: vLLM's M-RoPE (gathered per-token rows, now laid out by token), dual-chunk and FoPE calls
    (explicit positions) reach the core's gate: each steady step is a launch plan (17, 49 and 16 ropekit
    calls; 104, 319 and 102 before, the checked path every step), bit for bit its first call."""
    from call_count import assert_planned, steady_step

    positions = torch.tensor([40, 7, 63, 0])
    q, k = _qk(4, 2, 1, 16, seed=4)
    mrope = get_rope(16, 64, True, {"rope_theta": 500.0, "mrope_section": [2, 3, 3]}, torch.float32)
    dual = get_rope(16, 64, True, {"rope_theta": 500.0}, torch.float32, {"chunk_size": 12, "local_size": 4})
    params = {"rope_type": "default", "use_fope": True, "num_key_value_heads": 1, "num_inv_freq": 4}
    fope = get_rope(16, 64, True, {**params, "fope_sep_head": True, "fope_init_factor": 0.1}, torch.float32)
    steps = {
        "mrope": (
            lambda: mrope.forward_native(torch.stack([positions, positions.flip(0), positions]), q, k),
            18,
        ),
        "dual": (lambda: dual.forward_native(positions, q, k), 50),
        "fope": (lambda: fope.forward_native(positions, q, k), 17),
    }
    for name, (step, budget) in steps.items():
        calls, first, planned = steady_step(step)
        assert_planned(calls, budget)
        for got, again in zip(planned, first, strict=True):
            assert torch.equal(got, again), name
