"""The attention scale a RoPE configuration implies, beside its cos/sin tables.

Most schedules leave the softmax alone: scores are q.k / sqrt(head_dim). Two published models change it:

* **DeepSeek's YaRN** (DeepSeek-V2 / V3 / V3.2 MLA attention; Hugging Face ``yarn_apply_mscale`` in
  ``modeling_deepseek_v3.py``, vLLM ``rotary_embedding/deepseek_scaling_rope.py``): with ``mscale_all_dim``
  set, the softmax scale is multiplied by mscale(f, mscale_all_dim)^2, where mscale(f, m) = 0.1 m ln f + 1.
  The tables carry only mscale(f, mscale) / mscale(f, mscale_all_dim) (1.0 for the published configs). The
  plain YaRN temperature instead sits in the tables (both q and k), which is the same mscale^2 on q.k.
* **Llama 4's temperature tuning** on its NoPE layers (Hugging Face ``Llama4TextAttention``): the query at
  position p is multiplied by 1 + attn_scale * ln(1 + floor((p + 1) / floor_scale)) before attention, a
  per-position factor that grows slowly past floor_scale tokens. It is carried in the scaling dict as
  ``floor_scale`` / ``attn_scale`` and read with :func:`attention_temperature`; RoPE layers ignore it.
* **Ministral 3 / Mistral 4's position scaling** (Hugging Face ``get_llama_4_attn_scale`` in
  ``modeling_ministral3.py`` / ``modeling_mistral4.py``): every layer multiplies the query at position p by
  1 + beta * ln(1 + floor(p / original)), with ``llama_4_scaling_beta`` = beta and the rope_parameters'
  ``original_max_position_embeddings`` = original. Note p, not p + 1 as in Llama 4.

docs/scaling.md ("Attention scale") compares them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ropekit.schedules.yarn import yarn_mscale
from ropekit.validation import check_head_dim, check_positive, describe, is_compiling

__all__ = ["attention_temperature", "check_temperature", "softmax_scale"]


def softmax_scale(scaling: Mapping[str, Any] | None, factor: float | None, head_dim: int) -> float:
    """1 / sqrt(head_dim), times DeepSeek's mscale(factor, mscale_all_dim)^2 when the scaling dict sets it.

    Args:
        scaling: the config's scaling dict (or None).
        factor: the schedule's scaling factor (YaRN's factor, or its length ratio), or None.
        head_dim: the width q.k runs over (for MLA, qk_nope_head_dim + qk_rope_head_dim, not the rotary part).
    """
    head_dim = check_head_dim(head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    mscale_all_dim = (scaling or {}).get("mscale_all_dim")
    if factor is not None and mscale_all_dim:  # HF treats 0 and a missing key alike
        scale *= yarn_mscale(factor, mscale_all_dim) ** 2
    return scale


def check_temperature(scaling: Mapping[str, Any] | None) -> None:
    """floor_scale and attn_scale come together, each a finite number > 0.

    Raises:
        ValueError: naming the key, for one without the other or a bad value.
    """
    if not scaling:
        return
    beta = scaling.get("llama_4_scaling_beta")
    if beta is not None:
        if scaling.get("floor_scale") is not None:
            raise ValueError(
                "scaling['llama_4_scaling_beta']: a config takes Ministral 3's position scaling or Llama 4's "
                "floor_scale / attn_scale, not both"
            )
        check_positive("scaling['llama_4_scaling_beta']", beta)
        check_positive(
            "scaling['original_max_position_embeddings'] (the length llama_4_scaling_beta scales over)",
            scaling.get("original_max_position_embeddings"),
        )
        return
    floor, attn = scaling.get("floor_scale"), scaling.get("attn_scale")
    if floor is None and attn is None:
        return
    if floor is None or attn is None:
        missing = "floor_scale" if floor is None else "attn_scale"
        raise ValueError(
            f"scaling[{missing!r}]: Llama 4's temperature tuning needs floor_scale and attn_scale together, "
            "got only one"
        )
    check_positive("scaling['floor_scale']", floor)
    check_positive("scaling['attn_scale']", attn)


def attention_temperature(
    scaling: Mapping[str, Any] | None, positions: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The per-position query multiplier a scaling dict implies (ones without one).

    Llama 4: 1 + attn_scale * ln(1 + floor((p + 1) / floor_scale)); Ministral 3 / Mistral 4:
    1 + llama_4_scaling_beta * ln(1 + floor(p / original_max_position_embeddings)).

    Args:
        scaling: a scaling dict holding floor_scale and attn_scale, or llama_4_scaling_beta and
            original_max_position_embeddings; without them every factor is 1.
        positions: integer tensor of query positions, any shape.
        dtype: output dtype (computed in float64).

    Returns:
        a tensor shaped like positions.

    Raises:
        ValueError: for positions that are not an integer tensor, or negative ones (every rotation refuses
            them; the formula would give -inf or NaN). Values are read on the host for CPU tensors; on another
            device a negative position fails a device-side assert (no sync), as the rotation kernels do.
    """
    if not isinstance(positions, torch.Tensor) or positions.is_floating_point() or positions.is_complex():
        raise ValueError(f"positions: expected an integer tensor, got {describe(positions)}")
    if positions.numel() and not is_compiling():
        if positions.device.type == "cpu":
            lowest = int(positions.min())
            if lowest < 0:
                raise ValueError(f"positions: expected values >= 0, got a minimum of {lowest}")
        else:
            torch._assert_async((positions >= 0).all(), "positions: expected values >= 0")
    pos = positions.to(torch.float64)
    if scaling and scaling.get("llama_4_scaling_beta") is not None:
        steps = torch.floor(pos / float(scaling["original_max_position_embeddings"]))  # (...,)
        return (torch.log1p(steps) * float(scaling["llama_4_scaling_beta"]) + 1.0).to(dtype)
    if not scaling or scaling.get("floor_scale") is None:
        return torch.ones(positions.shape, dtype=dtype, device=positions.device)
    steps = torch.floor((pos + 1.0) / float(scaling["floor_scale"]))  # (...,)
    return (torch.log1p(steps) * float(scaling["attn_scale"]) + 1.0).to(dtype)
