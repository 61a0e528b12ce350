"""Shared test settings, the two tiers, and the reference comparison as a fixture.

The reference and the tolerances themselves live in ``tests/rotary_reference.py`` (one home; the backend cases
in ``tests/rotary_cases.py`` use it too).

Tiers (CONTRIBUTING.md): ``make test`` runs every test not marked ``proof`` or ``engine``, and fails when one
of them takes more than ``FAST_TEST_BOUND_S`` of CPU time (setup, call and teardown together; its process's
and the subprocesses it waited for): a heavy test in the fast tier cannot slip past, and a loaded machine,
which stretches the wall clock, does not fail a test that is not heavy. ``make proofs`` runs ``-m proof``
here and ``-m engine`` (tests/engines/, collected only with ``ROPEKIT_ENGINES=1``) in the engines' own
environment.
"""

from __future__ import annotations

import os
import resource
import time

import pytest
from hypothesis import HealthCheck, settings

from rotary_reference import assert_matches_reference as _assert_matches_reference
from rotary_reference import reference_rotation, tolerance

__all__ = ["reference_rotation", "tolerance"]  # kept importable from here for older test files


# The machine is shared and slow: no per-example deadline. Tests that need more or fewer examples say so.
settings.register_profile("ropekit", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ropekit")


@pytest.fixture
def assert_matches_reference():
    """Assert that ``got`` equals the float64 reference rotation of ``x`` within the tolerance of got's dtype.

    ``conjugate=True`` compares against the inverse rotation (by -theta), the rule for gradients.
    """
    return _assert_matches_reference


# A fast-tier test may take this much CPU time (its process's, all threads, and its waited-for subprocesses':
# the Triton interpreter suites run in one), cold caches. CPU time, not the wall clock: on the 2-core machine
# with another job running, wall-clock durations doubled or tripled and failed tests that are not heavy.
# ROPEKIT_FAST_TEST_BOUND_S overrides it; 0 turns the check off.
FAST_TEST_BOUND_S = float(os.environ.get("ROPEKIT_FAST_TEST_BOUND_S", "60"))
TIER_MARKERS = ("proof", "engine")

# tests/engines/ imports vLLM, SGLang and torchtitan at module level: collected only in their environment.
collect_ignore = [] if os.environ.get("ROPEKIT_ENGINES") == "1" else ["engines"]

_durations: dict[str, float] = {}
_tiers: dict[str, bool] = {}


def pytest_collection_modifyitems(config, items):
    """An engine test outside tests/engines/ would be collected where its engine is missing: refused."""
    for item in items:
        if item.get_closest_marker("engine") and "engines" not in item.path.parts:
            raise pytest.UsageError(f"{item.nodeid}: engine tests live in tests/engines/")


def _cpu_seconds() -> float:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item._ropekit_cpu_mark = _cpu_seconds()  # the CPU clock as the test's setup starts
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report carries the CPU seconds since the last one (user_properties travel from xdist's
    workers); setup's count from the test's start."""
    report = yield
    now = _cpu_seconds()
    report.user_properties.append(("cpu_seconds", now - item._ropekit_cpu_mark))
    item._ropekit_cpu_mark = now
    return report


def pytest_runtest_logreport(report):
    cpu = dict(report.user_properties).get("cpu_seconds")
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + (report.duration if cpu is None else cpu)
    if report.when == "setup":
        _tiers[report.nodeid] = not any(m in report.keywords for m in TIER_MARKERS)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    slow = _slow_fast_tier_tests()
    if slow:
        terminalreporter.section("fast tier over its bound")
        for nodeid, seconds in slow:
            terminalreporter.write_line(
                f"{seconds:7.1f} s  {nodeid}: a fast-tier test over {FAST_TEST_BOUND_S:g} s of CPU time "
                "(make it smaller, or mark it proof)"
            )


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller sees every report
        return
    if _slow_fast_tier_tests() and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _slow_fast_tier_tests() -> list[tuple[str, float]]:
    if FAST_TEST_BOUND_S <= 0:
        return []
    slow = [(n, d) for n, d in _durations.items() if _tiers.get(n) and d > FAST_TEST_BOUND_S]
    return sorted(slow, key=lambda item: -item[1])
