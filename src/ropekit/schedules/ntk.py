"""Static NTK-aware scaling (bloc97, 2023): raise the base to base * factor^(d / (d - 2)).

The lowest frequency is then divided by exactly ``factor`` (interpolated) while the highest stays put
(extrapolated), with a geometric blend in between. Not in HF's registry; no attention scaling.
"""

from __future__ import annotations

import torch

from ropekit.schedules.extend import ntk_base
from ropekit.schedules.params import check_value
from ropekit.schedules.registry import RopeSpec, register_schedule


def _validate(spec: RopeSpec) -> None:
    check_value(spec, "factor", minimum=1, required=True)  # below 1 would shrink the context, never extend it
    if spec.rotary_dim <= 2:
        raise ValueError(
            f"rotary_dim: NTK scaling needs rotary_dim > 2 (it uses d / (d - 2)), got {spec.rotary_dim}"
        )


@register_schedule("ntk", required=("factor",), validate=_validate)
def ntk(spec: RopeSpec, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    return spec.default_inv_freq(ntk_base(spec.base, spec.params["factor"], spec.rotary_dim)), 1.0
