"""LongRoPE (Ding et al. 2024, arXiv:2402.13753), as shipped by Phi-3: searched per-pair rescale factors.

theta_i = base^(-2i/d) / ext_i, where ext is ``short_factor`` while
seq_len <= original_max_position_embeddings and ``long_factor`` beyond it (seq_len = largest position + 1, so
position L_orig is the first one served by the long factors). The attention factor is
sqrt(1 + ln f / ln L_orig) with f = max_position_embeddings / L_orig, unless
``factor`` or ``attention_factor`` say otherwise.
"""

from __future__ import annotations

import math

import torch

from ropekit.schedules.params import check_factor_list, check_length, check_value
from ropekit.schedules.registry import RopeSpec, register_schedule


def longrope_attention_factor(spec: RopeSpec) -> float:
    given = spec.get("attention_factor")
    if given is not None:
        return float(given)
    original = spec.original_length()
    factor = spec.factor_or_length_ratio()
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original))


def _validate(spec: RopeSpec) -> None:
    check_factor_list(spec, "short_factor", spec.rotary_dim // 2)
    check_factor_list(spec, "long_factor", spec.rotary_dim // 2)
    check_value(spec, "factor", minimum=1)  # below 1 would shrink the context, never extend it
    check_value(spec, "attention_factor", minimum=0)
    check_length(spec, "original_max_position_embeddings")
    longrope_attention_factor(spec)  # raises when the lengths are unknown


@register_schedule(
    "longrope",
    required=("short_factor", "long_factor"),
    optional=("original_max_position_embeddings", "factor", "attention_factor"),
    validate=_validate,
    length_dependent=True,
    aliases=("su",),  # Phi-3's first configs named it "su"
)
def longrope(spec: RopeSpec, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    use_long = seq_len is not None and seq_len > spec.original_length()
    ext = torch.tensor(spec.params["long_factor" if use_long else "short_factor"], dtype=spec.dtype)
    inv_freq = 1.0 / (ext * spec.base ** spec.exponents())
    return inv_freq, longrope_attention_factor(spec)
