"""Run a file of Triton test cases under the interpreter, in a fresh Python process.

Triton decides at import time whether its kernels compile for a GPU or run interpreted, so the cases must
be collected by a process that starts with TRITON_INTERPRET=1 (``from triton_interpreter import ...``:
pytest puts tests/ on sys.path).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_interpreter_cases(cases: Path, *, cwd: Path, timeout: int) -> None:
    """pytest ``cases`` with TRITON_INTERPRET=1; fail the calling test unless cases ran and every one passed
    (a skipped case fails too: under the interpreter every case must run)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    cmd += ["-W", "ignore::DeprecationWarning", str(cases)]
    result = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
