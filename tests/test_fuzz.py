"""A misuse fuzzer for the functional API: random calls, valid and invalid, each checked against an
independent model of what the call should do.

Each example draws a layout (contiguous, HF's transposed bhsd view, a slice of a packed qkv buffer, a strided
last axis, an expanded view, packed thd with cu_seqlens), a dtype, shapes, partial rotary, a position mode
(none, int offset, per-sequence offsets, explicit positions, cu_seqlens; each sometimes out of range,
negative, of the wrong dtype or shape), a backend (torch, cpu, auto), inplace, interleaved, and whether
gradients flow. The model below decides, without ropekit's code, whether the call is valid. Then:

* valid: the output equals the float64 reference (ropekit.reference) within the dtype's tolerance, is finite,
  inputs are unchanged unless inplace=True, and gradients are the reference's conjugate rotation;
* invalid: a ValueError, with every input unchanged.

Anything else (another exception, a crash, NaN/inf, a modified input) fails. ``ROPEKIT_FUZZ_EXAMPLES`` sets
the number of eager examples (default 2000, ~15 s); the compiled test runs 1/200 as many (10, ~20 s).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import reference_rotation, tolerance
from ropekit import apply_rotary, apply_rotary_qk
from ropekit.backends import BACKENDS

EXAMPLES = int(os.environ.get("ROPEKIT_FUZZ_EXAMPLES", "2000"))
CPU_KERNEL = BACKENDS["cpu"].unavailable_reason(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1)) is None
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
LAYOUTS = ["contiguous", "bhsd", "packed_qkv", "strided", "expanded", "thd"]
MODES = ["none", "int", "tensor_offsets", "positions"]


@dataclass
class Case:
    """One drawn call: the tensors, the keyword arguments, and the model's verdict."""

    x: torch.Tensor
    k: torch.Tensor | None
    cos: torch.Tensor
    sin: torch.Tensor
    kwargs: dict
    rows: np.ndarray | None  # every token's table row, when the call is valid
    invalid: list[str] = field(default_factory=list)  # why the model expects a ValueError
    requires_grad: bool = False


def _view(layout, lead, heads, head_dim, dtype, g, rng):
    """A tensor of shape lead + (heads, head_dim) in the drawn memory layout, with finite values."""

    def randn(*shape):
        return (torch.randn(*shape, generator=g) * float(rng.choice([0.5, 3.0, 50.0]))).to(dtype)

    if layout == "bhsd" and len(lead) == 2:
        return randn(lead[0], heads, lead[1], head_dim).transpose(1, 2)  # (B, S, H, D) view of (B, H, S, D)
    if layout == "packed_qkv":
        return randn(*lead, 3, heads, head_dim)[..., 1, :, :]  # the k slice of a (..., 3, H, D) buffer
    if layout == "strided":
        return randn(*lead, heads, 2 * head_dim)[..., ::2]  # last axis of stride 2
    if layout == "expanded" and len(lead) == 2:
        return randn(lead[0], 1, heads, head_dim).expand(*lead, heads, head_dim)  # stride 0 over seq
    return randn(*lead, heads, head_dim)


