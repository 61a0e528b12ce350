"""The fused serving kernel under Triton's interpreter: the same checks as the torch and cpu backends.

Run only by test_fused_triton.py, in a subprocess with TRITON_INTERPRET=1 (see tests/triton_interpreter.py).
The interpreter is slow, so the grid covers each switch of the kernel once rather than every product.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fused_cases import (
    FP8,
    LAYOUTS,
    check_cache_write,
    check_cache_write_fp8,
    check_duplicate_slots_are_refused,
    check_errors_write_nothing,
    check_fp8,
    check_fp8_mla,
    check_memory_rule,
    check_shift,
    check_wide_heads,
)

import ropekit
from ropekit.backends.triton.rotary import interpreter_enabled
from rotary_reference import reference_tables, tolerance

pytestmark = pytest.mark.skipif(
    not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (test_fused_triton.py)"
)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", ["offsets", "cu_seqlens", "positions"])
def test_triton_cache_write_matches_the_reference(layout, mode):
    check_cache_write("triton", mode, layout, torch.float32, interleaved=mode == "positions", inplace=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_cache_write_half_precision_partial(dtype):
    check_cache_write("triton", "offsets_per_seq", "nhd", dtype, True, False, partial=True)


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_triton_fp8_cache(fp8_dtype):
    check_cache_write_fp8("triton", "hnd", fp8_dtype, per_head=True)


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("interleaved", [False, True])
def test_triton_fp8_contract_bit_for_bit(fp8_dtype, interleaved):
    check_fp8("triton", "positions", fp8_dtype, interleaved, per_head=interleaved, partial=not interleaved)


def test_triton_fp8_mla():
    check_fp8_mla("triton", torch.float8_e4m3fn)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("with_slots", [False, True])
def test_triton_shift(layout, with_slots):
    check_shift("triton", layout, torch.float32, -9, interleaved=False, with_slots=with_slots)


def test_triton_errors_write_nothing():
    check_errors_write_nothing("triton")


def test_triton_memory_rule():
    check_memory_rule("triton")


def test_triton_duplicate_slots_are_refused():
    check_duplicate_slots_are_refused("triton")


def test_triton_wide_heads_are_refused_and_auto_serves_them():
    check_wide_heads("triton")


@pytest.mark.parametrize("bad", ["row", "slot"])
def test_triton_kernel_fails_a_launch_with_a_row_or_slot_out_of_range_itself(monkeypatch, bad):
    """With the host check off, the fused kernel's own check: a table row past the table (clamped to row 0)
    or a slot past the cache (its writes skipped) fails the launch with no separate assert kernel (under the
    interpreter the launcher raises when the kernel returns; compiled, the kernel traps); the other token's
    slot is written, and nothing is written past the cache."""
    from ropekit.backends.fused_launch import Channel, FusedLaunch
    from ropekit.backends.triton import fused as fused_triton
    from ropekit.backends.triton import rotary as triton_backend
    from rotary_reference import reference_tables

    monkeypatch.setattr(triton_backend, "HOST_CHECKS", False)
    cos, sin = reference_tables(8, 16)
    k = torch.randn(1, 2, 1, 8)  # (batch, seq, heads, head_dim)
    cache = torch.zeros(1, 4, 1, 8)  # (pages, page_size, heads, head_dim): 4 slots
    positions = torch.tensor([3, 16 if bad == "row" else 4])
    slots = torch.tensor([1, 4 if bad == "slot" else 2])
    channel = Channel(src=k, dst=cache, rotate=True, by_slot=True)
    launch = FusedLaunch(1, 2, cos, sin, positions, 0, slots, False, False, (None, channel, None))
    with pytest.raises(RuntimeError, match="outside the cos/sin table or a slot outside the cache"):
        fused_triton.launch(launch, checked=True)
    assert cache[0, 1].abs().sum() > 0  # the good token was written
    if bad == "slot":
        assert cache[0, 2:].abs().sum() == 0  # the bad slot wrote nothing (and nothing went past the cache)
    fused_triton.launch(launch._replace(positions=torch.tensor([3, 4]), slots=torch.tensor([1, 2])))


# ---- the prefill grid: PREFILL_BLOCK_T tokens a program (issue 25) --------------------------------------

PREFILL = (
    262  # at least triton_kernel.PREFILL_TOKENS, and not a multiple of PREFILL_BLOCK_T: a short last block
)


def test_a_prefill_launch_takes_several_tokens_a_program_and_decode_one():
    from ropekit.backends.triton import fused as fused_triton
    from ropekit.backends.triton.rotary_kernel import PREFILL_TOKENS

    assert PREFILL >= PREFILL_TOKENS and PREFILL % fused_triton.PREFILL_BLOCK_T != 0
    assert fused_triton.PREFILL_BLOCK_T > 1
    channels = {
        "k": dict(rotate=True, by_slot=True, kind=0, in_place=False, copy_tail=True, width=8, heads=2)
    }
    for prefill, block_t in ((False, 1), (True, fused_triton.PREFILL_BLOCK_T)):
        constexprs, _ = fused_triton.launch_config(
            4, False, True, False, False, False, channels, prefill=prefill
        )
        assert constexprs["BLOCK_T"] == block_t
    # A launch that stores FP8 keeps one token a program (its token loop spilled: fused_triton._fp8).
    for fp8 in ({"k": channels["k"] | dict(kind=1)}, {"q": channels["k"] | dict(kind=2, by_slot=False)}):
        constexprs, _ = fused_triton.launch_config(4, False, True, False, False, False, fp8, prefill=True)
        assert constexprs["BLOCK_T"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_triton_prefill_cache_write_equals_the_torch_backend(dtype, interleaved):
    """A prefill of 262 packed tokens (65 programs of 4, the last of 2): q, the key cache and the value cache
    equal the torch backend's bit for bit, and the float64 reference to the dtype's tolerance; the slot
    skipped (-1) and the slots nobody names keep their values."""
    from rotary_reference import reference_rotation

    head_dim, slots_n = 12, 300
    cos, sin = reference_tables(8, 512)  # partial rotary: the tail is copied
    g = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(PREFILL, h, head_dim, generator=g).to(dtype) for h in (4, 2, 2))
    positions = torch.randint(0, 512, (PREFILL,), generator=g)
    slots = torch.randperm(slots_n, generator=g)[:PREFILL]
    slots[PREFILL - 1] = -1  # in the short last block
    out = {}
    for backend in ("triton", "torch"):
        caches = [torch.randn(slots_n, 2, head_dim, generator=torch.Generator().manual_seed(s)).to(dtype)
                  for s in (1, 2)]  # fmt: skip
        got = ropekit.apply_rotary_qk_and_cache(
            q, k, v, cos, sin, k_cache=caches[0], v_cache=caches[1], slot_mapping=slots, positions=positions,
            cache_layout="flat", interleaved=interleaved, backend=backend,
        )  # fmt: skip
        out[backend] = (got, *caches)
    for got, want in zip(out["triton"], out["torch"], strict=True):
        assert torch.equal(got, want)
    tol = tolerance(dtype, 4.0)
    pos = positions.numpy()
    torch.testing.assert_close(
        out["triton"][0].double(), reference_rotation(q, cos, sin, pos, interleaved=interleaved), **tol
    )
    k_cache = out["triton"][1]
    keep = slots >= 0
    want_k = reference_rotation(k, cos, sin, pos, interleaved=interleaved)[keep]
    torch.testing.assert_close(k_cache[slots[keep]].double(), want_k, **tol)
    untouched = torch.ones(slots_n, dtype=torch.bool)
    untouched[slots[keep]] = False
    fresh = torch.randn(slots_n, 2, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert untouched.sum() > 0 and torch.equal(k_cache[untouched], fresh[untouched])


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_triton_prefill_fp8_contract_bit_for_bit(fp8_dtype):
    """The FP8 quantisation at prefill size (int offset, 2 x 131 tokens; one token a program: see
    fused_triton._fp8): the contract's bytes exactly."""
    from fused_cases import contract_bytes, float32_rotation

    head_dim = 16
    cos, sin = reference_tables(head_dim, 512)
    g = torch.Generator().manual_seed(22)
    q, k = (torch.randn(2, PREFILL // 2, h, head_dim, generator=g) * 50 for h in (4, 2))
    q8, k8 = ropekit.apply_rotary_qk_fp8(
        q, k, cos, sin, q_scale=0.2, k_scale=0.5, fp8_dtype=fp8_dtype, offsets=7, backend="triton"
    )
    pos = np.arange(PREFILL // 2)[None].repeat(2, 0) + 7
    assert torch.equal(
        q8.view(torch.uint8), contract_bytes(float32_rotation(q, cos, sin, pos, False), 0.2, fp8_dtype)
    )
    assert torch.equal(
        k8.view(torch.uint8), contract_bytes(float32_rotation(k, cos, sin, pos, False), 0.5, fp8_dtype)
    )


def test_triton_prefill_kernel_flags_a_bad_row_in_the_short_last_block(monkeypatch):
    """The kernel's own row check runs for every token of a block, the last block's too: a row past the
    table in the prefill's last token fails the launch (host check off)."""
    from ropekit.backends.fused_launch import Channel, FusedLaunch
    from ropekit.backends.triton import fused as fused_triton
    from ropekit.backends.triton import rotary as triton_backend

    monkeypatch.setattr(triton_backend, "HOST_CHECKS", False)
    cos, sin = reference_tables(8, 512)
    k = torch.randn(1, PREFILL, 1, 8)
    cache = torch.zeros(PREFILL, 1, 1, 8)
    positions = torch.arange(PREFILL)
    positions[-1] = 512
    channel = Channel(src=k, dst=cache, rotate=True, by_slot=True)
    launch = FusedLaunch(
        1, PREFILL, cos, sin, positions, 0, torch.arange(PREFILL), False, False, (None, channel, None)
    )
    with pytest.raises(RuntimeError, match="outside the cos/sin table or a slot outside the cache"):
        fused_triton.launch(launch, checked=True)
    fused_triton.launch(launch._replace(positions=torch.arange(PREFILL)))
    assert cache[-1].abs().sum() > 0  # the last block's last token written once the row is good
