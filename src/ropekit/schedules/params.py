"""Checks for schedule parameters: each raises a ValueError naming the key, the value and what was
expected."""

from __future__ import annotations

import math

from ropekit.schedules.registry import RopeSpec
from ropekit.validation import check_positive

__all__ = ["check_factor_list", "check_int", "check_number"]


def check_number(spec: RopeSpec, key: str, *, positive: bool = True, minimum: float | None = None) -> None:
    """scaling[key], when present and not None, is a finite real number (> 0 if positive, >= minimum)."""
    value = spec.params.get(key)
    if value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and positive:
        ok = value > 0
    if ok and minimum is not None:
        ok = value >= minimum
    if not ok:
        want = "a finite number"
        if positive:
            want += " > 0"
        if minimum is not None:
            want += f" >= {minimum}"
        raise ValueError(f"scaling[{key!r}]: expected {want}, got {value!r}")


def check_int(spec: RopeSpec, key: str) -> None:
    """scaling[key], when present and not None, is a positive integer."""
    value = spec.params.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"scaling[{key!r}]: expected a positive integer, got {value!r}")


def check_factor_list(spec: RopeSpec, key: str, length: int) -> None:
    """scaling[key] is a list of `length` positive finite numbers (one per rotated pair)."""
    value = spec.params.get(key)
    if not isinstance(value, (list, tuple)):
        raise ValueError(
            f"scaling[{key!r}]: expected a list of {length} numbers (rotary_dim / 2), got {value!r:.80}"
        )
    if len(value) != length:
        raise ValueError(
            f"scaling[{key!r}]: expected a list of length {length} (rotary_dim / 2), got length {len(value)}"
        )
    for i, v in enumerate(value):
        check_positive(f"scaling[{key!r}][{i}]", v)
