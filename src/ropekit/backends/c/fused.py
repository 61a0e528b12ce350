"""The fused serving loop in C: RoPE with the KV-cache write, FP8 quantisation and the cache shift.

It runs a :class:`~ropekit.backends.fused_launch.FusedLaunch` channel by channel, each channel one pass over
the tokens (an OpenMP chunk of tokens per thread, one parallel region per call): each head is rotated into a
float32 scratch row and stored once, to its own dtype (round to nearest even, as
:mod:`ropekit.backends.c.rotary`)
or to FP8 bytes. Table rows and slots are all checked before the first write. The common head shapes (128 and
64 wide) run compile-time specialisations of the per-head loops.

FP8 stores follow the rounding contract of :func:`ropekit.apply_rotary_qk_fp8` bit for bit: the float32
rotation r (each product and sum rounded, no FMA: ``-ffp-contract=off``), then the float32 quotient
``r / scale`` (a division, never a multiplication by a reciprocal), clamped to the format's largest finite
value (NaN stays NaN), then rounded to nearest even into the format's bits (by one float32 FMA onto the FP8
grid: the C source says how; equal to an integer rounding for all 2^32 inputs). Built with
:mod:`ropekit.backends.c.build` (shared cache, checks and lock).
"""

from __future__ import annotations

import ctypes
import struct

import torch

from ropekit.backends.c.build import C_PRELUDE, PARALLEL_THRESHOLD, CLibrary
from ropekit.backends.fused_launch import FusedLaunch, check_bounds, check_launch, slot_error
from ropekit.backends.kernel_op import MAX_WIDTH, row_error

__all__ = ["launch", "plan", "unavailable_reason"]

