"""The CPU fast path: a small C/OpenMP loop compiled at first use, close to the cost of copying the bytes.

RoPE reads q and k once and writes them once, so a copy of the same bytes is its floor. Measured on a 2-core
Xeon (docs/benchmarks.md), the plain torch backend costs ~19x a ``copy_`` because every elementwise op makes
a full pass over memory; inductor in-place was ~7x. This loop makes one pass: for each token (one OpenMP
chunk) it reads the cos/sin row once, rotates each head into a stack scratch, and writes it back, which keeps
the in-place case vectorised (no possible aliasing between the loads and the stores).

The library is built at first use by :mod:`ropekit.backends.c.build` (a private, file-locked cache keyed on
the source, flags, compiler and CPU). No compiler, a failed or timed-out build, or an unsafe cache makes this
backend unavailable with a logged reason, and ``backend="auto"`` falls back to the torch backend.

Supported: float32, float16 and bfloat16 storage (math in float32). float64 stays on the torch backend, whose
math is float64.
"""

from __future__ import annotations

import ctypes
import struct

import torch

from ropekit.backends.c.build import C_PRELUDE, PARALLEL_THRESHOLD, CLibrary
from ropekit.backends.kernel_op import MAX_HALF, KernelBackend, check_launch, check_offset_rows, row_error
from ropekit.validation import NUMERICS

__all__ = ["CpuBackend", "launch"]

