"""The 2017 sinusoidal (absolute) position encoding, added to token embeddings.

PE(m, 2i) = sin(m / base^(2i/dim)), PE(m, 2i+1) = cos(m / base^(2i/dim)) (Vaswani et al., 2017).
"""

from __future__ import annotations

import torch
from torch import nn

from ropekit.validation import check_base

__all__ = ["SinusoidalPositionalEmbedding", "sinusoidal_embedding"]


def sinusoidal_embedding(
    positions: int | torch.Tensor, dim: int, base: float = 10000.0, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Sinusoidal encodings, shape (n, dim), computed in float64 and cast to dtype.

    Args:
        positions: an int n (meaning arange(n)) or a 1-D tensor of n positions.
        dim: encoding width, a positive even integer.
        base: wavelength base (10000 in the paper), finite and > 1.
    """
    if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0 or dim % 2:
        raise ValueError(f"dim: expected a positive even integer, got {dim!r}")
    base = check_base(base)
    if isinstance(positions, bool) or not isinstance(positions, (int, torch.Tensor)):
        raise ValueError(f"positions: expected an int or a 1-D tensor, got {positions!r:.80}")
    if isinstance(positions, int):
        if positions < 0:
            raise ValueError(f"positions: expected a non-negative int n (meaning arange(n)), got {positions}")
        positions = torch.arange(positions)
    if positions.dim() != 1:
        raise ValueError(f"positions: expected a 1-D tensor, got shape {tuple(positions.shape)}")
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # (dim/2,)
    angles = positions.to(torch.float64)[:, None] * inv_freq.to(positions.device)  # (n, dim/2)
    pe = torch.stack((torch.sin(angles), torch.cos(angles)), dim=-1)  # (n, dim/2, 2): sin at 2i, cos at 2i+1
    return pe.flatten(-2).to(dtype)


class SinusoidalPositionalEmbedding(nn.Module):
    """Adds sinusoidal encodings to token embeddings of shape (batch, seq, dim).

    The table is a non-persistent buffer that grows on demand; ``offsets`` shifts the positions (KV-cache decoding).
    """

    def __init__(self, dim: int, base: float = 10000.0, max_len: int = 2048) -> None:
        super().__init__()
        self.dim, self.base = dim, base
        self.register_buffer("pe", sinusoidal_embedding(max_len, dim, base), persistent=False)  # (max_len, dim)

    def forward(self, x: torch.Tensor, offsets: int = 0) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x: expected shape (batch, seq, {self.dim}), got {tuple(x.shape)}")
        needed = offsets + x.shape[1]
        if needed > self.pe.shape[0]:
            self.pe = sinusoidal_embedding(1 << (needed - 1).bit_length(), self.dim, self.base).to(self.pe.device)
        pe = self.pe[offsets:needed].to(device=x.device, dtype=x.dtype)  # (seq, dim)
        return x + pe
