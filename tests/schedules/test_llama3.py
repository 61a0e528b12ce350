"""Llama 3.1 scaling: short wavelengths kept, long ones divided by factor, a linear blend in between."""

from __future__ import annotations

import math

import pytest
import torch

from ropekit import RopeConfig
from ropekit.reference import inv_freq

LLAMA31 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _bands(dim=128, base=5e5, params=LLAMA31):
    plain = torch.from_numpy(inv_freq(dim, base))
    got = RopeConfig(dim, base, scaling=params).inv_freq()
    wavelength = 2 * math.pi / plain
    original = params["original_max_position_embeddings"]
    short = wavelength < original / params["high_freq_factor"]
    long = wavelength > original / params["low_freq_factor"]
    return plain, got, wavelength, short, long


def test_llama3_keeps_short_wavelengths_and_divides_long_ones_by_factor():
    plain, got, _, short, long = _bands()
    assert short.any() and long.any()  # the Llama 3.1 geometry has pairs in both bands
    torch.testing.assert_close(got[short], plain[short], rtol=1e-15, atol=0)  # 1 ulp: pow vs reciprocal
    torch.testing.assert_close(got[long], plain[long] / LLAMA31["factor"], rtol=1e-15, atol=0)
    assert RopeConfig(128, 5e5, scaling=LLAMA31).attention_scaling() == 1.0


def test_llama3_blends_the_middle_band_by_the_papers_smoothing_factor():
    plain, got, wavelength, short, long = _bands()
    middle = ~short & ~long
    assert middle.any()
    s = (LLAMA31["original_max_position_embeddings"] / wavelength[middle] - 1.0) / (4.0 - 1.0)
    want = (1 - s) * plain[middle] / LLAMA31["factor"] + s * plain[middle]
    torch.testing.assert_close(got[middle], want, rtol=1e-12, atol=0)


def test_llama3_frequencies_stay_sorted_and_between_the_two_extremes():
    plain, got, *_ = _bands()
    assert torch.all(got[1:] < got[:-1])
    assert torch.all(got <= plain * (1 + 1e-15))
    assert torch.all(got >= plain / LLAMA31["factor"] * (1 - 1e-15))


def test_llama3_rejects_high_freq_factor_not_above_low_freq_factor():
    with pytest.raises(ValueError, match=r"high_freq_factor"):
        RopeConfig(128, 5e5, scaling={**LLAMA31, "high_freq_factor": 1.0})


def test_llama3_without_original_length_anywhere_is_a_value_error():
    params = {k: v for k, v in LLAMA31.items() if k != "original_max_position_embeddings"}
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        RopeConfig(128, 5e5, scaling=params)
