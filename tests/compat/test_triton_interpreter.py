"""The compat cases on the Triton kernel: triton_interpreter_cases.py, run with TRITON_INTERPRET=1 in a fresh
interpreter (Triton decides at import whether kernels compile or interpret)."""

from __future__ import annotations

from pathlib import Path

import pytest

from triton_interpreter import run_interpreter_cases, tiers

HERE = Path(__file__).parent


# The fast tier runs every second case of the per-axis cover (the Triton kernel's own interpreter suite,
# tests/backends/triton, covers the kernel; these cases cover the peers' conventions on it, which the torch
# and C tests cover in the fast tier too); make proofs runs every case.
@pytest.mark.parametrize("tier", tiers(2, fast_runs=1))
def test_compat_cases_pass_on_the_triton_kernel_under_the_interpreter(tier):
    run_interpreter_cases(
        HERE / "triton_interpreter_cases.py", cwd=HERE.parent.parent, timeout=600, tier=tier
    )
