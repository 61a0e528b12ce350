"""The boundary checks (tests/boundary_checks.py) on the Triton backend, under the interpreter.

Run only by tests/test_boundary.py, in a subprocess with TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest

from boundary_checks import (
    CORE_ENTRIES,
    assert_autograd_sees_the_write,
    assert_planned_write_bumps_the_version,
    check_aliasing_storages_are_refused_when_planned,
    check_inference_tensor_is_refused_before_writing,
    check_inverse_undoes_forward,
    check_rotary_last,
    check_table_aliasing_the_input_is_refused,
    check_view_of_a_leaf_is_refused_before_writing,
)
from ropekit.backends.triton.rotary import interpreter_enabled

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


@pytest.mark.parametrize("entry", sorted(CORE_ENTRIES))
def test_triton_planned_in_place_write_bumps_the_version_counter(entry):
    assert_planned_write_bumps_the_version(*CORE_ENTRIES[entry], "triton")


def test_triton_in_place_with_a_table_aliasing_the_input_is_refused():
    check_table_aliasing_the_input_is_refused("triton")


def test_triton_q_and_k_aliasing_through_two_storages_are_refused():
    check_aliasing_storages_are_refused_when_planned("triton")


def test_triton_view_of_a_leaf_is_refused_before_writing():
    check_view_of_a_leaf_is_refused_before_writing("triton")


def test_triton_inference_tensor_is_refused_before_writing():
    check_inference_tensor_is_refused_before_writing("triton")
