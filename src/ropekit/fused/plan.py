"""What the serving fusions share: cache layouts, scales, slots, the backend choice and the run.

Each public fused op checks its arguments once, here, and builds one
:class:`~ropekit.backends.fused_launch.FusedLaunch`; :func:`run` hands it to the torch reference, the C loop
or the Triton kernel and tells autograd which tensors were written (their version counters move, as after a
PyTorch in-place op). Every check runs before anything is written, so a call that raises leaves the caches
exactly as they were.

Cache layouts (docs/serving.md draws them); a flat slot s is page ``s // page_size``, index ``s % page_size``:
    "flat": (num_slots, heads, head_dim), one slot per row (pages of one slot);
    "nhd":  (num_pages, page_size, heads, head_dim), vLLM's and FlashInfer's paged layout;
    "hnd":  (num_pages, heads, page_size, head_dim), FlashInfer's head-major paged layout.
"""

from __future__ import annotations

import math
import numbers

import torch

from ropekit.backends import select_backend
from ropekit.backends.fused_launch import FP8_KINDS, FusedLaunch
from ropekit.validation import check_movable, check_writable, describe, is_compiling

__all__ = [
    "CACHE_LAYOUTS",
    "FUSED_BACKENDS",
    "cache_view",
    "check_inference",
    "check_scale",
    "check_slots",
    "run",
    "select",
]

CACHE_LAYOUTS = ("flat", "nhd", "hnd")
# The backends with a fused serving kernel (a registered third-party backend has none).
FUSED_BACKENDS = ("torch", "cpu", "triton")
_LAYOUT_SHAPES = {
    "flat": "(num_slots, heads, head_dim)",
    "nhd": "(num_pages, page_size, heads, head_dim)",
    "hnd": "(num_pages, heads, page_size, head_dim)",
}


def check_inference(op: str, **tensors: torch.Tensor | None) -> None:
    """The serving fusions are inference only: a cache write or an FP8 cast has no gradient to give."""
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if t is not None and t.requires_grad:
            raise ValueError(
                f"{name}: {op} is inference only (a cache write and an FP8 cast are not differentiable), got "
                f"a tensor that requires grad; call it under torch.no_grad() or torch.inference_mode(), or "
                f"pass {name}.detach()"
            )


def cache_view(
    name: str, cache: object, layout: object, heads: int, width: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """cache as a (pages, page_size, heads, width) view, checked: its layout, heads, width, dtype and device.

    dtype is the input dtype; an FP8 cache (FP8_KINDS) is accepted too and returned as its uint8 bytes.
    """
    if layout not in CACHE_LAYOUTS:
        raise ValueError(f"cache_layout: expected one of {list(CACHE_LAYOUTS)}, got {layout!r}")
    shape = _LAYOUT_SHAPES[layout]
    if not isinstance(cache, torch.Tensor) or cache.dim() != (3 if layout == "flat" else 4):
        raise ValueError(f"{name}: expected a {layout!r} cache {shape}, got {describe(cache)}")
    if layout == "flat":
        view = cache.unsqueeze(1)  # (num_slots, 1, heads, width)
    elif layout == "nhd":
        view = cache
    else:
        view = cache.transpose(1, 2)  # (num_pages, page_size, heads, width)
    if tuple(view.shape[2:]) != (heads, width):
        raise ValueError(
            f"{name}: expected a {layout!r} cache {shape} with heads = {heads} and head_dim = {width}, got "
            f"shape {tuple(cache.shape)}"
        )
    if cache.dtype != dtype and cache.dtype not in FP8_KINDS:
        allowed = [str(dtype), *(str(d) for d in FP8_KINDS)]
        raise ValueError(
            f"{name}: expected dtype in {allowed} (the input's, or FP8 with a scale), got {cache.dtype}"
        )
    if cache.device != device:
        raise ValueError(
            f"{name}: expected a tensor on the inputs' device {device}, got one on {cache.device}"
        )
    if width > 1 and cache.stride(-1) != 1:
        raise ValueError(
            f"{name}: expected a last axis of stride 1 (the cache is written in place), got strides "
            f"{cache.stride()}"
        )
    if cache.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name}: expected a cache that does not require grad (it is written in place)")
    check_writable(name, cache)
    return view.view(torch.uint8) if cache.dtype in FP8_KINDS else view