_SOURCE = (
    C_PRELUDE
    + f"#define ROPEKIT_MAX_WIDTH {MAX_WIDTH}\n"
    + r"""

/* float32 -> FP8 bits, round to nearest even, after clamping to +-max (NaN stays NaN): branch-free, so the
   store loops vectorise. E4M3: float8_e4m3fn (bias 7, 3 mantissa bits, max 448); E5M2: float8_e5m2 (bias 15,
   2 mantissa bits, max 57344). |v|, clamped, lies in a binade E (at least the smallest normal's, so the
   subnormals share its step). SCALE = 2^(bias - 127) moves |v| to a float32 whose exponent field is the
   format's; magic = 2^(E + 23 - mantissa bits) * SCALE makes the float32 ulp of |v| * SCALE + magic the
   scaled FP8 step, so the FMA's one rounding is the round to nearest even at the step, and the sum less
   magic (exact) is the rounded value, scaled: a normal float32 whose top bits are the format's exponent and
   mantissa, or for the format's subnormals a float32 subnormal whose top mantissa bits are the code (a carry
   into the next binade included). Equal, for all 2^32 inputs of both formats (checked exhaustively), to the
   float addition it replaced and to the integer rounding before that; 2-3 instructions fewer a vector. */
#ifdef _OPENMP
#include <omp.h>
#else /* a build without OpenMP: the pragma is ignored and one thread takes every token */
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
#endif
#define INLINE static inline __attribute__((always_inline))
#define REPEATED (INT64_MIN + 1)
#define MEETS (INT64_MIN + 2)
#define DEFINE_FP8(NAME, FMAX_BITS, MIN_NORMAL, SHIFT, SCALE, TO_SCALED) \
INLINE uint32_t NAME(float v) { \
    uint32_t u; memcpy(&u, &v, 4); \
    uint32_t a = u & 0x7fffffffu; \
    uint32_t c = a < FMAX_BITS ? a : FMAX_BITS; /* |v| clamped to the largest finite (inf too; NaN below) */ \
    uint32_t e = c & 0x7f800000u; \
    e = e > MIN_NORMAL ? e : MIN_NORMAL; /* its binade, at least the smallest normal's */ \
    uint32_t magic = e - (TO_SCALED); /* 2^(E + SHIFT) * SCALE: the FP8 step is the float32 ulp there */ \
    float x, m; memcpy(&x, &c, 4); memcpy(&m, &magic, 4); \
    float r = __builtin_fmaf(x, SCALE, m) - m; /* |v| * SCALE rounded to the step, to nearest even */ \
    uint32_t code; memcpy(&code, &r, 4); \
    code >>= (SHIFT); /* the float32 exponent field is the format's, its top mantissa bits the format's */ \
    code = a > 0x7f800000u ? 0x7fu : code; \
    return code | ((u >> 24) & 0x80u); \
}
/* 448; 2^-6; SCALE 2^(7 - 127): a float32 of the format's exponent bias 7 */
DEFINE_FP8(fp8_e4m3, 0x43e00000u, 0x3c800000u, 20, 0x1p-120f, (120u - 20u) << 23)
/* 57344; 2^-14; SCALE 2^(15 - 127) */
DEFINE_FP8(fp8_e5m2, 0x47600000u, 0x38800000u, 21, 0x1p-112f, (112u - 21u) << 23)
/* o[j] = FP8 bits of x[j] / scale for j < n, in one pass (measured as fast as forming 32-bit lanes first and
   narrowing in a second loop; the 512-bit loops, below, take fp8_row512 for rows of 64-byte multiples). */
INLINE void fp8_row(const float *x, uint8_t *o, int64_t n, float scale, int kind) {
    if (kind == 1)
        for (int64_t j = 0; j < n; ++j) o[j] = (uint8_t)fp8_e4m3(x[j] / scale);
    else
        for (int64_t j = 0; j < n; ++j) o[j] = (uint8_t)fp8_e5m2(x[j] / scale);
}
/* A source row is read PREFETCH_BYTES after it is asked for: one token's heads are a contiguous run in the
   common layouts, and one thread streaming 84 MB (a 4k-token prefill's q and k) waits on memory while it
   computes unless the lines are requested ahead (measured in a C harness at prefill-4k: 1.55x -> 1.2x a
   copy of its bytes, one thread). A prefetch is a hint: it never faults and writes nothing; the addresses
   are heads of this channel's source (this token's, or the next token's), never past them. */
#define PREFETCH_BYTES 2048
/* How a token's heads are stored (kind 0: the source dtype). Up to DIRECT_ELEMENTS, all channels together (a
   64-sequence decode step's 0.4M fits the caches), each head is rotated straight to its destination (DIRECT;
   decode-64 rope + cache 52 -> 48 us of C), and a cache row (a by-slot channel) with whole 64-byte lines is
   written with streaming stores (STREAM): the attention that reads it next reads the whole cache from memory
   anyway, and the lines it would have kept evict the step's q and the caller's own data (rope + cache
   decode-64, whole call, one thread: ~94 -> ~87 us). Above, the prefetched scratch-row loop (SCRATCH). */
#define DIRECT_ELEMENTS ((int64_t)1 << 20)
#define STREAM_BYTES 2048
enum { SCRATCH, DIRECT, STREAM };
#ifdef __AVX__
#include <immintrin.h>
static inline int streamable(const void *dst, int64_t row, int64_t head_stride) {
    return row <= STREAM_BYTES && row % 64 == 0 && head_stride % 64 == 0 && (uintptr_t)dst % 64 == 0;
}
/* o: 64-byte aligned, bytes a multiple of 64 (streamable); x: any alignment. */
static inline void stream_row(void *o, const void *x, int64_t bytes) {
    for (int64_t j = 0; j < bytes; j += 32)
        _mm256_stream_si256((__m256i *)((char *)o + j),
                            _mm256_loadu_si256((const __m256i *)((const char *)x + j)));
}
/* Streaming stores are weakly ordered: fenced before the loop returns (another thread may read the cache). */
static inline void stream_fence(void) { _mm_sfence(); }
#else
static inline int streamable(const void *dst, int64_t row, int64_t head_stride) { return 0; }
static inline void stream_row(void *o, const void *x, int64_t bytes) { memcpy(o, x, (size_t)bytes); }
static inline void stream_fence(void) {}
#endif
/* fp8_row with 512-bit vectors, for the wide loops (FP8 stores of WIDE_ELEMENTS or more) and n a multiple of
   64: the same bytes in fewer instructions than GCC makes of fp8_row (the C loop at prefill-4k FP8 with its
   data in cache: ~41 -> ~34 ns a head). Per 16 floats: the quotient q (a division, as fp8_row); c = min(|q|,
   max) (NaN stays NaN: MINPS returns its second operand); DEFINE_FP8's rounding (c * SCALE + magic, one FMA);
   the code shifted to the top byte and clamped there to 0x7f, which only a NaN passes (its exponent field is
   all ones), with q's sign bit; the top bytes of four vectors gathered by two byte permutes. Streaming stores
   when stream (each row a whole number of 64-byte lines: the 21 MB a 4k prefill writes are read next by the
   attention, not by this loop). */
#if defined(__AVX512F__) && defined(__AVX512VBMI__) /* VBMI: the byte permutes */
#define HAVE_FP8_ROW512 1
INLINE __m512i fp8_top16(__m512 x, __m512 scale, __m512 fmax, __m512i min_normal, __m512i to_scaled,
                         __m512 unscale, int up) {
    const __m512 q = _mm512_div_ps(x, scale);
    const __m512 c = _mm512_min_ps(fmax, _mm512_abs_ps(q)); /* a NaN |q| is MINPS's second operand: kept */
    const __m512i bits = _mm512_castps_si512(c);
    const __m512i e = _mm512_max_epu32(_mm512_and_si512(bits, _mm512_set1_epi32(0x7f800000)), min_normal);
    const __m512 m = _mm512_castsi512_ps(_mm512_sub_epi32(e, to_scaled));
    const __m512 r = _mm512_sub_ps(_mm512_fmadd_ps(c, unscale, m), m);
    const __m512i top = _mm512_min_epu32(_mm512_sll_epi32(_mm512_castps_si512(r), _mm_cvtsi32_si128(up)),
                                         _mm512_set1_epi32(0x7f000000));
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u); /* 0xd8: sign ? q : top, bit by bit */
    return _mm512_ternarylogic_epi32(top, _mm512_castps_si512(q), sign, 0xd8);
}
INLINE void fp8_row512(const float *x, uint8_t *o, int64_t n, float scale, int kind, int stream) {
    const __m512 vscale = _mm512_set1_ps(scale);
    const __m512 fmax = _mm512_set1_ps(kind == 1 ? 448.0f : 57344.0f);
    const __m512i min_normal = _mm512_set1_epi32(kind == 1 ? 0x3c800000 : 0x38800000);
    const __m512i to_scaled = _mm512_set1_epi32((int)(kind == 1 ? (120u - 20u) << 23 : (112u - 21u) << 23));
    const __m512 unscale = _mm512_set1_ps(kind == 1 ? 0x1p-120f : 0x1p-112f);
    const int up = kind == 1 ? 4 : 3; /* code << up: its 7 bits at 24..30 */
    const __m512i top_bytes = _mm512_set_epi8(
        127, 123, 119, 115, 111, 107, 103, 99, 95, 91, 87, 83, 79, 75, 71, 67,
        63, 59, 55, 51, 47, 43, 39, 35, 31, 27, 23, 19, 15, 11, 7, 3,
        127, 123, 119, 115, 111, 107, 103, 99, 95, 91, 87, 83, 79, 75, 71, 67,
        63, 59, 55, 51, 47, 43, 39, 35, 31, 27, 23, 19, 15, 11, 7, 3);
    for (int64_t j = 0; j < n; j += 64) {
        __m512i v[4];
        for (int i = 0; i < 4; ++i)
            v[i] = fp8_top16(_mm512_loadu_ps(x + j + 16 * i), vscale, fmax, min_normal, to_scaled, unscale,
                             up);
        const __m512i low = _mm512_permutex2var_epi8(v[0], top_bytes, v[1]);
        const __m512i high = _mm512_permutex2var_epi8(v[2], top_bytes, v[3]);
        const __m512i bytes = _mm512_inserti64x4(low, _mm512_castsi512_si256(high), 1);
        if (stream)
            _mm512_stream_si512((__m512i *)(o + j), bytes);
        else
            _mm512_storeu_si512(o + j, bytes);
    }
}
#else
#define HAVE_FP8_ROW512 0
INLINE void fp8_row512(const float *x, uint8_t *o, int64_t n, float scale, int kind, int stream) {
    fp8_row(x, o, n, scale, kind);
}
#endif
/* fp8_row with 256-bit vectors, for CPUs with AVX2 and FMA but not AVX-512, and n a multiple of 32. With
   AVX-512, GCC vectorises fp8_row itself (its mask registers if-convert the selects); with AVX2 alone it
   does not ("control flow in loop"), and fp8_row runs one float at a time: prefill-4k FP8 on a Zen 3 core
   took 51 ms against 6.2 ms for a copy of its bytes. Per 8 floats, fp8_top16's steps: the quotient q, the
   clamp c = min(max, |q|) (a NaN kept), DEFINE_FP8's FMA rounding, the code (a NaN's shifted bits are far
   past 0x7f). Per 32 floats, the narrowing: the four vectors of codes by two unsigned saturating packs (a
   NaN's code saturates to 0xff, whose low 7 bits are 0x7f), the four quotients by two signed ones (a
   negative int32, i.e. a set sign bit, saturates to a byte with bit 7 set, a positive one to one without),
   each in the same lane order; the byte is the code's low 7 bits with the quotient's sign, then one lane
   permute. Plain stores: streaming ones measured ~4% slower on a Zen 3 core at prefill-4k; so did, within
   the noise, rotating straight into the bytes with no scratch row, and a division by reciprocal and two
   Markstein corrections (the loop's time there is its memory, not its arithmetic). */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define HAVE_FP8_ROW256 1
typedef struct {
    __m256 scale, fmax, unscale;
    __m256i min_normal, to_scaled, order, low7;
    __m128i shift;
} fp8_consts;
INLINE fp8_consts fp8_consts_for(float scale, int kind) {
    fp8_consts k;
    k.scale = _mm256_set1_ps(scale);
    k.fmax = _mm256_set1_ps(kind == 1 ? 448.0f : 57344.0f);
    k.unscale = _mm256_set1_ps(kind == 1 ? 0x1p-120f : 0x1p-112f);
    k.min_normal = _mm256_set1_epi32(kind == 1 ? 0x3c800000 : 0x38800000);
    k.to_scaled = _mm256_set1_epi32((int)(kind == 1 ? (120u - 20u) << 23 : (112u - 21u) << 23));
    k.order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* the packs interleave 128-bit lanes */
    k.low7 = _mm256_set1_epi8(0x7f);
    k.shift = _mm_cvtsi32_si128(kind == 1 ? 20 : 21);
    return k;
}
INLINE __m256i fp8_code8(__m256 q, const fp8_consts *k) {
    const __m256 c = _mm256_min_ps(k->fmax, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), q)); /* NaN: kept */
    const __m256i field = _mm256_and_si256(_mm256_castps_si256(c), _mm256_set1_epi32(0x7f800000));
    const __m256i e = _mm256_max_epu32(field, k->min_normal);
    const __m256 m = _mm256_castsi256_ps(_mm256_sub_epi32(e, k->to_scaled));
    const __m256 r = _mm256_sub_ps(_mm256_fmadd_ps(c, k->unscale, m), m);
    return _mm256_srl_epi32(_mm256_castps_si256(r), k->shift);
}
/* The FP8 bytes of x0..x3 (32 floats, in order) divided by the scale, stored at o. */
INLINE void fp8_store32(uint8_t *o, __m256 x0, __m256 x1, __m256 x2, __m256 x3, const fp8_consts *k) {
    const __m256 q0 = _mm256_div_ps(x0, k->scale), q1 = _mm256_div_ps(x1, k->scale);
    const __m256 q2 = _mm256_div_ps(x2, k->scale), q3 = _mm256_div_ps(x3, k->scale);
    const __m256i codes = _mm256_packus_epi16(_mm256_packus_epi32(fp8_code8(q0, k), fp8_code8(q1, k)),
                                              _mm256_packus_epi32(fp8_code8(q2, k), fp8_code8(q3, k)));
    const __m256i signs = _mm256_packs_epi16(
        _mm256_packs_epi32(_mm256_castps_si256(q0), _mm256_castps_si256(q1)),
        _mm256_packs_epi32(_mm256_castps_si256(q2), _mm256_castps_si256(q3)));
    const __m256i bytes = _mm256_or_si256(_mm256_and_si256(codes, k->low7),
                                          _mm256_andnot_si256(k->low7, signs));
    _mm256_storeu_si256((__m256i *)o, _mm256_permutevar8x32_epi32(bytes, k->order));
}
INLINE void fp8_row256(const float *x, uint8_t *o, int64_t n, float scale, int kind) {
    const fp8_consts k = fp8_consts_for(scale, kind);
    for (int64_t j = 0; j < n; j += 32)
        fp8_store32(o + j, _mm256_loadu_ps(x + j), _mm256_loadu_ps(x + j + 8), _mm256_loadu_ps(x + j + 16),
                    _mm256_loadu_ps(x + j + 24), &k);
}
#else
#define HAVE_FP8_ROW256 0
INLINE void fp8_row256(const float *x, uint8_t *o, int64_t n, float scale, int kind) {
    fp8_row(x, o, n, scale, kind);
}
#endif
INLINE void prefetch_row(const void *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)p + off, 0, 3);
}

/* The first token whose slot (-1 aside) an earlier token has, -1 if none, -2 if it could not be checked (no
   memory): a launch plan's check, where two writes to one slot would race (ropekit.fused.plan's
   check_distinct_slots, in C: a decode-64 step 6 us -> well under 1). Slots lie in [-1, num_slots) here. */
#include <stdlib.h>
static int64_t first_repeated_slot(const int64_t *slots, int64_t tokens) {
    if (tokens <= 64) { /* a decode step: every pair (vectorised) */
        for (int64_t t = 1; t < tokens; ++t) {
            int hit = 0;
            for (int64_t u = 0; u < t; ++u) hit |= slots[u] == slots[t];
            if (hit && slots[t] >= 0) return t;
        }
        return -1;
    }
    int bits = 7;
    while (((int64_t)1 << bits) < 2 * tokens) ++bits;
    const uint64_t mask = ((uint64_t)1 << bits) - 1;
    int64_t *seen = malloc(sizeof(int64_t) << bits); /* open addressing, -1 marks a free place */
    if (!seen) return -2;
    memset(seen, 0xff, sizeof(int64_t) << bits);
    int64_t found = -1;
    for (int64_t t = 0; t < tokens && found < 0; ++t) {
        if (slots[t] < 0) continue;
        uint64_t h = ((uint64_t)slots[t] * 0x9e3779b97f4a7c15u) >> (64 - bits);
        while (seen[h] >= 0 && seen[h] != slots[t]) h = (h + 1) & mask;
        if (seen[h] == slots[t]) found = t;
        seen[h] = slots[t];
    }
    free(seen);
    return found;
}

/* Channel integers, CH_INTS per channel after the GLOBALS: */
enum { ON, ROTATE, BY_SLOT, KIND, HEADS, WIDTH, SRC_B, SRC_S, SRC_H, PAGE_SIZE, DST_P, DST_I, DST_H,
       SCALE_H, SRC_IS_DST, CH_INTS };
enum { GLOBALS = 11, POINTER_WORDS = 15 };

/* A launch plan's memory rule by byte ranges (ropekit.fused.planned): m = the count of pairs n, then n pairs
   of pointer words (i, j), then the span in bytes of each of the POINTER_WORDS words (first element to one
   past the last). 1 when some pair's ranges meet (the caller then decides exactly), 0 when none does. */
static int ranges_meet(const uint64_t *p, const int64_t *m) {
    const int64_t pairs = m[0];
    const int64_t *spans = m + 1 + 2 * pairs;
    for (int64_t n = 0; n < pairs; ++n) {
        const int64_t i = m[1 + 2 * n], j = m[2 + 2 * n];
        if (p[i] < p[j] + (uint64_t)spans[j] && p[j] < p[i] + (uint64_t)spans[i]) return 1;
    }
    return 0;
}

#define DEFINE_FUSED(NAME, T, LOAD, STORE, WIDE) \
/* One head: buf[0 : 2 half] = its rotation (when rotate), in float32; with load_tail, buf[2 half : width] = \
   the features that pass through. */ \
INLINE void NAME##_rotate(const T *x, float *buf, int64_t width, int64_t half, int rotate, \
                                 int interleaved, const float *c, const float *s, int load_tail) { \
    int64_t rot = rotate ? 2 * half : 0; \
    if (rotate && interleaved) { \
        for (int64_t i = 0; i < half; ++i) { \
            float a = LOAD(x[2 * i]), b = LOAD(x[2 * i + 1]); \
            buf[2 * i] = a * c[i] - b * s[i]; \
            buf[2 * i + 1] = b * c[i] + a * s[i]; \
        } \
    } else if (rotate) { \
        for (int64_t i = 0; i < half; ++i) { \
            float a = LOAD(x[i]), b = LOAD(x[i + half]); \
            buf[i] = a * c[i] - b * s[i]; \
            buf[i + half] = b * c[i] + a * s[i]; \
        } \
    } \
    if (load_tail) \
        for (int64_t j = rot; j < width; ++j) buf[j] = LOAD(x[j]); \
} \
/* Ask for head `later` of this token (src), or, past its last head, of the next token (next: NULL at the \
   end of the channel's tokens). */ \
INLINE void NAME##_prefetch(const T *src, const T *next, int64_t later, int64_t heads, int64_t src_h, \
                            int64_t row) { \
    if (later < heads) \
        prefetch_row(src + later * src_h, row); \
    else if (next && later - heads < heads) \
        prefetch_row(next + (later - heads) * src_h, row); \
} \
/* One token of one channel: its heads rotated and stored in the source dtype, or as FP8 bytes. */ \
INLINE void NAME##_token_body(const T *src, int64_t src_h, \
                         char *dst, int64_t dst_h, int64_t heads, \
                         int64_t width, int64_t half, int rotate, int interleaved, const float *c, \
                         const float *s, int kind, const float *scale, int64_t scale_h, const T *next, \
                         int mode) { \
    int64_t rot = rotate ? 2 * half : 0; \
    float buf[ROPEKIT_MAX_WIDTH]; /* a head of float32: width <= the bound (checked by the caller) */ \
    const int64_t row = width * (int64_t)sizeof(T), ahead = (PREFETCH_BYTES + row - 1) / row; \
    if (kind == 0 && mode != SCRATCH) { /* DIRECT or STREAM: no scratch row of float32, no prefetches */ \
        T row_out[STREAM_BYTES / sizeof(T)] __attribute__((aligned(64))); /* STREAM: a rotated head */ \
        for (int64_t h = 0; h < heads; ++h) { \
            const T *x = src + h * src_h; \
            T *o = (T *)dst + h * dst_h, *to = mode == STREAM && rotate ? row_out : o; \
            if (rotate && interleaved) { \
                for (int64_t i = 0; i < half; ++i) { \
                    float a = LOAD(x[2 * i]), b = LOAD(x[2 * i + 1]); \
                    to[2 * i] = STORE(a * c[i] - b * s[i]); \
                    to[2 * i + 1] = STORE(b * c[i] + a * s[i]); \
                } \
            } else if (rotate) { \
                /* iteration i reads x[i], x[i + half], writes those two alone, in place (to == x) or into \
                   memory no source meets (the memory rule): no store reaches another iteration's load */ \
                _Pragma("GCC ivdep") \
                for (int64_t i = 0; i < half; ++i) { \
                    float a = LOAD(x[i]), b = LOAD(x[i + half]); \
                    to[i] = STORE(a * c[i] - b * s[i]); \
                    to[i + half] = STORE(b * c[i] + a * s[i]); \
                } \
            } \
            if (mode == STREAM) { \
                if (rotate) memcpy(to + rot, x + rot, (size_t)(width - rot) * sizeof(T)); \
                stream_row(o, rotate ? row_out : x, row); \
            } else if ((const void *)x != (void *)o) { \
                memcpy(o + rot, x + rot, (size_t)(width - rot) * sizeof(T)); \
            } \
        } \
        return; \
    } \
    if (kind == 0) { \
        for (int64_t h = 0; h < heads; ++h) { \
            const T *x = src + h * src_h; \
            T *o = (T *)dst + h * dst_h; \
            NAME##_prefetch(src, next, h + ahead, heads, src_h, row); \
            NAME##_rotate(x, buf, width, half, rotate, interleaved, c, s, 0); \
            for (int64_t j = 0; j < rot; ++j) o[j] = STORE(buf[j]); \
            if ((const void *)x != (void *)o) memcpy(o + rot, x + rot, (size_t)(width - rot) * sizeof(T)); \
        } \
        return; \
    } \
    /* the wide loops' rows of 64-byte multiples: fp8_row512, streamed when every row starts a cache line */ \
    const int row512 = HAVE_FP8_ROW512 && (WIDE) && width % 64 == 0; \
    const int row256 = HAVE_FP8_ROW256 && width % 32 == 0; /* AVX2 alone: every loop, narrow or wide */ \
    const int stream = row512 && mode == SCRATCH && streamable(dst, width, dst_h); \
    for (int64_t h = 0; h < heads; ++h) { \
        NAME##_prefetch(src, next, h + ahead, heads, src_h, row); \
        NAME##_rotate(src + h * src_h, buf, width, half, rotate, interleaved, c, s, 1); \
        if (row512) \
            fp8_row512(buf, (uint8_t *)dst + h * dst_h, width, scale[h * scale_h], kind, stream); \
        else if (row256) \
            fp8_row256(buf, (uint8_t *)dst + h * dst_h, width, scale[h * scale_h], kind); \
        else \
            fp8_row(buf, (uint8_t *)dst + h * dst_h, width, scale[h * scale_h], kind); \
    } \
} \
/* The common head shapes as compile-time constants: the per-head loops then unroll without remainders, \
   which is most of the cost of the FP8 stores (measured: prefill-4k FP8 6.4 -> 4.5 ms on one thread). */ \
static void NAME##_token(const T *src, int64_t src_h, char *dst, int64_t dst_h, int64_t heads, \
                         int64_t width, int64_t half, int rotate, int interleaved, const float *c, \
                         const float *s, int kind, const float *scale, int64_t scale_h, const T *next, \
                         int mode) { \
    if (rotate && width == 128 && half == 64 && !interleaved) \
        NAME##_token_body(src, src_h, dst, dst_h, heads, 128, 64, 1, 0, c, s, kind, scale, scale_h, next, \
                          mode); \
    else if (rotate && width == 128 && half == 64) \
        NAME##_token_body(src, src_h, dst, dst_h, heads, 128, 64, 1, 1, c, s, kind, scale, scale_h, next, \
                          mode); \
    else if (rotate && width == 64 && half == 32 && !interleaved) \
        NAME##_token_body(src, src_h, dst, dst_h, heads, 64, 32, 1, 0, c, s, kind, scale, scale_h, next, \
                          mode); \
    else if (rotate && width == 64 && half == 32) \
        NAME##_token_body(src, src_h, dst, dst_h, heads, 64, 32, 1, 1, c, s, kind, scale, scale_h, next, \
                          mode); \
    else if (!rotate && width == 128) \
        NAME##_token_body(src, src_h, dst, dst_h, heads, 128, half, 0, 0, c, s, kind, scale, scale_h, next, \
                          mode); \
    else if (!rotate && width == 512) \
        NAME##_token_body(src, src_h, dst, dst_h, heads, 512, half, 0, 0, c, s, kind, scale, scale_h, next, \
                          mode); \
    else \
        NAME##_token_body(src, src_h, dst, dst_h, heads, width, half, rotate, interleaved, c, s, kind, \
                          scale, scale_h, next, mode); \
} \
/* One thread's share (tokens [part * tokens / parts, (part + 1) * tokens / parts)) of every channel, each \
   channel one pass over its tokens: one stream read and one written at a time, which the prefetchers \
   follow better than three interleaved streams (measured: ~25% faster at prefill). The channels read and \
   write disjoint memory (the fused ops check it), so a thread moves on to the next channel at once. */ \
static void NAME##_channels(const uint64_t *p, const int64_t *a, int direct, int64_t part, int64_t parts) { \
    const int64_t seq = a[1], half = a[2], cos_stride = a[4], sin_stride = a[5], offset = (int64_t)p[13]; \
    const int interleaved = (int)a[6]; \
    const float *cos = (const float *)p[0], *sin = (const float *)p[1]; \
    const int64_t *pos = (const int64_t *)p[2], *slots = (const int64_t *)p[3]; \
    const float sign = a[7] ? -1.0f : 1.0f; /* conjugate */ \
    const int64_t tokens = a[0] * seq, first = part * tokens / parts, end = (part + 1) * tokens / parts; \
    for (int ch = 0; ch < 3; ++ch) { \
        const int64_t *ca = a + GLOBALS + ch * CH_INTS; \
        if (!ca[ON]) continue; \
        const int kind = (int)ca[KIND], rotate = (int)ca[ROTATE]; \
        const size_t esize = kind ? 1 : sizeof(T); \
        const float *scale = (const float *)p[6 + 3 * ch]; \
        for (int64_t token = first; token < end; ++token) { \
            int64_t slot = ca[BY_SLOT] ? slots[token] : token; \
            if (slot < 0) continue; \
            int64_t b = token / seq, t = token % seq; \
            int64_t row = pos ? pos[token] : offset + t; \
            const float *c = cos + row * cos_stride; \
            float s[ROPEKIT_MAX_HALF]; \
            if (rotate) \
                for (int64_t i = 0; i < half; ++i) s[i] = sign * sin[row * sin_stride + i]; \
            char *dst = (char *)p[5 + 3 * ch] + \
                esize * (size_t)((slot / ca[PAGE_SIZE]) * ca[DST_P] + (slot % ca[PAGE_SIZE]) * ca[DST_I]); \
            const T *src = ca[SRC_IS_DST] ? (const T *)dst \
                                          : (const T *)p[4 + 3 * ch] + b * ca[SRC_B] + t * ca[SRC_S]; \
            int64_t src_h = ca[SRC_IS_DST] ? ca[DST_H] : ca[SRC_H]; \
            const T *next = NULL; /* the next token's source, for the prefetches (a source of its own) */ \
            if (!ca[SRC_IS_DST] && token + 1 < tokens) \
                next = (const T *)p[4 + 3 * ch] + ((token + 1) / seq) * ca[SRC_B] \
                       + ((token + 1) % seq) * ca[SRC_S]; \
            const int mode = !direct ? SCRATCH \
                             : ca[BY_SLOT] && streamable(dst, ca[WIDTH] * sizeof(T), ca[DST_H] * sizeof(T)) \
                             ? STREAM : DIRECT; \
            NAME##_token(src, src_h, dst, ca[DST_H], ca[HEADS], ca[WIDTH], half, rotate, interleaved, c, s, \
                         kind, scale, ca[SCALE_H], next, mode); \
        } \
        stream_fence(); /* this thread's streaming stores are ordered before it goes on */ \
    } \
} \
/* p: cos, sin, positions, slots, then (src, dst, scale) per channel, then the int offset, then a pointer \
   read by the memory rule alone (per-sequence offsets; 15 words, what changes from call to call). a: \
   GLOBALS, then CH_INTS per channel (fixed by the launch's layout), then the memory rule's pairs and spans \
   (ranges_meet; a count of 0: none). Returns -1 when done; t >= 0: token t's table row is outside \
   [0, table_len); -2 - t: token t's slot is outside [-1, num_slots); INT64_MIN: half or a channel's \
   width is past its bound (the scratch rows' fixed size); REPEATED (with a[10] set): a slot is given \
   twice, or that could not be checked; MEETS: the byte ranges of a written tensor and another meet. \
   Nothing is written when it returns an error. */ \
int64_t NAME(const uint64_t *p, const int64_t *a) { \
    const int64_t batch = a[0], seq = a[1], half = a[2], table_len = a[3], offset = (int64_t)p[13]; \
    const int64_t num_slots = a[9], threads = a[8]; \
    const int64_t *pos = (const int64_t *)p[2], *slots = (const int64_t *)p[3]; \
    const int64_t tokens = batch * seq; \
    if (half < 1 || half > ROPEKIT_MAX_HALF) return INT64_MIN; \
    if (ranges_meet(p, a + GLOBALS + 3 * CH_INTS)) return MEETS; \
    for (int ch = 0; ch < 3; ++ch) { \
        const int64_t *ca = a + GLOBALS + ch * CH_INTS; \
        const int64_t w = ca[WIDTH]; \
        if (ca[ON] && (w < 1 || w > ROPEKIT_MAX_WIDTH || (ca[ROTATE] && 2 * half > w))) return INT64_MIN; \
    } \
    { \
        int64_t bad = first_bad_row(pos, tokens, offset, seq, table_len); \
        if (bad >= 0) return bad; \
    } \
    if (slots) \
        for (int64_t token = 0; token < tokens; ++token) \
            if (slots[token] < -1 || slots[token] >= num_slots) return -2 - token; \
    if (slots && a[10] && first_repeated_slot(slots, tokens) != -1) return REPEATED; \
    int64_t elements = 0; \
    for (int ch = 0; ch < 3; ++ch) { \
        const int64_t *ca = a + GLOBALS + ch * CH_INTS; \
        if (ca[ON]) elements += ca[HEADS] * ca[WIDTH]; \
    } \
    const int direct = elements * tokens <= DIRECT_ELEMENTS; \
    /* One parallel region serves the three channels (one fork and join per call); one thread never enters \
       OpenMP (its team set-up was about half of a decode-1 step's C time). */ \
    if (threads > 1) { \
        _Pragma("omp parallel num_threads(threads)") \
        NAME##_channels(p, a, direct, omp_get_thread_num(), omp_get_num_threads()); \
    } else { \
        NAME##_channels(p, a, direct, 0, 1); \
    } \
    return -1; \
}

DEFINE_FUSED(fused_f32_narrow, float, F32_LOAD, F32_STORE, 0)
DEFINE_FUSED(fused_f16_narrow, _Float16, F16_LOAD, F16_STORE, 0)
DEFINE_FUSED(fused_bf16_narrow, uint16_t, bf16_load, bf16_store, 0)
#if defined(__GNUC__) && !defined(__clang__)
/* The same loops with 512-bit vectors where the CPU has them (GCC's default on Intel is 256), run only for
   FP8 stores of at least WIDE_ELEMENTS: prefill FP8 is compute-bound, ~13% faster so. Not for every call:
   after 512-bit arithmetic the core runs slower for a while (the AVX-512 frequency licence), and with
   every call wide, decode steps of the whole process measured ~15% slower (rope + cache decode-1 10.6 ->
   12.7 us). */
#pragma GCC push_options
#pragma GCC target("prefer-vector-width=512")
DEFINE_FUSED(fused_f32_wide, float, F32_LOAD, F32_STORE, 1)
DEFINE_FUSED(fused_f16_wide, _Float16, F16_LOAD, F16_STORE, 1)
DEFINE_FUSED(fused_bf16_wide, uint16_t, bf16_load, bf16_store, 1)
#pragma GCC pop_options
#define WIDE_ELEMENTS ((int64_t)1 << 22)
static int wide(const int64_t *a) {
    int64_t fp8 = 0;
    for (int ch = 0; ch < 3; ++ch) {
        const int64_t *ca = a + GLOBALS + ch * CH_INTS;
        if (ca[ON] && ca[KIND]) fp8 += ca[HEADS] * ca[WIDTH];
    }
    return fp8 * a[0] * a[1] >= WIDE_ELEMENTS;
}
#define DEFINE_ENTRY(NAME) \
int64_t NAME(const uint64_t *p, const int64_t *a) { \
    return wide(a) ? NAME##_wide(p, a) : NAME##_narrow(p, a); \
}
#else
#define DEFINE_ENTRY(NAME) \
int64_t NAME(const uint64_t *p, const int64_t *a) { return NAME##_narrow(p, a); }
#endif
DEFINE_ENTRY(fused_f32)
DEFINE_ENTRY(fused_f16)
DEFINE_ENTRY(fused_bf16)
"""
)