_SOURCE = (
    C_PRELUDE
    + r"""
#include <sys/mman.h>

/* A fresh output of many megabytes costs a page fault per 4 KB on first write (20k faults, most of the time
   of a 4k-token prefill out of place: clone pays them too). Asking for transparent huge pages, as PyTorch
   does under THP_MEM_ALLOC_ENABLE, makes that ~40 faults; the advice only concerns the 2 MB-aligned pages
   inside the output, and is ignored where THP is off or unknown. */
#define HUGE_OUTPUT_BYTES ((int64_t)8 << 20)
#define DIRECT_ELEMENTS ((int64_t)1 << 20)
/* Where the scratch row helps depends on the core: on AMD's Zen cores every size is written directly
   (Zen 3, one thread, prefill-4k in place: 0.77 -> 0.70 x copy_, measured in one process; the Xeon's 0.80
   -> 0.70 went the other way). -march=native names the core (GCC's __znverN__). */
#if defined(__znver1__) || defined(__znver2__) || defined(__znver3__) || defined(__znver4__) \
    || defined(__znver5__)
#define DIRECT_ALWAYS 1
#else
#define DIRECT_ALWAYS 0
#endif
static void advise_huge(void *p, int64_t bytes) {
#ifdef MADV_HUGEPAGE
    const uintptr_t huge = (uintptr_t)2 << 20;
    uintptr_t lo = ((uintptr_t)p + huge - 1) & ~(huge - 1);
    uintptr_t hi = ((uintptr_t)p + (uintptr_t)bytes) & ~(huge - 1);
    if (bytes >= HUGE_OUTPUT_BYTES && hi > lo) madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
#else
    (void)p; (void)bytes;
#endif
}


/* A packed batch's cu_seqlens, int32 (cu32) or int64, entry i. */
static inline int64_t cu_at(const void *cu, int cu32, int64_t i) {
    return cu32 ? (int64_t)((const int32_t *)cu)[i] : ((const int64_t *)cu)[i];
}

/* Whether cu (n + 1 entries) fails to run from 0 to tokens without decreasing. */
static int cu_malformed(const void *cu, int cu32, int64_t n, int64_t tokens) {
    if (cu_at(cu, cu32, 0) != 0 || cu_at(cu, cu32, n) != tokens) return 1;
    for (int64_t s = 0; s < n; ++s)
        if (cu_at(cu, cu32, s + 1) < cu_at(cu, cu32, s)) return 1;
    return 0;
}

/* -1 if cu (n + 1 entries) runs from 0 to tokens without decreasing and every sequence's rows, its offset
   (offsets[s], or offset when offsets is NULL) + [0, length), lie in [0, table_len) (a negative offset fails
   even for an empty sequence, as the checked path refuses it); -3 if cu is malformed; else the first token of
   a sequence whose rows do not fit. Nothing is written before it returns. */
static int64_t check_packed(const void *cu, int cu32, int64_t n, const int64_t *offsets, int64_t offset,
                            int64_t tokens, int64_t table_len) {
    if (cu_malformed(cu, cu32, n, tokens)) return -3;
    for (int64_t s = 0; s < n; ++s) {
        int64_t start = cu_at(cu, cu32, s), length = cu_at(cu, cu32, s + 1) - start;
        int64_t off = offsets ? offsets[s] : offset;
        if (off < 0 || (length > 0 && off > table_len - length)) return start;
    }
    return -1;
}

/* The sequence of packed token t: the last s in [0, n) with cu[s] <= t (cu checked by check_packed). */
static inline int64_t packed_sequence(const void *cu, int cu32, int64_t n, int64_t t) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (cu_at(cu, cu32, mid) <= t) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* st: strides in elements, {q_b, q_s, q_h, qo_b, qo_s, qo_h, k_b, k_s, k_h, ko_b, ko_s, ko_h}. */
#define DEFINE_ROTARY(NAME, T, LOAD, STORE, ROUND) \
static void NAME##_heads(const T *x, T *out, int64_t sx, int64_t so, int64_t heads, int64_t half, \
                         int64_t tail, const float *c, const float *s, const float *c2, const float *s2, \
                         int interleaved, int copy_tail, int direct, int per_op) { \
    float ra[2 * ROPEKIT_MAX_HALF], rb[ROPEKIT_MAX_HALF], xf[2 * ROPEKIT_MAX_HALF]; /* half <= the bound */ \
    for (int64_t h = 0; h < heads; ++h) { \
        const T *xr = x + h * sx; \
        T *orow = out + h * so; \
        if (per_op && interleaved) { /* numerics "hf" / "vllm": each product and sum rounded to T, as \
                    PyTorch's ops in T (a product of two values of T is exact in float32); the same pass */ \
            for (int64_t j = 0; j < 2 * half; ++j) xf[j] = LOAD(xr[j]); \
            for (int64_t j = 0; j < 2 * half; ++j) /* s2 carries each pair's sign */ \
                ra[j] = ROUND(ROUND(xf[j] * c2[j]) + ROUND(xf[j ^ 1] * s2[j])); \
            for (int64_t j = 0; j < 2 * half; ++j) orow[j] = STORE(ra[j]); \
        } else if (per_op) { \
            for (int64_t i = 0; i < half; ++i) { \
                float a = LOAD(xr[i]), b = LOAD(xr[i + half]); \
                ra[i] = ROUND(ROUND(a * c[i]) - ROUND(b * s[i])); \
                rb[i] = ROUND(ROUND(b * c[i]) + ROUND(a * s[i])); \
            } \
            for (int64_t i = 0; i < half; ++i) { \
                orow[i] = STORE(ra[i]); \
                orow[i + half] = STORE(rb[i]); \
            } \
        } else if (interleaved) { /* c2, s2: c, s per pair, s2 signed; out[j] = x[j] c2 + x[j^1] s2 */ \
            int64_t j = 0; \
            for (j = 0; j < 2 * half; ++j) xf[j] = LOAD(xr[j]); \
            for (j = 0; j + 8 <= 2 * half; j += 8) { /* swap within pairs with one shuffle per 8 floats */ \
                v8f v, cc, ss; \
                memcpy(&v, xf + j, 32); memcpy(&cc, c2 + j, 32); memcpy(&ss, s2 + j, 32); \
                v8f w = __builtin_shuffle(v, (v8i){1, 0, 3, 2, 5, 4, 7, 6}); \
                v = v * cc + w * ss; \
                memcpy(ra + j, &v, 32); \
            } \
            for (; j < 2 * half; ++j) ra[j] = xf[j] * c2[j] + xf[j ^ 1] * s2[j]; \
            for (j = 0; j < 2 * half; ++j) orow[j] = STORE(ra[j]); \
        } else if (direct) { /* iteration i reads x[i], x[i + half] and writes them alone: in place \
                    (orow == xr) or into a separate output, no iteration's store reaches another's load */ \
            _Pragma("GCC ivdep") \
            for (int64_t i = 0; i < half; ++i) { \
                float a = LOAD(xr[i]), b = LOAD(xr[i + half]); \
                orow[i] = STORE(a * c[i] - b * s[i]); \
                orow[i + half] = STORE(b * c[i] + a * s[i]); \
            } \
        } else { /* all loads of a head, then all its stores: faster streaming from memory (measured) */ \
            for (int64_t i = 0; i < half; ++i) { \
                float a = LOAD(xr[i]), b = LOAD(xr[i + half]); \
                ra[i] = a * c[i] - b * s[i]; \
                rb[i] = b * c[i] + a * s[i]; \
            } \
            for (int64_t i = 0; i < half; ++i) { \
                orow[i] = STORE(ra[i]); \
                orow[i + half] = STORE(rb[i]); \
            } \
        } \
        if (copy_tail) memcpy(orow + 2 * half, xr + 2 * half, (size_t)tail * sizeof(T)); \
    } \
} \
/* a: the integer arguments, as _INT_ARGS. Returns -1 when done, -2 if half is outside [1, ROPEKIT_MAX_HALF] \
   (the scratch rows' size), -3 for malformed cu_seqlens, else the first token whose table row (pos[token]; \
   pos[batch row] + its index in the sequence with per_seq; offset + that index when pos is NULL; packed (cu \
   not NULL, batch 1): its index in its sequence s + pos[s], or + offset when pos is NULL) is outside \
   [0, table_len); nothing is written then. With cu and pos but not per_seq, pos holds a row per token \
   (a launch plan's explicit positions of a packed batch): cu is checked (-3 if malformed), not read. */ \
int64_t NAME(const void *q, void *qo, const void *k, void *ko, const float *cos, const float *sin, \
             const int64_t *pos, const void *cu, const int64_t *a, int64_t offset, int64_t nthreads) { \
    const int64_t *st = a, batch = a[12], seq = a[13], q_heads = a[14], k_heads = a[15]; \
    const int64_t half = a[16]; \
    const int64_t tail = a[17], cos_stride = a[18], sin_stride = a[19], table_len = a[20]; \
    const int interleaved = (int)a[21], conjugate = (int)a[22], copy_tail = (int)a[23]; \
    const int per_seq = (int)a[24]; \
    const int64_t n_seqs = a[25]; \
    const int cu32 = (int)a[26]; \
    const int per_op = (int)a[27]; \
    const int threads = (int)nthreads; \
    float sign = conjugate ? -1.0f : 1.0f; \
    int64_t tokens = batch * seq; \
    /* Up to DIRECT_ELEMENTS (the working set of a 64-sequence decode step fits the caches) the rotation is \
       written directly: decode-64 in place 30 -> 22 us; above, a scratch row per head: prefill-4k in place \
       0.80 -> 0.70 x copy_ (2-core Xeon, one thread). */ \
    const int direct = DIRECT_ALWAYS || tokens * (q_heads + k_heads) * (2 * half + tail) <= DIRECT_ELEMENTS; \
    if (half < 1 || half > ROPEKIT_MAX_HALF) return -2; \
    const int cu_rows = cu && (per_seq || !pos); /* rows from cu_seqlens (else, with cu, one per token) */ \
    if (cu && !cu_rows && cu_malformed(cu, cu32, n_seqs, tokens)) return -3; \
    if (cu_rows) { /* a packed batch: cu_seqlens and each sequence's rows */ \
        int64_t bad = check_packed(cu, cu32, n_seqs, pos, offset, tokens, table_len); \
        if (bad != -1) return bad; \
    } else if (pos && per_seq) { /* pos[b]: sequence b's offset; its rows are pos[b] + t */ \
        for (int64_t b = 0; b < batch && seq > 0; ++b) \
            if (pos[b] < 0 || pos[b] > table_len - seq) \
                return b * seq + (pos[b] < 0 ? 0 : table_len - pos[b] > 0 ? table_len - pos[b] : 0); \
    } else { \
        int64_t bad = first_bad_row(pos, tokens, offset, seq, table_len); \
        if (bad >= 0) return bad; \
    } \
    if (tokens > 0 && (copy_tail & 1)) /* an output of its own (out of place): see advise_huge */ \
        advise_huge(qo, ((batch - 1) * st[3] + (seq - 1) * st[4] + (q_heads - 1) * st[5] \
                         + 2 * half + tail) * (int64_t)sizeof(T)); \
    if (tokens > 0 && k && (copy_tail & 2)) \
        advise_huge(ko, ((batch - 1) * st[9] + (seq - 1) * st[10] + (k_heads - 1) * st[11] \
                         + 2 * half + tail) * (int64_t)sizeof(T)); \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1)") \
    for (int64_t token = 0; token < tokens; ++token) { \
        int64_t b = token / seq, t = token % seq; \
        int64_t row; \
        if (cu_rows) { /* b is 0, t the token's index in the batch */ \
            int64_t sq = packed_sequence(cu, cu32, n_seqs, t); \
            row = t - cu_at(cu, cu32, sq) + (pos ? pos[sq] : offset); \
        } else { \
            row = pos ? (per_seq ? pos[b] + t : pos[token]) : offset + t; \
        } \
        const float *c = cos + row * cos_stride; \
        float s[ROPEKIT_MAX_HALF], c2[2 * ROPEKIT_MAX_HALF], s2[2 * ROPEKIT_MAX_HALF], cr[ROPEKIT_MAX_HALF]; \
        for (int64_t i = 0; i < half; ++i) s[i] = sign * sin[row * sin_stride + i]; \
        if (per_op) { /* the peers' tables are cast to T first */ \
            for (int64_t i = 0; i < half; ++i) { cr[i] = ROUND(c[i]); s[i] = ROUND(s[i]); } \
            c = cr; \
        } \
        if (interleaved) \
            for (int64_t i = 0; i < half; ++i) { \
                c2[2 * i] = c2[2 * i + 1] = c[i]; \
                s2[2 * i] = -s[i]; \
                s2[2 * i + 1] = s[i]; \
            } \
        NAME##_heads((const T *)q + b * st[0] + t * st[1], (T *)qo + b * st[3] + t * st[4], st[2], \
                     st[5], q_heads, half, tail, c, s, c2, s2, interleaved, copy_tail & 1, direct, per_op); \
        if (k) \
            NAME##_heads((const T *)k + b * st[6] + t * st[7], (T *)ko + b * st[9] + t * st[10], st[8], \
                         st[11], k_heads, half, tail, c, s, c2, s2, interleaved, copy_tail & 2, direct, \
                         per_op); \
    } \
    return -1; \
}

/* A float rounded to T and back (numerics "hf" / "vllm"): branch-free, so the per-op loops vectorize; bf16 as
   bf16_store rounds (to nearest even, a NaN kept quiet). */
static inline float bf16_round(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    uint32_t r = (u & 0x7fffffffu) > 0x7f800000u ? ((u | 0x00400000u) & 0xffff0000u) : rounded;
    memcpy(&f, &r, 4); return f;
}
#define F32_ROUND(v) (v)
#define F16_ROUND(v) ((float)(_Float16)(v))

DEFINE_ROTARY(rotary_f32, float, F32_LOAD, F32_STORE, F32_ROUND)
DEFINE_ROTARY(rotary_f16, _Float16, F16_LOAD, F16_STORE, F16_ROUND)
DEFINE_ROTARY(rotary_bf16, uint16_t, bf16_load, bf16_store, bf16_round)
"""
)

