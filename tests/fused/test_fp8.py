"""ropekit.fused.fp8: RoPE + FP8 on the torch and cpu backends, bit for bit to the rounding contract."""

from __future__ import annotations

import pytest
import torch
from fused_cases import FP8, check_fp8, check_fp8_mla, tables
from hypothesis import given, settings
from hypothesis import strategies as st

import ropekit
from c_compiler import CPU

BACKENDS = ["torch", CPU]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("mode", ["offsets", "offsets_per_seq", "cu_seqlens", "positions"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_fp8_outputs_follow_the_rounding_contract_bit_for_bit(backend, fp8_dtype, mode, interleaved):
    check_fp8(backend, mode, fp8_dtype, interleaved, per_head=mode == "positions")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp8_dtype", FP8)
def test_fp8_partial_rotary_scales_the_tail(backend, fp8_dtype):
    check_fp8(backend, "cu_seqlens", fp8_dtype, False, per_head=True, partial=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp8_dtype", FP8)
def test_mla_form_returns_four_tensors_with_nope_parts_only_cast(backend, fp8_dtype):
    check_fp8_mla(backend, fp8_dtype)


def test_fp8_refuses_a_backend_that_cannot_serve_it():
    cos, sin = tables(8)
    q, k = torch.randn(1, 2, 2, 8).double(), torch.randn(1, 2, 1, 8).double()
    with pytest.raises(ValueError, match="backend: 'cpu' cannot serve"):
        ropekit.apply_rotary_qk_fp8(q, k, cos, sin, q_scale=1.0, k_scale=1.0, backend="cpu")


def test_fp8_mla_needs_both_nope_parts_and_matching_heads():
    cos, sin = tables(8)
    q, k = torch.randn(1, 2, 2, 8), torch.randn(1, 2, 1, 8)
    with pytest.raises(ValueError, match="q_nope, k_nope"):
        ropekit.apply_rotary_qk_fp8(q, k, cos, sin, q_scale=1.0, k_scale=1.0, q_nope=torch.randn(1, 2, 2, 4))
    with pytest.raises(ValueError, match="k_nope"):
        ropekit.apply_rotary_qk_fp8(
            q,
            k,
            cos,
            sin,
            q_scale=1.0,
            k_scale=1.0,
            q_nope=torch.randn(1, 2, 2, 4),
            k_nope=torch.randn(1, 2, 3, 4),
        )


def test_fp8_is_inference_only():
    cos, sin = tables(8)
    q, k = torch.randn(1, 2, 2, 8, requires_grad=True), torch.randn(1, 2, 1, 8)
    with pytest.raises(ValueError, match="inference only"):
        ropekit.apply_rotary_qk_fp8(q, k, cos, sin, q_scale=1.0, k_scale=1.0)


@pytest.mark.c_compiler
@pytest.mark.parametrize("interleaved", [False, True])
def test_specialised_c_shapes_follow_the_contract_deepseek_mla_widths(interleaved):
    """MLA's widths (rope 64, nope 512) and head_dim 128 run compile-time specialisations of the C loop."""
    cos, sin = tables(64)
    g = torch.Generator().manual_seed(6)
    q, k = torch.randn(5, 4, 64, generator=g) * 30, torch.randn(5, 1, 64, generator=g)
    q_nope, k_nope = torch.randn(5, 4, 512, generator=g), torch.randn(5, 1, 512, generator=g)
    kw = dict(q_scale=0.1, k_scale=0.05, q_nope=q_nope, k_nope=k_nope, positions=torch.arange(5) * 7)
    torch_outs = ropekit.apply_rotary_qk_fp8(q, k, cos, sin, interleaved=interleaved, backend="torch", **kw)
    cpu_outs = ropekit.apply_rotary_qk_fp8(q, k, cos, sin, interleaved=interleaved, backend="cpu", **kw)
    pairs = zip(torch_outs, cpu_outs, strict=True)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in pairs)
    cos, sin = tables(128)
    q, k = torch.randn(3, 4, 128, generator=g) * 30, torch.randn(3, 2, 128, generator=g)
    outs = [
        ropekit.apply_rotary_qk_fp8(
            q,
            k,
            cos,
            sin,
            q_scale=0.1,
            k_scale=0.05,
            positions=torch.arange(3),
            interleaved=interleaved,
            backend=backend,
        )
        for backend in ("torch", "cpu")
    ]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(*outs, strict=True))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "scale", [1e-46, 1e300, torch.tensor(1e-46, dtype=torch.float64), torch.tensor([1.0, 1e39]).double()]
)
def test_a_scale_is_checked_as_the_kernel_divides_by_it_in_float32(backend, scale):
    """Issue 24, defect 4: q_scale=1e-46 is > 0 as a Python float but 0 in float32, the kernels' dtype, so
    zeros became NaN without an error (1e300: inf in float32, every byte 0). A scale, number or tensor, is
    checked after its float32 cast."""
    cos, sin = tables(16)
    q, k = torch.zeros(4, 2, 16), torch.zeros(4, 2, 16)
    for name in ("q_scale", "k_scale"):
        scales = {"q_scale": 1.0, "k_scale": 1.0, name: scale}
        with pytest.raises(ValueError, match=rf"^{name}: expected .*finite.* > 0.*float32"):
            ropekit.apply_rotary_qk_fp8(q, k, cos, sin, **scales, backend=backend)


