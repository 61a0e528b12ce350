"""A patched HF model's cos/sin tables, built by ropekit from :func:`ropekit.model_rope`, one per layer type.

A transformers model computes its tables in a rotary module (``model.rotary_emb``): ``forward(x,
position_ids[, layer_type])`` returns the per-token rows every layer of that type rotates with. Gemma 3n /
Gemma 4 / OLMo 3 call it once per layer type, DeepSeek-V4 with ``main`` or ``compress``. :func:`prove_tables`
replaces such a module's forward, per layer-type key, by one that returns ropekit's rows for the RoPE that
``model_rope`` gives the layers reading them, in the form the rotation function reads (``Convention.table``:
``cat(freqs, freqs)``, ``repeat_interleave``, one value per pair, or complex), after proving, on the calls the
probe forward recorded, that ropekit's rows equal the module's own:

1. **Who reads what.** Each layer's recorded cos (or freqs_cis) shares storage with one recorded output of a
   rotary module; that (module, key) serves the layer. The layer's index (``layer_idx``) names its
   ``model_rope`` entry.
2. **One RoPE per table.** Every layer served by one (module, key) must have the same ``model_rope`` entry,
   and none may be a NoPE layer; ropekit's rows for each recorded call must equal the module's output within
   float32 rounding of the angles (HF forms them in float32). Otherwise the module keeps its own code for
   that key and the reason is logged: the layers still rotate through ropekit, on the model's tables.

The rows come from one :class:`ropekit.table_cache.CosSinCache` per RopeConfig (its growth, length-dependent
frequencies and compile policy); a call with arguments other than the recorded ones (another key, another
keyword) runs the module's own forward.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ropekit.config import RopeConfig
from ropekit.layer_rope import LayerRope
from ropekit.positions import resolve
from ropekit.table_cache import CosSinCache

__all__ = ["TABLES_ATTR", "RotaryCall", "prove_tables", "record_rotary", "restore", "rotary_modules"]

log = logging.getLogger(__name__)

TABLES_ATTR = "_ropekit_tables"  # on a rotary module patch replaced: {key: RopeConfig}
# The forms HF's rotary modules hand out, from ropekit's (..., R/2) rows (hf_probe.Convention.table).
WIDEN: dict[str, Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]] = {
    "first_half": lambda c, s: (torch.cat((c, c), -1), torch.cat((s, s), -1)),  # (..., R)
    "every_other": lambda c, s: (c.repeat_interleave(2, -1), s.repeat_interleave(2, -1)),  # (..., R)
    "full": lambda c, s: (c, s),  # (..., R/2)
    "complex": lambda c, s: (torch.complex(c, s),),  # (..., R/2) complex
}


@dataclass
class RotaryCall:
    """One recorded call of a rotary module: the layer-type key, its arguments and its output tensors."""

    key: Any
    args: tuple
    kwargs: dict
    outputs: tuple[torch.Tensor, ...]


@dataclass
class _Key:
    """What one layer-type key of a rotary module serves."""

    rope: RopeConfig
    table: str  # a WIDEN form
    follows_input: bool  # the output takes x's dtype (HF's .to(x.dtype)); else the recorded dtype
    dtype: torch.dtype  # the recorded output's dtype
    cache: CosSinCache = field(init=False)

    def __post_init__(self) -> None:
        self.cache = CosSinCache(self.rope)


def rotary_modules(model: nn.Module, config: Any) -> list[nn.Module]:
    """The model's rotary modules built from its text config whose forward takes position_ids."""
    found = []
    for module in model.modules():
        if (
            not type(module).__name__.endswith("RotaryEmbedding")
            or getattr(module, "config", None) is not config
        ):
            continue
        try:
            parameters = inspect.signature(type(module).forward).parameters
        except (TypeError, ValueError):
            continue
        if "position_ids" in parameters and "forward" not in module.__dict__:
            found.append(module)
    return found


