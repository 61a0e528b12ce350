"""The C loop for QK-RMSNorm + RoPE on a packed qkv buffer, in place (see :mod:`ropekit.fused.qk_norm`).

One pass per token: the q heads and the k heads of the token are each read once, normalised in float32,
multiplied by their weight, rounded to the storage dtype where Hugging Face rounds, rotated with the token's
cos/sin row and written back; v is never touched. The unfused sequence (an RMSNorm, then a rotation) reads
and writes q and k twice.

Built by :mod:`ropekit.backends.c.build` (the same flags: no FMA contraction, nearest-even
rounding stores), so the rotation of a given normalised value is bit for bit the torch backend's. The sum of
squares runs in eight float32 lanes (a fixed order, so results do not depend on threads); its rounding differs
from ``torch.mean`` by an ulp or so of float32.
"""

from __future__ import annotations

import ctypes
import struct
from typing import NamedTuple

import torch

from ropekit.backends.c.build import C_PRELUDE, PARALLEL_THRESHOLD, CLibrary
from ropekit.backends.kernel_op import row_error

__all__ = ["MAX_HEAD_DIM", "MAX_PART_FEATURES", "NormSpec", "launch", "plan", "unavailable_reason"]


class NormSpec(NamedTuple):
    """What the kernels need to know about the norm and the packing, checked once by the public call.

    Attributes:
        q_heads, k_heads, head_dim: the packing: q is features [0, q_heads * head_dim) of a token row, k
            the next k_heads * head_dim; the rest (v) is never touched.
        eps: added to the mean square (> 0).
        weight_offset: the weight is ``w + weight_offset`` (Gemma's ``1 + w`` is 1.0).
        all_heads: the mean square runs over all heads of q (of k) together, OLMo 2's form, with weights of
            q_heads * head_dim (k_heads * head_dim) features; otherwise over each head, weights (head_dim,).
        cast_before_weight: round the normalised value to the storage dtype before the weight multiplies it
            (Qwen3 / Llama RMSNorm); otherwise multiply in float32 and round once (Gemma 3, OLMo 2).
        interleaved: pair layout of the rotation (GPT-J when True, GPT-NeoX / HF halves when False).
    """

    q_heads: int
    k_heads: int
    head_dim: int
    eps: float
    weight_offset: float
    all_heads: bool
    cast_before_weight: bool
    interleaved: bool


# The C loop keeps a head of float32 per thread in a scratch row of MAX_HEAD_DIM floats on its stack (64 KB),
# and the weights plus weight_offset on the heap (OLMo 2's weights span every head); wider inputs take torch.
MAX_HEAD_DIM = 1 << 14
MAX_PART_FEATURES = 1 << 16

