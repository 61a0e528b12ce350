"""benchmarks/gpu_check.py runs only on a GPU; here: it imports, refuses politely without one, and every
decode step it checks for host syncs is a valid call (run on the CPU)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_without_a_gpu_it_exits_2_before_doing_anything(gpu_check, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--no-bench"])
    assert gpu_check.main() == 2
    assert "no CUDA device" in capsys.readouterr().out


def test_every_decode_step_is_a_valid_call_with_the_decode_shapes(gpu_check):
    steps = gpu_check.decode_steps("cpu")
    assert {"RotaryEmbedding, positions tensor", "apply_rotary_qk, offsets tensor"} <= set(steps)
    for name, step in steps.items():
        out = step()
        outs = (out,) if isinstance(out, torch.Tensor) else out
        assert outs[0].shape == (1, 1, 32, 128), name
        assert all(torch.isfinite(o.float()).all() for o in outs), name


def test_decode_steps_at_the_same_position_agree(gpu_check):
    steps = gpu_check.decode_steps("cpu")
    want = steps["apply_rotary_qk, int offset"]()
    for name in [
        "apply_rotary_qk, offsets tensor",
        "RotaryEmbedding, int offset",
        "RotaryEmbedding, positions tensor",
    ]:
        got = steps[name]()
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), name


def test_packed_decode_steps_are_the_decode_step_as_a_packed_call(gpu_check):
    """The no-sync check's packed (cu_seqlens) steps rotate the decode token as the 4-D step does."""
    want = gpu_check.decode_steps("cpu")["apply_rotary_qk, int offset"]()
    steps = gpu_check.packed_decode_steps("cpu")
    assert len(steps) == 2
    for name, step in steps.items():
        got = step()
        assert got[0].shape == (1, 32, 128), name
        assert all(torch.equal(g, w[0]) for g, w in zip(got, want, strict=True)), name


def test_roofline_lines_give_the_share_of_published_bandwidth_each_measured_row_reached(gpu_check):
    from ropekit.tools import roofline

    ours = next(
        t
        for t in roofline.traffic(gpu_check.bench.SHAPES["prefill-4k"], torch.bfloat16)
        if t.row == "ropekit[triton]"
    )
    at_half_bandwidth = ours.total / 3.35e12 * 2 * 1e6  # microseconds
    records = [
        {"shape": "prefill-4k", "row": "ropekit[triton]", "dtype": "bfloat16", "fwd_us": at_half_bandwidth},
        {
            "shape": "prefill-4k",
            "row": "ropekit[triton] in-place",
            "dtype": "bfloat16",
            "fwd_us": at_half_bandwidth,
        },
        {
            "shape": "prefill-4k",
            "row": "torchtune",
            "dtype": "bfloat16",
            "fwd_us": 10.0,
        },  # no model: left out
        {"shape": "prefill-4k", "row": "Liger", "dtype": "bfloat16", "fwd_us": float("nan")},  # skipped row
    ]
    lines = gpu_check.roofline_lines(records, "NVIDIA H100 80GB HBM3")
    assert lines[0].startswith("roofline: H100 SXM, 3.35 TB/s") and len(lines) == 3
    assert all(line.endswith("50% of peak bandwidth") for line in lines[1:])
    assert "no published bandwidth" in gpu_check.roofline_lines(records, "NVIDIA L4")[0]
