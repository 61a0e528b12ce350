"""The fused Triton RoPE kernel: q and k of one token in one program, cos/sin loaded once per token.

One program handles one token (one row of the resolved positions). It loads that token's cos/sin row once,
then rotates every q head and every k head with it, in blocks of ``BLOCK_H`` heads. Layout switches
(``INTERLEAVED``, ``CONJUGATE``, whether k exists, whether a tail must be copied) are compile-time constants,
so each combination compiles to straight-line code. Math runs in float32 whatever the storage dtype.

Importing this module imports Triton. Triton decides at decoration time whether ``@triton.jit`` compiles for
the GPU or runs in the interpreter, so ``TRITON_INTERPRET=1`` must be set before this module is imported.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["rotary_kernel"]


@triton.jit
def _bf16_round_to_nearest_even(x):
    """float32 -> bfloat16, rounding to nearest even, in integer arithmetic (the C loop's bf16_store).

    GPUs round a plain cast to nearest even too, but Triton's interpreter truncates; spelling the rounding out
    makes the rounding contract (docs/safety.md) hold, and be testable, in both. NaN stays a quiet NaN."""
    u = x.to(tl.uint32, bitcast=True)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    top = tl.where(nan, (u >> 16) | 0x40, (u + 0x7FFF + ((u >> 16) & 1)) >> 16)
    return top.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _rotate_heads(
    x_ptr,
    out_ptr,
    x_stride_h,
    out_stride_h,
    n_heads,
    c,
    s,
    half_idx,
    half_mask,
    tail_idx,
    tail_mask,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    COPY_TAIL: tl.constexpr,
    BF16: tl.constexpr,
):
    """Rotate n_heads heads of one token; x_ptr/out_ptr point at head 0, feature 0 of that token."""
    if INTERLEAVED:
        a_idx = 2 * half_idx  # pair i sits at (2i, 2i+1): GPT-J / Meta
        b_idx = 2 * half_idx + 1
    else:
        a_idx = half_idx  # pair i sits at (i, i + R/2): GPT-NeoX / HF
        b_idx = half_idx + HALF
    for h0 in range(0, n_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        mask = (heads < n_heads)[:, None] & half_mask[None, :]  # (BLOCK_H, BLOCK_HALF)
        x_row = x_ptr + heads[:, None] * x_stride_h
        out_row = out_ptr + heads[:, None] * out_stride_h
        a = tl.load(x_row + a_idx[None, :], mask=mask, other=0.0).to(tl.float32)
        b = tl.load(x_row + b_idx[None, :], mask=mask, other=0.0).to(tl.float32)
        ra = a * c - b * s
        rb = b * c + a * s
        if BF16:
            ra, rb = _bf16_round_to_nearest_even(ra), _bf16_round_to_nearest_even(rb)
        tl.store(out_row + a_idx[None, :], ra.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_row + b_idx[None, :], rb.to(out_ptr.dtype.element_ty), mask=mask)
        if COPY_TAIL:
            tmask = (heads < n_heads)[:, None] & tail_mask[None, :]  # (BLOCK_H, BLOCK_TAIL)
            tail = tl.load(x_row + tail_idx[None, :], mask=tmask, other=0.0)
            tl.store(out_row + tail_idx[None, :], tail, mask=tmask)


@triton.jit(do_not_specialize=["offset"])
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
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    HAS_K: tl.constexpr,
    HAS_POS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    CONJUGATE: tl.constexpr,
    COPY_TAIL_Q: tl.constexpr,
    COPY_TAIL_K: tl.constexpr,
    BF16: tl.constexpr,
):
    """Rotate token ``program_id(0)`` of q (and k); leading axes are (batch, seq), the last has stride 1.

    The token's table row is ``positions[token]`` (HAS_POS) or ``offset + t``; a row outside [0, table_len)
    clears ``flag`` and reads row 0 instead (see :func:`ropekit.backends.triton.launch`).
    """
    token = tl.program_id(0).to(tl.int64)
    b = token // seq_len
    t = token % seq_len
    if HAS_POS:
        pos = tl.load(pos_ptr + token)
    else:
        pos = offset + t  # an int offset: the launcher checked the range with integers
    # Never read outside the table: a bad row is clamped and reported through the flag (asserted on the device
    # by the launcher), so the call fails instead of returning these values.
    bad = (pos < 0) | (pos >= table_len)
    tl.store(flag_ptr, 0, mask=bad)
    pos = tl.where(bad, 0, pos)

    half_idx = tl.arange(0, BLOCK_HALF)
    half_mask = half_idx < HALF
    c = tl.load(cos_ptr + pos * cos_stride + half_idx, mask=half_mask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * sin_stride + half_idx, mask=half_mask, other=0.0).to(tl.float32)[None, :]
    if CONJUGATE:
        s = -s  # R(-theta) = R(theta)^T: the backward pass
    tail_idx = 2 * HALF + tl.arange(0, BLOCK_TAIL)
    tail_mask = tl.arange(0, BLOCK_TAIL) < TAIL

    _rotate_heads(
        q_ptr + b * q_stride_b + t * q_stride_s,
        q_out_ptr + b * qo_stride_b + t * qo_stride_s,
        q_stride_h,
        qo_stride_h,
        q_heads,
        c,
        s,
        half_idx,
        half_mask,
        tail_idx,
        tail_mask,
        HALF,
        BLOCK_HQ,
        INTERLEAVED,
        COPY_TAIL_Q,
        BF16,
    )
    if HAS_K:
        _rotate_heads(
            k_ptr + b * k_stride_b + t * k_stride_s,
            k_out_ptr + b * ko_stride_b + t * ko_stride_s,
            k_stride_h,
            ko_stride_h,
            k_heads,
            c,
            s,
            half_idx,
            half_mask,
            tail_idx,
            tail_mask,
            HALF,
            BLOCK_HK,
            INTERLEAVED,
            COPY_TAIL_K,
            BF16,
        )