_ENTRY = {torch.float32: "rotary_f32", torch.float16: "rotary_f16", torch.bfloat16: "rotary_bf16"}
# q, q_out, k, k_out, cos, sin, positions, the integer arguments that depend on shapes and flags alone packed
# into one int64 array (a ctypes call converts each argument separately, so 24 integers as one pointer save
# microseconds per decode step, and a launch plan keeps the bytes), then the offset and the thread count.
_ARGTYPES = (ctypes.c_void_p,) * 9 + (ctypes.c_int64,) * 2
# strides {q_b, q_s, q_h, qo_b, qo_s, qo_h, k_b, k_s, k_h, ko_b, ko_s, ko_h}, batch, seq, q_heads, k_heads,
# half, tail, cos_stride, sin_stride, table_len, interleaved, conjugate, copy_tail, per_seq, n_seqs, cu32.
# copy_tail: bit 0 for q, bit 1 for k, set when that output is not its input (the tail must be copied).
# per_seq: positions holds one offset per batch row (a launch plan's tensor offsets), not a row per token.
# n_seqs, cu32: a packed batch's sequences and whether its cu_seqlens is int32 (a launch plan's, else 0).
# per_op: numerics "hf" / "vllm" (the table and each product and sum rounded to the dtype), else 0 ("exact").
_INT_ARGS = struct.Struct("28q")


