"""The Triton kernel for QK-RMSNorm + RoPE on packed qkv, in place (see :mod:`ropekit.fused.qk_norm`).

One program per token (decode), or per PREFILL_BLOCK_T tokens taken one after another (a prefill: see
``fused_triton.PREFILL_BLOCK_T``): it loads each token's cos/sin row once, then normalises, weights and
rotates the q heads and the k heads in blocks of heads, each head loaded in 16-byte vectors: its two rotary
halves (or, pairs interleaved, its whole rotary run) and its tail. Switches (pair layout, OLMo 2's all-heads
norm, where the rounding falls, positions tensor or int offset, bfloat16 rounding under the interpreter) are
compile-time constants. Every rounding to the storage dtype is to nearest even: the hardware conversion
(``cvt.rn``) in compiled code, integer arithmetic under Triton's interpreter, whose float -> bfloat16 cast
truncates (``ROUND_BF16_IN_INTEGERS``). Every launch passes :data:`COMPILE_OPTIONS`.

Importing this module imports Triton; set ``TRITON_INTERPRET=1`` before importing it to run on the CPU.
"""

from __future__ import annotations

import itertools

import triton
import triton.language as tl

from ropekit.backends.triton.fused import _token_block, _token_row
from ropekit.backends.triton.rotary_kernel import _bf16_round_to_nearest_even

__all__ = [
    "COMPILE_OPTIONS",
    "OCCUPANCY_TARGET",
    "VECTORISED_ARGS",
    "aot_specializations",
    "qk_norm_rotary_kernel",
]

# Passed at every launch (ropekit.backends.triton.qk_norm.launch) and every ahead-of-time compile.
# enable_fp_fusion: no x * c - y * s (nor a * a + b * b) contracted into an FMA, so each product and sum
#   rounds as in the C loop and torch.
# maxnreg: see OCCUPANCY_TARGET.
COMPILE_OPTIONS = {"enable_fp_fusion": False, "maxnreg": 80}
# 6 blocks of 4 warps an SM (768 of 2,048 threads, 37.5% occupancy): 80 registers a thread. Full occupancy
# allows 32, but a thread holds the token's cos/sin run across both parts, one 16-byte vector of each run of a
# block (the two halves, 8 values each in fp16 / bf16) with their float32 weights, and the normalised,
# weighted and rotated values: ptxas allocates up to 78 under this cap, no spills (capped at 64, head_dim 256
# in bf16 spills 24 bytes on sm_90). The tail is read in runs of the block's width, twice (its squares, then
# its values): held across the norm it spilled. Memory-bound (each element is read once, or twice with OLMo
# 2's all-heads norm, and written once): 24 warps an SM with 32 bytes of loads in flight a thread suffice. The
# AOT check holds every specialization to ropekit.tools.ptx_check.register_budget(4, 0.375) = 80 and to no
# spills.
OCCUPANCY_TARGET = 0.375
# qkv's every load and store is 128-bit (the AOT check proves it): a block gives each thread one 16-byte
# vector of each run (qk_norm_blocks.block_sizes), the interleaved run loaded whole and rotated in its load's
# layout.
VECTORISED_ARGS = ("qkv_ptr",)

_ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


@triton.jit
def _to_storage(x, DTYPE: tl.constexpr, ROUND_BF16_IN_INTEGERS: tl.constexpr):
    """x (float32) in the storage dtype, rounded to nearest even."""
    if ROUND_BF16_IN_INTEGERS:  # the interpreter only: its cast truncates
        return _bf16_round_to_nearest_even(x)
    return x.to(DTYPE, fp_downcast_rounding="rtne")  # cvt.rn


@triton.jit
def _round(x, DTYPE: tl.constexpr, ROUND_BF16_IN_INTEGERS: tl.constexpr):
    """x (float32) rounded to the storage dtype and back: where Hugging Face's RMSNorm casts."""
    return _to_storage(x, DTYPE, ROUND_BF16_IN_INTEGERS).to(tl.float32)


@triton.jit
def _rsqrt_rn(total, count, eps):
    """1 / sqrt(total / count + eps) with correctly rounded division and square root, as the C loop and
    torch compute it (a GPU's default division and square root are approximate)."""
    mean = tl.div_rn(total, (count + 0.0).to(tl.float32))
    return tl.div_rn(1.0 + 0.0 * mean, tl.sqrt_rn(mean + eps))


