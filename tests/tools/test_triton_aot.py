"""Every Triton kernel in ropekit, compiled ahead of time for sm_80, sm_90 and sm_100 on this CPU machine, and
its machine code checked (ropekit.tools.ptx_check): no spills, registers within budget, 128-bit q/k accesses,
round-to-nearest-even 16-bit stores, no FMA; the fused kernel's channels 128-bit too.

Three grids. ``make test`` compiles a per-axis cover (``triton_aot.cover(strength=1)``: every target, every
constexpr value, every argument type and warp count at least once: 24 compiles of the 7,068 distinct ones
(rotary 8, fused 11, QK-norm 5), about 10 CPU-s cold; the pairwise cover, 116 compiles, was 45 CPU-s of a
fast tier at its 5-minute edge, and the 3-wise cover below holds every pair). ``make proofs`` (``-m proof``)
compiles a 3-wise cover (every triple of axis values, the target one axis: 411 compiles, rotary 131, fused
224, QK-norm 56), and every specialization of each kernel that the manifest of the last full run
(``triton_aot.MANIFEST``) does not hold as it is now (its source or specializations changed), and says so.
``make proofs-full`` (``ROPEKIT_TRITON_GRID=full``) compiles every specialization for every target, 2,356
distinct x 3 = 7,068 compiles (the rotary kernel's 1,420, the fused kernel's 696, the QK-norm kernel's 240),
then records the manifest. A compile costs about 0.4 CPU-s with ptxas (the shared 2-core AMD EPYC VM,
2026-12-07: 14 compiles of the 3-wise cover from nothing, 0.40 CPU-s each); CI measured about 1.2 s a
compile on each of two xdist workers, so the 3-wise cover is a few minutes and the full grid about an hour.

Compiles and checked findings are stored in $ROPEKIT_CACHE_DIR/triton-aot, keyed by what each reads (the
checks' source keys only the findings); a warm run reads them back. A full grid runs in parts of about
``PROOF_PART`` compiles, so pytest-xdist spreads them evenly over its workers.
"""

from __future__ import annotations

import collections
import functools
import itertools
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
    reason="compiles need Triton's JIT, not its interpreter",
)

from ropekit.tools import triton_aot  # noqa: E402

KERNEL = "ropekit.backends.triton.rotary_kernel"


@pytest.fixture(scope="module")
def triton_cache(tmp_path_factory):
    """Triton's own artifacts (190 KB a specialization) go to a temporary directory unless TRITON_CACHE_DIR
    is set; the checked results are cached by triton_aot itself."""
    if os.environ.get("TRITON_CACHE_DIR"):
        yield
        return
    os.environ["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton"))
    yield
    os.environ.pop("TRITON_CACHE_DIR", None)


def test_every_module_with_a_triton_kernel_lists_specializations_covering_each_jit_function():
    modules = triton_aot.kernel_modules()
    assert KERNEL in modules
    for module in modules:
        specs = triton_aot.specs(module)
        assert specs, f"{module} defines @triton.jit kernels but no aot_specializations()"
        assert triton_aot.uncovered(module, specs) == [], f"{module}: kernels nobody compiles ahead of time"


def test_the_rotary_kernel_specializations_cover_each_axis_the_launcher_chooses():
    specs = triton_aot.specs(KERNEL)
    constexprs = [dict(s.constexprs) for s in specs]
    dtypes = {dict(s.signature)["q_ptr"] for s in specs}
    assert dtypes == {"*fp32:16", "*fp16:16", "*bf16:16"}
    for flag in ("INTERLEAVED", "CONJUGATE", "COPY_TAIL"):
        assert {c[flag] for c in constexprs} == {False, True}, flag
    # int offset, positions, per-sequence offsets, a packed batch's cu_seqlens (int32 or int64)
    assert {c["ROWS"] for c in constexprs} == {0, 1, 2, 3}
    packed = {dict(s.signature)["rows_ptr"] for s in specs if dict(s.constexprs)["ROWS"] == 3}
    assert packed == {"*i32:16", "*i64:16"}
    assert {c["BLOCK_T"] == 1 for c in constexprs} == {False, True}  # decode and prefill grids
    assert all(c["TRAP_BAD_ROWS"] for c in constexprs)  # compiled code traps on a bad row
    assert {2 * c["HALF"] + c["TAIL"] for c in constexprs} == {64, 80, 128, 256}
    assert any(c["TAIL"] > 0 and not c["COPY_TAIL"] for c in constexprs)  # partial rotary in place
    assert not any(c["ROUND_BF16_IN_INTEGERS"] for c in constexprs)  # the interpreter's workaround only
    assert len(specs) == len({(s.signature, s.constexprs) for s in specs}) == 1420


