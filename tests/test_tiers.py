"""The two tiers (tests/conftest.py, CONTRIBUTING.md): a fast-tier test over its time bound fails the run, a
proof-marked test does not count against it, and engine tests are refused outside tests/engines/. The C
loop's marker: where a compiler is found it skips nothing; where none is, only the C cases skip, counted."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent

# Each test here runs a child pytest (about 4 CPU-s, most of it importing torch). The fast tier keeps the ones
# that prove what it relies on (the bound fails a run and counts CPU time, the C marker, the cover); the
# refusals and switches run in make proofs (moved 2026-12-08: 22 CPU-s of a fast tier at its 5-minute edge).
PROOF = pytest.mark.proof

SLOW = """
import time
import pytest

def spin(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass

def test_quick():
    pass

def test_slow_in_the_fast_tier():
    spin(0.6)

@pytest.mark.proof
def test_slow_proof():
    spin(0.6)
"""


def _run(
    tmp_path: Path, body: str, *args: str, bound: str = "0.3", **env: str
) -> subprocess.CompletedProcess:
    for name in ("conftest.py", "rotary_reference.py", "c_compiler.py", "cover.py"):
        shutil.copy(HERE / name, tmp_path / name)
    shutil.copy(HERE.parent / "pyproject.toml", tmp_path / "pyproject.toml")  # the registered markers
    (tmp_path / "test_body.py").write_text(body)
    # the run's own settings only: CI's ROPEKIT_REQUIRE_C_COMPILER=1 must not leak into the no-compiler case
    inherited = {k: v for k, v in os.environ.items() if k != "ROPEKIT_REQUIRE_C_COMPILER"}
    env = {**inherited, "ROPEKIT_FAST_TEST_BOUND_S": bound, **env}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_fast_tier_test_over_the_bound_fails_the_run_and_is_named(tmp_path):
    done = _run(tmp_path, SLOW, "-m", "not proof and not engine")
    assert done.returncode == 1, done.stdout
    assert "2 passed" in done.stdout  # every test passed: the bound alone fails the run
    assert "test_slow_in_the_fast_tier: a fast-tier test over 0.3 s of CPU time" in done.stdout
    assert "test_quick:" not in done.stdout


def test_the_bound_counts_cpu_time_not_the_wall_clock(tmp_path):
    """A test that waits (a loaded machine, a sleep) is not heavy; one whose subprocess computes is."""
    body = (
        "import subprocess, sys, time\n\n"
        "def test_waits():\n    time.sleep(0.6)\n\n"
        "def test_child_computes():\n"
        "    code = 'import time\\nend = time.process_time() + 0.6\\nwhile time.process_time() < end: pass'\n"
        "    subprocess.run([sys.executable, '-c', code], check=True)\n"
    )
    done = _run(tmp_path, body)
    assert done.returncode == 1, done.stdout
    assert "test_child_computes: a fast-tier test over 0.3 s of CPU time" in done.stdout
    assert "test_waits:" not in done.stdout


@PROOF
def test_a_proof_may_take_longer(tmp_path):
    done = _run(tmp_path, SLOW, "-m", "proof")
    assert done.returncode == 0, done.stdout
    assert "1 passed" in done.stdout and "over its bound" not in done.stdout


@PROOF
def test_the_bound_can_be_turned_off_for_a_loaded_machine(tmp_path):
    done = _run(tmp_path, SLOW, bound="0")
    assert done.returncode == 0, done.stdout


@PROOF
def test_an_engine_test_outside_tests_engines_is_refused(tmp_path):
    body = "import pytest\n\n@pytest.mark.engine\ndef test_needs_vllm():\n    pass\n"
    done = _run(tmp_path, body)
    assert done.returncode != 0 and "engine tests live in tests/engines/" in (done.stdout + done.stderr)


def test_the_markers_are_registered_so_a_typo_is_an_error():
    text = (HERE.parent / "pyproject.toml").read_text()
    assert '"proof:' in text and '"engine:' in text and '"c_compiler:' in text


C_LOOP = """
import numpy as np
import pytest
import torch
from c_compiler import CPU
from ropekit import apply_rotary
from rotary_reference import reference_tables

@pytest.mark.c_compiler
def test_marked():
    cos, sin = reference_tables(8, 64)
    apply_rotary(torch.ones(1, 2, 1, 8), cos, sin, backend="cpu")

@pytest.mark.parametrize("backend", ["torch", CPU])
def test_listed(backend):
    pass

@pytest.mark.parametrize("table", [np.zeros(3)])  # an array parameter: compared with "cpu" it is no bool
def test_array(table):
    pass
"""


@pytest.mark.c_compiler
def test_where_a_compiler_is_found_the_c_marker_skips_nothing_and_the_c_loop_builds(tmp_path):
    """The marker asks what the library asks (backends.c.build.find_compiler): where it finds a compiler the
    C tests run, and the C loop they run builds (a fresh cache), so no C test is skipped that could run."""
    done = _run(tmp_path, C_LOOP, "-rs", bound="0", ROPEKIT_CACHE_DIR=str(tmp_path / "cache"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 passed" in done.stdout and "skipped" not in done.stdout, done.stdout


def test_without_a_compiler_only_the_c_cases_skip_and_the_run_counts_them(tmp_path):
    done = _run(tmp_path, C_LOOP, "-rs", CC=str(tmp_path / "no-such-compiler"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed, 2 skipped" in done.stdout, done.stdout  # the torch case of the list still runs
    assert "2 tests skipped: no C compiler (set CC)" in done.stdout
    assert done.stdout.count(": no C compiler (set CC)") == 3  # -rs: both skips, then the count


@PROOF
def test_ci_can_require_a_compiler_so_the_c_tests_never_skip_there(tmp_path):
    done = _run(tmp_path, C_LOOP, CC=str(tmp_path / "no-such-compiler"), ROPEKIT_REQUIRE_C_COMPILER="1")
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout + done.stderr
    assert "ROPEKIT_REQUIRE_C_COMPILER=1 but no C compiler was found" in done.stdout + done.stderr


@PROOF
def test_an_unmarked_cpu_case_in_a_parametrized_list_is_refused(tmp_path):
    body = 'import pytest\n\n@pytest.mark.parametrize("launcher", ["torch", "cpu"])\n'
    body += "def test_x(launcher):\n    pass\n"
    done = _run(tmp_path, body)
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout + done.stderr
    assert "test_x[cpu]: a 'cpu' case runs the C loop" in done.stdout + done.stderr


COVER = """
import pytest

@pytest.mark.cover
@pytest.mark.parametrize("a", [1, 2, 3])
@pytest.mark.parametrize("b", ["x", "y"])
def test_grid(a, b):
    pass

@pytest.mark.cover(every=2)
@pytest.mark.parametrize("c", [1, 2, 3, 4, 5])
def test_axis(c):
    pass
"""


def test_a_cover_test_runs_a_per_axis_cover_in_the_fast_tier_and_the_rest_as_proofs(tmp_path):
    """cover: of a 3 x 2 grid, 3 cases hold every value of both axes (fast), the other 3 are proofs; of a
    5-case axis with every=2, cases 1, 3 and 5 are fast and 2 and 4 proofs. Nothing runs in neither tier."""
    fast = _run(tmp_path, COVER, "-m", "not proof and not engine", "-vv", bound="0")
    proof = _run(tmp_path, COVER, "-m", "proof", "-vv", bound="0")
    assert fast.returncode == 0 and proof.returncode == 0, fast.stdout + proof.stdout
    ran = {tier: {line.split(" ")[0].split("::")[1] for line in out.stdout.splitlines() if " PASSED" in line}
           for tier, out in (("fast", fast), ("proof", proof))}  # fmt: skip
    assert len(ran["fast"]) == 6 and len(ran["proof"]) == 5 and not ran["fast"] & ran["proof"]
    assert {"test_axis[1]", "test_axis[3]", "test_axis[5]"} <= ran["fast"]
    grid = {f"test_grid[{b}-{a}]" for a in (1, 2, 3) for b in "xy"}
    assert grid <= ran["fast"] | ran["proof"]
    fast_grid = [
        name.split("[")[1].rstrip("]").split("-") for name in ran["fast"] if name.startswith("test_grid")
    ]
    assert {b for b, _ in fast_grid} == {"x", "y"} and {a for _, a in fast_grid} == {"1", "2", "3"}
