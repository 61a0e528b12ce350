"""Run a Hugging Face model's rotary embedding through ropekit, and change a loaded model's context scaling.

:func:`patch` rebinds, per attention layer, the name ``apply_rotary_pos_emb`` that the layer's ``forward``
looks up: the layer gets its own copy of ``forward`` whose globals point that name at ropekit. Nothing global
changes, so other models (and unpatched layers) keep HF's code, and :func:`unpatch` simply drops the copy.
The copy sees the modeling module's globals as they were when it was patched.

The patched layer rotates with position_ids (which every supported decoder layer passes to its attention) and
a ropekit table built by :meth:`ropekit.RopeConfig.from_hf` from the model's config, so every scaling schedule
runs through ropekit too: float64 angles, ropekit's schedule code, and the backend chosen by ``backend=``.

Supported families (``config.model_type``): see :data:`SUPPORTED_MODEL_TYPES`.
"""

from __future__ import annotations

import copy
import functools
import types
from typing import Any

import torch
from torch import nn

from ropekit.backends import BACKENDS
from ropekit.config import RopeConfig
from ropekit.functional import apply_rotary_qk
from ropekit.hf_config import rope_layer_types
from ropekit.module import RotaryEmbedding
from ropekit.validation import check_positive

__all__ = ["EXTEND_METHODS", "SUPPORTED_MODEL_TYPES", "extend_context", "patch", "unpatch"]

# model_type -> family, as HF names them. Gemma 3 appears as "gemma3_text" (Gemma3ForCausalLM) and as
# "gemma3" (the multimodal wrapper whose text_config holds the language model).
SUPPORTED_MODEL_TYPES = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "phi3": "Phi-3",
    "gpt_neox": "GPT-NeoX",
    "gemma2": "Gemma 2",
    "gemma3": "Gemma 3",
    "gemma3_text": "Gemma 3",
}
EXTEND_METHODS = ("linear", "ntk", "dynamic", "yarn", "llama3", "longrope")
HF_FUNCTION = "apply_rotary_pos_emb"
ROTARY_ATTR = "ropekit_rotary"  # the RotaryEmbedding a patched layer owns (non-persistent buffers only)


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"model: expected a transformers PreTrainedModel, got {type(model).__name__}")
    return getattr(config, "text_config", None) or config


def _check_supported(model: nn.Module) -> None:
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        families = sorted(set(SUPPORTED_MODEL_TYPES.values()))
        raise ValueError(
            f"model: architecture {type(model).__name__} (model_type {model_type!r}) is not supported; "
            f"supported families: {', '.join(families)} (model_type {sorted(SUPPORTED_MODEL_TYPES)})"
        )


def _rotary_layers(model: nn.Module) -> list[nn.Module]:
    """Attention layers whose forward calls HF's apply_rotary_pos_emb."""
    layers = []
    for module in model.modules():
        forward = _unwrap(type(module).forward)
        if HF_FUNCTION in getattr(getattr(forward, "__code__", None), "co_names", ()):
            layers.append(module)
    return layers


def _unwrap(fn):
    """The innermost function under functools.wraps decorators."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


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
    return new


def _cell_holds(cell, obj) -> bool:
    try:
        return cell.cell_contents is obj
    except ValueError:  # an empty cell
        return False


def _rotate_with_ropekit(rope: RotaryEmbedding):
    """The stand-in for HF's apply_rotary_pos_emb in one layer.

    The patched forward passes ``(position_ids, hf_cos_sin)`` where HF's ``(cos, sin)`` went, so this function
    receives the positions as ``cos`` and HF's pair as ``sin``.
    """

    def apply_rotary_pos_emb(q, k, position_ids, hf_cos_sin, unsqueeze_dim=1):
        if unsqueeze_dim != 1:
            raise ValueError(
                f"unsqueeze_dim: ropekit's patch serves HF's (B, H, S, D) layout (1), got {unsqueeze_dim}"
            )
        if position_ids is not None:
            positions = position_ids.expand(q.shape[0], -1)  # (B, S): HF may pass (1, S) for the whole batch
            return rope(q, k, positions=positions)
        # No position ids reached the layer: rotate with HF's own cos/sin, one table row per token.
        cos, sin = hf_cos_sin
        batch, seq = q.shape[0], q.shape[2]
        half = cos.shape[-1] // 2
        cos = cos[..., :half].expand(batch, seq, half).reshape(batch * seq, half)  # (B*S, R/2)
        sin = sin[..., :half].expand(batch, seq, half).reshape(batch * seq, half)
        rows = torch.arange(batch * seq, device=q.device).view(batch, seq)  # (B, S): token t reads row t
        q, k = apply_rotary_qk(
            q.transpose(1, 2), k.transpose(1, 2), cos, sin, positions=rows, backend=rope.backend
        )  # (B, S, heads, D)
        return q.transpose(1, 2), k.transpose(1, 2)

    return apply_rotary_pos_emb


def _patched_forward(rebuilt):
    """Wrap the rebuilt forward so that position_ids travel to ropekit in place of HF's (cos, sin)."""

    @functools.wraps(rebuilt)
    def forward(self, *args, **kwargs):
        if "position_embeddings" in kwargs:
            kwargs["position_embeddings"] = (kwargs.get("position_ids"), kwargs["position_embeddings"])
        else:
            raise ValueError(
                f"{type(self).__name__}: the patched layer expects position_embeddings as a keyword, "
                "as HF's decoder layers pass it"
            )
        return rebuilt(self, *args, **kwargs)

    return forward


def _layer_type(layer: nn.Module, config: Any, per_layer: list[str]) -> str | None:
    if not per_layer:
        return None
    layer_type = getattr(layer, "layer_type", None)
    if layer_type is None:
        layer_type = config.layer_types[layer.layer_idx]
    return layer_type


def patch(model: nn.Module, backend: str = "auto") -> int:
    """Make every attention layer of an HF model rotate q and k with ropekit.

    Idempotent: patching a patched model re-patches it (for instance with another backend).

    Args:
        model: a transformers model of a supported family (Llama, Mistral, Qwen2, Qwen3, Phi-3, GPT-NeoX,
            Gemma 2, Gemma 3), any head (``...ForCausalLM``, the bare ``...Model``).
        backend: ropekit backend, "auto", "torch", "cpu" or "triton".

    Returns:
        The number of attention layers patched.

    Raises:
        ValueError: for an unsupported architecture (named in the message), an unknown backend, or a config
            ropekit cannot read.
    """
    _check_supported(model)
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend: expected 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
    unpatch(model)
    config = _text_config(model)
    per_layer = rope_layer_types(config)
    ropes: dict[str | None, RotaryEmbedding] = {}
    layers = _rotary_layers(model)
    for layer in layers:
        layer_type = _layer_type(layer, config, per_layer)
        if layer_type not in ropes:
            rope_config = RopeConfig.from_hf(config, layer_type=layer_type)
            rope = RotaryEmbedding(rope_config, layout="bhsd", backend=backend)
            device = next((p.device for p in layer.parameters()), None)
            ropes[layer_type] = rope.to(device) if device is not None else rope
        rope = ropes[layer_type]
        rebuilt = _with_globals(type(layer).forward, {HF_FUNCTION: _rotate_with_ropekit(rope)})
        setattr(layer, ROTARY_ATTR, rope)
        layer.forward = types.MethodType(_patched_forward(rebuilt), layer)
    return len(layers)


def unpatch(model: nn.Module) -> int:
    """Restore HF's own rotary code in every layer :func:`patch` changed; returns how many were restored."""
    restored = 0
    for module in model.modules():
        if ROTARY_ATTR in module._modules:
            del module._modules[ROTARY_ATTR]
            module.__dict__.pop("forward", None)
            restored += 1
    return restored


def _is_patched(model: nn.Module) -> str | None:
    """The backend of a patched model, or None."""
    for module in model.modules():
        rope = module._modules.get(ROTARY_ATTR)
        if rope is not None:
            return rope.backend
    return None


