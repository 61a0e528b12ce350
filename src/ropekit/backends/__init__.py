"""Backend dispatch: the one place that decides which backend runs an op, and its fallbacks.

A backend is one object that runs every op (:mod:`ropekit.backends.base`): the rotation (``rotate_qk``), the
fused serving launch (``launch_fused``: RoPE + KV-cache write, RoPE + FP8, cache shift) and QK-norm + RoPE
(``launch_qk_norm``). ``backend="auto"`` walks :data:`AUTO_ORDER` and takes the first backend that can serve
the inputs, logging why each earlier one was skipped; the plain torch backend always can, and serves a fused
op that the chosen backend cannot (a head too wide, a C loop not built, a registered backend without fused
kernels). Naming a backend explicitly that cannot serve the inputs raises a ValueError with the reason.
"""

from __future__ import annotations

import logging
import os

import torch

from ropekit.backends.base import Backend, served_numerics
from ropekit.backends.c.rotary import CpuBackend
from ropekit.backends.eager.backend import EagerBackend
from ropekit.backends.kernel_op import check_device
from ropekit.backends.plan import clear_plans
from ropekit.backends.triton.backend import TritonBackend

__all__ = [
    "AUTO_ORDER",
    "BACKENDS",
    "FUSED_BACKENDS",
    "Backend",
    "clear_backend_cache",
    "named_backend",
    "register_backend",
    "select_backend",
]

log = logging.getLogger("ropekit.backends")

# Both fast backends are always registered, so naming one that cannot serve the inputs gives its reason.
BACKENDS: dict[str, Backend] = {"triton": TritonBackend(), "cpu": CpuBackend(), "torch": EagerBackend()}
# The kernels' out-of-place ops, registered just above, get their ATen decompositions (torch.export).
from ropekit.backends import decompose  # noqa: E402, F401

# Fastest first; "torch" last because it always works.
AUTO_ORDER: list[str] = ["triton", "cpu", "torch"]
# The built-in backends, each with a fused serving kernel (a registered third-party backend may have none).
FUSED_BACKENDS = ("torch", "cpu", "triton")
# op -> the method that runs its launch: every op but the rotation is optional for a registered backend.
_LAUNCHES = {"fused": "launch_fused", "qk_norm": "launch_qk_norm"}


# (name, device, dtype, table width, TRITON_INTERPRET) -> the backend chosen for it: the answer never
# changes within a process, and deciding costs microseconds a decode step cannot spare. Cleared by
# register_backend and clear_backend_cache (tests that change what is available).
_choices: dict[tuple, tuple[Backend, list[str]]] = {}


def clear_backend_cache() -> None:
    """Forget every cached backend choice and launch plan (after changing BACKENDS, AUTO_ORDER or a backend's
    state)."""
    _choices.clear()
    clear_plans()


def register_backend(backend: Backend, *, auto_priority: int | None = None) -> None:
    """Add a backend; with auto_priority, also insert it into AUTO_ORDER at that index."""
    clear_backend_cache()
    BACKENDS[backend.name] = backend
    if auto_priority is not None and backend.name not in AUTO_ORDER:
        AUTO_ORDER.insert(auto_priority, backend.name)


