"""The fused Triton RoPE kernel: q and k of one token in one program, cos/sin loaded once per token.

One program handles one token (one row of the resolved positions). It loads that token's cos/sin row once,
then rotates every q head and every k head with it, in tiles of ``BLOCK_H`` heads. Layout switches
(``INTERLEAVED``, ``CONJUGATE``, positions or an int offset, whether a tail must be copied) are compile-time
constants, so each combination compiles to straight-line code. Math runs in float32 whatever the storage
dtype, with no fused multiply-add (``enable_fp_fusion=False`` at every launch, as the C loop's
``-ffp-contract=off``), and each output is rounded once, to nearest even.

:func:`kernel_config` is the launcher's whole choice of specialization (constexprs and ``num_warps``) as a
pure function of the call's shape, so :func:`aot_specializations` can list every kernel the launcher can
launch and the tests compile each one ahead of time for sm_80 / sm_90 / sm_100 (``ropekit.tools.triton_aot``).

Importing this module imports Triton. Triton decides at decoration time whether ``@triton.jit`` compiles for
the GPU or runs in the interpreter, so ``TRITON_INTERPRET=1`` must be set before this module is imported.
"""

from __future__ import annotations

import itertools

import triton
import triton.language as tl

__all__ = [
    "COMPILE_OPTIONS",
    "OCCUPANCY_TARGET",
    "VECTORISED_ARGS",
    "aot_specializations",
    "kernel_config",
    "rotary_kernel",
    "signature",
]

# Passed at every launch and every ahead-of-time compile.
# enable_fp_fusion: no a * c - b * s contracted into an FMA, so the float32 result, hence the rounded output,
#   is the C loop's and the torch backend's bit for bit. Explicit, because Triton's default
#   (TRITON_DEFAULT_FP_FUSION) flips to off in 3.10.
# maxnreg: see OCCUPANCY_TARGET.
COMPILE_OPTIONS = {"enable_fp_fusion": False, "maxnreg": 48}
# Full occupancy (2,048 threads an SM) allows 32 registers a thread. A tile keeps one 16-byte vector of each
# pair half (8 fp16/bf16 values -> 16 float32) and the token's cos/sin (16 float32, held across the head
# loop): ptxas wants 32-44 registers on sm_80 / sm_90 and up to 48 on sm_100. Capped at 32 it spills 8-350
# bytes a thread (at 40, sm_100 still spills 16); 8-byte vectors would fit 32 but lose the 128-bit accesses.
# So the cap is 48: at least 42 of 64 warps an SM resident (66%), 32 bytes in flight a thread, over 40 KB an
# SM, above the ~15 KB that H100's bandwidth x latency needs. The AOT check holds every specialization to
# ropekit.tools.ptx_check.register_budget(num_warps, OCCUPANCY_TARGET) = 48 and to no spills.
OCCUPANCY_TARGET = 0.625
# The pointers whose every global load and store must be 128-bit when they are 16-byte aligned.
VECTORISED_ARGS = ("q_ptr", "k_ptr", "q_out_ptr", "k_out_ptr")

# Bytes of one vectorised global load or store (ld.global.v4.b32): each thread holds one such vector of a and
# one of b per tile.
VECTOR_BYTES = 16
# Heads per tile when the head is narrow enough (most models' head counts are multiples of 8).
TARGET_HEADS = 8
MIN_WARPS, MAX_WARPS = 2, 8

_ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def kernel_config(
    dtype: str,
    half: int,
    tail: int,
    *,
    interleaved: bool,
    conjugate: bool,
    has_pos: bool,
    copy_tail: bool,
    interpret: bool = False,
) -> tuple[dict[str, object], int]:
    """The constexprs and ``num_warps`` the launcher passes for one call; a pure function of its arguments.

    Args:
        dtype: the storage dtype as Triton names it: "fp32", "fp16" or "bf16".
        half: rotary_dim // 2 (the width of the cos/sin table); tail: head_dim - rotary_dim.
        interleaved, conjugate, has_pos: the pair layout, the backward rotation, a positions tensor.
        copy_tail: whether the tail is copied (an out-of-place partial rotary).
        interpret: Triton's interpreter runs the kernel: its float -> bfloat16 cast truncates, so the bf16
            store rounds in integer arithmetic there instead (never in compiled code, where the hardware
            conversion cvt.rn rounds to nearest even).

    A tile is ``BLOCK_H`` heads by ``BLOCK_HALF`` pairs, sized so that each of ``num_warps * 32`` threads
    holds one 16-byte vector of each pair half: ``BLOCK_H * BLOCK_HALF = num_warps * 32 * vector``.
    """
    vector = VECTOR_BYTES // _ELEMENT_BYTES[dtype]  # elements per 16-byte load
    block_half = _next_pow2(half)
    warps = min(MAX_WARPS, max(MIN_WARPS, TARGET_HEADS * block_half // (32 * vector)))
    block_h = max(1, warps * 32 * vector // block_half)
    constexprs = {
        "HALF": half,
        "TAIL": tail,
        "BLOCK_HALF": block_half,
        "BLOCK_TAIL": _next_pow2(max(tail, 1)),
        "TAIL_CHUNK": min(_next_pow2(max(tail, 1)), block_half),
        "BLOCK_H": block_h,
        "HAS_POS": has_pos,
        "INTERLEAVED": interleaved,
        "CONJUGATE": conjugate,
        "COPY_TAIL": copy_tail and tail > 0,
        "ROUND_BF16_IN_INTEGERS": interpret and dtype == "bf16",
    }
    return constexprs, warps


_INT_ARGS = ("table_len", "seq_len", "q_heads", "k_heads")
_STRIDES = (*(f"{t}_stride_{a}" for t in ("q", "k", "qo", "ko") for a in "bsh"), "cos_stride", "sin_stride")


def signature(dtype: str, head_dim: int, half: int, constexprs: dict[str, object]) -> dict[str, str]:
    """The kernel's signature for contiguous (batch, seq, heads, head_dim) tensors and a contiguous table,
    in Triton's ahead-of-time notation: ``:16`` marks an argument the JIT specializes as divisible by 16
    (torch allocations are; a stride is when its value is), which is what lets the compiler vectorise."""
    sig = {name: f"*{dtype}:16" for name in ("q_ptr", "k_ptr", "q_out_ptr", "k_out_ptr")}
    sig |= {"cos_ptr": "*fp32:16", "sin_ptr": "*fp32:16", "pos_ptr": "*i64:16", "flag_ptr": "*i32:16"}
    sig["offset"] = "i64"
    sig |= dict.fromkeys(_INT_ARGS, "i32")
    # Strides of a contiguous tensor: head_dim (per head), heads * head_dim (per token), ... all multiples
    # of head_dim; the table's row stride is half.
    sig |= {name: "i32:16" if head_dim % 16 == 0 else "i32" for name in _STRIDES[:-2]}
    sig |= dict.fromkeys(_STRIDES[-2:], "i32:16" if half % 16 == 0 else "i32")
    return sig | dict.fromkeys(constexprs, "constexpr")


# head_dim -> the partial rotary_dim compiled for it (Phi-2: 32 of 80; GPT-J: 64 of 256; half otherwise).
PARTIAL_ROTARY = {64: 32, 80: 32, 128: 64, 256: 64}


def aot_specializations():
    """Every (kernel, signature, constexprs, num_warps) the launcher picks for head_dim 64, 80, 128 and 256,
    full and partial rotary (tail copied or in place), each dtype, pair layout, direction and position kind.

    Forward and backward are the same kernel; the backward pass is ``CONJUGATE=True``.
    """
    grid = itertools.product(
        ("fp32", "fp16", "bf16"), PARTIAL_ROTARY, ("full", "copy", "inplace"), *[(False, True)] * 3
    )
    for dtype, head_dim, rotary, interleaved, conjugate, has_pos in grid:
        rotary_dim = head_dim if rotary == "full" else PARTIAL_ROTARY[head_dim]
        half, tail = rotary_dim // 2, head_dim - rotary_dim
        constexprs, warps = kernel_config(
            dtype,
            half,
            tail,
            interleaved=interleaved,
            conjugate=conjugate,
            has_pos=has_pos,
            copy_tail=rotary == "copy",
        )
        yield rotary_kernel, signature(dtype, head_dim, half, constexprs), constexprs, warps


@triton.jit
def _bf16_round_to_nearest_even(x):
    """float32 -> bfloat16, rounding to nearest even, in integer arithmetic (the C loop's bf16_store).

    Only for Triton's interpreter, whose float -> bfloat16 cast truncates; compiled code uses the hardware
    conversion (cvt.rn.bf16.f32), which rounds to nearest even. NaN stays a quiet NaN."""
    u = x.to(tl.uint32, bitcast=True)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    top = tl.where(nan, (u >> 16) | 0x40, (u + 0x7FFF + ((u >> 16) & 1)) >> 16)
    return top.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _store_rounded(ptr, value, mask, ROUND_BF16_IN_INTEGERS: tl.constexpr):
    """Store float32 ``value`` in ``ptr``'s dtype, rounded once to nearest even."""
    if ROUND_BF16_IN_INTEGERS:
        tl.store(ptr, _bf16_round_to_nearest_even(value), mask=mask)
    else:
        tl.store(ptr, value.to(ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit
def _token_row(pos_ptr, offset, seq_len, table_len, flag_ptr, HAS_POS: tl.constexpr):
    """This program's token (``program_id(0)``), its batch row b and index t in the sequence, and its table
    row: ``positions[token]`` (HAS_POS) or ``offset + t``. A row outside [0, table_len) clears ``flag`` and
    reads row 0 instead, so no kernel reads outside the table and its launcher can fail the call."""
    token = tl.program_id(0).to(tl.int64)
    b = token // seq_len
    t = token % seq_len
    if HAS_POS:
        pos = tl.load(pos_ptr + token)
    else:
        pos = offset + t
    bad = (pos < 0) | (pos >= table_len)
    tl.store(flag_ptr, 0, mask=bad)
    return token, b, t, tl.where(bad, 0, pos)


@triton.jit
def _rotate_heads(
    x_ptr,
    out_ptr,
    x_stride_h,
    out_stride_h,
    n_heads,
    c,
    s,
    HALF: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    TAIL_CHUNK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    COPY_TAIL: tl.constexpr,
    ROUND_BF16_IN_INTEGERS: tl.constexpr,
):
    """Rotate n_heads heads of one token; x_ptr/out_ptr point at head 0, feature 0 of that token.

    c, s: (1, BLOCK_HALF) float32. Each tile is read with contiguous, 16-byte aligned vectors: in the
    half layout the two halves are two contiguous runs; in the interleaved layout the whole rotary part is
    read as one run and split into its even and odd lanes in registers (a stride-2 load would not vectorise).
    """
    pair = tl.arange(0, BLOCK_HALF)
    for h0 in range(0, n_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        head_ok = (heads < n_heads)[:, None]
        x_row = x_ptr + heads[:, None] * x_stride_h  # (BLOCK_H, 1)
        out_row = out_ptr + heads[:, None] * out_stride_h
        if INTERLEAVED:  # pair i sits at (2i, 2i+1): GPT-J / Meta
            lane = tl.arange(0, 2 * BLOCK_HALF)
            mask = head_ok & (lane < 2 * HALF)[None, :]  # (BLOCK_H, 2 * BLOCK_HALF)
            x = tl.load(x_row + lane[None, :], mask=mask, other=0.0).to(tl.float32)
            a, b = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_HALF, 2)))
            ra = a * c - b * s
            rb = b * c + a * s
            y = tl.reshape(tl.join(ra, rb), (BLOCK_H, 2 * BLOCK_HALF))
            _store_rounded(out_row + lane[None, :], y, mask, ROUND_BF16_IN_INTEGERS)
        else:  # pair i sits at (i, i + R/2): GPT-NeoX / HF
            mask = head_ok & (pair < HALF)[None, :]  # (BLOCK_H, BLOCK_HALF)
            a = tl.load(x_row + pair[None, :], mask=mask, other=0.0).to(tl.float32)
            b = tl.load(x_row + HALF + pair[None, :], mask=mask, other=0.0).to(tl.float32)
            _store_rounded(out_row + pair[None, :], a * c - b * s, mask, ROUND_BF16_IN_INTEGERS)
            _store_rounded(out_row + HALF + pair[None, :], b * c + a * s, mask, ROUND_BF16_IN_INTEGERS)
        if COPY_TAIL:  # in chunks of TAIL_CHUNK columns: one 16-byte vector a thread, like the pairs
            for j in tl.static_range(0, BLOCK_TAIL, TAIL_CHUNK):
                tail = 2 * HALF + j + tl.arange(0, TAIL_CHUNK)
                tmask = head_ok & (tail < 2 * HALF + TAIL)[None, :]  # (BLOCK_H, TAIL_CHUNK)
                tl.store(out_row + tail[None, :], tl.load(x_row + tail[None, :], mask=tmask), mask=tmask)


@triton.jit(do_not_specialize=["offset", "table_len", "seq_len", "q_heads", "k_heads"])
def rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    flag_ptr,
    offset,
    table_len,
    seq_len,
    q_heads,
    k_heads,
    q_stride_b,
    q_stride_s,
    q_stride_h,
    k_stride_b,
    k_stride_s,
    k_stride_h,
    qo_stride_b,
    qo_stride_s,
    qo_stride_h,
    ko_stride_b,
    ko_stride_s,
    ko_stride_h,
    cos_stride,
    sin_stride,
    HALF: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    TAIL_CHUNK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_POS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    CONJUGATE: tl.constexpr,
    COPY_TAIL: tl.constexpr,
    ROUND_BF16_IN_INTEGERS: tl.constexpr,
):
    """Rotate token ``program_id(0)`` of q (and k: ``k_heads`` is 0 without one); leading axes are
    (batch, seq), the last has stride 1.

    The token's table row is ``positions[token]`` (HAS_POS) or ``offset + t``. Whichever it is, a row
    outside [0, table_len) clears ``flag`` and reads row 0 instead, so the kernel never reads outside the
    table and the launcher can fail the call (see :func:`ropekit.backends.triton.launch`).
    """
    _, b, t, pos = _token_row(pos_ptr, offset, seq_len, table_len, flag_ptr, HAS_POS)

    pair = tl.arange(0, BLOCK_HALF)
    c = tl.load(cos_ptr + pos * cos_stride + pair, mask=pair < HALF, other=0.0)[None, :]  # (1, BLOCK_HALF)
    s = tl.load(sin_ptr + pos * sin_stride + pair, mask=pair < HALF, other=0.0)[None, :]
    if CONJUGATE:
        s = -s  # R(-theta) = R(theta)^T: the backward pass

    _rotate_heads(
        q_ptr + b * q_stride_b + t * q_stride_s,
        q_out_ptr + b * qo_stride_b + t * qo_stride_s,
        q_stride_h,
        qo_stride_h,
        q_heads,
        c,
        s,
        HALF,
        TAIL,
        BLOCK_HALF,
        BLOCK_TAIL,
        TAIL_CHUNK,
        BLOCK_H,
        INTERLEAVED,
        COPY_TAIL,
        ROUND_BF16_IN_INTEGERS,
    )
    _rotate_heads(
        k_ptr + b * k_stride_b + t * k_stride_s,
        k_out_ptr + b * ko_stride_b + t * ko_stride_s,
        k_stride_h,
        ko_stride_h,
        k_heads,
        c,
        s,
        HALF,
        TAIL,
        BLOCK_HALF,
        BLOCK_TAIL,
        TAIL_CHUNK,
        BLOCK_H,
        INTERLEAVED,
        COPY_TAIL,
        ROUND_BF16_IN_INTEGERS,
    )
