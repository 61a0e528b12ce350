"""Which ropekit rotation reproduces a model's own RoPE function, found and proved by measurement.

A Hugging Face attention layer rotates q and k by calling a module-level function with the cos/sin that the
model's rotary module produced: ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` in most families,
``apply_rotary_emb(xq, xk, freqs_cis)`` (complex) in Llama 4 and DeepSeek-V2,
``apply_rotary_pos_emb_interleave`` in DeepSeek-V3, ``apply_rotary_pos_emb(tensor, sin, cos)`` in GPT-J.
The families disagree on three things only, and a :class:`Convention` names one choice of each:

* how the (B, S, W) table holds the per-pair angles: ``first_half`` (``cat(freqs, freqs)``, Llama and most),
  ``every_other`` (``repeat_interleave(freqs, 2)``, Cohere), ``full`` (``freqs`` once, GPT-J, GPT-OSS), or
  ``complex`` (``exp(i freqs)``, Llama 4);
* which features pair up: ``half`` (i, i + R/2), ``interleaved`` (2i, 2i + 1), or ``deinterleave``
  (interleaved pairs whose results are written out as [evens, odds], DeepSeek-V3's ``rope_interleave``);
* the layout of q: (B, H, S, D) or (B, S, H, D), read from ``unsqueeze_dim`` when the function has one.

Partial rotary needs one more choice only for DeepSeek-V4, whose heads are [nope | rope]: ropekit rotates the
first R = 2 * table width features and passes the rest, as every other HF function does, or the last R. The
table values (frequencies, YaRN's mscale, M-RoPE's section merge, per-layer bases) are the model's own, read
as they are, so the only thing to get right is the pairing, and :func:`find_convention` proves that on
random q and k before anything is replaced.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ropekit.functional import apply_rotary, apply_rotary_qk

__all__ = [
    "CANDIDATES",
    "Call",
    "Convention",
    "Signature",
    "find_convention",
    "kernel_function",
    "model_function",
    "rotation_function",
    "stand_in",
]

# Parameter names that HF's rotation functions give the tensors they rotate and the tables they read.
ROTATED_NAMES = ("q", "k", "x", "tensor", "xq", "xk")
TABLE_NAMES = (("cos", "sin"), ("freqs_cis",))
UNSQUEEZE_NAME = "unsqueeze_dim"


@dataclass(frozen=True)
class Convention:
    """One way to run a model's rotation function through ropekit (see the module docstring)."""

    table: str  # "first_half", "every_other", "full" or "complex"
    pairing: str  # "half", "interleaved" or "deinterleave"
    layout: str  # "bhsd" or "bshd"; overridden per call by unsqueeze_dim when the function has it
    conjugate: bool = False  # rotates by -angle (NanoChat's rotate_half flips the other sign)
    rotary_position: str = "first"  # "last": the trailing features rotate (DeepSeek-V4's [nope | rope] heads)
    # the arithmetic (ropekit.validation.NUMERICS): "hf" where the model's function computes in its dtype,
    # "exact" where it computes in float32 and rounds once (patch(numerics="hf") proves which, bit for bit)
    numerics: str = "exact"

    def describe(self) -> str:
        sign = ", conjugate" if self.conjugate else ""
        where = ", trailing features" if self.rotary_position == "last" else ""
        numerics = f", numerics={self.numerics!r}" if self.numerics != "exact" else ""
        table = self.table.replace("_", "-")
        return f"{self.pairing} pairing, {table} table, {self.layout}{sign}{where}{numerics}"


# Tried in this order; the first one that agrees with the model's function is used.
CANDIDATES = tuple(
    Convention(table, pairing, layout, conjugate, position)
    for layout in ("bhsd", "bshd")
    for table, pairing, conjugate, position in (
        ("first_half", "half", False, "first"),
        ("full", "half", False, "first"),
        ("every_other", "interleaved", False, "first"),
        ("first_half", "interleaved", False, "first"),
        ("full", "interleaved", False, "first"),
        ("first_half", "deinterleave", False, "first"),
        ("complex", "interleaved", False, "first"),
        ("first_half", "half", True, "first"),
        ("first_half", "interleaved", True, "first"),
        ("full", "interleaved", False, "last"),  # DeepSeek-V4: per-pair tables, trailing rope slice
        ("first_half", "half", False, "last"),
    )
)


class NotUnderstood(ValueError):
    """A rotation function whose signature ropekit cannot map onto (tensors to rotate, tables)."""


