"""The Triton backend: its interpreter suite (in a subprocess), its refusal without a GPU, and its fake op."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ropekit import apply_rotary
from ropekit.backends import BACKENDS
from rotary_cases import tables
from triton_interpreter import TIERS, run_interpreter_cases

HERE = Path(__file__).parent.parent  # tests/backends: the shared interpreter cases


@pytest.mark.parametrize("tier", TIERS)
def test_triton_kernel_passes_the_interpreter_suite(tier):
    """tests/backends/triton_interpreter_cases.py, run with TRITON_INTERPRET=1 in a fresh interpreter."""
    run_interpreter_cases(HERE / "triton_interpreter_cases.py", cwd=HERE, timeout=300, tier=tier)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"), reason="the interpreter accepts CPU tensors"
)
def test_triton_on_cpu_tensors_without_interpreter_is_a_clear_value_error():
    cos, sin = tables(4)
    with pytest.raises(ValueError, match=r"backend: 'triton'.*CUDA device"):
        apply_rotary(torch.randn(1, 3, 2, 4), cos, sin, backend="triton")


@pytest.mark.parametrize("op", ["triton_rotary", "triton_rotary_", "rotary_qk_fp8", "qk_norm_rotary_"])
def test_triton_ops_on_cpu_tensors_without_interpreter_are_the_functions_value_error(monkeypatch, op):
    """Issue 39: the registered op on a CPU tensor without TRITON_INTERPRET raised Triton's "0 active
    drivers"; it says what apply_rotary says (the backend's own reason), before anything is written."""
    import ropekit.fused  # noqa: F401  registers the serving ops

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # read per call
    cos, sin = tables(16)
    q, k = torch.randn(1, 3, 2, 16), torch.randn(1, 3, 2, 16)
    qkv = torch.randn(1, 3, 96)
    before = q.clone(), qkv.clone()
    ops, scale = torch.ops.ropekit, torch.ones(1)
    norm = (torch.ones(16), torch.ones(16), cos, sin, None, 0, 2, 2, 16, 1e-6, 0.0, False, True, False)
    calls = {
        "triton_rotary": lambda: ops.triton_rotary(q, k, cos, sin, None, False, False, 0),
        "triton_rotary_": lambda: ops.triton_rotary_(q, k, cos, sin, None, False, False, 0),
        "rotary_qk_fp8": lambda: ops.rotary_qk_fp8(
            q, k, cos, sin, None, 0, scale, scale, torch.float8_e4m3fn, None, None, False, "triton"
        ),
        "qk_norm_rotary_": lambda: ops.qk_norm_rotary_(qkv, *norm, "triton"),
    }
    match = r"backend: 'triton' cannot serve these inputs: q is on the CPU; .*CUDA"
    with pytest.raises(ValueError, match=match):
        calls[op]()
    assert torch.equal(q, before[0]) and torch.equal(qkv, before[1])


def test_triton_fake_op_gives_output_shapes_and_strides_without_running():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 4, 8, 16).transpose(1, 2)  # (batch, seq, heads, head_dim) from a bhsd buffer
        k = torch.empty(2, 8, 1, 16)
        cos, sin, pos = torch.empty(32, 8), torch.empty(32, 8), torch.zeros(2, 8, dtype=torch.int64)
        out_q, out_k = torch.ops.ropekit.triton_rotary(q, k, cos, sin, pos, False, False)
        assert out_q.shape == q.shape and out_q.stride() == q.stride()
        assert out_k.shape == k.shape
        assert torch.ops.ropekit.triton_rotary(q, None, cos, sin, pos, True, True)[0].shape == q.shape


def test_triton_reports_unsupported_dtype_and_auto_refuses_the_interpreter(monkeypatch):
    backend = BACKENDS["triton"]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, cos = torch.zeros(1, 2, 1, 4), torch.zeros(2, 2)
    assert backend.unavailable_reason(x, cos) is None
    assert "float64" in backend.unavailable_reason(x.double(), cos)
    assert "interpreter" in backend.auto_skip_reason(x, cos)


def _ptx_for_sm90(module, spec) -> str:
    """The PTX of one of ``module.aot_specializations()`` compiled for sm_90 with the launcher's options."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel, signature, constexprs, num_warps = spec
    compiled = triton.compile(
        ASTSource(kernel, {k: v.split(":")[0] for k, v in signature.items()}, constexprs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, **module.COMPILE_OPTIONS},
    )
    return compiled.asm["ptx"]


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"), reason="compiles need Triton's JIT"
)
@pytest.mark.parametrize(
    "module", ["rotary_kernel", "fused", "qk_norm_kernel"], ids=["rotary", "fused", "qk_norm"]
)
def test_compiled_kernels_fail_a_bad_row_with_a_predicated_trap_not_an_assert_kernel(module):
    """Issue 25: a launch checks its rows without a torch._assert_async launch: the compiled kernel itself
    traps (one predicated instruction) when a row (or slot) is out of range, and calls no assert routine."""
    pytest.importorskip("triton")
    import importlib

    mod = importlib.import_module(f"ropekit.backends.triton.{module}")
    spec = next(iter(mod.aot_specializations()))
    constexprs = spec[2]
    assert constexprs["TRAP_BAD_ROWS"] is True
    ptx = _ptx_for_sm90(mod, spec)
    assert "@%p trap;" in ptx and "__assertfail" not in ptx
    assert ptx.count("trap;") == (2 if constexprs.get("HAS_SLOTS") else 1)  # rows (and slots)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"), reason="compiles need Triton's JIT"
)
@pytest.mark.parametrize("cu_dtype", ["i32", "i64"])
def test_compiled_packed_kernel_checks_rows_and_cu_seqlens_with_one_trap_and_no_host_sync(cu_dtype):
    """Issue 25: the packed form (ROWS_CU_SEQLENS) reads cu_seqlens itself (a bisection loop), and checks
    its values and every row with the one predicated trap the other forms have: no assert routine, no
    second trap."""
    pytest.importorskip("triton")
    from ropekit.backends.triton import rotary_kernel as mod

    spec = next(
        spec
        for spec in mod.aot_specializations()
        if spec[2]["ROWS"] == mod.ROWS_CU_SEQLENS and spec[1]["rows_ptr"].startswith(f"*{cu_dtype}")
    )
    ptx = _ptx_for_sm90(mod, spec)
    assert "@%p trap;" in ptx and "__assertfail" not in ptx
    assert ptx.count("trap;") == 1
