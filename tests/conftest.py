"""Shared test settings and the comparison against the float64 reference.

Tolerances follow the dtype: a rotated feature carries one rounding of the output (half an ulp of x's dtype)
plus float32 arithmetic on table rows that are themselves rounded to float32, so the error bound is a few ulps
of the output dtype relative to the output, plus a few float32 ulps of the input's scale.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings

from ropekit import reference

# The machine is shared and slow: no per-example deadline. Tests that need more or fewer examples say so.
settings.register_profile("ropekit", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ropekit")


def tolerance(dtype: torch.dtype, scale: float = 1.0) -> dict[str, float]:
    """rtol / atol for an output of ``dtype`` computed from inputs of magnitude ``scale``."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return {
        "rtol": 2 * torch.finfo(dtype).eps,
        "atol": 16 * torch.finfo(compute).eps * max(scale, 1.0),
    }


def reference_rotation(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: np.ndarray, *, interleaved: bool
) -> torch.Tensor:
    """The float64 reference result for x (B, S, H, D) or (T, H, D), token positions of shape x.shape[:-2]."""
    out = reference.apply_tables(
        x.detach().double().numpy(), cos.double().numpy(), sin.double().numpy(), positions, interleaved
    )
    return torch.from_numpy(out)


@pytest.fixture
def assert_matches_reference():
    """Assert that ``got`` equals the float64 reference rotation of ``x`` within the tolerance of got's dtype.

    ``conjugate=True`` compares against the inverse rotation (by -theta), the rule for gradients.
    """

    def check(got, x, cos, sin, positions, *, interleaved, conjugate=False):
        assert got.dtype == x.dtype and got.shape == x.shape
        want = reference_rotation(x, cos, -sin if conjugate else sin, positions, interleaved=interleaved)
        scale = float(x.detach().abs().max()) if x.numel() else 1.0
        torch.testing.assert_close(got.detach().double(), want, **tolerance(got.dtype, scale))

    return check
