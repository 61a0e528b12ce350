"""RotaryEmbedding against transformers' own rotary modules, end to end (q and k rotated by both).

HF forms its angles in float32, so its error grows like position * 2^-24 radians; positions here stay below
a few hundred, where that is under 1e-5, and the tolerance says so.
"""

from __future__ import annotations

import random

import pytest
import torch

from ropekit import RopeConfig, RotaryEmbedding, apply_rotary_qk

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, Phi3Config  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb  # noqa: E402
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding  # noqa: E402

HEADS, HEAD_DIM = 2, 16
TOL = {"rtol": 1e-5, "atol": 2e-5}


def _qk(seq: int, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seq)
    return (
        torch.randn(batch, HEADS, seq, HEAD_DIM, generator=g),  # (B, H, S, D): HF's layout
        torch.randn(batch, HEADS, seq, HEAD_DIM, generator=g),
    )


def _compare(ours: RotaryEmbedding, hf: torch.nn.Module, positions: torch.Tensor) -> None:
    q, k = _qk(positions.shape[-1], positions.shape[-2] if positions.dim() > 1 else 1)
    cos, sin = hf(q, positions)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = ours(q, k, positions=positions)
    where = f"max position {int(positions.max())}"
    torch.testing.assert_close(got_q, want_q, **TOL, msg=where)
    torch.testing.assert_close(got_k, want_k, **TOL, msg=where)


def _llama(rope_scaling: dict | None, mpe: int = 64, base: float = 10000.0) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        max_position_embeddings=mpe,
        rope_theta=base,
        rope_scaling=rope_scaling,
    )


@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        {"type": "linear", "factor": 4.0},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "beta_fast": 16},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ],
    ids=["default", "linear", "yarn", "llama3"],
)
def test_static_schedules_rotate_like_llama_rotary_embedding(rope_scaling):
    hf_config = _llama(rope_scaling)
    ours = RotaryEmbedding(RopeConfig.from_hf(hf_config), layout="bhsd")
    hf = LlamaRotaryEmbedding(hf_config)
    positions = torch.stack([torch.arange(40), torch.arange(40) + 100])  # (B, S), two offsets
    _compare(ours, hf, positions)


def test_dynamic_ntk_follows_hf_grow_and_reset_across_calls():
    hf_config = _llama({"rope_type": "dynamic", "factor": 4.0}, mpe=32)
    ours = RotaryEmbedding(RopeConfig.from_hf(hf_config), layout="bhsd")
    hf = LlamaRotaryEmbedding(hf_config)
    # Largest position + 1 per call: below, grow, between (kept), reset, grow, exactly at, decode steps.
    for start, length in [(0, 16), (0, 48), (0, 40), (0, 20), (0, 40), (0, 32), (40, 1), (41, 1), (0, 8)]:
        _compare(ours, hf, torch.arange(start, start + length)[None])


def test_frozen_dynamic_ntk_rotates_every_step_with_one_base():
    config = RopeConfig(HEAD_DIM, scaling={"rope_type": "dynamic", "factor": 4.0}, max_position_embeddings=32)
    rope = RotaryEmbedding(config)
    cos, sin = config.cos_sin(128, seq_len=96)  # the base for a 96-token generation
    q, k = torch.randn(1, 1, HEADS, HEAD_DIM), torch.randn(1, 1, HEADS, HEAD_DIM)  # (B, S, H, D)
    with rope.freeze(96):
        for step in (40, 60, 90):  # decode steps: each alone would pick its own base
            got = rope(q, k, offsets=step)
            want = apply_rotary_qk(q, k, cos, sin, offsets=step)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    unfrozen, _ = rope(q, k, offsets=40)
    assert not torch.allclose(unfrozen, got[0]), "outside the with block each call picks its own base again"
    assert not torch.allclose(rope(q, k, offsets=40)[0], apply_rotary_qk(q, k, cos, sin, offsets=40)[0])


def test_longrope_switches_to_long_factors_exactly_past_the_original_length():
    rng = random.Random(0)
    pairs = HEAD_DIM // 2
    hf_config = Phi3Config(
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=256,
        original_max_position_embeddings=32,
        rope_scaling={
            "type": "longrope",
            "short_factor": [rng.uniform(1, 2) for _ in range(pairs)],
            "long_factor": [rng.uniform(1, 40) for _ in range(pairs)],
        },
    )
    ours = RotaryEmbedding(RopeConfig.from_hf(hf_config), layout="bhsd")
    hf = Phi3RotaryEmbedding(hf_config)
    for start, length in [(0, 31), (0, 32), (0, 33), (32, 1), (31, 1), (0, 100), (5, 20)]:
        _compare(ours, hf, torch.arange(start, start + length)[None])
    config = RopeConfig.from_hf(hf_config)
    assert torch.equal(config.inv_freq(32), config.inv_freq(None))  # position 31 is the last short one
    assert not torch.equal(config.inv_freq(33), config.inv_freq(32))


def _mrope_positions(batch: int, seq: int) -> torch.Tensor:
    """(3, B, S): text tokens (t = h = w) around a 2 x 4 x 4 image grid, as Qwen2-VL lays them out."""
    g = torch.Generator().manual_seed(1)
    pos = torch.arange(seq).expand(3, batch, seq).clone()
    grid = torch.stack(torch.meshgrid(torch.arange(2), torch.arange(4), torch.arange(4), indexing="ij"))
    pos[:, :, 4:36] = 4 + grid.reshape(3, 1, 32)
    pos[:, :, 36:] = torch.arange(8, 8 + seq - 36)
    return pos + torch.randint(0, 5, (1, batch, 1), generator=g)


@pytest.mark.parametrize("variant", ["qwen2_vl", "qwen3_vl"])
def test_mrope_matches_hf_qwen_vl_rotary(variant):
    if variant == "qwen2_vl":
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig as Config
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding as Rotary

        scaling = {"type": "mrope", "mrope_section": [2, 3, 3]}
    else:
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig as Config
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding as Rotary

        scaling = {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    hf_config = Config(
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        head_dim=HEAD_DIM,
        rope_theta=1e6,
        rope_scaling=scaling,
    )
    config = RopeConfig.from_hf(hf_config)
    assert config.mrope_section == tuple(scaling["mrope_section"])
    assert config.mrope_interleaved == (variant == "qwen3_vl")
    positions = _mrope_positions(2, 48)
    q, k = _qk(48)
    cos, sin = Rotary(hf_config)(q, positions)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = RotaryEmbedding(config, layout="bhsd")(q, k, positions=positions)
    torch.testing.assert_close(got_q, want_q, **TOL)
    torch.testing.assert_close(got_k, want_k, **TOL)
