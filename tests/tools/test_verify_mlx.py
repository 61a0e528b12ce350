"""ropekit.tools.verify_mlx: the rows of `ropekit verify --framework mlx` pass, and catch a wrong rotation, a
fast path handed (B, T, H, D) as is, and bad arguments."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlx.core", reason="ropekit.mlx needs the mlx extra: pip install 'ropekit[mlx]'")

import mlx.core as mx

import ropekit.mlx as rm
from ropekit.config import RopeConfig
from ropekit.tools import verify_framework
from ropekit.tools.verify_mlx import mlx_checks, run_mlx_checks

FAST_ROWS = 4  # float32 in both layouts, float16, partial rotary: mx.fast.rope, not the table rotation


@pytest.mark.parametrize("interleaved", [False, True])
def test_every_mlx_row_passes(interleaved):
    rows = mlx_checks(RopeConfig(32, rotary_dim=24, interleaved=interleaved), np.random.default_rng(0))
    assert len(rows) == 18 and all(r.name.startswith("mlx: ") for r in rows)
    assert all(r.passed for r in rows), [r for r in rows if not r.passed]
    assert "mlx: partial rotary (last 24 of 32) = torch backend, bit for bit" in {r.name for r in rows}


def test_a_rotation_that_drops_the_sign_of_sin_fails_the_rows_that_compare_outputs(monkeypatch):
    real = rm._rotate_rows
    monkeypatch.setattr(rm, "_rotate_rows", lambda x, c, s, *a, **kw: real(x, c, -s, *a, **kw))
    rows = mlx_checks(RopeConfig(32), np.random.default_rng(0))
    failed = {r.name for r in rows if not r.passed}
    assert "mlx: apply_rotary float32 (half) = torch backend, bit for bit" in failed
    assert "mlx: layouts bthd and bhtd (T=8, H=3) = torch backend, bit for bit" in failed
    assert "mlx: position 2^24, float32 = float64 reference (norm of the error, unit vectors)" in failed
    assert "mlx: cos_sin = RopeConfig.cos_sin (torch), bit for bit" not in failed  # the tables are right
    # every output row of the table path; the tables and mx.fast.rope's rows do not use it
    assert len(failed) == len(rows) - 1 - FAST_ROWS
    assert not any(name.startswith("mlx: fast=True") for name in failed)


def test_mx_fast_rope_handed_bthd_as_is_fails_the_bthd_fast_rows(monkeypatch):
    """The pitfall: mx.fast.rope reads axis -2 as the sequence axis, so (B, T, H, D) rotates by head index."""

    def naive(self, x_bthd, offsets):
        offset = mx.array(np.asarray(offsets).astype(np.int32))
        config = self.config
        return mx.fast.rope(
            x_bthd, config.rotary_dim, traditional=config.interleaved, base=None, scale=1.0, offset=offset,
            freqs=self.freqs,
        )  # fmt: skip

    monkeypatch.setattr(rm.RotaryEmbedding, "_fast", naive)
    rows = mlx_checks(RopeConfig(32), np.random.default_rng(0))
    failed = {r.name for r in rows if not r.passed}
    assert any(name.startswith("mlx: fast=True float32 layout bthd") for name in failed)
    assert any(name.startswith("mlx: fast=True float32 layout bhtd") for name in failed)
    assert all(name.startswith("mlx: fast=True") for name in failed)


def test_bad_arguments_are_refused_by_name(monkeypatch):
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match=r"n_positions: expected a positive integer other than 3 .*got 3"):
        mlx_checks(RopeConfig(16), rng, n_positions=3)
    with pytest.raises(ValueError, match=r"n_positions: expected a positive integer other than 3.*got 0"):
        mlx_checks(RopeConfig(16), rng, n_positions=0)
    with pytest.raises(ValueError, match=r"max_position: expected a positive integer, got -1"):
        mlx_checks(RopeConfig(16), rng, max_position=-1)
    with pytest.raises(ValueError, match=r"config: expected a ropekit.RopeConfig, got 16"):
        run_mlx_checks(16)
    monkeypatch.setattr(verify_framework.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        ValueError, match=r"framework: 'mlx' needs mlx installed .*pip install 'ropekit\[mlx\]'"
    ):
        run_mlx_checks(RopeConfig(16))