_LIBRARY = CLibrary(
    stem="rotary_cpu",
    source=_SOURCE,
    entries=_ENTRY,
    argtypes=_ARGTYPES,
    refusal="backend: 'cpu' cannot serve these inputs",
    description="the CPU fast path",
)


def _assume_constant_result(fn):
    """What ``torch.compiler.assume_constant_result`` does (it sets this marker, torch/_dynamo/decorators.py),
    without importing torch._dynamo, which would cost seconds at ``import ropekit``. A test checks that the
    marker still matches the public decorator."""
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def _build_failure() -> str | None:
    """None once the library is loaded, else why it could not be built.

    torch.compile runs this eagerly and keeps the answer as a constant: building reads files and runs a
    compiler, which it cannot trace, so a first call under compile would otherwise break the graph.
    """
    return _LIBRARY.load()


_NO_K = (0, 0, 0)


def launch(q, k, q_out, k_out, cos, sin, positions, offset, interleaved, conjugate, numerics="exact") -> None:
    """Run the C loop; see :data:`ropekit.backends.kernel_op.Launch` (numerics: one of
    :data:`ropekit.validation.NUMERICS`, "hf" and "vllm" rounding after each op, in the same pass).

    Raises:
        ValueError: on anything :func:`~ropekit.backends.kernel_op.check_launch` rejects, CUDA tensors, or a
            table row outside the table (checked by the C loop on the host before it writes anything).
    """
    check_launch(q, k, q_out, k_out, cos, sin, positions, offset, _ENTRY)
    if not q.is_cpu:
        raise ValueError(f"q: expected a CPU tensor for the C kernel, got one on {q.device}")
    table_len = cos.shape[0]
    if positions is None:
        check_offset_rows(offset, q.shape[0], q.shape[1], table_len)
    int_args = _pack(q, k, q_out, k_out, cos, sin, interleaved, conjugate, per_op=numerics != "exact")
    bad = (_LIBRARY.functions or _LIBRARY.require())[q.dtype](
        q.data_ptr(),
        q_out.data_ptr(),
        k.data_ptr() if k is not None else None,
        k_out.data_ptr() if k is not None else None,
        cos.data_ptr(),
        sin.data_ptr(),
        None if positions is None else positions.data_ptr(),
        None,  # cu_seqlens: a launch plan's packed batch only
        int_args,  # bytes: read-only for the C loop, owned by this call (thread-safe)
        offset,
        _threads(q, k),
    )
    if bad == -2:  # check_launch bounds the width first: reached only if the two bounds ever disagree
        raise ValueError(f"cos: expected 1 <= rotary_dim // 2 <= {MAX_HALF}, got {cos.shape[1]}")
    if bad >= 0:
        position = int(positions[bad]) if positions is not None else offset + bad
        raise row_error(position, table_len, bad if positions is not None else None)


