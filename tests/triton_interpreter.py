"""Run a file of Triton test cases under the interpreter, in a fresh Python process.

Triton decides at import time whether its kernels compile for a GPU or run interpreted, so the cases must
be collected by a process that starts with TRITON_INTERPRET=1 (``from triton_interpreter import ...``:
pytest puts tests/ on sys.path).

Two tiers (``TIERS``): the fast one (``make test``) runs, of each case function, a per-axis cover of its
parametrization (every value of every parameter at least once: this file is also the pytest plugin that picks
it); the full one (``make proofs``, marked ``proof``) runs every case.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cover import per_axis_cover

TIER_ENV = "ROPEKIT_INTERPRETER_TIER"
SHARD_ENV = "ROPEKIT_INTERPRETER_SHARD"


def tiers(fast_shards: int = 1, *, fast_runs: int | None = None) -> list:
    """The tiers as pytest parameters: the fast one, split into ``fast_shards`` tests when a suite's cover
    takes longer than the fast tier's per-test bound (shard i runs every fast_shards-th case of the cover,
    each in its own process, and pytest-xdist spreads the shards over its workers), then the full one.
    ``fast_runs``: only the first that many shards run in the fast tier (a suite whose kernel another suite
    covers); the full tier still runs every case."""
    if fast_runs is not None and not 1 <= fast_runs <= fast_shards:
        raise ValueError(f"fast_runs must be in [1, fast_shards={fast_shards}], got {fast_runs!r}")
    if fast_shards == 1:
        fast = [pytest.param("fast", id="fast")]
    else:
        fast = [pytest.param(f"fast-{i}/{fast_shards}", id=f"fast-{i}") for i in range(fast_shards)]
    return [*fast[:fast_runs], pytest.param("full", id="full", marks=pytest.mark.proof)]


TIERS = tiers()


def run_interpreter_cases(cases: Path, *, cwd: Path, timeout: int, tier: str = "full") -> None:
    """pytest ``cases`` with TRITON_INTERPRET=1; fail the calling test unless cases ran and every one passed
    (a skipped case fails too: under the interpreter every case must run). tier: "full", "fast", or "fast-i/n"
    (shard i of n of the fast tier's cover)."""
    name, _, shard = tier.partition("-")
    if name not in ("fast", "full") or (shard and name != "fast"):
        raise ValueError(f"tier must be 'fast', 'fast-i/n' or 'full', got {tier!r}")
    pytest.importorskip("triton")
    here = str(Path(__file__).parent)
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", TIER_ENV: name, SHARD_ENV: shard, "PYTHONPATH": path}
    if name == "full":  # a proof (make proofs): its cases are not held to the fast tier's per-test bound
        env["ROPEKIT_FAST_TEST_BOUND_S"] = "0"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    cmd += ["-p", "triton_interpreter", "-W", "ignore::DeprecationWarning", str(cases)]
    result = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
    if name == "full":
        assert "deselected" not in result.stdout, result.stdout[-2000:]


def pytest_collection_modifyitems(config, items):
    if os.environ.get(TIER_ENV) != "fast":
        return
    groups: dict[tuple, list] = {}
    for item in items:
        groups.setdefault((str(item.path), getattr(item, "originalname", item.name)), []).append(item)
    keep = {item for group in groups.values() for item in per_axis_cover(group)}
    if os.environ.get(SHARD_ENV):  # "i/n": every n-th case of the cover, from the i-th
        index, count = (int(part) for part in os.environ[SHARD_ENV].split("/"))
        keep = set([item for item in items if item in keep][index::count])
    deselected = [item for item in items if item not in keep]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item in keep]