@dataclass(frozen=True)
class Signature:
    """Where a rotation function takes its rotated tensors, its tables and unsqueeze_dim."""

    rotated: tuple[tuple[int, str], ...]  # (position, name) of q[, k]
    tables: tuple[tuple[int, str], ...]  # (position, name) of (cos, sin) or (freqs_cis,)
    unsqueeze: tuple[int, str, int] | None  # (position, name, default)
    others: tuple[tuple[int, str, Any], ...]  # every other parameter: (position, name, default)

    @classmethod
    def of(cls, fn: Callable) -> Signature:
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError) as err:
            raise NotUnderstood(f"its signature cannot be read ({err})") from None
        slots = {
            p.name: i for i, p in enumerate(params) if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        }
        rotated = tuple((slots[n], n) for n in sorted(slots, key=slots.get) if n in ROTATED_NAMES)
        tables = next(
            (tuple((slots[n], n) for n in names) for names in TABLE_NAMES if set(names) <= set(slots)), ()
        )
        if not rotated or not tables or len(rotated) > 2:
            raise NotUnderstood(
                f"its parameters {[p.name for p in params]} do not name tensors to rotate "
                f"{ROTATED_NAMES} and tables {TABLE_NAMES}"
            )
        known = {n for _, n in rotated + tables} | {UNSQUEEZE_NAME}
        unsqueeze = None
        if UNSQUEEZE_NAME in slots:
            default = params[slots[UNSQUEEZE_NAME]].default
            unsqueeze = (
                slots[UNSQUEEZE_NAME],
                UNSQUEEZE_NAME,
                1 if default is inspect.Parameter.empty else default,
            )
        others = tuple(
            (slots[p.name], p.name, p.default) for p in params if p.name in slots and p.name not in known
        )
        return cls(rotated, tables, unsqueeze, others)

    @staticmethod
    def get(args: tuple, kwargs: dict, slot: tuple) -> Any:
        position, name = slot[0], slot[1]
        if name in kwargs:
            return kwargs[name]
        if position < len(args):
            return args[position]
        return slot[2] if len(slot) > 2 else None


@dataclass
class Call:
    """One recorded call of a model's rotation function: its arguments and what it returned."""

    args: tuple
    kwargs: dict
    output: Any


def kernel_function(obj: Any) -> Callable | None:
    """The plain function inside a ``kernels`` function module, or None when ``obj`` is not one.

    transformers 5.25 decorates its RoPE functions with
    ``kernels.use_kernel_forward_from_hub("rotary_pos_emb")``, which turns ``apply_rotary_pos_emb`` into an
    instance of a generated ``nn.Module`` class (``Func``) whose ``forward(*args, **kwargs)`` calls the
    original function. ``kernels`` marks the class with
    ``kernel_layer_name`` and holds the function in the closure of the class's own ``forward`` (the free
    variable ``func``); ``kernelize`` only ever replaces an instance's ``forward``, never the class's, so the
    class's ``forward`` always reaches the model's code.
    """
    cls = type(obj)
    if not isinstance(obj, torch.nn.Module) or not isinstance(getattr(cls, "kernel_layer_name", None), str):
        return None
    forward = cls.__dict__.get("forward")
    code = getattr(forward, "__code__", None)
    if code is None:
        return None
    cells = dict(zip(code.co_freevars, forward.__closure__ or (), strict=True))
    held = [cells["func"]] if "func" in cells else list(cells.values())
    functions = []
    for cell in held:
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if inspect.isfunction(contents):
            functions.append(contents)
    return functions[0] if len(functions) == 1 else None


def model_function(obj: Any) -> Any:
    """The model's own function behind a global: the one a kernels module wraps, else the global itself."""
    return kernel_function(obj) or obj


def rotation_function(name: str, fn: Any) -> bool:
    """Whether a global that an attention forward calls looks like a RoPE rotation (checked by probing).

    The global's name or the function's own name must read apply_*rotary* / apply_*rope*. A ``kernels``
    function module (:func:`kernel_function`) is read through the function it wraps.
    """
    fn = model_function(fn)
    if not inspect.isfunction(fn):
        return False
    return any(
        ("rotary" in n or "rope" in n) and n.startswith(("apply", "_apply"))
        for n in (name.lower(), fn.__name__.lower())
    )


