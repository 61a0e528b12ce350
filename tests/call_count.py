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
