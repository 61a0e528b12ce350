"""ropekit.tools.bench_fused: fused rows run beside their unfused sequence, agree with it, count bytes."""

from __future__ import annotations

import pytest
import torch

from ropekit.tools.bench import COLUMNS, SHAPES, make_case
from ropekit.tools.bench_fused import fused_records

COLS = [*COLUMNS, *(c for c in ("mb", "x_unfused") if c not in COLUMNS)]  # bench adds them on merge


@pytest.mark.parametrize("shape", ["tiny", "tiny-varlen", "decode-1"])
def test_qk_norm_row_agrees_with_rms_norm_then_rotate_and_moves_half_the_bytes(shape):
    case = make_case(SHAPES[shape], torch.float32, torch.device("cpu"))
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
    case = make_case(SHAPES["tiny"], torch.float32, torch.device("cpu"))
    kw = dict(columns=COLS, min_run_time=0.0, repeats=1, measure=lambda fn, t: 1.0, log=lambda m: None)
    assert fused_records(case, include=["no such row"], **kw) == []