FUSED = "ropekit.backends.triton.fused"
QK_NORM = "ropekit.backends.triton.qk_norm_kernel"


def _assert_fused_vectorised(r) -> None:
    """Issue 25: every channel the fused kernel runs reads its source (in place: its destination) and writes
    its destination with 128-bit accesses; an FP8 destination with 64-bit ones (8 bytes a thread)."""
    c = dict(r.spec.constexprs)
    signature = dict(r.spec.signature)
    assert r.budget == 80
    for ch in "qkv":
        if not c[f"{ch.upper()}_ON"]:
            continue
        reads = f"{ch}_dst" if c[f"{ch.upper()}_IN_PLACE"] else f"{ch}_src"
        assert r.vector_bits[reads] == [128], (r.spec.label, r.vector_bits)
        if signature[f"{ch}_dst"].startswith("*u8"):
            assert f"{ch}_dst" not in r.vector_bits  # FP8 bytes: not held to 128 bits
        else:
            assert r.vector_bits[f"{ch}_dst"] == [128], (r.spec.label, r.vector_bits)


def _assert_clean(results) -> None:
    """No finding in any compile; for the rotary kernel, also what the checks saw, so a check that found
    nothing to look at cannot pass silently."""
    failed = [f"sm_{r.arch} {r.spec.label}: {r.findings}" for r in results if r.findings]
    assert not failed, "\n".join(failed[:20])
    for r in results:
        assert r.local_bytes == 0 and 0 < r.registers <= r.budget
        if r.spec.module == FUSED:
            _assert_fused_vectorised(r)
        if r.spec.module == QK_NORM:  # issue 25: qkv read and written 128 bits at a time
            assert r.budget == 80 and r.vector_bits == {"qkv_ptr": [128]}, (r.spec.label, r.vector_bits)
        if r.spec.module != KERNEL:
            continue
        dtype = dict(r.spec.signature)["q_ptr"].split(":")[0].lstrip("*")
        assert r.budget == 48
        assert set(r.vector_bits) == {"q_ptr", "k_ptr", "q_out_ptr", "k_out_ptr"}
        assert all(bits and min(bits) >= 128 for bits in r.vector_bits.values()), r.vector_bits
        assert r.rounding == ([] if dtype == "fp32" else sorted(r.vector_bits))
    print(collections.Counter(r.registers for r in results))


# The proof. make proofs: each module's 3-wise cover (every triple of axis values, the target one axis), and
# the full grid of every kernel that the manifest of the last make proofs-full holds no run of (its source or
# specializations changed since: triton_aot.full_grid_kernels). make proofs-full (ROPEKIT_TRITON_GRID=full):
# every specialization of every module for every target. A full grid runs in parts of about PROOF_PART
# compiles (a minute or two of CPU each) so that pytest-xdist keeps both workers busy to the end: part i of n
# is every n-th specialization from the i-th, so the parts of one (module, target) hold each once.
PROOF_PART = 120
ALL_MODULES = triton_aot.kernel_modules()
GRID = os.environ.get("ROPEKIT_TRITON_GRID", "cover")
if GRID not in ("cover", "full"):
    raise ValueError(
        f"ROPEKIT_TRITON_GRID must be 'cover' (make proofs) or 'full' (make proofs-full), got {GRID!r}"
    )


@functools.cache
def _specs(module: str) -> tuple:
    """The module's distinct specializations (the fused kernel's listing names a few twice)."""
    return tuple(dict.fromkeys(triton_aot.specs(module)))


@functools.cache
def _full_kernels(module: str) -> frozenset:
    if GRID == "full":
        return frozenset(spec.kernel for spec in _specs(module))
    return frozenset(triton_aot.full_grid_kernels(module))


@functools.cache
def _cover3(module: str) -> tuple:
    return tuple(triton_aot.cover(_specs(module), strength=3))


