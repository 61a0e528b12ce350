"""One description of a fused serving launch, checked once at the kernel wall, for the C loop and Triton.

Every serving fusion (RoPE + KV-cache write, RoPE + FP8, cache shift; :mod:`ropekit.fused`) is the same loop:
for each token, read its cos/sin row once, then run up to three *channels* over that token's heads:

* a channel reads a source head (``src``, a (batch, seq, heads, width) view; or, with ``src`` None, the
  destination itself, for an in-place shift), rotates its first ``2 * half`` features when ``rotate`` (the
  rest pass through), optionally divides by a scale and casts to FP8, and writes the head into ``dst``;
* ``dst`` is always a 4-D view (pages, page_size, heads, width): a cache in any layout ("flat" is pages of
  one slot, "hnd" a transposed view), or an output shaped like the input (pages = batch, page_size = seq).
  With ``by_slot`` the token's destination is ``slot_mapping[token]`` (-1: skip the token), else the token's
  own index; a flat slot s lands at page ``s // page_size``, index ``s % page_size``.

The q channel, the k channel (into the key cache) and the v channel (copied into the value cache) of
``apply_rotary_qk_and_cache`` are three channels; FP8 quantisation is two rotating channels with FP8
destinations; the shift is one in-place rotating channel. :func:`check_launch` is the kernel wall: the
kernels trust what it checked (shapes, strides, dtypes, devices), and check the values themselves (table
rows and slots: the C loop on the host before any write, Triton on the device, clamped, with a trap that
fails the launch).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ropekit.backends.kernel_op import MAX_HALF, MAX_WIDTH
from ropekit.validation import check_no_alias, check_writable, describe

__all__ = [
    "FP8_KINDS",
    "Channel",
    "FusedLaunch",
    "check_bounds",
    "check_launch",
    "check_scale_form",
    "fp8_kind",
    "slot_error",
]

# FP8 storage formats: the kernels' code for each (0 stores the source dtype).
FP8_KINDS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Channel(NamedTuple):
    """One tensor's pass through the fused loop (see the module docstring)."""

    src: torch.Tensor | None  # (batch, seq, heads, width), last stride 1; None: read dst in place
    dst: torch.Tensor  # (pages, page_size, heads, width), last stride 1; uint8 when fp8 is set
    rotate: bool  # rotate the first 2 * half features (the rest pass through)
    by_slot: bool  # address dst by slot_mapping[token] (-1 skips), else by the token's index
    fp8: int = 0  # 0: store src's dtype; else FP8_KINDS' code (dst holds the FP8 bytes as uint8)
    scale: torch.Tensor | None = None  # float32 (1,) or (heads,): stored = value / scale (FP8 only)


