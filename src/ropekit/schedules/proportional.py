"""Proportional RoPE (p-RoPE, Barbero et al. 2024): only the fastest share of the pairs rotates.

With d = rotary_dim (HF: the head width) and p = partial_rotary_factor, the first int(p * d / 2) pairs get
theta_i = base^(-2i/d) / factor and the rest get frequency 0: they still occupy their slots in the table, but
never rotate (cos 1, sin 0), carrying semantic rather than positional information. Unlike plain partial
rotary, the exponents keep the full d as denominator.
"""

from __future__ import annotations

import torch

from ropekit.schedules.params import check_value
from ropekit.schedules.registry import RopeSpec, register_schedule


def _validate(spec: RopeSpec) -> None:
    check_value(spec, "factor")
    check_value(spec, "partial_rotary_factor", minimum=0)
    p = spec.get("partial_rotary_factor", 1.0)
    if p > 1:
        raise ValueError(f"scaling['partial_rotary_factor']: expected a number in [0, 1], got {p!r}")


@register_schedule("proportional", optional=("factor", "partial_rotary_factor"), validate=_validate)
def proportional(spec: RopeSpec, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    d = spec.rotary_dim
    rotated = int(spec.get("partial_rotary_factor", 1.0) * d // 2)
    inv_freq = 1.0 / (spec.base ** spec.exponents()[:rotated])
    inv_freq = torch.cat((inv_freq, torch.zeros(d // 2 - rotated, dtype=spec.dtype)))
    inv_freq /= spec.get("factor", 1.0)
    return inv_freq, 1.0