def _proof_parts() -> list:
    params = []
    for module in ALL_MODULES:
        name = module.rsplit(".", 1)[-1]
        full = [spec for spec in _specs(module) if spec.kernel in _full_kernels(module)]
        parts = -(-len(full) // PROOF_PART)
        for arch in triton_aot.ARCHES:
            if len(full) < len(_specs(module)):
                params.append(pytest.param(module, arch, "cover", 0, 1, id=f"{name}-sm{arch}-cover"))
            for part in range(parts):
                params.append(
                    pytest.param(
                        module, arch, "full", part, parts, id=f"{name}-sm{arch}-full-{part + 1}of{parts}"
                    )
                )
    return params


def _proof_specs(module: str, arch: int, grid: str, part: int, parts: int) -> list:
    """What one proof test compiles for sm_<arch>: the 3-wise cover's compiles of the kernels not compiled in
    full, or one part of the full grid of those that are."""
    full = _full_kernels(module)
    if grid == "cover":
        return [spec for spec, a in _cover3(module) if a == arch and spec.kernel not in full]
    return [spec for spec in _specs(module) if spec.kernel in full][part::parts]


def _stale_note(module: str) -> str | None:
    """What make proofs says of a module whose kernels the manifest holds no full run of, or not of this
    source, these specializations, these checks or this Triton: shown in pytest's warnings summary."""
    if GRID == "full":
        return None
    notes = []
    for kernel, differ in sorted(triton_aot.stale_kernels(module).items()):
        what = (
            "no full run recorded"
            if differ == ["no full run"]
            else f"{', '.join(differ)} changed since its full run"
        )
        grid = "its full grid" if kernel in _full_kernels(module) else "its 3-wise cover only"
        notes.append(f"{kernel}: {what}, so {grid} is compiled here")
    if not notes:
        return None
    return (
        f"the Triton manifest ({triton_aot.MANIFEST.name}) is stale for {module}: {'; '.join(notes)}. "
        "Run make proofs-full and commit the manifest."
    )


@pytest.mark.proof
@pytest.mark.parametrize(("module", "arch", "grid", "part", "parts"), _proof_parts())
def test_the_proof_grid_compiles_and_passes_the_machine_code_checks(
    module, arch, grid, part, parts, triton_cache
):
    note = _stale_note(module)
    if note is not None:
        warnings.warn(note, triton_aot.StaleManifestWarning, stacklevel=1)
    specs = _proof_specs(module, arch, grid, part, parts)
    assert specs, f"{module}: {grid} part {part + 1} of {parts} for sm_{arch} is empty"
    _assert_clean([triton_aot.compile_and_check(spec, arch) for spec in specs])


# The fast tier compiles a per-axis cover of each module's grid, one test per (module, target); the pairwise
# cover is checked here as a cover (the 3-wise one of make proofs holds every pair it holds).


@functools.cache
def _cover(module: str) -> tuple:
    return tuple(triton_aot.cover(_specs(module)))


@functools.cache
def _cover1(module: str) -> tuple:
    return tuple(triton_aot.cover(_specs(module), strength=1))


def _named_values(spec, arch) -> dict:
    """Every axis of one compile by name: the target, the warps, each constexpr and each argument's type."""
    values = {("target",): arch, ("warps",): spec.num_warps}
    values |= {("const", k): repr(v) for k, v in spec.constexprs}
    return values | {("sig", k): v for k, v in spec.signature}


@pytest.mark.parametrize("module", ALL_MODULES)
def test_the_pairwise_cover_holds_every_pair_of_axis_values_of_the_full_grid(module):
    """Checked here from the grid itself, not from cover()'s own bookkeeping: for every two axes that vary,
    every pair of their values that some (spec, target) of the full product has, some compile of the cover
    has too; and every target gets compiles."""
    specs = triton_aot.specs(module)
    chosen = _cover(module)
    assert len(chosen) < len(specs) * len(triton_aot.ARCHES) / 5, f"{module}: the cover is no saving"
    assert {spec.kernel for spec in specs} == {spec.kernel for spec, _ in chosen}
    assert {a for _, a in chosen} == set(triton_aot.ARCHES)
    full = [_named_values(s, a) for s in specs for a in triton_aot.ARCHES]
    compiled = [_named_values(s, a) for s, a in chosen]
    varying = sorted(name for name in full[0] if len({row.get(name) for row in full}) > 1)
    for one, two in itertools.combinations(varying, 2):
        grid = {(row.get(one), row.get(two)) for row in full}
        seen = {(row.get(one), row.get(two)) for row in compiled}
        assert grid <= seen, f"{module}: {one} x {two}: {sorted(grid - seen, key=repr)[:5]} never compiled"


def test_a_per_axis_cover_is_smaller_and_still_holds_every_value():
    for module in ALL_MODULES:
        specs = triton_aot.specs(module)
        per_axis = triton_aot.cover(specs, strength=1)
        assert len(per_axis) <= len(_cover(module))
        for name, _ in specs[0].constexprs:
            everywhere = {repr(dict(s.constexprs)[name]) for s in specs}
            assert everywhere == {repr(dict(s.constexprs)[name]) for s, _ in per_axis}, name
    with pytest.raises(ValueError, match="strength must be 1"):
        triton_aot.cover(triton_aot.specs(KERNEL), strength=4)


@pytest.mark.parametrize("arch", triton_aot.ARCHES)
@pytest.mark.parametrize("module", ALL_MODULES)
def test_the_cover_compiles_and_passes_the_machine_code_checks(module, arch, triton_cache):
    chosen = [spec for spec, a in _cover1(module) if a == arch]
    assert chosen, f"{module}: nothing compiled for sm_{arch}"
    _assert_clean([triton_aot.compile_and_check(spec, arch) for spec in chosen])


def _axis_codes(rows: list[dict], names: list, values: dict):
    import numpy as np

    return np.array([[values[name][repr(row.get(name))] for name in names] for row in rows], np.int64)


@pytest.mark.parametrize("module", ALL_MODULES)
def test_the_3_wise_cover_holds_every_triple_of_axis_values_of_the_full_grid(module):
    """make proofs' cover, checked from the grid itself as the pairwise one is: for every three axes that vary
    (an argument absent from a specialization counts as one more value of its axis), every triple of their
    values that some (spec, target) of the full product has, some compile of the cover has too."""
    import numpy as np

    specs = _specs(module)
    chosen = _cover3(module)
    assert len(chosen) < len(specs) * len(triton_aot.ARCHES) / 5, f"{module}: the cover is no saving"
    assert set(_cover(module)) - set(chosen) or len(chosen) > len(_cover(module))
    full = [_named_values(s, a) for s in specs for a in triton_aot.ARCHES]
    compiled = [_named_values(s, a) for s, a in chosen]
    names = sorted({name for row in full for name in row})
    values = {name: sorted({repr(row.get(name)) for row in full}) for name in names}
    varying = [name for name in names if len(values[name]) > 1]
    values = {name: {v: i for i, v in enumerate(values[name])} for name in varying}
    grid, seen = _axis_codes(full, varying, values), _axis_codes(compiled, varying, values)
    sizes = [len(values[name]) for name in varying]
    assert len(varying) >= 3
    for i, j, k in itertools.combinations(range(len(varying)), 3):
        table = np.zeros((sizes[i], sizes[j], sizes[k]), bool)
        table[seen[:, i], seen[:, j], seen[:, k]] = True
        missed = ~table[grid[:, i], grid[:, j], grid[:, k]]
        assert not missed.any(), (
            f"{module}: {varying[i]} x {varying[j]} x {varying[k]}: never compiled as in "
            f"{full[int(np.argmax(missed))]}"
        )


def test_the_3_wise_cover_is_the_same_in_every_process():
    """Each xdist worker computes the cover it compiles a part of: the same whatever the strings hash to."""
    code = f"from ropekit.tools import triton_aot as t; print(t.cover(t.specs({QK_NORM!r}), strength=3))"
    seed = "1" if os.environ.get("PYTHONHASHSEED") == "0" else "0"  # not this process's
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == repr(list(_cover3(QK_NORM)))


def _module_copy(tmp_path, name: str, source: str):
    """``source`` imported as a new module ``name`` (a kernel module with an edit)."""
    import importlib.util

    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fields(result) -> dict:
    return {name: getattr(result, name) for name in triton_aot._FIELDS}


def test_a_changed_check_rereads_the_stored_compile_and_a_changed_toolchain_compiles_again(
    tmp_path, monkeypatch, triton_cache
):
    monkeypatch.setenv("ROPEKIT_CACHE_DIR", str(tmp_path))
    store = tmp_path / "triton-aot"
    spec = _specs(QK_NORM)[0]
    first = triton_aot.compile_and_check(spec, 80)
    assert first.registers > 0 and first.findings == []
    assert len(list((store / "compiled").iterdir())) == len(list((store / "checked").iterdir())) == 1

    def compile_again(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(triton_aot, "_compile", compile_again)
    assert _fields(triton_aot.compile_and_check(spec, 80)) == _fields(first)  # the stored findings
    monkeypatch.setattr(triton_aot, "_checks_source", lambda: "a changed check")
    assert _fields(triton_aot.compile_and_check(spec, 80)) == _fields(first)  # checked again, not compiled
    assert len(list((store / "compiled").iterdir())) == 1
    assert len(list((store / "checked").iterdir())) == 2
    monkeypatch.setattr(triton_aot, "_toolchain", lambda arch: ("another Triton", "12.9", []))
    with pytest.raises(AssertionError, match="compiled again"):
        triton_aot.compile_and_check(spec, 80)


def test_the_compile_key_is_what_the_compile_reads_and_not_the_checks(tmp_path, monkeypatch):
    import dataclasses

    from ropekit.backends.triton import qk_norm_kernel

    spec = _specs(QK_NORM)[0]
    key = triton_aot.compile_key(spec, 80)
    constexprs = dict(spec.constexprs)
    flag = next(name for name, value in constexprs.items() if isinstance(value, bool))
    signature = dict(spec.signature)
    hinted = next(
        name for name, kind in signature.items() if kind.endswith(":16") and not kind.startswith("*")
    )
    pointer = next(name for name, kind in signature.items() if kind == "*fp32:16")
    read = {
        "target": (spec, 90),
        "constexpr": (
            dataclasses.replace(spec, constexprs=tuple({**constexprs, flag: not constexprs[flag]}.items())),
            80,
        ),
        "argument type": (
            dataclasses.replace(spec, signature=tuple({**signature, pointer: "*bf16:16"}.items())),
            80,
        ),
        "divisibility": (
            dataclasses.replace(spec, signature=tuple({**signature, hinted: "i32"}.items())),
            80,
        ),
        "warps": (dataclasses.replace(spec, num_warps=2 * spec.num_warps), 80),
        "options": (dataclasses.replace(spec, options=(("enable_fp_fusion", True),)), 80),
    }
    for what, (other, arch) in read.items():
        assert triton_aot.compile_key(other, arch) != key, what
    # Read by the checks only: the pointers held to 128 bits, the occupancy, the checks' code.
    assert triton_aot.compile_key(dataclasses.replace(spec, vectorised=(), occupancy=0.5), 80) == key
    monkeypatch.setattr(triton_aot, "_checks_source", lambda: "a changed check")
    assert triton_aot.compile_key(spec, 80) == key
    monkeypatch.setattr(triton_aot, "_toolchain", lambda arch: ("another Triton", "12.9", []))
    assert triton_aot.compile_key(spec, 80) != key
    monkeypatch.undo()
    # The kernel's source, as Triton keys it: a line added above the kernel moves its debug lines.
    source = "\n" + Path(qk_norm_kernel.__file__).read_text()
    monkeypatch.setattr(
        qk_norm_kernel, spec.kernel, getattr(_module_copy(tmp_path, "moved", source), spec.kernel)
    )
    assert triton_aot.compile_key(spec, 80) != key


def test_the_manifests_kernel_source_is_its_own_and_its_callees_not_the_line_it_starts_on(tmp_path):
    from ropekit.backends.triton import rotary_kernel

    source = Path(rotary_kernel.__file__).read_text()
    rtne = 'fp_downcast_rounding="rtne"'  # in _store_rounded, which the kernel calls
    assert source.count(rtne) == 1
    moved = _module_copy(tmp_path, "moved", "# a line above the kernel\n" + source)
    callee = _module_copy(tmp_path, "callee", source.replace(rtne, 'fp_downcast_rounding="rtz"'))

    def digest(module):
        return triton_aot._digest("\n".join(triton_aot._kernel_sources(module.rotary_kernel)))

    assert (
        moved.rotary_kernel.cache_key != rotary_kernel.rotary_kernel.cache_key
    )  # Triton's key: the line too
    assert digest(moved) == digest(rotary_kernel)
    assert digest(callee) != digest(rotary_kernel)


def test_make_proofs_compiles_in_full_a_kernel_whose_source_or_specializations_changed_since_its_full_run():
    records = triton_aot.kernel_records(QK_NORM)
    ((name, record),) = records.items()
    kernel = name.rsplit(".", 1)[1]
    assert (
        triton_aot.stale_kernels(QK_NORM, records) == {}
        and triton_aot.full_grid_kernels(QK_NORM, records) == []
    )
    for field in ("source", "specializations", "checks", "triton"):
        changed = {name: {**record, field: "0" * 16}}
        assert triton_aot.stale_kernels(QK_NORM, changed) == {kernel: [field]}
        assert triton_aot.full_grid_kernels(QK_NORM, changed) == (
            [kernel] if field in triton_aot.FULL_GRID_FIELDS else []
        )
    assert triton_aot.stale_kernels(QK_NORM, {}) == {kernel: ["no full run"]}
    assert triton_aot.full_grid_kernels(QK_NORM, {}) == [kernel]


def test_write_manifest_records_a_kernel_only_when_every_compile_of_its_grid_passed(tmp_path, monkeypatch):
    path = tmp_path / "manifest.json"
    specs = _specs(QK_NORM)
    monkeypatch.setattr(triton_aot, "stored_result", lambda spec, arch: triton_aot.Result(spec, arch, 40))
    lines = triton_aot.write_manifest([QK_NORM], path=path)
    assert triton_aot.read_manifest(path) == triton_aot.kernel_records(QK_NORM)
    assert lines == [
        f"{QK_NORM}.qk_norm_rotary_kernel: {3 * len(specs)} compiles passed; recorded in manifest.json"
    ]

    def one_missing_one_failed(spec, arch):
        if (spec, arch) == (specs[-1], 100):
            return None
        return triton_aot.Result(
            spec, arch, 40, findings=["spills: 8 bytes"] if (spec, arch) == (specs[0], 80) else []
        )

    monkeypatch.setattr(triton_aot, "stored_result", one_missing_one_failed)
    old = {
        name: {**record, "source": "0" * 16} for name, record in triton_aot.kernel_records(QK_NORM).items()
    }
    path.write_text(json.dumps({"kernels": old}))
    with pytest.raises(
        RuntimeError, match=f"qk_norm_rotary_kernel: 1 of {3 * len(specs)} compiles not stored, 1 with"
    ):
        triton_aot.write_manifest([QK_NORM], path=path)
    assert triton_aot.read_manifest(path) == old


TINY_KERNEL = """
import triton
import triton.language as tl

COMPILE_OPTIONS = {"enable_fp_fusion": False}


@triton.jit
def copy_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets))


def aot_specializations():
    signature = {"x_ptr": "*fp32:16", "y_ptr": "*fp32:16", "BLOCK": "constexpr"}
    return [(copy_kernel, signature, {"BLOCK": 128}, 1)]
"""


def test_write_manifest_records_a_kernel_once_its_compile_is_stored(tmp_path, monkeypatch, triton_cache):
    """End to end on a one-compile module: nothing stored, nothing recorded; compiled, recorded as it is."""
    monkeypatch.setenv("ROPEKIT_CACHE_DIR", str(tmp_path / "store"))
    (tmp_path / "tiny_triton_module.py").write_text(TINY_KERNEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "manifest.json"
    with pytest.raises(RuntimeError, match=r"tiny_triton_module\.copy_kernel: 1 of 1 compiles not stored"):
        triton_aot.write_manifest(["tiny_triton_module"], arches=[80], path=path)
    assert triton_aot.read_manifest(path) == {}
    (spec,) = triton_aot.specs("tiny_triton_module")
    assert triton_aot.compile_and_check(spec, 80).findings == []
    assert triton_aot.write_manifest(["tiny_triton_module"], arches=[80], path=path) == [
        "tiny_triton_module.copy_kernel: 1 compiles passed; recorded in manifest.json"
    ]
    assert triton_aot.read_manifest(path) == triton_aot.kernel_records("tiny_triton_module", [80])
    assert triton_aot.stale_kernels("tiny_triton_module", triton_aot.read_manifest(path)) == {
        "copy_kernel": ["targets", "compiles"]  # recorded for sm_80 alone, read against the three targets
    }


def test_the_checked_in_manifest_records_kernels_that_exist_as_write_manifest_records_them():
    kept = triton_aot.read_manifest()
    current = {
        name: record for module in ALL_MODULES for name, record in triton_aot.kernel_records(module).items()
    }
    assert set(kept) <= set(current), "the manifest records a kernel that no longer exists"
    for name, record in kept.items():
        assert set(record) == set(current[name]), name


def test_the_proof_compiles_each_stale_kernels_full_grid_once_and_the_3_wise_cover_of_the_rest():
    params = [p.values for p in _proof_parts()]
    for module in ALL_MODULES:
        full = _full_kernels(module)
        compiled = [
            (spec, arch)
            for m, arch, *rest in params
            if m == module
            for spec in _proof_specs(module, arch, *rest)
        ]
        assert len(compiled) == len(set(compiled))
        wanted = {(s, a) for s, a in _cover3(module) if s.kernel not in full}
        wanted |= {(s, a) for s in _specs(module) if s.kernel in full for a in triton_aot.ARCHES}
        assert set(compiled) == wanted, module