def select_backend(
    name: str,
    q: torch.Tensor,
    cos: torch.Tensor,
    *,
    op: str = "rotary",
    widest: int = 0,
    spec=None,
    numerics: str = "exact",
) -> Backend:
    """Return the backend to use for these inputs (cached per name, device type, dtype, table width and
    numerics).

    Args:
        name: "auto" or a registered backend's name.
        q, cos: the inputs (their device, dtype and the table width decide).
        op: "rotary"; "fused" (RoPE + cache, RoPE + FP8, cache shift: ``launch_fused``) or "qk_norm"
            (``launch_qk_norm``): the rotation's choice, then whether it runs that op here, for heads of
            ``widest`` features and the QK-norm packing ``spec``. "auto" falls back to torch where it cannot.
        numerics: the rotation's arithmetic (:data:`ropekit.validation.NUMERICS`): a backend serves the
            modes its ``numerics`` attribute lists ("exact" alone without one; Triton's kernel is "exact"
            only), "auto" skips one that does not, and naming it raises.
    """
    if op != "rotary":
        return _select_fused(name, q, cos, op, widest, spec)
    if torch.compiler.is_compiling():
        return _select(name, q, cos, numerics=numerics)
    # Only an explicit "triton" on CPU tensors depends on the environment (the interpreter switch).
    interpret = os.environ.get("TRITON_INTERPRET") if name == "triton" else None
    key = (name, q.device, q.dtype, cos.shape[-1], interpret, numerics)
    choice = _choices.get(key)
    if choice is None:
        skipped: list[str] = []
        choice = _choices[key] = (_select(name, q, cos, skipped, numerics), skipped)
    if choice[1] and log.isEnabledFor(logging.DEBUG):
        for line in choice[1]:
            log.debug("ropekit: backend %s", line)
    return choice[0]


def _select(
    name: str, q: torch.Tensor, cos: torch.Tensor, skipped: list[str] | None = None, numerics: str = "exact"
) -> Backend:
    """The backend for these inputs; for "auto", why each earlier candidate was skipped goes to skipped."""
    if name == "auto":
        for candidate in AUTO_ORDER:
            backend = BACKENDS[candidate]
            # A backend may refuse auto while still serving an explicit request (Triton's slow interpreter).
            reason = _numerics_reason(backend, numerics) or getattr(
                backend, "auto_skip_reason", backend.unavailable_reason
            )(q, cos)
            if reason is None:
                return backend
            if skipped is not None:  # never under compile: a logging call would break the graph
                skipped.append(f"{candidate!r} skipped: {reason}")
        return BACKENDS["torch"]
    if name not in BACKENDS:
        raise ValueError(f"backend: expected 'auto' or one of {sorted(BACKENDS)}, got {name!r}")
    backend = BACKENDS[name]
    reason = _numerics_reason(backend, numerics)
    if reason is not None:
        raise ValueError(f"backend: {name!r} cannot serve numerics={numerics!r}: {reason}")
    reason = backend.unavailable_reason(q, cos)
    if reason is not None:
        raise ValueError(f"backend: {name!r} cannot serve these inputs: {reason}")
    return backend


def _numerics_reason(backend: Backend, numerics: str) -> str | None:
    """None when backend computes in the arithmetic mode numerics, else why not."""
    served = served_numerics(backend)
    if numerics in served:
        return None
    others = [name for name, b in BACKENDS.items() if numerics in served_numerics(b)]
    return f"it computes numerics {list(served)} only; {numerics!r} is served by {others} (and 'auto')"


def _select_fused(name, q, cos, op: str, widest: int, spec) -> Backend:
    if type(name) is not str:
        raise ValueError(f"backend: expected a string, got {name!r}")
    backend = select_backend(name, q, cos)
    if not hasattr(backend, _LAUNCHES[op]):  # a registered backend without fused kernels
        if name == "auto":
            return BACKENDS["torch"]
        raise ValueError(
            f"backend: {backend.name!r} has no fused serving kernel (use 'torch', 'cpu' or 'triton')"
        )
    reason = backend.fused_unavailable_reason(op, widest=widest, spec=spec)
    if reason is None:
        return backend
    if name == "auto":
        return BACKENDS["torch"]
    raise ValueError(f"backend: {backend.name!r} {reason}")


def named_backend(name: object, op: str, device: torch.device | None = None) -> Backend:
    """The backend a registered op names (its ``str backend`` argument), which must run ``op``; with
    ``device`` (a registered op called directly), on that device (:func:`kernel_op.check_device`)."""
    backend = BACKENDS.get(name) if type(name) is str else None
    if backend is None or not hasattr(backend, _LAUNCHES[op]):
        raise ValueError(f"backend: expected one of {list(FUSED_BACKENDS)}, got {name!r}")
    if device is not None:
        check_device(backend, device)
    return backend
