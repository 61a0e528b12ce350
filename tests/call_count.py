"""Python calls inside ropekit per call: what a noisy machine cannot blur (sys.setprofile counts them).

Not collected on its own (no ``test_`` prefix); the call-budget tests of the launch plans use it."""

from __future__ import annotations

import sys
from pathlib import Path

import ropekit

ROOT = str(Path(ropekit.__file__).parent)


def ropekit_calls(fn) -> list[str]:
    """Names of the Python functions inside ropekit that one call of fn runs (sys.setprofile)."""
    return ropekit_frames(fn, lambda frame: frame.f_code.co_name)


def ropekit_frames(fn, record) -> list:
    """record(frame) for every Python function inside ropekit that one call of fn runs, in order."""
    seen: list = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(ROOT):
            seen.append(record(frame))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def steady_step(step) -> tuple[list[str], object, object]:
    """(ropekit calls of a steady call of step, the first call's result, that call's result): step() once,
    checked in full (it plans the kind), then again under the profiler."""
    first = step()
    got: list = []
    calls = ropekit_calls(lambda: got.append(step()))
    return calls, first, got[0]


def assert_planned(calls: list[str], budget: int) -> None:
    """A steady call that a launch plan served: its run, no positions resolved, no argument checked by the
    checked path (check_x), at most ``budget`` ropekit calls."""
    assert "run" in calls and "resolve" not in calls and "check_x" not in calls, calls
    assert len(calls) <= budget, (len(calls), calls)
