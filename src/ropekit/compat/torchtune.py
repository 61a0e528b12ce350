"""torchtune's rotary modules (torchtune 0.6) on the core: one tensor in, one tensor out.

Migration: ``from torchtune.modules import RotaryPositionalEmbeddings`` (or
``VisionRotaryPositionalEmbeddings``; ``torchtune.models.llama3_1.Llama3ScaledRoPE``;
``torchtune.models.phi3.Phi3RotaryPositionalEmbeddings``) becomes
``from ropekit.compat.torchtune import ...``; the construction and the calls stay as they are. Each module
also takes ropekit's ``backend=`` (keyword only).

Shape notation: b batch, s sequence, n_h heads, h_d head_dim (torchtune's).

Same semantics as torchtune: x is (b, s, n_h, h_d); the output has x's dtype and x is not modified;
frequencies are base^(-2i/dim) (times the Llama 3.1 schedule for :class:`Llama3ScaledRoPE`), computed in
float32 exactly as torchtune does. ``input_pos`` is None (positions 0 .. s-1), (s,) or (1, s) (one position
per token, shared by the batch: decoding) or (b, s) (packed samples). Pairing: (2i, 2i+1) (Meta's LLaMA
pairing, which torchtune reproduces with ``x.reshape(..., -1, 2)``) for every module but
:class:`Phi3RotaryPositionalEmbeddings`, which pairs (i, i + h_d/2) (``rotate_half``, as HF's Phi-3).

``rope_init()`` (and ``reset_parameters()``, the name ``nn.Module.to_empty`` users reach for) rebuilds the
tables, as torchtune's does: after building under ``torch.device("meta")``, call it (after ``to_empty`` if you
used it) and the module computes again, on the device its buffers were moved to (the default device if they
are still on meta).

Differences:

- Angles are formed in float64 before the cast (torchtune multiplies in float32), so at position p the
  tables differ from torchtune's by up to about p * 6e-8 radians: ropekit's are the exact ones.
- Math runs in float32 for every module (torchtune's Phi-3 module multiplies in x's dtype).
- A position past max_seq_len grows the table (torchtune's docstring promises that; its code raises).
- Wrong shapes and positions are ValueErrors naming the argument.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ropekit.compat._common import check_backend_name, peer_names
from ropekit.config import RopeConfig
from ropekit.functional import apply_rotary
from ropekit.module import RotaryEmbedding
from ropekit.multiaxis import axial_cos_sin
from ropekit.validation import check_int, describe

__all__ = [
    "Llama3ScaledRoPE",
    "Phi3RotaryPositionalEmbeddings",
    "RotaryPositionalEmbeddings",
    "VisionRotaryPositionalEmbeddings",
]


def _live_device(module: nn.Module) -> torch.device | None:
    """The device of the module's buffers, or None if it has none yet or they are on meta."""
    for buffer in module.buffers():
        return None if buffer.is_meta else buffer.device
    return None


class _TorchtuneRoPE(nn.Module):
    """What torchtune's modules share: ``rope_init`` / ``reset_parameters`` rebuild the tables."""

    def rope_init(self) -> None:
        """Build (or rebuild) the tables: torchtune's step after constructing on meta (and ``to_empty``)."""
        device = _live_device(self)
        self._build()
        if device is not None:
            self.to(device)

    def reset_parameters(self) -> None:
        """Same as :meth:`rope_init`."""
        self.rope_init()

    def _build(self) -> None:
        raise NotImplementedError


