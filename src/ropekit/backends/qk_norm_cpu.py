"""The C loop for QK-RMSNorm + RoPE on a packed qkv buffer, in place (see :mod:`ropekit.fused.qk_norm`).

One pass per token: the q heads and the k heads of the token are each read once, normalised in float32,
multiplied by their weight, rounded to the storage dtype where Hugging Face rounds, rotated with the token's
cos/sin row and written back; v is never touched. The unfused sequence (an RMSNorm, then a rotation) reads
and writes q and k twice.

Built with :func:`ropekit.backends.cpu.build_library` (the same flags: no FMA contraction, nearest-even
rounding stores), so the rotation of a given normalised value is bit for bit the torch backend's. The sum of
squares runs in eight float32 lanes (a fixed order, so results do not depend on threads); its rounding differs
from ``torch.mean`` by an ulp or so of float32.
"""

from __future__ import annotations

import ctypes
import logging
import struct
from typing import NamedTuple

import torch

from ropekit.backends.cpu import PARALLEL_THRESHOLD, build_library
from ropekit.backends.kernel_op import row_error

__all__ = ["NormSpec", "launch"]

log = logging.getLogger("ropekit.backends")


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


_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_load(uint16_t h) {
    uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t bf16_store(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);  /* round to nearest even */
    return (uint16_t)(u >> 16);
}
typedef float v8f __attribute__((vector_size(32)));
#define F32_LOAD(v) (v)
#define F32_STORE(v) (v)
#define F16_LOAD(v) ((float)(v))
#define F16_STORE(v) ((_Float16)(v))

/* Sum of squares of n values in eight float32 lanes, then the lanes in order: a fixed order. */
static float sum_squares(const float *x, int64_t n) {
    v8f acc = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f v;
        memcpy(&v, x + i, 32);
        acc += v * v;
    }
    float total = 0.0f;
    for (int j = 0; j < 8; ++j) total += acc[j];
    for (; i < n; ++i) total += x[i] * x[i];
    return total;
}

/* a: {stride_b, stride_s, batch, seq, q_heads, k_heads, head_dim, half, cos_stride, sin_stride, table_len,
   offset, interleaved, all_heads, cast_before_weight, threads}; f: {eps, weight_offset}. */
#define DEFINE_QK_NORM(NAME, T, LOAD, STORE) \
static void NAME##_part(T *x, int64_t heads, int64_t head_dim, int64_t half, const float *w, int all_heads, \
                        float eps, float offset, int cast_before, int interleaved, const float *c, \
                        const float *s) { \
    int64_t width = heads * head_dim; \
    float xf[width], y[head_dim]; \
    for (int64_t j = 0; j < width; ++j) xf[j] = LOAD(x[j]); \
    float r_all = all_heads ? 1.0f / sqrtf(sum_squares(xf, width) / (float)width + eps) : 0.0f; \
    for (int64_t h = 0; h < heads; ++h) { \
        const float *xh = xf + h * head_dim; \
        const float *wh = w + (all_heads ? h * head_dim : 0); \
        T *out = x + h * head_dim; \
        float r = all_heads ? r_all : 1.0f / sqrtf(sum_squares(xh, head_dim) / (float)head_dim + eps); \
        for (int64_t d = 0; d < head_dim; ++d) { \
            float n = xh[d] * r; \
            if (cast_before) n = LOAD(STORE(n)); \
            y[d] = LOAD(STORE(n * (wh[d] + offset))); \
        } \
        if (interleaved) { \
            for (int64_t i = 0; i < half; ++i) { \
                float a = y[2 * i], b = y[2 * i + 1]; \
                out[2 * i] = STORE(a * c[i] - b * s[i]); \
                out[2 * i + 1] = STORE(b * c[i] + a * s[i]); \
            } \
        } else { \
            for (int64_t i = 0; i < half; ++i) { \
                float a = y[i], b = y[i + half]; \
                out[i] = STORE(a * c[i] - b * s[i]); \
                out[i + half] = STORE(b * c[i] + a * s[i]); \
            } \
        } \
        for (int64_t d = 2 * half; d < head_dim; ++d) out[d] = STORE(y[d]); \
    } \
} \
/* Returns -1 when done, else the first token whose table row is outside [0, table_len); nothing is written \
   then. */ \
