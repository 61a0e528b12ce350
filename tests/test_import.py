"""`import ropekit` costs no more than the core needs: heavy optional modules load on first use only."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

# Each costs from a tenth of a second (tqdm) to seconds (torch._dynamo pulls sympy and triton).
OPTIONAL = ["torch._dynamo", "torch._inductor", "matplotlib", "tqdm", "transformers", "triton", "sympy"]


def _modules_loaded_by(statement: str) -> list[str]:
    """The OPTIONAL modules present after `statement` that `import torch` alone does not load."""
    code = (
        "import json, sys; import torch; before = set(sys.modules); "
        f"{statement}; "
        f"print(json.dumps(sorted(m for m in {OPTIONAL!r} if m in sys.modules and m not in before)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_import_ropekit_loads_no_optional_heavy_module():
    # torch itself imports tqdm (torch.hub) when it is installed; what matters is what ropekit adds.
    assert _modules_loaded_by("import ropekit") == []


def test_the_probe_sees_a_module_that_is_imported():
    """The check above could pass vacuously if the probe were broken: importing dynamo must show up."""
    assert "torch._dynamo" in _modules_loaded_by("import ropekit, torch._dynamo")


def test_cpu_backend_constant_marker_is_what_torch_compiler_sets():
    """backends.c.rotary marks _build_failure constant for torch.compile without importing torch._dynamo; the
    marker must stay what torch.compiler.assume_constant_result sets, or compiled calls would break graphs."""
    from ropekit.backends.c.rotary import _assume_constant_result

    def ours():
        return None

    def theirs():
        return None

    _assume_constant_result(ours)
    torch.compiler.assume_constant_result(theirs)
    assert vars(ours) == vars(theirs) and vars(ours)