_ENTRY = {torch.float32: "fused_f32", torch.float16: "fused_f16", torch.bfloat16: "fused_bf16"}
_GLOBALS = struct.Struct("11q")  # batch, seq, half, table_len, strides, flags, threads, num_slots, distinct
_CHANNEL = struct.Struct("15q")
# The pointers, the int offset, then a pointer the memory rule alone reads: what a repeated launch changes.
_POINTERS = struct.Struct("13QqQ")
_POINTER_WORDS = 15
_OFF = _CHANNEL.pack(*[0] * 15)
_NO_MEMORY_CHECK = struct.pack("q", 0)  # the memory rule's block with no pairs: the loop checks none
_BAD_WIDTH = -(1 << 63)  # INT64_MIN: the C loop's answer for a width past its bounds
MEETS = _BAD_WIDTH + 2  # the loop's answer when a pair's byte ranges meet (nothing written)

_LIBRARY = CLibrary(
    stem="fused_cpu",
    source=_SOURCE,
    entries=_ENTRY,
    argtypes=(ctypes.c_char_p, ctypes.c_char_p),
    refusal="backend: 'cpu' cannot serve the fused op",
    description="the fused C loop",
)


def unavailable_reason() -> str | None:
    """None once the fused C loop is loaded (it is built now if need be), else why it could not be built."""
    return None if _LIBRARY.functions else _LIBRARY.load()  # per call: one attribute read once loaded


