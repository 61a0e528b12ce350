"""Frequency schedules: one module per method, all registered in :mod:`ropekit.schedules.registry`."""

from ropekit.schedules import default  # noqa: F401  (registers "default")
from ropekit.schedules.registry import (
    SCHEDULES,
    RopeSpec,
    Schedule,
    get_schedule,
    register_schedule,
    split_scaling,
)

__all__ = ["SCHEDULES", "RopeSpec", "Schedule", "get_schedule", "register_schedule", "split_scaling"]
