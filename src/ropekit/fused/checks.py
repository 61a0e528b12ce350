"""The checks the serving fusions share: cache layouts, scales, slots, inference only.

Each public fused op checks its arguments once, with these, and builds one
:class:`~ropekit.backends.fused_launch.FusedLaunch`, which the backend chosen by
:func:`ropekit.backends.select_backend` runs (``launch_fused``). Every check runs before anything is written,
so a call that raises leaves the caches exactly as they were.

Cache layouts (docs/serving.md draws them); a flat slot s is page ``s // page_size``, index ``s % page_size``:
    "flat": (num_slots, heads, head_dim), one slot per row (pages of one slot);
    "nhd":  (num_pages, page_size, heads, head_dim), vLLM's and FlashInfer's paged layout;
    "hnd":  (num_pages, heads, page_size, head_dim), FlashInfer's head-major paged layout.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from ropekit.backends.fused_launch import FP8_KINDS, check_scale_form, fp8_kind
from ropekit.validation import check_in_place_allowed, check_movable, check_writable, describe, is_compiling

__all__ = [
    "CACHE_LAYOUTS",
    "cache_takes_scale",
    "cache_view",
    "check_distinct_slots",
    "check_inference",
    "check_kernel_scale",
    "check_scale",
    "check_scale_values",
    "check_slots",
    "paged_view",
    "pages",
]

CACHE_LAYOUTS = ("flat", "nhd", "hnd")
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
    view = paged_view(name, cache, layout)
    shape = _LAYOUT_SHAPES[layout]
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
    check_in_place_allowed(name, cache)
    check_writable(name, cache)
    return view.view(torch.uint8) if cache.dtype in FP8_KINDS else view


def paged_view(name: str, cache: object, layout: object) -> torch.Tensor:
    """cache in any layout as a (pages, page_size, heads, width) view (the kernels' one form); a ValueError
    for an unknown layout or a cache of the wrong rank. Nothing else is checked here (see cache_view)."""
    if layout not in CACHE_LAYOUTS:
        raise ValueError(f"cache_layout: expected one of {list(CACHE_LAYOUTS)}, got {layout!r}")
    if not isinstance(cache, torch.Tensor) or cache.dim() != (3 if layout == "flat" else 4):
        shape = _LAYOUT_SHAPES[layout]
        raise ValueError(f"{name}: expected a {layout!r} cache {shape}, got {describe(cache)}")
    return pages(cache, layout)


def pages(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """:func:`paged_view` of a cache checked already (a fused op's launch after its public call)."""
    if layout == "flat":
        return cache.unsqueeze(1)  # (num_slots, 1, heads, width)
    if layout == "nhd":
        return cache
    return cache.transpose(1, 2)  # (num_pages, page_size, heads, width)


_EXPECTED_SCALE = "a finite scale > 0 in float32 (stored = value / scale; the kernels divide in float32)"


def check_scale(name: str, scale: object, heads: int, device: torch.device) -> torch.Tensor:
    """An FP8 scale (stored = value / scale): a number, a 0-d tensor or a (heads,) tensor. Every value is
    checked as the kernels divide by it, after its cast to float32: finite and > 0 there (1e-46 is 0 in
    float32, 1e300 is inf). Returns it as a contiguous float32 (1,) or (heads,) tensor on device. Values of a
    CUDA tensor are checked with a device-side assert (no host sync)."""
    expected = _EXPECTED_SCALE
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
    check_scale_values(name, out, scale)
    return out


def check_kernel_scale(name: str, scale: object, heads: int, device: torch.device) -> None:
    """A scale as a registered op takes it (what :func:`check_scale` makes of the function's argument): a
    contiguous float32 tensor of 1 or ``heads`` values on ``device``, each finite and > 0. The registered ops'
    own callers reach every backend through this, the torch backend included, which has no kernel wall."""
    hint = " (the registered op's form of a scale; the function also takes a number or a 0-d tensor)"
    check_scale_form(name, scale, heads, device, hint)
    check_scale_values(name, scale)


def check_scale_values(name: str, scale: torch.Tensor, given: torch.Tensor | None = None) -> None:
    """Every value of a scale as the kernels use it (float32: :func:`check_scale`'s result, or the tensor a
    registered op is given) finite and > 0; ``given`` is the caller's tensor, for the message. On the host
    for CPU tensors, a device-side assert otherwise (no host sync)."""
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        return  # not a kernel's scale: the launcher's wall names it
    ok = (scale > 0) & (scale < math.inf)
    if scale.device.type == "cpu" and not is_compiling():
        if not bool(ok.all()):
            given = scale if given is None else given
            raise ValueError(
                f"{name}: expected every value {_EXPECTED_SCALE}, got {given.tolist()} ({scale.tolist()} in "
                f"float32)"
            )
    else:
        torch._assert_async(ok.all(), f"ropekit: {name} must be finite and > 0 in float32")


def cache_takes_scale(name: str, cache: torch.Tensor, scale: object) -> bool:
    """Whether a cache is FP8 and so takes its scale (k_scale / v_scale): a scale is required for an FP8
    cache and refused for any other (it would be ignored). The one rule for apply_rotary_qk_and_cache and
    its registered ops."""
    if fp8_kind(cache.dtype):
        if scale is None:
            raise ValueError(f"{name}: expected a scale for the {cache.dtype} cache, got None")
        return True
    if scale is not None:
        raise ValueError(
            f"{name}: expected None for a {cache.dtype} cache (scales are for FP8), got {describe(scale)}"
        )
    return False


def check_slots(name: str, slots: object, shape: tuple[int, ...], device) -> torch.Tensor:
    """slot_mapping: an int64 tensor of the given shape on device, no slot twice; returned flat, contiguous.

    Its range (each -1 or in [0, num_slots)) is checked once, by whichever launcher runs: the C loop and the
    torch reference on the host before any write, Triton on the host (interpreter) or the device. Distinct
    slots are checked here, where the data lives (:func:`check_distinct_slots`)."""
    if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64:
        raise ValueError(f"{name}: expected an int64 tensor (one flat slot per token), got {describe(slots)}")
    if tuple(slots.shape) != tuple(shape):
        raise ValueError(
            f"{name}: expected shape {tuple(shape)} (one slot per token), got {tuple(slots.shape)}"
        )
    if slots.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {slots.device}")
    flat = slots.reshape(-1).contiguous()
    check_distinct_slots(name, flat)
    return flat


def check_distinct_slots(name: str, flat: torch.Tensor) -> None:
    """No slot twice among the tokens' real slots (-1, a skipped token, may repeat): two tokens written to one
    slot race on a multi-threaded loop or a GPU, and rotating one cached key twice (shift_cache_) is never
    meant. On the host for CPU tensors (a ValueError naming the slot and two tokens); on the device otherwise
    (a device-side assert, no host sync). Checked before anything is written."""
    if flat.numel() < 2:
        return
    if flat.device.type != "cpu" or is_compiling():
        ordered = flat.sort().values  # (n,): equal slots are neighbours
        repeated = (ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)
        torch._assert_async(~repeated.any(), f"ropekit: {name} holds a slot twice (slots must be distinct)")
        return
    ordered = np.sort(flat.numpy())  # the host's data, no copy; NumPy costs less per call than torch here
    repeated = (ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)
    if repeated.any():
        slot = int(ordered[1:][repeated][0])
        first, second = (flat == slot).nonzero().flatten()[:2].tolist()
        raise ValueError(
            f"{name}: slot {slot} is given twice (tokens {first} and {second}); expected distinct slots (-1, "
            f"a skipped token, may repeat): two writes to one slot race on a parallel backend"
        )
