"""Every schedule against transformers' ROPE_INIT_FUNCTIONS, on seeded random configs, in both config forms.

For each rope_type we draw configs (head dims, bases, partial rotary factors, every optional key present or
not), write them as a legacy config.json dict (rope_theta + rope_scaling with the old ``type`` alias) and in
the v5 ``rope_parameters`` form, and compare at seq_len below, at, just above and far above the original
length:

* inv_freq of our float64 path within 5e-6 relative of HF's float32 values;
* attention scaling exactly equal;
* with ``hf_float32_inv_freq=True``, inv_freq bit for bit equal.
"""

from __future__ import annotations

import random

import pytest
import torch

from ropekit import RopeConfig

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

CASES_PER_TYPE = 24


def _params(rng: random.Random, rope_type: str, mpe: int, pairs: int) -> dict:
    """Schedule keys for one random config; each optional key appears about half the time."""

    def maybe(key, value, out):
        if rng.random() < 0.5:
            out[key] = value

    p: dict = {}
    if rope_type in ("linear", "dynamic"):
        p["factor"] = rng.choice([rng.uniform(1.0, 16.0), float(rng.randint(2, 8))])
    elif rope_type == "yarn":
        original = mpe // rng.choice([1, 2, 4, 8])
        p["original_max_position_embeddings"] = original
        p["factor"] = rng.uniform(1.5, 40.0) if rng.random() < 0.8 or original == mpe else None
        maybe("beta_fast", rng.uniform(8, 64), p)
        maybe("beta_slow", rng.uniform(0.25, 2), p)
        maybe("truncate", rng.random() < 0.5, p)
        if rng.random() < 0.5:
            p["mscale"], p["mscale_all_dim"] = rng.uniform(0.5, 1.5), rng.uniform(0.5, 1.5)
        if rng.random() < 0.25:
            p["attention_factor"] = rng.uniform(0.5, 2.0)
    elif rope_type == "longrope":
        p["original_max_position_embeddings"] = mpe // rng.choice([2, 8, 32])
        p["short_factor"] = sorted(rng.uniform(1, 4) for _ in range(pairs))
        p["long_factor"] = sorted(rng.uniform(1, 64) for _ in range(pairs))
        maybe("factor", rng.uniform(2, 32), p)
        maybe("attention_factor", rng.uniform(0.5, 2.0), p)
    elif rope_type == "llama3":
        low = rng.uniform(0.5, 2.0)
        p.update(
            factor=rng.uniform(2, 16),
            low_freq_factor=low,
            high_freq_factor=low + rng.uniform(0.5, 6),
            original_max_position_embeddings=mpe // rng.choice([2, 4, 16]),
        )
    elif rope_type == "proportional":
        maybe("factor", rng.uniform(1, 8), p)
    return p


def _random_case(rng: random.Random, rope_type: str) -> tuple[dict, dict, int]:
    """(legacy config.json dict, v5 rope_parameters dict, the length the schedule switches at)."""
    head_dim = rng.choice([8, 16, 32, 64, 96, 128, 256])
    partial = rng.choice([1.0, 1.0, 0.5, 0.25, 0.75])
    if rope_type == "proportional":
        partial = rng.choice([0.0, 0.25, 0.5, 1.0])
    while int(head_dim * partial) % 2 or (rope_type != "proportional" and int(head_dim * partial) < 4):
        partial = 1.0
    rotary_dim = head_dim if rope_type == "proportional" else int(head_dim * partial)
    base = 10 ** rng.uniform(3, 7)
    mpe = rng.choice([512, 2048, 4096, 8192, 32768])
    params = _params(rng, rope_type, mpe, rotary_dim // 2)
    legacy = {
        "model_type": "llama",
        "hidden_size": head_dim * 4,
        "num_attention_heads": 4,
        "max_position_embeddings": mpe,
        "rope_theta": base,
        "partial_rotary_factor": partial,
        "rope_scaling": {"type": rope_type, **params},
    }
    if rope_type == "longrope" and rng.random() < 0.5:  # Phi-3 keeps the original length at the top level
        legacy["original_max_position_embeddings"] = legacy["rope_scaling"].pop(
            "original_max_position_embeddings"
        )
    v5 = {"rope_type": rope_type, "rope_theta": base, "partial_rotary_factor": partial, **params}
    v5.setdefault("original_max_position_embeddings", legacy.get("original_max_position_embeddings"))
    if v5["original_max_position_embeddings"] is None:
        del v5["original_max_position_embeddings"]
    switch = mpe if rope_type == "dynamic" else params.get("original_max_position_embeddings", mpe)
    if rope_type == "longrope":
        switch = v5["original_max_position_embeddings"]
    return legacy, v5, switch


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "yarn", "longrope", "llama3", "proportional"])
def test_inv_freq_and_attention_scaling_match_transformers(rope_type):
    rng = random.Random(f"parity-{rope_type}")
    for case in range(CASES_PER_TYPE):
        legacy, v5, switch = _random_case(rng, rope_type)
        hf_legacy = LlamaConfig(**{k: v for k, v in legacy.items() if k != "model_type"})
        hf_v5 = LlamaConfig(
            hidden_size=legacy["hidden_size"],
            num_attention_heads=4,
            max_position_embeddings=legacy["max_position_embeddings"],
            rope_parameters=dict(v5),
        )
        ours = {
            "legacy dict": RopeConfig.from_hf(legacy),
            "v5 dict": RopeConfig.from_hf({**legacy, "rope_scaling": None, "rope_parameters": v5}),
            "legacy PretrainedConfig": RopeConfig.from_hf(hf_legacy),
            "v5 PretrainedConfig": RopeConfig.from_hf(hf_v5),
        }
        exact = RopeConfig.from_hf(legacy, hf_float32_inv_freq=True)
        for seq_len in (None, max(switch // 2, 1), switch, switch + 1, 3 * switch):
            for hf_name, hf in (("legacy", hf_legacy), ("v5", hf_v5)):
                want, want_scale = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu", seq_len=seq_len)
                for name, cfg in ours.items():
                    got = cfg.inv_freq(seq_len)
                    where = f"case {case} {name} vs HF {hf_name}, seq_len={seq_len}: {v5}"
                    assert got.dtype == torch.float64
                    torch.testing.assert_close(got, want.double(), rtol=5e-6, atol=0, msg=where)
                    assert cfg.attention_scaling(seq_len) == want_scale, where
                assert torch.equal(exact.inv_freq(seq_len).float(), want), f"case {case} float32 mode: {v5}"


def test_default_matches_transformers_llama_rotary():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rng = random.Random("parity-default")
    for _ in range(CASES_PER_TYPE):
        head_dim = rng.choice([8, 16, 64, 128, 256])
        base = 10 ** rng.uniform(3, 7)
        hf = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, rope_theta=base)
        want, scale = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
        ours = RopeConfig.from_hf(hf)
        torch.testing.assert_close(ours.inv_freq(), want.double(), rtol=5e-6, atol=0)
        assert ours.attention_scaling() == scale
        assert torch.equal(RopeConfig.from_hf(hf, hf_float32_inv_freq=True).inv_freq().float(), want)