def _channel_ints(ch, num_slots_holder: list[int]) -> tuple[bytes, tuple[int, int, int]]:
    if ch is None:
        return _OFF, (0, 0, 0)
    dst = ch.dst
    pages, page_size, heads, width = dst.shape
    if ch.by_slot:
        num_slots_holder.append(pages * page_size)
    src = ch.src
    sb, ss, sh = (0, 0, 0) if src is None else src.stride()[:3]
    dp, di, dh = dst.stride()[:3]
    scale = ch.scale
    ints = _CHANNEL.pack(
        1, ch.rotate, ch.by_slot, ch.fp8, heads, width, sb, ss, sh, page_size, dp, di, dh,
        0 if scale is None or scale.shape[0] == 1 else 1, src is None,
    )  # fmt: skip
    ptrs = (0 if src is None else src.data_ptr(), dst.data_ptr(), 0 if scale is None else scale.data_ptr())
    return ints, ptrs


def launch(plan: FusedLaunch, *, checked: bool = False) -> None:
    """Run the fused C loop on CPU tensors.

    checked=True: the caller built plan from arguments it checked itself (the :mod:`ropekit.fused` ops), so
    :func:`~ropekit.backends.fused_launch.check_launch` is not run twice; the C loop still checks every table
    row and slot before it writes.

    Raises:
        ValueError: anything :func:`~ropekit.backends.fused_launch.check_launch` rejects, a table row outside
            the table or a slot outside [-1, num_slots) (both checked before any write).
    """
    if not checked:
        check_launch(plan)
    else:  # the fused ops checked the rest; the C loop's bounds hold on this path too
        check_bounds(plan)
    if plan.cos.device.type != "cpu":
        raise ValueError(f"q: expected CPU tensors for the C kernel, got tensors on {plan.cos.device}")
    table_len, half = plan.cos.shape
    num_slots: list[int] = []
    chans = [_channel_ints(ch, num_slots) for ch in plan.channels]
    if len(set(num_slots)) > 1:
        raise ValueError(f"v_cache: expected as many slots as k_cache ({num_slots[0]}), got {num_slots[1]}")
    tokens = plan.batch * plan.seq
    work = sum(ch.dst.shape[2] * ch.dst.shape[3] for ch in plan.channels if ch is not None) * tokens
    ints = _GLOBALS.pack(
        plan.batch, plan.seq, half, table_len, plan.cos.stride(0), plan.sin.stride(0),
        plan.interleaved, plan.conjugate,
        torch.get_num_threads() if work >= PARALLEL_THRESHOLD else 1,
        num_slots[0] if num_slots else 0,
        0,  # distinct slots: the fused ops check them before they launch
    ) + b"".join(c[0] for c in chans) + _NO_MEMORY_CHECK  # fmt: skip
    pointers = _POINTERS.pack(
        plan.cos.data_ptr(),
        plan.sin.data_ptr(),
        0 if plan.positions is None else plan.positions.data_ptr(),
        0 if plan.slots is None or not num_slots else plan.slots.data_ptr(),  # unused: no by-slot channel
        *(ptr for c in chans for ptr in c[1]),
        plan.offset,
        0,
    )
    bad = (_LIBRARY.functions or _LIBRARY.require())[plan.dtype](pointers, ints)
    if bad == _BAD_WIDTH:  # check_bounds ran first: reached only if the two bounds ever disagree
        raise ValueError(f"a head wider than the C loop's scratch row ({MAX_WIDTH} floats): nothing written")
    if bad >= 0:
        position = int(plan.positions[bad]) if plan.positions is not None else plan.offset + bad
        raise row_error(position, table_len, bad if plan.positions is not None else None)
    if bad < -1:
        token = -2 - bad
        raise slot_error(int(plan.slots[token]), num_slots[0], token)


