"""RotaryEmbedding: the nn.Module that owns a cos/sin table and rotates q and k.

Shape notation: B batch, S sequence, T packed tokens, H heads, D head_dim.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ropekit.backends import BACKENDS
from ropekit.config import RopeConfig
from ropekit.functional import apply_resolved
from ropekit.positions import resolve
from ropekit.table_cache import CosSinCache
from ropekit.validation import check_bool, describe

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


class RotaryEmbedding(nn.Module):
    """Rotary position embedding for q and k.

    Args:
        config: a :class:`RopeConfig`; or None, and pass its arguments as keywords (``head_dim=64``).
        layout: "bshd" (B, S, H, D) (default, flash-attn's); "bhsd" (B, H, S, D) (Hugging Face's);
            "sbhd" (S, B, H, D) (Megatron's, sequence first); "thd" (T, H, D) packed, with cu_seqlens.
            Every layout is read through a view: nothing is copied to reorder it.
        backend: forwarded to :func:`ropekit.apply_rotary_qk`.

    The cos/sin table lives in ``self.cache``, a :class:`ropekit.table_cache.CosSinCache` (non-persistent
    buffers, never in a state_dict); ``rope.cos`` / ``rope.sin`` read it. It follows the inputs' device;
    float64 inputs get a float64 table (float32 otherwise: math runs in float32). It is lazy (2048 rows at
    first, grown as positions arrive), covers max_position_embeddings rows when a call's largest position is
    unknown on the host (tensor positions on a GPU: set max_position_embeddings to the longest context you
    serve), computes rows per call for far-away positions, and under torch.compile never breaks the graph:
    a call the table does not serve gets rows computed for its own tokens. A module built on ``meta`` is
    exact after ``to_empty`` (or :meth:`reset_parameters`). The full policy: :mod:`ropekit.table_cache`.

    Length-dependent schedules (dynamic NTK, LongRoPE) follow each call's largest position as HF's
    ``dynamic_rope_update`` does, so cached keys and later queries may differ in base: :meth:`freeze` fixes
    it for a generation (docs/scaling.md, "KV-cache hazard"). Compiled calls keep the table's frequencies.

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
        if backend != "auto" and backend not in BACKENDS:
            raise ValueError(f"backend: expected 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
        self.config, self.layout, self.backend = config, layout, backend
        self.cache = CosSinCache(config)
        self._swap = _TO_BSHD.get(layout)
        self._rank = 3 if layout == "thd" else 4
        self._mrope = config.mrope_section is not None  # read every call: a plain attribute

    cos = property(lambda self: self.cache.cos, doc="The cached cos table (table_len, rotary_dim // 2).")
    sin = property(lambda self: self.cache.sin, doc="The cached sin table (table_len, rotary_dim // 2).")

    def freeze(self, seq_len: int) -> Any:
        """Use the frequencies for ``seq_len`` in every call until :meth:`unfreeze`.

        Freeze a length-dependent schedule (dynamic NTK, LongRoPE) at the generation's final length (prompt +
        new tokens) and every cached key and every query use one base. Returns a context manager that restores
        the previous state on exit: both ``rope.freeze(n)`` and ``with rope.freeze(n): ...`` work. A no-op
        for other schedules.

        Raises:
            ValueError: if seq_len is not a positive integer.
        """
        return self.cache.freeze(seq_len, owner=self)

    def unfreeze(self) -> None:
        """Let length-dependent frequencies follow each call's largest position again."""
        self.cache.unfreeze()

    def reset_parameters(self) -> None:
        """Recompute the table from the config where it lies (after ``to_empty``; FSDP calls this)."""
        self.cache.reset_parameters()

    def extra_repr(self) -> str:
        return f"{self.config}, layout={self.layout!r}"  # the table's length: the child cache's line

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None = None,
        *,
        positions: torch.Tensor | None = None,
        offsets: int | torch.Tensor = 0,
        cu_seqlens: torch.Tensor | None = None,
        inplace: bool = False,
        inverse: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """Rotate q and k laid out as ``self.layout``; positions / offsets / cu_seqlens as in apply_rotary.

        Args:
            q, k: tensors of the module's layout. Omit k to rotate one tensor (only the queries, or only a key
                about to be written to a cache); the call then returns that one tensor.
            inplace: write into q (and k) and return them; otherwise they are never modified.
            inverse: rotate by the negative angles (undo a rotation), as in :func:`ropekit.apply_rotary`.

        Returns:
            (q_rotated, k_rotated), or q_rotated alone when k is omitted.

        Raises:
            ValueError: q or k not of the layout's rank or of another head_dim than the config's, "thd"
                without cu_seqlens or positions, or any bad argument :func:`ropekit.apply_rotary_qk` rejects.
        """
        for name, t in (("q", q), ("k", k)):
            if t is None and name == "k":
                continue  # one tensor
            if (
                not isinstance(t, torch.Tensor)
                or t.dim() != self._rank
                or t.shape[-1] != self.config.head_dim
            ):
                self._reject(name, t)
        swap = self._swap
        q_view = q if swap is None else q.transpose(*swap)  # (B, S, H, D) views
        k_view = k if swap is None or k is None else k.transpose(*swap)
        alone = self._rank == 3 and cu_seqlens is None  # packed tokens, explicit positions: 1 sequence
        if alone:
            if positions is None:
                raise ValueError("cu_seqlens: layout 'thd' needs cu_seqlens or positions, got None")
            q_view, k_view = q[None], None if k is None else k[None]  # (1, T, H, D)
            if isinstance(positions, torch.Tensor):
                mrope = self._mrope and positions.dim() == 2
                positions = positions[:, None] if mrope else positions[None]  # (axes, 1, T) or (1, T)
        if self._mrope and self._is_mrope(positions, q_view):
            cos, sin, pos = self._mrope_rows(q_view, positions, cu_seqlens)
        else:
            pos = resolve(q_view, positions=positions, offsets=offsets, cu_seqlens=cu_seqlens, name="q")
            cos, sin, pos = self.cache.lookup(pos, q_view)
        flags = {} if inverse is False and self.config.rotary_position == "first" else self._flags(inverse)
        out_q, out_k = apply_resolved(
            q_view, k_view, cos, sin, pos, interleaved=self.config.interleaved, inplace=inplace,
            backend=self.backend, **flags,
        )  # fmt: skip
        if inplace:
            return q if k is None else (q, k)  # the caller's own tensors, whatever view the layout needed
        if alone:
            out_q, out_k = out_q[0], None if k is None else out_k[0]  # (T, H, D)
        elif swap is not None:
            out_q, out_k = out_q.transpose(*swap), None if k is None else out_k.transpose(*swap)
        return out_q if k is None else (out_q, out_k)

    def _reject(self, name: str, t: object) -> None:
        if not isinstance(t, torch.Tensor) or t.dim() != self._rank:
            raise ValueError(
                f"{name}: expected a {self._rank}-D tensor {LAYOUT_SHAPES[self.layout]} for layout "
                f"{self.layout!r}, got {describe(t)}"
            )
        raise ValueError(
            f"{name}: expected head_dim {self.config.head_dim} (this RotaryEmbedding's config), got "
            f"{t.shape[-1]} in shape {tuple(t.shape)}"
        )

    def _flags(self, inverse: object) -> dict[str, object]:
        """The keywords past the defaults, passed only when set (the steady state passes none)."""
        return {"inverse": check_bool("inverse", inverse), "rotary_position": self.config.rotary_position}

    def _is_mrope(self, positions: object, q: torch.Tensor) -> bool:
        """(axes, B, S) positions for this config's M-RoPE sections ((axes, T) with cu_seqlens)."""
        sections = self.config.mrope_section
        return (
            isinstance(positions, torch.Tensor)
            and positions.dim() == q.dim() - 1
            and positions.shape[0] == len(sections)
        )

    def _mrope_rows(self, q: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor | None):
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
        cos, sin, rows = self.cache.rows_at(axes, q)
        return cos, sin, resolve(q, positions=rows.tensor, cu_seqlens=cu_seqlens, name="q")
