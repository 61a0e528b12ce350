"""Python calls inside ropekit per call: what a noisy machine cannot blur (sys.setprofile counts them).

Not collected on its own (no ``test_`` prefix); the call-budget tests of the launch plans use it."""

from __future__ import annotations

import sys
from pathlib import Path

import ropekit

ROOT = str(Path(ropekit.__file__).parent)


def ropekit_calls(fn) -> list[str]:
    """Names of the Python functions inside ropekit that one call of fn runs (sys.setprofile)."""
    calls: list[str] = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(ROOT):
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls
