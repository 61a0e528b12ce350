"""The fused serving kernel in Triton: a program runs the q, k and v channels of a
:class:`~ropekit.backends.fused_launch.FusedLaunch` (RoPE + KV-cache write, RoPE + FP8, cache shift) for one
token (decode) or for :data:`PREFILL_BLOCK_T` tokens (a prefill of at least ``PREFILL_TOKENS`` tokens).

Each channel's switches (present, rotated, addressed by slot, FP8 kind, in place, width) are compile-time
constants, so each combination compiles to straight-line code. Math runs in float32. Stores round to nearest
even: fp16 / bf16 through the hardware conversion (``cvt.rn``) in compiled code, and through
:func:`_bf16_round_to_nearest_even` in integer arithmetic under the interpreter (whose float -> bfloat16 cast
truncates: ``ROUND_BF16_IN_INTEGERS``); FP8 through :func:`_fp8_bits`, in integer arithmetic as the C loop
does; the quotient ``r / scale`` is ``div_rn`` (a plain ``/`` compiles to an approximate division on GPUs),
and every launch passes :data:`COMPILE_OPTIONS` (``enable_fp_fusion=False``), so the rotation's products and
sums round separately (no FMA), which the FP8 rounding contract needs bit for bit.

Values are checked without a host sync: a table row or slot outside its range is clamped into the table (the
slot's writes skipped) and fails the launch (:func:`ropekit.backends.triton.rotary_kernel.flag_bad`:
compiled, the
kernel traps; under the interpreter the launcher raises when the kernel returns).

Importing this module imports Triton; set ``TRITON_INTERPRET=1`` before importing it to run the interpreter.
"""

from __future__ import annotations

import itertools

import triton
import triton.language as tl

from ropekit.backends.triton.rotary_kernel import PREFILL_TOKENS, _bf16_round_to_nearest_even, flag_bad

__all__ = [
    "COMPILE_OPTIONS",
    "OCCUPANCY_TARGET",
    "VECTORISED_ARGS",
    "aot_specializations",
    "fused_kernel",
    "launch_config",
]

# Passed at every launch (launch) and every ahead-of-time compile (ropekit.tools.triton_aot).
# enable_fp_fusion: no a * c - b * s contracted into an FMA: the FP8 rounding contract and the C loop's
#   results bit for bit need the products and the sum rounded separately.
# maxnreg: see OCCUPANCY_TARGET.
COMPILE_OPTIONS = {"enable_fp_fusion": False, "maxnreg": 80}
# 6 blocks of 4 warps an SM (768 of 2,048 threads, 37.5% occupancy): 80 registers a thread. Full occupancy
# allows 32, but a thread holds the token's cos/sin run (kept across the three channels), one 16-byte vector
# of each run of a tile (8 fp16 / bf16 values: 16 float32 for a pair's two halves) and their rotated values,
# 64-bit addresses from the three channels' int64 strides, and the FP8 paths' correctly rounded division
# (div.rn) and integer rounding: ptxas allocates up to 78 under this cap with no spills (capped at 72, an
# FP8 fp16 specialization spills 24 bytes on sm_100). The kernel is memory-bound (each element is read once
# and written once, a few float operations apiece): it needs bytes in flight rather than warps, and 24
# resident warps an SM with 32 bytes of loads outstanding a thread (24 KB an SM) keep the memory system busy.
# maxnreg makes the cap a compile option; the AOT check holds every specialization to
# ropekit.tools.ptx_check.register_budget(4, OCCUPANCY_TARGET) = 80 and to no spills.
OCCUPANCY_TARGET = 0.375
# The pointers whose global loads and stores must be 128-bit when they are 16-byte aligned: each thread holds
# one 16-byte vector of a tile (channel_constexprs), the interleaved run loaded whole and split in registers.
# An FP8 destination stores 8 bytes a thread (64-bit): vectorised_args leaves it out of a specialization.
VECTORISED_ARGS = tuple(f"{c}_{part}" for c in ("q", "k", "v") for part in ("src", "dst"))

