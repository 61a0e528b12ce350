"""The fused Triton kernel: its interpreter suite (in a subprocess) and its list of AOT specializations."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from triton_interpreter import run_interpreter_cases, tiers

HERE = Path(__file__).parent


# The fast tier runs every second case of the per-axis cover (38 CPU-s for all of it); make proofs runs
# every case. The fused ops' fuzz and the torch / C suites cover the same ops in the fast tier.
@pytest.mark.parametrize("tier", tiers(2, fast_runs=1))
def test_fused_triton_kernel_passes_the_interpreter_suite(tier):
    """tests/fused/fused_triton_cases.py, run with TRITON_INTERPRET=1 in a fresh interpreter."""
    run_interpreter_cases(HERE / "fused_triton_cases.py", cwd=HERE, timeout=600, tier=tier)


def test_aot_specializations_name_every_argument_of_the_kernel():
    pytest.importorskip("triton")
    from ropekit.backends.triton import fused as fused_triton

    specs = list(fused_triton.aot_specializations())
    params = list(inspect.signature(fused_triton.fused_kernel.fn).parameters)
    assert len(specs) > 100
    for kernel, signature, constexprs, num_warps in specs:
        assert kernel is fused_triton.fused_kernel and num_warps in (1, 2, 4, 8)
        assert list(signature) == params, set(params) ^ set(signature)
        assert {n for n, t in signature.items() if t == "constexpr"} == set(constexprs)
    assert {c["BLOCK_T"] for _, _, c, _ in specs} == {1, fused_triton.PREFILL_BLOCK_T}  # decode, prefill
    kinds = {(c["K_KIND"], c["V_KIND"], c["Q_KIND"]) for _, _, c, _ in specs}
    assert {(1, 1, 0), (2, 2, 0), (0, 0, 0), (1, 0, 1)} <= kinds  # FP8 caches, native cache, FP8 q and k


def test_an_fp8_specialization_compiles_for_sm90_without_fma_and_with_exact_division():
    """Compiled ahead of time (no GPU needed): the rounding contract needs separate products and sums (no
    fma) and a correctly rounded quotient (div.rn, not the approximate div.full)."""
    pytest.importorskip("triton")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ropekit.backends.triton import fused as fused_triton

    spec = next(s for s in fused_triton.aot_specializations() if s[2]["Q_KIND"] == 1 and s[2]["Q_ROTATE"])
    kernel, signature, constexprs, num_warps = spec
    compiled = triton.compile(
        ASTSource(kernel, {k: v.split(":")[0] for k, v in signature.items()}, constexprs),  # no hints
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, **fused_triton.COMPILE_OPTIONS},
    )
    ptx = compiled.asm["ptx"]
    assert "fma.rn" not in ptx and "div.full" not in ptx
    assert "div.rn.f32" in ptx
