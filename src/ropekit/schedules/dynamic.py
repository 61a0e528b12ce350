"""Dynamic NTK scaling (emozilla, 2023): NTK-aware base growth chosen from the current sequence length.

With L = max(seq_len, L_max) and L_max = max_position_embeddings, the base becomes
base * (factor * L / L_max - (factor - 1))^(d / (d - 2)): unchanged up to L_max, then growing with the
context.
Because the frequencies depend on the length, keys cached under one length and queries rotated under another
disagree; see docs/scaling.md ("KV-cache hazard") and :meth:`ropekit.RotaryEmbedding.freeze`.
"""

from __future__ import annotations

import torch

from ropekit.schedules.params import check_value
from ropekit.schedules.registry import RopeSpec, register_schedule


def _validate(spec: RopeSpec) -> None:
    check_value(spec, "factor", minimum=1, required=True)  # below 1 would shrink the context, never extend it
    if spec.max_position_embeddings is None:
        raise ValueError(
            "max_position_embeddings: dynamic NTK scaling needs the model's context length, got None"
        )
    if spec.rotary_dim <= 2:
        raise ValueError(
            f"rotary_dim: dynamic NTK needs rotary_dim > 2 (it uses d / (d - 2)), got {spec.rotary_dim}"
        )


@register_schedule(
    "dynamic", required=("factor",), validate=_validate, length_dependent=True, keeps_longest=True
)
def dynamic(spec: RopeSpec, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    d, factor, l_max = spec.rotary_dim, spec.params["factor"], spec.max_position_embeddings
    length = l_max if seq_len is None else max(seq_len, l_max)
    base = spec.base * ((factor * length / l_max) - (factor - 1)) ** (d / (d - 2))
    return spec.default_inv_freq(base), 1.0
