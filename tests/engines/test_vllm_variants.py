"""ropekit.compat's vLLM variants against vLLM 0.33's own classes (the engines environment only).

Oracle: vLLM's Python classes, built by its own ``get_rope`` inside ``set_current_vllm_config(VllmConfig())``
with ``VLLM_TARGET_DEVICE=cpu``. Each case compares vLLM's ``cos_sin_cache`` with ropekit's and vLLM's
``forward_native`` with ropekit's, in float32, and both with ropekit's float64 reference: ropekit must be at
least as close to the reference as vLLM is (plus the float32 rounding of one rotation).

vLLM 0.33 no longer ships TeleChat3's and HunYuan-VL's classes (vLLM 0.11's ``telechat3_scaling_rope.py`` and
``xdrope.py``); their oracles are the 0.33 classes those were built from, named in each test. vLLM's
``DualChunkRotaryEmbedding.__init__`` needs an accelerator; its own ``_compute_cos_sin_cache`` and
``forward_native`` are run on an instance whose attributes are set as that ``__init__`` sets them.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
import vllm.config as vllm_config
import vllm.model_executor.layers.rotary_embedding as vllm_rope

from ropekit import reference as ref
from ropekit.compat import vllm as rk

pytestmark = pytest.mark.engine

APPLY_ATOL = 2e-5  # one float32 rotation of |x| ~ 3


def _atol(rows: int, scale: float = 1.0) -> float:
    """vLLM forms p * theta in float32 (relative error 2^-24 per operation, p < rows); ropekit in float64,
    rounded once. Entries of |value| <= scale then differ by up to about 2 * rows * 2^-24 * scale."""
    return (2 * rows * 2.0**-24 + 2e-7) * scale


def _same_cache(ours, theirs, scale=1.0):
    torch.testing.assert_close(ours, theirs, rtol=0, atol=_atol(theirs.shape[0], scale))


def _vllm(*args, **kwargs):
    """vLLM's own class, even when ropekit's plugin is registered in this process (test_vllm_plugin.py loads
    it): the oracle is built with the plugin's entries out of vLLM's registry, and fresh (get_rope caches
    each configuration's module)."""
    from vllm.model_executor import custom_op

    registry = custom_op.op_registry_oot
    ours = {name: cls for name, cls in registry.items() if cls.__module__.startswith("ropekit.")}
    try:
        for name in ours:
            del registry[name]
        with vllm_config.set_current_vllm_config(vllm_config.VllmConfig()):
            vllm_rope._ROPE_DICT.clear()
            return vllm_rope.get_rope(*args, **kwargs)
    finally:
        registry.update(ours)
        vllm_rope._ROPE_DICT.clear()


def _qk(tokens, heads, kv_heads, head_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, heads * head_size, generator=g), torch.randn(
        tokens, kv_heads * head_size, generator=g
    )


def _heads(t, head_size):
    return t.double().numpy().reshape(t.shape[0], -1, head_size)


def _close_to_reference(ours, theirs, want, head_size, atol=0.0):
    """ropekit equals vLLM in float32, and is no farther from the float64 reference than vLLM (+ rounding)."""
    torch.testing.assert_close(ours, theirs, rtol=0, atol=APPLY_ATOL + 5 * atol)
    err_ours = np.abs(_heads(ours, head_size) - want).max()
    err_theirs = np.abs(_heads(theirs, head_size) - want).max()
    assert err_ours <= err_theirs + APPLY_ATOL, (err_ours, err_theirs)


@pytest.mark.parametrize("section", [[4, 6, 6], [8, 4, 4]])
def test_bailing_mrope_equals_vllm(section):
    head_size, params = 32, {"rope_type": "bailing_mrope", "mrope_section": section, "rope_theta": 5000.0}
    theirs = _vllm(head_size, 64, False, params, torch.float32)
    ours = rk.get_rope(head_size, 64, False, params, torch.float32)
    assert type(theirs).__name__ == "BailingMRotaryEmbedding"
    _same_cache(ours.cos_sin_cache, theirs.cos_sin_cache)
    g = torch.Generator().manual_seed(2)
    positions = torch.randint(0, 256, (3, 9), generator=g)
    q, k = _qk(9, 4, 2, head_size)
    t, h, w = section
    axis_of_pair = np.array([1 + j % 2 if j < h + w else 0 for j in range(t + h + w)])
    theta = ref.inv_freq(head_size, 5000.0)
    for got, want_from, x in zip(
        ours.forward_native(positions, q, k), theirs.forward_native(positions, q, k), (q, k), strict=True
    ):
        want = ref.rotate_multiaxis(
            _heads(x, head_size), positions.numpy()[:, :, None], theta, axis_of_pair, True
        )
        _close_to_reference(got, want_from, want, head_size, _atol(256))


@pytest.mark.parametrize("interleaved", [False, True])
def test_mrope_equals_vllm(interleaved):
    head_size = 32
    params = {"mrope_section": [6, 5, 5], "mrope_interleaved": interleaved, "rope_theta": 1e6}
    theirs = _vllm(head_size, 32, True, params, torch.float32)
    ours = rk.get_rope(head_size, 32, True, params, torch.float32)
    _same_cache(ours.cos_sin_cache, theirs.cos_sin_cache)
    positions = torch.randint(0, 128, (3, 6), generator=torch.Generator().manual_seed(4))
    q, k = _qk(6, 2, 1, head_size)
    for got, other in zip(
        ours.forward_native(positions, q, k), theirs.forward_native(positions, q, k), strict=True
    ):
        torch.testing.assert_close(
            got, other, rtol=0, atol=APPLY_ATOL + 5 * _atol(ours.cos_sin_cache.shape[0])
        )


def test_xdrope_equals_vllm_ntk_alpha_cache_split_by_sections():
    # vLLM 0.11's XDRotaryEmbedding = DynamicNTKAlphaRotaryEmbedding's cache, each section taking its own
    # row of the (4, T) positions: vLLM 0.33's DynamicNTKAlpha cache in its MRotaryEmbedding's split.
    head_size, section, alpha = 32, [4, 4, 4, 4], 1000.0
    ours = rk.get_rope(
        head_size, 64, True, {"rope_type": "xdrope", "alpha": alpha, "xdrope_section": section}, torch.float32
    )
    alpha_rope = _vllm(head_size, 64, True, {"rope_type": "dynamic", "alpha": alpha}, torch.float32)
    assert type(alpha_rope).__name__ == "DynamicNTKAlphaRotaryEmbedding"
    _same_cache(ours.cos_sin_cache, alpha_rope.cos_sin_cache)
    split = _vllm(head_size, 64, True, {"mrope_section": section}, torch.float32, mrope_positions_factor=1)
    split.cos_sin_cache = alpha_rope.cos_sin_cache.clone()
    positions = torch.randint(0, 64, (4, 7), generator=torch.Generator().manual_seed(5))
    q, k = _qk(7, 4, 1, head_size)
    base = 10000.0 * alpha ** (head_size / (head_size - 2))
    theta, axis_of_pair = ref.inv_freq(head_size, base), np.repeat(np.arange(4), section)
    for got, other, x in zip(
        ours.forward_native(positions, q, k), split.forward_native(positions, q, k), (q, k), strict=True
    ):
        want = ref.rotate_multiaxis(_heads(x, head_size), positions.numpy()[:, :, None], theta, axis_of_pair)
        _close_to_reference(got, other, want, head_size, _atol(64))


@pytest.mark.parametrize("num_inv_freq", [5, None])
def test_fope_equals_vllm(num_inv_freq):
    head_size, kv_heads, heads, rows = 32, 2, 4, 128
    params = {"rope_type": "default", "use_fope": True, "num_key_value_heads": kv_heads, "rope_theta": 500.0}
    params.update(num_inv_freq=num_inv_freq, fope_sep_head=True, fope_init_factor=0.1)
    theirs = _vllm(head_size, rows, True, params, torch.float32)
    ours = rk.get_rope(head_size, rows, True, params, torch.float32)
    assert type(theirs).__name__ == type(ours).__name__ == "FourierRotaryEmbedding"
    torch.testing.assert_close(ours.inv_freq.float(), theirs.inv_freq, rtol=1e-6, atol=0)
    f = theirs.inv_freq.shape[0]
    g = torch.Generator().manual_seed(7)
    cos_coef, sin_coef = (
        torch.randn(kv_heads, f, f, generator=g) * 0.3,
        torch.randn(kv_heads, f, f, generator=g) * 0.3,
    )
    theirs.cos_coef.data.copy_(cos_coef)
    theirs.sin_coef.data.copy_(sin_coef)
    ours.weight_loader(ours.cos_coef, cos_coef)
    ours.weight_loader(ours.sin_coef, sin_coef)
    positions = torch.tensor([0, 1, 77, 127, 3, 3])
    q, k = _qk(6, heads, kv_heads, head_size)
    theirs_q, theirs_k = theirs.forward_native(positions, q, k)  # builds vLLM's cache on its first call
    ours_q, ours_k = ours.forward_native(positions, q, k)
    torch.testing.assert_close(ours.cos_sin_cache, theirs.cos_sin_cache, rtol=0, atol=1e-5)
    theta = ours.inv_freq.numpy()
    for got, other, x in ((ours_q, theirs_q, q), (ours_k, theirs_k, k)):
        want = ref.rotate_fope(
            _heads(x, head_size), positions.numpy(), theta, cos_coef.numpy(), sin_coef.numpy()
        )
        torch.testing.assert_close(got, other.reshape(got.shape), rtol=0, atol=1e-4)
        assert (
            np.abs(_heads(got, head_size) - want).max()
            <= np.abs(_heads(other, head_size) - want).max() + 1e-4
        )


def test_fope_without_separate_heads_fails_in_vllm_too():
    # ropekit refuses fope_sep_head=False with a ValueError; vLLM cannot run it either.
    params = {"use_fope": True, "num_key_value_heads": 2, "num_inv_freq": 4, "fope_sep_head": False}
    params["fope_init_factor"] = 0.1
    with pytest.raises(RuntimeError):
        _vllm(16, 32, True, params, torch.float32)
    with pytest.raises(ValueError, match="fope_sep_head"):
        rk.get_rope(16, 32, True, params, torch.float32)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"mscale": 0.707, "mscale_all_dim": 0.707},
        {"mscale": 1.0, "mscale_all_dim": 0.8},
        {"mscale_all_dim": 1.0},
    ],
)
def test_deepseek_yarn_equals_vllm(extra):
    head_size, rotary_dim = 48, 32
    params = {
        "rope_type": "deepseek_yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 1e4,
    }
    params.update(extra, rope_dim=rotary_dim, beta_fast=32, beta_slow=1)
    theirs = _vllm(head_size, 64 * 40, False, params, torch.float32)
    ours = rk.get_rope(head_size, 64 * 40, False, params, torch.float32)
    assert type(theirs).__name__ == "DeepseekScalingRotaryEmbedding"
    _same_cache(ours.cos_sin_cache, theirs.cos_sin_cache, scale=2.0)
    positions = torch.tensor([0, 5, 2559, 1000])
    q, k = (t.view(4, 2, head_size) for t in _qk(4, 2, 2, head_size))  # vLLM's DeepSeek class takes (T, H, D)
    for got, other in zip(
        ours.forward_native(positions, q, k), theirs.forward_native(positions, q, k), strict=True
    ):
        torch.testing.assert_close(got, other, rtol=0, atol=1e-4)  # the cache carries mscale ~ 1.4