def _tables(
    convention: Convention, cos: torch.Tensor, sin: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's tables with one angle per pair: (..., S, R/2); views for first-half and full tables."""
    # The fused backends read tables whose last axis has stride 1; every-other and complex tables are
    # compacted (one (B, S, R/2) copy per call, far smaller than q and k).
    if convention.table == "complex":
        pairs = torch.view_as_real(cos)  # (..., S, R/2, 2): real and imaginary parts side by side
        return pairs[..., 0].contiguous(), pairs[..., 1].contiguous()
    if sin is None:
        raise ValueError("the plan reads real cos/sin tables")
    if convention.table == "first_half":
        half = cos.shape[-1] // 2
        return cos[..., :half], sin[..., :half]
    if convention.table == "every_other":
        return cos[..., ::2].contiguous(), sin[..., ::2].contiguous()
    return cos, sin


def _rotate(
    convention: Convention, layout: str, xs: list, cos: torch.Tensor, sin: torch.Tensor, backend: str
) -> list | None:
    """Rotate the tensors in xs (some may be None) as the convention says; None when the shapes do not fit."""
    present = [x for x in xs if x is not None]
    if not present or any(not isinstance(x, torch.Tensor) or x.dim() != 4 for x in present):
        return None
    if cos.is_complex() != (convention.table == "complex"):
        return None
    cos, sin = _tables(convention, cos, sin)
    if convention.conjugate:
        sin = -sin  # (..., S, R/2): the one table copy a conjugate convention costs
    seq_axis = 2 if layout == "bhsd" else 1
    batch, seq = present[0].shape[0], present[0].shape[seq_axis]
    if any(x.shape[0] != batch or x.shape[seq_axis] != seq for x in present):
        return None
    if cos.dim() == 3 and cos.shape[0] == 1:
        cos, sin = cos[0], sin[0]
    if cos.shape[-2] != seq:
        return None
    positions = None
    if cos.dim() == 3:  # (B, S, R/2): one row per token, read in place
        if cos.shape[0] != batch:
            return None
        cos, sin = cos.flatten(0, 1), sin.flatten(0, 1)  # (B*S, R/2): a view when the table is dense
        positions = torch.arange(batch * seq, device=present[0].device).view(batch, seq)
    elif cos.dim() != 2:
        return None
    views = [
        None if x is None else (x.transpose(1, 2) if layout == "bhsd" else x) for x in xs
    ]  # (B, S, H, D)
    inplace = False
    if convention.pairing == "deinterleave":
        width = 2 * cos.shape[-1]
        if any(v.shape[-1] != width for v in views if v is not None):
            return None
        # (x0, x1, x2, ...) -> [x0, x2, ..., x1, x3, ...]: the one copy HF's function makes too; rotating
        # that copy in place with half pairing writes what DeepSeek's code writes.
        views = [None if v is None else v.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2) for v in views]
        inplace = True
    interleaved = convention.pairing == "interleaved"
    first, second = [*views, None][:2]
    kw = dict(positions=positions, interleaved=interleaved, inplace=inplace, backend=backend)
    if convention.numerics != "exact":
        kw["numerics"] = convention.numerics
    if convention.rotary_position != "first":
        kw["rotary_position"] = convention.rotary_position
    if first is None:
        first, second = second, None
    if second is None:
        out = [apply_rotary(first, cos, sin, **kw)]
    else:
        out = list(apply_rotary_qk(first, second, cos, sin, **kw))
    out = [o.transpose(1, 2) if layout == "bhsd" else o for o in out]
    it = iter(out)
    return [None if x is None else next(it) for x in xs]


def _layout(signature: Signature, convention: Convention, args: tuple, kwargs: dict) -> str | None:
    if signature.unsqueeze is None:
        return convention.layout
    dim = Signature.get(args, kwargs, signature.unsqueeze)
    return {1: "bhsd", 2: "bshd"}.get(dim)


def _run_convention(
    signature: Signature, convention: Convention, args: tuple, kwargs: dict, backend: str, like: Any
) -> Any:
    """ropekit's result for one call, shaped like the model function's output `like`; None if unservable."""
    layout = _layout(signature, convention, args, kwargs)
    if layout is None:
        return None
    xs = [Signature.get(args, kwargs, s) for s in signature.rotated]
    tables = [Signature.get(args, kwargs, s) for s in signature.tables]
    cos, sin = (tables[0], None) if len(tables) == 1 else tables
    if not isinstance(cos, torch.Tensor) or (sin is not None and not isinstance(sin, torch.Tensor)):
        return None
    out = _rotate(convention, layout, xs, cos, sin, backend)
    if out is None:
        return None
    if isinstance(like, torch.Tensor):  # one tensor back: q alone (k None, as Qwen4-exp's indexer calls it)
        present = [o for o in out if o is not None]
        return present[0] if len(present) == 1 else None
    return tuple(out)


