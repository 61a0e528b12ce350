"""The boundary checks (tests/boundary_checks.py) on the Triton backend, under the interpreter.

Run only by tests/test_boundary.py, in a subprocess with TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest

from boundary_checks import (
    CORE_ENTRIES,
    assert_autograd_sees_the_write,
    check_inverse_undoes_forward,
    check_rotary_last,
)
from ropekit.backends.triton import interpreter_enabled

pytestmark = pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1")


@pytest.mark.parametrize("entry", sorted(CORE_ENTRIES))
def test_triton_in_place_write_bumps_the_version_counter(entry):
    assert_autograd_sees_the_write(*CORE_ENTRIES[entry], "triton")


@pytest.mark.parametrize("inplace", [False, True])
def test_triton_inverse_undoes_forward(inplace):
    check_inverse_undoes_forward("triton", inplace, interleaved=inplace)


@pytest.mark.parametrize("inplace", [False, True])
def test_triton_rotary_last_matches_reference(inplace):
    check_rotary_last("triton", inplace, interleaved=not inplace)