CHANNELS = ("q", "k", "v")
NUM_WARPS = 4
# Tokens a program takes in a prefill launch (at least triton_kernel.PREFILL_TOKENS tokens, as the rotary
# kernel's 2-D grid): one after another, each token's heads in the same tiles as decode's, so the 16-byte
# vector a thread, the registers and the accesses are decode's; the grid is a quarter of one program a token
# (prefill-4k: 1,024 programs, still several waves of an H100's 132 SMs x 6 resident blocks). Decode keeps one
# token a program: a few tokens make a small grid, and every program is busy.
PREFILL_BLOCK_T = 4
# Bytes of one vectorised global load or store: a tile gives each thread one such vector of the source.
VECTOR_BYTES = 16
_ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


@triton.jit
def _token_row(
    token, pos_ptr, offset, seq_len, table_len, flag_ptr, HAS_POS: tl.constexpr, TRAP: tl.constexpr
):
    """One token (this kernel's and the QK-norm kernel's): its batch row b and index t in the sequence, and
    its table row: ``positions[token]`` (HAS_POS) or ``offset + t``. A row outside [0, table_len) reads row 0
    instead and fails the launch (``rotary_kernel.flag_bad``): no kernel reads outside the table, and none
    returns a result."""
    b = token // seq_len
    t = token % seq_len
    if HAS_POS:
        pos = tl.load(pos_ptr + token)
    else:
        pos = offset + t
    bad = (pos < 0) | (pos >= table_len)
    flag_bad(bad, flag_ptr, TRAP)
    return b, t, tl.where(bad, 0, pos)


@triton.jit
def _token_block(tokens, BLOCK_T: tl.constexpr):
    """This program's tokens [start, end): ``BLOCK_T`` of them (PREFILL_BLOCK_T for a prefill, else 1), fewer
    in the last block. int64, as every address computed from a token is."""
    start = tl.program_id(0).to(tl.int64) * BLOCK_T
    return start, tl.minimum(start + BLOCK_T, tokens)