def _bind(
    module: nn.Module, args: tuple, kwargs: dict, signature: inspect.Signature | None = None
) -> dict[str, Any] | None:
    """{parameter: value} of a call of the module's forward (signature: its own, read once by the caller)."""
    signature = signature or inspect.signature(type(module).forward)
    try:
        bound = signature.bind(module, *args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return dict(list(bound.arguments.items())[1:])  # without self


def _outputs(out: Any) -> tuple[torch.Tensor, ...]:
    out = out if isinstance(out, tuple) else (out,)
    return tuple(o for o in out if isinstance(o, torch.Tensor))


def record_rotary(modules: list[nn.Module], calls: dict[int, list[RotaryCall]]) -> None:
    """Make each module record its calls into calls[id(module)]; the caller drops the recorder afterwards
    (``module.__dict__.pop("forward")``)."""
    for module in modules:
        original = type(module).forward

        def record(*args, _module=module, _original=original, **kwargs):
            out = _original(_module, *args, **kwargs)
            bound = _bind(_module, args, kwargs) or {}
            calls.setdefault(id(_module), []).append(
                RotaryCall(bound.get("layer_type"), args, kwargs, _outputs(out))
            )
            return out

        module.forward = record


def restore(model: nn.Module) -> int:
    """Give every rotary module :func:`prove_tables` replaced its own forward back; returns how many."""
    restored = 0
    for module in model.modules():
        if TABLES_ATTR in module.__dict__:
            del module.__dict__[TABLES_ATTR]
            module.__dict__.pop("forward", None)
            restored += 1
    return restored


def _rows(key: _Key, position_ids: Any, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """ropekit's table for position_ids ((B, S), or M-RoPE's (axes, B, S)), in the model's form."""
    if not isinstance(position_ids, torch.Tensor) or not isinstance(x, torch.Tensor):
        return None
    if position_ids.is_floating_point():
        # HF's rotary modules take float positions (Qwen3-Omni's get_rope_index makes float32 ones, and a
        # fractional position is a valid angle there); ropekit's tables index integer rows, so such a call
        # keeps the module's own table code, with no value read on the host.
        return None
    cache = key.cache
    mrope = key.rope.mrope_section is not None and position_ids.dim() == 3
    if position_ids.dim() != 2 and not mrope:
        return None
    batch, seq = position_ids.shape[-2:]
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    # Only the shape, dtype and device of x are read: a zero-stride (B, S, 1, 2) stand-in for the kernels' x.
    probe = torch.zeros((), dtype=dtype, device=position_ids.device).expand(batch, seq, 1, 2)
    if mrope and cache.is_mrope(position_ids, probe):
        cos, sin, pos = cache.mrope_rows(position_ids, probe, None)
    else:
        if mrope:
            return None
        cos, sin, pos = cache.lookup(resolve(probe, positions=position_ids, name="position_ids"), probe)
    rows = pos.as_tensor(probe)  # (B, S)
    out = WIDEN[key.table](cos[rows], sin[rows])  # (B, S, W)
    if key.table == "complex":
        return out
    dtype = x.dtype if key.follows_input else key.dtype
    return tuple(t.to(dtype) for t in out)


def _stand_in(module: nn.Module, keys: dict[Any, _Key], recorded: dict[str, Any]) -> Callable:
    """The rotary module's forward: ropekit's rows for a proved key, the module's own code otherwise.

    recorded: the probe's values of the arguments other than x, position_ids and layer_type.
    """
    signature = inspect.signature(type(module).forward)

    def forward(*args, **kwargs):
        bound = _bind(module, args, kwargs, signature)
        key = None if bound is None else keys.get(bound.get("layer_type"))
        if key is None or any(bound.get(n) != v for n, v in recorded.items()):
            return type(module).forward(module, *args, **kwargs)
        out = _rows(key, bound["position_ids"], bound.get("x"))
        if out is None:
            return type(module).forward(module, *args, **kwargs)
        return out[0] if len(out) == 1 else out

    forward.__qualname__ = f"ropekit:{type(module).__qualname__}.forward"
    return forward


def _tolerance(outputs: tuple[torch.Tensor, ...], largest: int) -> float:
    """HF forms position * inv_freq in float32: its angles carry ~largest position float32 ulps, then its
    rows are rounded to the output dtype."""
    dtype = outputs[0].real.dtype if outputs[0].is_complex() else outputs[0].dtype
    scale = max((o.abs().max().item() for o in outputs if o.numel()), default=1.0)
    return 4 * scale * (torch.finfo(dtype).eps + torch.finfo(torch.float32).eps * (1 + largest))


def _matches(key: _Key, module: nn.Module, call: RotaryCall) -> str | None:
    """None if ropekit's rows equal the recorded output, else why not."""
    bound = _bind(module, call.args, call.kwargs) or {}
    position_ids = bound.get("position_ids")
    try:
        ours = _rows(key, position_ids, bound.get("x"))
    except ValueError as err:
        return f"ropekit's rows could not be built ({err})"
    if ours is None:
        return f"position_ids of shape {getattr(position_ids, 'shape', None)} are not read"
    theirs = call.outputs
    if len(ours) != len(theirs) or any(
        a.shape != b.shape or a.dtype != b.dtype for a, b in zip(ours, theirs, strict=True)
    ):
        return (
            f"ropekit's rows {[(tuple(a.shape), a.dtype) for a in ours]} are not shaped like the module's "
            f"{[(tuple(b.shape), b.dtype) for b in theirs]}"
        )
    largest = int(position_ids.abs().max()) if position_ids.numel() else 0
    tol = _tolerance(theirs, largest)
    diff = max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True) if a.numel())
    return (
        None
        if diff <= tol
        else f"ropekit's rows differ from the module's by {diff:.3g} (tolerance {tol:.3g})"
    )


