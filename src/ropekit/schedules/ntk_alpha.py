"""NTK scaling with a fixed alpha (Tencent HunYuan): the base becomes base * alpha^(d / (d - 2)).

HunYuan's checkpoints label this ``"type": "dynamic"`` with an ``alpha`` key, but the frequencies never
depend on the sequence length: the base is raised once, as in static NTK with factor = alpha. Hugging Face
gives it its own type internally (``HunYuanDenseV1RotaryEmbedding.compute_ntk_alpha_rope_parameters``) and
vLLM its own class (``vllm/model_executor/layers/rotary_embedding/dynamic_ntk_alpha_rope.py``), so
:func:`ropekit.hf_config.rope_kwargs` reads "dynamic" + alpha as ``rope_type "ntk_alpha"``. No attention
scaling.
"""

from __future__ import annotations

import torch

from ropekit.schedules.extend import ntk_base
from ropekit.schedules.ntk import check_ntk
from ropekit.schedules.registry import RopeSpec, register_schedule


def _validate(spec: RopeSpec) -> None:
    check_ntk(spec, "alpha")  # HunYuan publishes 1000


@register_schedule("ntk_alpha", required=("alpha",), validate=_validate)
def ntk_alpha(spec: RopeSpec, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    return spec.default_inv_freq(ntk_base(spec.base, spec.params["alpha"], spec.rotary_dim)), 1.0
