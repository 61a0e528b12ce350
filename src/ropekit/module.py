"""RotaryEmbedding: the nn.Module that owns a cos/sin table and rotates q and k.

Shape notation: B batch, S sequence, T packed tokens, H heads, D head_dim.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch
from torch import nn

from ropekit.backends import BACKENDS
from ropekit.config import COS_SIN_CHUNK_ELEMENTS, RopeConfig
from ropekit.functional import apply_resolved, apply_rotary, apply_rotary_qk
from ropekit.positions import _is_integer_tensor, resolve
from ropekit.validation import check_bool, check_int, describe, is_compiling

__all__ = ["RotaryEmbedding"]

LAYOUTS = ("bshd", "bhsd", "sbhd", "thd")
LAYOUT_SHAPES = {
    "bshd": "(batch, seq, heads, head_dim)",
    "bhsd": "(batch, heads, seq, head_dim)",
    "sbhd": "(seq, batch, heads, head_dim)",
    "thd": "(total_tokens, heads, head_dim)",
}
# The axes swapped to view an input of each layout as (batch, seq, heads, head_dim); a swap is a view.
_TO_BSHD = {"bhsd": (1, 2), "sbhd": (0, 1)}
# Rows built at construction (fewer if max_position_embeddings is smaller); the table grows as positions
# arrive. Also the rows a table covers when the config names no context length and the largest position
# of a call is unknown on the host (tensor positions on a GPU, see the class docstring).
DEFAULT_TABLE_LEN = 2048
# The table never grows past this many rows (or max_position_embeddings, if larger): a call reaching further
# computes cos/sin for its own tokens only, so one far-away position id cannot allocate a gigantic table.
MAX_TABLE_ROWS = 1 << 20


class RotaryEmbedding(nn.Module):
    """Rotary position embedding for q and k.

    Args:
        config: a :class:`RopeConfig`; or None, and pass its arguments as keywords (``head_dim=64``).
        layout: "bshd" (B, S, H, D) (default, flash-attn's); "bhsd" (B, H, S, D) (Hugging Face's);
            "sbhd" (S, B, H, D) (Megatron's, sequence first); "thd" (T, H, D) packed, with cu_seqlens.
            Every layout is read through a view: nothing is copied to reorder it.
        backend: forwarded to :func:`ropekit.apply_rotary_qk`.

    The cos/sin table is a non-persistent buffer (it is never saved in a state_dict) that follows the inputs'
    device; float64 inputs get a float64 table (float32 otherwise: math runs in float32).

    Table policy (docs/benchmarks.md, "Tables"):

    - **Lazy.** Construction builds min(max_position_embeddings, 2048) rows, not max_position_embeddings
      rows; the table grows when a call reaches past its end, to the next power of two (capped at
      max_position_embeddings when the call fits under it). Growing computes only the new rows, a chunk at a
      time, into the larger table, so the peak is the old and the new table side by side: 1.5x the finished
      table when it doubles, under 2x for a last step that stops at max_position_embeddings.
    - **Where the largest position comes from.** It is read on the host when that costs no device sync:
      from an int ``offsets`` and the shapes (any device), or from CPU tensors. For tensor positions or
      offsets on a GPU, reading it would stall the stream, so the table instead covers
      max_position_embeddings rows (2048 when the config names none), grown once, and positions are
      checked against it by :func:`ropekit.apply_rotary_qk` (on the device, for CUDA tensors): a position
      past it is an error, never a wrong row. Set max_position_embeddings to the longest context you serve.
      Length-dependent schedules (below) need the exact largest position and read it each call (a sync on
      a GPU) unless :meth:`freeze` fixes their length.
    - **Far positions.** The table stops growing at max(max_position_embeddings, 2^20) rows; a call
      reaching past that computes cos/sin rows for its own tokens (float64 angles, as always): a far-away
      position id costs per-token work, not a huge table.
    - **torch.compile.** A call that needs more rows than the table holds, known while tracing (an int
      ``offsets`` and the shapes), grows the table eagerly outside the graph (a graph break, then a
      recompile for the larger table); tensor positions are checked against the table's rows. A position
      past the table is never read as garbage.

    Length-dependent schedules (dynamic NTK, LongRoPE) pick their frequencies per call from
    seq_len = (largest position in the call) + 1, exactly as Hugging Face's ``dynamic_rope_update`` does:
    LongRoPE uses its long factors once seq_len exceeds original_max_position_embeddings; dynamic NTK keeps
    the frequencies of the longest sequence seen and returns to the original ones when a sequence shorter than
    max_position_embeddings arrives. During generation with a KV cache that means keys cached under one base
    meet queries rotated under another; :meth:`freeze` fixes the frequencies for a whole generation
    (docs/scaling.md, "KV-cache hazard"). Under torch.compile they keep the frequencies the table was built
    with.

    M-RoPE configs (``mrope_section``) accept positions of shape (3, B, S) (temporal, height, width), or
    (3, T) for "thd"; each token's cos/sin row is then built for that call.

    Example:
        >>> rope = RotaryEmbedding(head_dim=64, base=10000.0)
        >>> q, k = rope(torch.randn(2, 16, 8, 64), torch.randn(2, 16, 2, 64))
        >>> k_new = rope(torch.randn(2, 1, 2, 64), offsets=16)  # one tensor: a key about to be cached
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
        cos, sin = config.cos_sin(min(self._covered_rows, DEFAULT_TABLE_LEN))
        self.register_buffer("cos", cos, persistent=False)  # (table_len, rotary_dim // 2)
        self.register_buffer("sin", sin, persistent=False)
        # Length-dependent schedules: the seq_len the table was built for, HF's "max_seq_len_cached" for
        # dynamic NTK, and the length fixed by freeze() (None = follow each call).
        self._table_seq_len: int | None = None
        self._longest: int | None = config.max_position_embeddings
        self._frozen_seq_len: int | None = None

    @property
    def _covered_rows(self) -> int:
        """Rows the table holds when a call's largest position is unknown on the host."""
        return self.config.max_position_embeddings or DEFAULT_TABLE_LEN

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
        seq_len = check_int("seq_len", seq_len)
        previous, self._frozen_seq_len = self._frozen_seq_len, seq_len
        return _FrozenFrequencies(self, previous)

    def unfreeze(self) -> None:
        """Let length-dependent frequencies follow each call's largest position again."""
        self._frozen_seq_len = None

    def _frequency_seq_len(self, needed: int | None) -> int | None:
        """The seq_len a length-dependent schedule uses for a call whose largest position is needed - 1
        (None: not known, so keep the table's)."""
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

    def extra_repr(self) -> str:
        return f"{self.config}, layout={self.layout!r}, table_len={self.cos.shape[0]}"

    def _table_ready(self, needed: int | None, like: torch.Tensor) -> bool:
        """True when the table serves a call reaching row needed - 1 (None: covered rows) on like's device and
        precision, with no rebuild for a change of frequencies (checked in _ensure_table)."""
        rows = self._covered_rows if needed is None else needed
        dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
        return self.cos.shape[0] >= rows and self.cos.device == like.device and self.cos.dtype == dtype

    def _ensure_table(self, needed: int | None, like: torch.Tensor) -> None:
        """Make the table serve a call whose largest position is needed - 1 (None: unknown, so cover
        max_position_embeddings rows) on like's device and precision; for length-dependent schedules, rebuild
        it when this call's frequencies differ from the table's."""
        dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
        seq_len = self._frequency_seq_len(needed)
        same_frequencies = seq_len == self._table_seq_len or (
            self.config.length_dependent
            and torch.equal(self.config.inv_freq(seq_len), self.config.inv_freq(self._table_seq_len))
            and self.config.attention_scaling(seq_len) == self.config.attention_scaling(self._table_seq_len)
        )
        if not same_frequencies or self.cos.dtype != dtype:
            # New frequencies or precision: every row changes (a float32 table cannot give float64 rows).
            self.cos, self.sin = self._build_rows(0, self.cos.shape[0], dtype, like.device, seq_len)
            self._table_seq_len = seq_len
        elif self.cos.device != like.device:
            self.cos, self.sin = self.cos.to(like.device), self.sin.to(like.device)  # the same values
        rows = self._covered_rows if needed is None else needed
        if self.cos.shape[0] < rows:
            length = 1 << (rows - 1).bit_length()  # grow geometrically: amortised O(1) regrowth
            covered = self.config.max_position_embeddings
            if covered is not None and rows <= covered:
                length = min(length, covered)
            self.cos, self.sin = self._grow(length, seq_len)

    def _build_rows(
        self, start: int, stop: int, dtype: torch.dtype, device: torch.device, seq_len: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows [start, stop), built a chunk at a time (peak: the result plus one chunk)."""
        half = self.config.rotary_dim // 2
        cos = torch.empty(stop - start, half, dtype=dtype, device=device)  # (rows, rotary_dim // 2)
        sin = torch.empty_like(cos)
        self._fill_rows(cos, sin, start, seq_len)
        return cos, sin

    def _fill_rows(self, cos: torch.Tensor, sin: torch.Tensor, start: int, seq_len: int | None) -> None:
        """Write the rows of positions start, start + 1, ... into cos and sin, one chunk at a time."""
        chunk = max(1, COS_SIN_CHUNK_ELEMENTS // cos.shape[1])
        for first in range(0, cos.shape[0], chunk):
            last = min(first + chunk, cos.shape[0])
            positions = torch.arange(start + first, start + last, device=cos.device)
            cos[first:last], sin[first:last] = self.config.cos_sin(
                positions, dtype=cos.dtype, device=cos.device, seq_len=seq_len
            )

    def _grow(self, length: int, seq_len: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The table extended to `length` rows: the old rows are copied, only the new ones computed."""
        old = self.cos.shape[0]
        cos = torch.empty(length, self.cos.shape[1], dtype=self.cos.dtype, device=self.cos.device)
        sin = torch.empty_like(cos)
        cos[:old], sin[:old] = self.cos, self.sin
        self._fill_rows(cos[old:], sin[old:], old, seq_len)
        return cos, sin

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None = None,
        *,
        positions: torch.Tensor | None = None,
        offsets: int | torch.Tensor = 0,
        cu_seqlens: torch.Tensor | None = None,
        inplace: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """Rotate q and k laid out as ``self.layout``; positions / offsets / cu_seqlens as in apply_rotary.

        Args:
            q, k: tensors of the module's layout. Omit k to rotate one tensor (only the queries, or only a key
                about to be written to a cache); the call then returns that one tensor.
            inplace: write into q (and k) and return them; otherwise they are never modified.

        Returns:
            (q_rotated, k_rotated), or q_rotated alone when k is omitted.

        Raises:
            ValueError: q or k not of the layout's rank or of another head_dim than the config's, "thd"
                without cu_seqlens or positions, or any bad argument :func:`ropekit.apply_rotary_qk` rejects.
        """
        check_bool("inplace", inplace)
        rank = 3 if self.layout == "thd" else 4
        for name, t in (("q", q), ("k", k)):
            if name == "k" and t is None:
                continue  # one tensor
            if not isinstance(t, torch.Tensor) or t.dim() != rank:
                raise ValueError(
                    f"{name}: expected a {rank}-D tensor {LAYOUT_SHAPES[self.layout]} for layout "
                    f"{self.layout!r}, got {describe(t)}"
                )
            if t.shape[-1] != self.config.head_dim:
                raise ValueError(
                    f"{name}: expected head_dim {self.config.head_dim} (this RotaryEmbedding's config), got "
                    f"{t.shape[-1]} in shape {tuple(t.shape)}"
                )
        alone = self.layout == "thd" and cu_seqlens is None  # packed tokens, explicit positions: 1 sequence
        q_in, k_in = q, k
        q, k = self._to_bshd(q), self._to_bshd(k)  # (B, S, H, D) views
        if alone:
            if positions is None:
                raise ValueError("cu_seqlens: layout 'thd' needs cu_seqlens or positions, got None")
            q, k = q[None], None if k is None else k[None]  # (1, T, H, D)
            if isinstance(positions, torch.Tensor):
                mrope = self.config.mrope_section is not None and positions.dim() == 2
                positions = positions[:, None] if mrope else positions[None]  # (axes, 1, T) or (1, T)
        q, k = self._rotate(q, k, positions, offsets, cu_seqlens, inplace)
        if inplace:
            q, k = q_in, k_in  # the caller's own tensors, whatever view the layout needed
        else:
            if alone:
                q, k = q[0], None if k is None else k[0]  # (T, H, D)
            q, k = self._to_bshd(q), self._to_bshd(k)  # back to the module's layout
        return q if k_in is None else (q, k)

    def _to_bshd(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """The (B, S, H, D) view of a tensor in the module's layout, and back (a swap is its own inverse)."""
        axes = _TO_BSHD.get(self.layout)
        return t if t is None or axes is None else t.transpose(*axes)

    def _rotate_with(self, q, k, cos, sin, inplace, **kwargs):
        """apply_rotary_qk, or apply_rotary when k is None; returns (q, k or None)."""
        kwargs.update(interleaved=self.config.interleaved, backend=self.backend, inplace=inplace)
        if k is None:
            return apply_rotary(q, cos, sin, **kwargs), None
        return apply_rotary_qk(q, k, cos, sin, **kwargs)

    def _rotate(
        self, q, k, positions, offsets, cu_seqlens, inplace
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward on (B, S, H, D) or, with cu_seqlens, (T, H, D) inputs; k may be None."""
        if isinstance(positions, torch.Tensor) and self.config.mrope_section is not None:
            if positions.dim() == q.dim() - 1 and positions.shape[0] == len(self.config.mrope_section):
                return self._rotate_mrope(q, k, positions, cu_seqlens, inplace)
        # Resolved once: the largest position sizes the table, the rows go to the kernels.
        pos = resolve(q, positions=positions, offsets=offsets, cu_seqlens=cu_seqlens, name="q")
        needed = max(pos.largest + 1, 1) if pos.largest is not None else None
        if needed is None:  # not read by resolve (device tensors, compile): the host-side bound, if any
            needed = self._rows_needed(q, positions, offsets, cu_seqlens)
        far = needed is not None and needed > max(self.config.max_position_embeddings or 0, MAX_TABLE_ROWS)
        if far:
            # Far past any table worth keeping: rotate with rows computed for this call's tokens.
            far_rows = pos.as_tensor(q)
            return self._rotate_rows(q, k, far_rows, self._frequency_seq_len(needed), cu_seqlens, inplace)
        if is_compiling():
            if not self._table_ready(needed, q):
                # Resizing a buffer is not graph code: run it eagerly (a graph break), then recompile.
                torch.compiler.disable(self._ensure_table)(needed, q)
        else:
            self._ensure_table(needed, q)
        return apply_resolved(
            q,
            k,
            self.cos,
            self.sin,
            pos,
            interleaved=self.config.interleaved,
            inplace=inplace,
            backend=self.backend,
        )

    def _rotate_mrope(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        inplace: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
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
        exact = self.config.length_dependent and self._frozen_seq_len is None and positions.numel()
        seq_len = self._frequency_seq_len(int(positions.max()) + 1 if exact else None)
        return self._rotate_rows(q, k, axes, seq_len, cu_seqlens, inplace)

    def _rotate_rows(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        positions: torch.Tensor,
        seq_len: int | None,
        cu_seqlens: torch.Tensor | None,
        inplace: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rotate with one freshly computed cos/sin row per token instead of the cached table.

        positions: anything :meth:`RopeConfig.cos_sin` maps to q.shape[:-2] + (R/2,) rows: positions shaped
        like q.shape[:-2], or M-RoPE positions (axes, B, S).
        """
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        cos, sin = self.config.cos_sin(positions, dtype=dtype, device=q.device, seq_len=seq_len)  # (..., R/2)
        half = cos.shape[-1]
        cos, sin = cos.reshape(-1, half), sin.reshape(-1, half)  # (tokens, R/2): one row per token
        rows = torch.arange(cos.shape[0], device=q.device).reshape(q.shape[:-2])  # (B, S) or (T,)
        return self._rotate_with(q, k, cos, sin, inplace, positions=rows, cu_seqlens=cu_seqlens)

    def _needs_exact_length(self) -> bool:
        """A length-dependent schedule follows each call's largest position (read even from a GPU)."""
        return self.config.length_dependent and self._frozen_seq_len is None and not is_compiling()

    def _rows_needed(self, q, positions, offsets, cu_seqlens) -> int | None:
        """1 + the largest position this call touches, when the host can know it without a device sync;
        None when it cannot. Bad values give 1: apply_rotary_qk rejects them with the argument's name.

        From an int offset and the shapes on any device (with cu_seqlens, the packed length bounds every
        sequence); from tensors only on the CPU, where reading them is free, or where a length-dependent
        schedule needs the exact value (then a GPU syncs, as Hugging Face's dynamic update does).
        """
        readable = self._needs_exact_length() or (q.device.type == "cpu" and not is_compiling())
        if positions is not None:
            if not _is_integer_tensor(positions) or not positions.numel():
                return 1
            return int(positions.max()) + 1 if readable else None
        if isinstance(offsets, torch.Tensor):
            if not _is_integer_tensor(offsets) or not offsets.numel():
                return 1
            if not readable:
                return None
            offsets = int(offsets.max())
        elif isinstance(offsets, bool) or not isinstance(offsets, (numbers.Integral, torch.SymInt)):
            return 1
        if cu_seqlens is None:
            longest = q.shape[1]  # (B, S, H, D)
        elif readable and _is_integer_tensor(cu_seqlens) and cu_seqlens.dim() == 1 and cu_seqlens.numel() > 1:
            longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        else:
            longest = q.shape[0]  # (T, H, D): no packed sequence is longer than the pack
        # No int(): under torch.compile an int offset may be symbolic, and int() would pin its value.
        return offsets + max(longest, 1) if offsets >= 0 else 1


class _FrozenFrequencies:
    """Returned by :meth:`RotaryEmbedding.freeze`; as a context manager it restores the previous state."""

    def __init__(self, module: RotaryEmbedding, previous: int | None) -> None:
        self._module, self._previous = module, previous

    def __enter__(self) -> RotaryEmbedding:
        return self._module

    def __exit__(self, *exc: object) -> None:
        self._module._frozen_seq_len = self._previous