@pytest.mark.parametrize("inverse", [False, True])
def test_deepseek_v4_equals_vllm(inverse):
    params = {"rope_type": "deepseek_yarn", "factor": 16.0, "original_max_position_embeddings": 64}
    params.update(rope_theta=160000.0, mscale=1.0, mscale_all_dim=1.0, is_deepseek_v4=True, rope_dim=16)
    theirs = _vllm(64, 1024, False, params, torch.bfloat16)
    ours = rk.get_rope(64, 1024, False, params, torch.bfloat16)
    assert type(theirs).__name__ == type(ours).__name__ == "DeepseekV4ScalingRotaryEmbedding"
    _same_cache(ours.cos_sin_cache, theirs.cos_sin_cache)
    q = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(8))
    positions = torch.tensor([0, 1, 63, 1023, 500])
    got, _ = ours.forward_native(positions, q, None, inverse=inverse)
    other, _ = theirs.forward_native(positions, q, None, inverse=inverse)
    torch.testing.assert_close(got, other, rtol=0, atol=APPLY_ATOL + 5 * _atol(ours.cos_sin_cache.shape[0]))


def test_telechat3_yarn_equals_vllm_yarn_with_its_temperature():
    # vLLM 0.11's TeleChat3RoPEScaledRotaryEmbedding is its YaRN class with mscale 0.07 ln(f) + 1 (times
    # attn_factor): vLLM 0.33's YaRN class with that attention_factor.
    factor, original = 8, 128
    theirs = _vllm(
        64, original * factor, True,
        {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
         "attention_factor": 0.07 * math.log(factor) + 1.0},
        torch.float32,
    )  # fmt: skip
    ours = rk.get_rope(
        64, original * factor, True,
        {"rope_type": "telechat3-yarn", "factor": factor, "original_max_position_embeddings": original},
        torch.float32,
    )  # fmt: skip
    _same_cache(ours.cos_sin_cache, theirs.cos_sin_cache)


