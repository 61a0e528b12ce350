"""Run a Hugging Face model's rotary embedding through ropekit, and change a loaded model's context scaling.

:func:`patch` works from the model itself, not from a list of architectures:

1. **Find.** Every module whose ``forward`` calls a module-level RoPE function (``apply_rotary_pos_emb``,
   ``apply_rotary_emb``, ``apply_rotary_pos_emb_interleave``, ...) is a candidate layer.
2. **Record.** One forward pass on a few token ids records, per layer, the arguments its RoPE function
   received: the layer's q/k shapes and the cos/sin that the model's own rotary module produced. Layers whose
   function is never called (Llama 4's NoPE layers, vision towers that a text forward does not reach) are
   left alone.
3. **Prove.** For each recorded call, random q and k go through the model's own function and through
   ropekit (:mod:`ropekit.integrations.hf_probe` tries each pairing/table reading in turn). A layer is
   patched only if one agrees within a few units in the last place of the dtype; otherwise :func:`patch`
   raises a ValueError naming the model type, the layer and the difference, before anything is replaced
   (``strict=False`` skips the layer with a warning instead).
4. **Replace.** Each proved layer gets its own copy of ``forward`` whose globals point the function's name at
   a stand-in that rotates with ropekit, reading the model's cos/sin in place as ropekit tables. Nothing
   global changes: other models and unpatched layers keep HF's code, and :func:`unpatch` drops the copy.

5. **Tables.** The model's text rotary modules, recorded by the same probe, then serve ropekit's tables from
   :func:`ropekit.model_rope` for each layer type whose layers agree on one entry and whose rows are proved
   equal to the module's own (:mod:`ropekit.integrations.hf_tables`); :func:`layer_ropes` says which layer
   reads which entry. Where ``model_rope`` refuses the config (a layer layout it does not read) or a table is
   not proved, the layers read the model's own tables: the rotation is still ropekit's, and proved.

:func:`extend_context` changes the config, rebuilds the rotary modules and patches a patched model again.
"""

from __future__ import annotations

import copy
import functools
import logging
import re
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ropekit.backends import BACKENDS
from ropekit.config import RopeConfig
from ropekit.functional import apply_rotary
from ropekit.hf_config import rope_layer_types
from ropekit.integrations import hf_tables
from ropekit.integrations.hf_probe import (
    Call,
    NotUnderstood,
    Signature,
    find_convention,
    kernel_function,
    model_function,
    rotation_function,
    stand_in,
)
from ropekit.layer_rope import LayerRope, model_rope
from ropekit.schedules.extend import EXTEND_METHODS, extension_scaling, ntk_base
from ropekit.validation import check_bool, check_numerics

__all__ = [
    "EXTEND_METHODS",
    "extend_context",
    "layer_ropes",
    "patch",
    "patch_doors",
    "patched_layers",
    "unpatch",
]

log = logging.getLogger(__name__)

CONVENTIONS_ATTR = "_ropekit_conventions"  # on a patched layer: {function name: (Convention, backend, door)}
STAND_INS_ATTR = "_ropekit_stand_ins"  # on a patched layer: {function name: the stand-in it calls}
DOOR_ATTR = "_ropekit_previous_forward"  # on a kernels function module we opened: its forward before us
ROPE_ATTR = "_ropekit_layer_rope"  # on a patched layer served ropekit's tables: its model_rope entry
# on a patched model: (backend, strict, numerics), for extend_context to patch again
PATCH_ATTR = "_ropekit_patch"
ORIGINAL_ATTR = (
    "_ropekit_original_rope"  # on a model extend_context changed: its rope before the first change
)
LAYER_NAME = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)(?=\.|$)")  # "model.layers.3.attn" -> 3
PROBE_TOKENS = 12  # positions 0..11: enough distinct angles that a wrong pairing cannot agree by chance
# RoPE-parameter keys that describe a context extension; everything else (rope_theta, partial_rotary_factor,
# mrope_section, ...) is the model's own and survives extend_context.
SCALING_KEYS = frozenset(
    {
        "rope_type", "type", "factor", "original_max_position_embeddings", "low_freq_factor",
        "high_freq_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
        "truncate", "short_factor", "long_factor",
    }
)  # fmt: skip


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"model: expected a transformers PreTrainedModel, got {type(model).__name__}")
    return getattr(config, "text_config", None) or config


def _model_type(model: nn.Module) -> str:
    return str(getattr(getattr(model, "config", None), "model_type", None))


def _unwrap(fn):
    """The innermost function under functools.wraps decorators."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def _code_names(code: types.CodeType) -> set[str]:
    """Global names a code object and the functions defined inside it look up."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _rotation_globals(layer: nn.Module) -> dict[str, Any]:
    """The RoPE functions (by global name) that the layer's forward calls, as the module globals hold them:
    plain functions, or ``kernels`` function modules (transformers >= 5.25; read with
    :func:`hf_probe.model_function`)."""
    forward = _unwrap(type(layer).forward)
    code = getattr(forward, "__code__", None)
    if code is None:
        return {}
    scope = forward.__globals__
    return {n: scope[n] for n in sorted(_code_names(code)) if rotation_function(n, scope.get(n))}


def _kernel_door(layer: nn.Module, fn: Any) -> nn.Module | None:
    """The layer's own copy of a kernels function module, when it holds one for the global `fn`.

    ``kernels.use_kernelized_func`` gives each attention layer a private instance of the function's module
    (``layer._kernel_funcs``) and routes the module-level name to it while the layer runs; ``kernelize``
    replaces that instance's ``forward``. ropekit's patch goes through the same door: no module global and
    no forward of the layer is touched.
    """
    if kernel_function(fn) is None:
        return None
    held = layer.__dict__.get("_kernel_funcs")
    if not isinstance(held, dict):
        return None
    doors = [m for m in held.values() if type(m) is type(fn)]
    return doors[0] if len(doors) == 1 else None


def _open_door(door: nn.Module, fn: Callable) -> None:
    """Route a layer's kernels function module to `fn`, as ``kernelize`` installs a kernel."""

    def forward(self, *args, **kwargs):
        return fn(*args, **kwargs)

    forward.__qualname__ = f"ropekit:{getattr(fn, '__qualname__', 'rotation')}"
    if DOOR_ATTR not in door.__dict__:
        door.__dict__[DOOR_ATTR] = door.__dict__.get("forward")  # a kernel kernelize installed, or None
    door.forward = types.MethodType(forward, door)


def _close_doors(layer: nn.Module) -> None:
    """Give every kernels function module of the layer back the forward it had before ropekit opened it."""
    held = layer.__dict__.get("_kernel_funcs")
    for door in held.values() if isinstance(held, dict) else ():
        if DOOR_ATTR not in door.__dict__:
            continue
        previous = door.__dict__.pop(DOOR_ATTR)
        if previous is None:
            door.__dict__.pop("forward", None)
        else:
            door.forward = previous


def _candidate_layers(model: nn.Module) -> list[tuple[str, nn.Module, dict[str, Any]]]:
    found = []
    for name, module in model.named_modules():
        functions = _rotation_globals(module)
        if functions:
            found.append((name or type(module).__name__, module, functions))
    return found


def _with_globals(fn, replacements: dict[str, Any]):
    """A copy of fn with the global names in `replacements` rebound; decorator wrappers are rebuilt around it.

    Decorators made with functools.wraps keep the wrapped function in a closure cell; the copy of each wrapper
    gets a new cell holding the copy of what it wraps.
    """
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        # The copy's globals drop __name__: torch.compile resolves globals that name a module through
        # sys.modules, which would find HF's function again; without the name it guards this dict itself.
        scope = {k: v for k, v in fn.__globals__.items() if k != "__name__"} | replacements
        new = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    else:
        cells = fn.__closure__ or ()
        held = [_cell_holds(c, inner) for c in cells]
        if not any(held):
            raise ValueError(f"model: cannot patch {fn.__qualname__}: a decorator hides the wrapped forward")
        new_inner = _with_globals(inner, replacements)
        closure = tuple(types.CellType(new_inner) if h else c for c, h in zip(cells, held, strict=True))
        new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = copy.copy(fn.__kwdefaults__)
    functools.update_wrapper(new, fn, updated=())
    if inner is not None:
        new.__wrapped__ = new_inner
    else:
        del new.__wrapped__  # update_wrapper points it at fn; the copy wraps nothing
    return new


def _cell_holds(cell, obj) -> bool:
    try:
        return cell.cell_contents is obj
    except ValueError:  # an empty cell
        return False


def _replace_functions(layer: nn.Module, functions: dict[str, Any], replacements: dict[str, Any]) -> None:
    """Make the layer call replacements[name] where its forward calls the global `name`.

    Through the kernels door where the layer holds one for that function (:func:`_kernel_door`), else
    through a copy of the layer's forward whose globals name the replacement (:func:`_with_globals`).
    """
    through_globals = {}
    for name, fn in replacements.items():
        door = _kernel_door(layer, functions[name])
        if door is None:
            through_globals[name] = fn
        else:
            _open_door(door, fn)
    if through_globals:
        layer.forward = types.MethodType(_with_globals(type(layer).forward, through_globals), layer)


def _restore_functions(layer: nn.Module) -> None:
    layer.__dict__.pop("forward", None)
    _close_doors(layer)


def _recorder(calls: dict, key: tuple, fn):
    def record(*args, **kwargs):
        out = fn(*args, **kwargs)
        calls.setdefault(key, Call(args, kwargs, out))
        return out

    return record


def _token_ids(model: nn.Module, device: torch.device) -> torch.Tensor:
    """(2, PROBE_TOKENS) ordinary token ids: none of the ids the config reserves (image, pad, bos, ...)."""
    config = _text_config(model)
    vocab = int(getattr(config, "vocab_size", None) or getattr(model.config, "vocab_size", None) or 32)
    reserved = set()
    for cfg in {id(model.config): model.config, id(config): config}.values():
        for key, value in vars(cfg).items():
            if "token" in key and isinstance(value, int):
                reserved.add(value)
    ordinary = [t for t in range(3, vocab) if t not in reserved][: 4 * PROBE_TOKENS] or [0]
    picks = torch.tensor(ordinary, device=device)
    order = torch.randperm(len(ordinary), generator=torch.Generator().manual_seed(0)).to(device)
    return picks[order.repeat(2 * PROBE_TOKENS)[: 2 * PROBE_TOKENS]].view(2, PROBE_TOKENS)


def _probe_forward(model: nn.Module) -> None:
    """Run the model once on a few token ids (encoder-decoder models get them as decoder ids too)."""
    parameter = next(model.parameters(), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    ids = _token_ids(model, device)
    attempts = [{"input_ids": ids}]
    if getattr(model.config, "is_encoder_decoder", False):
        attempts.insert(0, {"input_ids": ids, "decoder_input_ids": ids})
    errors = []
    training = model.training
    model.eval()  # no dropout, no running statistics updated by the probe
    try:
        with torch.no_grad():
            for inputs in attempts:
                try:
                    model(**inputs)
                    return
                except Exception as err:
                    errors.append(f"{type(err).__name__}: {err}")
    finally:
        model.train(training)
    raise ValueError(
        f"model: could not run {type(model).__name__} (model_type {_model_type(model)!r}) on token ids "
        f"{tuple(ids.shape)} to record its layers' RoPE calls: {errors[-1]}"
    )


def _record_calls(
    model: nn.Module, candidates: list, rotaries: list[nn.Module]
) -> tuple[dict[tuple[int, str], Call], dict[int, list[hf_tables.RotaryCall]]]:
    """One probe forward recording every candidate layer's rotation calls and every rotary module's calls."""
    calls: dict[tuple[int, str], Call] = {}
    rotary_calls: dict[int, list[hf_tables.RotaryCall]] = {}
    try:
        for _, layer, functions in candidates:
            recorders = {n: _recorder(calls, (id(layer), n), model_function(f)) for n, f in functions.items()}
            _replace_functions(layer, functions, recorders)
        hf_tables.record_rotary(rotaries, rotary_calls)
        _probe_forward(model)
    finally:
        for _, layer, _ in candidates:
            _restore_functions(layer)
        for module in rotaries:
            module.__dict__.pop("forward", None)
    return calls, rotary_calls


def _check_backend(backend: str, call: Call, signature: Signature, numerics: str) -> None:
    """Raise the backend's own ValueError now, not as a failed proof, when it cannot serve the model."""
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend: expected 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
    x = Signature.get(call.args, call.kwargs, signature.rotated[0])
    if isinstance(x, torch.Tensor):
        table = torch.zeros(1, 1, device=x.device)
        x = torch.zeros(1, 1, 1, 2, dtype=x.dtype, device=x.device)
        apply_rotary(x, table, table, backend=backend, numerics=numerics)


def patch(model: nn.Module, backend: str = "auto", *, strict: bool = True, numerics: str = "exact") -> int:
    """Make every attention layer of an HF model rotate q and k with ropekit, after proving it agrees.

    Idempotent: patching a patched model re-patches it (for instance with another backend). See the module
    docstring for how layers are found and proved, and how their tables then come from
    :func:`ropekit.model_rope` (:func:`layer_ropes`; the model's own tables where model_rope refuses the
    config or a table is not proved equal).

    Args:
        model: any transformers model (any head, ``...ForCausalLM``, the bare ``...Model``, multimodal
            wrappers, encoders) whose attention layers call a module-level RoPE function.
        backend: ropekit backend, "auto", "torch", "cpu" or "triton".
        strict: if True (default), a layer whose RoPE ropekit cannot reproduce is a ValueError and nothing is
            patched; if False, such layers keep HF's code and a warning names each of them.
        numerics: "exact" (default): ropekit's arithmetic (one rounding) on ropekit's own tables where
            proved, within a few ulps of HF's. "hf": the model's own bits: each layer reads the cos / sin
            its rotary module computes (model_rope's tables are not served) and is patched only where
            ropekit reproduces its function bit for bit, in the dtype's per-op arithmetic (HF's
            ``q * cos + rotate_half(q) * sin``) or, for a function that computes in float32, rounded once;
            the patched model's logits then equal the unpatched model's (docs/numerics-modes.md).

    Returns:
        The number of layers patched.

    Raises:
        ValueError: when no layer of the model applies RoPE on a text forward pass, when a layer's rotation
            disagrees with ropekit (strict; the message names the model type, the layer and the measured
            difference), for an unknown backend or one that cannot serve the model (or numerics "hf"), a
            model on the meta device, numerics other than "exact" and "hf", or when the model cannot run on
            a few token ids.
    """
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend: expected 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
    check_bool("strict", strict)
    if check_numerics(numerics) == "vllm":
        raise ValueError(
            "numerics: expected 'exact' or 'hf' for a transformers model, got 'vllm' (vLLM's bits are the "
            "plugins': ROPEKIT_NUMERICS, docs/engines.md)"
        )
    _text_config(model)
    tensors = (*model.named_parameters(), *model.named_buffers())
    on_meta = next((name for name, t in tensors if t.is_meta), None)
    if on_meta is not None:
        raise ValueError(
            f"model: {type(model).__name__} has tensors on the meta device ({on_meta!r}: shapes only, no "
            "values), and patch runs the model once to prove each layer's rotation; patch after its weights "
            "are loaded (from_pretrained, or to_empty then load_state_dict)"
        )
    unpatch(model)
    model_type = _model_type(model)
    candidates = _candidate_layers(model)
    wrapped = [name for name, layer, _ in candidates if "forward" in layer.__dict__]
    if wrapped:
        raise ValueError(
            f"model: layer {wrapped[0]!r} already has its forward replaced by another library (an accelerate "
            "hook, another patch); patch the model before wrapping it"
        )
    if not candidates:
        raise ValueError(
            f"model: nothing to patch in {type(model).__name__} (model_type {model_type!r}): no module's "
            "forward calls a RoPE function (apply_rotary*/apply_rope*)"
        )
    rotaries = hf_tables.rotary_modules(model, _text_config(model))
    calls, rotary_calls = _record_calls(model, candidates, rotaries)
    if not calls:
        functions = sorted({n for _, _, fs in candidates for n in fs})
        raise ValueError(
            f"model: nothing to patch in {type(model).__name__} (model_type {model_type!r}): its layers "
            f"reference {functions} but none was called on a text forward pass (a vision or audio tower's "
            "RoPE is not patched)"
        )
    replacements, refused, served = _prove(model_type, candidates, calls, backend, numerics)
    if refused and strict:
        raise ValueError(refused[0] + (f" (and {len(refused) - 1} more layers)" if len(refused) > 1 else ""))
    for message in refused:
        warnings.warn(message, stacklevel=2)
    functions_of = {layer: functions for _, layer, functions in candidates}
    for layer, (conventions, stand_ins) in replacements.items():
        _replace_functions(layer, functions_of[layer], stand_ins)
        setattr(layer, CONVENTIONS_ATTR, conventions)
        layer.__dict__[STAND_INS_ATTR] = stand_ins
    model.__dict__[PATCH_ATTR] = (backend, strict, numerics)
    # "hf": the model's own tables are the bits to reproduce (ropekit's agree within float32 rounding only)
    ropes = _serve_model_rope(model, rotaries, rotary_calls, served) if numerics == "exact" else {}
    for layer, entry in ropes.items():
        layer.__dict__[ROPE_ATTR] = entry
    log.debug("patched %d layers of %s, %d on model_rope's tables", len(replacements), model_type, len(ropes))
    return len(replacements)


def _serve_model_rope(
    model: nn.Module, rotaries: list[nn.Module], rotary_calls: dict, served: dict
) -> dict[nn.Module, LayerRope]:
    """Rotary modules serve ropekit's tables from model_rope where proved (:mod:`hf_tables`).

    A config model_rope refuses (a layout it does not read) keeps the model's own tables in every layer: the
    rotation is still ropekit's and proved; only the table values are the model's.
    """
    if not served:
        return {}
    if not rotaries:
        log.info(
            "%s keeps its own cos/sin tables: no rotary module built from its text config", _model_type(model)
        )
        return {}
    try:
        layers = model_rope(model.config)
    except ValueError as err:
        log.info("%s keeps its own cos/sin tables: %s", _model_type(model), err)
        return {}
    names = {module: name for name, module in model.named_modules()}
    layer_of = {layer: _layer_index(layer, names.get(layer, "")) for layer in served}
    ropes, reasons = hf_tables.prove_tables(rotaries, rotary_calls, served, layer_of, layers)
    for reason in reasons:
        log.info("%s keeps its own cos/sin tables for %s", _model_type(model), reason)
    return ropes


def _layer_index(layer: nn.Module, name: str) -> int | None:
    """The decoder index of a layer: its layer_idx, else the N of the last "layers.N" (or layer.N, h.N,
    blocks.N) in its name (ESM's layers; a module inside an attention layer, as DeepSeek-V4's compressors)."""
    index = getattr(layer, "layer_idx", None)
    if isinstance(index, int) and not isinstance(index, bool):
        return index
    found = LAYER_NAME.findall(name)
    return int(found[-1]) if found else None


def _prove(
    model_type: str, candidates: list, calls: dict, backend: str, numerics: str
) -> tuple[dict, list[str], dict]:
    """Per layer: the stand-ins proved against its recorded calls, or the reason it is refused; and per
    patched layer, the tables its calls received with their form (``Convention.table``), when one form."""
    replacements: dict[nn.Module, tuple[dict, dict]] = {}
    refused: list[str] = []
    served: dict[nn.Module, tuple[list, str]] = {}
    checked_backend = False
    for layer_name, layer, functions in candidates:
        conventions, stand_ins, reasons, tables = {}, {}, [], []
        for name, held in functions.items():
            fn = model_function(held)
            call = calls.get((id(layer), name))
            if call is None:
                continue  # not called: a NoPE layer or a branch the text forward does not take
            try:
                signature = Signature.of(fn)
            except NotUnderstood as err:
                reasons.append(f"its {name} cannot be read: {err}")
                continue
            if not checked_backend:
                _check_backend(backend, call, signature, numerics)
                checked_backend = True
            try:
                convention, diff, tol = find_convention(fn, signature, call, backend, numerics)
            except NotUnderstood as err:
                reasons.append(f"its {name} cannot be read: {err}")
                continue
            if convention is None:
                reasons.append(
                    f"ropekit does not reproduce its {name}: smallest difference {diff:.3g} over every "
                    "pairing "
                    f"and table layout, tolerance {tol:.3g}"
                )
                continue
            recorded = {slot[1]: Signature.get(call.args, call.kwargs, slot) for slot in signature.others}
            recorded["__tuple__"] = isinstance(call.output, tuple)
            door = "kernels" if _kernel_door(layer, held) is not None else "globals"
            conventions[name] = (convention, backend, door)
            tables += [Signature.get(call.args, call.kwargs, slot) for slot in signature.tables]
            stand_ins[name] = stand_in(fn, signature, convention, recorded, backend)
        if reasons:
            refused.append(
                f"model: {model_type} layer {layer_name!r} ({type(layer).__name__}) not patched: "
                + "; ".join(reasons)
            )
        elif conventions:
            replacements[layer] = (conventions, stand_ins)
            forms = {convention.table for convention, _, _ in conventions.values()}
            if len(forms) == 1:
                served[layer] = (tables, forms.pop())
    return replacements, refused, served


def unpatch(model: nn.Module) -> int:
    """Restore HF's own rotary code in every layer :func:`patch` changed; returns how many were restored."""
    restored = 0
    model.__dict__.pop(PATCH_ATTR, None)
    hf_tables.restore(model)
    for module in model.modules():
        if CONVENTIONS_ATTR in module.__dict__:
            del module.__dict__[CONVENTIONS_ATTR]
            module.__dict__.pop(ROPE_ATTR, None)
            module.__dict__.pop(STAND_INS_ATTR, None)
            _restore_functions(module)
            restored += 1
    return restored


def patched_layers(model: nn.Module) -> dict[str, dict[str, str]]:
    """{layer name: {RoPE function: how ropekit runs it}} for every layer :func:`patch` replaced.

    Each description names the door ropekit came in by (``through kernels``: the layer's own kernels function
    module, as ``kernels.kernelize`` installs a kernel; ``through module globals``: a copy of the layer's
    forward) and ends with where the layer's tables come from: ropekit's, from its ``model_rope`` entry, or
    the model's own rotary module.
    """
    return {
        name: {
            fn: f"{convention.describe()}, backend {backend}, through {DOORS[door]}, "
            + ("tables from model_rope" if ROPE_ATTR in module.__dict__ else "the model's tables")
            for fn, (convention, backend, door) in module.__dict__[CONVENTIONS_ATTR].items()
        }
        for name, module in model.named_modules()
        if CONVENTIONS_ATTR in module.__dict__
    }


DOORS = {"kernels": "kernels", "globals": "module globals"}


def patch_doors(model: nn.Module) -> set[str]:
    """The doors :func:`patch` used in a patched model: a subset of {"kernels", "globals"}."""
    return {
        door
        for module in model.modules()
        for _, _, door in module.__dict__.get(CONVENTIONS_ATTR, {}).values()
    }


def layer_ropes(model: nn.Module) -> dict[str, LayerRope]:
    """{layer name: its :func:`ropekit.model_rope` entry} for every patched layer served ropekit's tables."""
    return {
        name: module.__dict__[ROPE_ATTR]
        for name, module in model.named_modules()
        if ROPE_ATTR in module.__dict__
    }


def _training_rope(model: nn.Module, config: Any, target: str | None) -> tuple[dict, int, int]:
    """(RoPE parameters, max_position_embeddings, original training length) before any extend_context.

    Remembered on the model at the first call, so later calls extend from the same starting point. The
    training length is the published original_max_position_embeddings when the config has one (Llama 3.1's
    8192, Phi-3's 4096), else max_position_embeddings.
    """
    remembered = model.__dict__.get(ORIGINAL_ATTR)
    if remembered is not None and remembered[0] == target:
        return remembered[1:]
    params = dict(config.rope_parameters[target] if target else config.rope_parameters)
    original = (
        params.get("original_max_position_embeddings")
        or getattr(config, "original_max_position_embeddings", None)
        or config.max_position_embeddings
    )
    state = (params, int(config.max_position_embeddings), int(original))
    model.__dict__[ORIGINAL_ATTR] = (target, *state)
    return state


def extend_context(model: nn.Module, method: str, factor: float, **params: Any) -> dict[str, Any]:
    """Set a loaded HF model's context extension, in its config and its rotary modules alike.

    A setting, not an accumulation: the extension always starts from the model's training length (the
    published original_max_position_embeddings, else max_position_embeddings, remembered at the first call),
    so calling it twice with the same arguments equals calling it once, and re-applying the scaling a model
    was published with (Llama 3.1's llama3 block) changes nothing. The scaling dict comes from
    :func:`ropekit.schedules.extension_scaling`; the model's own keys (rope_theta, partial_rotary_factor,
    mrope_section, ...) are kept. ``ntk`` has no HF rope_type, so it is written as rope_type "default" with
    the base :func:`ropekit.schedules.ntk_base` gives. Per-layer-type configs (Gemma 2/3, ModernBERT, ...)
    change only their ``full_attention`` entry, since sliding-window layers never see long distances.

    HF's rotary modules are rebuilt from the new config; a patched model is patched again (with the backend
    and strictness of its :func:`patch`), so its tables come from ``model_rope`` of the new config.

    Args:
        model: a transformers model with a RoPE config (patched or not).
        method: one of :data:`EXTEND_METHODS`.
        factor: the extension factor, >= 1.
        params: the method's extra keys (yarn: beta_fast, beta_slow, mscale, ...; llama3: low_freq_factor,
            high_freq_factor; longrope: short_factor and long_factor, required).

    Returns:
        The RoPE parameters written into the config (the full_attention ones for per-layer configs).

    Raises:
        ValueError: for an unknown method, a factor below 1, missing or unknown keys (validated by ropekit and
            by the model's own rotary modules before anything is changed), or a model without a RoPE config.
    """
    config = _text_config(model)
    if not isinstance(getattr(config, "rope_parameters", None), dict):
        raise ValueError(f"model: {_model_type(model)!r} has no rope_parameters in its config to extend")
    target = "full_attention" if rope_layer_types(config) else None
    old, old_max, original = _training_rope(model, config, target)
    kept = {k: v for k, v in old.items() if k not in SCALING_KEYS}
    if method == "ntk":
        if params:
            raise ValueError(f"params: method 'ntk' takes no extra keys, got {sorted(params)}")
        _, max_positions = extension_scaling(method, factor, original)
        rotary_dim = RopeConfig.from_hf(config, layer_type=target).rotary_dim
        new = {**kept, "rope_type": "default", "rope_theta": ntk_base(old["rope_theta"], factor, rotary_dim)}
    else:
        scaling, max_positions = extension_scaling(method, factor, original, **params)
        new = {**kept, **scaling}
    if new == old:
        max_positions = old_max  # the model's own published scaling: nothing changes

    trial = copy.deepcopy(config)  # validate with ropekit and with HF before touching the model
    _write_parameters(trial, target, new, max_positions)
    RopeConfig.from_hf(trial, layer_type=target)
    _rebuild_rotary_modules(model, config, trial, dry_run=True)

    patched = model.__dict__.get(PATCH_ATTR)
    _write_parameters(config, target, new, max_positions)
    _rebuild_rotary_modules(model, config, config, dry_run=False)
    if patched is not None:  # the new tables from model_rope, proved again, with the same choices
        patch(model, patched[0], strict=patched[1], numerics=patched[2])
    return new


def _write_parameters(config, target: str | None, new: dict, max_positions: int) -> None:
    if target is None:
        config.rope_parameters = dict(new)
    else:
        config.rope_parameters = {**config.rope_parameters, target: dict(new)}
    config.max_position_embeddings = max_positions


def _rebuild_rotary_modules(model: nn.Module, config: Any, new_config: Any, dry_run: bool) -> None:
    """Re-create the model's text rotary modules from `new_config`, on the device they were on.

    With dry_run, only build them (HF validates the RoPE parameters as it computes the frequencies) and
    report a failure as a ValueError.
    """
    rebuilt = 0
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            if (
                not type(child).__name__.endswith("RotaryEmbedding")
                or getattr(child, "config", None) is not config
            ):
                continue
            rebuilt += 1
            try:
                fresh = type(child)(new_config)
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(
                    f"model: {type(child).__name__} cannot be rebuilt with the extended RoPE parameters: "
                    f"{err}"
                ) from None
            if dry_run:
                continue
            buffers = list(child.buffers())
            setattr(parent, name, fresh.to(buffers[0].device) if buffers else fresh)
    if not rebuilt:
        raise ValueError(
            f"model: {_model_type(model)!r} has no rotary module built from its text config, so its RoPE "
            "cannot be changed from the config"
        )
