"""ropekit.tools.verify_jax: the rows of `ropekit verify --framework jax` pass, and catch a wrong rotation."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax", reason="ropekit.jax needs the jax extra: pip install 'ropekit[jax]'")
pytest.importorskip("flax.nnx", reason="ropekit.jax needs the jax extra (flax): pip install 'ropekit[jax]'")

import ropekit.jax as rj
from ropekit.config import RopeConfig
from ropekit.tools.verify_jax import jax_checks


@pytest.mark.parametrize("interleaved", [False, True])
def test_every_jax_row_passes(interleaved):
    rows = jax_checks(RopeConfig(32, rotary_dim=24, interleaved=interleaved), np.random.default_rng(0))
    assert len(rows) == 10 and all(r.name.startswith("jax: ") for r in rows)
    assert all(r.passed for r in rows), [r for r in rows if not r.passed]


def test_a_rotation_that_drops_the_sign_of_sin_fails_the_rows_that_compare_outputs(monkeypatch):
    real = rj._rotate
    monkeypatch.setattr(rj, "_rotate", lambda x, c, s, *a, **kw: real(x, c, -s, *a, **kw))
    failed = {r.name for r in jax_checks(RopeConfig(32), np.random.default_rng(0)) if not r.passed}
    assert "jax: apply_rotary eager float32 = torch backend, bit for bit" in failed
    assert "jax: position 2^24, float32 = float64 reference (norm of the error, unit vectors)" in failed
    assert "jax: cos_sin = RopeConfig.cos_sin (torch), bit for bit" not in failed  # the tables are right
    assert len(failed) == 8  # every output row but the trace count, the tables and the grad (the inverse)
