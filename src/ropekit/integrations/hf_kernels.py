"""ropekit through Hugging Face's own door: a ``kernels`` layer for transformers' kernelized RoPE functions.

transformers (5.25 on) decorates its RoPE functions with
``kernels.use_kernel_forward_from_hub("rotary_pos_emb")`` and gives each attention layer a private copy of
the function's module (``use_kernelized_func``); ``kernels``' ``kernelize`` replaces that copy's ``forward``
with the layer class a kernel mapping names for the device.
:func:`kernel_mapping` is such a mapping whose repository is ropekit itself (nothing is downloaded)::

    from kernels import Mode, kernelize, use_kernel_mapping
    from ropekit.integrations.hf_kernels import kernel_mapping

    with use_kernel_mapping(kernel_mapping()):
        model = kernelize(model, mode=Mode.INFERENCE, device="cpu")

:func:`ropekit.integrations.hf.patch` comes in by the same door (with its proof at patch time, and ropekit's
tables from ``model_rope``); this module is for a user who already drives the model through ``kernelize``.

The layer proves itself, as :func:`~ropekit.integrations.hf.patch` does: the first call of each *form* (the
dtype, device, rank and width of every tensor argument, and the function's other arguments) runs the model's
own function and ropekit's candidate conventions on random q and k (:func:`hf_probe.find_convention`); the
proved stand-in serves every later call of that form, whatever its batch or sequence length. A form no
convention reproduces keeps the model's own function, with a warning naming it: never a silent wrong answer.
Under ``torch.compile`` a form not yet proved runs the model's own function (the proof runs eagerly): run one
eager forward before compiling.
"""

from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ropekit.backends import BACKENDS
from ropekit.integrations.hf_probe import (
    Call,
    NotUnderstood,
    Signature,
    find_convention,
    kernel_function,
    stand_in,
)

__all__ = ["DEVICES", "ROTARY_LAYER_NAMES", "RotaryRepository", "kernel_mapping", "rotary_layer"]

# The layer names transformers kernelizes RoPE functions under (5.25: every apply_rotary_pos_emb that follows
# Llama's form; the others stay plain functions, which hf.patch reaches through the module globals).
ROTARY_LAYER_NAMES = ("rotary_pos_emb",)
# Device types kernels maps (kernels' own list, less the ones no torch build of ropekit runs on).
DEVICES = ("cpu", "cuda", "rocm", "xpu", "mps", "npu")

_UNPROVED = object()  # a form's entry before its proof
# {the model's function: {(backend, form): the proved stand-in, or None where ropekit keeps the function}}
_PROOFS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _check_backend(backend: Any) -> None:
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend: expected 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")


def rotary_layer(backend: str = "auto") -> type[nn.Module]:
    """The layer class ``kernelize`` installs: an ``nn.Module`` with no state whose ``forward(*args,
    **kwargs)`` takes the place of the kernelized function's, as ``kernels`` requires of a layer.

    Args:
        backend: the ropekit backend the stand-ins rotate with ("auto", "torch", "cpu" or "triton").
    """
    _check_backend(backend)
    return _layer_class(backend)


@functools.cache
def _layer_class(backend: str) -> type[nn.Module]:
    def forward(self, *args, **kwargs):
        return _rotate(self, backend, args, kwargs)

    # kernels checks that a layer adds no members to nn.Module's but these two flags, and that its forward's
    # parameters match the function module's in number and kind: every function transformers kernelizes as
    # "rotary_pos_emb" reads (q, k, cos, sin, unsqueeze_dim=1), and kernels keeps one layer per repository.
    # The arguments travel on untouched to the model's own function or its proved stand-in.
    forward.__signature__ = inspect.Signature(
        [
            inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            for n in ("self", "q", "k", "cos", "sin")
        ]
        + [inspect.Parameter("unsqueeze_dim", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=1)]
    )
    return type(
        f"RopekitRotary_{backend}",
        (nn.Module,),
        {
            "forward": forward,
            "can_torch_compile": True,  # a proved form is plain torch ops (or ropekit's registered ops)
            "has_backward": True,  # ropekit's rotation has its backward (the conjugate rotation)
            "__module__": __name__,
            "__doc__": f"ropekit's rotation for a kernelized RoPE function, backend {backend!r}.",
        },
    )


