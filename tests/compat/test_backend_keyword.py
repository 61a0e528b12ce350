"""Every compat entry point takes ropekit's ``backend=`` and honours it.

The peers' signatures have no backend argument; each ropekit mirror adds one, keyword-only after the peer's
own parameters (the last positional argument of ``LigerRopeFunction.apply``, which takes no keywords; a
constructor argument for modules). This file lists one small call per entry point, proves the named backend
is the one the core dispatched to, and that an unknown name is a ValueError naming ``backend``. A new public
name in a compat module must join CALLS or NOT_ROTATIONS, or test_every_public_name_is_covered fails.

The seams: every core entry asks :func:`ropekit.backends.select_backend` for its backend, imported by name
into ropekit.functional (the rotations), ropekit.fused.cache, ropekit.fused.fp8 and ropekit.fused.qk_norm;
the fused ops then run their launch on the chosen backend object (``launch_fused``, ``launch_qk_norm``),
which are watched too, so a fused call also proves that the kernel launched is the one named.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import ropekit.backends.plan
import ropekit.functional
import ropekit.fused.cache
import ropekit.fused.fp8
import ropekit.fused.qk_norm
from c_compiler import CPU
from ropekit.backends import BACKENDS
from ropekit.compat import (
    flash_attn,
    flashinfer,
    hf,
    liger,
    megatron,
    rotary_embedding_torch,
    torchtune,
    transformer_engine,
    vllm,
)

MODULES = [
    flash_attn, flashinfer, hf, liger, megatron, rotary_embedding_torch, torchtune, transformer_engine, vllm,
]  # fmt: skip

# Public names that rotate nothing, so have no backend to choose.
NOT_ROTATIONS = {
    "hf.ROPE_INIT_FUNCTIONS": "frequencies and attention factor only",
    "hf.rope_config_validation": "reads a config",
}


def _tables(rows: int, half: int):
    angle = torch.rand(rows, half) * 6.28
    return angle.cos(), angle.sin()


def _hf_rows(seq: int, dim: int):
    cos, sin = _tables(seq, dim // 2)
    return torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]  # (1, S, D)


def _te_freqs(rows: int, d2: int) -> torch.Tensor:
    """TE's angles (rows, 1, 1, d2): each pair's angle written for both its features, cat(f, f)."""
    f = torch.rand(rows, d2 // 2) * 6.28
    return torch.cat([f, f], -1)[:, None, None]


def _flashinfer_calls(cache: torch.Tensor) -> dict:
    """FlashInfer's fused FP8 ops on 5 tokens, 3 q heads, one kv head, rope_dim 16, float32 [cos | sin]."""
    fp8 = torch.float8_e4m3fn
    q, k, pos = (lambda: torch.randn(5, 3, 16)), (lambda: torch.randn(5, 1, 16)), torch.arange(5)
    # One sequence on pages [1, 0] of 4 entries each: tokens 0-3 fill page 1, token 4 starts page 0.
    table = (torch.tensor([1, 0]), torch.tensor([0, 2]), torch.zeros(5, dtype=torch.long), torch.arange(5))
    paged = lambda: (torch.zeros(2, 4, 1, 16, dtype=fp8), torch.zeros(2, 4, 1, 16, dtype=fp8))  # noqa: E731
    return {
        "flashinfer.rope_quantize_fp8": lambda b: flashinfer.rope_quantize_fp8(
            q(), k(), None, None, cache, pos, backend=b
        ),
        "flashinfer.mla_rope_quantize_fp8": lambda b: flashinfer.mla_rope_quantize_fp8(
            q(), torch.randn(5, 16), torch.randn(5, 3, 8), torch.randn(5, 8), cache, pos, backend=b
        ),
        "flashinfer.rope_quantize_fp8_append_paged_kv_cache": lambda b: (
            flashinfer.rope_quantize_fp8_append_paged_kv_cache(
                q(), k(), None, None, k(), cache, pos, paged(), *table, page_size=4, backend=b
            )
        ),
    }