_SOURCE = (
    C_PRELUDE
    + f"#define ROPEKIT_MAX_HEAD_DIM {MAX_HEAD_DIM}\n#define ROPEKIT_MAX_PART_FEATURES {MAX_PART_FEATURES}\n"
    + r"""
#include <math.h>
#include <stdlib.h>


/* Sum of squares of n values in eight float32 lanes, then the lanes in order: a fixed order. */
static inline float sum_squares(const float *x, int64_t n) {
    v8f acc = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t whole = n - n % 8;
    for (int64_t i = 0; i < whole; i += 8) {
        v8f v;
        memcpy(&v, x + i, 32);
        acc += v * v;
    }
    float total = 0.0f;
    for (int j = 0; j < 8; ++j) total += acc[j];
    for (int64_t i = whole; i < n; ++i) total += x[i] * x[i];
    return total;
}

/* a: {stride_b, stride_s, batch, seq, q_heads, k_heads, head_dim, half, cos_stride, sin_stride, table_len,
   offset, interleaved, all_heads, cast_before_weight, threads}; f: {eps, weight_offset}. */
/* y(v, w): the normalised value times its weight, rounded where the model rounds (Qwen3 rounds the
   normalised value first), as the storage dtype holds it; it is then rotated in float32 and rounded once. */
#define QK_Y(LOAD, STORE, v, wv) \
    (cast_before ? LOAD(STORE(LOAD(STORE((v) * r)) * (wv))) : LOAD(STORE((v) * r * (wv))))

/* a: {stride_b, stride_s, batch, seq, q_heads, k_heads, head_dim, half, cos_stride, sin_stride, table_len,
   offset, interleaved, all_heads, cast_before_weight, threads}; f: {eps, weight_offset}. w: the weights with
   weight_offset added. */
#define DEFINE_QK_NORM(NAME, T, LOAD, STORE) \
static inline __attribute__((always_inline)) void NAME##_heads( \
        T *restrict x, int64_t heads, int64_t head_dim, int64_t half, const float *restrict w, \
        int all_heads, float eps, int cast_before, int interleaved, const float *restrict c, \
        const float *restrict s, const T *next) { \
    float xf[ROPEKIT_MAX_HEAD_DIM]; /* head_dim <= the bound (checked on entry) */ \
    float r = 0.0f; \
    if (all_heads) { /* OLMo 2: one mean square over every head, the heads' sums added in order */ \
        float total = 0.0f; \
        for (int64_t h = 0; h < heads; ++h) { \
            for (int64_t d = 0; d < head_dim; ++d) xf[d] = LOAD(x[h * head_dim + d]); \
            total += sum_squares(xf, head_dim); \
        } \
        r = 1.0f / sqrtf(total / (float)(heads * head_dim) + eps); \
    } \
    for (int64_t h = 0; h < heads; ++h) { \
        T *restrict out = x + h * head_dim; \
        const float *restrict wh = w + (all_heads ? h * head_dim : 0); \
        if (next) /* the same head of the next token: its lines arrive while this one computes */ \
            for (int64_t d = 0; d < head_dim; d += 64 / (int64_t)sizeof(T)) \
                __builtin_prefetch(next + h * head_dim + d, 1, 3); \
        for (int64_t d = 0; d < head_dim; ++d) xf[d] = LOAD(out[d]); \
        if (!all_heads) r = 1.0f / sqrtf(sum_squares(xf, head_dim) / (float)head_dim + eps); \
        if (interleaved) { \
            for (int64_t i = 0; i < half; ++i) { \
                float a = QK_Y(LOAD, STORE, xf[2 * i], wh[2 * i]); \
                float b = QK_Y(LOAD, STORE, xf[2 * i + 1], wh[2 * i + 1]); \
                out[2 * i] = STORE(a * c[i] - b * s[i]); \
                out[2 * i + 1] = STORE(b * c[i] + a * s[i]); \
            } \
        } else { \
            for (int64_t i = 0; i < half; ++i) { \
                float a = QK_Y(LOAD, STORE, xf[i], wh[i]); \
                float b = QK_Y(LOAD, STORE, xf[i + half], wh[i + half]); \
                out[i] = STORE(a * c[i] - b * s[i]); \
                out[i + half] = STORE(b * c[i] + a * s[i]); \
            } \
        } \
        for (int64_t d = 2 * half; d < head_dim; ++d) out[d] = STORE(QK_Y(LOAD, STORE, xf[d], wh[d])); \
    } \
} \
/* The common head sizes get their own copy of the loop, with constant trip counts the compiler unrolls and \
   vectorises without remainder handling: at head_dim 128 that overhead cost more than the arithmetic. */ \
static void NAME##_part(T *x, int64_t heads, int64_t head_dim, int64_t half, const float *w, int all_heads, \
                        float eps, int cast_before, int interleaved, const float *c, const float *s, \
                        const T *next) { \
    if (head_dim == 128 && half == 64) \
        NAME##_heads(x, heads, 128, 64, w, all_heads, eps, cast_before, interleaved, c, s, next); \
    else if (head_dim == 64 && half == 32) \
        NAME##_heads(x, heads, 64, 32, w, all_heads, eps, cast_before, interleaved, c, s, next); \
    else if (head_dim == 256 && half == 128) \
        NAME##_heads(x, heads, 256, 128, w, all_heads, eps, cast_before, interleaved, c, s, next); \
    else \
        NAME##_heads(x, heads, head_dim, half, w, all_heads, eps, cast_before, interleaved, c, s, next); \
} \
/* Returns -1 when done, -2 when head_dim, half or a part's features are past the bounds (or the weights' \
   scratch cannot be allocated), else the first token whose table row is outside [0, table_len); nothing is \
   written then. */ \
int64_t NAME(void *qkv, const float *wq, const float *wk, const float *cos, const float *sin, \
             const int64_t *pos, const int64_t *a, const double *f) { \
    const int64_t stride_b = a[0], stride_s = a[1], batch = a[2], seq = a[3], q_heads = a[4]; \
    const int64_t k_heads = a[5], head_dim = a[6], half = a[7], cos_stride = a[8], sin_stride = a[9]; \
    const int64_t table_len = a[10], offset = a[11]; \
    const int interleaved = (int)a[12], all_heads = (int)a[13], cast_before = (int)a[14]; \
    const int threads = (int)a[15]; \
    const float eps = (float)f[0], weight_offset = (float)f[1]; \
    int64_t tokens = batch * seq; \
    if (head_dim < 1 || head_dim > ROPEKIT_MAX_HEAD_DIM || half < 1 || 2 * half > head_dim || q_heads < 1 \
        || k_heads < 1 || q_heads > ROPEKIT_MAX_PART_FEATURES / head_dim \
        || k_heads > ROPEKIT_MAX_PART_FEATURES / head_dim) \
        return -2; \
    { \
        int64_t bad = first_bad_row(pos, tokens, offset, seq, table_len); \
        if (bad >= 0) return bad; \
    } \
    int64_t nq = all_heads ? q_heads * head_dim : head_dim, nk = all_heads ? k_heads * head_dim : head_dim; \
    /* w + weight_offset in float32, once per call (Gemma's 1.0 + w.float()), on the heap: OLMo 2's span \
       every head */ \
    float *wq2 = (float *)malloc((size_t)(nq + nk) * sizeof(float)); \
    if (!wq2) return -2; \
    float *wk2 = wq2 + nq; \
    for (int64_t i = 0; i < nq; ++i) wq2[i] = wq[i] + weight_offset; \
    for (int64_t i = 0; i < nk; ++i) wk2[i] = wk[i] + weight_offset; \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1)") \
    for (int64_t token = 0; token < tokens; ++token) { \
        int64_t b = token / seq, t = token % seq; \
        int64_t row = pos ? pos[token] : offset + t; \
        T *x = (T *)qkv + b * stride_b + t * stride_s; \
        const T *next = NULL; /* the next token's row, to prefetch (none past the last) */ \
        if (token + 1 < tokens) next = (const T *)qkv + (t + 1 < seq ? b * stride_b + (t + 1) * stride_s \
                                                                     : (b + 1) * stride_b); \
        const float *c = cos + row * cos_stride, *s = sin + row * sin_stride; \
        NAME##_part(x, q_heads, head_dim, half, wq2, all_heads, eps, cast_before, interleaved, c, s, next); \
        NAME##_part(x + q_heads * head_dim, k_heads, head_dim, half, wk2, all_heads, eps, cast_before, \
                    interleaved, c, s, next ? next + q_heads * head_dim : NULL); \
    } \
    free(wq2); \
    return -1; \
}

DEFINE_QK_NORM(qk_norm_rotary_f32, float, F32_LOAD, F32_STORE)
DEFINE_QK_NORM(qk_norm_rotary_f16, _Float16, F16_LOAD, F16_STORE)
DEFINE_QK_NORM(qk_norm_rotary_bf16, uint16_t, bf16_load, bf16_store)
"""
)

