"""torchtune's rotary modules (torchtune 0.6) on the core: one tensor in, one tensor out.

Migration: ``from torchtune.modules import RotaryPositionalEmbeddings`` becomes
``from ropekit.compat.torchtune import RotaryPositionalEmbeddings`` (and
``torchtune.models.llama3_1.Llama3ScaledRoPE`` becomes ``ropekit.compat.torchtune.Llama3ScaledRoPE``); the
construction and the calls stay as they are.

Shape notation: b batch, s sequence, n_h heads, h_d head_dim (torchtune's).

Same semantics as torchtune: x is (b, s, n_h, h_d) with h_d == dim; pairs (2i, 2i+1) rotate together (Meta's
LLaMA pairing, which torchtune reproduces with ``x.reshape(..., -1, 2)``); ``input_pos`` is None (positions
0 .. s-1), (s,) (one position per token, shared by the batch: decoding) or (b, s) (packed samples); the output
has x's dtype and x is not modified. frequencies are base^(-2i/dim) (times the Llama 3.1 schedule for
:class:`Llama3ScaledRoPE`), computed in float32 exactly as torchtune does. Differences:

- Angles are formed in float64 before the cast (torchtune multiplies in float32), so at position p the
  tables differ from torchtune's by up to about p * 6e-8 radians: ropekit's are the exact ones.
- A position past max_seq_len grows the table (torchtune's docstring promises that; its code raises).
- Wrong shapes and positions are ValueErrors naming the argument.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ropekit.compat._common import peer_names
from ropekit.config import RopeConfig
from ropekit.module import RotaryEmbedding
from ropekit.validation import check_int, describe

__all__ = ["Llama3ScaledRoPE", "RotaryPositionalEmbeddings"]


class RotaryPositionalEmbeddings(nn.Module):
    """Mirrors ``torchtune.modules.RotaryPositionalEmbeddings(dim, max_seq_len=4096, base=10_000)``.

    Args:
        dim: head_dim of the inputs.
        max_seq_len: table rows built up front (it grows past that on demand).
        base: RoPE base.

    Raises:
        ValueError: dim not a positive even int, max_seq_len not a positive int, base not a number > 1.
    """

    def __init__(self, dim: int, max_seq_len: int = 4096, base: int = 10_000) -> None:
        super().__init__()
        self._setup(dim, max_seq_len, base, scaling=None)

    def _setup(self, dim: int, max_seq_len: int, base: float, scaling: dict[str, Any] | None) -> None:
        max_seq_len = check_int("max_seq_len", max_seq_len, minimum=1, expected="a positive int")
        self.dim, self.max_seq_len, self.base = dim, max_seq_len, base
        config = RopeConfig(
            dim,
            base,
            interleaved=True,
            scaling=scaling,
            max_position_embeddings=max_seq_len,
            hf_float32_inv_freq=True,  # torchtune's float32 frequencies, bit for bit
        )
        self.rope = RotaryEmbedding(config, layout="bshd")

    @property
    def cache(self) -> torch.Tensor:
        """torchtune's cache: (max_seq_len, dim // 2, 2) holding [cos, sin] of each position and pair."""
        cos, sin = self.rope.config.cos_sin(self.max_seq_len)
        return torch.stack([cos, sin], dim=-1)

    def forward(self, x: torch.Tensor, *, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate x (b, s, n_h, h_d) at positions input_pos (None, (s,) or (b, s)); x is not modified.

        Raises:
            ValueError: x not (b, s, n_h, dim), input_pos not an integer tensor of shape (s,) or (b, s),
                or negative positions.
        """
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[-1] != self.dim:
            raise ValueError(f"x: expected shape (batch, seq, heads, dim = {self.dim}), got {describe(x)}")
        positions = input_pos
        if isinstance(input_pos, torch.Tensor) and input_pos.dim() == 1 and input_pos.shape[0] == x.shape[1]:
            positions = input_pos.expand(x.shape[0], -1)  # one position per token, shared by the batch
        with peer_names({"positions": "input_pos"}):
            return self.rope(x, positions=positions)


class Llama3ScaledRoPE(RotaryPositionalEmbeddings):
    """Mirrors ``torchtune.models.llama3_1.Llama3ScaledRoPE`` (Llama 3.1's frequency schedule).

    Frequencies come from ropekit's llama3 schedule (the same bands and smoothing as Meta's llama-models
    ``apply_scaling``): wavelengths below old_context_len / high_freq_factor keep their frequency, those above
    old_context_len / low_freq_factor are divided by scale_factor, and the band between is interpolated.

    Args:
        dim, max_seq_len, base: as :class:`RotaryPositionalEmbeddings`.
        scale_factor, low_freq_factor, high_freq_factor, old_context_len: the schedule's parameters.

    Raises:
        ValueError: as :class:`RotaryPositionalEmbeddings`, and for invalid schedule parameters.
    """

    def __init__(
        self,
        dim: int,
        max_seq_len: int = 4096,
        base: int = 10_000,
        scale_factor: float = 8,
        low_freq_factor: float = 1,
        high_freq_factor: float = 4,
        old_context_len: int = 8192,
    ) -> None:
        nn.Module.__init__(self)
        self.scale_factor, self.low_freq_factor = scale_factor, low_freq_factor
        self.high_freq_factor, self.old_context_len = high_freq_factor, old_context_len
        scaling = {
            "rope_type": "llama3",
            "factor": scale_factor,
            "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor,
            "original_max_position_embeddings": old_context_len,
        }
        self._setup(dim, max_seq_len, base, scaling)
