"""RotaryEmbedding: the nn.Module that owns a cos/sin table and rotates q and k.

Shape notation: B batch, S sequence, T packed tokens, H heads, D head_dim.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ropekit.backends import BACKENDS
from ropekit.config import RopeConfig
from ropekit.functional import apply_rotary_qk
from ropekit.positions import resolve_positions
from ropekit.validation import describe, is_compiling

__all__ = ["RotaryEmbedding"]

LAYOUTS = ("bshd", "bhsd", "thd")
LAYOUT_SHAPES = {
    "bshd": "(batch, seq, heads, head_dim)",
    "bhsd": "(batch, heads, seq, head_dim)",
    "thd": "(total_tokens, heads, head_dim)",
}
# Table rows built up front when the config names no context length; grows on demand after that.
DEFAULT_TABLE_LEN = 2048
# The table never grows past this many rows (or max_position_embeddings, if larger): a call reaching further
# computes cos/sin for its own tokens only, so one far-away position id cannot allocate a gigantic table.
MAX_TABLE_ROWS = 1 << 20


class RotaryEmbedding(nn.Module):
    """Rotary position embedding for q and k.

    Args:
        config: a :class:`RopeConfig`; or None, and pass its arguments as keywords (``head_dim=64``).
        layout: "bshd" (B, S, H, D) (default, flash-attn's); "bhsd" (B, H, S, D) (Hugging Face's);
            "thd" (T, H, D) packed, with cu_seqlens.
        backend: forwarded to :func:`ropekit.apply_rotary_qk`.

    The cos/sin table is a non-persistent buffer (it is never saved in a state_dict). It holds
    ``max_position_embeddings`` rows (or 2048) to start with, grows when a later position arrives, and follows
    the inputs' device, and float64 inputs get a float64 table (float32 otherwise: math runs in float32).
    Under ``torch.compile`` the table is not resized, so size it up front with max_position_embeddings.
    The table stops growing at max(max_position_embeddings, 2^20) rows; a call reaching past that computes
    cos/sin rows for its own tokens (float64 angles, as always): a far-away position id costs per-token work,
    not a huge table.

    Length-dependent schedules (dynamic NTK, LongRoPE) pick their frequencies per call from
    seq_len = (largest position in the call) + 1, exactly as Hugging Face's ``dynamic_rope_update`` does:
    LongRoPE uses its long factors once seq_len exceeds original_max_position_embeddings; dynamic NTK keeps
    the frequencies of the longest sequence seen and returns to the original ones when a sequence shorter than
    max_position_embeddings arrives. During generation with a KV cache that means keys cached under one base
    meet queries rotated under another; :meth:`freeze` fixes the frequencies for a whole generation
    (docs/scaling.md, "KV-cache hazard").

    M-RoPE configs (``mrope_section``) accept positions of shape (3, B, S) (temporal, height, width), or
    (3, T) for "thd"; each token's cos/sin row is then built for that call.

    Example:
        >>> rope = RotaryEmbedding(head_dim=64, base=10000.0)
        >>> q, k = rope(torch.randn(2, 16, 8, 64), torch.randn(2, 16, 2, 64))
    """

    def __init__(
        self,
        config: RopeConfig | None = None,
        *,
        layout: str = "bshd",
        backend: str = "auto",
        **config_kwargs: Any,
    ) -> None:
        super().__init__()
        if config is None:
            config = RopeConfig(**config_kwargs)
        elif config_kwargs:
            raise ValueError(
                f"config_kwargs: pass either a RopeConfig or its keyword arguments, not both; got config and "
                f"{sorted(config_kwargs)}"
            )
        if not isinstance(config, RopeConfig):
            raise ValueError(f"config: expected a RopeConfig or None, got {type(config).__name__}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
        self.config = config
        self.layout = layout
        if backend != "auto" and backend not in BACKENDS:
            raise ValueError(f"backend: expected 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
        self.backend = backend
        cos, sin = config.cos_sin(config.max_position_embeddings or DEFAULT_TABLE_LEN)
        self.register_buffer("cos", cos, persistent=False)  # (table_len, rotary_dim // 2)
        self.register_buffer("sin", sin, persistent=False)
        # Length-dependent schedules: the seq_len the table was built for, HF's "max_seq_len_cached" for
        # dynamic NTK, and the length fixed by freeze() (None = follow each call).
        self._table_seq_len: int | None = None
        self._longest: int | None = config.max_position_embeddings
        self._frozen_seq_len: int | None = None

    def freeze(self, seq_len: int) -> _FrozenFrequencies:
        """Use the frequencies for ``seq_len`` in every call until :meth:`unfreeze`.

        Length-dependent schedules (dynamic NTK, LongRoPE) otherwise change their frequencies with the largest
        position of each call, so keys cached early in a generation were rotated under a different base than
        later queries. Freeze at the generation's final length (prompt + new tokens) and every key and query
        uses one base. Returns a context manager that restores the previous state on exit, so both
        ``rope.freeze(n)`` and ``with rope.freeze(n): ...`` work. A no-op for other schedules.

        Raises:
            ValueError: if seq_len is not a positive integer.
        """
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
            raise ValueError(f"seq_len: expected a positive integer, got {seq_len!r}")
        previous, self._frozen_seq_len = self._frozen_seq_len, seq_len
        return _FrozenFrequencies(self, previous)

    def unfreeze(self) -> None:
        """Let length-dependent frequencies follow each call's largest position again."""
        self._frozen_seq_len = None

    def _frequency_seq_len(self, needed: int) -> int | None:
        """The seq_len a length-dependent schedule uses for a call whose largest position is needed - 1."""
        if not self.config.length_dependent:
            return None
        if self._frozen_seq_len is not None:
            return self._frozen_seq_len
        if not self.config.schedule.keeps_longest or self._longest is None:
            return needed
        # HF's dynamic NTK: grow past the longest sequence seen; reset once a short sequence arrives.
        original = self.config.max_position_embeddings
        if needed > self._longest:
            self._longest = needed
        if needed < original < self._longest:
            self._longest = original
        return self._longest

    def extra_repr(self) -> str:
        return f"{self.config}, layout={self.layout!r}, table_len={self.cos.shape[0]}"

    def _ensure_table(self, needed: int, like: torch.Tensor) -> None:
        """Grow the table to at least `needed` rows and move it to like's device / precision; for
        length-dependent schedules, rebuild it when this call's frequencies differ from the table's."""
        dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
        seq_len = self._frequency_seq_len(needed)
        same_frequencies = seq_len == self._table_seq_len or (
            self.config.length_dependent
            and torch.equal(self.config.inv_freq(seq_len), self.config.inv_freq(self._table_seq_len))
            and self.config.attention_scaling(seq_len) == self.config.attention_scaling(self._table_seq_len)
        )
        if (
            self.cos.shape[0] >= needed
            and self.cos.device == like.device
            and self.cos.dtype == dtype
            and same_frequencies
        ):
            return
        length = max(self.cos.shape[0], needed)
        if length > self.cos.shape[0]:
            length = 1 << (length - 1).bit_length()  # grow geometrically: amortised O(1) regrowth
        self.cos, self.sin = self.config.cos_sin(length, dtype=dtype, device=like.device, seq_len=seq_len)
        self._table_seq_len = seq_len

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        offsets: int | torch.Tensor = 0,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k laid out as ``self.layout``; positions / offsets / cu_seqlens as in apply_rotary.

        Raises:
            ValueError: q or k not of the layout's rank, "thd" without cu_seqlens or positions, or any bad
                argument :func:`ropekit.apply_rotary_qk` rejects.
        """
        rank = 3 if self.layout == "thd" else 4
        for name, t in (("q", q), ("k", k)):
            if not isinstance(t, torch.Tensor) or t.dim() != rank:
                raise ValueError(
                    f"{name}: expected a {rank}-D tensor {LAYOUT_SHAPES[self.layout]} for layout "
                    f"{self.layout!r}, got {describe(t)}"
                )
        if self.layout == "thd" and cu_seqlens is None:
            if positions is None:
                raise ValueError("cu_seqlens: layout 'thd' needs cu_seqlens or positions, got None")
            # Packed tokens with explicit positions only: one sequence of T tokens.
            cu_seqlens = torch.tensor([0, q.shape[0]], device=q.device)
        if self.layout == "bhsd":
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, S, H, D) views
        if isinstance(positions, torch.Tensor) and self.config.mrope_section is not None:
            if positions.dim() == q.dim() - 1 and positions.shape[0] == len(self.config.mrope_section):
                q, k = self._rotate_mrope(q, k, positions, cu_seqlens)
                if self.layout == "bhsd":
                    q, k = q.transpose(1, 2), k.transpose(1, 2)  # back to (B, H, S, D)
                return q, k
        if not is_compiling():
            needed = self._needed_rows(q, positions, offsets, cu_seqlens)
            if needed > max(self.config.max_position_embeddings or 0, MAX_TABLE_ROWS):
                # Far past any table worth keeping: rotate with rows computed for this call's tokens.
                pos = resolve_positions(
                    q, positions=positions, offsets=offsets, cu_seqlens=cu_seqlens, table_len=needed
                )
                q, k = self._rotate_rows(q, k, pos, self._frequency_seq_len(needed), cu_seqlens)
                return (q.transpose(1, 2), k.transpose(1, 2)) if self.layout == "bhsd" else (q, k)
            self._ensure_table(needed, q)
        elif self.cos.device != q.device:
            self.cos, self.sin = self.cos.to(q.device), self.sin.to(q.device)
        q, k = apply_rotary_qk(
            q,
            k,
            self.cos,
            self.sin,
            positions=positions,
            offsets=offsets,
            cu_seqlens=cu_seqlens,
            interleaved=self.config.interleaved,
            backend=self.backend,
        )
        if self.layout == "bhsd":
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # back to (B, H, S, D)
        return q, k

    def _rotate_mrope(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """M-RoPE: per-token cos/sin rows for (axes, B, S) or (axes, T) positions, applied as a table."""
        if positions.is_floating_point() or positions.dtype == torch.bool:
            raise ValueError(f"positions: expected an integer tensor, got dtype {positions.dtype}")
        lead = tuple(q.shape[:-2])  # (B, S) or (T,)
        if tuple(positions.shape[1:]) != lead:
            raise ValueError(
                f"positions: expected M-RoPE positions of shape (axes, *q.shape[:-2]) = "
                f"{(positions.shape[0], *lead)}, got {tuple(positions.shape)}"
            )
        axes = positions if q.dim() == 4 else positions[:, None, :]  # (axes, B, S)
        seq_len = self._frequency_seq_len(int(positions.max()) + 1) if positions.numel() else None
        return self._rotate_rows(q, k, axes, seq_len, cu_seqlens)

    def _rotate_rows(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        seq_len: int | None,
        cu_seqlens: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate with one freshly computed cos/sin row per token instead of the cached table.

        positions: anything :meth:`RopeConfig.cos_sin` maps to q.shape[:-2] + (R/2,) rows: positions shaped
        like q.shape[:-2], or M-RoPE positions (axes, B, S).
        """
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        cos, sin = self.config.cos_sin(positions, dtype=dtype, device=q.device, seq_len=seq_len)  # (..., R/2)
        half = cos.shape[-1]
        cos, sin = cos.reshape(-1, half), sin.reshape(-1, half)  # (tokens, R/2): one row per token
        rows = torch.arange(cos.shape[0], device=q.device).reshape(q.shape[:-2])  # (B, S) or (T,)
        return apply_rotary_qk(
            q,
            k,
            cos,
            sin,
            positions=rows,
            cu_seqlens=cu_seqlens,
            interleaved=self.config.interleaved,
            backend=self.backend,
        )

    @staticmethod
    def _needed_rows(q, positions, offsets, cu_seqlens) -> int:
        """1 + the largest position this call touches (validation of bad values happens downstream)."""
        if positions is not None:
            has_values = isinstance(positions, torch.Tensor) and positions.numel()
            return int(positions.max()) + 1 if has_values else 1
        if cu_seqlens is not None:
            if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.numel() >= 2:
                longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
            else:
                longest = 0
        else:
            longest = q.shape[1] if q.dim() == 4 else 0
        off = int(offsets.max()) if isinstance(offsets, torch.Tensor) and offsets.numel() else offsets
        return max(int(off) if isinstance(off, int) else 0, 0) + longest


class _FrozenFrequencies:
    """Returned by :meth:`RotaryEmbedding.freeze`; as a context manager it restores the previous state."""

    def __init__(self, module: RotaryEmbedding, previous: int | None) -> None:
        self._module, self._previous = module, previous

    def __enter__(self) -> RotaryEmbedding:
        return self._module

    def __exit__(self, *exc: object) -> None:
        self._module._frozen_seq_len = self._previous
