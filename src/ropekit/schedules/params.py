"""Reading schedule parameters out of a scaling dict and checking them with :mod:`ropekit.validation`.

Each helper names the key as ``scaling['key']`` in its ValueError; absent keys and keys set to None (HF writes
absent keys as null) are left to the schedule's defaults.
"""

from __future__ import annotations

from ropekit.schedules.registry import RopeSpec
from ropekit.validation import check_bool, check_int, check_number, check_positive

__all__ = ["check_factor_list", "check_flag", "check_length", "check_value"]


def check_value(spec: RopeSpec, key: str, *, minimum: float | None = None, required: bool = False) -> None:
    """scaling[key] is a finite number: > 0 by default, or >= minimum when one is given.

    An absent or null key passes unless ``required`` (the schedule has no default for it).
    """
    value = spec.params.get(key)
    if value is None:
        if required:
            want = "a finite number" + (" > 0" if minimum is None else f" >= {minimum:g}")
            raise ValueError(f"scaling[{key!r}]: expected {want}, got {value!r}")
        return
    if minimum is None:
        check_positive(f"scaling[{key!r}]", value)
    else:
        check_number(f"scaling[{key!r}]", value, minimum=minimum)


def check_length(spec: RopeSpec, key: str) -> None:
    """scaling[key] is a positive integer (a context length such as original_max_position_embeddings)."""
    value = spec.params.get(key)
    if value is not None:
        check_int(f"scaling[{key!r}]", value)


def check_flag(spec: RopeSpec, key: str) -> None:
    """scaling[key] is a bool."""
    value = spec.params.get(key)
    if value is not None:
        check_bool(f"scaling[{key!r}]", value)


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
