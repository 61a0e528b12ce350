"""Shared test settings, the two tiers, and the reference comparison as a fixture.

The reference and the tolerances themselves live in ``tests/rotary_reference.py`` (one home; the backend cases
in ``tests/rotary_cases.py`` use it too).

Tiers (CONTRIBUTING.md): ``make test`` runs every test not marked ``proof`` or ``engine``, and fails when one
of them takes more than ``FAST_TEST_BOUND_S`` of CPU time (setup, call and teardown together; its process's
and the subprocesses it waited for): a heavy test in the fast tier cannot slip past, and a loaded machine,
which stretches the wall clock, does not fail a test that is not heavy. ``make proofs`` runs ``-m proof``
here and ``-m engine`` (tests/engines/, collected only with ``ROPEKIT_ENGINES=1``) in the engines' own
environment.

The C loop: a test that needs it carries ``@pytest.mark.c_compiler`` (``tests/c_compiler.py``: in a
parametrized backend list, ``CPU``); with no C compiler found it is skipped with the reason
"no C compiler (set CC)", and the run says how many were. ``ROPEKIT_REQUIRE_C_COMPILER=1`` (CI) makes a
missing compiler an error.
"""

from __future__ import annotations

import os
import resource
import time

import pytest
from hypothesis import HealthCheck, settings

from c_compiler import NO_C_COMPILER, find_compiler
from cover import per_axis_cover
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
_no_compiler_skips: set[str] = set()


@pytest.hookimpl(tryfirst=True)  # before -m selects: the cases it marks proof leave the fast tier
def pytest_collection_modifyitems(config, items):
    """An engine test outside tests/engines/ would be collected where its engine is missing: refused. A test
    that needs the C loop is skipped where no C compiler is found (ROPEKIT_REQUIRE_C_COMPILER=1: an error);
    a parametrized 'cpu' backend case without the mark is refused, since it would fail there instead.
    Of a test marked ``cover``, the fast tier runs a per-axis cover of its parametrization (every value of
    every parameter at least once); its other cases are marked ``proof``, so ``make proofs`` runs them."""
    _cover(items)
    compiler = find_compiler()
    for item in items:
        if item.get_closest_marker("engine") and "engines" not in item.path.parts:
            raise pytest.UsageError(f"{item.nodeid}: engine tests live in tests/engines/")
        if not item.get_closest_marker("c_compiler"):
            _refuse_an_unmarked_cpu_case(item)
        elif compiler is None:
            if os.environ.get("ROPEKIT_REQUIRE_C_COMPILER") == "1":
                raise pytest.UsageError(
                    f"ROPEKIT_REQUIRE_C_COMPILER=1 but no C compiler was found ($CC, else cc): {item.nodeid} "
                    "and every other test of the C loop would be skipped"
                )
            item.add_marker(pytest.mark.skip(reason=NO_C_COMPILER))


def _cover(items) -> None:
    """Mark proof the cases of each ``cover`` test that its per-axis cover leaves out."""
    groups: dict[tuple, list] = {}
    for item in items:
        if item.get_closest_marker("cover") and hasattr(item, "callspec"):
            groups.setdefault((str(item.path), item.originalname), []).append(item)
    for group in groups.values():
        every = group[0].get_closest_marker("cover").kwargs.get("every")
        # One axis: its per-axis cover is every case; cover(every=n) keeps each n-th, in collection order.
        kept = set(group[::every] if every else per_axis_cover(group))
        for item in group:
            if item not in kept:
                item.add_marker(pytest.mark.proof)


def _refuse_an_unmarked_cpu_case(item) -> None:
    """A parametrized "cpu" (a backend, a launcher: anything but a device) names the C loop."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if any(isinstance(value, str) and value == "cpu" and name != "device" for name, value in params.items()):
        raise pytest.UsageError(
            f"{item.nodeid}: a 'cpu' case runs the C loop: put c_compiler.CPU in the parametrized list "
            "(or mark the test c_compiler; a parameter that is a device is named 'device')"
        )


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
    if report.skipped and isinstance(report.longrepr, tuple) and report.longrepr[2].endswith(NO_C_COMPILER):
        _no_compiler_skips.add(report.nodeid)
    cpu = dict(report.user_properties).get("cpu_seconds")
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + (report.duration if cpu is None else cpu)
    if report.when == "setup":
        _tiers[report.nodeid] = not any(m in report.keywords for m in TIER_MARKERS)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _no_compiler_skips:
        terminalreporter.write_line(f"{len(_no_compiler_skips)} tests skipped: {NO_C_COMPILER}")
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