class RotaryPositionalEmbeddings(_TorchtuneRoPE):
    """Mirrors ``torchtune.modules.RotaryPositionalEmbeddings(dim, max_seq_len=4096, base=10_000)``.

    Args:
        dim: head_dim of the inputs.
        max_seq_len: table rows built up front (it grows past that on demand).
        base: RoPE base.
        backend: ropekit's backend ("auto", "torch", "cpu" or "triton").

    Raises:
        ValueError: dim not a positive even int, max_seq_len not a positive int, base not a number > 1, an
            unknown backend.
    """

    _interleaved = True  # Meta's pairing
    _scaling: dict[str, Any] | None = None

    def __init__(
        self, dim: int, max_seq_len: int = 4096, base: int = 10_000, *, backend: str = "auto"
    ) -> None:
        super().__init__()
        self.max_seq_len = check_int("max_seq_len", max_seq_len, minimum=1, expected="a positive int")
        self.dim, self.base = dim, base
        self.backend = check_backend_name(backend)
        self.rope_init()

    def _build(self) -> None:
        config = RopeConfig(
            self.dim,
            self.base,
            interleaved=self._interleaved,
            scaling=self._scaling,
            max_position_embeddings=self.max_seq_len,
            hf_float32_inv_freq=True,  # torchtune's float32 frequencies, bit for bit
        )
        self.rope = RotaryEmbedding(config, layout="bshd", backend=self.backend)

    @property
    def cache(self) -> torch.Tensor:
        """torchtune's cache: (max_seq_len, dim // 2, 2) holding [cos, sin] of each position and pair."""
        cos, sin = self.rope.config.cos_sin(self.max_seq_len)
        return torch.stack([cos, sin], dim=-1)

    def forward(self, x: torch.Tensor, *, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate x (b, s, n_h, h_d) at positions input_pos (None, (s,), (1, s) or (b, s)); x is not modified.

        Raises:
            ValueError: x not (b, s, n_h, dim), input_pos not an integer tensor of shape (s,), (1, s) or
                (b, s), or negative positions.
        """
        return self._rotate(x, input_pos)

    def _rotate(self, x: torch.Tensor, input_pos: torch.Tensor | None) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[-1] != self.dim:
            raise ValueError(f"x: expected shape (batch, seq, heads, dim = {self.dim}), got {describe(x)}")
        positions = input_pos
        if isinstance(input_pos, torch.Tensor) and input_pos.shape[-1:] == x.shape[1:2]:
            if input_pos.dim() == 1 or (input_pos.dim() == 2 and input_pos.shape[0] == 1):
                positions = input_pos.expand(x.shape[0], -1)  # one position per token, shared by the batch
        with peer_names({"positions": "input_pos"}):
            return self.rope(x, positions=positions)


class Llama3ScaledRoPE(RotaryPositionalEmbeddings):
    """Mirrors ``torchtune.models.llama3_1.Llama3ScaledRoPE`` (Llama 3.1's frequency schedule).

    Frequencies come from ropekit's llama3 schedule (the same bands and smoothing as Meta's llama-models
    ``apply_scaling``): wavelengths below old_context_len / high_freq_factor keep their frequency, those above
    old_context_len / low_freq_factor are divided by scale_factor, and the band between is interpolated.

    Args:
        dim, max_seq_len, base, backend: as :class:`RotaryPositionalEmbeddings`.
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
        *,
        backend: str = "auto",
    ) -> None:
        self.scale_factor, self.low_freq_factor = scale_factor, low_freq_factor
        self.high_freq_factor, self.old_context_len = high_freq_factor, old_context_len
        self._scaling = {
            "rope_type": "llama3",
            "factor": scale_factor,
            "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor,
            "original_max_position_embeddings": old_context_len,
        }
        super().__init__(dim, max_seq_len, base, backend=backend)


class Phi3RotaryPositionalEmbeddings(RotaryPositionalEmbeddings):
    """Mirrors ``torchtune.models.phi3.Phi3RotaryPositionalEmbeddings(dim, max_seq_len=4096, base=10_000)``.

    Phi-3 pairs (i, i + h_d/2) (``rotate_half``), as HF's Phi-3; frequencies as
    :class:`RotaryPositionalEmbeddings`. ``input_pos`` is positional here, as in torchtune.

    Raises:
        ValueError: as :class:`RotaryPositionalEmbeddings`.
    """

    _interleaved = False

    @property
    def cache(self) -> torch.Tensor:
        """torchtune's Phi-3 cache: (max_seq_len, 2 * dim) holding [cos | cos | sin | sin] per position."""
        cos, sin = self.rope.config.cos_sin(self.max_seq_len)
        return torch.cat([cos, cos, sin, sin], dim=-1)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        """Rotate x (b, s, n_h, h_d) at positions input_pos (None, (s,), (1, s) or (b, s)); x is not modified.

        Raises:
            ValueError: as :meth:`RotaryPositionalEmbeddings.forward`.
        """
        return self._rotate(x, input_pos)