def test_hunyuan_dynamic_alpha_equals_vllm():
    params = {"rope_type": "dynamic", "alpha": 1000.0, "rope_theta": 10000.0}
    theirs = _vllm(128, 512, True, params, torch.float32)
    ours = rk.get_rope(128, 512, True, params, torch.float32)
    _same_cache(ours.cos_sin_cache, theirs.cos_sin_cache)
    positions = torch.tensor([0, 7, 511])
    q, k = _qk(3, 2, 1, 128)
    for got, other in zip(
        ours.forward_native(positions, q, k), theirs.forward_native(positions, q, k), strict=True
    ):
        torch.testing.assert_close(
            got, other, rtol=0, atol=APPLY_ATOL + 5 * _atol(ours.cos_sin_cache.shape[0])
        )


@pytest.mark.parametrize(("head_size", "side"), [(16, 4), (88, 24)])
def test_llama4_vision_equals_vllm(head_size, side):
    # Issue 26: "from_hf on a Llama 4 vision config differs from vLLM's class (128 of 136 entries at a 4x4
    # grid with the class token)". Settled here: ropekit's tables and rotation equal vLLM's.
    params = {"rope_type": "mllama4", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    theirs = _vllm(head_size, side * side, False, params, torch.complex64)
    ours = rk.get_rope(head_size, side * side, False, params, torch.complex64)
    _same_cache(ours.cos_sin_cache, theirs.cos_sin_cache)
    q = torch.randn(2, side * side + 1, 3, head_size, generator=torch.Generator().manual_seed(9))
    k = torch.randn_like(q)
    for got, other in zip(ours(q, k), theirs.forward_native(q, k), strict=True):
        torch.testing.assert_close(
            got, other, rtol=0, atol=APPLY_ATOL + 5 * _atol(ours.cos_sin_cache.shape[0])
        )
    from ropekit import RopeConfig
    from ropekit.multiaxis import llama4_vision_positions

    hf = {"model_type": "llama4_vision_model", "hidden_size": head_size * 16, "num_attention_heads": 16}
    config = RopeConfig.from_hf({**hf, "rope_theta": 10000.0})
    cos, sin = config.cos_sin(llama4_vision_positions(side, 1)[:, None], dtype=torch.float64)
    table = torch.complex(cos[0], sin[0]).to(torch.complex64)[:, None]  # (N + 1, 1, R)
    _same_cache(table, theirs.cos_sin_cache)


def test_dual_chunk_equals_vllm_own_tables_and_forward():
    cls = vllm_rope.DualChunkRotaryEmbedding
    head_size, rotary_dim, rows, chunk, local = 32, 32, 96, 24, 8
    with vllm_config.set_current_vllm_config(vllm_config.VllmConfig()):
        theirs = cls.__new__(cls)
        torch.nn.Module.__init__(theirs)
    values = dict(head_size=head_size, rotary_dim=rotary_dim, max_position_embeddings=rows, base=5000.0)
    values.update(is_neox_style=True, chunk_size=chunk, local_size=local, dtype=torch.float32, device="cpu")
    for name, value in values.items():  # what its __init__ sets, with the CPU for its CUDA device
        setattr(theirs, name, value)
    caches = theirs._compute_cos_sin_cache()
    names = ("cos_sin_q_cache", "cos_sin_qc_cache", "cos_sin_k_cache", "cos_sin_qc_no_clamp_cache")
    for name, cache in zip((*names, "cos_sin_q_inter_cache"), caches, strict=True):
        theirs.register_buffer(name, cache, persistent=False)
    ours = rk.get_rope(
        head_size,
        rows,
        True,
        {"rope_theta": 5000.0},
        torch.float32,
        {"chunk_size": chunk, "local_size": local},
    )
    for name in (*names, "cos_sin_q_inter_cache"):
        torch.testing.assert_close(getattr(ours, name), getattr(theirs, name), rtol=0, atol=_atol(rows))
    positions = torch.tensor([0, 15, 16, 17, 40, 95])
    q, k = _qk(6, 2, 2, head_size)
    for got, other in zip(
        ours.forward_native(positions, q, k), theirs.forward_native(positions, q, k), strict=True
    ):
        torch.testing.assert_close(got, other, rtol=0, atol=APPLY_ATOL + 5 * _atol(rows))


def test_mrope_with_yarn_equals_vllm():
    # vLLM measures the YaRN ramp against original * mrope_positions_factor (its enlarged cache length).
    params = {
        "mrope_section": [6, 5, 5],
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    params["rope_theta"] = 1e6
    theirs = _vllm(32, 256, True, params, torch.float32)
    ours = rk.get_rope(32, 256, True, params, torch.float32)
    assert theirs.cos_sin_cache.shape == ours.cos_sin_cache.shape == (64 * 4 * 4, 32)
    _same_cache(ours.cos_sin_cache, theirs.cos_sin_cache, scale=1.2)
    positions = torch.randint(0, 1024, (3, 6), generator=torch.Generator().manual_seed(4))
    q, k = _qk(6, 2, 1, 32)
    for got, other in zip(
        ours.forward_native(positions, q, k), theirs.forward_native(positions, q, k), strict=True
    ):
        torch.testing.assert_close(got, other, rtol=0, atol=APPLY_ATOL + 5 * _atol(1024))