def check_scale(name: str, scale: object, heads: int, device: torch.device) -> torch.Tensor:
    """An FP8 scale (stored = value / scale): a number, a 0-d tensor or a (heads,) tensor. Every value is
    checked as the kernels divide by it, after its cast to float32: finite and > 0 there (1e-46 is 0 in
    float32, 1e300 is inf). Returns it as a contiguous float32 (1,) or (heads,) tensor on device. Values of a
    CUDA tensor are checked with a device-side assert (no host sync)."""
    expected = "a finite scale > 0 in float32 (stored = value / scale; the kernels divide in float32)"
    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        try:
            as_float32 = torch.tensor([float(scale)], dtype=torch.float32)  # (1,)
        except OverflowError:  # an int past float's range
            as_float32 = torch.tensor([math.inf], dtype=torch.float32)
        if not 0 < as_float32.item() < math.inf:
            raise ValueError(f"{name}: expected {expected}, got {scale!r} ({as_float32.item()!r} in float32)")
        return as_float32.to(device)
    if not isinstance(scale, torch.Tensor) or not scale.is_floating_point() or scale.dim() > 1:
        raise ValueError(
            f"{name}: expected a float, a 0-d float tensor or a ({heads},) per-head tensor, got "
            f"{describe(scale)}"
        )
    if scale.dim() == 1 and scale.shape[0] != heads:
        raise ValueError(
            f"{name}: expected a 0-d tensor or shape ({heads},) (one per head), got {tuple(scale.shape)}"
        )
    check_movable(name, scale, device, where="the inputs' device")
    out = scale.detach().reshape(-1).to(device=device, dtype=torch.float32).contiguous()
    ok = (out > 0) & (out < math.inf)
    if out.device.type == "cpu" and not is_compiling():
        if not bool(ok.all()):
            raise ValueError(
                f"{name}: expected every value {expected}, got {scale.tolist()} ({out.tolist()} in float32)"
            )
    else:
        torch._assert_async(ok.all(), f"ropekit: {name} must be finite and > 0 in float32")
    return out


def check_slots(name: str, slots: object, shape: tuple[int, ...], device) -> torch.Tensor:
    """slot_mapping: an int64 tensor of the given shape on device; returned flat and contiguous.

    Its values (each -1 or in [0, num_slots)) are checked once, by whichever launcher runs: the C loop and the
    torch reference on the host before any write, Triton on the host (interpreter) or the device."""
    if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64:
        raise ValueError(f"{name}: expected an int64 tensor (one flat slot per token), got {describe(slots)}")
    if tuple(slots.shape) != tuple(shape):
        raise ValueError(
            f"{name}: expected shape {tuple(shape)} (one slot per token), got {tuple(slots.shape)}"
        )
    if slots.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {slots.device}")
    return slots.reshape(-1).contiguous()


def select(backend: str, x: torch.Tensor, cos: torch.Tensor) -> str:
    """The backend name that runs a fused op on inputs like x: the dispatch's choice (it raises for an
    explicit backend that cannot serve x), then whether that backend has a fused kernel here."""
    if not isinstance(backend, str):
        raise ValueError(f"backend: expected a string, got {backend!r}")
    name = select_backend(backend, x, cos).name
    if name not in FUSED_BACKENDS:
        raise ValueError(f"backend: {name!r} has no fused serving kernel (use 'torch', 'cpu' or 'triton')")
    if name == "cpu":
        from ropekit.backends import fused_cpu

        reason = fused_cpu.unavailable_reason()
        if reason is not None:
            if backend == "auto":
                return "torch"
            raise ValueError(f"backend: 'cpu' cannot serve the fused op: {reason}")
    return name


def run(name: str, plan: FusedLaunch, written: list[torch.Tensor]) -> None:
    """Run plan on the named backend, then bump the version counter of every tensor written."""
    if name == "torch":
        from ropekit.backends.fused_eager import launch
    elif name == "cpu":
        from ropekit.backends.fused_cpu import launch
    else:
        from ropekit.backends.fused_triton import launch
    if name != "torch" and (plan.cos.dtype != torch.float32 or plan.cos.stride(-1) != 1):
        plan = plan._replace(cos=plan.cos.float().contiguous(), sin=plan.sin.float().contiguous())
    launch(plan, checked=True)  # the fused ops checked their arguments and built plan themselves
    if name != "torch":  # the torch reference writes through tensor ops, which bump the counters themselves
        live = [t for t in written if not t.is_inference()]
        if live:
            torch.autograd.graph.increment_version(live)
