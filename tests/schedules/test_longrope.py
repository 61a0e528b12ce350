"""LongRoPE (Phi-3): short factors up to the original length, long factors past it, sqrt attention factor."""

from __future__ import annotations

import math

import pytest
import torch

from ropekit import RopeConfig
from ropekit.reference import inv_freq

DIM, BASE, ORIGINAL, MAX_POS = 16, 1e4, 64, 1024
SHORT = [1.0 + 0.1 * i for i in range(DIM // 2)]
LONG = [2.0 + 3.0 * i for i in range(DIM // 2)]


def _config(**extra) -> RopeConfig:
    scaling = {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, **extra}
    if "original_max_position_embeddings" not in extra:
        scaling["original_max_position_embeddings"] = ORIGINAL
    return RopeConfig(DIM, BASE, scaling=scaling, max_position_embeddings=MAX_POS)


SWITCH = [(None, SHORT), (1, SHORT), (ORIGINAL, SHORT), (ORIGINAL + 1, LONG), (MAX_POS, LONG)]


@pytest.mark.parametrize(("seq_len", "factors"), SWITCH)
def test_longrope_switches_to_long_factors_only_past_the_original_length(seq_len, factors):
    want = torch.from_numpy(inv_freq(DIM, BASE)) / torch.tensor(factors, dtype=torch.float64)
    torch.testing.assert_close(_config().inv_freq(seq_len), want, rtol=1e-14, atol=0)


def test_longrope_attention_factor_is_sqrt_one_plus_log_ratio():
    want = math.sqrt(1 + math.log(MAX_POS / ORIGINAL) / math.log(ORIGINAL))
    assert _config().attention_scaling() == pytest.approx(want, rel=1e-15)
    assert _config(attention_factor=1.5).attention_scaling() == 1.5


def test_longrope_tables_carry_the_attention_factor():
    config = _config()
    cos, sin = config.cos_sin(torch.arange(5), dtype=torch.float64)
    torch.testing.assert_close(cos**2 + sin**2, torch.full_like(cos, config.attention_scaling() ** 2))


@pytest.mark.parametrize("key", ["short_factor", "long_factor"])
def test_longrope_factor_list_of_the_wrong_length_names_the_key(key):
    with pytest.raises(ValueError, match=key):
        _config(**{key: [1.0] * (DIM // 2 + 1)})


def test_longrope_answers_to_phi3s_early_alias_su():
    scaling = {
        "type": "su",
        "short_factor": SHORT,
        "long_factor": LONG,
        "original_max_position_embeddings": ORIGINAL,
    }
    config = RopeConfig(DIM, BASE, scaling=scaling, max_position_embeddings=MAX_POS)
    assert config.rope_type == "longrope"
    past = ORIGINAL + 1
    torch.testing.assert_close(config.inv_freq(past), _config().inv_freq(past), rtol=0, atol=0)


def test_seq_len_zero_takes_the_short_factors_as_transformers_does():
    """Issue 24: seq_len=0 was refused; transformers' _compute_longrope_parameters takes it (``if seq_len and
    seq_len > original``: short factors, as for no seq_len). Both are called on one config."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS as HF_INIT

    from ropekit.compat.hf import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "longrope", "rope_theta": BASE, "short_factor": SHORT, "long_factor": LONG,
              "original_max_position_embeddings": ORIGINAL}  # fmt: skip
    hf = LlamaConfig(
        head_dim=DIM, hidden_size=4 * DIM, num_attention_heads=4, max_position_embeddings=MAX_POS,
        rope_parameters=params,
    )  # fmt: skip
    want, want_scale = HF_INIT["longrope"](hf, None, 0)
    got, scale = ROPE_INIT_FUNCTIONS["longrope"](hf, None, 0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)  # transformers forms them in float32
    assert scale == pytest.approx(want_scale, rel=1e-12)
    short = torch.from_numpy(inv_freq(DIM, BASE)) / torch.tensor(SHORT, dtype=torch.float64)
    torch.testing.assert_close(_config().inv_freq(0), short, rtol=1e-14, atol=0)
