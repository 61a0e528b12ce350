"""The QK-norm Triton kernel's block sizes: what its launcher (:mod:`ropekit.backends.triton.qk_norm`) picks
for a head shape, and what its ahead-of-time specializations (:mod:`ropekit.backends.triton.qk_norm_kernel`)
compile. Plain Python: importing it imports no Triton."""

from __future__ import annotations

__all__ = ["NUM_WARPS", "block_sizes"]

NUM_WARPS = 4
# Bytes of one vectorised global load or store: a tile gives each thread one such vector of a run.
VECTOR_BYTES = 16
# The widest rotary half (BLOCK_HALF) that takes the prefill grid: head_dim 256 in fp16 / bf16 spilled 8
# bytes a thread on sm_90 under the 80-register cap with the token loop, so it keeps one token a program.
MAX_PREFILL_BLOCK_HALF = 64


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def block_sizes(
    head_dim: int,
    half: int,
    q_heads: int,
    k_heads: int,
    element_bytes: int = 4,
    interleaved: bool = False,
    prefill: bool = False,
) -> dict[str, int]:
    """The kernel's shape constants for one packing: the halves, the tail and the heads per block.

    A block is BLOCK_H heads by one run (a pair half, or the interleaved pairs' whole run), one 16-byte vector
    of it a thread (``element_bytes``: qkv's storage size): BLOCK_H x run = NUM_WARPS * 32 threads x vector.
    Heads past the count are masked (idle lanes, never a narrower access); q and k take the same blocks.
    ``prefill`` (at least PREFILL_TOKENS tokens): a program takes PREFILL_BLOCK_T tokens (BLOCK_T), else
    one; a head wider than MAX_PREFILL_BLOCK_HALF pairs keeps one."""
    from ropekit.backends.triton.fused import PREFILL_BLOCK_T

    tail = head_dim - 2 * half
    block_half, block_tail = _next_pow2(half), _next_pow2(max(tail, 1))
    run = 2 * block_half if interleaved else block_half
    heads = max(1, NUM_WARPS * 32 * (VECTOR_BYTES // element_bytes) // run)
    return {
        "HALF": half,
        "TAIL": tail,
        "BLOCK_HALF": block_half,
        "BLOCK_TAIL": block_tail,
        "TAIL_CHUNK": min(block_tail, run),  # the tail in runs of the tile's width
        "BLOCK_HQ": heads,
        "BLOCK_HK": heads,
        "BLOCK_T": PREFILL_BLOCK_T if prefill and block_half <= MAX_PREFILL_BLOCK_HALF else 1,
    }
