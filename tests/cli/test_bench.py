"""`ropekit bench`: a one-repeat run writes the CSV and the plot; bad input is a message, not a traceback."""

from __future__ import annotations

import csv

import pytest

from ropekit.cli import main
from ropekit.tools import bench


@pytest.mark.c_compiler
def test_bench_writes_csv_and_plot(tmp_path, capsys):
    out_csv, out_png = tmp_path / "b.csv", tmp_path / "b.png"
    argv = ["bench", "--shapes", "tiny", "--repeats", "1", "--rows", "ropekit[cpu]", "--no-memory"]
    assert main([*argv, "--csv", str(out_csv), "--plot", str(out_png)]) == 0
    text = capsys.readouterr().out
    assert "ropekit[cpu]" in text and "x copy_" in text
    with open(out_csv) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == bench.COLUMNS
    modes = {f"ropekit[cpu] numerics={m}{s}" for m in ("hf", "vllm") for s in ("", " in-place")}
    assert {r["row"] for r in rows} == {"copy_", "clone", "ropekit[cpu]", "ropekit[cpu] in-place", *modes}
    assert all(float(r["x_copy"]) > 0 for r in rows)
    assert out_png.read_bytes()[:4] == b"\x89PNG"


def test_bench_unknown_shape_is_an_error_message(capsys):
    assert main(["bench", "--shapes", "nope", "--repeats", "1"]) == 2
    assert "shapes: expected names" in capsys.readouterr().err


def test_bench_min_run_time_is_passed_on_and_checked(capsys):
    argv = ["bench", "--shapes", "decode-1", "--repeats", "1", "--rows", "ropekit[cpu]", "--no-memory"]
    assert main([*argv, "--min-run-time", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "min_run_time=0.01s" in out and "== decode-1 ==" in out
    assert main([*argv, "--min-run-time", "0"]) == 2
    assert "min_run_time: expected a number of seconds > 0" in capsys.readouterr().err


def test_bench_roofline_prints_bytes_and_predicted_time_naming_the_bandwidth_source(capsys):
    assert main(["bench", "--roofline", "--gpu", "h200", "--shapes", "decode-1", "prefill-4k"]) == 0
    out = capsys.readouterr().out
    assert "H200 SXM, 4.8 TB/s" in out and "datasheet" in out and "torch.bfloat16" in out
    for row in ("ropekit[triton]", "flash-attn", "Liger", "HF eager", "Meta complex"):
        assert out.count(row) == 2, row
