"""cos/sin tables stay exact to 1e-6 at every position up to 2^24 (base 5e5, head_dim 128).

The reference is the formula itself evaluated in NumPy's extended precision (x87 80-bit long double, 64-bit
mantissa), so it is ~2000x more accurate than float64 at these angles and independent of ropekit's code path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ropekit import RopeConfig

BASE, HEAD_DIM = 5e5, 128
LIMIT = 2**24

pytestmark = pytest.mark.skipif(
    np.finfo(np.longdouble).eps > 1e-18, reason="needs an extended-precision long double for the reference"
)


def _exact(positions: np.ndarray, base: float = BASE, dim: int = HEAD_DIM) -> tuple[np.ndarray, np.ndarray]:
    i = np.arange(dim // 2, dtype=np.longdouble)
    theta = np.longdouble(base) ** (-2 * i / np.longdouble(dim))
    angle = positions.astype(np.longdouble)[:, None] * theta  # (n, dim / 2)
    return np.cos(angle), np.sin(angle)


def _positions() -> np.ndarray:
    rng = np.random.default_rng(0)
    landmarks = [0, 1, 4095, 131072, 2**20, 2**22, LIMIT - 1, LIMIT]
    return np.concatenate([landmarks, rng.integers(0, LIMIT + 1, 4000)]).astype(np.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tables_match_the_exact_formula_to_1e_minus_6_up_to_position_2_pow_24(dtype):
    positions = _positions()
    want_cos, want_sin = _exact(positions)
    cos, sin = RopeConfig(HEAD_DIM, BASE).cos_sin(torch.from_numpy(positions), dtype=dtype)
    assert cos.dtype == dtype
    err = max(
        np.abs(cos.double().numpy() - want_cos).max(),
        np.abs(sin.double().numpy() - want_sin).max(),
    )
    # float32 tables: one rounding of a value in [-1, 1] (<= 6e-8); float64: angle round-off ~1e-9.
    assert err <= (1e-7 if dtype == torch.float32 else 1e-8), err


def test_hf_float32_inv_freq_reproduces_the_float32_drift_it_documents():
    """The opt-in HF rounding is what makes long positions drift (docs/scaling.md quotes these figures)."""
    positions = np.array([131072, LIMIT])
    want_cos, _ = _exact(positions)
    cos, _ = RopeConfig(HEAD_DIM, BASE, hf_float32_inv_freq=True).cos_sin(
        torch.from_numpy(positions), dtype=torch.float64
    )
    err = np.abs(cos.numpy() - want_cos).max(axis=1)
    assert 1e-3 < err[0] < 1e-2 and err[1] > 0.3, err
