"""Frequency schedules: one module per method, all registered in :mod:`ropekit.schedules.registry`."""

# Importing a schedule module registers it.
from ropekit.schedules import (  # noqa: F401
    axial,
    default,
    dual_chunk,
    dynamic,
    linear,
    llama3,
    longrope,
    ntk,
    ntk_alpha,
    proportional,
    yarn,
)
from ropekit.schedules.dual_chunk import DualChunkPositions, DualChunkTables, dual_chunk_positions
from ropekit.schedules.extend import EXTEND_METHODS, extension_scaling, ntk_base
from ropekit.schedules.mrope import MROPE_LAYOUTS, mrope_axis_of_pair, mrope_layout
from ropekit.schedules.registry import (
    SCHEDULES,
    RopeSpec,
    Schedule,
    get_schedule,
    register_schedule,
    split_scaling,
)

__all__ = [
    "EXTEND_METHODS",
    "MROPE_LAYOUTS",
    "SCHEDULES",
    "DualChunkPositions",
    "DualChunkTables",
    "RopeSpec",
    "Schedule",
    "dual_chunk_positions",
    "extension_scaling",
    "get_schedule",
    "mrope_axis_of_pair",
    "mrope_layout",
    "ntk_base",
    "register_schedule",
    "split_scaling",
]
