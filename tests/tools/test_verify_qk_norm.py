"""ropekit.tools.verify_qk_norm: the QK-norm rows of ``ropekit verify`` pass, and catch a wrong norm."""

from __future__ import annotations

import pytest

from ropekit.config import RopeConfig
from ropekit.tools.verify import run_checks


@pytest.mark.c_compiler
def test_rows_pass_in_every_form_and_a_norm_dropping_gemmas_offset_fails_only_its_rows(monkeypatch):
    import ropekit.backends.eager.qk_norm as qk_norm

    config = RopeConfig(32, rotary_dim=16)
    rows = {c.name: c for c in run_checks(config, backends=["cpu", "torch"]) if c.name.startswith("qk_norm")}
    assert len(rows) == 3 * 2 * 2 and all(c.passed for c in rows.values()), rows
    real = qk_norm.rms_norm
    monkeypatch.setattr(qk_norm, "rms_norm", lambda x, w, spec: real(x, w, spec._replace(weight_offset=0.0)))
    failed = {c.name for c in run_checks(config, backends=["cpu", "torch"]) if not c.passed}
    assert failed == {
        f"qk_norm_rotary_ torch {dtype} (gemma3) = float64 composition (error / bound)"
        for dtype in ("float32", "bfloat16")
    }
