"""ropekit.tools.bench_fused: the fused rows beside their unfused sequences, with the bytes each moves."""

from __future__ import annotations

import math

import pytest
import torch

from ropekit.tools import bench
from ropekit.tools.bench_fused import FUSED_ROWS, CopyFloor, copy_floor, fused_records, random_bytes


@pytest.fixture(scope="module")
def records():
    case = bench.make_case(bench.Shape("llama-heads", 1, 8, 32, 8, 16), torch.float32, torch.device("cpu"))
    fast = lambda fn, min_run_time: (fn(), 1e-3)[1]  # noqa: E731 - one call, a fixed time: no timing here
    return fused_records(case, bench.COLUMNS, fast, None, 0.01, 1, lambda msg: None)


def test_every_fusion_gives_a_fused_and_an_unfused_row_that_agree(records):
    names = [r["row"] for r in records]
    for row in FUSED_ROWS:
        assert f"fused {row.name}" in names and f"unfused {row.name}" in names
    for r in records:
        assert list(r) == bench.COLUMNS
        assert r["note"] == "" and r["max_err"] <= (1e-5 if "cache" in r["row"] else 32.0)
        if r["row"].startswith("unfused"):
            assert r["x_unfused"] == 1.0


def test_bytes_column_gives_the_savings_of_each_fusion_with_32_query_and_8_key_heads(records):
    mb = {r["row"]: r["mb"] for r in records}
    # cache: 2 (q + k + v) against 2 (q + k) + 2 (k + v); with Hq = 4 Hk, 96 against 112 units: saves 1/7
    assert 1 - mb["fused rope+cache"] / mb["unfused rope+cache"] == pytest.approx(1 / 7)
    # fp8 from float32: read 4 + write 1 bytes against rotate (4 + 4) then scale and cast (4 + 1): saves 8/13
    assert 1 - mb["fused rope+fp8"] / mb["unfused rope+fp8"] == pytest.approx(8 / 13)


def test_run_benchmark_includes_the_fused_rows_by_name():
    recs, _ = bench.run_benchmark(["tiny"], repeats=1, include=["rope+cache"], min_run_time=0.01)
    rows = {r["row"] for r in recs}
    assert {"fused rope+cache", "unfused rope+cache"} <= rows and "fused rope+fp8" not in rows
    assert all(not math.isnan(r["mb"]) for r in recs)


COLS = bench.COLUMNS


@pytest.mark.parametrize("shape", ["tiny", "tiny-varlen", "decode-1"])
def test_qk_norm_row_agrees_with_rms_norm_then_rotate_and_moves_half_the_bytes(shape):
    case = bench.make_case(bench.SHAPES[shape], torch.float32, torch.device("cpu"))
    calls = []

    def measure(fn, min_run_time):
        calls.append(fn)
        fn()
        return 1e-3 * len(calls)

    records = fused_records(case, columns=COLS, include=["qknorm"], min_run_time=0.0, repeats=2,
                            measure=measure, log=lambda message: None)  # fmt: skip
    fused, unfused = records
    assert (fused["row"], unfused["row"]) == ("fused qknorm+rope", "unfused qknorm+rope")
    assert fused["note"] == "" and fused["max_err"] < 1e-4
    q_k_bytes = (case.q.numel() + case.k.numel()) * 4
    assert fused["mb"] * 2**20 == 2 * q_k_bytes and unfused["mb"] == 2 * fused["mb"]
    assert len(calls) == 6  # two rounds of fused, unfused and the copy floor, interleaved
    assert set(fused) == set(COLS)


def test_include_filters_the_fused_rows():
    case = bench.make_case(bench.SHAPES["tiny"], torch.float32, torch.device("cpu"))
    kw = dict(columns=COLS, min_run_time=0.0, repeats=1, measure=lambda fn, t: 1.0, log=lambda m: None)
    assert fused_records(case, include=["no such row"], **kw) == []


@pytest.mark.parametrize("row", FUSED_ROWS, ids=lambda row: row.name)
def test_copy_floor_reads_and_writes_buffers_that_hold_values_before_timing(row):
    # A torch.empty buffer never written maps the shared zero page: reading it is cheaper than any real read.
    case = bench.make_case(bench.SHAPES["decode-1"], torch.float32, torch.device("cpu"))
    floors = []

    def measure(fn, min_run_time):
        if isinstance(fn, CopyFloor) and not floors:
            floors.append([bool((t != 0).all()) for t in (*fn.sources, *fn.buffers)])
        fn()
        return 1e-3

    fused_records(case, columns=COLS, include=[row.name], min_run_time=0.0, repeats=1,
                  measure=measure, log=lambda message: None)  # fmt: skip
    assert floors and len(floors[0]) >= 2 and all(floors[0])


def test_random_bytes_are_never_zero_and_copy_floor_copies_them():
    src = random_bytes(1 << 16, torch.device("cpu"))
    floor = copy_floor((src,))
    assert src.dtype == torch.uint8 and src.numel() == 1 << 16 and bool((src != 0).all())
    assert bool((floor.buffers[0] == 1).all())
    floor()
    assert torch.equal(floor.buffers[0], src) and floor.buffers[0].data_ptr() != src.data_ptr()