def extend_context(model: nn.Module, method: str, factor: float, **params: Any) -> dict[str, Any]:
    """Switch a loaded HF model to a context-extension method, in its config and its rotary modules alike.

    What each method writes into the config's RoPE parameters (``rope_parameters``; per layer type only into
    ``full_attention``, since sliding-window layers never see long distances, as Gemma 3 ships):

    * ``linear``: rope_type "linear", factor (positions divided by factor: position interpolation).
    * ``ntk``: static NTK-aware scaling as a new base, rope_theta * factor^(d / (d - 2)), rope_type "default"
      (HF has no "ntk" rope_type; this is the same frequencies in a form HF reads).
    * ``dynamic``: rope_type "dynamic", factor; the base grows with the sequence past max_position_embeddings.
    * ``yarn``: rope_type "yarn", factor, original_max_position_embeddings (default: the model's current
      max_position_embeddings), plus any of beta_fast, beta_slow, mscale, mscale_all_dim, attention_factor,
      truncate; max_position_embeddings becomes original * factor.
    * ``llama3``: rope_type "llama3", factor, low_freq_factor (default 1), high_freq_factor (default 4),
      original_max_position_embeddings (default: the current max_position_embeddings); max_position_embeddings
      becomes original * factor.
    * ``longrope``: rope_type "longrope", short_factor and long_factor (lists of rotary_dim / 2, required),
      original_max_position_embeddings (default: the current max_position_embeddings);
      max_position_embeddings becomes original * factor, which sets the attention factor
      sqrt(1 + ln(factor) / ln(original)) unless attention_factor is given.

    The model's RotaryEmbedding modules are rebuilt from the new config, and a patched model is re-patched
    with the same backend, so HF's path and ropekit's agree.

    Args:
        model: a model of a supported family (patched or not).
        method: one of :data:`EXTEND_METHODS`.
        factor: the extension factor, > 1 for a longer context (> 0 in general).
        params: the method's extra keys, as listed above.

    Returns:
        The new RoPE parameters dict written into the config (the full_attention one for per-layer configs).

    Raises:
        ValueError: for an unknown method, a factor that is not a positive number, missing or unknown keys
            (ropekit validates the result before anything is changed), or an unsupported model.
    """
    _check_supported(model)
    if method not in EXTEND_METHODS:
        raise ValueError(f"method: expected one of {EXTEND_METHODS}, got {method!r}")
    check_positive("factor", factor)
    config = _text_config(model)
    per_layer = rope_layer_types(config)
    target = "full_attention" if per_layer else None
    old = dict(config.rope_parameters[target] if target else config.rope_parameters)
    new, max_positions = _extended_parameters(config, target, old, method, float(factor), params)

    trial = copy.deepcopy(config)  # validate with ropekit before touching the model
    _write_parameters(trial, target, new, max_positions)
    RopeConfig.from_hf(trial, layer_type=target)

    _write_parameters(config, target, new, max_positions)
    _rebuild_hf_rotary_modules(model)
    backend = _is_patched(model)
    if backend is not None:
        patch(model, backend)
    return new


def _extended_parameters(
    config, target: str | None, old: dict, method: str, factor: float, params: dict
) -> tuple[dict, int]:
    """The new RoPE parameters and max_position_embeddings for `method` (see extend_context)."""
    keep = {k: old[k] for k in ("rope_theta", "partial_rotary_factor") if k in old}
    max_positions = config.max_position_embeddings
    if method == "ntk":
        if params:
            raise ValueError(f"params: method 'ntk' takes no extra keys, got {sorted(params)}")
        d = RopeConfig.from_hf(config, layer_type=target).rotary_dim
        return {
            **keep,
            "rope_type": "default",
            "rope_theta": old["rope_theta"] * factor ** (d / (d - 2)),
        }, max_positions
    new = {**keep, "rope_type": method, "factor": factor, **params}
    if method in ("yarn", "llama3", "longrope"):
        original = new.setdefault("original_max_position_embeddings", max_positions)
        max_positions = int(original * factor)
    if method == "llama3":
        new.setdefault("low_freq_factor", 1.0)
        new.setdefault("high_freq_factor", 4.0)
    if method == "longrope":
        new.pop("factor")  # HF derives it from max_position_embeddings / original
    return new, max_positions


def _write_parameters(config, target: str | None, new: dict, max_positions: int) -> None:
    if target is None:
        config.rope_parameters = dict(new)
    else:
        config.rope_parameters = {**config.rope_parameters, target: dict(new)}
    config.max_position_embeddings = max_positions


def _rebuild_hf_rotary_modules(model: nn.Module) -> None:
    """Re-create HF's rotary modules from the (changed) config, on the device they were on."""
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            if type(child).__name__.endswith("RotaryEmbedding") and hasattr(child, "config"):
                buffers = list(child.buffers())
                fresh = type(child)(child.config)
                if buffers:
                    fresh = fresh.to(buffers[0].device)
                setattr(parent, name, fresh)
