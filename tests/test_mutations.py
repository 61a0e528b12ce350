"""tests/mutations.py stays runnable: every entry still applies to today's source (a refactor that moves a
protection must move its mutation too), names tests that exist, and, as a proof, is caught."""

from __future__ import annotations

from pathlib import Path

import pytest

from mutations import MUTATIONS, ROOT, Mutation, _kernel_cache, main, occurrences, run_one

# Mutations that pass every named test today: each needs a test (issue 24); remove the name once it has one.
SURVIVES_ON_MAIN: dict[str, str] = {}  # none today (issue 24: every entry is caught on main)


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_each_mutation_applies_exactly_once_and_names_tests_that_exist(mutation):
    for path, old, new in mutation.edits():
        assert (ROOT / "src" / path).is_file(), path
        assert new != old
    counts = occurrences(mutation)
    assert counts == [1] * len(counts), f"an old text of {mutation.name!r} is not in its file once: {counts}"
    assert mutation.tests, "a mutation names the tests that must catch it"
    for node in mutation.tests:
        assert (ROOT / node.split("::")[0]).is_file(), node


def test_mutation_names_are_unique_and_listable(capsys):
    assert len({m.name for m in MUTATIONS}) == len(MUTATIONS)
    assert main(["--list"]) == 0
    assert capsys.readouterr().out.count("\n") == len(MUTATIONS)


def test_mutants_share_one_private_kernel_cache_unless_the_build_module_is_mutated(tmp_path):
    """Libraries are cached under a hash of their source, so mutants may share a cache; a mutant of the build
    module (which computes that hash) must not: it gets an empty one in its own copy."""
    plain = [m for m in MUTATIONS if all(path != "ropekit/backends/c/build.py" for path, _, _ in m.edits())]
    shared = _kernel_cache(plain[0], tmp_path / "a")
    assert _kernel_cache(plain[1], tmp_path / "b") == shared
    assert shared.is_dir() and shared.stat().st_mode & 0o077 == 0
    build = Mutation("build", "ropekit/backends/c/build.py", "x", "y", ("tests/test_mutations.py",))
    (tmp_path / "c").mkdir()
    own = _kernel_cache(build, tmp_path / "c")
    assert own == tmp_path / "c" / "kernel-cache" and own.is_dir() and not any(own.iterdir())
    assert own.stat().st_mode & 0o077 == 0


def test_an_unknown_name_is_refused():
    with pytest.raises(SystemExit):
        main(["--only", "no such mutation"])


@pytest.mark.c_compiler
@pytest.mark.proof  # a copy of the tree, three C builds and a pytest run: seconds of CPU
def test_the_harness_never_edits_the_working_tree():
    """run_one works on a copy: the working tree's file is byte for byte what it was."""
    m = next(m for m in MUTATIONS if m.path.endswith("shift.py"))
    path = Path(ROOT / "src" / m.path)
    before = path.read_bytes()
    verdict, detail, _ = run_one(
        m._replace(tests=("tests/test_mutations.py::test_an_unknown_name_is_refused",))
    )
    assert path.read_bytes() == before
    assert verdict == "survives", detail  # the named test does not look at shift_cache_


@pytest.mark.c_compiler
@pytest.mark.proof
@pytest.mark.parametrize(
    "mutation",
    [
        pytest.param(m, marks=pytest.mark.xfail(strict=True, reason=SURVIVES_ON_MAIN[m.name]))
        if m.name in SURVIVES_ON_MAIN
        else m
        for m in MUTATIONS
    ],
    ids=[m.name for m in MUTATIONS],
)
def test_proof_every_mutation_of_the_in_place_safety_is_caught(mutation):
    verdict, detail, _ = run_one(mutation)
    assert verdict == "caught", f"{mutation.name}: {verdict}: {detail}"
