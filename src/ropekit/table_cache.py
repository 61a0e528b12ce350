"""CosSinCache: the cos/sin table a :class:`ropekit.RotaryEmbedding` owns, and the policy that sizes it.

Shape notation: R/2 = rotary_dim // 2 frequency pairs; L table rows.

The policy (docs/benchmarks.md, "Tables"):

- **Lazy.** Construction builds min(max_position_embeddings, 2048) rows; the table grows when a call reaches
  past its end, to the next power of two (capped at max_position_embeddings when the call fits under it).
  Growing computes only the new rows, a chunk at a time, into the larger table: the peak is the old and the
  new table side by side.
- **The bound comes from** :func:`ropekit.positions.resolve` (``Positions.largest``: host-known without a
  sync). When it is unknown (tensor positions on a GPU, or under torch.compile), the table covers
  max_position_embeddings rows (2048 when the config names none) and the kernels check each row.
  Length-dependent schedules read the exact largest position (a sync on a GPU, as Hugging Face's
  ``dynamic_rope_update`` does) unless :meth:`CosSinCache.freeze` fixes their length.
- **Length-dependent schedules** take seq_len = (largest position in the call) + 1: LongRoPE uses its long
  factors once seq_len exceeds original_max_position_embeddings; dynamic NTK keeps the frequencies of the
  longest sequence seen and returns to the original ones when a sequence shorter than
  max_position_embeddings arrives (Hugging Face's ``dynamic_rope_update``). A change of frequencies
  rebuilds every row.
- **Far positions.** The table stops growing at max(max_position_embeddings, 2^20) rows; a call reaching
  past that gets cos/sin rows computed for its own tokens.
- **torch.compile.** Resizing a buffer is not graph code, so a compiled call that the table does not serve
  (past its rows, or another device or precision) gets rows computed for its own tokens inside the graph:
  no graph break, so ``fullgraph=True`` holds. The table grows at the next eager call.
- **Meta and to_empty.** Any ``_apply`` that replaces the buffers (``to_empty``, ``.to(dtype)``) recomputes
  them from the config on their new device, so a module built under ``torch.device("meta")`` is exact after
  ``to_empty``; :meth:`CosSinCache.reset_parameters` does the same on request.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ropekit.config import COS_SIN_CHUNK_ELEMENTS, RopeConfig
from ropekit.positions import Positions, resolve
from ropekit.validation import check_int, is_compiling

__all__ = ["DEFAULT_TABLE_LEN", "MAX_TABLE_ROWS", "CosSinCache"]

# Rows built at construction (fewer if max_position_embeddings is smaller); also the rows covered when the
# config names no context length and a call's largest position is unknown on the host.
DEFAULT_TABLE_LEN = 2048
# The table never grows past this many rows (or max_position_embeddings, if larger): one far-away position
# id cannot allocate a gigantic table.
MAX_TABLE_ROWS = 1 << 20


def _table_dtype(x: torch.Tensor) -> torch.dtype:
    """Float64 inputs get a float64 table; every other dtype's math runs in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class CosSinCache(nn.Module):
    """A cos/sin table for one :class:`RopeConfig`, sized to the calls it serves (module docstring).

    Buffers ``cos`` and ``sin`` (L, R/2) are non-persistent: never saved in a state_dict.
    """

    def __init__(self, config: RopeConfig) -> None:
        super().__init__()
        self.config = config
        # Rows the table holds when a call's largest position is unknown on the host.
        self._covered = config.max_position_embeddings or DEFAULT_TABLE_LEN
        cos, sin = config.cos_sin(min(self._covered, DEFAULT_TABLE_LEN))
        self.register_buffer("cos", cos, persistent=False)  # (L, R/2)
        self.register_buffer("sin", sin, persistent=False)
        # Length-dependent schedules: the seq_len the table was built for, HF's "max_seq_len_cached" for
        # dynamic NTK, and the length fixed by freeze() (None = follow each call).
        self._table_seq_len: int | None = None
        self._longest: int | None = config.max_position_embeddings
        self._frozen_seq_len: int | None = None
        self._length_dependent = config.length_dependent  # read every call: a plain attribute, not a property

    def extra_repr(self) -> str:
        return f"table_len={self.cos.shape[0]}"

    # -- frequencies of length-dependent schedules ------------------------------------------------------
    def freeze(self, seq_len: int, *, owner: object = None) -> _FrozenFrequencies:
        """Use the frequencies for seq_len until :meth:`unfreeze` (see RotaryEmbedding.freeze); the
        returned context manager restores the previous state and enters as owner (default: this cache)."""
        seq_len = check_int("seq_len", seq_len)
        previous, self._frozen_seq_len = self._frozen_seq_len, seq_len
        return _FrozenFrequencies(self, previous, self if owner is None else owner)

    def unfreeze(self) -> None:
        self._frozen_seq_len = None

    def _frequency_seq_len(self, needed: int | None) -> int | None:
        """The seq_len a length-dependent schedule uses for a call whose largest position is needed - 1
        (None: not known, so keep the table's). Eager only: it updates HF's longest-seen length."""
        if not self.config.length_dependent:
            return None
        if self._frozen_seq_len is not None:
            return self._frozen_seq_len
        if needed is None:
            return self._table_seq_len
        if not self.config.schedule.keeps_longest or self._longest is None:
            return needed
        # HF's dynamic NTK: grow past the longest sequence seen; reset once a short sequence arrives.
        original = self.config.max_position_embeddings
        if needed > self._longest:
            self._longest = needed
        if needed < original < self._longest:
            self._longest = original
        return self._longest

    # -- serving a call ---------------------------------------------------------------------------------
    def lookup(self, pos: Positions, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Positions]:
        """The tables and rows serving a call resolved as pos on x (B, S, H, D) or (T, H, D).

        Returns the cached table and pos itself, or (far positions, compiled calls the table does not
        serve) rows computed for the call's own tokens and the positions that index them.
        """
        largest, cos = pos.largest, self.cos
        if (  # the steady state: a table of the right device and precision that holds the rows
            cos.device == x.device
            and cos.dtype == (torch.float64 if x.dtype == torch.float64 else torch.float32)
            and not self._length_dependent
            and (
                largest < cos.shape[0]
                if largest is not None  # a host-known bound
                else pos.tensor is not None and cos.shape[0] >= self._covered  # rows the kernels check
            )
        ):
            return cos, self.sin, pos
        return self._serve(pos, x)

    def _serve(self, pos: Positions, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Positions]:
        """:meth:`lookup` past the steady state: find the rows the call needs, then keep the table (eager)
        or compute the call's own rows (compiled, or far positions)."""
        compiling = is_compiling()
        if pos.largest is not None:
            needed = max(pos.largest + 1, 1)
        elif pos.tensor is None:  # an int offset under compile: offset + seq, maybe symbolic
            needed = pos.offset + max(x.shape[1], 1)
        elif self._length_dependent and self._frozen_seq_len is None and not compiling and not x.is_meta:
            # The exact length picks the frequencies: read it (a device sync, as HF's dynamic update).
            needed = int(pos.tensor.max()) + 1 if pos.tensor.numel() else 1
        else:
            needed = None  # cover max_position_embeddings rows; the kernels check each row
        if compiling:
            seq_len = self._frozen_seq_len if self._frozen_seq_len is not None else self._table_seq_len
            if not self._serves(needed, x):  # resizing a buffer is not graph code: rows for this call
                return self.token_rows(pos, x, seq_len)
            return self.cos, self.sin, pos
        seq_len = self._frequency_seq_len(needed)
        if needed is not None and needed > max(self.config.max_position_embeddings or 0, MAX_TABLE_ROWS):
            return self.token_rows(pos, x, seq_len)  # far past any table worth keeping
        self._ensure(needed, x, seq_len)
        return self.cos, self.sin, pos

    def _serves(self, needed: int | None, x: torch.Tensor) -> bool:
        """Whether the table holds needed rows (None: the covered rows) on x's device and precision."""
        rows = self._covered if needed is None else needed
        return self.cos.shape[0] >= rows and self.cos.device == x.device and self.cos.dtype == _table_dtype(x)

    def is_mrope(self, positions: object, x: torch.Tensor) -> bool:
        """(axes, B, S) positions for this config's M-RoPE sections ((axes, T) for packed x)."""
        shape = positions.shape if isinstance(positions, torch.Tensor) else ()
        return len(shape) == x.dim() - 1 and shape[0] == len(self.config.mrope_section)

    def mrope_rows(
        self, positions: torch.Tensor, x: torch.Tensor, cu_seqlens: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, Positions]:
        """M-RoPE: per-token cos/sin rows for (axes, B, S) or (axes, T) positions on x (B, S, H, D) or
        (T, H, D), with the frequencies of the largest position for length-dependent schedules (read on the
        host, as HF does), and the resolved positions that index them."""
        if positions.is_floating_point() or positions.dtype == torch.bool:
            raise ValueError(f"positions: expected an integer tensor, got dtype {positions.dtype}")
        lead = tuple(x.shape[:-2])  # (B, S) or (T,)
        if tuple(positions.shape[1:]) != lead:
            raise ValueError(
                f"positions: expected M-RoPE positions of shape (axes, *q.shape[:-2]) = "
                f"{(positions.shape[0], *lead)}, got {tuple(positions.shape)}"
            )
        axes = positions if x.dim() == 4 else positions[:, None, :]  # (axes, B, S)
        exact = self.config.length_dependent and self._frozen_seq_len is None and axes.numel()
        seq_len = self._frequency_seq_len(int(axes.max()) + 1 if exact else None)
        cos, sin, rows = self.token_rows(axes, x, seq_len)
        return cos, sin, resolve(x, positions=rows.tensor, cu_seqlens=cu_seqlens, name="q")

    def token_rows(
        self, pos: Positions | torch.Tensor, x: torch.Tensor, seq_len: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, Positions]:
        """cos/sin computed for the call's own tokens, with the positions that index them.

        pos: resolved positions, or a tensor :meth:`RopeConfig.cos_sin` maps to rows (M-RoPE (axes, ...)).
        """
        lead = tuple(x.shape[:-2])  # (B, S) or (T,)
        if isinstance(pos, Positions) and pos.tensor is None:  # offset + arange(S), the same for every row
            angles_at, lead = torch.arange(pos.offset, pos.offset + x.shape[1], device=x.device), None
        else:
            angles_at = pos.tensor if isinstance(pos, Positions) else pos
        cos, sin = self.config.cos_sin(angles_at, dtype=_table_dtype(x), device=x.device, seq_len=seq_len)
        half = cos.shape[-1]
        cos, sin = cos.reshape(-1, half), sin.reshape(-1, half)  # (tokens, R/2): one row per token
        largest = None if is_compiling() else cos.shape[0] - 1
        if lead is None:
            return cos, sin, Positions(None, 0, largest)
        rows = torch.arange(cos.shape[0], device=x.device).reshape(lead)  # (B, S) or (T,)
        return cos, sin, Positions(rows, 0, largest)

    # -- keeping the table --------------------------------------------------------------------------------
    def _ensure(self, needed: int | None, x: torch.Tensor, seq_len: int | None) -> None:
        """Make the table serve a call whose largest position is needed - 1 (None: cover
        max_position_embeddings rows) on x's device and precision, with seq_len's frequencies."""
        dtype = _table_dtype(x)
        same_frequencies = seq_len == self._table_seq_len or (
            self.config.length_dependent
            and torch.equal(self.config.inv_freq(seq_len), self.config.inv_freq(self._table_seq_len))
            and self.config.attention_scaling(seq_len) == self.config.attention_scaling(self._table_seq_len)
        )
        # A table on meta never had values (a module built under torch.device("meta")): build it.
        if not same_frequencies or self.cos.dtype != dtype or (self.cos.is_meta and not x.is_meta):
            self.cos, self.sin = self._rows(self.cos.shape[0], dtype, x.device, seq_len)
            self._table_seq_len = seq_len
        elif self.cos.device != x.device:
            self.cos, self.sin = self.cos.to(x.device), self.sin.to(x.device)  # the same values
        rows = self._covered if needed is None else needed
        if self.cos.shape[0] < rows:
            length = 1 << (rows - 1).bit_length()  # grow geometrically: amortised O(1) regrowth
            covered = self.config.max_position_embeddings
            if covered is not None and rows <= covered:
                length = min(length, covered)
            self._grow(length, seq_len)

    def _rows(
        self, length: int, dtype: torch.dtype, device: torch.device, seq_len: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [0, length), built a chunk at a time (peak: the result plus one chunk)."""
        cos = torch.empty(length, self.config.rotary_dim // 2, dtype=dtype, device=device)  # (L, R/2)
        sin = torch.empty_like(cos)
        self._fill(cos, sin, 0, seq_len)
        return cos, sin

    def _fill(self, cos: torch.Tensor, sin: torch.Tensor, start: int, seq_len: int | None) -> None:
        """Write the rows of positions start, start + 1, ... into cos and sin, one chunk at a time."""
        chunk = max(1, COS_SIN_CHUNK_ELEMENTS // cos.shape[1])
        for first in range(0, cos.shape[0], chunk):
            last = min(first + chunk, cos.shape[0])
            positions = torch.arange(start + first, start + last, device=cos.device)
            cos[first:last], sin[first:last] = self.config.cos_sin(
                positions, dtype=cos.dtype, device=cos.device, seq_len=seq_len
            )

    def _grow(self, length: int, seq_len: int | None) -> None:
        """Extend the table to length rows: the old rows are copied, only the new ones computed."""
        old = self.cos.shape[0]
        cos = torch.empty(length, self.cos.shape[1], dtype=self.cos.dtype, device=self.cos.device)
        sin = torch.empty_like(cos)
        cos[:old], sin[:old] = self.cos, self.sin
        self._fill(cos[old:], sin[old:], old, seq_len)
        self.cos, self.sin = cos, sin

    def reset_parameters(self) -> None:
        """Recompute every row from the config, in the table's dtype: where the table lies, or, for a table
        on meta (never any values), on the default device, as torchtune's ``rope_init`` does."""
        if self.cos.is_meta:
            device = torch.empty(0).device  # the default device: meta again inside torch.device("meta")
            self.cos, self.sin = self._rows(self.cos.shape[0], self.cos.dtype, device, self._table_seq_len)
        else:
            self._fill(self.cos, self.sin, 0, self._table_seq_len)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> CosSinCache:
        before = self.cos
        super()._apply(fn, recurse)
        if self.cos is not before and not self.cos.is_meta:  # new buffers (to_empty, .to(dtype)): rebuild
            with torch.no_grad():
                self.reset_parameters()
        return self


class _FrozenFrequencies:
    """Returned by :meth:`CosSinCache.freeze`; as a context manager it restores the previous state."""

    def __init__(self, cache: CosSinCache, previous: int | None, owner: object) -> None:
        self._cache, self._previous, self._owner = cache, previous, owner

    def __enter__(self) -> object:
        return self._owner

    def __exit__(self, *exc: object) -> None:
        self._cache._frozen_seq_len = self._previous
