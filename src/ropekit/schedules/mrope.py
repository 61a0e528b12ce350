"""Multimodal RoPE (M-RoPE, Qwen2-VL / Qwen3-VL): each frequency pair follows one position axis.

A token carries three positions (temporal, height, width); ``mrope_section`` = [s_t, s_h, s_w] with
s_t + s_h + s_w = rotary_dim / 2 says how many pairs each axis owns. Two layouts ship:

* chunked (Qwen2-VL, ``"type": "mrope"``): pairs [0, s_t) follow t, the next s_h follow h, the last s_w
  follow w;
* interleaved (Qwen3-VL, ``"mrope_interleaved": true``): pair j follows h when j % 3 == 1 and j < 3 s_h, w
  when j % 3 == 2 and j < 3 s_w, and t otherwise, so every axis spans the whole frequency range.

* ernie (ERNIE 4.5-VL, ``"mrope_layout": "ernie"``): mrope_section is [s_h, s_w, s_t] with s_h = s_w; the
  first 2 s_h pairs alternate h (even j) and w (odd j), the last s_t pairs follow t (Hugging Face
  ``Ernie4_5_VLMoeTextRotaryEmbedding``; vLLM ``rotary_embedding/ernie45_vl_rope.py``).

Positions are always given in the order (t, h, w). For a text token t = h = w, so every layout gives exactly
the 1-D angles.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ropekit.validation import check_bool, check_int

__all__ = ["MROPE_LAYOUTS", "mrope_axis_of_pair", "mrope_layout"]

# The layouts by name; mrope_interleaved = True is "interleaved", False (or absent) "chunked".
MROPE_LAYOUTS = ("chunked", "interleaved", "ernie")


def mrope_layout(scaling: Mapping[str, Any] | None, pairs: int) -> tuple[tuple[int, ...], str] | None:
    """Read (mrope_section, layout name) from a scaling dict, or None when it has no M-RoPE keys.

    Args:
        scaling: the scaling / rope_parameters dict.
        pairs: rotary_dim // 2, which the sections must add up to.

    Raises:
        ValueError: for sections that are not non-negative integers summing to `pairs`, a non-bool
            mrope_interleaved, an unknown mrope_layout (or one that contradicts mrope_interleaved), a layout
            the sections cannot fill, or ``"type": "mrope"`` without mrope_section.
    """
    if not scaling:
        return None
    section = scaling.get("mrope_section")
    kind = scaling.get("rope_type", scaling.get("type"))
    if section is None:
        if kind == "mrope":
            raise ValueError("scaling['mrope_section']: rope_type 'mrope' needs the section sizes, got none")
        for key in ("mrope_interleaved", "mrope_layout"):
            if scaling.get(key) is not None:
                raise ValueError(f"scaling['mrope_section']: {key} needs the section sizes, got none")
        return None
    layout = _layout_name(scaling)
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
    if layout == "ernie":
        if len(section) != 3 or section[0] != section[1]:
            raise ValueError(
                f"scaling['mrope_section']: the ernie layout expects [s_h, s_w, s_t] with s_h == s_w, "
                f"got {list(section)}"
            )
        return tuple(section), layout
    counts = torch.bincount(mrope_axis_of_pair(section, layout), minlength=len(section)).tolist()
    if counts != list(section):
        raise ValueError(
            f"scaling['mrope_section']: {list(section)} cannot be interleaved over {pairs} pairs "
            f"(each axis after the first needs 3 * section <= rotary_dim / 2); "
            f"the pairs would split as {counts}"
        )
    return tuple(section), layout


def _layout_name(scaling: Mapping[str, Any]) -> str:
    """The layout a scaling dict names through mrope_layout or the older mrope_interleaved flag."""
    interleaved = scaling.get("mrope_interleaved")
    if interleaved is not None:
        check_bool("scaling['mrope_interleaved']", interleaved)
    layout = scaling.get("mrope_layout")
    if layout is None:
        return "interleaved" if interleaved else "chunked"
    if layout not in MROPE_LAYOUTS:
        raise ValueError(f"scaling['mrope_layout']: expected one of {list(MROPE_LAYOUTS)}, got {layout!r}")
    if interleaved is not None and interleaved != (layout == "interleaved"):
        raise ValueError(
            f"scaling['mrope_interleaved']: {interleaved} contradicts mrope_layout {layout!r}; drop one"
        )
    return layout


def mrope_axis_of_pair(section: Sequence[int], layout: bool | str) -> torch.Tensor:
    """Which position axis drives each frequency pair: int64 tensor of shape (sum(section),).

    layout is a name from MROPE_LAYOUTS, or a bool (True = "interleaved", False = "chunked").
    """
    if isinstance(layout, bool):
        layout = "interleaved" if layout else "chunked"
    pairs = sum(section)
    j = torch.arange(pairs)
    if layout == "chunked":
        return torch.repeat_interleave(torch.arange(len(section)), torch.tensor(section))
    if layout == "ernie":
        hw = section[0] + section[1]
        # h on the even pairs, w on the odd ones, of the first s_h + s_w; t on the rest.
        return torch.where(j < hw, 1 + j % 2, torch.zeros_like(j))
    axis = torch.zeros(pairs, dtype=torch.int64)
    for a in range(1, len(section)):
        # Axis a takes every len(section)-th pair starting at a, for its first `section[a]` slots.
        axis[(j % len(section) == a) & (j < len(section) * section[a])] = a
    return axis
