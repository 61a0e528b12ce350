"""`ropekit verify`: the table, --json, exit codes, bad arguments, and `python -m ropekit`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import ropekit.cli.verify
from ropekit.cli import main
from ropekit.tools.verify import Check


def test_prints_a_pass_table_and_exits_zero(capsys):
    assert main(["verify", "--head-dim", "16"]) == 0
    out = capsys.readouterr().out
    assert "head_dim=16 base=10000 rotary_dim=16 pairing=half (GPT-NeoX / HF)" in out
    assert "check" in out and "max error" in out and "tolerance" in out
    assert "R_m^T R_n = R_(n-m)" in out and "textbook: theta=30deg, m=1, n=3 gives 0.5" in out
    assert "FAIL" not in out and out.count("PASS") >= 13
    assert out.rstrip().endswith("passed, 0 failed")


def test_json_output_follows_the_schema(capsys):
    assert (
        main(
            ["verify", "--head-dim", "12", "--rotary-dim", "8", "--base", "500000", "--interleaved", "--json"]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert list(doc) == ["checks"] and len(doc["checks"]) >= 13
    for check in doc["checks"]:
        assert list(check) == ["name", "max_error", "tolerance", "passed"]
        assert isinstance(check["name"], str) and isinstance(check["passed"], bool)
        assert isinstance(check["max_error"], float) and isinstance(check["tolerance"], float)
        assert check["passed"] and check["max_error"] <= check["tolerance"]


def test_a_failing_check_gives_a_non_zero_exit_and_a_fail_row(monkeypatch, capsys):
    broken = [Check("broken claim", 1.0, 1e-9)]
    monkeypatch.setattr("ropekit.tools.verify.run_checks", lambda config, **kw: broken)
    assert main(["verify"]) == 1
    out = capsys.readouterr().out
    assert "broken claim" in out and "FAIL" in out and "0 passed, 1 failed" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["verify", "--rotary-dim", "7"],
            "rotary_dim: expected a positive even integer <= head_dim (128), got 7",
        ),
        (["verify", "--head-dim", "0"], "head_dim: expected a positive integer, got 0"),
        (["verify", "--base", "1"], "base: expected a finite number > 1, got 1.0"),
    ],
)
def test_bad_values_exit_2_with_the_message(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ropekit verify: error: ") and message in err


@pytest.mark.parametrize("argv", [["verify", "--head-dim", "abc"], ["verify", "--nope"], []])
def test_malformed_arguments_exit_2_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "usage: ropekit" in capsys.readouterr().err


def test_format_table_aligns_columns():
    table = ropekit.cli.verify.format_table([Check("short", 0.0, 1e-9), Check("a longer name", 2e-3, 1e-9)])
    rows = table.splitlines()
    assert rows[2].index("PASS") == rows[3].index("FAIL")
    assert rows[-1] == "1 passed, 1 failed"


def test_python_dash_m_ropekit_verify_runs_the_same_command():
    done = subprocess.run(
        [sys.executable, "-m", "ropekit", "verify", "--head-dim", "8", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert all(c["passed"] for c in json.loads(done.stdout)["checks"])


def test_a_huge_head_dim_is_a_one_line_error_not_a_memory_error():
    done = subprocess.run(
        [sys.executable, "-m", "ropekit", "verify", "--head-dim", "100000"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "ropekit verify: error: head_dim: expected at most 1024 for verify (its checks build head_dim x "
        "head_dim rotation matrices), got 100000"
    ]


@pytest.mark.c_compiler
def test_backend_rows_are_printed_for_the_cpu_fast_path(capsys):
    assert main(["verify", "--head-dim", "16", "--backends", "cpu"]) == 0
    out = capsys.readouterr().out
    for row in ("backend cpu float32 (half)", "backend cpu bfloat16 (interleaved)"):
        assert row in out
    assert "backend torch" not in out


@pytest.mark.proof  # 7 CPU-s; the kernel's own interpreter suite is in the fast tier
def test_backends_triton_without_a_gpu_runs_the_kernel_in_the_interpreter():
    pytest.importorskip("triton")
    done = subprocess.run(
        [sys.executable, "-m", "ropekit", "verify", "--head-dim", "16", "--backends", "triton", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
    )
    assert done.returncode in (0, 1), done.stderr
    out = json.loads(done.stdout)
    rows = {c["name"]: c for c in out["checks"]}
    for layout in ("half", "interleaved"):
        assert rows[f"backend triton float32 ({layout}) = float64 reference (error / bound)"]["passed"]
        assert f"backend triton bfloat16 ({layout}) = float64 reference (error / bound)" in rows
    if not torch.cuda.is_available():
        assert out["triton_mode"]["mode"] == "interpreter"
        assert "nothing about the compiled code" in out["triton_mode"]["proves"]


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"), reason="compiling needs the JIT"
)
@pytest.mark.proof  # 9 CPU-s; tests/tools/test_triton_aot.py compiles the kernels in the fast tier
def test_backends_triton_compile_only_compiles_for_three_gpus_and_says_so(capsys):
    pytest.importorskip("triton")
    argv = ["verify", "--head-dim", "64", "--rotary-dim", "32", "--backends", "triton", "--compile-only"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "triton: compile-only: compiled this configuration's kernels" in out
    for arch in (80, 90, 100):
        assert f"triton sm_{arch} bf16 backward, positions: machine-code findings" in out
    assert "backend triton" not in out  # nothing was run
    assert main(["verify", "--backends", "torch", "--compile-only"]) == 2
    assert "compile_only: expected --backends to include 'triton'" in capsys.readouterr().err


def test_framework_jax_runs_the_theorem_checks_and_the_jax_rows(capsys):
    pytest.importorskip("jax", reason="ropekit.jax needs the jax extra: pip install 'ropekit[jax]'")
    pytest.importorskip("flax.nnx", reason="ropekit.jax needs the jax extra (flax)")
    assert main(["verify", "--framework", "jax", "--head-dim", "32"]) == 0
    out = capsys.readouterr().out
    assert "R_m^T R_n = R_(n-m)" in out and "jax: jit traces of 4 decode steps - 1" in out
    assert "backend torch" not in out and out.rstrip().endswith("passed, 0 failed")
    assert main(["verify", "--framework", "jax", "--backends", "torch"]) == 2
    assert "framework: --backends and --compile-only pick torch backends" in capsys.readouterr().err


def test_framework_mlx_runs_the_theorem_checks_and_the_mlx_rows(capsys):
    pytest.importorskip("mlx.core", reason="ropekit.mlx needs the mlx extra: pip install 'ropekit[mlx]'")
    assert main(["verify", "--framework", "mlx", "--head-dim", "32", "--rotary-dim", "24", "--json"]) == 0
    names = [c["name"] for c in json.loads(capsys.readouterr().out)["checks"]]
    assert "R_m^T R_n = R_(n-m)" in names
    assert "mlx: layouts bthd and bhtd (T=8, H=3) = torch backend, bit for bit" in names
    assert "mlx: partial rotary (last 24 of 32) = torch backend, bit for bit" in names
    assert not any(n.startswith(("backend ", "jax: ")) for n in names)
    assert main(["verify", "--framework", "mlx", "--interleaved"]) == 0
    out = capsys.readouterr().out
    assert (
        "pairing=interleaved" in out
        and "mlx: position 2^24" in out
        and out.rstrip().endswith("passed, 0 failed")
    )
    assert main(["verify", "--framework", "mlx", "--compile-only"]) == 2
    err = capsys.readouterr().err
    assert "framework: --backends and --compile-only pick torch backends; drop them for 'mlx'" in err


def test_framework_mlx_without_mlx_names_the_extra(capsys, monkeypatch):
    from ropekit.tools import verify_framework

    real = verify_framework.importlib.util.find_spec
    monkeypatch.setattr(
        verify_framework.importlib.util, "find_spec", lambda n: None if n == "mlx" else real(n)
    )
    assert main(["verify", "--framework", "mlx"]) == 2
    assert (
        "framework: 'mlx' needs mlx installed (mlx missing): pip install 'ropekit[mlx]'"
        in capsys.readouterr().err
    )


def test_numerics_hf_prints_bit_rows_against_hfs_expression(capsys):
    assert main(["verify", "--head-dim", "16", "--numerics", "hf", "--backends", "torch"]) == 0
    out = capsys.readouterr().out
    assert "backend torch bfloat16 (half) numerics=hf = HF's x*cos + rotate_half(x)*sin" in out
    assert "FAIL" not in out


def test_numerics_triton_or_an_unknown_mode_exits_2_naming_it(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # whatever an earlier test imported Triton with
    assert main(["verify", "--numerics", "vllm", "--backends", "triton"]) == 2
    assert "cannot serve numerics='vllm'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["verify", "--numerics", "fast"])
    assert exit_.value.code == 2