@triton.jit
def _fp8_bits(v, KIND: tl.constexpr):
    """float32 -> FP8 bits (uint8), clamped to the format's largest finite value, round to nearest even.

    KIND 1: float8_e4m3fn (bias 7, 3 mantissa bits, max 448); KIND 2: float8_e5m2 (bias 15, 2 bits, max
    57344). Below the smallest normal, adding 2^14 (2^7) makes the float32 ulp the FP8 step, so the float
    addition itself rounds the subnormal. NaN stays NaN (0x7f with its sign)."""
    if KIND == 1:
        fmax = 448.0
    else:
        fmax = 57344.0
    v = tl.where(v > fmax, fmax, tl.where(v < -fmax, -fmax, v))
    u = v.to(tl.uint32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    if KIND == 1:
        sub = (a.to(tl.float32, bitcast=True) + 16384.0).to(tl.uint32, bitcast=True) - 0x46800000
        nor = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960
        r = tl.where(a < 0x3C800000, sub, nor)
    else:
        sub = (a.to(tl.float32, bitcast=True) + 128.0).to(tl.uint32, bitcast=True) - 0x43000000
        nor = ((a + 0xFFFFF + ((a >> 21) & 1)) >> 21) - 448
        r = tl.where(a < 0x38800000, sub, nor)
    r = tl.where(a > 0x7F800000, 0x7F, r)
    return (r | sign).to(tl.uint8)


@triton.jit
def _store(ptr, x, mask, scale, KIND: tl.constexpr, ROUND_BF16_IN_INTEGERS: tl.constexpr):
    if KIND == 0:
        if ROUND_BF16_IN_INTEGERS:  # the interpreter only (its cast truncates)
            tl.store(ptr, _bf16_round_to_nearest_even(x), mask=mask)
        else:  # cvt.rn: round to nearest even
            tl.store(ptr, x.to(ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    else:
        tl.store(ptr, _fp8_bits(tl.math.div_rn(x, scale), KIND), mask=mask)


@triton.jit
def _channel(
    src_ptr,
    dst_ptr,
    scale_ptr,
    slot,
    ok,
    b,
    t,
    heads,
    src_sb,
    src_ss,
    src_sh,
    page_size,
    dst_sp,
    dst_si,
    dst_sh,
    scale_sh,
    c,
    s,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    TAIL_CHUNK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROTATE: tl.constexpr,
    KIND: tl.constexpr,
    IN_PLACE: tl.constexpr,
    COPY_TAIL: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    ROUND_BF16_IN_INTEGERS: tl.constexpr,
):
    """One channel's heads of one token: rotate (ROTATE) and store at dst's slot (see fused_launch).

    A tile is BLOCK_H heads by one contiguous run: each thread holds one 16-byte vector of the source
    (channel_constexprs sizes it). The half layout reads its two halves as two runs; the interleaved layout
    reads the rotary part as one run and splits even and odd lanes in registers (a stride-2 load would not
    vectorise); the tail is copied in runs of TAIL_CHUNK columns."""
    dst = dst_ptr + (slot // page_size) * dst_sp + (slot % page_size) * dst_si
    if IN_PLACE:  # the shift: the source is the destination
        src = dst
        src_h = dst_sh
    else:
        src = src_ptr + b * src_sb + t * src_ss
        src_h = src_sh
    pair = tl.arange(0, BLOCK_HALF)
    if ROTATE:
        rot = 2 * HALF
    else:
        rot = 0
    n_heads = tl.where(ok, heads, 0)  # a skipped slot (-1) writes no head
    for h0 in range(0, heads, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        h_ok = (hs < n_heads)[:, None]  # (BLOCK_H, 1)
        scale = 1.0
        if KIND != 0:
            scale = tl.load(scale_ptr + hs * scale_sh, mask=hs < n_heads, other=1.0)[:, None]
        x_row = src + hs[:, None] * src_h  # (BLOCK_H, 1)
        o_row = dst + hs[:, None] * dst_sh
        if ROTATE:
            if INTERLEAVED:  # pair i at (2i, 2i+1): GPT-J / Meta
                lane = tl.arange(0, 2 * BLOCK_HALF)
                mask = h_ok & (lane < 2 * HALF)[None, :]  # (BLOCK_H, 2 * BLOCK_HALF)
                v = tl.load(x_row + lane[None, :], mask=mask, other=0.0).to(tl.float32)
                xa, xb = tl.split(tl.reshape(v, (BLOCK_H, BLOCK_HALF, 2)))
                swapped = tl.reshape(tl.join(xb, xa), (BLOCK_H, 2 * BLOCK_HALF))  # each pair's partner
                # c, s interleaved (lane 2i: cos_i, -sin_i; lane 2i+1: cos_i, sin_i): a * c - b * s and
                # b * c + a * s exactly, computed in the layout of the load, which the store keeps (a join
                # of the two results would go through shared memory).
                _store(o_row + lane[None, :], v * c + swapped * s, mask, scale, KIND, ROUND_BF16_IN_INTEGERS)
            else:  # pair i at (i, i + R/2): GPT-NeoX / HF
                mask = h_ok & (pair < HALF)[None, :]  # (BLOCK_H, BLOCK_HALF)
                xa = tl.load(x_row + pair[None, :], mask=mask, other=0.0).to(tl.float32)
                xb = tl.load(x_row + HALF + pair[None, :], mask=mask, other=0.0).to(tl.float32)
                _store(o_row + pair[None, :], xa * c - xb * s, mask, scale, KIND, ROUND_BF16_IN_INTEGERS)
                _store(
                    o_row + HALF + pair[None, :], xb * c + xa * s, mask, scale, KIND, ROUND_BF16_IN_INTEGERS
                )
        if COPY_TAIL:
            for j in tl.static_range(0, BLOCK_TAIL, TAIL_CHUNK):
                cols = rot + j + tl.arange(0, TAIL_CHUNK)
                tmask = h_ok & (cols < WIDTH)[None, :]  # (BLOCK_H, TAIL_CHUNK)
                tail = tl.load(x_row + cols[None, :], mask=tmask, other=0.0)
                if KIND == 0:
                    tl.store(o_row + cols[None, :], tail, mask=tmask)
                else:
                    _store(
                        o_row + cols[None, :], tail.to(tl.float32), tmask, scale, KIND, ROUND_BF16_IN_INTEGERS
                    )


@triton.jit(do_not_specialize=["offset"])
def fused_kernel(
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slots_ptr,
    flag_ptr,
    offset,
    table_len,
    num_slots,
    seq_len,
    tokens,
    cos_stride,
    sin_stride,
    q_src,
    q_dst,
    q_scale,
    q_heads,
    q_sb,
    q_ss,
    q_sh,
    q_ps,
    q_dp,
    q_di,
    q_dh,
    q_scale_h,
    k_src,
    k_dst,
    k_scale,
    k_heads,
    k_sb,
    k_ss,
    k_sh,
    k_ps,
    k_dp,
    k_di,
    k_dh,
    k_scale_h,
    v_src,
    v_dst,
    v_scale,
    v_heads,
    v_sb,
    v_ss,
    v_sh,
    v_ps,
    v_dp,
    v_di,
    v_dh,
    v_scale_h,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    CONJUGATE: tl.constexpr,
    ROUND_BF16_IN_INTEGERS: tl.constexpr,
    TRAP_BAD_ROWS: tl.constexpr,
    Q_ON: tl.constexpr,
    Q_ROTATE: tl.constexpr,
    Q_BY_SLOT: tl.constexpr,
    Q_KIND: tl.constexpr,
    Q_IN_PLACE: tl.constexpr,
    Q_COPY_TAIL: tl.constexpr,
    Q_WIDTH: tl.constexpr,
    Q_BLOCK_TAIL: tl.constexpr,
    Q_TAIL_CHUNK: tl.constexpr,
    Q_BLOCK_H: tl.constexpr,
    K_ON: tl.constexpr,
    K_ROTATE: tl.constexpr,
    K_BY_SLOT: tl.constexpr,
    K_KIND: tl.constexpr,
    K_IN_PLACE: tl.constexpr,
    K_COPY_TAIL: tl.constexpr,
    K_WIDTH: tl.constexpr,
    K_BLOCK_TAIL: tl.constexpr,
    K_TAIL_CHUNK: tl.constexpr,
    K_BLOCK_H: tl.constexpr,
    V_ON: tl.constexpr,
    V_ROTATE: tl.constexpr,
    V_BY_SLOT: tl.constexpr,
    V_KIND: tl.constexpr,
    V_IN_PLACE: tl.constexpr,
    V_COPY_TAIL: tl.constexpr,
    V_WIDTH: tl.constexpr,
    V_BLOCK_TAIL: tl.constexpr,
    V_TAIL_CHUNK: tl.constexpr,
    V_BLOCK_H: tl.constexpr,
):
    """Tokens ``program_id(0) * BLOCK_T`` onwards (one a program for decode; BLOCK_T for prefill, each
    token's heads in the same tiles as decode's): a token's row is ``positions[token]`` (HAS_POS) or
    ``offset + t``; its slot ``slot_mapping[token]`` for by-slot channels (-1: skipped), else the token
    index."""
    start, end = _token_block(tokens, BLOCK_T)
    for token in range(start, end):
        b, t, pos = _token_row(token, pos_ptr, offset, seq_len, table_len, flag_ptr, HAS_POS, TRAP_BAD_ROWS)
        slot = token
        write = token >= 0
        if HAS_SLOTS:
            slot = tl.load(slots_ptr + token)
            flag_bad((slot < -1) | (slot >= num_slots), flag_ptr, TRAP_BAD_ROWS)
            write = (slot >= 0) & (slot < num_slots)
            slot = tl.where(write, slot, 0)
        half_idx = tl.arange(0, BLOCK_HALF)
        half_mask = half_idx < HALF
        c = tl.load(cos_ptr + pos * cos_stride + half_idx, mask=half_mask, other=0.0).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + pos * sin_stride + half_idx, mask=half_mask, other=0.0).to(tl.float32)[None, :]
        if CONJUGATE:
            s = -s
        if INTERLEAVED:  # one entry a lane: (1, 2 * BLOCK_HALF), see _channel
            c = tl.reshape(tl.join(c, c), (1, 2 * BLOCK_HALF))
            s = tl.reshape(tl.join(-s, s), (1, 2 * BLOCK_HALF))
        if Q_ON:
            q_slot, q_ok = token, token >= 0
            if Q_BY_SLOT:
                q_slot, q_ok = slot, write
            _channel(
                    q_src, q_dst, q_scale, q_slot, q_ok, b, t, q_heads, q_sb, q_ss, q_sh, q_ps,
                    q_dp, q_di, q_dh, q_scale_h, c, s, HALF, BLOCK_HALF, Q_WIDTH, Q_BLOCK_TAIL,
                    Q_TAIL_CHUNK, Q_BLOCK_H, Q_ROTATE, Q_KIND, Q_IN_PLACE, Q_COPY_TAIL, INTERLEAVED,
                    ROUND_BF16_IN_INTEGERS,
                )  # fmt: skip
        if K_ON:
            k_slot, k_ok = token, token >= 0
            if K_BY_SLOT:
                k_slot, k_ok = slot, write
            _channel(
                    k_src, k_dst, k_scale, k_slot, k_ok, b, t, k_heads, k_sb, k_ss, k_sh, k_ps,
                    k_dp, k_di, k_dh, k_scale_h, c, s, HALF, BLOCK_HALF, K_WIDTH, K_BLOCK_TAIL,
                    K_TAIL_CHUNK, K_BLOCK_H, K_ROTATE, K_KIND, K_IN_PLACE, K_COPY_TAIL, INTERLEAVED,
                    ROUND_BF16_IN_INTEGERS,
                )  # fmt: skip
        if V_ON:
            v_slot, v_ok = token, token >= 0
            if V_BY_SLOT:
                v_slot, v_ok = slot, write
            _channel(
                    v_src, v_dst, v_scale, v_slot, v_ok, b, t, v_heads, v_sb, v_ss, v_sh, v_ps,
                    v_dp, v_di, v_dh, v_scale_h, c, s, HALF, BLOCK_HALF, V_WIDTH, V_BLOCK_TAIL,
                    V_TAIL_CHUNK, V_BLOCK_H, V_ROTATE, V_KIND, V_IN_PLACE, V_COPY_TAIL, INTERLEAVED,
                    ROUND_BF16_IN_INTEGERS,
                )  # fmt: skip


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def channel_constexprs(
    prefix: str, spec: dict | None, half: int, element_bytes: int = 4, interleaved: bool = False
) -> dict[str, object]:
    """The constexprs of one channel: spec has rotate, by_slot, kind, in_place, copy_tail, width, heads.

    A tile is BLOCK_H heads by one run of columns (a pair half; the interleaved pairs' whole run; a tail
    chunk; a whole unrotated head), sized so that each of the NUM_WARPS * 32 threads holds one 16-byte
    vector of the source (``element_bytes``: its storage size): BLOCK_H x run = threads x vector. One vector
    a thread keeps each tile in the layout of its load, through the rotation to the store (two would send the
    interleaved results through shared memory). Heads past a channel's count are masked, which costs idle
    lanes, never a narrower access."""
    on = spec is not None
    if spec is None:
        spec = dict(rotate=False, by_slot=False, kind=0, in_place=False, copy_tail=False, width=1, heads=1)
    rot = 2 * half if spec["rotate"] else 0
    block_half = _next_pow2(half)
    block_tail = _next_pow2(max(spec["width"] - rot, 1))
    elements = NUM_WARPS * 32 * (VECTOR_BYTES // element_bytes)  # one 16-byte vector a thread
    pairs = 2 * block_half if interleaved else block_half  # the run a rotating tile reads at once
    tail_chunk = min(block_tail, pairs if spec["rotate"] else elements)
    run = pairs if spec["rotate"] else tail_chunk
    return {
        f"{prefix}_ON": on,
        f"{prefix}_ROTATE": spec["rotate"],
        f"{prefix}_BY_SLOT": spec["by_slot"],
        f"{prefix}_KIND": spec["kind"],
        f"{prefix}_IN_PLACE": spec["in_place"],
        f"{prefix}_COPY_TAIL": spec["copy_tail"] and spec["width"] > rot,
        f"{prefix}_WIDTH": spec["width"],
        f"{prefix}_BLOCK_TAIL": block_tail,
        f"{prefix}_TAIL_CHUNK": tail_chunk,
        f"{prefix}_BLOCK_H": max(1, elements // run),
    }


def launch_config(half: int, has_pos: bool, has_slots: bool, interleaved: bool, conjugate: bool,
                  round_bf16_in_integers: bool, channels: dict, interpret: bool = False,
                  element_bytes: int = 4,
                  prefill: bool = False) -> tuple[dict[str, object], int]:  # fmt: skip
    """(constexprs, num_warps) for a launch: the one place both the launcher and the AOT list decide them.

    ``round_bf16_in_integers``: bf16 storage under Triton's interpreter, whose float -> bfloat16 cast
    truncates (never in compiled code, where the hardware conversion cvt.rn rounds to nearest even).
    ``interpret``: Triton's interpreter runs the kernel: a bad row or slot clears the flag instead of
    trapping. ``element_bytes``: the source's storage size (the tiles hold one 16-byte vector a thread).
    ``prefill``: the launch has at least PREFILL_TOKENS tokens: PREFILL_BLOCK_T tokens a program (except
    a launch that stores FP8: :func:`_fp8`)."""
    constexprs: dict[str, object] = {
        "HALF": half,
        "BLOCK_HALF": _next_pow2(half),
        "BLOCK_T": PREFILL_BLOCK_T if prefill and not _fp8(channels) else 1,
        "HAS_POS": has_pos,
        "HAS_SLOTS": has_slots,
        "INTERLEAVED": interleaved,
        "CONJUGATE": conjugate,
        "ROUND_BF16_IN_INTEGERS": round_bf16_in_integers,
        "TRAP_BAD_ROWS": not interpret,
    }
    for prefix in CHANNELS:
        spec = channels.get(prefix)
        constexprs |= channel_constexprs(prefix.upper(), spec, half, element_bytes, interleaved)
    return constexprs, NUM_WARPS


def _fp8(channels: dict) -> bool:
    """Whether a channel stores FP8 (a cache by slot, or quantised q / k): that launch keeps one token a
    program. With the token loop, FP8 specializations spilled under the 80-register cap: 8-16 bytes a thread
    on sm_80 (an FP8 cache, fp16 / bf16, head_dim 64-256: the slot, the scale and the three channels'
    addresses live across the tokens), 32 on sm_100 (FP8 q and k, bf16, head_dim 80). The native cache
    write and the shift take the prefill grid with no spill (the AOT check)."""
    return any(spec is not None and spec["kind"] for spec in channels.values())


def _signature(dtype: str, kinds: dict[str, int], constexprs: dict[str, object]) -> dict[str, str]:
    """The argument types of one specialization (Triton's ASTSource signature), as the JIT specializes a
    launch on torch's allocations and contiguous (or packed) heads whose width is a multiple of 16: ``:16``
    marks the tensors (16-byte aligned) and the strides (multiples of the head width; the table's row stride
    is half)."""
    sig = {"cos_ptr": "*fp32:16", "sin_ptr": "*fp32:16", "pos_ptr": "*i64", "slots_ptr": "*i64"}
    sig |= {"flag_ptr": "*i32"}
    sig |= dict.fromkeys(("offset", "table_len", "num_slots", "seq_len", "tokens"), "i64")
    sig |= dict.fromkeys(("cos_stride", "sin_stride"), "i64:16" if constexprs["HALF"] % 16 == 0 else "i64")
    for prefix in CHANNELS:
        store = "*u8:16" if kinds.get(prefix) else f"*{dtype}:16"
        sig |= {f"{prefix}_src": f"*{dtype}:16", f"{prefix}_dst": store, f"{prefix}_scale": "*fp32"}
        for name in ("heads", "sb", "ss", "sh", "ps", "dp", "di", "dh", "scale_h"):
            sig[f"{prefix}_{name}"] = "i64:16" if name in _STRIDES else "i64"
    sig |= {name: "constexpr" for name in constexprs}
    return sig


_STRIDES = ("sb", "ss", "sh", "dp", "di", "dh")


def vectorised_args(signature: dict[str, str]) -> tuple[str, ...]:
    """The pointers of one specialization whose every access must be 128-bit (ropekit.tools.triton_aot): each
    channel's source and destination, except an FP8 destination, whose thread stores the 8 bytes of its
    16-byte source vector (64-bit)."""
    return tuple(name for name in VECTORISED_ARGS if signature.get(name, "").split(":")[0] != "*u8")


def aot_specializations():
    """Every specialization the launcher picks for the served shapes: (kernel, signature, constexprs,
    num_warps) for the cache write (native and FP8 caches), FP8 quantisation (plain and the MLA nope pass) and
    the shift, in fp32 / fp16 / bf16, both pairings, offset or positions, decode or prefill grid (BLOCK_T),
    head_dim 64, 80, 128, 256 (and partial rotary at 128)."""
    specs = []
    for dtype in ("fp32", "fp16", "bf16"):
        for head_dim, half in ((64, 32), (80, 40), (128, 64), (256, 128), (128, 32)):
            for interleaved in (False, True):
                for has_pos, prefill in itertools.product((False, True), (False, True)):
                    for _op, channels, kinds, has_slots, conjugate in _op_forms(head_dim):
                        constexprs, warps = launch_config(
                            half, has_pos, has_slots, interleaved, conjugate, False, channels,
                            element_bytes=_ELEMENT_BYTES[dtype], prefill=prefill,
                        )  # fmt: skip
                        if prefill and constexprs["BLOCK_T"] == 1:  # FP8: decode's grid, listed
                            continue
                        specs.append((fused_kernel, _signature(dtype, kinds, constexprs), constexprs, warps))
    return specs


def _op_forms(head_dim: int):
    """(name, channel specs, FP8 kinds, has_slots, conjugate) of each fused op's launch at one head_dim."""
    rot = dict(rotate=True, in_place=False, copy_tail=True, width=head_dim)
    q_inplace = rot | dict(by_slot=False, kind=0, in_place=True, copy_tail=False, heads=32)
    forms = []
    for kind in (0, 1, 2):
        k = rot | dict(by_slot=True, kind=kind, heads=8)
        v = dict(
            rotate=False, by_slot=True, kind=kind, in_place=False, copy_tail=True, width=head_dim, heads=8
        )
        forms.append(("cache", {"q": q_inplace, "k": k, "v": v}, {"k": kind, "v": kind}, True, False))
    for kind in (1, 2):
        q = rot | dict(by_slot=False, kind=kind, heads=32)
        k = rot | dict(by_slot=False, kind=kind, heads=8)
        forms.append(("fp8", {"q": q, "k": k}, {"q": kind, "k": kind}, False, False))
        # The MLA nope pass: q_nope (16 heads of 512) and k_nope (1 head of 512), scaled and cast only.
        nope = dict(rotate=False, by_slot=False, kind=kind, in_place=False, copy_tail=True, width=512)
        nope_qk = {"q": nope | dict(heads=16), "k": nope | dict(heads=1)}
        forms.append(("fp8 nope", nope_qk, {"q": kind, "k": kind}, False, False))
    shift = rot | dict(by_slot=True, kind=0, in_place=True, copy_tail=False, heads=8)
    for conjugate in (False, True):
        forms.append(("shift", {"k": shift}, {}, True, conjugate))
    return forms


def _channel_args(ch, dummy, scale_dummy) -> tuple[list, dict | None]:
    if ch is None:
        return [dummy, dummy, scale_dummy, 0, 0, 0, 0, 1, 0, 0, 0, 0], None
    dst = ch.dst
    _, page_size, heads, width = dst.shape
    src = ch.src
    sb, ss, sh = (0, 0, 0) if src is None else src.stride()[:3]
    scale = ch.scale
    args = [
        dst if src is None else src, dst, scale_dummy if scale is None else scale, heads, sb, ss, sh,
        page_size, *dst.stride()[:3], 0 if scale is None or scale.shape[0] == 1 else 1,
    ]  # fmt: skip
    in_place = src is None
    spec = dict(
        rotate=ch.rotate, by_slot=ch.by_slot, kind=ch.fp8, in_place=in_place, heads=heads, width=width,
        copy_tail=not in_place and (ch.fp8 or src.data_ptr() != dst.data_ptr()),
    )  # fmt: skip
    return args, spec


def launch(plan, *, checked: bool = False) -> None:
    """Run the fused kernel: one program a token, or PREFILL_BLOCK_T tokens a program from PREFILL_TOKENS
    tokens on (see the module docstring for the value checks).

    Raises:
        ValueError: anything :func:`~ropekit.backends.fused_launch.check_launch` rejects; with CPU tensors
            (the interpreter) a table row or slot out of range, checked on the host before the launch.
        RuntimeError: under the interpreter, a row or slot out of range that the host did not check (a
            compiled kernel traps instead: the CUDA error surfaces at the next synchronising call).
    """
    import contextlib

    import torch

    from ropekit.backends.fused_launch import check_bounds, check_launch, slot_error
    from ropekit.backends.kernel_op import check_offset_rows, row_error
    from ropekit.backends.triton import rotary as triton_backend

    if not checked:  # see fused_cpu.launch
        check_launch(plan)
    else:
        check_bounds(plan)
    tokens = plan.batch * plan.seq
    if tokens == 0:
        return
    cos, sin = plan.cos, plan.sin
    table_len, half = cos.shape
    num_slots = next(
        (c.dst.shape[0] * c.dst.shape[1] for c in plan.channels if c is not None and c.by_slot), 0
    )
    host = triton_backend.HOST_CHECKS and cos.device.type == "cpu"
    slots = plan.slots if any(c is not None and c.by_slot for c in plan.channels) else None
    if plan.positions is None:
        check_offset_rows(plan.offset, plan.batch, plan.seq, table_len)
    elif host:
        lo, hi = torch.stack(torch.aminmax(plan.positions)).tolist()
        if lo < 0 or hi >= table_len:
            raise row_error(lo if lo < 0 else hi, table_len)
    if slots is not None and host:
        lo, hi = torch.stack(torch.aminmax(slots)).tolist()
        if lo < -1 or hi >= num_slots:
            raise slot_error(lo if lo < -1 else hi, num_slots)
    flag = triton_backend.error_flag(cos.device)
    dummy = flag
    scale_dummy = cos
    args, specs = [], {}
    for prefix, ch in zip(CHANNELS, plan.channels, strict=True):
        a, spec = _channel_args(ch, dummy, scale_dummy)
        args += a
        specs[prefix] = spec
    interpret = triton_backend.interpreter_enabled()
    constexprs, num_warps = launch_config(
        half, plan.positions is not None, slots is not None, plan.interleaved, plan.conjugate,
        plan.dtype == torch.bfloat16 and interpret, specs, interpret, plan.dtype.itemsize,
        tokens >= PREFILL_TOKENS,
    )  # fmt: skip
    device_guard = torch.cuda.device(cos.device) if cos.is_cuda else contextlib.nullcontext()
    with device_guard:
        fused_kernel[(-(-tokens // constexprs["BLOCK_T"]),)](
            cos, sin, flag if plan.positions is None else plan.positions,
            flag if slots is None else slots, flag, plan.offset, table_len, num_slots, plan.seq, tokens,
            cos.stride(0), sin.stride(0), *args, **constexprs, num_warps=num_warps, **COMPILE_OPTIONS,
        )  # fmt: skip
    if interpret and not flag[0]:  # the interpreter's kernel cleared it (compiled kernels trap instead)
        raise triton_backend.flagged(
            flag, "ropekit: a position is outside the cos/sin table or a slot outside the cache"
        )
