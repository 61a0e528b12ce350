"""ropekit.tools.bench: a tiny interleaved run, memory accounting, and argument checks."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
import torch

from ropekit import reference
from ropekit.tools import bench


@pytest.fixture(scope="module")
def tiny_records():
    records, notes = bench.run_benchmark(
        ["tiny", "tiny-varlen", "decode-1"],
        repeats=1,
        include=["ropekit", "Meta", "HF eager"],
        min_run_time=0.02,
    )
    return records, notes


@pytest.mark.c_compiler
def test_quick_run_gives_every_column_and_positive_ratios(tiny_records):
    records, _ = tiny_records
    assert {r["row"] for r in records} >= {"copy_", "clone", "ropekit[torch]", "ropekit[cpu]", "Meta complex"}
    assert {"ropekit.compat.hf", "ropekit.compat.vllm in-place", "ropekit.RotaryEmbedding"} <= {
        r["row"] for r in records
    }
    for r in records:
        assert list(r) == bench.COLUMNS
        assert r["fwd_ms"] > 0 and r["x_copy"] > 0 and r["x_clone"] > 0 and r["fwd_gbps"] > 0
        assert r["fwd_us"] == pytest.approx(1000 * r["fwd_ms"])
        assert r["note"] == ""
    for r in records:
        if r["row"] == "copy_":
            assert r["x_copy"] == 1.0


@pytest.mark.c_compiler
def test_numerics_rows_run_on_the_backend_auto_picks_for_each_mode(tiny_records):
    records, _ = tiny_records
    rows = {r["row"] for r in records}
    for numerics in ("hf", "vllm"):
        assert {f"ropekit[cpu] numerics={numerics}", f"ropekit[cpu] numerics={numerics} in-place"} <= rows
    peers = [r for r in records if "numerics=" in r["row"]]
    assert peers and all(r["max_err"] == 0 for r in peers if r["dtype"] == "float32")  # exact's bits


def test_every_row_agrees_with_the_reference_on_the_same_inputs(tiny_records):
    records, _ = tiny_records
    for r in records:
        if r["row"] not in ("copy_", "clone"):
            # Peers forming float32 angles drift ~position * 1e-7: decode-1 sits near position 4000.
            far = r["shape"] == "decode-1" and not r["row"].startswith("ropekit")
            assert r["max_err"] < (1e-3 if far else 1e-5), r


def test_triton_on_cpu_is_skipped_with_the_dispatchs_reason(tiny_records):
    _, notes = tiny_records
    assert any("ropekit[triton] skipped: backend: 'triton' cannot serve" in n for n in notes)


def test_decode_1_is_one_llama_3_8b_token_at_an_int_offset():
    case = bench.make_case(bench.SHAPES["decode-1"], torch.float32, torch.device("cpu"))
    assert case.q.shape == (1, 1, 32, 128) and case.k.shape == (1, 1, 8, 128)
    offset = case.ropekit_kwargs["offsets"]
    assert isinstance(offset, int) and case.positions.tolist() == [[offset]]


@pytest.mark.c_compiler
def test_ropekit_rows_are_the_dispatchs_choice_and_the_torch_baseline(monkeypatch):
    """bench asks ropekit.backends.select_backend; it keeps no copy of the skip rules."""
    case = bench.make_case(bench.SHAPES["tiny"], torch.float32, torch.device("cpu"))
    real = bench.select_backend

    def refusing_cpu(name, q, cos, **needs):
        if name in ("cpu", "auto"):
            if name == "cpu":
                raise ValueError("backend: 'cpu' cannot serve these inputs: a test said so")
            return real("torch", q, cos, **needs)
        return real(name, q, cos, **needs)

    assert bench.ropekit_backends(case)[0] == [real("auto", case.q, case.cos).name, "torch"]
    monkeypatch.setattr(bench, "select_backend", refusing_cpu)
    names, notes = bench.ropekit_backends(case)
    assert names == ["torch"]
    assert "ropekit[cpu] skipped: backend: 'cpu' cannot serve these inputs: a test said so" in notes


def test_a_peer_row_appended_to_the_list_is_run_or_skipped_with_a_note(monkeypatch):
    case = bench.make_case(bench.SHAPES["tiny"], torch.float32, torch.device("cpu"))
    extra = bench.Row("extra", lambda case: lambda q, k: (q.clone(), k.clone()))
    missing = bench.Row("missing", extra.setup)
    monkeypatch.setattr(
        bench,
        "PEER_ROWS",
        [bench.PeerRow(lambda: extra), bench.PeerRow(lambda: missing, "no_such_module_xyz")],
    )
    rows, notes = bench.build_rows(case)
    assert "extra" in [r.name for r in rows] and "missing" not in [r.name for r in rows]
    assert any(n.startswith("missing skipped: cannot import no_such_module_xyz") for n in notes)


def test_measure_reports_seconds_per_call():
    import time

    per_call = bench.measure(lambda: time.sleep(2e-3), min_run_time=0.05)
    assert 2e-3 <= per_call < 0.1


def test_plot_legend_lies_outside_the_axes(tiny_records):
    import matplotlib.pyplot as plt

    fig = bench.figure(tiny_records[0])
    fig.canvas.draw()
    (ax,) = fig.axes
    renderer = fig.canvas.get_renderer()
    legend, axes = ax.get_legend().get_window_extent(renderer), ax.get_window_extent(renderer)
    assert legend.x0 >= axes.x1  # entirely to the right: no bar is hidden
    plt.close(fig)


@pytest.mark.c_compiler
def test_ropekit_training_step_saves_only_tables_and_positions():
    case = bench.make_case(bench.SHAPES["tiny"], torch.float32, torch.device("cpu"))
    row = bench._ropekit_row("cpu", inplace=False)
    saved_mb, peak_mb = bench.measure_memory(row, row.setup(case), case)
    tables = case.cos.nbytes + case.sin.nbytes
    # The positions are saved when they were built as a tensor; an int offset (the fast path) needs none.
    assert saved_mb * 2**20 in (tables, tables + case.positions.nbytes)
    # Peak beyond the inputs: the two outputs and the two gradients, nothing else.
    assert peak_mb * 2**20 <= 2 * case.nbytes + tables + case.positions.nbytes


@pytest.mark.c_compiler
def test_ropekit_peak_memory_is_below_hf_eager():
    pytest.importorskip("transformers")
    case = bench.make_case(bench.SHAPES["tiny"], torch.float32, torch.device("cpu"))
    ours, hf = bench._ropekit_row("cpu", inplace=False), bench._hf_row(compiled=False)
    assert (
        bench.measure_memory(ours, ours.setup(case), case)[1]
        < bench.measure_memory(hf, hf.setup(case), case)[1]
    )


def test_meta_complex_form_is_the_interleaved_reference_rotation():
    theta = reference.inv_freq(8)
    x = torch.randn(1, 3, 2, 8, dtype=torch.float64)
    pos = np.array([0, 5, 11])
    angle = torch.from_numpy(pos[:, None] * theta)[None, :, None, :]  # (1, 3, 1, 4)
    got = bench.meta_complex_rotary(x, torch.polar(torch.ones_like(angle), angle))
    want = reference.rotate_interleaved(x.numpy(), pos[None, :, None], theta)
    np.testing.assert_allclose(got.numpy(), want, atol=1e-6)


def test_csv_has_the_documented_columns(tiny_records, tmp_path):
    records, _ = tiny_records
    path = tmp_path / "bench.csv"
    bench.write_csv(records, str(path))
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == bench.COLUMNS and len(rows) == len(records)
    assert all(float(r["x_copy"]) > 0 for r in rows)


def test_table_lists_each_shape_and_marks_missing_figures(tiny_records):
    text = bench.format_table(tiny_records[0])
    assert "== tiny ==" in text and "== tiny-varlen ==" in text
    assert math.isnan(next(r for r in tiny_records[0] if r["row"] == "copy_")["fwd_bwd_ms"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"shapes": ["huge"]}, "shapes: expected names"),
        ({"shapes": ["tiny"], "dtype": "float64"}, "dtype: expected one of"),
        ({"shapes": ["tiny"], "device": "tpu"}, "device: expected"),
        ({"shapes": ["tiny"], "repeats": 0}, "repeats: expected a positive integer"),
        ({"shapes": ["tiny"], "min_run_time": 0}, "min_run_time: expected a number of seconds > 0"),
    ],
)
def test_bad_arguments_are_value_errors(kwargs, match):
    shapes = kwargs.pop("shapes")
    with pytest.raises(ValueError, match=match):
        bench.run_benchmark(shapes, **kwargs)
