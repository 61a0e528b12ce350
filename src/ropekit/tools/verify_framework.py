"""What the framework rows of ``ropekit verify --framework jax|mlx`` share: the entry point (theorem checks,
then the framework's rows), the float64-reference row per dtype and pairing, the torch path they are compared
with, the ulp measure and the far-position row. Torch and NumPy only; no framework is imported here."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ropekit import reference as ref
from ropekit.config import RopeConfig
from ropekit.functional import apply_rotary
from ropekit.tools.verify import Check, backend_error_bound, run_checks
from ropekit.validation import describe

__all__ = [
    "FAR_POSITION",
    "PAIRINGS",
    "bit_row",
    "far_position_row",
    "pair_ulps",
    "reference_rows",
    "run_framework_checks",
    "tables_row",
    "torch_path",
]

# The far position the precision row rotates at: float32 angles are O(1) off there.
FAR_POSITION = 1 << 24
# (interleaved, the name a row gives the pairing)
PAIRINGS = ((False, "half"), (True, "interleaved"))

# rotate(x_float64, dtype_name, interleaved) -> (the input as stored in dtype, the output), both float64
Rotate = Callable[[np.ndarray, str, bool], tuple[np.ndarray, np.ndarray]]


def run_framework_checks(
    config: RopeConfig,
    framework: str,
    modules: Sequence[str],
    rows: Callable[[RopeConfig, np.random.Generator], list[Check]],
    *,
    seed: int = 0,
) -> list[Check]:
    """The theorem checks of :func:`ropekit.tools.verify.run_checks` (float64, no torch backend rows), then
    ``rows(config, rng)``, the framework's own.

    Raises:
        ValueError: naming the argument, for a config that is not a RopeConfig, or where one of ``modules``
            (the framework's extra) is not installed.
    """
    if not isinstance(config, RopeConfig):
        raise ValueError(f"config: expected a ropekit.RopeConfig, got {describe(config)}")
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(
            f"framework: {framework!r} needs {' and '.join(modules)} installed ({', '.join(missing)} "
            f"missing): pip install 'ropekit[{framework}]'"
        )
    return run_checks(config, seed=seed, backends=[]) + rows(config, np.random.default_rng(seed))


def tables_row(
    framework: str,
    cos_sin: Callable[[RopeConfig, int], tuple[object, object]],
    config: RopeConfig,
    rng: np.random.Generator,
    n_positions: int,
    max_position: int,
) -> tuple[np.ndarray, tuple[object, object], tuple[torch.Tensor, torch.Tensor], Check]:
    """The positions the rows rotate at (n_positions drawn from [0, max_position)), the framework's tables
    ``cos_sin(config, length)`` and torch's for them, and the row saying the two are equal bit for bit."""
    positions = rng.integers(0, max_position, size=n_positions)
    length = int(positions.max()) + 1
    tables, torch_tables = cos_sin(config, length), config.cos_sin(length)
    row = bit_row(f"{framework}: cos_sin = RopeConfig.cos_sin (torch), bit for bit", tables, torch_tables)
    return positions, tables, torch_tables, row


def reference_rows(
    name: str, x: np.ndarray, positions: np.ndarray, config: RopeConfig, dtypes: Sequence[str], rotate: Rotate
) -> list[Check]:
    """One row per dtype and pairing: ``rotate``'s output against the float64 reference rotation of the
    same (already rounded) input, as error / :func:`backend_error_bound` (the torch backends' bound).

    x: (B, T, H, D) float64; positions: (T,), the position of each token; name: a format string with
    {dtype} and {pairing}.
    """
    theta = ref.inv_freq(config.rotary_dim, config.base)
    rows = []
    for dtype_name in dtypes:
        for interleaved, pairing in PAIRINGS:
            exact_in, got = rotate(x, dtype_name, interleaved)
            exact = ref.rotate_interleaved if interleaved else ref.rotate_half
            want = exact(exact_in, positions[None, :, None], theta)
            bound = backend_error_bound(want, getattr(torch, dtype_name), float(np.abs(exact_in).max()))
            error = np.abs(got - want) / bound
            rows.append(Check(name.format(dtype=dtype_name, pairing=pairing), float(error.max()), 1.0))
    return rows


def torch_path(
    x: np.ndarray,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: np.ndarray,
    *,
    interleaved: bool = False,
    rotary_position: str = "first",
) -> np.ndarray:
    """x (B, T, H, D) rotated by ropekit's torch backend at positions (B, T), as NumPy in x's dtype."""
    return apply_rotary(
        torch.from_numpy(np.ascontiguousarray(x)), cos, sin, positions=torch.from_numpy(positions),
        interleaved=interleaved, rotary_position=rotary_position, backend="torch",
    ).numpy()  # fmt: skip


def bit_row(name: str, got: Sequence[np.ndarray], want: Sequence[np.ndarray]) -> Check:
    """The largest |got - want| over the pairs of arrays, which must be 0 (bit for bit)."""
    error = max(
        float(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64)).max())
        for g, w in zip(got, want, strict=True)
    )
    return Check(name, error, 0.0)


def pair_ulps(got: np.ndarray, want: np.ndarray, x: np.ndarray, config: RopeConfig) -> float:
    """The largest |got - want| in float32 ulps of each pair's magnitude sqrt(a^2 + b^2) (half pairing)."""
    half = config.rotary_dim // 2
    a, b = x[..., :half].astype(np.float64), x[..., half : 2 * half].astype(np.float64)
    norm = np.sqrt(a * a + b * b).astype(np.float32)
    ulp = np.spacing(np.concatenate([norm, norm], -1))
    rot = slice(0, 2 * half)
    return float((np.abs(got[..., rot] - want[..., rot]) / ulp).max())


def far_position_row(
    name: str, x: np.ndarray, config: RopeConfig, rotate: Callable[[np.ndarray, np.ndarray], np.ndarray]
) -> Check:
    """Unit vectors (one head of x (B, T, H, D)) at FAR_POSITION + arange(T), rotated by
    ``rotate(unit, positions (1, T))`` in float32, against the float64 reference: the largest norm of the
    error, within 1e-6."""
    unit = np.asarray(x[:1, :, :1], np.float32)
    unit = unit / np.linalg.norm(unit, axis=-1, keepdims=True)
    far = FAR_POSITION + np.arange(unit.shape[1])
    exact = ref.rotate_interleaved if config.interleaved else ref.rotate_half
    want = exact(unit.astype(np.float64), far[None, :, None], ref.inv_freq(config.rotary_dim, config.base))
    got = np.asarray(rotate(unit, far[None, :]), np.float64)
    return Check(name, float(np.linalg.norm(got - want, axis=-1).max()), 1e-6)