@dataclass(frozen=True)
class RotaryRepository:
    """A ``kernels`` repository that is ropekit itself: ``load()`` returns :func:`rotary_layer`'s class."""

    backend: str = "auto"

    def __post_init__(self) -> None:
        _check_backend(self.backend)

    def load(self) -> type[nn.Module]:
        return rotary_layer(self.backend)


def kernel_mapping(backend: str = "auto", devices: tuple[str, ...] = DEVICES) -> dict[str, dict]:
    """A kernel mapping for ``kernels.use_kernel_mapping`` / ``register_kernel_mapping``: every RoPE layer
    name transformers kernelizes, on every device in ``devices``, served by ropekit.

    Raises:
        ValueError: for an unknown backend, or a device type kernels does not map.
    """
    _check_backend(backend)
    if isinstance(devices, str) or not devices or any(d not in DEVICES for d in devices):
        raise ValueError(
            f"devices: expected a non-empty tuple of device types from {DEVICES}, got {devices!r}"
        )
    repository = RotaryRepository(backend)
    return {name: dict.fromkeys(devices, repository) for name in ROTARY_LAYER_NAMES}


def _form(signature: Signature, args: tuple, kwargs: dict) -> tuple:
    """What a proof depends on: every tensor's dtype, device, rank and last width; every other value."""
    parts: list = []
    for slot in signature.rotated + signature.tables:
        x = Signature.get(args, kwargs, slot)
        if isinstance(x, torch.Tensor):
            parts.append((x.dtype, x.device.type, x.dim(), x.shape[-1] if x.dim() else None))
        else:
            parts.append(type(x).__name__)
    for slot in ((signature.unsqueeze,) if signature.unsqueeze else ()) + signature.others:
        value = Signature.get(args, kwargs, slot)
        parts.append(repr(value) if not isinstance(value, torch.Tensor) else ("tensor", value.dtype))
    return tuple(parts)


@functools.cache
def _signature(fn: Callable) -> Signature | None:
    try:
        return Signature.of(fn)
    except NotUnderstood as err:
        warnings.warn(f"ropekit's kernels layer keeps {fn.__module__}.{fn.__qualname__}: {err}", stacklevel=4)
        return None


def _rotate(module: nn.Module, backend: str, args: tuple, kwargs: dict) -> Any:
    fn = kernel_function(module)
    if fn is None:
        raise ValueError(
            f"module: ropekit's kernels layer serves kernels function modules (a function decorated with "
            f"kernels.use_kernel_forward_from_hub), got {type(module).__name__}"
        )
    signature = _signature(fn)
    if signature is None:
        return fn(*args, **kwargs)
    proofs = _PROOFS.setdefault(fn, {})
    key = (backend, _form(signature, args, kwargs))
    entry = proofs.get(key, _UNPROVED)
    if entry is _UNPROVED:
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)  # proved eagerly only; this form keeps the model's function
        entry = proofs[key] = _prove(fn, signature, args, kwargs, backend)
    return fn(*args, **kwargs) if entry is None else entry(*args, **kwargs)


def _prove(fn: Callable, signature: Signature, args: tuple, kwargs: dict, backend: str) -> Callable | None:
    """The stand-in proved equal to `fn` on this call's form, or None (with a warning) where none is."""
    with torch.no_grad():
        output = fn(*args, **kwargs)
    call = Call(args, kwargs, output)
    name = f"{fn.__module__}.{fn.__qualname__}"
    try:
        convention, diff, tol = find_convention(fn, signature, call, backend)
    except NotUnderstood as err:
        warnings.warn(f"ropekit's kernels layer keeps {name}: {err}", stacklevel=5)
        return None
    if convention is None:
        warnings.warn(
            f"ropekit's kernels layer keeps {name}: no ropekit convention reproduces it (smallest difference "
            f"{diff:.3g}, tolerance {tol:.3g})",
            stacklevel=5,
        )
        return None
    recorded: dict[str, Any] = {slot[1]: Signature.get(args, kwargs, slot) for slot in signature.others}
    recorded["__tuple__"] = isinstance(output, tuple)
    return stand_in(fn, signature, convention, recorded, backend)
