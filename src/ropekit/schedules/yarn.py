"""YaRN (Peng et al. 2023, arXiv:2309.00071): interpolate the slow pairs, keep the fast ones, ramp in between.

A pair that completes more than ``beta_fast`` rotations within the original context keeps its frequency
(extrapolation); one that completes fewer than ``beta_slow`` is divided by ``factor`` (interpolation). Pair
index i is mapped to its rotation count through the inverse of r(i) = L_orig / (2 pi base^(2i/d)), and a
linear ramp blends the two regimes between those indices. The tables are then multiplied by an attention
factor (the paper's "temperature"): 0.1 ln(factor) + 1, or DeepSeek's ratio
mscale(f, mscale) / mscale(f, mscale_all_dim).
"""

from __future__ import annotations

import math

import torch

from ropekit.schedules.params import check_flag, check_length, check_value
from ropekit.schedules.registry import RopeSpec, register_schedule
from ropekit.validation import check_positive

# The paper's defaults: extrapolate pairs with > 32 rotations in the original context, interpolate those
# with < 1.
BETA_FAST = 32.0
BETA_SLOW = 1.0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """0.1 * mscale * ln(factor) + 1 for factor > 1, else 1 (YaRN's attention temperature)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def telechat3_attention_factor(factor: float, attn_factor: float = 1.0) -> float:
    """TeleChat3's YaRN temperature: (0.07 ln(factor) + 1) * attn_factor for factor > 1, else attn_factor.

    TeleChat3 is YaRN with 0.07 where the paper has 0.1 (vLLM 0.11's ``TeleChat3RoPEScaledRotaryEmbedding``,
    ``rope_type "telechat3-yarn"``); ropekit reads it as rope_type "yarn" with this ``attention_factor``.

    Raises:
        ValueError: for a factor or attn_factor that is not a finite number > 0 (named as the
            rope_parameters keys they come from).
    """
    factor = check_positive("rope_parameters['factor']", factor)
    attn_factor = check_positive("rope_parameters['attn_factor']", attn_factor)
    return (1.0 if factor <= 1 else 0.07 * math.log(factor) + 1.0) * attn_factor


def yarn_attention_factor(spec: RopeSpec) -> float:
    """The attention scaling YaRN applies to the cos/sin tables."""
    given = spec.get("attention_factor")
    if given is not None:
        return float(given)
    factor = spec.factor_or_length_ratio()
    # HF treats a zero mscale like a missing one (truthiness), and so do we, to stay equal to it.
    mscale, mscale_all_dim = spec.get("mscale"), spec.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return yarn_mscale(factor)


def correction_dim(rotations: float, dim: int, base: float, length: int) -> float:
    """The (fractional) pair index whose frequency completes `rotations` turns within `length` positions."""
    return (dim * math.log(length / (rotations * 2 * math.pi))) / (2 * math.log(base))


def ramp_bounds(spec: RopeSpec) -> tuple[float, float]:
    """The pair indices where the ramp starts (kept before it) and ends (fully interpolated after it)."""
    dim, length = spec.rotary_dim, spec.original_length()
    low = correction_dim(spec.get("beta_fast", BETA_FAST), dim, spec.base, length)
    high = correction_dim(spec.get("beta_slow", BETA_SLOW), dim, spec.base, length)
    if spec.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _validate(spec: RopeSpec) -> None:
    check_value(spec, "factor", minimum=1)  # below 1 would shrink the context, never extend it
    for key in ("beta_fast", "beta_slow", "attention_factor"):
        check_value(spec, key)
    for key in ("mscale", "mscale_all_dim"):
        check_value(spec, key, minimum=0)
    check_length(spec, "original_max_position_embeddings")
    check_flag(spec, "truncate")
    fast, slow = spec.get("beta_fast", BETA_FAST), spec.get("beta_slow", BETA_SLOW)
    if fast < slow:
        raise ValueError(f"scaling['beta_fast']: expected >= beta_slow ({slow}), got {fast}")
    spec.factor_or_length_ratio()  # raises when neither factor nor the lengths are known


@register_schedule(
    "yarn",
    # As in HF, the factor key is required but may be null: DeepSeek's configs then take the length ratio.
    required=("factor",),
    optional=(
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "truncate",
    ),
    validate=_validate,
)
def yarn(spec: RopeSpec, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    factor = spec.factor_or_length_ratio()
    pos_freqs = spec.base ** spec.exponents()
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)
    low, high = ramp_bounds(spec)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(spec.rotary_dim // 2, dtype=spec.dtype) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1 = keep the original frequency, 0 = fully interpolated
    inv_freq = interpolated * (1 - keep) + extrapolated * keep
    return inv_freq, yarn_attention_factor(spec)