def test_a_meta_table_is_a_value_error_naming_it():
    """Issue 24: a meta cos / sin beside CPU inputs was PyTorch's NotImplementedError ("Cannot copy out of
    meta tensor") from inside the call; it has no values to rotate with."""
    cos, sin = tables(16)
    tabs = {"cos": cos.to("meta"), "sin": sin.to("meta")}
    q, k = torch.randn(4, 2, 16), torch.randn(4, 1, 16)
    with pytest.raises(ValueError, match=r"^cos: expected a tensor with values.* got a meta tensor"):
        ropekit.apply_rotary_qk_fp8(q, k, tabs["cos"], tabs["sin"], q_scale=1.0, k_scale=1.0)
    meta_scale = torch.ones((), device="meta")  # a meta scale: no value to divide by either
    with pytest.raises(ValueError, match=r"^k_scale: expected a tensor with values.* got a meta tensor"):
        ropekit.apply_rotary_qk_fp8(q, k, cos, sin, q_scale=1.0, k_scale=meta_scale)


# The fused C loop runs 512-bit vectors (where the CPU has them) for FP8 stores of this many elements or more.
WIDE_ELEMENTS = 1 << 22


@pytest.mark.c_compiler
@pytest.mark.parametrize("copies", [1, 11], ids=["narrow", "wide"])
@pytest.mark.parametrize("fp8_dtype", FP8)
def test_the_c_conversion_equals_torchs_cast_at_every_exponent_and_rounding_boundary(fp8_dtype, copies):
    """The C loop's float32 -> FP8 rounding (issue 25 rewrote it: one float addition rounds onto the FP8 grid)
    against torch's ``clamp(-max, max).to(fp8)``, for every float32 whose low 16 bits are 0, 1, 0x7fff,
    0x8000, 0x8001 or 0xffff: every sign and exponent (subnormals, the saturating range, inf, NaN), and every
    FP8 tie (a float32 with the bits below the FP8 mantissa's half-step clear) with its neighbours on each
    side. Cast-only nope parts with a scale of 1 put the values through the C rounding unchanged; 11 copies
    make the call large enough for the loop's 512-bit variant."""
    high = torch.arange(1 << 16, dtype=torch.int64) << 16
    low = torch.tensor([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    bits = (high[:, None] | low[None, :]).reshape(-1)  # (393216,)
    bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)
    values = bits.view(torch.float32).reshape(-1, 1, 512).repeat(copies, 1, 1)  # (tokens, 1 head, 512): MLA's
    tokens = values.shape[0]
    assert (2 * values.numel() >= WIDE_ELEMENTS) == (copies > 1)
    cos, sin = tables(8)
    q, k = torch.zeros(tokens, 1, 8), torch.zeros(tokens, 1, 8)
    outs = ropekit.apply_rotary_qk_fp8(
        q, k, cos, sin, q_scale=1.0, k_scale=1.0, fp8_dtype=fp8_dtype, q_nope=values, k_nope=values.flip(0),
        positions=torch.zeros(tokens, dtype=torch.int64), backend="cpu",
    )  # fmt: skip
    fmax = torch.finfo(fp8_dtype).max
    for got, x in ((outs[2], values), (outs[3], values.flip(0))):
        want = x.clamp(-fmax, fmax).to(fp8_dtype).view(torch.uint8)
        nan = x.isnan()  # torch's NaN bytes are its own; the contract's are 0x7f with the sign
        assert torch.equal(got.view(torch.uint8)[~nan], want[~nan])
        assert torch.equal(got.view(torch.uint8)[nan] & 0x7F, torch.full_like(want[nan], 0x7F))


@pytest.mark.c_compiler
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("fp8_dtype", FP8)
def test_a_prefill_sized_call_runs_the_wide_loop_to_the_same_bytes(fp8_dtype, interleaved):
    """A 1024-token Llama-3-8B prefill (5.2M FP8 elements, past WIDE_ELEMENTS) on the C loop's 512-bit
    variant equals the torch backend's bytes: saturation, per-head scales and both pair layouts included."""
    cos, sin = ropekit.RopeConfig(head_dim=128).cos_sin(1100)
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(1, 1024, 32, 128, generator=g) * 30, torch.randn(1, 1024, 8, 128, generator=g)
    assert q.numel() + k.numel() >= WIDE_ELEMENTS
    kw = dict(q_scale=torch.rand(32, generator=g) + 0.02, k_scale=0.05, fp8_dtype=fp8_dtype, offsets=3)
    want = ropekit.apply_rotary_qk_fp8(q, k, cos, sin, interleaved=interleaved, backend="torch", **kw)
    got = ropekit.apply_rotary_qk_fp8(q, k, cos, sin, interleaved=interleaved, backend="cpu", **kw)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want, strict=True))


