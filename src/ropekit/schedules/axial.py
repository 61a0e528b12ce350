"""Axial RoPE as a schedule: each position axis owns a block of pairs with frequencies of its own.

``mrope_section = [s_0, s_1, ...]`` gives axis a the next s_a pairs, with theta_i = base^(-2i / (2 s_a)) for
i < s_a: every block restarts at frequency 1, as if it were a RoPE of width 2 s_a. (M-RoPE instead spreads one
set of frequencies base^(-2j / rotary_dim) over the axes.) Llama 4's vision encoder is this with two axes
(patch column + 1, patch row + 1) and interleaved pairs (Hugging Face ``Llama4VisionRotaryEmbedding``; vLLM
``vllm/model_executor/layers/rotary_embedding/llama4_vision_rope.py``); positions come from
:func:`ropekit.multiaxis.llama4_vision_positions`. :func:`ropekit.axial_cos_sin` builds the same tables
directly from a grid.
"""

from __future__ import annotations

import torch

from ropekit.schedules.registry import RopeSpec, register_schedule


@register_schedule("axial", required=("mrope_section",))
def axial(spec: RopeSpec, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    # mrope_section itself is checked (integers summing to rotary_dim / 2) by ropekit.schedules.mrope.
    blocks = [1.0 / (spec.base ** spec.exponents(2 * pairs)) for pairs in spec.params["mrope_section"]]
    return torch.cat(blocks), 1.0