def _pack(q, k, q_out, k_out, cos, sin, interleaved, conjugate, per_seq=False, cu_seqlens=None, per_op=False):
    """The C loop's integer arguments that depend on shapes, strides and flags alone (see _INT_ARGS); of
    cu_seqlens (a packed batch: q (1, T, H, D)), its length and dtype."""
    batch, seq, q_heads, head_dim = q.shape  # (batch, seq, heads, head_dim)
    half = cos.shape[1]
    has_k = k is not None
    return _INT_ARGS.pack(
        *q.stride()[:3], *q_out.stride()[:3], *(k.stride()[:3] if has_k else _NO_K),
        *(k_out.stride()[:3] if has_k else _NO_K),
        batch, seq, q_heads, k.shape[2] if has_k else 0, half, head_dim - 2 * half,
        cos.stride()[0], sin.stride()[0], cos.shape[0],
        interleaved, conjugate,
        (q_out.data_ptr() != q.data_ptr()) | (has_k and k_out.data_ptr() != k.data_ptr()) << 1,
        per_seq,
        0 if cu_seqlens is None else cu_seqlens.shape[0] - 1,
        cu_seqlens is not None and cu_seqlens.dtype == torch.int32,
        per_op,
    )  # fmt: skip


def pointer_launch(
    q, k, q_out, k_out, cos, sin, interleaved, conjugate, per_sequence, cu_seqlens=None, numerics="exact"
):
    """The C loop bound to the integers of a launch on tensors laid out as these (shapes, strides, dtype,
    flags; a packed batch's cu_seqlens length and dtype): call(q, q_out, k, k_out, cos, sin, rows, offset,
    cu=None) with data pointers as ints (k, k_out, rows, cu may be None; rows: one offset per batch row, or
    per packed sequence, with per_sequence, else a row per token (explicit positions; with cu, cu is then
    checked, not read for rows) or None for offset + the token's index in its sequence; cu: the packed
    batch's cu_seqlens, q then (1, T, H, D)) returns the loop's code: -1 done, else a row outside the
    table or malformed cu_seqlens, nothing written. The caller keeps the kernel wall: every tensor it points
    at is laid out as these. numerics: as the loop's per_op rounding (:func:`launch`)."""
    function, int_args, parallel = _bound_loop(
        q, k, q_out, k_out, cos, sin, interleaved, conjugate, per_sequence, cu_seqlens, numerics != "exact"
    )

    def call(q, q_out, k, k_out, cos, sin, rows, offset, cu=None) -> int:
        threads = torch.get_num_threads() if parallel else 1
        return function(q, q_out, k, k_out, cos, sin, rows, cu, int_args, offset, threads)

    return call