int64_t NAME(void *qkv, const float *wq, const float *wk, const float *cos, const float *sin, \
             const int64_t *pos, const int64_t *a, const double *f) { \
    const int64_t stride_b = a[0], stride_s = a[1], batch = a[2], seq = a[3], q_heads = a[4]; \
    const int64_t k_heads = a[5], head_dim = a[6], half = a[7], cos_stride = a[8], sin_stride = a[9]; \
    const int64_t table_len = a[10], offset = a[11]; \
    const int interleaved = (int)a[12], all_heads = (int)a[13], cast_before = (int)a[14]; \
    const int threads = (int)a[15]; \
    const float eps = (float)f[0], weight_offset = (float)f[1]; \
    int64_t tokens = batch * seq; \
    if (pos) { \
        for (int64_t token = 0; token < tokens; ++token) \
            if (pos[token] < 0 || pos[token] >= table_len) return token; \
    } else if (tokens > 0 && (offset < 0 || offset > table_len - seq)) { \
        return offset < 0 ? 0 : table_len - offset > 0 ? table_len - offset : 0; \
    } \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1)") \
    for (int64_t token = 0; token < tokens; ++token) { \
        int64_t b = token / seq, t = token % seq; \
        int64_t row = pos ? pos[token] : offset + t; \
        T *x = (T *)qkv + b * stride_b + t * stride_s; \
        const float *c = cos + row * cos_stride, *s = sin + row * sin_stride; \
        NAME##_part(x, q_heads, head_dim, half, wq, all_heads, eps, weight_offset, cast_before, \
                    interleaved, c, s); \
        NAME##_part(x + q_heads * head_dim, k_heads, head_dim, half, wk, all_heads, eps, weight_offset, \
                    cast_before, interleaved, c, s); \
    } \
    return -1; \
}

DEFINE_QK_NORM(qk_norm_rotary_f32, float, F32_LOAD, F32_STORE)
DEFINE_QK_NORM(qk_norm_rotary_f16, _Float16, F16_LOAD, F16_STORE)
DEFINE_QK_NORM(qk_norm_rotary_bf16, uint16_t, bf16_load, bf16_store)
"""

_ENTRY = {torch.float32: "qk_norm_rotary_f32", torch.float16: "qk_norm_rotary_f16",
          torch.bfloat16: "qk_norm_rotary_bf16"}  # fmt: skip
SUPPORTED_DTYPES = tuple(_ENTRY)
# qkv, wq, wk, cos, sin, positions, the integer arguments (one int64 array) and the two floats (doubles).
_ARGTYPES = [ctypes.c_void_p] * 8
_INT_ARGS = struct.Struct("16q")
_FLOAT_ARGS = struct.Struct("2d")
# Floats kept on the stack per call of the part loop: x of one token's q (or k) plus one head; the C loop
# refuses wider rows (the torch path serves them).
MAX_ROW_FEATURES = 1 << 15

_functions: dict[torch.dtype, object] = {}
_build_error: str | None = None


def build_failure() -> str | None:
    """None once the library is loaded, else why it could not be built (built once per process)."""
    global _build_error
    if not _functions and _build_error is None:
        try:
            lib = build_library(source=_SOURCE, stem="qk_norm_cpu")
        except (RuntimeError, OSError) as err:
            _build_error = str(err)
            log.warning("ropekit: the QK-norm C loop is unavailable, using torch: %s", _build_error)
            return _build_error
        for dtype, entry in _ENTRY.items():
            fn = getattr(lib, entry)
            fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int64
            _functions[dtype] = fn
    return _build_error


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
    error = build_failure()
    if error is not None:
        raise ValueError(
            f"backend: 'cpu' cannot serve these inputs: the C kernel could not be built: {error}"
        )
    batch, seq, _ = qkv.shape
    table_len, half = cos.shape
    work = batch * seq * (spec.q_heads + spec.k_heads) * spec.head_dim
    ints = _INT_ARGS.pack(
        qkv.stride(0), qkv.stride(1), batch, seq, spec.q_heads, spec.k_heads, spec.head_dim, half,
        cos.stride(0), sin.stride(0), table_len, offset, spec.interleaved, spec.all_heads,
        spec.cast_before_weight, torch.get_num_threads() if work >= PARALLEL_THRESHOLD else 1,
    )  # fmt: skip
    floats = _FLOAT_ARGS.pack(spec.eps, spec.weight_offset)
    bad = _functions[qkv.dtype](
        qkv.data_ptr(),
        q_weight.data_ptr(),
        k_weight.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        None if positions is None else positions.data_ptr(),
        ints,
        floats,
    )
    if bad >= 0:
        position = int(positions[bad]) if positions is not None else offset + bad
        raise row_error(position, table_len, bad if positions is not None else None)
