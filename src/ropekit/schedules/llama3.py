"""Llama 3.1's wavelength-banded scaling (Meta, 2024).

With L = original_max_position_embeddings: pairs whose wavelength 2 pi / theta_i is shorter than
L / high_freq_factor keep their frequency; pairs longer than L / low_freq_factor are divided by ``factor``; in
between, s = (L / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor) blends the two,
theta_i * ((1 - s) / factor + s). No attention scaling.
"""

from __future__ import annotations

import math

import torch

from ropekit.schedules.params import check_length, check_value
from ropekit.schedules.registry import RopeSpec, register_schedule


def _validate(spec: RopeSpec) -> None:
    check_value(spec, "factor", minimum=1, required=True)  # below 1 would shrink the context, never extend it
    for key in ("low_freq_factor", "high_freq_factor"):
        check_value(spec, key, required=True)
    check_length(spec, "original_max_position_embeddings")
    spec.original_length()
    low, high = spec.params["low_freq_factor"], spec.params["high_freq_factor"]
    if high <= low:
        raise ValueError(f"scaling['high_freq_factor']: expected > low_freq_factor ({low}), got {high}")


@register_schedule(
    "llama3",
    required=("factor", "low_freq_factor", "high_freq_factor"),
    optional=("original_max_position_embeddings",),
    validate=_validate,
)
def llama3(spec: RopeSpec, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    inv_freq = spec.default_inv_freq()
    factor = spec.params["factor"]
    low_ff, high_ff = spec.params["low_freq_factor"], spec.params["high_freq_factor"]
    original = spec.original_length()
    low_freq_wavelen, high_freq_wavelen = original / low_ff, original / high_ff
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0