def stand_in(
    fn: Callable, signature: Signature, convention: Convention, recorded: dict, backend: str
) -> Callable:
    """The function a patched layer calls in place of the model's `fn`.

    `recorded` holds the values the probe saw for every parameter that is neither rotated nor a table; a call
    that passes other values (or shapes the convention was not proved on) goes to the model's own function, so
    a stand-in is never used outside what was proved.
    """
    returns_tuple = recorded["__tuple__"]

    def rotate(*args, **kwargs):
        for slot in signature.others:
            value = Signature.get(args, kwargs, slot)
            if not isinstance(value, torch.Tensor) and value != recorded.get(slot[1]):
                return fn(*args, **kwargs)
        out = _run_convention(
            signature, convention, args, kwargs, backend, () if returns_tuple else torch.empty(())
        )
        return fn(*args, **kwargs) if out is None else out

    rotate.__name__ = fn.__name__
    rotate.__qualname__ = f"ropekit:{fn.__qualname__}"
    rotate.__wrapped_model_function__ = fn  # what unpatching restores, and where the tests look
    return rotate


def tolerance(dtype: torch.dtype, scale: float) -> float:
    """Agreement required between the model's rotation and ropekit's: a few units in the last place.

    Both compute q cos + rotate(q) sin; HF rounds each product to the model dtype, ropekit rounds once, so
    they differ by at most ~2 ulp of the output's size. A wrong pairing or table differs by O(|q|).
    """
    return 4 * torch.finfo(dtype).eps * max(1.0, scale)


def _probe_inputs(signature: Signature, call: Call, generator: torch.Generator) -> tuple[tuple, dict]:
    """The recorded call with every rotated tensor replaced by fresh random values (same shape and dtype)."""
    args, kwargs = list(call.args), dict(call.kwargs)
    for position, name in signature.rotated:
        x = Signature.get(call.args, call.kwargs, (position, name))
        if not isinstance(x, torch.Tensor):
            continue
        fresh = torch.randn(x.shape, generator=generator, dtype=torch.float32).to(
            device=x.device, dtype=x.dtype
        )
        if name in kwargs:
            kwargs[name] = fresh
        else:
            args[position] = fresh
    return tuple(args), kwargs


def _difference(ours: Any, theirs: Any) -> float:
    """Largest absolute difference between two outputs of the same structure (inf if they differ in shape)."""
    a = [ours] if isinstance(ours, torch.Tensor) else list(ours)
    b = [theirs] if isinstance(theirs, torch.Tensor) else list(theirs)
    if len(a) != len(b):
        return float("inf")
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            if x is not y:
                return float("inf")
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            return float("inf")
        worst = max(worst, (x.double() - y.double()).abs().max().item() if x.numel() else 0.0)
    return worst


def find_convention(
    fn: Callable, signature: Signature, call: Call, backend: str, numerics: str = "exact"
) -> tuple[Convention | None, float, float]:
    """The first candidate convention that agrees with `fn` on the recorded call's tables and random q, k.

    Returns (convention or None, the smallest difference measured, the tolerance). Every candidate is measured
    on the same random inputs, through the model's own function and through ropekit with ``backend``.

    ``numerics`` "hf": the model's bits, tolerance 0. Each candidate is tried in the model dtype's per-op
    arithmetic ("hf", HF's ``q * cos + rotate_half(q) * sin``) and then rounded once ("exact": a function
    that computes in float32, as Llama 4's complex product does); the convention carries the one that
    equals the model's function bit for bit.
    """
    generator = torch.Generator().manual_seed(0)
    args, kwargs = _probe_inputs(signature, call, generator)
    with torch.no_grad():
        theirs = fn(*args, **kwargs)
        outputs = (
            [theirs]
            if isinstance(theirs, torch.Tensor)
            else list(theirs)
            if isinstance(theirs, tuple)
            else []
        )
        outputs = [o for o in outputs if isinstance(o, torch.Tensor)]
        if not outputs:
            raise NotUnderstood(f"it returned {type(theirs).__name__}, expected tensors")
        scale = max(o.abs().max().item() for o in outputs if o.numel())
        tol = tolerance(outputs[0].dtype, scale) if numerics == "exact" else 0.0
        arithmetic = ("exact",) if numerics == "exact" else (numerics, "exact")
        best = float("inf")
        for convention in (replace(c, numerics=m) for c in CANDIDATES for m in arithmetic):
            if signature.unsqueeze is not None and convention.layout != "bhsd":
                continue  # unsqueeze_dim sets the layout: the bshd twins would repeat the bhsd ones
            try:
                ours = _run_convention(signature, convention, args, kwargs, backend, theirs)
            except ValueError:  # a table too wide for the head, and the like: not this convention
                continue
            if ours is None:
                continue
            diff = _difference(ours, theirs)
            if diff <= tol:
                return convention, diff, tol
            best = min(best, diff)
    return None, best, tol