class FusedLaunch(NamedTuple):
    """A whole launch: the tokens, their table rows and slots, and the channels (q, k, v; None if absent)."""

    batch: int
    seq: int
    cos: torch.Tensor  # float32 (table_len, half), last stride 1
    sin: torch.Tensor
    positions: torch.Tensor | None  # contiguous int64 (batch * seq,), or None: rows offset + arange(seq)
    offset: int
    slots: torch.Tensor | None  # contiguous int64 (batch * seq,), needed when a channel is by_slot
    interleaved: bool
    conjugate: bool
    channels: tuple[Channel | None, Channel | None, Channel | None]

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype the kernels read (every channel's source, or in-place destination)."""
        for ch in self.channels:
            if ch is not None:
                return (ch.src if ch.src is not None else ch.dst).dtype
        raise ValueError("channels: expected at least one channel")


def fp8_kind(dtype: torch.dtype) -> int:
    """The kernels' code for an FP8 storage dtype, 0 for any other dtype."""
    return FP8_KINDS.get(dtype, 0)


def _fail(name: str, expected: str, got: str) -> None:
    raise ValueError(f"{name}: expected {expected}, got {got}")


def check_bounds(launch: FusedLaunch) -> None:
    """The kernels' fixed bounds: 1 <= half <= MAX_HALF and each channel's head width in [2 * half (when it
    rotates), MAX_WIDTH]. Part of :func:`check_launch`, and run on its own by the launchers when a fused op
    checked everything else (their ``checked=True`` path)."""
    half = launch.cos.shape[1]
    if not 1 <= half <= MAX_HALF:
        _fail("cos", f"1 <= rotary_dim // 2 <= {MAX_HALF}", f"width {half}")
    for name, ch in zip(("q", "k", "v"), launch.channels, strict=True):
        if ch is not None:
            width = ch.dst.shape[-1]
            if not 0 < width <= MAX_WIDTH or (ch.rotate and 2 * half > width):
                _fail(
                    f"{name} destination",
                    f"a head width in [2 * rotary_dim // 2, {MAX_WIDTH}] (wider heads: backend='torch')",
                    str(width),
                )


def check_launch(launch: FusedLaunch) -> None:
    """Everything the fused kernels rely on to stay inside their tensors; a ValueError naming the part if not.

    Values (table rows, slots) are not read here: each kernel checks them where they live.
    """
    tokens = launch.batch * launch.seq
    cos, sin = launch.cos, launch.sin
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 2:
            _fail(name, "a 2-D float32 tensor (table_len, rotary_dim // 2)", describe(t))
        if t.shape[1] > 1 and t.stride(1) != 1:
            _fail(name, "a last axis of stride 1", f"strides {t.stride()}")
    if sin.shape != cos.shape or sin.device != cos.device:
        _fail("sin", f"cos's shape {tuple(cos.shape)} on {cos.device}", f"{tuple(sin.shape)} on {sin.device}")
    device = cos.device
    for name, t in (("positions", launch.positions), ("slot_mapping", launch.slots)):
        if t is None:
            continue
        if t.dtype != torch.int64 or t.numel() != tokens or not t.is_contiguous() or t.device != device:
            _fail(name, f"a contiguous int64 tensor of {tokens} tokens on {device}", describe(t))
    if launch.positions is None and (type(launch.offset) is not int or not 0 <= launch.offset < 1 << 63):
        _fail("offset", "a non-negative int64 when positions is None", repr(launch.offset))
    dtype = launch.dtype
    if dtype not in KERNEL_DTYPES:
        _fail("q", f"a tensor of {[str(d) for d in KERNEL_DTYPES]}", str(dtype))
    for name, ch in zip(("q", "k", "v"), launch.channels, strict=True):
        if ch is not None:
            _check_channel(name, ch, launch, device, dtype)
    check_bounds(launch)
    _check_memory(launch)


def _check_memory(launch: FusedLaunch) -> None:
    """The memory rule (docs/safety.md): no destination shares memory with anything the launch reads or
    another destination, except a channel's destination that is its own source (in place)."""
    written, read = [], [("cos", launch.cos), ("sin", launch.sin), ("positions", launch.positions),
                         ("slot_mapping", launch.slots)]  # fmt: skip
    for name, ch in zip(("q", "k", "v"), launch.channels, strict=True):
        if ch is not None:
            in_place = ch.src is None or ch.src.data_ptr() == ch.dst.data_ptr()
            written.append((name if in_place else f"{name} destination", ch.dst))
            read += [(name, ch.dst if ch.src is None else ch.src), (f"{name} scale", ch.scale)]
    check_no_alias(tuple(written), tuple(read), optional=False)


def _check_channel(name: str, ch: Channel, launch: FusedLaunch, device, dtype) -> None:
    dst = ch.dst
    want_dst = torch.uint8 if ch.fp8 else dtype
    if not isinstance(dst, torch.Tensor) or dst.dim() != 4 or dst.dtype != want_dst or dst.device != device:
        _fail(f"{name} destination", f"a 4-D {want_dst} tensor on {device}", describe(dst))
    pages, page_size, heads, width = dst.shape
    if dst.stride(3) != 1 and width > 1:
        _fail(f"{name} destination", "a last axis of stride 1", f"strides {dst.stride()}")
    check_writable(f"{name} destination", dst)
    if ch.src is None:
        if ch.fp8 or (not ch.by_slot and pages * page_size != launch.batch * launch.seq):
            _fail(name, "a source tensor unless the channel rotates its destination in place by slot", "None")
    else:
        src = ch.src
        shape = (launch.batch, launch.seq, heads, width)
        if not isinstance(src, torch.Tensor) or tuple(src.shape) != shape or src.dtype != dtype:
            _fail(name, f"a {dtype} tensor of shape {shape}", describe(src))
        if src.device != device or (src.stride(3) != 1 and width > 1):
            _fail(name, f"a tensor on {device} with a last axis of stride 1", f"strides {src.stride()}")
    if not ch.by_slot and ch.src is not None and (pages, page_size) != (launch.batch, launch.seq):
        _fail(f"{name} destination", f"leading axes ({launch.batch}, {launch.seq})", str(tuple(dst.shape)))
    if ch.by_slot and launch.slots is None:
        _fail("slot_mapping", "a tensor when a channel writes by slot", "None")
    if ch.fp8:
        check_scale_form(f"{name} scale", ch.scale, heads, device)


def check_scale_form(name: str, scale: object, heads: int, device, hint: str = "") -> None:
    """A scale as the kernels read it (stored = value / scale): a contiguous float32 tensor of 1 or
    ``heads`` values on ``device``. The kernel wall's rule, and the registered ops' (through
    ``fused.checks.check_kernel_scale``, which adds ``hint``: the forms the public functions also take)."""
    if (
        not isinstance(scale, torch.Tensor)
        or scale.dtype != torch.float32
        or scale.dim() != 1
        or scale.shape[0] not in (1, heads)
        or not scale.is_contiguous()
        or scale.device != device
    ):
        _fail(name, f"a contiguous float32 tensor of 1 or {heads} values on {device}{hint}", describe(scale))


def slot_error(slot: int, num_slots: int, token: int | None = None) -> ValueError:
    """The error for a slot outside [-1, num_slots)."""
    where = "" if token is None else f" (token {token})"
    return ValueError(
        f"slot_mapping: slot {slot}{where} is outside the cache ({num_slots} slots); expected -1 (skip the "
        f"token) or 0 <= slot < num_slots"
    )
