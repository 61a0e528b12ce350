""".ci/run (CONTRIBUTING.md): CI runs `make test` and `make proofs` as timed phases, one make target each.
Its phases run exactly the commands of those two targets, each phase prints its wall time, a failing phase
fails CI after printing its line, and the log ends with pytest's own summary lines."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CI_RUN = ROOT / ".ci" / "run"
PHASE_LINE = re.compile(r"^phase (\S+): \d+m\d\ds( FAILED, exit \d+)?$")


def phases() -> list[tuple[str, str]]:
    """(phase name, make target) of .ci/run's PHASES, in order."""
    block = re.search(r"^PHASES=\((.*?)^\)", CI_RUN.read_text(), flags=re.MULTILINE | re.DOTALL)
    assert block, ".ci/run has no PHASES=( ... ) list"
    return re.findall(r'^\s*"(\S+) (\S+)"\s*$', block.group(1), flags=re.MULTILINE)


def make_commands(*targets: str) -> list[str]:
    """The commands make would run for targets from nothing (-n: print only; -B: as if nothing were built)."""
    command = ["make", "-nB", "--no-print-directory", *targets]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True).stdout.splitlines()


def test_the_phases_are_the_ones_ci_reports():
    assert [name for name, _ in phases()] == [
        "venv", "fast-tier", "proofs", "hf-latest", "engines-venv", "engines"
    ]  # fmt: skip


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on PATH")
def test_the_phases_run_exactly_make_test_then_make_proofs():
    targets = [target for _, target in phases()]
    assert make_commands(*targets) == make_commands("test", "proofs")


FAKE_MAKE = """#!/usr/bin/env bash
echo "$1" >> "$CALLS"
echo "running $1"
if [ "$1" = "$FAIL_TARGET" ]; then
    echo "FAILED tests/test_x.py::test_y - AssertionError: boom"
    echo "1 failed, 3 passed in 1.02s"
    exit 2
fi
case "$1" in
    test|proofs-core|proofs-latest|proofs-engines) echo "3 passed, 1 skipped in 0.50s ($1)" ;;
esac
"""


def run_ci(tmp_path: Path, fail_target: str = "") -> tuple[subprocess.CompletedProcess, list[str]]:
    """.ci/run in a copy of the tree's layout, with a fake make that logs its targets."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(CI_RUN, tmp_path / ".ci" / "run")
    make = tmp_path / "fake-make"
    make.write_text(FAKE_MAKE)
    make.chmod(0o755)
    calls = tmp_path / "calls"
    env = {**os.environ, "MAKE": str(make), "CALLS": str(calls), "FAIL_TARGET": fail_target}
    result = subprocess.run(
        ["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True, env=env, timeout=60
    )
    return result, calls.read_text().split()


def test_each_phase_prints_its_wall_time_and_the_log_ends_with_pytest_summaries(tmp_path):
    result, calls = run_ci(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert calls == ["venv", "test", "proofs-core", "proofs-latest", "engines-venv", "proofs-engines"]
    lines = result.stdout.splitlines()
    phase_lines = [line for line in lines if PHASE_LINE.match(line)]
    names = ["venv", "fast-tier", "proofs", "hf-latest", "engines-venv", "engines"]
    # once as each phase ends, once more in the summary
    assert [PHASE_LINE.match(line).group(1) for line in phase_lines] == names + names
    assert "running venv" in lines[: lines.index(phase_lines[0])]  # the phase's own output streams first
    summary = lines[lines.index("== CI summary ==") + 1 :]
    assert [PHASE_LINE.match(line).group(1) for line in summary[:6]] == names
    assert summary[6:] == [
        "-- pytest, fast-tier:",
        "3 passed, 1 skipped in 0.50s (test)",
        "-- pytest, proofs:",
        "3 passed, 1 skipped in 0.50s (proofs-core)",
        "-- pytest, hf-latest:",
        "3 passed, 1 skipped in 0.50s (proofs-latest)",
        "-- pytest, engines:",
        "3 passed, 1 skipped in 0.50s (proofs-engines)",
    ]


def test_a_failing_phase_prints_its_line_and_pytest_summary_then_fails_ci(tmp_path):
    result, calls = run_ci(tmp_path, fail_target="proofs-core")
    assert result.returncode == 2
    assert calls == ["venv", "test", "proofs-core"]  # nothing after the failing phase runs
    lines = result.stdout.splitlines()
    phase_lines = [line for line in lines if PHASE_LINE.match(line)]
    assert phase_lines[2].startswith("phase proofs: ") and phase_lines[2].endswith(" FAILED, exit 2")
    assert not any(line.startswith("phase engines") for line in lines)
    assert lines[-2:] == [
        "FAILED tests/test_x.py::test_y - AssertionError: boom",
        "1 failed, 3 passed in 1.02s",
    ]
