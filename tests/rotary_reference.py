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

__all__ = [
    "PEER_ROTATIONS",
    "assert_matches_reference",
    "hf_rotation",
    "reference_rotation",
    "reference_tables",
    "tolerance",
    "vllm_rotation",
]


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


# -- the peers' own torch expressions, written as they write them (numerics="hf" / "vllm") ------------------


def _peer_rows(x, cos, sin, positions, inverse):
    """Each token's table row cast to x's dtype, as the peers cast it, with a heads axis: (..., 1, R/2)."""
    c = cos[positions].to(x.dtype).unsqueeze(-2)
    s = sin[positions].to(x.dtype).unsqueeze(-2)
    return c, (-s if inverse else s)


def hf_rotation(x, cos, sin, positions, *, interleaved, inverse=False):
    """transformers' eager ``q * cos + rotate_half(q) * sin`` in x's dtype on the first R features (full-width
    rows: ``cat(freqs, freqs)``; interleaved: ``repeat_interleave`` and Cohere's interleaved rotate_half); the
    rest pass through. cos, sin (L, R/2); positions: x.shape[:-2]. inverse: sin negated."""
    c, s = _peer_rows(x, cos, sin, positions, inverse)
    rot = 2 * cos.shape[-1]
    x_rot = x[..., :rot]
    if interleaved:
        c, s = c.repeat_interleave(2, -1), s.repeat_interleave(2, -1)
        x1, x2 = x_rot[..., ::2], x_rot[..., 1::2]
        rotated_half = torch.stack((-x2, x1), dim=-1).flatten(-2)
    else:
        c, s = torch.cat((c, c), -1), torch.cat((s, s), -1)
        x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2 :]
        rotated_half = torch.cat((-x2, x1), dim=-1)
    return torch.cat((x_rot * c + rotated_half * s, x[..., rot:]), dim=-1)


def vllm_rotation(x, cos, sin, positions, *, interleaved, inverse=False):
    """vLLM's ``apply_rotary_emb_torch`` (``forward_native``): ``x1 * cos - x2 * sin``, ``x2 * cos + x1 *
    sin`` in x's dtype on the first R features, cos / sin the cache's halves cast to x's dtype."""
    c, s = _peer_rows(x, cos, sin, positions, inverse)
    rot = 2 * cos.shape[-1]
    x_rot = x[..., :rot]
    if interleaved:
        x1, x2 = x_rot[..., ::2], x_rot[..., 1::2]
    else:
        x1, x2 = torch.chunk(x_rot, 2, dim=-1)
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    out = torch.stack((o1, o2), dim=-1).flatten(-2) if interleaved else torch.cat((o1, o2), dim=-1)
    return torch.cat((out, x[..., rot:]), dim=-1)


PEER_ROTATIONS = {"hf": hf_rotation, "vllm": vllm_rotation}