def plan(like: FusedLaunch, memory: tuple[tuple[tuple[int, int], ...], dict[int, int]] | None = None):
    """The C loop bound to everything of a launch like ``like`` but its data and its int offset: a repeated
    launch (:mod:`ropekit.fused.planned`) packs 13 pointers and its offset and calls the loop (the integer
    block is packed once).

    memory: the memory rule the loop checks first, by byte ranges: (pairs of pointer words, {pointer word:
    its span in bytes}); word 14 is the ``extra`` pointer of run, read by this check alone. None: no check.

    Returns run(pointers, offset, extra=0, check_memory=True) -> the loop's code: -1 done; :data:`MEETS`: the
    byte ranges of a pair met (check_memory); otherwise a table row or a slot was out of range, or a slot was
    given twice (-1 aside; the loop checks it here, where the checked path checks it itself); in every case
    but -1 nothing was written (the caller decides exactly, or its checked path reports it). pointers: cos,
    sin, positions (0: rows offset + arange(seq)), slots, then (source, destination, scale) per channel (0
    where absent), laid out exactly as ``like``'s tensors (same shapes and strides).
    """
    function = (_LIBRARY.functions or _LIBRARY.require())[like.dtype]
    table_len, half = like.cos.shape
    num_slots: list[int] = []
    channels = b"".join(_channel_ints(ch, num_slots)[0] for ch in like.channels)
    work = sum(ch.dst.shape[2] * ch.dst.shape[3] for ch in like.channels if ch is not None)
    parallel = work * like.batch * like.seq >= PARALLEL_THRESHOLD
    ints = (like.batch, like.seq, half, table_len, like.cos.stride(0), like.sin.stride(0), like.interleaved,
            like.conjugate)  # fmt: skip
    slots = num_slots[0] if num_slots else 0
    if memory is None:
        checks = _NO_MEMORY_CHECK
    else:
        pairs, spans = memory
        words = [len(pairs), *(w for pair in pairs for w in pair)]
        words += [spans.get(w, 0) for w in range(_POINTER_WORDS)]
        checks = struct.pack(f"{len(words)}q", *words)
    # (threads, check_memory) -> the integer block
    blocks = {
        (threads, check): _GLOBALS.pack(*ints, threads, slots, 1) + channels
        + (checks if check else _NO_MEMORY_CHECK)
        for threads in (1,)
        for check in (True, False)
    }  # fmt: skip
    single, single_unchecked, pack_pointers = blocks[1, True], blocks[1, False], _POINTERS.pack

    def run(pointers: tuple[int, ...], offset: int, extra: int = 0, check_memory: bool = True) -> int:
        if not parallel:
            return function(
                pack_pointers(*pointers, offset, extra), single if check_memory else single_unchecked
            )
        threads = torch.get_num_threads()
        block = blocks.get((threads, check_memory)) or blocks.setdefault(
            (threads, check_memory),
            _GLOBALS.pack(*ints, threads, slots, 1)
            + channels
            + (checks if check_memory else _NO_MEMORY_CHECK),
        )
        return function(pack_pointers(*pointers, offset, extra), block)

    return run