@st.composite
def cases(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    g, rng = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
    layout = draw(st.sampled_from(LAYOUTS))
    dtype = draw(st.sampled_from(DTYPES))
    mode = draw(st.sampled_from(MODES))
    half = draw(st.integers(1, 6))
    head_dim = draw(st.sampled_from([2 * half, 2 * half + draw(st.integers(1, 4))]))
    if draw(st.integers(0, 15)) == 0:
        head_dim = 2 * half - 2  # table wider than the head: invalid
    head_dim = max(head_dim, 1)
    table_len = draw(st.integers(1, 40))
    heads, k_heads = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    invalid = []
    if 2 * half > head_dim:
        invalid.append("rotary_dim > head_dim")

    if layout == "thd":
        lens = draw(st.lists(st.integers(0, 5), min_size=1, max_size=4))
        total = sum(lens)
        lead = (total,)
        cu = np.cumsum([0, *lens])
        cu_t = torch.tensor(cu, dtype=draw(st.sampled_from([torch.int32, torch.int64])))
        if draw(st.integers(0, 9)) == 0:  # malformed: does not end at total_tokens, or decreases
            cu_t = cu_t.clone()
            cu_t[-1] += 1
            invalid.append("cu_seqlens does not end at total_tokens")
        kwargs = {"cu_seqlens": cu_t}
        starts = np.repeat(cu[:-1], lens)
        base = np.arange(total) - starts  # position within each packed sequence
        seq_of = np.repeat(np.arange(len(lens)), lens)
        n_seq = len(lens)
    else:
        batch, seq = draw(st.integers(0, 3)), draw(st.integers(0, 6))
        lead = (batch, seq)
        kwargs = {}
        base = np.broadcast_to(np.arange(seq)[None, :], lead)
        seq_of = np.broadcast_to(np.arange(batch)[:, None], lead)
        n_seq = batch

    if mode == "int":
        offset = draw(st.one_of(st.integers(0, 45), st.sampled_from([-1, 2**62, 2**63, 2**64])))
        kwargs["offsets"] = offset
        rows = base + offset if 0 <= offset < 2**63 else None
        if rows is None:
            invalid.append("offset negative or past int64")
    elif mode == "tensor_offsets":
        n = n_seq + (1 if draw(st.integers(0, 12)) == 0 else 0)
        off = draw(st.lists(st.integers(-2, 40), min_size=n, max_size=n))
        kwargs["offsets"] = torch.tensor(off, dtype=draw(st.sampled_from([torch.int32, torch.int64])))
        if n != n_seq:
            invalid.append("offsets of the wrong length")
            rows = None
        else:
            rows = base + np.asarray(off, dtype=np.int64)[seq_of] if len(off) else base.copy()
            if min(off, default=0) < 0:
                invalid.append("negative offsets")
    elif mode == "positions":
        shape = lead if draw(st.integers(0, 12)) else (*lead, 1)
        values = rng.integers(-1 if draw(st.integers(0, 8)) == 0 else 0, table_len + 2, size=shape)
        pos_dtype = draw(st.sampled_from([torch.int64, torch.int32, torch.int16, torch.float32]))
        kwargs["positions"] = torch.from_numpy(values).to(pos_dtype)
        rows = values if shape == lead else None
        if shape != lead:
            invalid.append("positions of the wrong shape")
        if pos_dtype == torch.float32:
            invalid.append("float positions")
        if pos_dtype == torch.int16 and values.size and (values.max() > 32767):
            invalid.append("int16 overflow")  # never drawn with these table sizes; kept for clarity
        if draw(st.integers(0, 12)) == 0:
            kwargs["offsets"] = 1
            invalid.append("positions with a non-zero offset")
    else:
        rows = base.copy()
    if rows is not None and rows.size:
        if rows.min() < 0:
            invalid.append("a negative row")
        if rows.max() >= table_len:
            invalid.append("a row past the table")

    x = _view(layout, lead, heads, head_dim, dtype, g, rng)
    with_k = draw(st.booleans())
    k = _view(draw(st.sampled_from(LAYOUTS[:-1] if layout != "thd" else ["contiguous"])), lead, k_heads,
              head_dim, dtype, g, rng) if with_k else None  # fmt: skip
    backend = draw(st.sampled_from(["torch", "cpu", "auto"] if CPU_KERNEL else ["torch", "auto"]))
    if backend == "cpu" and dtype == torch.float64:
        invalid.append("the cpu kernel does not serve float64")
    inplace = draw(st.booleans())
    if inplace:
        for t in (x, k):
            if (
                t is not None
                and t.numel()
                and 0 in t.stride()
                and any(n > 1 for n, s in zip(t.shape, t.stride(), strict=True) if s == 0)
            ):
                invalid.append("in place on an expanded view")
        if with_k and draw(st.integers(0, 10)) == 0 and k.shape == x.shape and x.numel():
            k = x  # q and k the same memory
            invalid.append("q and k share memory")
    # Gradients flow through copies of x and k (leaves, then non-leaf copies for in place): an expanded view
    # would be densified by that copy, so expanded in-place cases run without gradients.
    expanded_inplace = "in place on an expanded view" in invalid
    requires_grad = dtype in (torch.float32, torch.float64) and not expanded_inplace and draw(st.booleans())
    table_dtype = torch.float64 if draw(st.integers(0, 3)) == 0 else torch.float32
    angles = np.arange(table_len)[:, None] * (10000.0 ** (-np.arange(half) / max(half, 1)))[None, :]
    cos = torch.from_numpy(np.cos(angles)).to(table_dtype)
    sin = torch.from_numpy(np.sin(angles)).to(table_dtype)
    kwargs.update(interleaved=draw(st.booleans()), inplace=inplace, backend=backend)
    return Case(x, k, cos, sin, kwargs, None if invalid else np.asarray(rows), invalid, requires_grad)


def _call(case: Case, call=None):
    x, k = case.x, case.k
    if case.requires_grad:
        x = x.detach().clone().requires_grad_(True)
        k = None if k is None else (x if case.k is case.x else k.detach().clone().requires_grad_(True))
        leaves = (x, k)
        if case.kwargs["inplace"]:  # in place needs non-leaf inputs, as for any in-place op
            x = x * 1
            k = None if k is None else (x if case.k is case.x else k * 1)
    else:
        leaves = (None, None)
    if call is not None:
        return call(x, k), leaves, (x, k)
    if k is None:
        return (apply_rotary(x, case.cos, case.sin, **case.kwargs), None), leaves, (x, k)
    return apply_rotary_qk(x, k, case.cos, case.sin, **case.kwargs), leaves, (x, k)


def _inputs(case: Case) -> dict[str, torch.Tensor]:
    return {
        name: t
        for name, t in (("x", case.x), ("k", case.k), ("cos", case.cos), ("sin", case.sin))
        if t is not None
    }


def _check(case: Case, call=None, compiled=False) -> None:
    before = {name: t.clone() for name, t in _inputs(case).items()}
    if case.invalid:
        with pytest.raises((ValueError, RuntimeError)) as info:
            _call(case, call)
        # Compiled, a check that reads tensor values runs on the device (torch._assert_async): a RuntimeError
        # naming what it checked. It may fire before a shape check that the eager path reports first.
        device_checked = ("cos/sin table", "cu_seqlens")
        if not (
            isinstance(info.value, ValueError)
            or (compiled and any(w in str(info.value) for w in device_checked))
        ):
            raise AssertionError(f"expected a ValueError for {case.invalid}, got {info.value!r}")
        for name, t in _inputs(case).items():
            assert torch.equal(t, before[name]), f"an invalid call ({case.invalid}) modified {name}"
        return
    (out_x, out_k), leaves, inputs = _call(case, call)
    interleaved = case.kwargs["interleaved"]
    for name, got, src in (("x", out_x, before["x"]), ("k", out_k, before.get("k"))):
        if got is None:
            continue
        assert got.shape == src.shape and got.dtype == src.dtype
        assert torch.isfinite(got).all(), f"{name}: NaN or inf from finite input"
        want = reference_rotation(src, case.cos, case.sin, case.rows, interleaved=interleaved)
        scale = float(src.abs().max()) if src.numel() else 1.0
        torch.testing.assert_close(got.detach().double(), want, **tolerance(got.dtype, scale))
    if not case.kwargs["inplace"]:
        for name, t in _inputs(case).items():
            assert torch.equal(t, before[name]), f"an out-of-place call modified {name}"
    else:
        assert out_x is inputs[0]
    if case.requires_grad and out_x.numel():
        grads = [torch.ones_like(out_x) * 0.5] + ([torch.ones_like(out_k)] if out_k is not None else [])
        torch.autograd.backward([o for o in (out_x, out_k) if o is not None], grads)
        for leaf, grad in zip(leaves, grads, strict=False):
            if leaf is None or leaf.grad is None:
                continue
            want = reference_rotation(grad, case.cos, -case.sin, case.rows, interleaved=interleaved)
            torch.testing.assert_close(leaf.grad.double(), want, **tolerance(leaf.dtype))


@settings(max_examples=EXAMPLES, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=cases())
def test_any_call_is_right_or_a_value_error(case):
    _check(case)


def _compiled_call(case):
    kwargs = case.kwargs

    def step(x, k):
        if k is None:
            return apply_rotary(x, case.cos, case.sin, **kwargs), None
        return apply_rotary_qk(x, k, case.cos, case.sin, **kwargs)

    return torch.compile(step, backend="aot_eager", dynamic=False)


@settings(max_examples=max(EXAMPLES // 200, 4), suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_any_compiled_call_is_right_or_an_error(case):
    """Compiled: valid calls as in eager; invalid ones raise (a device-side assert of the torch backend is a
    RuntimeError naming the table), never garbage."""
    torch._dynamo.reset()
    compiled = _compiled_call(case)
    _check(case, call=compiled, compiled=True)