def _calls():
    cos, sin = _tables(16, 8)
    hf_cos, hf_sin = _hf_rows(5, 16)
    cache = torch.cat(_tables(32, 8), dim=-1)
    bhsd = lambda heads: torch.randn(2, heads, 5, 16)  # noqa: E731
    freqs = torch.rand(5, 2, 1, 16)
    vllm_args = lambda: (torch.arange(5), torch.randn(5, 3 * 16), torch.randn(5, 16), 16, cache)  # noqa: E731
    return {
        **_flashinfer_calls(cache),
        "flashinfer.apply_rope_with_cos_sin_cache": lambda b: flashinfer.apply_rope_with_cos_sin_cache(
            *vllm_args(), backend=b
        ),
        "flashinfer.apply_rope_with_cos_sin_cache_inplace": lambda b: (
            flashinfer.apply_rope_with_cos_sin_cache_inplace(*vllm_args(), backend=b)
        ),
        "transformer_engine.apply_rotary_pos_emb": lambda b: transformer_engine.apply_rotary_pos_emb(
            torch.randn(5, 2, 3, 16), _te_freqs(5, 16), backend=b
        ),
        "transformer_engine.apply_fused_qkv_rotary_pos_emb": lambda b: (
            transformer_engine.apply_fused_qkv_rotary_pos_emb(
                torch.randn(5, 2, 2, 64), _te_freqs(5, 16), _te_freqs(5, 16), [32, 16, 16], backend=b
            )
        ),
        "vllm.fused_qk_norm_rope": lambda b: vllm.fused_qk_norm_rope(
            *(torch.randn(5, 6 * 16), 4, 1, 1, 16, 1e-6, torch.ones(16), torch.ones(16), cache, True),
            torch.arange(5),
            backend=b,
        ),
        "flash_attn.apply_rotary_emb": lambda b: flash_attn.apply_rotary_emb(
            torch.randn(2, 5, 3, 16), cos, sin, backend=b
        ),
        "flash_attn.apply_rotary_emb_qkv_": lambda b: flash_attn.apply_rotary_emb_qkv_(
            torch.randn(2, 5, 3, 3, 16), cos, sin, backend=b
        ),
        "flash_attn.apply_rotary_emb_kv_": lambda b: flash_attn.apply_rotary_emb_kv_(
            torch.randn(2, 5, 2, 3, 16), cos, sin, backend=b
        ),
        "flash_attn.RotaryEmbedding": lambda b: flash_attn.RotaryEmbedding(16, backend=b)(
            torch.randn(2, 5, 3, 3, 16)
        ),
        "hf.apply_rotary_pos_emb": lambda b: hf.apply_rotary_pos_emb(
            bhsd(4), bhsd(2), hf_cos, hf_sin, backend=b
        ),
        "liger.liger_rotary_pos_emb": lambda b: liger.liger_rotary_pos_emb(
            bhsd(4), bhsd(2), hf_cos, hf_sin, backend=b
        ),
        "liger.liger_rotary_pos_emb_gpt_oss": lambda b: liger.liger_rotary_pos_emb_gpt_oss(
            bhsd(4), bhsd(2), hf_cos[..., :8], hf_sin[..., :8], backend=b
        ),
        "liger.liger_rotary_pos_emb_vision": lambda b: liger.liger_rotary_pos_emb_vision(
            torch.randn(5, 3, 16), torch.randn(5, 3, 16), hf_cos[0], hf_sin[0], backend=b
        ),
        "liger.LigerRopeFunction": lambda b: liger.LigerRopeFunction.apply(
            bhsd(4), bhsd(2), hf_cos, hf_sin, None, 1, None, b
        ),
        "megatron.apply_rotary_pos_emb": lambda b: megatron.apply_rotary_pos_emb(
            torch.randn(5, 2, 3, 16), freqs, backend=b
        ),
        "megatron.apply_rotary_pos_emb_with_cos_sin": lambda b: megatron.apply_rotary_pos_emb_with_cos_sin(
            torch.randn(5, 2, 3, 16), cos, sin, backend=b
        ),
        "rotary_embedding_torch.RotaryEmbedding": lambda b: rotary_embedding_torch.RotaryEmbedding(
            16, backend=b
        ).rotate_queries_or_keys(bhsd(3)),
        "rotary_embedding_torch.apply_rotary_emb": lambda b: rotary_embedding_torch.apply_rotary_emb(
            torch.rand(5, 16), bhsd(3), backend=b
        ),
        "torchtune.RotaryPositionalEmbeddings": lambda b: torchtune.RotaryPositionalEmbeddings(16, backend=b)(
            torch.randn(2, 5, 3, 16)
        ),
        "torchtune.Llama3ScaledRoPE": lambda b: torchtune.Llama3ScaledRoPE(16, backend=b)(
            torch.randn(2, 5, 3, 16)
        ),
        "torchtune.Phi3RotaryPositionalEmbeddings": lambda b: torchtune.Phi3RotaryPositionalEmbeddings(
            16, backend=b
        )(torch.randn(2, 5, 3, 16)),
        "torchtune.VisionRotaryPositionalEmbeddings": lambda b: torchtune.VisionRotaryPositionalEmbeddings(
            4, 8, 2, 8, backend=b
        )(torch.randn(2, 10, 3, 16)),
        "vllm.rotary_embedding": lambda b: vllm.rotary_embedding(
            torch.arange(5), torch.randn(5, 3 * 16), torch.randn(5, 16), 16, cache, True, backend=b
        ),
        "vllm.apply_rope_with_cos_sin_cache": lambda b: vllm.apply_rope_with_cos_sin_cache(
            torch.arange(5), torch.randn(5, 3 * 16), torch.randn(5, 16), 16, cache, backend=b
        ),
        "vllm.apply_rope_with_cos_sin_cache_inplace": lambda b: vllm.apply_rope_with_cos_sin_cache_inplace(
            torch.arange(5), torch.randn(5, 3 * 16), torch.randn(5, 16), 16, cache, backend=b
        ),
        "vllm.get_rope": lambda b: vllm.get_rope(16, 32, True, {"rope_theta": 10000.0}, backend=b)(
            torch.arange(5), torch.randn(5, 3 * 16), torch.randn(5, 16)
        ),
        "vllm.RotaryEmbedding": lambda b: vllm.RotaryEmbedding(
            16, 16, 32, 10000, True, torch.float32, backend=b
        )(torch.arange(5), torch.randn(5, 3 * 16), torch.randn(5, 16)),
    }


