"""Linear scaling / position interpolation (Chen et al. 2023, kaiokendev): every theta_i divided by factor.

Dividing the frequencies by f is the same as dividing the positions by f, so a context f times longer lands in
the angle range seen in training.
"""

from __future__ import annotations

import torch

from ropekit.schedules.params import check_value
from ropekit.schedules.registry import RopeSpec, register_schedule


def _validate(spec: RopeSpec) -> None:
    check_value(spec, "factor", minimum=1, required=True)  # below 1 would shrink the context, never extend it


@register_schedule("linear", required=("factor",), validate=_validate)
def linear(spec: RopeSpec, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    inv_freq = spec.default_inv_freq()
    inv_freq /= spec.params["factor"]
    return inv_freq, 1.0
