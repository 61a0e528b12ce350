"""The fused serving loop in C: RoPE with the KV-cache write, FP8 quantisation and the cache shift.

It runs a :class:`~ropekit.backends.fused_launch.FusedLaunch` in one pass: one OpenMP chunk of tokens per
thread, the token's cos/sin row read once, each head of each channel rotated into a float32 scratch row and
stored once, to its own dtype (round to nearest even, as :mod:`ropekit.backends.cpu`) or to FP8 bytes.

FP8 stores follow the rounding contract of :func:`ropekit.apply_rotary_qk_fp8` bit for bit: the float32
rotation r (each product and sum rounded, no FMA: ``-ffp-contract=off``), then the float32 quotient
``r / scale`` (a division, never a multiplication by a reciprocal), clamped to the format's largest finite
value (NaN stays NaN), then rounded to nearest even into the format's bits in integer arithmetic. Built with
:func:`ropekit.backends.cpu.build_library` (shared cache, checks and lock).
"""

from __future__ import annotations

import ctypes
import struct

import torch

from ropekit.backends.cpu import PARALLEL_THRESHOLD, build_library
from ropekit.backends.fused_launch import FusedLaunch, check_launch, slot_error
from ropekit.backends.kernel_op import row_error

__all__ = ["launch", "unavailable_reason"]

_SOURCE = r"""
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
/* float32 -> FP8 bits, round to nearest even; kind 1: e4m3fn (bias 7, 3 mantissa bits, max 448), kind 2:
   e5m2 (bias 15, 2 mantissa bits, max 57344). v is clamped to +-max first (NaN stays NaN). Below the
   smallest normal, adding 2^14 (e4m3fn) or 2^7 (e5m2) makes the float32 ulp equal the FP8 step, so the
   hardware's own rounding of that sum rounds the subnormal. */
static inline uint8_t fp8_store(float v, int kind) {
    float fmax = kind == 1 ? 448.0f : 57344.0f;
    v = v > fmax ? fmax : (v < -fmax ? -fmax : v);
    uint32_t u; memcpy(&u, &v, 4);
    uint32_t sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu, r;
    if (a > 0x7f800000u) return (uint8_t)(0x7fu | sign);
    if (kind == 1) {
        if (a < 0x3c800000u) {  /* below 2^-6 */
            float f; memcpy(&f, &a, 4); f += 16384.0f; memcpy(&r, &f, 4); r -= 0x46800000u;
        } else {
            r = ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
        }
    } else {
        if (a < 0x38800000u) {  /* below 2^-14 */
            float f; memcpy(&f, &a, 4); f += 128.0f; memcpy(&r, &f, 4); r -= 0x43000000u;
        } else {
            r = ((a + 0xfffffu + ((a >> 21) & 1u)) >> 21) - (112u << 2);
        }
    }
    return (uint8_t)(r | sign);
}
#define F32_LOAD(v) (v)
#define F32_STORE(v) (v)
#define F16_LOAD(v) ((float)(v))
#define F16_STORE(v) ((_Float16)(v))

/* Channel integers, CH_INTS per channel after the GLOBALS: */
enum { ON, ROTATE, BY_SLOT, KIND, HEADS, WIDTH, SRC_B, SRC_S, SRC_H, PAGE_SIZE, DST_P, DST_I, DST_H,
       SCALE_H, SRC_IS_DST, CH_INTS };
enum { GLOBALS = 11 };

#define DEFINE_FUSED(NAME, T, LOAD, STORE) \
static void NAME##_head(const T *x, void *out, int64_t width, int64_t half, int rotate, int interleaved, \
                        const float *c, const float *s, int kind, float scale) { \
    float buf[width]; \
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
    if (kind == 0) { \
        T *o = (T *)out; \
        for (int64_t j = 0; j < rot; ++j) o[j] = STORE(buf[j]); \
        if ((const void *)x != out) memcpy(o + rot, x + rot, (size_t)(width - rot) * sizeof(T)); \
    } else { \
        uint8_t *o = (uint8_t *)out; \
        for (int64_t j = 0; j < rot; ++j) o[j] = fp8_store(buf[j] / scale, kind); \
        for (int64_t j = rot; j < width; ++j) o[j] = fp8_store(LOAD(x[j]) / scale, kind); \
    } \
} \
/* p: cos, sin, positions, slots, then (src, dst, scale) per channel. a: GLOBALS, then CH_INTS per channel. \
   Returns -1 when done; t >= 0: token t's table row is outside [0, table_len); -2 - t: token t's slot is \
   outside [-1, num_slots). Nothing is written when it returns an error. */ \
int64_t NAME(const uint64_t *p, const int64_t *a) { \
    const int64_t batch = a[0], seq = a[1], half = a[2], table_len = a[3], offset = a[4]; \
    const int64_t cos_stride = a[5], sin_stride = a[6], num_slots = a[10]; \
    const int interleaved = (int)a[7], conjugate = (int)a[8], threads = (int)a[9]; \
    const float *cos = (const float *)p[0], *sin = (const float *)p[1]; \
    const int64_t *pos = (const int64_t *)p[2], *slots = (const int64_t *)p[3]; \
    const float sign = conjugate ? -1.0f : 1.0f; \
    const int64_t tokens = batch * seq; \
    if (pos) { \
        for (int64_t token = 0; token < tokens; ++token) \
            if (pos[token] < 0 || pos[token] >= table_len) return token; \
    } else if (tokens > 0 && (offset < 0 || offset > table_len - seq)) { \
        return offset < 0 ? 0 : table_len - offset > 0 ? table_len - offset : 0; \
    } \
    if (slots) \
        for (int64_t token = 0; token < tokens; ++token) \
            if (slots[token] < -1 || slots[token] >= num_slots) return -2 - token; \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1)") \
    for (int64_t token = 0; token < tokens; ++token) { \
        int64_t b = token / seq, t = token % seq; \
        int64_t row = pos ? pos[token] : offset + t; \
        const float *c = cos + row * cos_stride; \
        float s[half]; \
        for (int64_t i = 0; i < half; ++i) s[i] = sign * sin[row * sin_stride + i]; \
        for (int ch = 0; ch < 3; ++ch) { \
            const int64_t *ca = a + GLOBALS + ch * CH_INTS; \
            if (!ca[ON]) continue; \
            int64_t slot = ca[BY_SLOT] ? slots[token] : token; \
            if (slot < 0) continue; \
            int kind = (int)ca[KIND]; \
            size_t esize = kind ? 1 : sizeof(T); \
            char *dst = (char *)p[5 + 3 * ch] + \
                esize * (size_t)((slot / ca[PAGE_SIZE]) * ca[DST_P] + (slot % ca[PAGE_SIZE]) * ca[DST_I]); \
            const T *src = ca[SRC_IS_DST] ? (const T *)dst \
                                          : (const T *)p[4 + 3 * ch] + b * ca[SRC_B] + t * ca[SRC_S]; \
            int64_t src_h = ca[SRC_IS_DST] ? ca[DST_H] : ca[SRC_H]; \
            const float *scale = (const float *)p[6 + 3 * ch]; \
            for (int64_t h = 0; h < ca[HEADS]; ++h) { \
                float sc = scale ? scale[h * ca[SCALE_H]] : 1.0f; \
                NAME##_head(src + h * src_h, dst + esize * (size_t)(h * ca[DST_H]), ca[WIDTH], half, \
                            (int)ca[ROTATE], interleaved, c, s, kind, sc); \
            } \
        } \
    } \
    return -1; \
}

DEFINE_FUSED(fused_f32, float, F32_LOAD, F32_STORE)
DEFINE_FUSED(fused_f16, _Float16, F16_LOAD, F16_STORE)
DEFINE_FUSED(fused_bf16, uint16_t, bf16_load, bf16_store)
"""