class VisionRotaryPositionalEmbeddings(_TorchtuneRoPE):
    """Mirrors ``torchtune.modules.VisionRotaryPositionalEmbeddings`` (2-D axial RoPE of image tiles,
    Heo et al. 2024, arXiv:2403.13298).

    The sequence holds max_num_tiles tiles of (tile_size // patch_size)^2 patches plus one CLS token each
    (last in its tile if append_cls_token, else first). In each tile, patch p sits at column x = p % g and row
    y = p // g (g = tile_size // patch_size). Of the h_d / 2 = dim pairs (2i, 2i+1), the first dim / 2 turn by
    (x + 1) * theta_i and the rest by (y + 1) * theta_i, theta_i = base^(-2i/dim); the CLS token is not
    rotated. The tables are ropekit's axial tables (:func:`ropekit.axial_cos_sin`) of a (g + 1) x (g + 1)
    grid, read at cell (x + 1, y + 1); cell (0, 0) is the identity the CLS token gets.

    Args:
        patch_size, tile_size, max_num_tiles: the tiling.
        dim: h_d / 2 (torchtune: ``embed_dim // num_heads // 2``); even.
        base: RoPE base.
        append_cls_token: where the CLS token sits in each tile.
        backend: ropekit's backend, keyword only.

    Raises:
        ValueError: a tiling that is not positive ints with at least one patch per tile, dim not a positive
            even int, base not a number > 1, an unknown backend.
    """

    def __init__(
        self,
        patch_size: int,
        tile_size: int,
        max_num_tiles: int,
        dim: int,
        base: int = 10_000,
        append_cls_token: bool = True,
        *,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        patch_size = check_int("patch_size", patch_size, minimum=1, expected="a positive int")
        tile_size = check_int("tile_size", tile_size, minimum=patch_size, expected="an int >= patch_size")
        self.patch_grid_size = tile_size // patch_size
        self.max_num_tiles = check_int("max_num_tiles", max_num_tiles, minimum=1, expected="a positive int")
        dim = check_int("dim", dim, minimum=2, expected="a positive even int")
        if dim % 2:
            raise ValueError(f"dim: expected a positive even int (dim / 2 pairs per axis), got {dim}")
        self.dim, self.base, self.append_cls_token = dim, base, bool(append_cls_token)
        self.backend = check_backend_name(backend)
        self.rope_init()

    def _build(self) -> None:
        g = self.patch_grid_size
        cos, sin = axial_cos_sin((g + 1, g + 1), 2 * self.dim, self.base)  # ((g + 1)^2, dim)
        patch = torch.arange(g * g, device=cos.device)
        cell = (patch % g + 1) * (g + 1) + (patch // g + 1)  # (g^2,) cells (x + 1, y + 1)
        cls = torch.zeros(1, dtype=cell.dtype, device=cell.device)  # cell (0, 0): angle 0
        cell = torch.cat([cell, cls] if self.append_cls_token else [cls, cell])  # (g^2 + 1,) one tile
        self.register_buffer("cos", cos, persistent=False)  # ((g + 1)^2, dim)
        self.register_buffer("sin", sin, persistent=False)
        self.register_buffer("tile_cells", cell, persistent=False)

    @property
    def cache(self) -> torch.Tensor:
        """torchtune's cache: (patches per tile + 1, dim, 2) holding [cos, sin] per token of a tile."""
        return torch.stack([self.cos[self.tile_cells], self.sin[self.tile_cells]], dim=-1)

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Rotate x (b, s, n_h, h_d), s = max_num_tiles * (patches per tile + 1); x is not modified.

        kwargs (torchtune passes ``input_pos``) are accepted and unused, as in torchtune.

        Raises:
            ValueError: x not 4-D with h_d = 2 * dim and s = max_num_tiles * (patches per tile + 1).
        """
        tile = self.tile_cells.shape[0]
        if (
            not isinstance(x, torch.Tensor)
            or x.dim() != 4
            or x.shape[-1] != 2 * self.dim
            or x.shape[1] != self.max_num_tiles * tile
        ):
            raise ValueError(
                f"x: expected shape (batch, max_num_tiles * (patches per tile + 1) = "
                f"{self.max_num_tiles * tile}, heads, 2 * dim = {2 * self.dim}), got {describe(x)}"
            )
        positions = self.tile_cells.repeat(self.max_num_tiles).expand(x.shape[0], -1)  # (b, s) cells
        return apply_rotary(
            x, self.cos, self.sin, positions=positions, interleaved=True, backend=self.backend
        )
