"""Multimodal RoPE (M-RoPE, Qwen2-VL / Qwen3-VL): each frequency pair follows one position axis.

A token carries three positions (temporal, height, width); ``mrope_section`` = [s_t, s_h, s_w] with
s_t + s_h + s_w = rotary_dim / 2 says how many pairs each axis owns. Two layouts ship:

* chunked (Qwen2-VL, ``"type": "mrope"``): pairs [0, s_t) follow t, the next s_h follow h, the last s_w
  follow w;
* interleaved (Qwen3-VL, ``"mrope_interleaved": true``): pair j follows h when j % 3 == 1 and j < 3 s_h, w
  when j % 3 == 2 and j < 3 s_w, and t otherwise, so every axis spans the whole frequency range.

For a text token t = h = w, so either layout gives exactly the 1-D angles.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ropekit.validation import check_bool, check_int

__all__ = ["mrope_axis_of_pair", "mrope_layout"]


def mrope_layout(scaling: Mapping[str, Any] | None, pairs: int) -> tuple[tuple[int, ...], bool] | None:
    """Read (mrope_section, interleaved) from a scaling dict, or None when it has no M-RoPE keys.

    Args:
        scaling: the scaling / rope_parameters dict.
        pairs: rotary_dim // 2, which the sections must add up to.

    Raises:
        ValueError: for sections that are not positive integers summing to `pairs`, a non-bool
            mrope_interleaved, an interleaved layout with a section too large to interleave, or
            ``"type": "mrope"`` without mrope_section.
    """
    if not scaling:
        return None
    section = scaling.get("mrope_section")
    interleaved = scaling.get("mrope_interleaved", False)
    kind = scaling.get("rope_type", scaling.get("type"))
    if section is None:
        if kind == "mrope":
            raise ValueError("scaling['mrope_section']: rope_type 'mrope' needs the section sizes, got none")
        if scaling.get("mrope_interleaved") is not None:
            raise ValueError("scaling['mrope_section']: mrope_interleaved needs the section sizes, got none")
        return None
    check_bool("scaling['mrope_interleaved']", interleaved)
    expected = f"scaling['mrope_section']: expected a list of non-negative integers, got {section!r}"
    if not isinstance(section, Sequence) or isinstance(section, str) or not section:
        raise ValueError(expected)
    try:
        section = [check_int("mrope_section", s, minimum=0) for s in section]
    except ValueError:
        raise ValueError(expected) from None
    if sum(section) != pairs:
        raise ValueError(
            f"scaling['mrope_section']: expected sections summing to rotary_dim / 2 = {pairs}, "
            f"got {list(section)} (sum {sum(section)})"
        )
    counts = torch.bincount(mrope_axis_of_pair(section, interleaved), minlength=len(section)).tolist()
    if counts != list(section):
        raise ValueError(
            f"scaling['mrope_section']: {list(section)} cannot be interleaved over {pairs} pairs "
            f"(each axis after the first needs 3 * section <= rotary_dim / 2); "
            f"the pairs would split as {counts}"
        )
    return tuple(section), interleaved


def mrope_axis_of_pair(section: Sequence[int], interleaved: bool) -> torch.Tensor:
    """Which position axis drives each frequency pair: int64 tensor of shape (sum(section),)."""
    pairs = sum(section)
    if not interleaved:
        return torch.repeat_interleave(torch.arange(len(section)), torch.tensor(section))
    axis = torch.zeros(pairs, dtype=torch.int64)
    j = torch.arange(pairs)
    for a in range(1, len(section)):
        # Axis a takes every len(section)-th pair starting at a, for its first `section[a]` slots.
        axis[(j % len(section) == a) & (j < len(section) * section[a])] = a
    return axis