CALLS = _calls()


def test_every_public_name_is_covered():
    public = {f"{m.__name__.rsplit('.', 1)[1]}.{name}" for m in MODULES for name in m.__all__}
    assert public == set(CALLS) | set(NOT_ROTATIONS)


# The core modules that call select_backend by the name they imported (see the module docstring).
SELECTING = [ropekit.functional, ropekit.fused.cache, ropekit.fused.fp8, ropekit.fused.qk_norm]


def _signatures():
    """(public name, signature) of every compat function and module constructor that takes backend."""
    for m in MODULES:
        for name in m.__all__:
            try:
                sig = inspect.signature(getattr(m, name))  # a class: its constructor's
            except (TypeError, ValueError):
                continue
            if "backend" in sig.parameters:
                yield f"{m.__name__.rsplit('.', 1)[1]}.{name}", sig


def test_backend_is_keyword_only_after_the_peers_parameters():
    checked = dict(_signatures())
    assert {"flashinfer.rope_quantize_fp8", "transformer_engine.apply_rotary_pos_emb",
            "vllm.fused_qk_norm_rope", "vllm.RotaryEmbedding"} <= set(checked)  # fmt: skip
    for label, sig in checked.items():
        param = sig.parameters["backend"]
        assert param.kind is inspect.Parameter.KEYWORD_ONLY, label
        assert param.default == "auto", label


@pytest.fixture
def requested(monkeypatch) -> list[str]:
    """The backend name each core dispatch was asked for."""
    seen: list[str] = []
    original = ropekit.functional.select_backend

    def select(name, q, cos, **needs):
        seen.append(name)
        return original(name, q, cos, **needs)

    for module in SELECTING:
        assert module.select_backend is original
        monkeypatch.setattr(module, "select_backend", select)
    monkeypatch.setattr(ropekit.backends.plan, "_plans", {})  # a launch plan would skip select_backend
    return seen


@pytest.fixture
def launched(monkeypatch) -> list[str]:
    """The backend name each fused kernel launch ran on."""
    seen: list[str] = []
    for name in ("torch", "cpu"):
        backend = BACKENDS[name]
        for method in ("launch_fused", "launch_qk_norm"):
            original = getattr(backend, method)

            def launch(*args, _name=name, _original=original, **kwargs):
                seen.append(_name)
                return _original(*args, **kwargs)

            monkeypatch.setattr(backend, method, launch)
    return seen


# The entry points that run on ropekit.fused's kernels (the others run on ropekit.functional's).
FUSED = {"flashinfer.rope_quantize_fp8", "flashinfer.mla_rope_quantize_fp8",
         "flashinfer.rope_quantize_fp8_append_paged_kv_cache", "vllm.fused_qk_norm_rope"}  # fmt: skip


@pytest.mark.parametrize("backend_name", ["torch", CPU])
@pytest.mark.parametrize("entry", list(CALLS))
def test_named_backend_is_the_one_dispatched(entry, backend_name, requested, launched):
    CALLS[entry](backend_name)
    assert requested and set(requested) == {backend_name}
    assert set(launched) == ({backend_name} if entry in FUSED else set())


@pytest.mark.parametrize("entry", list(CALLS))
def test_unknown_backend_is_a_value_error_naming_it(entry):
    with pytest.raises(ValueError, match=r"backend"):
        CALLS[entry]("no-such-backend")
