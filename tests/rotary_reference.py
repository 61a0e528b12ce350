"""The one home of the tests' reference and tolerance: what a rotated tensor must equal, and how closely.

Tolerances follow the dtype: a rotated feature carries one rounding of the output (half an ulp of x's dtype)
plus float32 arithmetic on table rows that are themselves rounded to float32, so the error bound is a few ulps
of the output dtype relative to the output, plus a few float32 ulps of the input's scale.

``tests/conftest.py`` serves these as fixtures and ``tests/rotary_cases.py`` builds the backend cases
on them; import from here (``from rotary_reference import ...``: pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import numpy as np
import torch

from ropekit import reference

__all__ = ["assert_matches_reference", "reference_rotation", "reference_tables", "tolerance"]


def tolerance(dtype: torch.dtype, scale: float = 1.0) -> dict[str, float]:
    """rtol / atol for an output of ``dtype`` computed from inputs of magnitude ``scale``."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return {
        "rtol": 2 * torch.finfo(dtype).eps,
        "atol": 16 * torch.finfo(compute).eps * max(scale, 1.0),
    }


def reference_tables(rotary_dim: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos/sin tables (length, rotary_dim // 2) from the reference frequencies, angles in float64."""
    angle = np.arange(length)[:, None] * reference.inv_freq(rotary_dim)[None, :]
    return torch.from_numpy(np.cos(angle)).float(), torch.from_numpy(np.sin(angle)).float()


def reference_rotation(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: np.ndarray,
    *,
    interleaved: bool,
    conjugate: bool = False,
) -> torch.Tensor:
    """The float64 reference rotation of x (B, S, H, D) or (T, H, D) at token positions of shape x.shape[:-2].

    ``conjugate=True`` rotates by -theta, the rule for gradients.
    """
    s = -sin if conjugate else sin
    out = reference.apply_tables(
        x.detach().double().numpy(), cos.double().numpy(), s.double().numpy(), positions, interleaved
    )
    return torch.from_numpy(out)


def assert_matches_reference(got, x, cos, sin, positions, *, interleaved, conjugate=False) -> None:
    """``got`` equals the reference rotation of ``x`` within the tolerance of got's dtype and x's scale."""
    assert got.dtype == x.dtype and got.shape == x.shape
    want = reference_rotation(x, cos, sin, positions, interleaved=interleaved, conjugate=conjugate)
    scale = float(x.detach().abs().max()) if x.numel() else 1.0
    torch.testing.assert_close(got.detach().double(), want, **tolerance(got.dtype, scale))
