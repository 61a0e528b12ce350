"""The 2017 sinusoidal (absolute) position encoding, added to token embeddings.

PE(m, 2i) = sin(m / base^(2i/dim)), PE(m, 2i+1) = cos(m / base^(2i/dim)) (Vaswani et al., 2017). How it
relates to RoPE is in docs/math.md.
"""

from __future__ import annotations

import numbers

import torch
from torch import nn

from ropekit.positions import resolve_positions
from ropekit.validation import check_base, check_even, check_int, describe, is_compiling

__all__ = ["SinusoidalPositionalEmbedding", "sinusoidal_embedding"]


def sinusoidal_embedding(
    positions: int | torch.Tensor, dim: int, base: float = 10000.0, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Sinusoidal encodings, computed in float64 and cast to dtype.

    Args:
        positions: an int n (meaning arange(n)) or a 1-D tensor of n positions.
        dim: encoding width, a positive even integer.
        base: wavelength base (10000 in the paper), finite and > 1.
        dtype: output dtype.

    Returns:
        Shape (n, dim): column 2i holds sin(m / base^(2i/dim)), column 2i+1 holds cos of the same angle.

    Raises:
        ValueError: dim not a positive even integer, base not finite and > 1, positions negative or not 1-D.
    """
    dim = check_even("dim", dim)
    base = check_base(base)
    if isinstance(positions, bool) or not isinstance(positions, (numbers.Integral, torch.Tensor)):
        raise ValueError(f"positions: expected an int or a 1-D tensor, got {describe(positions)}")
    if not isinstance(positions, torch.Tensor):
        positions = torch.arange(check_int("positions", positions, minimum=0, expected="an int n >= 0"))
    if positions.dim() != 1:
        raise ValueError(f"positions: expected a 1-D tensor, got shape {tuple(positions.shape)}")
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # (dim/2,)
    angles = positions.to(torch.float64)[:, None] * inv_freq.to(positions.device)  # (n, dim/2)
    pe = torch.stack((torch.sin(angles), torch.cos(angles)), dim=-1)  # (n, dim/2, 2): sin at 2i, cos at 2i+1
    return pe.flatten(-2).to(dtype)  # (n, dim)


class SinusoidalPositionalEmbedding(nn.Module):
    """Adds sinusoidal encodings to token embeddings (Vaswani et al., 2017).

    Args:
        dim: embedding width, a positive even integer.
        base: wavelength base, finite and > 1.
        max_len: rows built up front; the table grows when a later position arrives.

    The table is a non-persistent buffer (never in a state_dict) that follows the input's device, and is
    float64 for float64 inputs (float32 otherwise).

    Example:
        >>> pe = SinusoidalPositionalEmbedding(512)
        >>> h = pe(torch.randn(2, 16, 512))  # h[:, m] = x[:, m] + PE(m)
    """

    def __init__(self, dim: int, base: float = 10000.0, max_len: int = 2048) -> None:
        super().__init__()
        max_len = check_int("max_len", max_len, minimum=1, expected="a positive integer")
        self.register_buffer(
            "pe", sinusoidal_embedding(max_len, dim, base), persistent=False
        )  # (max_len, dim)
        self.dim, self.base = self.pe.shape[1], float(base)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base:g}, table_len={self.pe.shape[0]}"

    def forward(self, x: torch.Tensor, offsets: int | torch.Tensor = 0) -> torch.Tensor:
        """Return x + PE(offsets + arange(seq)).

        Args:
            x: (batch, seq, dim) token embeddings, any float dtype.
            offsets: a non-negative int, or a (batch,) integer tensor (one start position per row, as in
                KV-cache decoding or left padding).

        Returns:
            Shape (batch, seq, dim), x's dtype. x is not modified.

        Raises:
            ValueError: x not a floating (batch, seq, dim) tensor, or offsets negative / of the wrong shape.
        """
        if (
            not isinstance(x, torch.Tensor)
            or not x.is_floating_point()
            or x.dim() != 3
            or x.shape[-1] != self.dim
        ):
            raise ValueError(
                f"x: expected a float tensor of shape (batch, seq, {self.dim}), got {describe(x)}"
            )
        # The one position resolver (RoPE's) reads x.shape[:-2] as (batch, seq): a trailing unit axis makes
        # this (batch, seq, dim) input look like it. It checks the offsets and applies them.
        positions = resolve_positions(
            x[..., None], positions=None, offsets=offsets, cu_seqlens=None, table_len=None
        )  # (batch, seq), int64
        if positions.numel() and not is_compiling():
            self._ensure_table(int(positions.max()) + 1, x)
        return x + self.pe[positions].to(x.dtype)  # (batch, seq, dim)

    def _ensure_table(self, needed: int, like: torch.Tensor) -> None:
        """Grow the table to at least `needed` rows and move it to like's device / precision."""
        dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
        length = self.pe.shape[0]
        if length >= needed and self.pe.device == like.device and self.pe.dtype == dtype:
            return
        if needed > length:
            length = 1 << (needed - 1).bit_length()  # grow geometrically: amortised O(1) regrowth
        self.pe = sinusoidal_embedding(length, self.dim, self.base, dtype=dtype).to(like.device)
