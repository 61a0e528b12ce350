"""The compat cases on the Triton kernel: triton_interpreter_cases.py, run with TRITON_INTERPRET=1 in a fresh
interpreter (Triton decides at import whether kernels compile or interpret)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def test_compat_cases_pass_on_the_triton_kernel_under_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    cmd += ["-W", "ignore::DeprecationWarning", str(HERE / "triton_interpreter_cases.py")]
    result = subprocess.run(cmd, env=env, cwd=HERE.parent.parent, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