@triton.jit
def _norm_rotate_heads(
    x_ptr,
    w_ptr,
    n_heads,
    head_dim,
    eps,
    weight_offset,
    c,
    s,
    HALF: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    TAIL_CHUNK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    ALL_HEADS: tl.constexpr,
    CAST_BEFORE: tl.constexpr,
    ROUND_BF16_IN_INTEGERS: tl.constexpr,
):
    """Normalise, weight and rotate n_heads heads of one token in place; x_ptr points at head 0, feature 0.

    A tile is BLOCK_H heads by one contiguous run, one 16-byte vector of it a thread (block_sizes): the half
    layout reads its two halves as two runs, the interleaved layout its rotary part as one run, normalised,
    weighted and rotated in the layout of its load (c, s interleaved: lane 2i holds cos_i and -sin_i, lane
    2i+1 cos_i and sin_i), which the store keeps."""
    dtype = x_ptr.dtype.element_ty
    if INTERLEAVED:
        run = tl.arange(0, 2 * BLOCK_HALF)  # pair i sits at (2i, 2i+1): GPT-J / Meta
        run_mask = run < 2 * HALF
    else:
        run = tl.arange(0, BLOCK_HALF)  # pair i sits at (i, i + R/2): GPT-NeoX / HF
        run_mask = run < HALF
    r_all = 0.0
    if ALL_HEADS:  # OLMo 2: one mean square over every head of this part of the token
        total = 0.0
        for h0 in range(0, n_heads, BLOCK_H):
            heads = h0 + tl.arange(0, BLOCK_H)
            mask = (heads < n_heads)[:, None] & run_mask[None, :]
            row = x_ptr + heads[:, None] * head_dim
            a = tl.load(row + run[None, :], mask=mask, other=0.0).to(tl.float32)
            if INTERLEAVED:
                total += tl.sum(tl.sum(a * a, axis=1), axis=0)
            else:
                b = tl.load(row + HALF + run[None, :], mask=mask, other=0.0).to(tl.float32)
                total += tl.sum(tl.sum(a * a + b * b, axis=1), axis=0)
            if TAIL > 0:
                for j in tl.static_range(0, BLOCK_TAIL, TAIL_CHUNK):
                    cols = 2 * HALF + j + tl.arange(0, TAIL_CHUNK)
                    cmask = (heads < n_heads)[:, None] & (cols < 2 * HALF + TAIL)[None, :]
                    t = tl.load(row + cols[None, :], mask=cmask, other=0.0).to(tl.float32)
                    total += tl.sum(tl.sum(t * t, axis=1), axis=0)
        r_all = _rsqrt_rn(total, n_heads * head_dim, eps)
    for h0 in range(0, n_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        live = heads < n_heads
        mask = live[:, None] & run_mask[None, :]  # (BLOCK_H, run)
        row = x_ptr + heads[:, None] * head_dim
        if ALL_HEADS:
            w_row = w_ptr + heads[:, None] * head_dim  # weights of every head: (heads * head_dim,)
        else:
            w_row = w_ptr + 0 * heads[:, None]  # one (head_dim,) weight shared by the heads
        a = tl.load(row + run[None, :], mask=mask, other=0.0).to(tl.float32)
        wa = tl.load(w_row + run[None, :], mask=mask, other=0.0) + weight_offset
        if INTERLEAVED:
            squares = tl.sum(a * a, axis=1)
        else:
            b = tl.load(row + HALF + run[None, :], mask=mask, other=0.0).to(tl.float32)
            wb = tl.load(w_row + HALF + run[None, :], mask=mask, other=0.0) + weight_offset
            squares = tl.sum(a * a + b * b, axis=1)
        if TAIL > 0:  # in runs of TAIL_CHUNK columns, the tile's layout (no tail: no access at all)
            for j in tl.static_range(0, BLOCK_TAIL, TAIL_CHUNK):
                cols = 2 * HALF + j + tl.arange(0, TAIL_CHUNK)
                cmask = live[:, None] & (cols < 2 * HALF + TAIL)[None, :]  # (BLOCK_H, TAIL_CHUNK)
                t = tl.load(row + cols[None, :], mask=cmask, other=0.0).to(tl.float32)
                squares += tl.sum(t * t, axis=1)
        if ALL_HEADS:
            r = r_all
        else:
            r = _rsqrt_rn(squares, head_dim, eps)[:, None]  # (BLOCK_H, 1)
        na = a * r
        if CAST_BEFORE:  # Qwen3 / Llama: the normalised value is rounded before the weight multiplies it
            na = _round(na, dtype, ROUND_BF16_IN_INTEGERS)
        ya = _round(na * wa, dtype, ROUND_BF16_IN_INTEGERS)
        if INTERLEAVED:
            ye, yo = tl.split(tl.reshape(ya, (BLOCK_H, BLOCK_HALF, 2)))
            swapped = tl.reshape(tl.join(yo, ye), (BLOCK_H, 2 * BLOCK_HALF))  # each pair's partner
            out = ya * c + swapped * s  # = (ye * c - yo * s, yo * c + ye * s), exactly
            tl.store(row + run[None, :], _to_storage(out, dtype, ROUND_BF16_IN_INTEGERS), mask=mask)
        else:
            nb = b * r
            if CAST_BEFORE:
                nb = _round(nb, dtype, ROUND_BF16_IN_INTEGERS)
            yb = _round(nb * wb, dtype, ROUND_BF16_IN_INTEGERS)
            ra = ya * c - yb * s
            rb = yb * c + ya * s
            tl.store(row + run[None, :], _to_storage(ra, dtype, ROUND_BF16_IN_INTEGERS), mask=mask)
            tl.store(row + HALF + run[None, :], _to_storage(rb, dtype, ROUND_BF16_IN_INTEGERS), mask=mask)
        if TAIL > 0:  # read again (from cache) rather than held across the norm: registers
            for j in tl.static_range(0, BLOCK_TAIL, TAIL_CHUNK):
                cols = 2 * HALF + j + tl.arange(0, TAIL_CHUNK)
                cmask = live[:, None] & (cols < 2 * HALF + TAIL)[None, :]
                t = tl.load(row + cols[None, :], mask=cmask, other=0.0).to(tl.float32)
                wt = tl.load(w_row + cols[None, :], mask=cmask, other=0.0) + weight_offset
                nt = t * r
                if CAST_BEFORE:
                    nt = _round(nt, dtype, ROUND_BF16_IN_INTEGERS)
                yt = _round(nt * wt, dtype, ROUND_BF16_IN_INTEGERS)
                tl.store(row + cols[None, :], _to_storage(yt, dtype, ROUND_BF16_IN_INTEGERS), mask=cmask)


@triton.jit(do_not_specialize=["offset"])
def qk_norm_rotary_kernel(
    qkv_ptr,
    wq_ptr,
    wk_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    flag_ptr,
    offset,
    table_len,
    seq_len,
    tokens,
    stride_b,
    stride_s,
    q_heads,
    k_heads,
    head_dim,
    cos_stride,
    sin_stride,
    eps,
    weight_offset,
    HALF: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    TAIL_CHUNK: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_POS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    ALL_HEADS: tl.constexpr,
    CAST_BEFORE: tl.constexpr,
    ROUND_BF16_IN_INTEGERS: tl.constexpr,
    TRAP_BAD_ROWS: tl.constexpr,
):
    """Tokens ``program_id(0) * BLOCK_T`` onwards of qkv (batch, seq, width), one after another (BLOCK_T is 1
    for decode, fused_triton.PREFILL_BLOCK_T for a prefill): q then k normalised and rotated in place.

    A token's table row is ``positions[token]`` (HAS_POS) or ``offset + t``; a row outside [0, table_len)
    reads row 0 instead and fails the launch (``rotary_kernel.flag_bad``).
    """
    start, end = _token_block(tokens, BLOCK_T)
    for token in range(start, end):
        b, t, pos = _token_row(token, pos_ptr, offset, seq_len, table_len, flag_ptr, HAS_POS, TRAP_BAD_ROWS)
        half_idx = tl.arange(0, BLOCK_HALF)
        half_mask = half_idx < HALF
        c = tl.load(cos_ptr + pos * cos_stride + half_idx, mask=half_mask, other=0.0).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + pos * sin_stride + half_idx, mask=half_mask, other=0.0).to(tl.float32)[None, :]
        if INTERLEAVED:  # one entry a lane: (1, 2 * BLOCK_HALF), see _norm_rotate_heads
            c = tl.reshape(tl.join(c, c), (1, 2 * BLOCK_HALF))
            s = tl.reshape(tl.join(-s, s), (1, 2 * BLOCK_HALF))
        x = qkv_ptr + b * stride_b + t * stride_s
        _norm_rotate_heads(
            x, wq_ptr, q_heads, head_dim, eps, weight_offset, c, s, HALF, TAIL, BLOCK_HALF, BLOCK_TAIL,
            TAIL_CHUNK, BLOCK_HQ, INTERLEAVED, ALL_HEADS, CAST_BEFORE, ROUND_BF16_IN_INTEGERS,
        )  # fmt: skip
        _norm_rotate_heads(
            x + q_heads * head_dim, wk_ptr, k_heads, head_dim, eps, weight_offset, c, s, HALF, TAIL,
            BLOCK_HALF, BLOCK_TAIL, TAIL_CHUNK, BLOCK_HK, INTERLEAVED, ALL_HEADS, CAST_BEFORE,
            ROUND_BF16_IN_INTEGERS,
        )  # fmt: skip


