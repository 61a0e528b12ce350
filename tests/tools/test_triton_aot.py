"""Every Triton kernel in ropekit, compiled ahead of time for sm_80, sm_90 and sm_100 on this CPU machine, and
its machine code checked (ropekit.tools.ptx_check): no spills, registers within budget, 128-bit q/k accesses,
round-to-nearest-even 16-bit stores, no FMA; the fused kernel's channels 128-bit too.

Two tiers. ``make test`` compiles a pairwise cover of the grid (``triton_aot.cover``: every target with every
constexpr value, every pair of axis values together: 116 compiles of the 7,140 (rotary 32, fused 64, QK-norm
20), a few minutes on the shared 2-core machine cold). ``make proofs`` (``-m proof``) compiles every
specialization for every target: 2,380 x 3 = 7,140 compiles (the rotary kernel's row forms and prefill grid
tripled its 288 specializations to 852, and the packed form, cu_seqlens int32 or int64, took them to 1,420;
the prefill grids took the fused kernel's from 540 to 720 and the QK-norm kernel's from 144 to 240, issue 25)
at about 0.26-0.5 s of CPU each on the Xeon VM; on the Zen 3 one about 1.2 s a compile on each of two xdist
workers with ptxas, about 71 minutes cold.

Checked results are cached in $ROPEKIT_CACHE_DIR/triton-aot (keyed on the kernel source, the Triton version,
the spec, the target and the checks' source); a warm run reads them back. The proof runs in parts of about
``PROOF_PART`` compiles, so pytest-xdist spreads them evenly over its workers.
"""

from __future__ import annotations

import collections
import functools
import itertools
import os

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


# The proof: every specialization of every module for every target, in parts of about PROOF_PART compiles
# (a minute or two of CPU each) so that pytest-xdist keeps both workers busy to the end. Part i of n of a
# module's grid is every n-th specialization from the i-th: the parts of one (module, target) hold each once.
PROOF_PART = 120
ALL_MODULES = triton_aot.kernel_modules()


@functools.cache
def _specs(module: str) -> tuple:
    return tuple(triton_aot.specs(module))


def _proof_parts() -> list:
    params = []
    for module in ALL_MODULES:
        parts = -(-len(_specs(module)) // PROOF_PART)
        for arch in triton_aot.ARCHES:
            for part in range(parts):
                name = f"{module.rsplit('.', 1)[-1]}-sm{arch}-{part + 1}of{parts}"
                params.append(pytest.param(module, arch, part, parts, id=name))
    return params


@pytest.mark.proof
@pytest.mark.parametrize(("module", "arch", "part", "parts"), _proof_parts())
def test_every_specialization_compiles_and_passes_the_machine_code_checks(
    module, arch, part, parts, triton_cache
):
    specs = _specs(module)[part::parts]
    assert specs, f"{module}: part {part + 1} of {parts} is empty"
    _assert_clean([triton_aot.compile_and_check(spec, arch) for spec in specs])


# The fast tier: a pairwise cover of each module's grid, one test per (module, target).


@functools.cache
def _cover(module: str) -> tuple:
    return tuple(triton_aot.cover(_specs(module)))


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
    chosen = [spec for spec, a in _cover(module) if a == arch]
    assert chosen, f"{module}: nothing compiled for sm_{arch}"
    _assert_clean([triton_aot.compile_and_check(spec, arch) for spec in chosen])
