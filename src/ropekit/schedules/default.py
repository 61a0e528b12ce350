"""The unscaled schedule: theta_i = base^(-2i/rotary_dim), attention scaling 1."""

from __future__ import annotations

import torch

from ropekit.schedules.registry import RopeSpec, register_schedule


# Qwen2-VL's published config says {"type": "mrope", "mrope_section": [...]}: plain frequencies, sectioned per
# position axis (see ropekit.schedules.mrope).
@register_schedule("default", aliases=("mrope",))
def default(spec: RopeSpec, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    return spec.default_inv_freq(), 1.0
