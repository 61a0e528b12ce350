"""The fused serving launch in plain PyTorch: the readable reference the C loop and Triton kernel match.

It runs a :class:`~ropekit.backends.fused_launch.FusedLaunch` one channel at a time with ordinary tensor ops:
rotate the channel's source in float32 (float64 stays float64) with the torch backend's
:func:`~ropekit.backends.eager.rotary.rotate`, store it as the destination's dtype or as FP8
(``(r / scale).clamp(-fmax, fmax).to(fp8)``, the rounding contract), and scatter it to the destination at
the token's slot. Every value is computed before anything is written, so in-place channels read their inputs
intact. Works on any device and traces under torch.compile.
"""

from __future__ import annotations

import torch

from ropekit.backends.eager.rotary import rotate, table_rows
from ropekit.backends.fused_launch import FP8_KINDS, Channel, FusedLaunch, slot_error

__all__ = ["fp8_quantize", "launch"]

_FP8_DTYPES = {code: dtype for dtype, code in FP8_KINDS.items()}


def fp8_quantize(r: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """The rounding contract: ``(r / scale).clamp(-fmax, fmax).to(fp8_dtype)``.

    r: float32 (..., heads, width); scale: float32 (1,) or (heads,), broadcast over the heads.
    """
    fmax = torch.finfo(fp8_dtype).max
    return (r / scale[:, None]).clamp(-fmax, fmax).to(fp8_dtype)


def _values(ch: Channel, src: torch.Tensor, launch: FusedLaunch, rows: torch.Tensor) -> torch.Tensor:
    """The channel's stored values for src (tokens..., heads, width), in dst's dtype (FP8 as uint8)."""
    compute = torch.float64 if src.dtype == torch.float64 else torch.float32
    r = src.to(compute)
    if ch.rotate:
        r = rotate(
            r, launch.cos, launch.sin, rows, interleaved=launch.interleaved, conjugate=launch.conjugate,
            inplace=False,
        )  # fmt: skip
    if not ch.fp8:
        return r.to(src.dtype)
    return fp8_quantize(r.float(), ch.scale, _FP8_DTYPES[ch.fp8]).view(torch.uint8)


def launch(launch: FusedLaunch, *, checked: bool = False) -> None:
    """Run the launch with torch ops; ValueError for a table row or (host-checked) slot out of range.
    (checked: accepted for the launchers' common signature; torch ops check their own indexing.)"""
    batch, seq = launch.batch, launch.seq
    tokens = batch * seq
    rows = table_rows(
        None if launch.positions is None else launch.positions.view(batch, seq),
        launch.offset,
        torch.empty(batch, seq, 0, 0, device=launch.cos.device),
        launch.cos.shape[0],
    )  # (batch, seq): checked against the table
    slots = None if launch.slots is None else _checked_slots(launch)
    writes = []
    for ch in launch.channels:
        if ch is None:
            continue
        dst = ch.dst  # (pages, page_size, heads, width)
        page_size = dst.shape[1]
        if ch.src is None:  # in place: the sources are the destinations at the slots
            where = slots if ch.by_slot else torch.arange(tokens, device=dst.device).view(batch, seq)
            keep = where >= 0
            page, index = where[keep] // page_size, where[keep] % page_size
            src, token_rows = dst[page, index], rows[keep]  # (n, heads, width), (n,)
        elif ch.by_slot:
            keep = slots >= 0
            page, index = slots[keep] // page_size, slots[keep] % page_size
            src, token_rows = ch.src[keep], rows[keep]
        else:  # dst is shaped (batch, seq, heads, width) like src
            keep, page, index = None, None, None
            src, token_rows = ch.src, rows
        writes.append((dst, page, index, _values(ch, src, launch, token_rows)))
    for dst, page, index, values in writes:
        if page is None:
            dst.copy_(values)
        else:
            dst[page, index] = values


def _checked_slots(launch: FusedLaunch) -> torch.Tensor:
    """slot_mapping as (batch, seq), each in [-1, num_slots): checked on the host for CPU tensors, else with a
    device-side assert (the bad slots are then clamped, so indexing never leaves the cache)."""
    dst = next(ch.dst for ch in launch.channels if ch is not None and ch.by_slot)
    num_slots = dst.shape[0] * dst.shape[1]
    slots = launch.slots.view(launch.batch, launch.seq)
    if slots.device.type == "cpu" and not torch.compiler.is_compiling():
        if slots.numel():
            lo, hi = torch.stack(torch.aminmax(slots)).tolist()
            if lo < -1 or hi >= num_slots:
                raise slot_error(lo if lo < -1 else hi, num_slots)
        return slots
    inside = ((slots >= -1) & (slots < num_slots)).all()
    torch._assert_async(inside, "ropekit: a slot is outside the cache (slot_mapping >= num_slots)")
    return slots.clamp(-1, num_slots - 1)