def cast_only(values: torch.Tensor, scale: float, fp8_dtype: torch.dtype) -> torch.Tensor:
    """values (tokens, 1, 512) through the C loop's cast-only pass (MLA's nope part: value / scale, rounded),
    as FP8 bytes; the rotated parts are 8 zeros a token."""
    tokens = values.shape[0]
    cos, sin = tables(8)
    q, k = torch.zeros(tokens, 1, 8), torch.zeros(tokens, 1, 8)
    outs = ropekit.apply_rotary_qk_fp8(
        q, k, cos, sin, q_scale=scale, k_scale=scale, fp8_dtype=fp8_dtype, q_nope=values, k_nope=values,
        positions=torch.zeros(tokens, dtype=torch.int64), backend="cpu",
    )  # fmt: skip
    assert torch.equal(outs[2].view(torch.uint8), outs[3].view(torch.uint8))
    return outs[2].view(torch.uint8)


def assert_contract_bytes(got: torch.Tensor, values: torch.Tensor, scale: float, fp8_dtype: torch.dtype):
    """got == torch's (values / scale).clamp(-max, max).to(fp8) byte for byte; a NaN is 0x7f with the sign."""
    fmax = torch.finfo(fp8_dtype).max
    want = (
        (values / torch.tensor(scale, dtype=torch.float32)).clamp(-fmax, fmax).to(fp8_dtype).view(torch.uint8)
    )
    nan = (values.view(torch.int32) < 0).to(torch.uint8) << 7 | 0x7F  # elementwise: no boolean indexing
    assert torch.equal(got, torch.where(values.isnan(), nan, want))


# Every float32 bit pattern (NaN, inf, subnormals); scales finite and > 0 in float32, subnormal ones included.
BITS = st.lists(st.integers(0, (1 << 32) - 1), min_size=64, max_size=64)
SCALES = st.floats(min_value=2.0**-149, max_value=2.0**127, width=32, allow_subnormal=True)


@pytest.mark.c_compiler
@settings(max_examples=20, deadline=None)
@given(bits=BITS, scale=SCALES, fp8_dtype=st.sampled_from(FP8), wide=st.booleans())
def test_the_c_quotient_and_rounding_follow_the_contract_at_any_scale(bits, scale, fp8_dtype, wide):
    """Issue 25: the C loop's FP8 rows (the 512-bit one with its own division, clamp and rounding for calls of
    WIDE_ELEMENTS or more, the generic one below) against torch's ``(x / scale).clamp(-max, max).to(fp8)``
    for any float32 bit patterns and any float32 scale: quotients past the format's range, under its
    smallest subnormal, ties of the rounding after the division."""
    word = torch.tensor(bits, dtype=torch.int64)
    pattern = torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32).view(torch.float32)
    tokens = 4096 if wide else 8  # wide: 2 x 4096 x 512 FP8 elements, exactly WIDE_ELEMENTS
    values = pattern.repeat(tokens * 512 // 64).reshape(tokens, 1, 512)
    assert (2 * values.numel() >= WIDE_ELEMENTS) == wide
    assert_contract_bytes(cast_only(values, scale, fp8_dtype), values, scale, fp8_dtype)


@pytest.mark.proof
@pytest.mark.parametrize("fp8_dtype", FP8)
def test_every_float32_through_both_c_rows_equals_torchs_cast(fp8_dtype):
    """All 2^32 float32 values through the C loop's FP8 rows at scale 1, the generic row (calls below
    WIDE_ELEMENTS) and the 512-bit one, equal torch's ``clamp(-max, max).to(fp8)`` byte for byte (a NaN is
    0x7f with its sign). About 3 minutes of CPU time a format on the Zen 3 VM (9 before the comparison
    stopped indexing by boolean masks)."""
    chunk = 1 << 23  # float32 bit patterns per wide call (2 x 4M FP8 elements); the narrow calls take 1/8
    for start in range(-(1 << 31), 1 << 31, chunk):  # every int32, so every float32 bit pattern
        values = torch.arange(start, start + chunk, dtype=torch.int32).view(torch.float32)
        wide = cast_only(values.reshape(-1, 1, 512), 1.0, fp8_dtype).reshape(-1)
        narrow = torch.cat([cast_only(part.reshape(-1, 1, 512), 1.0, fp8_dtype).reshape(-1)
                            for part in values.chunk(8)])  # fmt: skip
        assert torch.equal(wide, narrow)
        assert_contract_bytes(wide, values, 1.0, fp8_dtype)