def _bound_loop(q, k, q_out, k_out, cos, sin, interleaved, conjugate, per_sequence, cu_seqlens, per_op=False):
    """pointer_launch's pieces: (the C loop, its packed integers, whether it runs on torch's threads), for a
    caller that calls the loop itself, ``function(q, q_out, k, k_out, cos, sin, rows, cu, int_args, offset,
    threads)`` (a plan's run: one Python call fewer per step)."""
    function = (_LIBRARY.functions or _LIBRARY.require())[q.dtype]
    int_args = _pack(q, k, q_out, k_out, cos, sin, interleaved, conjugate, per_sequence, cu_seqlens, per_op)
    return function, int_args, _threads(q, k) > 1


def _threads(q: torch.Tensor, k: torch.Tensor | None) -> int:
    work = q.numel() + (k.numel() if k is not None else 0)
    return torch.get_num_threads() if work >= PARALLEL_THRESHOLD else 1


class CpuBackend(KernelBackend):
    # A plan's run reads its tensors' data pointers alone (the strides are the plan's) and allocates its
    # outputs with empty_like: it serves the same memory through another view (ropekit.backends.plan).
    plan_reads_pointers = True
    numerics = NUMERICS  # "hf" / "vllm": a rounding per op in the loop (its per_op argument)

    def __init__(self) -> None:
        super().__init__("cpu", launch)

    def unavailable_reason(self, q: torch.Tensor, cos: torch.Tensor) -> str | None:
        if q.device.type != "cpu":
            return f"q is on {q.device.type}; the CPU fast path serves CPU tensors"
        if q.dtype not in _ENTRY:
            return f"dtype {q.dtype} is not supported (float32, float16, bfloat16; float64 uses torch)"
        if cos.shape[-1] > MAX_HALF:
            return f"rotary_dim {2 * cos.shape[-1]} is wider than the kernel serves ({2 * MAX_HALF})"
        return _build_failure()

    def kernels(self):
        from ropekit.backends.c import fused as fused_cpu  # C loops built by this file's machinery
        from ropekit.backends.c import qk_norm as qk_norm_cpu

        return fused_cpu.launch, qk_norm_cpu.launch

    def fused_unavailable_reason(self, op: str, *, widest: int = 0, spec=None) -> str | None:
        reason = super().fused_unavailable_reason(op, widest=widest, spec=spec)
        if reason is not None:
            return reason
        from ropekit.backends.c import fused as fused_cpu
        from ropekit.backends.c import qk_norm as qk_norm_cpu

        if op == "qk_norm":
            reason = qk_norm_cpu.unavailable_reason(spec)
            return None if reason is None else f"cannot serve these inputs: {reason}"
        reason = fused_cpu.unavailable_reason()
        return None if reason is None else f"cannot serve the fused op: {reason}"

    def plan(
        self,
        q,
        k,
        cos,
        sin,
        *,
        interleaved,
        conjugate,
        inplace,
        per_sequence=False,
        cu_seqlens=None,
        positions=False,
        numerics="exact",
    ):
        """The launch for one key (:mod:`ropekit.backends.plan`): the packed arguments are built once, and a
        call is the outputs, the data pointers and the C loop. With per_sequence, ``offset`` is an int64
        tensor of one offset per batch row, read by the C loop itself (no positions tensor is built). With
        ``positions``, ``offset`` is the call's positions tensor (contiguous int64, one row per token: (B, S),
        or (T,) with cu_seqlens, which the loop then checks and never reads for rows): the loop checks every
        row before it writes.
        With ``cu_seqlens`` (a packed batch: q and k (T, H, D), an int offset or one per packed sequence),
        the run takes the call's cu_seqlens too, ``run(q, k, cos, sin, offset, cu_seqlens)``: the C loop
        checks it (from 0 to T, never decreasing) and each sequence's rows before it writes, then finds each
        token's sequence by a binary search, so no positions tensor is built either. The run returns None,
        having written nothing, if a row is outside the table or cu_seqlens is malformed (the checked path
        then raises its own error)."""
        units = [t.stride(-1) == 1 for t in (q, cos, sin) + (() if k is None else (k,))]
        if not all(units) or cos.dtype != torch.float32 or not q.is_cpu or q.dtype not in _ENTRY:
            return None
        # empty_like's strides follow from the input's strides alone: the probes' are every call's.
        probes = (q, k) + (
            (q, k) if inplace else (torch.empty_like(q), None if k is None else torch.empty_like(k))
        )
        if cu_seqlens is not None:  # (T, H, D) as the loop's (1, T, H, D)
            probes = tuple(None if t is None else t[None] for t in probes)
        # pointer_launch's loop, called here (a decode step spares the wrapper's Python call)
        function, int_args, parallel = _bound_loop(
            *probes, cos, sin, interleaved, conjugate, per_sequence, cu_seqlens, numerics != "exact"
        )
        reads = per_sequence or positions  # offset is a tensor the loop reads

        def run(q, k, cos, sin, offset, cu_seqlens=None):
            if inplace:
                q_out, k_out = q, k
            else:
                q_out = torch.empty_like(q)
                k_out = None if k is None else torch.empty_like(k)
            bad = function(
                q.data_ptr(),
                q_out.data_ptr(),
                None if k is None else k.data_ptr(),
                None if k is None else k_out.data_ptr(),
                cos.data_ptr(),
                sin.data_ptr(),
                offset.data_ptr() if reads else None,
                None if cu_seqlens is None else cu_seqlens.data_ptr(),
                int_args,
                0 if reads else offset,
                torch.get_num_threads() if parallel else 1,
            )
            if bad != -1:  # a row outside the table, malformed cu_seqlens (or a width past the bound)
                return None  # nothing was written
            if inplace:  # what the dispatcher would do: tell autograd that q and k changed
                torch._C._increment_version((q,) if k is None else (q, k))
            return q_out, k_out

        return run
