"""One real `ropekit demo --quick` run (and one 2-process run), shared by every test that reads their outputs.

Under pytest-xdist each worker is its own process, so a file lock in the session's shared temp folder makes
the first worker run the demo and the others wait for its files instead of running it again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

# Generous: --quick targets well under 90 s, but the tests share two cores with the rest of the suite.
RUN_TIMEOUT_S = 600
# The tests read the run's files, not its quality past "better than guessing": 60 steps, not --quick's 200
# (16 s instead of 30 s on the 2-core VM; at 60 steps every method's perplexity at L was 17, guessing's 256).
STEPS = ["--steps", "60"]


def _shared_dir(tmp_path_factory) -> Path:
    base = tmp_path_factory.getbasetemp()
    # With xdist, basetemp is <session>/popen-gwN: its parent is per session and shared by the workers.
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _run_once(tmp_path_factory, name: str, command: list[str]) -> Path:
    out = _shared_dir(tmp_path_factory) / name
    with FileLock(str(out) + ".lock"):
        done = out / "done"
        if not done.exists():
            out.mkdir(parents=True, exist_ok=True)
            proc = subprocess.run(
                [*command, "--out", str(out)],
                capture_output=True,
                text=True,
                timeout=RUN_TIMEOUT_S,
                check=False,
            )
            (out / "stdout.txt").write_text(proc.stdout)
            (out / "stderr.txt").write_text(proc.stderr)
            done.write_text(str(proc.returncode))
    code = int((out / "done").read_text())
    if code != 0:
        pytest.fail(f"{' '.join(command)} exited {code}:\n{(out / 'stderr.txt').read_text()[-3000:]}")
    return out


@pytest.fixture(scope="session")
def quick_report(tmp_path_factory) -> Path:
    """Output folder of `python -m ropekit demo --quick` on one process."""
    command = [sys.executable, "-m", "ropekit", "demo", "--quick", *STEPS]
    return _run_once(tmp_path_factory, "demo-quick", command)


@pytest.fixture(scope="session")
def quick_ddp_report(tmp_path_factory) -> Path:
    """Output folder of the quick rope training on 2 processes (torchrun, gloo), without evaluation."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "ropekit", "demo", "--quick", *STEPS, "--variants", "rope", "--train-only"]  # fmt: skip
    return _run_once(tmp_path_factory, "demo-quick-ddp", command)
