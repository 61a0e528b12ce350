"""Shared test settings, and the reference comparison as a fixture.

The reference and the tolerances themselves live in ``tests/rotary_reference.py`` (one home; the backend cases
in ``tests/backends/rotary_cases.py`` use it too).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from rotary_reference import assert_matches_reference as _assert_matches_reference
from rotary_reference import reference_rotation, tolerance

__all__ = ["reference_rotation", "tolerance"]  # kept importable from here for older test files

# tests/engines needs vLLM, SGLang and torchtitan, installed only in .venv-engines (make engines-venv): it is
# collected there (or with ROPEKIT_ENGINES=1), where its conftest fails the run if an engine is missing.
if Path(sys.prefix).name != ".venv-engines" and os.environ.get("ROPEKIT_ENGINES") != "1":
    collect_ignore = ["engines"]

# The machine is shared and slow: no per-example deadline. Tests that need more or fewer examples say so.
settings.register_profile("ropekit", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ropekit")


@pytest.fixture
def assert_matches_reference():
    """Assert that ``got`` equals the float64 reference rotation of ``x`` within the tolerance of got's dtype.

    ``conjugate=True`` compares against the inverse rotation (by -theta), the rule for gradients.
    """
    return _assert_matches_reference