_ENTRY = {torch.float32: "qk_norm_rotary_f32", torch.float16: "qk_norm_rotary_f16",
          torch.bfloat16: "qk_norm_rotary_bf16"}  # fmt: skip
SUPPORTED_DTYPES = tuple(_ENTRY)
# qkv, wq, wk, cos, sin, positions, the integer arguments (one int64 array) and the two floats (doubles).
_ARGTYPES = (ctypes.c_void_p,) * 8
_INT_ARGS = struct.Struct("16q")
_FLOAT_ARGS = struct.Struct("2d")

_LIBRARY = CLibrary(
    stem="qk_norm_cpu",
    source=_SOURCE,
    entries=_ENTRY,
    argtypes=_ARGTYPES,
    refusal="backend: 'cpu' cannot serve these inputs",
    description="the QK-norm C loop",
)


def unavailable_reason(spec: NormSpec) -> str | None:
    """None if the C loop can serve this packing, else why not (then the torch path serves it)."""
    if spec.head_dim > MAX_HEAD_DIM:
        return f"head_dim {spec.head_dim} is wider than the C loop serves ({MAX_HEAD_DIM})"
    if max(spec.q_heads, spec.k_heads) * spec.head_dim > MAX_PART_FEATURES:
        return f"q or k rows of more than {MAX_PART_FEATURES} features are wider than the C loop serves"
    return None if _LIBRARY.functions else _LIBRARY.load()  # per call: one attribute read once loaded


def launch(qkv, q_weight, k_weight, cos, sin, positions, offset, spec: NormSpec) -> None:
    """Normalise and rotate q and k of qkv (batch, seq, width) in place with the C loop.

    Trusts what :func:`ropekit.fused.qk_norm.qk_norm_rotary_` checked (shapes, dtypes, strides, weights as
    contiguous float32); checks the table rows itself, on the host, before it writes anything.

    Args:
        qkv: CPU (batch, seq, width) view, last stride 1, dtype float32, float16 or bfloat16.
        q_weight, k_weight: contiguous float32 weights: (head_dim,), or (heads * head_dim,) with all_heads.
        cos, sin: float32 (table_len, half) with unit last stride.
        positions: contiguous int64 (batch * seq,), or None for rows offset + arange(seq).
        spec: the norm and packing (:class:`NormSpec`).

    Raises:
        ValueError: a table row outside the table (nothing is written), or the C loop cannot be built.
    """
    function = (_LIBRARY.functions or _LIBRARY.require())[qkv.dtype]
    batch, seq, _ = qkv.shape
    table_len, half = cos.shape
    work = batch * seq * (spec.q_heads + spec.k_heads) * spec.head_dim
    ints = _INT_ARGS.pack(
        qkv.stride(0), qkv.stride(1), batch, seq, spec.q_heads, spec.k_heads, spec.head_dim, half,
        cos.stride(0), sin.stride(0), table_len, offset, spec.interleaved, spec.all_heads,
        spec.cast_before_weight, torch.get_num_threads() if work >= PARALLEL_THRESHOLD else 1,
    )  # fmt: skip
    floats = _FLOAT_ARGS.pack(spec.eps, spec.weight_offset)
    bad = function(
        qkv.data_ptr(),
        q_weight.data_ptr(),
        k_weight.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        None if positions is None else positions.data_ptr(),
        ints,
        floats,
    )
    if bad == -2:  # unavailable_reason bounds the packing first: reached only if the bounds ever disagree
        raise ValueError(
            f"qkv: expected head_dim <= {MAX_HEAD_DIM} and q / k rows of <= {MAX_PART_FEATURES} features for "
            f"the C loop (or its weights' scratch could not be allocated): nothing written"
        )
    if bad >= 0:
        position = int(positions[bad]) if positions is not None else offset + bad
        raise row_error(position, table_len, bad if positions is not None else None)


def plan(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: NormSpec):
    """The C loop bound to everything of a launch like :func:`launch` on these tensors but their data and the
    int offset (:mod:`ropekit.fused.planned`; the library is built).

    Returns run(qkv, q_weight, k_weight, cos, sin, positions, offset) -> the loop's code, pointers given as
    ints (positions None: rows offset + arange(seq)): -1 done, else the token whose table row is outside the
    table, with nothing written.
    """
    function = (_LIBRARY.functions or _LIBRARY.require())[qkv.dtype]
    batch, seq, _ = qkv.shape
    table_len, half = cos.shape
    parallel = batch * seq * (spec.q_heads + spec.k_heads) * spec.head_dim >= PARALLEL_THRESHOLD
    head = (qkv.stride(0), qkv.stride(1), batch, seq, spec.q_heads, spec.k_heads, spec.head_dim, half,
            cos.stride(0), sin.stride(0), table_len)  # fmt: skip
    flags = (spec.interleaved, spec.all_heads, spec.cast_before_weight)
    floats = _FLOAT_ARGS.pack(spec.eps, spec.weight_offset)
    pack_ints = _INT_ARGS.pack

    def run(qkv, q_weight, k_weight, cos, sin, positions, offset) -> int:
        threads = torch.get_num_threads() if parallel else 1
        ints = pack_ints(*head, offset, *flags, threads)
        return function(qkv, q_weight, k_weight, cos, sin, positions, ints, floats)

    return run
