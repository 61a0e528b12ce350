"""Every compat entry point takes ropekit's ``backend=`` and honours it.

The peers' signatures have no backend argument; each ropekit mirror adds one, keyword-only after the peer's
own parameters (the last positional argument of ``LigerRopeFunction.apply``, which takes no keywords; a
constructor argument for modules). This file lists one small call per entry point, proves the named backend
is the one the core dispatched to, and that an unknown name is a ValueError naming ``backend``. A new public
name in a compat module must join CALLS or NOT_ROTATIONS, or test_every_public_name_is_covered fails.
"""

from __future__ import annotations

import pytest
import torch

import ropekit.functional
from ropekit.compat import flash_attn, hf, liger, megatron, rotary_embedding_torch, torchtune, vllm

MODULES = [flash_attn, hf, liger, megatron, rotary_embedding_torch, torchtune, vllm]

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


def _calls():
    cos, sin = _tables(16, 8)
    hf_cos, hf_sin = _hf_rows(5, 16)
    cache = torch.cat(_tables(32, 8), dim=-1)
    bhsd = lambda heads: torch.randn(2, heads, 5, 16)  # noqa: E731
    freqs = torch.rand(5, 2, 1, 16)
    return {
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


@pytest.fixture
def requested(monkeypatch) -> list[str]:
    """The backend name each core dispatch was asked for."""
    seen: list[str] = []
    original = ropekit.functional.select_backend

    def select(name, q, cos):
        seen.append(name)
        return original(name, q, cos)

    monkeypatch.setattr(ropekit.functional, "select_backend", select)
    return seen


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
@pytest.mark.parametrize("entry", list(CALLS))
def test_named_backend_is_the_one_dispatched(entry, backend_name, requested):
    CALLS[entry](backend_name)
    assert requested and set(requested) == {backend_name}


@pytest.mark.parametrize("entry", list(CALLS))
def test_unknown_backend_is_a_value_error_naming_it(entry):
    with pytest.raises(ValueError, match=r"backend"):
        CALLS[entry]("no-such-backend")