_ENTRY = {torch.float32: "fused_f32", torch.float16: "fused_f16", torch.bfloat16: "fused_bf16"}
_GLOBALS = struct.Struct("11q")
_CHANNEL = struct.Struct("15q")
_POINTERS = struct.Struct("13Q")
_OFF = _CHANNEL.pack(*[0] * 15)

_functions: dict[torch.dtype, ctypes._CFuncPtr] = {}
_build_error: list[str] = []


def _function(dtype: torch.dtype):
    if not _functions:
        if _build_error:
            raise ValueError(f"backend: 'cpu' cannot serve the fused op: {_build_error[0]}")
        try:
            lib = build_library(source=_SOURCE, stem="fused_cpu")
        except (RuntimeError, OSError) as err:
            _build_error.append(f"the C kernel could not be built: {err}")
            raise ValueError(f"backend: 'cpu' cannot serve the fused op: {_build_error[0]}") from None
        for d, entry in _ENTRY.items():
            fn = getattr(lib, entry)
            fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
            fn.restype = ctypes.c_int64
            _functions[d] = fn
    return _functions[dtype]


def unavailable_reason() -> str | None:
    """None when the fused C loop is (or can be) built, else why not."""
    try:
        _function(torch.float32)
    except ValueError as err:
        return str(err)
    return None


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


def launch(plan: FusedLaunch) -> None:
    """Run the fused C loop on CPU tensors.

    Raises:
        ValueError: anything :func:`~ropekit.backends.fused_launch.check_launch` rejects, a table row outside
            the table or a slot outside [-1, num_slots) (both checked before any write).
    """
    check_launch(plan)
    if plan.cos.device.type != "cpu":
        raise ValueError(f"q: expected CPU tensors for the C kernel, got tensors on {plan.cos.device}")
    table_len, half = plan.cos.shape
    num_slots: list[int] = []
    chans = [_channel_ints(ch, num_slots) for ch in plan.channels]
    if len(set(num_slots)) > 1:
        raise ValueError(f"v_cache: expected as many slots as k_cache ({num_slots[0]}), got {num_slots[1]}")
    tokens = plan.batch * plan.seq
    work = sum(ch.dst[0, 0].numel() for ch in plan.channels if ch is not None) * tokens
    ints = _GLOBALS.pack(
        plan.batch, plan.seq, half, table_len, plan.offset, plan.cos.stride(0), plan.sin.stride(0),
        plan.interleaved, plan.conjugate,
        torch.get_num_threads() if work >= PARALLEL_THRESHOLD else 1,
        num_slots[0] if num_slots else 0,
    ) + b"".join(c[0] for c in chans)  # fmt: skip
    pointers = _POINTERS.pack(
        plan.cos.data_ptr(),
        plan.sin.data_ptr(),
        0 if plan.positions is None else plan.positions.data_ptr(),
        0 if plan.slots is None else plan.slots.data_ptr(),
        *(ptr for c in chans for ptr in c[1]),
    )
    bad = _function(plan.dtype)(pointers, ints)
    if bad >= 0:
        position = int(plan.positions[bad]) if plan.positions is not None else plan.offset + bad
        raise row_error(position, table_len, bad if plan.positions is not None else None)
    if bad < -1:
        token = -2 - bad
        raise slot_error(int(plan.slots[token]), num_slots[0], token)