# The shapes the AOT check compiles: (head_dim, rotary_dim, q_heads, k_heads) of Qwen3, Gemma 3, OLMo 2 and a
# partial-rotary head. Block sizes follow ropekit.backends.triton.qk_norm_blocks.block_sizes.
AOT_SHAPES = ((128, 128, 32, 8), (256, 256, 8, 4), (128, 64, 16, 16))


def aot_specializations():
    """Every (kernel, signature, constexprs, num_warps) the launcher can pick for :data:`AOT_SHAPES`.

    The signature names every parameter in order ("constexpr" for the compile-time ones), as Triton's
    ``ASTSource`` takes it.
    """
    from ropekit.backends.triton.qk_norm_blocks import NUM_WARPS, block_sizes

    pointers = {"pos_ptr": "*i64", "flag_ptr": "*i32"}
    ints = {"offset", "table_len", "seq_len", "tokens", "stride_b", "stride_s"}
    # As the JIT specializes torch's allocations (16-byte aligned) and a qkv row of whole heads whose width
    # is a multiple of 16 (every AOT shape's): qkv's strides and head_dim divisible by 16.
    aligned = {"stride_b", "stride_s", "head_dim"}
    for (
        head_dim,
        rotary_dim,
        q_heads,
        k_heads,
    ), dtype, has_pos, interleaved, all_heads, cast, prefill in itertools.product(
        AOT_SHAPES, ("fp32", "fp16", "bf16"), *([(False, True)] * 5)
    ):
        constexprs = block_sizes(
            head_dim, rotary_dim // 2, q_heads, k_heads, _ELEMENT_BYTES[dtype], interleaved, prefill
        )
        if prefill and constexprs["BLOCK_T"] == 1:  # a wide head keeps decode's grid: listed already
            continue
        constexprs.update(
            HAS_POS=has_pos,
            INTERLEAVED=interleaved,
            ALL_HEADS=all_heads,
            CAST_BEFORE=cast,
            ROUND_BF16_IN_INTEGERS=False,  # compiled code rounds with cvt.rn
            TRAP_BAD_ROWS=True,  # compiled code traps on a bad row
        )
        signature = {}
        for name in qk_norm_rotary_kernel.arg_names:
            if name in constexprs:
                signature[name] = "constexpr"
            elif name.endswith("_ptr"):
                signature[name] = pointers.get(name, f"*{dtype}:16" if name == "qkv_ptr" else "*fp32:16")
            elif name in ("eps", "weight_offset"):
                signature[name] = "fp32"
            else:
                signature[name] = ("i64" if name in ints else "i32") + (":16" if name in aligned else "")
        yield qk_norm_rotary_kernel, signature, constexprs, NUM_WARPS