def prove_tables(
    modules: list[nn.Module],
    rotary_calls: dict[int, list[RotaryCall]],
    served: dict[nn.Module, tuple[list[torch.Tensor], str]],
    layer_of: dict[nn.Module, int | None],
    model_layers: list[LayerRope],
) -> tuple[dict[nn.Module, LayerRope], list[str]]:
    """Replace each rotary module's forward, per key proved, by ropekit's rows (module docstring).

    Args:
        modules: the rotary modules recorded.
        rotary_calls: their recorded calls, by id(module).
        served: per patched layer, the table tensors its rotation function received and their form.
        layer_of: per patched layer, its decoder index (None when unknown).
        model_layers: ``model_rope(config)``.

    Returns:
        ({layer: its model_rope entry} for each layer now served ropekit's rows, [why a key kept its own]).
    """
    source: dict[int, tuple[nn.Module, Any]] = {}  # storage address of a recorded output -> (module, key)
    for module in modules:
        for call in rotary_calls.get(id(module), []):
            for out in call.outputs:
                source[out.untyped_storage().data_ptr()] = (module, call.key)
    readers: dict[tuple[int, Any], list[nn.Module]] = {}
    untraced = 0
    for layer, (tables, _) in served.items():
        found = {source.get(t.untyped_storage().data_ptr()) for t in tables if isinstance(t, torch.Tensor)}
        if len(found) == 1 and None not in found:
            module, key = found.pop()
            readers.setdefault((id(module), key), []).append(layer)
        else:
            untraced += 1
    by_id = {id(m): m for m in modules}
    ropes: dict[nn.Module, LayerRope] = {}
    reasons: list[str] = []
    if untraced:  # GPT-J builds its table inside the layer; a copy of a module's output is not traced
        reasons.append(f"{untraced} layers whose tables are not one recorded rotary module's output")
    proved: dict[nn.Module, dict[Any, _Key]] = {}
    for (module_id, key), layers in readers.items():
        module = by_id[module_id]
        where = f"{type(module).__name__}" + (f" (layer type {key!r})" if key is not None else "")
        entries = [
            model_layers[i]
            for i in (layer_of.get(layer) for layer in layers)
            if i is not None and i < len(model_layers)
        ]
        chosen = {e.rope for e in entries}
        forms = {served[layer][1] for layer in layers}
        if not entries or None in chosen or len(chosen) != 1 or len(forms) != 1:
            reasons.append(
                f"{where}: model_rope gives its layers {sorted(map(str, chosen)) or 'no entry'} "
                f"(table forms {sorted(forms)}), not one RoPE"
            )
            continue
        calls = [c for c in rotary_calls[module_id] if c.key == key and c.outputs]
        first = calls[0].outputs[0]
        x = (_bind(module, calls[0].args, calls[0].kwargs) or {}).get("x")
        follows = isinstance(x, torch.Tensor) and first.dtype == x.dtype
        entry = _Key(chosen.pop(), forms.pop(), follows, first.dtype)
        failed = next((r for r in (_matches(entry, module, c) for c in calls) if r), None)
        if failed:
            reasons.append(f"{where}: {failed}")
            continue
        proved.setdefault(module, {})[key] = entry
        for layer in layers:
            index = layer_of.get(layer)
            if index is not None and index < len(model_layers):
                ropes[layer] = model_layers[index]
    for module, keys in proved.items():
        first = rotary_calls[id(module)][0]
        bound = _bind(module, first.args, first.kwargs) or {}
        recorded = {
            n: v
            for n, v in bound.items()
            if n not in ("x", "position_ids", "layer_type") and not isinstance(v, torch.Tensor)
        }
        module.forward = _stand_in(module, keys, recorded)
        module.__dict__[TABLES_ATTR] = {k: e.rope for k, e in keys.items()}
    return ropes, reasons
