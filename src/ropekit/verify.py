"""Numerical checks of every claim the seed documents make, for one configuration.

Each check compares two computations that the mathematics (docs/math.md) says are equal and reports the largest
difference against a float64 tolerance. Used by ``ropekit verify`` and the demo report.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

from ropekit import reference as ref
from ropekit.config import RopeConfig
from ropekit.functional import apply_rotary

__all__ = ["Check", "run_checks"]

# float64 round-off grows with the angle m*theta; positions up to a few thousand keep errors near 1e-12.
TOL = 1e-9


@dataclass(frozen=True)
class Check:
    name: str
    max_error: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return bool(self.max_error <= self.tolerance)

    def as_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def _err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


def run_checks(config: RopeConfig, *, seed: int = 0, n_positions: int = 8, max_position: int = 4096) -> list[Check]:
    """Run every check for ``config``; the textbook examples are included regardless of config."""
    rng = np.random.default_rng(seed)
    d = config.rotary_dim
    D = config.head_dim
    theta = ref.inv_freq(d, config.base)
    positions = rng.integers(0, max_position, size=n_positions)
    checks: list[Check] = []

    def add(name: str, err: float, tol: float = TOL) -> None:
        checks.append(Check(name, err, tol))

    # Scaling schedules change theta on purpose; the seeds' claims are about the unscaled rotation.
    config = RopeConfig(config.head_dim, config.base, rotary_dim=d, interleaved=config.interleaved)
    add("RopeConfig.inv_freq = base^(-2i/d)", _err(config.inv_freq().numpy(), theta))

    # Orthogonality and determinant of R_m.
    eye = np.eye(d)
    add("R^T R = I", max(_err(ref.rotation_matrix(m, theta).T @ ref.rotation_matrix(m, theta), eye) for m in positions))
    add("det R = 1", max(abs(np.linalg.det(ref.rotation_matrix(m, theta)) - 1.0) for m in positions))

    # Composition: R_m^T R_n = R_{n-m}.
    pairs = rng.integers(0, max_position, size=(n_positions, 2))
    add(
        "R_m^T R_n = R_(n-m)",
        max(
            _err(ref.rotation_matrix(m, theta).T @ ref.rotation_matrix(n, theta), ref.rotation_matrix(n - m, theta))
            for m, n in pairs
        ),
    )

    # The inner product of rotated q and k depends only on n - m.
    q, k = rng.standard_normal(D), rng.standard_normal(D)
    errs = []
    for offset in rng.integers(-64, 64, size=4):
        starts = rng.integers(max(0, -offset), max_position, size=n_positions)
        dots = [ref.rotate_interleaved(q, m, theta) @ ref.rotate_interleaved(k, m + offset, theta) for m in starts]
        scale = max(1.0, abs(dots[0]))
        errs.append((max(dots) - min(dots)) / scale)
    add("(R_m q).(R_n k) depends only on n - m", max(errs))

    # Norm preservation.
    x = rng.standard_normal((n_positions, D))
    rotated = ref.rotate_interleaved(x, positions, theta)
    add("norms preserved", _err(np.linalg.norm(rotated, axis=-1), np.linalg.norm(x, axis=-1)))

    # Matrix form = complex form = interleaved elementwise form.
    by_matrix = np.stack([ref.rotate_matrix(x[i], positions[i], theta) for i in range(n_positions)])
    add("matrix form = complex form", _err(by_matrix, ref.rotate_complex(x, positions, theta)))
    add("matrix form = interleaved form", _err(by_matrix, rotated))

    # Half layout is the interleaved layout under the pair permutation.
    to_half = np.concatenate([ref.interleaved_to_half_permutation(d), np.arange(d, D)])
    add(
        "half form = interleaved form, permuted",
        _err(ref.rotate_half(x[:, to_half], positions, theta), rotated[:, to_half]),
    )

    # The production apply_rotary against the reference, both layouts, float64.
    cos, sin = config.cos_sin(int(positions.max()) + 1, dtype=torch.float64)
    xt = torch.from_numpy(x).reshape(1, n_positions, 1, D)  # (batch, seq, heads, head_dim)
    pos_t = torch.from_numpy(positions).reshape(1, n_positions)
    for interleaved, name in ((False, "half"), (True, "interleaved")):
        got = apply_rotary(xt, cos, sin, positions=pos_t, interleaved=interleaved, backend="torch")
        rotate = ref.rotate_interleaved if interleaved else ref.rotate_half
        want = rotate(x, positions, theta)[None, :, None, :]
        add(f"apply_rotary ({name}) = reference", _err(got.numpy(), want))

    # The textbook's worked examples (d = 2, theta given directly in degrees).
    def dot2(angle_deg: float, m: int, n: int) -> float:
        t = np.array([math.radians(angle_deg)])
        return float(ref.rotate_interleaved(np.array([1.0, 0.0]), m, t) @ ref.rotate_interleaved(np.array([1.0, 0.0]), n, t))

    add("textbook: theta=30deg, m=1, n=3 gives 0.5", abs(dot2(30.0, 1, 3) - 0.5))
    add("textbook: theta=45deg, m=0, n=2 gives 0", abs(dot2(45.0, 0, 2) - 0.0))
    pe = ref.sinusoidal(np.array([1, 2]), 4)
    printed = np.array([[0.841, 0.909], [0.99995, 0.9998]])  # the textbook's rounded figures
    got = np.array([[pe[0, 0], pe[1, 0]], [pe[0, 3], pe[1, 3]]])
    add("textbook: sinusoidal d=4 at 1, 2 (to printed digits)", _err(got, printed), 5e-4)
    return checks
