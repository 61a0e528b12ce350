"""Every Triton kernel in ropekit, compiled ahead of time for sm_80, sm_90 and sm_100 on this CPU machine, and
its machine code checked (ropekit.tools.ptx_check): no spills, registers within budget, 128-bit q/k accesses,
round-to-nearest-even 16-bit stores, no FMA.

Checked results are cached in $ROPEKIT_CACHE_DIR/triton-aot (keyed on the kernel source, the Triton version,
the spec, the target and the checks' source). Measured on this 2-core machine, loaded by other sessions (load
average 15-24): a cold run (864 compiles, 288 specializations x 3 targets) took 223 s of CPU (user + sys,
~0.26 s a compile; 19 min wall under that load, about 2 min on 2 idle cores); from Triton's cache 17 s of CPU;
from the results cache 9 s of CPU (24 s wall under load). One test per (arch, dtype), so pytest-xdist spreads
them over its workers.
"""

from __future__ import annotations

import collections
import os

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
    reason="compiles need Triton's JIT, not its interpreter",
)

from ropekit.tools import triton_aot  # noqa: E402

KERNEL = "ropekit.backends.triton_kernel"


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
    for flag in ("INTERLEAVED", "CONJUGATE", "HAS_POS", "COPY_TAIL"):
        assert {c[flag] for c in constexprs} == {False, True}, flag
    assert {2 * c["HALF"] + c["TAIL"] for c in constexprs} == {64, 80, 128, 256}
    assert any(c["TAIL"] > 0 and not c["COPY_TAIL"] for c in constexprs)  # partial rotary in place
    assert not any(c["ROUND_BF16_IN_INTEGERS"] for c in constexprs)  # the interpreter's workaround only
    assert len(specs) == len({(s.signature, s.constexprs) for s in specs}) == 288


def _specs_for(dtype: str):
    return [s for s in triton_aot.specs(KERNEL) if dict(s.signature)["q_ptr"].startswith(f"*{dtype}")]


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("arch", triton_aot.ARCHES)
def test_every_rotary_specialization_compiles_and_passes_the_machine_code_checks(arch, dtype, triton_cache):
    results = [triton_aot.compile_and_check(spec, arch) for spec in _specs_for(dtype)]
    failed = [f"sm_{arch} {r.spec.label}: {r.findings}" for r in results if r.findings]
    assert not failed, "\n".join(failed[:20])
    # What the checks saw, so a check that found nothing to look at cannot pass silently.
    for r in results:
        assert r.local_bytes == 0 and 0 < r.registers <= r.budget == 48
        assert set(r.vector_bits) == {"q_ptr", "k_ptr", "q_out_ptr", "k_out_ptr"}
        assert all(bits and min(bits) >= 128 for bits in r.vector_bits.values()), r.vector_bits
        assert r.rounding == ([] if dtype == "fp32" else sorted(r.vector_bits))
    print(collections.Counter(r.registers for r in results))


OTHER_MODULES = [m for m in triton_aot.kernel_modules() if m != KERNEL]


@pytest.mark.skipif(not OTHER_MODULES, reason="no Triton kernel module besides the rotary kernel yet")
@pytest.mark.parametrize("module", OTHER_MODULES or ["none"])
def test_every_other_kernel_module_compiles_and_passes_the_machine_code_checks(module, triton_cache):
    """Kernels added later (the fused serving kernels) get the same compile and checks, for every target."""
    specs = triton_aot.specs(module)
    assert specs, f"{module} has no aot_specializations()"
    results = [triton_aot.compile_and_check(spec, arch) for spec in specs for arch in triton_aot.ARCHES]
    failed = [f"sm_{r.arch} {r.spec.label}: {r.findings}" for r in results if r.findings]
    assert not failed, "\n".join(failed[:20])
