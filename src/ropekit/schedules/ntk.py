"""Static NTK-aware scaling (bloc97, 2023): raise the base to base * factor^(d / (d - 2)).

The lowest frequency is then divided by exactly ``factor`` (interpolated) while the highest stays put
(extrapolated), with a geometric blend in between. Not in HF's registry; no attention scaling.
"""

from __future__ import annotations

import torch

from ropekit.schedules.extend import ntk_base
from ropekit.schedules.params import check_value
from ropekit.schedules.registry import RopeSpec, register_schedule


def check_ntk(spec: RopeSpec, key: str) -> None:
    """scaling[key] (the NTK factor, or HunYuan's alpha) is >= 1, and rotary_dim > 2 for d / (d - 2)."""
    check_value(spec, key, minimum=1, required=True)  # below 1 would shrink the context, never extend it
    if spec.rotary_dim <= 2:
        raise ValueError(
            f"rotary_dim: NTK scaling needs rotary_dim > 2 (it uses d / (d - 2)), got {spec.rotary_dim}"
        )


def _validate(spec: RopeSpec) -> None:
    check_ntk(spec, "factor")


@register_schedule("ntk", required=("factor",), validate=_validate)
def ntk(spec: RopeSpec, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    return spec.default_inv_freq(ntk_base(spec.base, spec.params["factor"], spec.rotary_dim)), 1.0
