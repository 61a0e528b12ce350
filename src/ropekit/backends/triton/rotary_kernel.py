"""The fused Triton RoPE kernel: q and k in one launch, tiled over tokens and heads.

The grid is (token blocks, head blocks): a program rotates ``BLOCK_T`` tokens by ``BLOCK_H`` heads (of q, or
of k: the head blocks of q come first, then k's), with the tokens' cos/sin rows loaded once for the tile.
Decode (a few tokens) uses one token a program; prefill ``BLOCK_T`` tokens, with more warps, so that a thread
holds the same elements (:func:`kernel_config`). Each token's table row is computed in the kernel
(``ROWS``): ``offset + t`` for an int offset, ``offsets[b] + t`` for per-sequence offsets,
``positions[token]``, or, for a packed batch, ``t - cu_seqlens[s] + offset`` (or ``+ offsets[s]``) with each
token's sequence ``s`` found by a binary search over cu_seqlens; no positions tensor is built for any offset
form. Layout switches (``INTERLEAVED``,
``CONJUGATE``, the row form, whether a tail must be copied) are compile-time constants, so each combination
compiles to straight-line code. Math runs in float32 whatever the storage
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
from triton.runtime.interpreter import InterpretedFunction

__all__ = [
    "COMPILE_OPTIONS",
    "INTERPRETED",
    "OCCUPANCY_TARGET",
    "VECTORISED_ARGS",
    "aot_specializations",
    "flag_bad",
    "grid",
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
# From this many tokens a launch is a prefill: a program takes several tokens (BLOCK_T) with MAX_WARPS warps,
# the same elements a thread as a decode program, and a quarter (or fewer) of the programs. Below it (decode,
# short chunks) one token a program keeps the grid small and every program busy.
PREFILL_TOKENS = 256

# How a token's table row is found (the ROWS constexpr): offset + t (an int offset), positions[token] (a
# positions tensor, one row a token), offsets[b] + t (a tensor of per-sequence offsets, one a batch row),
# t - cu_seqlens[s] + offset (+ offsets[s] when an offsets tensor is given: a runtime switch, not one more
# specialization) for a packed batch, s the token's sequence.
ROWS_OFFSET, ROWS_POSITIONS, ROWS_SEQ_OFFSETS, ROWS_CU_SEQLENS = 0, 1, 2, 3

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
    rows: int,
    copy_tail: bool,
    prefill: bool = False,
    interpret: bool = False,
) -> tuple[dict[str, object], int]:
    """The constexprs and ``num_warps`` the launcher passes for one call; a pure function of its arguments.

    Args:
        dtype: the storage dtype as Triton names it: "fp32", "fp16" or "bf16".
        half: rotary_dim // 2 (the width of the cos/sin table); tail: head_dim - rotary_dim.
        interleaved, conjugate: the pair layout, the backward rotation.
        rows: how a token's table row is found: ROWS_OFFSET, ROWS_POSITIONS, ROWS_SEQ_OFFSETS or
            ROWS_CU_SEQLENS.
        copy_tail: whether the tail is copied (an out-of-place partial rotary).
        prefill: at least PREFILL_TOKENS tokens: BLOCK_T tokens a program (see PREFILL_TOKENS).
        interpret: Triton's interpreter runs the kernel: its float -> bfloat16 cast truncates, so the bf16
            store rounds in integer arithmetic there instead (never in compiled code, where the hardware
            conversion cvt.rn rounds to nearest even); and a bad row clears a flag the launcher reads on the
            host instead of trapping (TRAP_BAD_ROWS).

    A tile is ``BLOCK_T`` tokens by ``BLOCK_H`` heads by ``BLOCK_HALF`` pairs, sized so that each of
    ``num_warps * 32`` threads holds one 16-byte vector of each pair half:
    ``BLOCK_T * BLOCK_H * BLOCK_HALF = num_warps * 32 * vector``.
    """
    vector = VECTOR_BYTES // _ELEMENT_BYTES[dtype]  # elements per 16-byte load
    block_half = _next_pow2(half)
    warps = min(MAX_WARPS, max(MIN_WARPS, TARGET_HEADS * block_half // (32 * vector)))
    block_h = max(1, warps * 32 * vector // block_half)
    block_t = MAX_WARPS // warps if prefill else 1
    constexprs = {
        "HALF": half,
        "TAIL": tail,
        "BLOCK_HALF": block_half,
        "BLOCK_TAIL": _next_pow2(max(tail, 1)),
        "TAIL_CHUNK": min(_next_pow2(max(tail, 1)), block_half),
        "BLOCK_T": block_t,
        "BLOCK_H": block_h,
        "ROWS": rows,
        "INTERLEAVED": interleaved,
        "CONJUGATE": conjugate,
        "COPY_TAIL": copy_tail and tail > 0,
        "ROUND_BF16_IN_INTEGERS": interpret and dtype == "bf16",
        "TRAP_BAD_ROWS": not interpret,
    }
    return constexprs, warps * block_t


def grid(tokens: int, q_heads: int, k_heads: int, constexprs: dict[str, object]) -> tuple[int, int]:
    """(token blocks, head blocks: q's then k's) for one launch."""
    block_t, block_h = constexprs["BLOCK_T"], constexprs["BLOCK_H"]
    return -(-tokens // block_t), -(-q_heads // block_h) + -(-k_heads // block_h)


_INT_ARGS = ("table_len", "tokens", "seq_len", "q_heads", "k_heads", "n_seqs", "search_steps")
_STRIDES = (*(f"{t}_stride_{a}" for t in ("q", "k", "qo", "ko") for a in "bsh"), "cos_stride", "sin_stride")


def signature(
    dtype: str, head_dim: int, half: int, constexprs: dict[str, object], rows_dtype: str = "i64"
) -> dict[str, str]:
    """The kernel's signature for contiguous (batch, seq, heads, head_dim) tensors and a contiguous table,
    in Triton's ahead-of-time notation: ``:16`` marks an argument the JIT specializes as divisible by 16
    (torch allocations are; a stride is when its value is), which is what lets the compiler vectorise.
    ``rows_dtype``: what rows_ptr points at, "i64", or "i32" for int32 cu_seqlens (ROWS_CU_SEQLENS)."""
    sig = {name: f"*{dtype}:16" for name in ("q_ptr", "k_ptr", "q_out_ptr", "k_out_ptr")}
    sig |= {"cos_ptr": "*fp32:16", "sin_ptr": "*fp32:16", "rows_ptr": f"*{rows_dtype}:16"}
    sig |= {"offsets_ptr": "*i64:16", "flag_ptr": "*i32:16"}
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
    full and partial rotary (tail copied or in place), each dtype, pair layout, direction, row form (a packed
    batch's cu_seqlens int32 or int64: two pointer types) and grid (decode: one token a program; prefill:
    BLOCK_T tokens).

    Forward and backward are the same kernel; the backward pass is ``CONJUGATE=True``.
    """
    grid = itertools.product(
        ("fp32", "fp16", "bf16"),
        PARTIAL_ROTARY,
        ("full", "copy", "inplace"),
        (False, True),
        (False, True),
        (
            (ROWS_OFFSET, "i64"),
            (ROWS_POSITIONS, "i64"),
            (ROWS_SEQ_OFFSETS, "i64"),
            (ROWS_CU_SEQLENS, "i32"),  # what rows_ptr points at: a packed batch's cu_seqlens, either dtype
            (ROWS_CU_SEQLENS, "i64"),
        ),
        (False, True),
    )
    for dtype, head_dim, rotary, interleaved, conjugate, (rows, rows_dtype), prefill in grid:
        rotary_dim = head_dim if rotary == "full" else PARTIAL_ROTARY[head_dim]
        half, tail = rotary_dim // 2, head_dim - rotary_dim
        constexprs, warps = kernel_config(
            dtype,
            half,
            tail,
            interleaved=interleaved,
            conjugate=conjugate,
            rows=rows,
            copy_tail=rotary == "copy",
            prefill=prefill,
        )
        if prefill and constexprs["BLOCK_T"] == 1:  # a wide head's decode tile already has MAX_WARPS warps
            continue
        yield rotary_kernel, signature(dtype, head_dim, half, constexprs, rows_dtype), constexprs, warps


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
def flag_bad(bad, flag_ptr, TRAP: tl.constexpr):
    """A value out of range (``bad``, any shape) fails the launch; the caller has clamped it already, so
    nothing was read outside a tensor.

    Compiled (TRAP): a thread that holds a bad value executes ``trap``, which aborts the kernel; the CUDA
    error surfaces at the next synchronising call on the device (as a device-side assert does) and the
    context is lost, so no later call can read a result. No separate assert kernel runs per launch. Under the
    interpreter: ``flag`` is cleared and the launcher raises on the host when the kernel returns."""
    if TRAP:
        tl.inline_asm_elementwise(
            "{ .reg .pred %p; setp.ne.s32 %p, $1, 0; @%p trap; mov.b32 $0, 0; }",
            "=r,r",
            [bad.to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        tl.store(flag_ptr + tl.zeros_like(bad.to(tl.int32)), 0, mask=bad)


@triton.jit
def _rotate_tile(
    x,
    out,
    x_stride_h,
    out_stride_h,
    h0,
    n_heads,
    token_ok,
    c,
    s,
    HALF: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    TAIL_CHUNK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    COPY_TAIL: tl.constexpr,
    ROUND_BF16_IN_INTEGERS: tl.constexpr,
):
    """Rotate heads h0 .. h0 + BLOCK_H of BLOCK_T tokens; x, out: (BLOCK_T,) pointers at each token's head 0.

    c, s: (BLOCK_T, 1, BLOCK_HALF) float32. Each tile is read with contiguous, 16-byte aligned vectors: in the
    half layout the two halves are two contiguous runs; in the interleaved layout the whole rotary part is
    read as one run and split into its even and odd lanes in registers (a stride-2 load would not vectorise).
    """
    pair = tl.arange(0, BLOCK_HALF)
    heads = h0 + tl.arange(0, BLOCK_H)
    ok = token_ok[:, None, None] & (heads < n_heads)[None, :, None]  # (BLOCK_T, BLOCK_H, 1)
    x_row = x[:, None, None] + heads[None, :, None] * x_stride_h  # (BLOCK_T, BLOCK_H, 1)
    out_row = out[:, None, None] + heads[None, :, None] * out_stride_h
    if INTERLEAVED:  # pair i sits at (2i, 2i+1): GPT-J / Meta
        lane = tl.arange(0, 2 * BLOCK_HALF)
        mask = ok & (lane < 2 * HALF)[None, None, :]  # (BLOCK_T, BLOCK_H, 2 * BLOCK_HALF)
        v = tl.load(x_row + lane[None, None, :], mask=mask, other=0.0).to(tl.float32)
        a, b = tl.split(tl.reshape(v, (BLOCK_T, BLOCK_H, BLOCK_HALF, 2)))
        y = tl.reshape(tl.join(a * c - b * s, b * c + a * s), (BLOCK_T, BLOCK_H, 2 * BLOCK_HALF))
        _store_rounded(out_row + lane[None, None, :], y, mask, ROUND_BF16_IN_INTEGERS)
    else:  # pair i sits at (i, i + R/2): GPT-NeoX / HF: two contiguous runs
        mask = ok & (pair < HALF)[None, None, :]  # (BLOCK_T, BLOCK_H, BLOCK_HALF)
        a = tl.load(x_row + pair[None, None, :], mask=mask, other=0.0).to(tl.float32)
        b = tl.load(x_row + HALF + pair[None, None, :], mask=mask, other=0.0).to(tl.float32)
        _store_rounded(out_row + pair[None, None, :], a * c - b * s, mask, ROUND_BF16_IN_INTEGERS)
        _store_rounded(out_row + HALF + pair[None, None, :], b * c + a * s, mask, ROUND_BF16_IN_INTEGERS)
    if COPY_TAIL:  # in chunks of TAIL_CHUNK columns: one 16-byte vector a thread, like the pairs
        for j in tl.static_range(0, BLOCK_TAIL, TAIL_CHUNK):
            tail = 2 * HALF + j + tl.arange(0, TAIL_CHUNK)
            tmask = ok & (tail < 2 * HALF + TAIL)[None, None, :]  # (BLOCK_T, BLOCK_H, TAIL_CHUNK)
            v = tl.load(x_row + tail[None, None, :], mask=tmask)
            tl.store(out_row + tail[None, None, :], v, mask=tmask)


@triton.jit(do_not_specialize=["offset", *_INT_ARGS])
def rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    rows_ptr,
    offsets_ptr,
    flag_ptr,
    offset,
    table_len,
    tokens,
    seq_len,
    q_heads,
    k_heads,
    n_seqs,
    search_steps,
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
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    CONJUGATE: tl.constexpr,
    COPY_TAIL: tl.constexpr,
    ROUND_BF16_IN_INTEGERS: tl.constexpr,
    TRAP_BAD_ROWS: tl.constexpr,
):
    """Rotate tokens ``program_id(0) * BLOCK_T ...`` by the heads of head block ``program_id(1)`` (q's
    blocks, then k's; ``k_heads`` is 0 without k). Leading axes are (batch, seq), the last has stride 1.

    A token's table row is ``offset + t`` (ROWS 0), ``rows[token]`` (ROWS 1: positions), ``rows[b] + t``
    (ROWS 2: per-sequence offsets) or ``t - rows[s] + offset``, ``offsets[s]`` in place of ``offset`` when
    it is negative (ROWS 3: a packed batch, batch 1, ``rows`` its cu_seqlens of ``n_seqs + 1`` entries).
    Whichever it is, a row outside [0, table_len) reads row 0 instead and fails the launch (:func:`flag_bad`):
    the kernel never reads outside the table nor returns a result.

    ROWS 3: token t's sequence s is the last one that starts at or before t (``searchsorted(cu_seqlens[1:],
    t, right=True)``), found by ``search_steps = ceil(log2(n_seqs))`` bisection steps that only ever read
    cu_seqlens[0 .. n_seqs - 1], whatever its values. The values of cu_seqlens are checked here too,
    without a host sync: the head-block-0 programs, together, check every entry (starts at 0, never
    decreases, ends at ``tokens``), and a malformed one fails the launch as a bad row does.
    """
    # Token indices fit int32 (tokens is an i32 argument); dividing in int32 keeps prefill's per-thread
    # division cheap. Addresses are computed in int64 below.
    token = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
    token_ok = token < tokens
    b = (token // seq_len).to(tl.int64)
    t = (token % seq_len).to(tl.int64)
    if ROWS == 1:
        pos = tl.load(rows_ptr + token, mask=token_ok, other=0)
    elif ROWS == 2:
        pos = tl.load(rows_ptr + b, mask=token_ok, other=0) + t
    elif ROWS == 3:  # a packed batch: b is 0, t the token's index in the batch
        lo = tl.zeros((BLOCK_T,), dtype=tl.int32)  # the answer lies in [lo, hi]: cu[lo] <= t
        hi = lo + (n_seqs - 1)
        for _ in range(search_steps):
            mid = (lo + hi + 1) // 2  # lo <= mid <= n_seqs - 1: in cu_seqlens whatever its values
            after = tl.load(rows_ptr + mid, mask=token_ok, other=0) > t
            lo = tl.where(after, lo, mid)
            hi = tl.where(after, mid - 1, hi)
        start = tl.load(rows_ptr + lo, mask=token_ok, other=0)
        per_sequence = (t * 0 + offset) < 0  # (BLOCK_T,): offsets[s] (offset -1), else the int offset
        shift = tl.load(offsets_ptr + lo, mask=token_ok & per_sequence, other=0)
        pos = t - start + tl.where(per_sequence, shift, offset)
    else:
        pos = offset + t
    bad = token_ok & ((pos < 0) | (pos >= table_len))
    if ROWS == 3:  # cu_seqlens' own values: entries j .. of this program, spread over the token programs
        if tl.program_id(1) == 0:
            stride = tl.num_programs(0) * BLOCK_T
            for j0 in range(tl.program_id(0) * BLOCK_T, n_seqs + 1, stride):
                j = j0 + tl.arange(0, BLOCK_T)
                here = j <= n_seqs
                cur = tl.load(rows_ptr + j, mask=here, other=0)
                prev = tl.load(rows_ptr + j - 1, mask=here & (j > 0), other=0)
                wrong = ((j == 0) & (cur != 0)) | (cur < prev) | ((j == n_seqs) & (cur != tokens))
                bad = bad | (here & wrong)
    flag_bad(bad, flag_ptr, TRAP_BAD_ROWS)
    pos = tl.where(bad | ~token_ok, 0, pos)

    pair = tl.arange(0, BLOCK_HALF)
    row_c = cos_ptr + pos[:, None] * cos_stride + pair[None, :]  # (BLOCK_T, BLOCK_HALF)
    row_s = sin_ptr + pos[:, None] * sin_stride + pair[None, :]
    c = tl.load(row_c, mask=(pair < HALF)[None, :], other=0.0)[:, None, :]  # (BLOCK_T, 1, BLOCK_HALF)
    s = tl.load(row_s, mask=(pair < HALF)[None, :], other=0.0)[:, None, :]
    if CONJUGATE:
        s = -s  # R(-theta) = R(theta)^T: the backward pass

    # Head block -> q's heads or k's: one tile of either, the same code on that tensor's pointers. (A branch,
    # not a select of the pointers: the machine-code check follows each pointer argument to its accesses.)
    q_blocks = tl.cdiv(q_heads, BLOCK_H)
    block = tl.program_id(1)
    if block < q_blocks:
        _rotate_tile(
            q_ptr + b * q_stride_b + t * q_stride_s,
            q_out_ptr + b * qo_stride_b + t * qo_stride_s,
            q_stride_h,
            qo_stride_h,
            block * BLOCK_H,
            q_heads,
            token_ok,
            c,
            s,
            HALF,
            TAIL,
            BLOCK_HALF,
            BLOCK_TAIL,
            TAIL_CHUNK,
            BLOCK_T,
            BLOCK_H,
            INTERLEAVED,
            COPY_TAIL,
            ROUND_BF16_IN_INTEGERS,
        )
    else:
        _rotate_tile(
            k_ptr + b * k_stride_b + t * k_stride_s,
            k_out_ptr + b * ko_stride_b + t * ko_stride_s,
            k_stride_h,
            ko_stride_h,
            (block - q_blocks) * BLOCK_H,
            k_heads,
            token_ok,
            c,
            s,
            HALF,
            TAIL,
            BLOCK_HALF,
            BLOCK_TAIL,
            TAIL_CHUNK,
            BLOCK_T,
            BLOCK_H,
            INTERLEAVED,
            COPY_TAIL,
            ROUND_BF16_IN_INTEGERS,
        )


# Whether Triton decorated the kernels for its interpreter (TRITON_INTERPRET=1 at import): fixed for the
# process, so the launcher reads it instead of the environment at every call.
INTERPRETED = isinstance(rotary_kernel, InterpretedFunction)
