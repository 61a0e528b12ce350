"""RotaryEmbedding: the nn.Module that owns a cos/sin table and rotates q and k.

Shape notation: B batch, S sequence, T packed tokens, H heads, D head_dim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.jit import _trace as _jit_trace
from torch.nn.modules import module as _torch_module

from ropekit.backends import BACKENDS
from ropekit.backends.plan import gate
from ropekit.config import RopeConfig, config_from
from ropekit.functional import apply_resolved, apply_rotary, apply_rotary_qk
from ropekit.layer_rope import model_rope
from ropekit.positions import resolve
from ropekit.table_cache import CosSinCache
from ropekit.validation import check_bool, check_numerics, describe

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
# The module's gates (backends.plan's one template, the rotation's arguments), one per (layout, head_dim),
# made at first use: the op name keeps the plans this module's checks proved (rank, head_dim, the layout's
# reading of the caller's tensors) apart from the functional call's and from a module of another layout or
# head_dim, so no plan made for a wider head with a table of this shape ever serves this module. Keys hold
# the caller's own tensors (bhsd / sbhd: the plan's run sees them through the swap). Explicit positions have
# gates of their own ("rotary_module positions ..."): a packed call's (T,) positions and (N,) per-sequence
# offsets are both 1-D int64 tensors, so one gate would let a plan of the one serve a call of the other.
_GATES: dict[str, Callable] = {}  # the gate's op name -> the gate
_FLAGS = "interleaved:bool inplace:bool backend:str conjugate:bool numerics:str"
# What nn.Module.__call__ asks before it calls forward (RotaryEmbedding.__call__ asks the same, in one frame).
_Module = nn.Module
_MODULE_CALL = nn.Module.__call__  # nn.Module's own: torch.fx and torch.ao patch it while they trace


def _module_gate(layout: str, head_dim: int, *, rows: bool = False) -> Callable:
    """The gate of modules of this layout and head_dim (made once per process): an int offset or
    per-sequence offsets; with rows, explicit positions (a tensor: (B, S), or (T,) for "thd"). A packed
    ("thd") gate takes cu_seqlens as a tensor; the others take it as None only."""
    op = f"rotary_module{' positions' if rows else ''} {layout} {head_dim}"
    if op not in _GATES:
        packed = "cu_seqlens" if layout == "thd" else "cu_seqlens!"
        _GATES[op] = gate(op, f"q k? cos sin {'positions' if rows else 'offset#'} {packed}", _FLAGS)
    return _GATES[op]


def _module_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """nn.Module.__call__ as it is now (a tracer may have patched it)."""
    return nn.Module.__call__(self, *args, **kwargs)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding for q and k.

    Args:
        config: a :class:`RopeConfig`; or None, and pass its arguments as keywords (``head_dim=64``).
        layout: "bshd" (B, S, H, D) (default, flash-attn's); "bhsd" (B, H, S, D) (Hugging Face's);
            "sbhd" (S, B, H, D) (Megatron's, sequence first); "thd" (T, H, D) packed, with cu_seqlens.
            Every layout is read through a view: nothing is copied to reorder it.
        backend: forwarded to :func:`ropekit.apply_rotary_qk`.
        numerics: "exact" (default), "hf" or "vllm": whose bits the rotation gives, as in
            :func:`ropekit.apply_rotary` (the arithmetic given this module's own table;
            docs/numerics-modes.md).

    The cos/sin table is ``self.cache``, a :class:`ropekit.table_cache.CosSinCache` (non-persistent buffers;
    ``rope.cos`` / ``rope.sin`` read them), which follows the inputs' device and precision (float64 stays
    float64, math runs in float32 otherwise), grows as positions arrive, covers max_position_embeddings rows
    for positions unknown on the host (set it to the longest context you serve), never breaks a compiled
    graph, and is exact after ``to_empty`` of a meta-built module. Its policy: :mod:`ropekit.table_cache`.

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
        numerics: str = "exact",
        **config_kwargs: Any,
    ) -> None:
        super().__init__()
        config = config_from(config, config_kwargs)
        if layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
        if backend != "auto" and backend not in BACKENDS:
            raise ValueError(f"backend: expected 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
        self.config, self.layout, self.backend = config, layout, backend
        self.numerics = check_numerics(numerics)
        self.cache = CosSinCache(config)
        self._swap = _TO_BSHD.get(layout)
        self._rank = 3 if layout == "thd" else 4
        self._mrope = config.mrope_section is not None  # read every call: a plain attribute
        # Rows depend on positions only (no M-RoPE, no length-dependent frequencies): an int offset's steady
        # step can go straight to the functional API once the table holds its rows, and, with the rotary part
        # first, to its launch plan (every layout; "thd" with cu_seqlens).
        self._plain = not self._mrope and not config.length_dependent
        self._planned = self._plain and config.rotary_position == "first"
        # made here, eagerly: a first call may be traced (making a gate is not graph code)
        self._launch = _module_gate(layout, config.head_dim)  # not pickled: __getstate__
        self._launch_positions = _module_gate(layout, config.head_dim, rows=True)
        self._interleaved = config.interleaved

    @classmethod
    def for_model(
        cls, config: Any, *, layout: str = "bshd", backend: str = "auto", numerics: str = "exact"
    ) -> list[RotaryEmbedding | None]:
        """One module per decoder layer of a Hugging Face model, from :func:`ropekit.model_rope`.

        None for a layer that applies no RoPE; layers whose RoPE is equal share one module, so a model with
        sliding and full layers holds two tables, not one per layer.

        Args:
            config: the HF config (a ``PretrainedConfig``, a dict, a config.json path or its folder).
            layout, backend, numerics: as for the constructor.

        Raises:
            ValueError: for a config :func:`ropekit.model_rope` cannot read, or a bad layout or backend.

        Example:
            >>> ropes = RotaryEmbedding.for_model(AutoConfig.for_model("gemma4_text"))  # doctest: +SKIP
            >>> q, k = ropes[5](q, k)  # the 512-wide proportional RoPE of a full-attention layer
        """
        shared: dict[RopeConfig, RotaryEmbedding] = {}
        modules: list[RotaryEmbedding | None] = []
        for layer in model_rope(config):
            if layer.rope is None:
                modules.append(None)
                continue
            if layer.rope not in shared:
                shared[layer.rope] = cls(layer.rope, layout=layout, backend=backend, numerics=numerics)
            modules.append(shared[layer.rope])
        return modules

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # nn.Module.__call__ is two frames (_wrapped_call_impl, _call_impl) and two re-packings of the
        # arguments before forward: about 1 us of a 12 us decode step on a 2-core Zen 3. When it would only
        # call forward (not compiled by Module.compile, no module or global hook, not recording torch.jit
        # scopes: _slow_forward then only calls forward; itself not patched by a tracer: torch.fx, torch.ao),
        # forward is called here; any other call is nn.Module.__call__'s, as before. The hook dicts are read
        # every call, where _call_impl reads them.
        state, hooks = self.__dict__, _torch_module
        try:
            only_forward = (
                self._compiled_call_impl is None
                and not (
                    state["_backward_hooks"] or state["_backward_pre_hooks"] or state["_forward_hooks"]
                    or state["_forward_pre_hooks"] or hooks._global_backward_pre_hooks
                    or hooks._global_backward_hooks or hooks._global_forward_hooks
                    or hooks._global_forward_pre_hooks
                )
                and _Module.__call__ is _MODULE_CALL
                and _jit_trace._trace_module_map is None
            )  # fmt: skip
        except (KeyError, AttributeError):  # a hook dict missing (an old pickle), or a torch whose private
            only_forward = False  # names moved: nn.Module.__call__ serves the call, as before
        if only_forward:
            return self.forward(*args, **kwargs)
        return _Module.__call__(self, *args, **kwargs)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass that changes what nn.Module.__call__ calls (_call_impl, _slow_forward) gets it back."""
        super().__init_subclass__(**kwargs)
        if "__call__" not in cls.__dict__ and any(
            getattr(cls, name) is not getattr(nn.Module, name) for name in ("_call_impl", "_slow_forward")
        ):
            cls.__call__ = _module_call

    cos = property(lambda self: self.cache.cos, doc="The cached cos table (table_len, rotary_dim // 2).")
    sin = property(lambda self: self.cache.sin, doc="The cached sin table (table_len, rotary_dim // 2).")

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("_launch", None)  # functions made at run time: made again on loading
        state.pop("_launch_positions", None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("numerics", "exact")  # a module pickled before numerics existed
        self._launch = _module_gate(self.layout, self.config.head_dim)
        self._launch_positions = _module_gate(self.layout, self.config.head_dim, rows=True)

    def freeze(self, seq_len: int) -> Any:
        """Use the frequencies for ``seq_len`` in every call until :meth:`unfreeze`.

        Freeze a length-dependent schedule at the final length of a generation (prompt + new tokens): every
        cached key and query then use one base. Returns a context manager restoring the previous state (both
        ``rope.freeze(n)`` and ``with rope.freeze(n): ...`` work). A no-op for other schedules.

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
        numerics = "" if self.numerics == "exact" else f", numerics={self.numerics!r}"
        # the table's length: the child cache's line
        return f"{self.config}, layout={self.layout!r}{numerics}"

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
        gated, plan_key, table = False, None, None  # whether this call went through the gate, its answer
        launch = None  # a steady step (checked when its plan was made): one lookup, pointers, one launch
        if self._planned and inverse is False:
            if positions is None:  # an int offset or per-sequence offsets
                launch, rows = self._launch, offsets
            elif type(positions) is torch.Tensor and type(offsets) is int and offsets == 0:
                launch, rows = self._launch_positions, positions  # explicit positions (torchtune's callers)
        if launch is not None:
            # The module's own gates (_module_gate; cu_seqlens: a tensor for "thd", None for the others). The
            # plan's run checks an int offset against the table (packed: all T rows); per-sequence offsets'
            # and explicit positions' rows are checked by the kernel (the C loop before it writes; Triton
            # flags them; packed offsets are planned on CPU tensors only), and a row past the table misses
            # here on the CPU, so the path below grows the table. Rows on a device are not read on the host:
            # such a call is gated only once the table covers the rows the path below would give it
            # (lookup's _covered: no growth left to miss).
            cache = self._modules["cache"]
            tables = cache._buffers  # dict reads: nn.Module.__getattr__ costs more
            gated, table = True, tables["cos"]
            if type(rows) is not torch.Tensor or rows.is_cpu or table.shape[0] >= cache._covered:
                out, plan_key = launch(
                    q, k, table, tables["sin"], rows, cu_seqlens, interleaved=self._interleaved,
                    inplace=inplace, backend=self.backend, conjugate=False, numerics=self.numerics,
                )  # fmt: skip
                if out is not None:
                    return out if k is not None else out[0]
        rank, head_dim = self._rank, self.config.head_dim
        for name, t in (("q", q), ("k", k)):
            if t is None and name == "k":
                continue  # one tensor
            if not isinstance(t, torch.Tensor) or t.dim() != rank or t.shape[-1] != head_dim:
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
        flags, where = {}, self.config.rotary_position  # keywords past the defaults: passed only when set
        if inverse is not False or where != "first":
            flags = {"inverse": check_bool("inverse", inverse), "rotary_position": where}
        if self.numerics != "exact":
            flags["numerics"] = self.numerics
        kw = dict(interleaved=self.config.interleaved, inplace=inplace, backend=self.backend, **flags)
        cos = self.cache.cos
        if (  # a steady decode / prefill step whose rows the table holds: the functional API's planned path
            type(offsets) is int and positions is None and cu_seqlens is None and self._plain
            and 0 <= offsets and offsets + q_view.shape[1] <= cos.shape[0] and cos.device == q.device
            and cos.dtype == (torch.float64 if q.dtype == torch.float64 else torch.float32)
        ):  # fmt: skip
            if gated:  # through the gate already: on to the checked path, which plans the next call
                pos = resolve(q_view, offsets=offsets, name="x" if k is None else "q")
                out_q, out_k = apply_resolved(
                    q_view, k_view, cos, self.cache.sin, pos, **kw, gated=True, plan_key=plan_key, swap=swap
                )
            elif k is None:
                out_q, out_k = apply_rotary(q_view, cos, self.cache.sin, offsets=offsets, **kw), None
            else:
                out_q, out_k = apply_rotary_qk(q_view, k_view, cos, self.cache.sin, offsets=offsets, **kw)
        else:
            if self._mrope and self.cache.is_mrope(positions, q_view):
                cos, sin, pos = self.cache.mrope_rows(positions, q_view, cu_seqlens)
            else:
                pos = resolve(q_view, positions=positions, offsets=offsets, cu_seqlens=cu_seqlens, name="q")
                cos, sin, pos = self.cache.lookup(pos, q_view)
                if gated and cos is table and positions is None:  # the table the key was made with (not
                    kw.update(  # grown): plan the next call
                        gated=True, plan_key=plan_key, offsets=offsets, cu_seqlens=cu_seqlens, swap=swap,
                        table_grows=True,
                    )  # fmt: skip
                elif gated and cos is table and not alone:  # explicit positions: the plan reads them as
                    kw.update(  # they are ((B, S), or packed (T,) with cu_seqlens), every row checked
                        gated=True, plan_key=plan_key, positions=positions, cu_seqlens=cu_seqlens, swap=swap,
                        table_grows=True,
                    )  # fmt: skip
            out_q, out_k = apply_resolved(q_view, k_view, cos, sin, pos, **kw)
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
