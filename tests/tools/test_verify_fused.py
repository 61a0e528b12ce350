"""ropekit.tools.verify_fused: the serving-fusion rows of ``ropekit verify`` pass, and fail when they must."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ropekit.backends.eager import fused as fused_eager
from ropekit.config import RopeConfig
from ropekit.tools.verify import Check, backend_device, backend_error_bound
from ropekit.tools.verify_fused import fused_checks


def _rows(backends, interleaved=False):
    config = RopeConfig(16, 10000.0, interleaved=interleaved)
    rng = np.random.default_rng(0)
    return fused_checks(
        config, backends, rng, 12, 512, check=Check, bound=backend_error_bound, device_of=backend_device
    )


@pytest.mark.c_compiler
def test_every_fused_row_passes_on_torch_and_cpu():
    rows = _rows(["torch", "cpu", "not-a-fused-backend"], interleaved=True)
    assert len(rows) == 2 * 5  # cache nhd / hnd, fp8 e4m3fn / e5m2, shift; a backend without kernels skipped
    assert all(r.passed for r in rows), [r for r in rows if not r.passed]


def test_an_fp8_store_that_rounds_twice_fails_the_contract_row(monkeypatch):
    def through_bfloat16(r, scale, fp8_dtype):  # rounded to bfloat16 first: a double rounding
        fmax = torch.finfo(fp8_dtype).max
        return (r / scale[:, None]).clamp(-fmax, fmax).to(torch.bfloat16).to(fp8_dtype)

    monkeypatch.setattr(fused_eager, "fp8_quantize", through_bfloat16)
    rows = {r.name: r for r in _rows(["torch"])}
    for fp8 in ("float8_e4m3fn", "float8_e5m2"):
        assert not rows[f"fused rope+fp8 torch {fp8}: bytes differing from the rounding contract"].passed
    assert all(r.passed for name, r in rows.items() if "rope+fp8" not in name)
