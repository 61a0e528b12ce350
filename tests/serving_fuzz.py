"""The serving surfaces' fuzz families, drawn by tests/test_fuzz.py (not collected on its own).

Each family draws one call of a serving surface (the KV-cache fusion, the FP8 fusion, the cache shift,
QK-norm, FlashInfer's paged append, the vLLM / FlashInfer / flash-attn compat calls), builds every tensor it
passes as a view into a few flat buffers (so caches can sit inside larger allocations, sources can be strided
slices, and a source can alias a cache), and states, without ropekit's code, what the call must leave in every
byte of every buffer: the float64 reference (ropekit.reference, through tests/rotary_reference.py) at the
declared outputs, the bytes as they were everywhere else. A call is then one of:

* "ok": it returns, the declared outputs match the model within the dtype's tolerance, and every other byte of
  every buffer (inputs, tables, cache slots not written, padding around views) is unchanged;
* "error": a ValueError, with every byte of every buffer unchanged;
* "either" (aliasing sources, duplicate slots): a ValueError with nothing changed, or the "ok" outcome, where
  the reference reads every source as it was before the call.

Backends: ``ROPEKIT_FUZZ_BACKENDS`` (default "torch,cpu,auto"; cpu only where its C kernel builds; "triton"
under TRITON_INTERPRET=1 in a separate process).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import strategies as st

from c_compiler import find_compiler
from ropekit import apply_rotary_qk_and_cache, apply_rotary_qk_fp8, qk_norm_rotary_, shift_cache_
from ropekit.compat import flash_attn as fa_compat
from ropekit.compat import flashinfer as fi_compat
from ropekit.compat import vllm as vllm_compat
from rotary_reference import reference_rotation, reference_tables, tolerance

CPU_KERNEL = find_compiler() is not None  # where there is one, a C loop that fails to build fails the fuzz
_WANTED = os.environ.get("ROPEKIT_FUZZ_BACKENDS", "torch,cpu,auto").split(",")
FUZZ_BACKENDS = [b for b in _WANTED if b and (b != "cpu" or CPU_KERNEL)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
LAYOUTS = ["flat", "nhd", "hnd"]
TABLE_LEN = 24


# ---- memory: every tensor of a call is a view into a buffer the model accounts for byte by byte ------------


class Memory:
    """The buffers of one drawn call and what the call must leave in them."""

    def __init__(self, g: torch.Generator) -> None:
        self.g = g
        self.buffers: list[torch.Tensor] = []
        self.before: list[torch.Tensor] = []
        # (buffer, flat element indices, the values it may hold (any one of them), elementwise bound)
        self.writes: list[tuple[int, torch.Tensor, list[torch.Tensor], torch.Tensor]] = []

    def buffer(self, shape, dtype, scale: float = 1.0) -> torch.Tensor:
        """A new contiguous buffer of random finite values."""
        t = (torch.randn(*shape, generator=self.g) * scale).to(dtype)
        self.buffers.append(t)
        return t

    def adopt(self, t: torch.Tensor) -> torch.Tensor:
        """Account for a contiguous tensor built elsewhere (a table, an index tensor)."""
        assert t.is_contiguous()
        self.buffers.append(t)
        return t

    def snapshot(self) -> None:
        self.before = [b.clone() for b in self.buffers]

    def _locate(self, view: torch.Tensor) -> tuple[int, torch.Tensor]:
        """The buffer view lives in and the flat element index of each of its elements."""
        for i, b in enumerate(self.buffers):
            if b.untyped_storage().data_ptr() == view.untyped_storage().data_ptr() and b.dtype == view.dtype:
                idx = torch.arange(b.numel()).as_strided(
                    view.shape, view.stride(), view.storage_offset() - b.storage_offset()
                )
                return i, idx
        raise AssertionError("a written view outside every buffer")

    def write(self, view: torch.Tensor, *wants: torch.Tensor, bound: torch.Tensor | float = 0.0) -> None:
        """The call must leave view equal to one of wants (float64, view's shape) within bound; with several
        wants (duplicate slots) any one of them, as a whole."""
        i, idx = self._locate(view)
        bound = torch.as_tensor(bound, dtype=torch.float64).expand(view.shape).reshape(-1)
        self.writes.append((i, idx.reshape(-1), [w.double().reshape(-1) for w in wants], bound))

    def assert_unchanged(self, why: str) -> None:
        for i, (b, was) in enumerate(zip(self.buffers, self.before, strict=True)):
            assert _same_bytes(b, was).all(), f"{why} changed buffer {i} {tuple(b.shape)} {b.dtype}"

    def assert_as_modelled(self) -> None:
        """Written elements as the model says; every other byte of every buffer as before."""
        written = [torch.zeros(b.numel(), dtype=torch.bool) for b in self.buffers]
        for i, idx, wants, bound in self.writes:
            got = self.buffers[i].reshape(-1)[idx].double()
            if not any(bool(((got - w).abs() <= bound).all()) for w in wants):
                worst = min(float((got - w).abs().sub(bound).max()) for w in wants)
                raise AssertionError(
                    f"buffer {i}: a written region is off the float64 model by {worst:.3g} past its bound "
                    f"(got {got[:8].tolist()}, want {wants[0][:8].tolist()})"
                )
            written[i][idx] = True
        for i, (b, was) in enumerate(zip(self.buffers, self.before, strict=True)):
            changed = ~_same_bytes(b, was) & ~written[i]
            assert not changed.any(), (
                f"buffer {i} {tuple(b.shape)} {b.dtype}: {int(changed.sum())} element(s) outside the "
                f"declared outputs changed (first at flat index {int(changed.nonzero()[0])})"
            )


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element, whether a and b hold the same bytes."""
    size = a.element_size()
    return (
        a.reshape(-1).view(torch.uint8).view(-1, size) == b.reshape(-1).view(torch.uint8).view(-1, size)
    ).all(1)


class Call:
    """One drawn call: the memory model, the call, its expected outcome ("ok", "error" or "either") and a
    check of what it returns; ``why`` says what the draw is, for a failure's message."""

    def __init__(
        self, memory: Memory, call, outcome: str, check_result=None, why: str = "", written=()
    ) -> None:
        self.memory, self.call, self.outcome, self.why = memory, call, outcome, why
        self.check_result = check_result or (lambda result: None)
        # The caller's tensors a served call writes in place (at least one element each): their version
        # counters must move, as after a PyTorch in-place op, so autograd sees the write.
        self.written = [t for t in written if t.numel()]

    def __repr__(self) -> str:
        return f"Call({self.outcome}: {self.why})"


def run_call(case: Call, call: Callable[[], object] | None = None) -> None:
    """Run the call (or ``call``, a compiled stand-in) and hold it to its model.

    A compiled call may refuse a value with the RuntimeError of a device-side check (torch._assert_async,
    whose message names what it checked) where eager raises a ValueError; either way nothing may be
    written."""
    refusals = (ValueError,) if call is None else (ValueError, RuntimeError)
    memory = case.memory
    memory.snapshot()
    if case.outcome == "error":
        with pytest.raises(refusals):
            (call or case.call)()
        memory.assert_unchanged(f"an invalid call ({case.why})")
        return
    versions = [t._version for t in case.written]
    try:
        result = (call or case.call)()
    except refusals:
        if case.outcome == "ok":
            raise
        memory.assert_unchanged(f"a refused call ({case.why})")
        return
    case.check_result(result)
    memory.assert_as_modelled()
    if call is not None:  # compiled, the C kernels' writes leave the counters as they were today: see
        return  # test_a_compiled_serving_write_moves_the_version_counter_as_in_eager (tests/test_fuzz.py)
    for t, version in zip(case.written, versions, strict=True):
        assert t._version > version, f"an in-place write left the version counter as it was ({case.why})"


# ---- shared pieces ---------------------------------------------------------------------------------------


def _bound(dtype: torch.dtype, want: torch.Tensor, scale: float) -> torch.Tensor:
    """The elementwise bound of tolerance(dtype, scale) around want."""
    tol = tolerance(dtype, scale)
    return tol["atol"] + tol["rtol"] * want.abs()


def _rotated(
    x: torch.Tensor, cos, sin, rows, interleaved, conjugate=False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the float64 reference rotation of x at rows, its elementwise bound in x's dtype)."""
    want = reference_rotation(x, cos, sin, np.asarray(rows), interleaved=interleaved, conjugate=conjugate)
    scale = float(x.detach().abs().max()) if x.numel() else 1.0
    return want, _bound(x.dtype, want, scale)


def _padded_view(
    memory: Memory, shape: tuple[int, ...], dtype, draw, scale: float = 1.0, padded: bool = True
) -> torch.Tensor:
    """A tensor of shape inside a larger buffer: leading entries before it, and axis 1 padded, sometimes."""
    lead = draw(st.integers(0, 2)) if padded and draw(st.booleans()) else 0
    pad = draw(st.integers(0, 2)) if padded and len(shape) > 2 and draw(st.booleans()) else 0
    full = list(shape)
    full[0] += lead
    if len(shape) > 2:
        full[1] += pad
    buf = memory.buffer(full, dtype, scale)
    view = buf[lead:]
    return view[:, : shape[1]] if len(shape) > 2 else view


def _slot_view(cache4: torch.Tensor, slot: int) -> torch.Tensor:
    """Slot s of a (pages, page_size, heads, width) cache view: (heads, width)."""
    page_size = cache4.shape[1]
    return cache4[slot // page_size, slot % page_size]


def _as_pages(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """Any cache layout as a (pages, page_size, heads, width) view (never a copy)."""
    if layout == "flat":
        return cache.unsqueeze(1)
    if layout == "nhd":
        return cache
    return cache.transpose(1, 2)


def _cache_shape(layout: str, pages: int, page_size: int, heads: int, width: int) -> tuple[int, ...]:
    if layout == "flat":
        return (pages * page_size, heads, width)
    if layout == "nhd":
        return (pages, page_size, heads, width)
    return (pages, heads, page_size, width)


def _tables(memory: Memory, draw, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (sometimes float64) reference tables of TABLE_LEN rows, accounted for as read-only buffers."""
    cos, sin = reference_tables(2 * half, TABLE_LEN)
    if draw(st.integers(0, 3)) == 0:
        cos, sin = cos.double(), sin.double()
    return memory.adopt(cos.contiguous()), memory.adopt(sin.contiguous())


def _backend(draw, dtype: torch.dtype) -> str:
    backends = [b for b in FUZZ_BACKENDS if dtype != torch.float64 or b in ("torch", "auto")]
    return draw(st.sampled_from(backends or ["torch"]))


def _op_backend(draw, dtype: torch.dtype) -> str:
    """A registered op's backend: a concrete one (the functions resolve "auto" before they reach the op)."""
    backends = [b for b in FUZZ_BACKENDS if b != "auto" and (dtype != torch.float64 or b == "torch")]
    return draw(st.sampled_from(backends or ["torch"]))


def _leaf_requiring_grad(draw, op: bool, buffer: torch.Tensor, why: list) -> tuple[Callable, bool]:
    """How a registered op is called: sometimes (op=True) with its in-place target a view of a leaf that
    requires grad, which PyTorch's in-place ops refuse (``x.mul_(2)`` raises) and so must the op, before it
    writes. Returns a wrapper that runs the call that way (the buffer's flag restored after), and whether
    the call is to be refused."""
    if not (op and draw(st.integers(0, 7)) == 0):
        return (lambda call: call()), False
    why.append("in place on a view of a leaf that requires grad")

    def run(call):
        buffer.requires_grad_(True)
        try:
            return call()
        finally:
            buffer.requires_grad_(False)

    return run, True


def _seed(draw) -> torch.Generator:
    return torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))


# ---- apply_rotary_qk_and_cache -----------------------------------------------------------------------------


@st.composite
def fused_calls(draw, alias: bool = False):
    """RoPE + KV-cache write: flat / nhd / hnd caches inside larger buffers, packed or 4-D tokens, positions
    or an int offset, slots with -1 padding, sometimes a duplicate or out-of-range slot, q None or in place.

    alias=True: a source is a view of a cache (k or v of k_cache or v_cache, or q of k_cache): the call
    refuses it with nothing written, or reads every source as it was before the call."""
    memory = Memory(_seed(draw))
    dtype = draw(st.sampled_from(DTYPES if alias else [*DTYPES, torch.float64]))
    backend = _backend(draw, dtype)
    layout = draw(st.sampled_from(["flat", "nhd"] if alias else LAYOUTS))
    page_size = 1 if layout == "flat" else draw(st.integers(1, 4))
    pages = draw(st.integers(2 if alias else 1, 6 if layout == "flat" else 3))
    num_slots = pages * page_size
    half = draw(st.integers(1, 4))
    head_dim = 2 * half + draw(st.integers(0, 2))
    k_heads = draw(st.integers(1, 2))
    q_heads = k_heads * draw(st.integers(1, 2))
    v_dim = head_dim if alias or draw(st.booleans()) else draw(st.integers(1, 6))
    if alias:
        q_heads = k_heads
    tokens = draw(st.integers(2 if alias else 0, min(num_slots, 6)))  # alias: num_slots >= 2
    packed = alias or draw(st.booleans())
    lead = (tokens,) if packed else (1, tokens) if draw(st.booleans()) or tokens < 2 else (2, tokens // 2)
    tokens = int(np.prod(lead))
    interleaved = draw(st.booleans())
    why = [f"{backend} {dtype} {layout} lead {lead}"]

    # Aliased caches stay dense, so that a run of slots is one (tokens, heads, width) view of them.
    k_cache = _padded_view(memory, _cache_shape(layout, pages, page_size, k_heads, head_dim), dtype, draw,
                           padded=not alias)  # fmt: skip
    v_cache = _padded_view(memory, _cache_shape(layout, pages, page_size, k_heads, v_dim), dtype, draw,
                           padded=not alias)  # fmt: skip
    scale = float(draw(st.sampled_from([0.5, 3.0, 50.0])))
    q = _padded_view(memory, (*lead, q_heads, head_dim), dtype, draw, scale)
    k = _padded_view(memory, (*lead, k_heads, head_dim), dtype, draw, scale)
    v = _padded_view(memory, (*lead, k_heads, v_dim), dtype, draw, scale)
    cache_only = not alias and draw(st.integers(0, 4)) == 0
    inplace = not cache_only and draw(st.booleans())
    if alias:
        rows_k = k_cache.view(-1, k_heads, head_dim)  # (num_slots, heads, width), a view
        rows_v = v_cache.view(-1, k_heads, v_dim)
        start = draw(st.integers(0, num_slots - tokens))
        kind = draw(st.sampled_from(["k<-k_cache", "v<-v_cache", "k<-v_cache", "v<-k_cache", "q<-k_cache"]))
        region = (rows_k if kind.endswith("k_cache") else rows_v)[start : start + tokens]
        if kind[0] == "k":
            k = region
        elif kind[0] == "v":
            v = region
        else:
            q = region
        why.append(f"{kind} at slot {start}")

    # Slots: distinct, some -1; sometimes a duplicate, sometimes one outside [-1, num_slots). An aliased
    # source is written half the time one slot past (or before) where it is read: token t's write lands on
    # the row token t + 1 reads next, as in issue 24's reproduction.
    perm = torch.randperm(num_slots, generator=memory.g)[:tokens]
    if alias and draw(st.booleans()):
        perm = (start + torch.arange(tokens) + draw(st.sampled_from([1, -1]))) % num_slots
    slots = perm.clone()
    if tokens and draw(st.integers(0, 3)) == 0:
        slots[draw(st.integers(0, tokens - 1))] = -1
    duplicate = not alias and tokens > 1 and draw(st.integers(0, 5)) == 0
    if duplicate:
        a, b = draw(st.permutations(range(tokens)))[:2]
        slots[a] = slots[b] = perm[a]
        why.append(f"duplicate slot {int(perm[a])}")
    bad_slot = not alias and tokens and draw(st.integers(0, 5)) == 0
    if bad_slot:
        slots[draw(st.integers(0, tokens - 1))] = draw(st.sampled_from([num_slots, -2, num_slots + 7]))
        why.append("a slot outside the cache")
    slot_mapping = memory.adopt(slots.reshape(lead).contiguous())

    cos, sin = _tables(memory, draw, half)
    pos_kind = draw(st.sampled_from(["positions", "offset"]))
    bad_position = not alias and tokens > 0 and draw(st.integers(0, 11)) == 0
    if pos_kind == "positions":
        rows = torch.randint(0, TABLE_LEN, lead, generator=memory.g)
        if bad_position:
            rows.view(-1)[0] = TABLE_LEN
        kwargs = {"positions": memory.adopt(rows.contiguous())}
        rows = rows.numpy()
    else:
        seq = lead[-1]
        offset = draw(st.integers(0, TABLE_LEN - seq)) + (TABLE_LEN if bad_position else 0)
        kwargs = {"offsets": offset}
        rows = np.broadcast_to(np.arange(seq) + offset, lead)
    if bad_position:
        why.append("a position past the table")

    # The model, from every source as it was before the call.
    q_src, k_src, v_src = (t.detach().clone() for t in (q, k, v))
    if not (bad_slot or bad_position):
        k_want, k_bound = _rotated(k_src, cos, sin, rows, interleaved)
        by_slot: dict[int, list[int]] = {}
        for token, s in enumerate(slots.tolist()):
            if s >= 0:
                by_slot.setdefault(s, []).append(token)
        kc4, vc4 = _as_pages(k_cache, layout), _as_pages(v_cache, layout)
        k_rows = k_want.reshape(tokens, k_heads, head_dim)
        v_rows = v_src.reshape(tokens, k_heads, v_dim).double()
        k_bounds = k_bound.reshape(tokens, k_heads, head_dim)
        for s, owners in by_slot.items():
            memory.write(_slot_view(kc4, s), *(k_rows[t] for t in owners), bound=k_bounds[owners[0]].max())
            memory.write(_slot_view(vc4, s), *(v_rows[t] for t in owners))
        q_want, q_bound = _rotated(q_src, cos, sin, rows, interleaved)
        if inplace:
            memory.write(q, q_want, bound=q_bound)

    def call():
        return apply_rotary_qk_and_cache(
            None if cache_only else q, k, v, cos, sin, k_cache=k_cache, v_cache=v_cache,
            slot_mapping=slot_mapping, cache_layout=layout, interleaved=interleaved, inplace=inplace,
            backend=backend, **kwargs,
        )  # fmt: skip

    def check_result(result):
        if cache_only:
            assert result is None
        elif inplace:
            assert result is q
        else:
            assert result.shape == q.shape and result.dtype == dtype
            assert ((result.double() - q_want).abs() <= q_bound).all(), "q_out off the float64 reference"

    invalid = bad_slot or bad_position
    outcome = "error" if invalid else "either" if alias or duplicate else "ok"
    if alias and kind == "q<-k_cache" and inplace:
        outcome = "error"  # q written in place over the cache it writes: refused today (check_disjoint)
    written = [k_cache, v_cache] if any(s >= 0 for s in slots.tolist()) else []
    written += [q] if inplace else []
    return Call(memory, call, outcome, check_result, ", ".join(why), written)


# ---- apply_rotary_qk_fp8 -----------------------------------------------------------------------------------


def _fp8_bound(want_stored: torch.Tensor, fp8: torch.dtype, fp32_err: torch.Tensor | float) -> torch.Tensor:
    """One FP8 ulp of the stored value (a full ulp: the contract rounds a float32 value, the model a float64
    one), the format's smallest subnormal, and the float32 error of the rotation in stored units."""
    mantissa = 3 if fp8 == torch.float8_e4m3fn else 2
    subnormal = 2.0 ** (-9 if fp8 == torch.float8_e4m3fn else -16)
    return want_stored.abs() * 2.0**-mantissa + subnormal + fp32_err


def _stored(value: torch.Tensor, scale: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """The contract's stored value of float64 value (..., H, D) with a (H,) or (1,) dividing scale."""
    fmax = torch.finfo(fp8).max
    return (value / scale.double()[:, None]).clamp(-fmax, fmax)


@st.composite
def fp8_calls(draw, op: bool = False):
    """RoPE + FP8: packed or 4-D, positions or an offset, per-tensor or per-head scales (numbers or tensors),
    both FP8 formats, sometimes the MLA nope parts; sometimes a scale that is not finite and > 0.

    op=True: the registered op ``torch.ops.ropekit.rotary_qk_fp8`` called directly (a public door: it checks
    what the function checks), scales as the tensors its schema takes."""
    memory = Memory(_seed(draw))
    dtype = draw(st.sampled_from(DTYPES))
    backend = _op_backend(draw, dtype) if op else _backend(draw, dtype)
    fp8 = draw(st.sampled_from(FP8))
    half = draw(st.integers(1, 4))
    head_dim = 2 * half + draw(st.integers(0, 2))
    q_heads, k_heads = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    # From 1: an empty call on the cpu backend raises an internal error today (tests/test_fuzz.py,
    # test_an_empty_fp8_call_returns_empty_outputs_on_the_cpu_backend_as_on_torch).
    tokens = draw(st.integers(1, 5))
    lead = (tokens,) if draw(st.booleans()) else (1, tokens)
    scale = float(draw(st.sampled_from([0.5, 3.0, 300.0])))  # 300: past e4m3's 448 after a small scale
    q = _padded_view(memory, (*lead, q_heads, head_dim), dtype, draw, scale)
    k = _padded_view(memory, (*lead, k_heads, head_dim), dtype, draw, scale)
    mla = draw(st.integers(0, 3)) == 0
    nope_dim = draw(st.integers(1, 4))
    q_nope = _padded_view(memory, (*lead, q_heads, nope_dim), dtype, draw, scale) if mla else None
    k_nope = _padded_view(memory, (*lead, k_heads, nope_dim), dtype, draw, scale) if mla else None
    cos, sin = _tables(memory, draw, half)
    interleaved = draw(st.booleans())
    rows = torch.randint(0, TABLE_LEN, lead, generator=memory.g)
    kwargs = {"positions": memory.adopt(rows.contiguous())}
    rows = rows.numpy()

    invalid = []
    scales, models = [], []  # as passed; as the model reads them ((1,) or (heads,), dividing)
    for name, heads in (("q_scale", q_heads), ("k_scale", k_heads)):
        kind = draw(st.sampled_from(["(1,)", "0-d", "per-head"] if op else ["float", "0-d", "per-head"]))
        if op and kind == "0-d":  # the function's form, not the op's: refused by name
            invalid.append(f"{name} 0-d")
        values = torch.tensor([draw(st.sampled_from([0.01, 0.25, 1.0, 7.0])) for _ in range(heads)])
        if draw(st.integers(0, 11)) == 0:
            values[0] = draw(st.sampled_from([0.0, -1.0, float("nan"), float("inf")]))
            invalid.append(f"{name} {values[0].item()}")
        if kind == "float":
            scales.append(float(values[0]))
            values = values[:1]
        elif kind == "(1,)":
            scales.append(memory.adopt(values[:1].clone()))
            values = values[:1]
        elif kind == "0-d":
            scales.append(memory.adopt(values[:1].reshape(()).clone()))
            values = values[:1]
        else:
            scales.append(memory.adopt(values.clone()))
        models.append(values)

    def call():
        if op:
            positions = kwargs["positions"]
            return torch.ops.ropekit.rotary_qk_fp8(
                q, k, cos, sin, positions, 0, *scales, fp8, q_nope, k_nope, interleaved, backend
            )
        return apply_rotary_qk_fp8(
            q, k, cos, sin, q_scale=scales[0], k_scale=scales[1], fp8_dtype=fp8, q_nope=q_nope, k_nope=k_nope,
            interleaved=interleaved, backend=backend, **kwargs,
        )  # fmt: skip

    def check_result(result):
        sources = [(q, models[0], True), (k, models[1], True)]
        if mla:
            sources += [(q_nope, models[0], False), (k_nope, models[1], False)]
        assert len(result) == len(sources)
        for out, (src, s, rotate) in zip(result, sources, strict=True):
            assert out.dtype == fp8 and out.shape == src.shape
            value = _rotated(src, cos, sin, rows, interleaved)[0] if rotate else src.double()
            want = _stored(value, s, fp8)
            err = 16 * torch.finfo(torch.float32).eps * (float(src.abs().max()) if src.numel() else 1.0)
            bound = _fp8_bound(want, fp8, err / s.double().min())
            assert ((out.double() - want).abs() <= bound).all(), f"FP8 output off the contract ({fp8})"

    why = f"{'op ' if op else ''}{backend} {dtype} {fp8} lead {lead} mla {mla} {invalid}"
    return Call(memory, call, "error" if invalid else "ok", check_result, why)


# ---- shift_cache_ ------------------------------------------------------------------------------------------


@st.composite
def shift_calls(draw, duplicates: bool = False, op: bool = False):
    """Cache shift: every layout inside a larger buffer, any delta (negative: the conjugate rotation), every
    slot or a subset with -1 padding; sometimes |delta| past the table or a slot outside the cache.

    duplicates=True: slots name one slot twice; the call refuses it with nothing written, or rotates that
    slot once (slots are a set: the docs say distinct).

    op=True: the registered op ``torch.ops.ropekit.shift_cache_`` called directly, sometimes on a view of a
    leaf that requires grad (refused, as PyTorch's in-place ops refuse it)."""
    memory = Memory(_seed(draw))
    dtype = draw(st.sampled_from(DTYPES if duplicates else [*DTYPES, torch.float64]))
    backend = _op_backend(draw, dtype) if op else _backend(draw, dtype)
    layout = draw(st.sampled_from(LAYOUTS))
    page_size = 1 if layout == "flat" else draw(st.integers(1, 4))
    pages = draw(st.integers(1, 6 if layout == "flat" else 3))
    num_slots = pages * page_size
    half = draw(st.integers(1, 4))
    width = 2 * half + draw(st.integers(0, 2))
    heads = draw(st.integers(1, 3))
    cache = _padded_view(memory, _cache_shape(layout, pages, page_size, heads, width), dtype, draw, 3.0)
    cos, sin = _tables(memory, draw, half)
    delta = draw(st.integers(-(TABLE_LEN - 1), TABLE_LEN - 1))
    bad_delta = draw(st.integers(0, 11)) == 0
    if bad_delta:
        delta = draw(st.sampled_from([TABLE_LEN, -TABLE_LEN, TABLE_LEN + 5]))
    interleaved = draw(st.booleans())
    why = [f"{'op ' if op else ''}{backend} {dtype} {layout} delta {delta}"]
    run, leaf = _leaf_requiring_grad(draw, op, memory.buffers[0], why)  # the cache's buffer
    if duplicates or draw(st.booleans()):
        n = draw(st.integers(1 if duplicates else 0, num_slots))
        chosen = torch.randperm(num_slots, generator=memory.g)[:n]
        ids = chosen.tolist()
        if n > 1 and draw(st.integers(0, 3)) == 0:
            ids[draw(st.integers(1, n - 1))] = -1  # never chosen[0], the slot a duplicate names again
        if duplicates:
            ids.insert(draw(st.integers(0, len(ids))), chosen[0].item())
            why.append(f"slot {chosen[0].item()} twice")
        bad_slot = bool(ids) and draw(st.integers(0, 3)) == 0 and not duplicates
        if bad_slot:
            ids[draw(st.integers(0, len(ids) - 1))] = draw(st.sampled_from([num_slots, -2]))
            why.append("a slot outside the cache")
        slots = memory.adopt(torch.tensor(ids, dtype=torch.int64))
        targets = sorted({s for s in ids if s >= 0})
    else:
        slots, bad_slot, targets = None, False, list(range(num_slots))
    invalid = bad_delta or bad_slot or leaf
    if not invalid:
        c4 = _as_pages(cache, layout)
        for s in targets:
            row = _slot_view(c4, s)
            want, bound = _rotated(
                row[None, None], cos, sin, np.array([[abs(delta)]]), interleaved, delta < 0
            )
            memory.write(row, want[0, 0], bound=float(bound.max()))

    def call():
        if op:
            shift = torch.ops.ropekit.shift_cache_
            return run(lambda: shift(cache, cos, sin, delta, layout, slots, interleaved, backend))
        return shift_cache_(cache, cos, sin, delta, cache_layout=layout, slots=slots, interleaved=interleaved,
                            backend=backend)  # fmt: skip

    def check_result(result):
        assert result is (None if op else cache)

    outcome = "error" if invalid else "either" if duplicates else "ok"
    return Call(memory, call, outcome, check_result, ", ".join(why), [cache] if targets else [])


# ---- qk_norm_rotary_ ---------------------------------------------------------------------------------------


def _rms_model(
    x: torch.Tensor, w: torch.Tensor, eps: float, offset: float, all_heads: bool, cast_first: bool
):
    """The RMSNorm forms of ropekit.fused.qk_norm's docstring in float64, with its rounding to x's dtype."""
    groups = x.double().flatten(-2) if all_heads else x.double()
    n = groups / torch.sqrt(groups.pow(2).mean(-1, keepdim=True) + eps)
    weight = w.double() + offset
    if cast_first:
        n = n.to(x.dtype).double()
    return (n * weight).to(x.dtype).view(x.shape)


@st.composite
def qk_norm_calls(draw, op: bool = False):
    """QK-RMSNorm + RoPE in place on a packed qkv that is a slice of a wider buffer: both norm forms, weight
    offsets, partial rotary, positions or an offset; sometimes a position past the table, an eps that is not
    finite and > 0 or a weight offset that is not finite.

    op=True: the registered op ``torch.ops.ropekit.qk_norm_rotary_`` called directly, sometimes on a view of a
    leaf that requires grad (refused, as PyTorch's in-place ops refuse it)."""
    memory = Memory(_seed(draw))
    dtype = draw(st.sampled_from([*DTYPES, torch.float64]))
    backend = _op_backend(draw, dtype) if op else _backend(draw, dtype)
    q_heads, k_heads = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    half = draw(st.integers(1, 3))
    head_dim = 2 * half + draw(st.integers(0, 2))
    width = (q_heads + 2 * k_heads) * head_dim
    tokens = draw(st.integers(0, 5))
    lead = (tokens,) if draw(st.booleans()) else (1, tokens)
    pad = draw(st.integers(0, 3))
    buf = memory.buffer((*lead, width + pad), dtype, float(draw(st.sampled_from([0.5, 3.0, 50.0]))))
    qkv = buf[..., :width]
    all_heads = draw(st.booleans())
    offset = float(draw(st.sampled_from([0.0, 1.0])))
    eps = float(draw(st.sampled_from([1e-6, 1e-5, 0.1])))
    why = []
    if draw(st.integers(0, 11)) == 0:  # what would make every normalised value NaN
        eps = draw(st.sampled_from([-1.0, 0.0, float("nan"), float("inf")]))
        why.append(f"eps {eps}")
    elif draw(st.integers(0, 11)) == 0:
        offset = draw(st.sampled_from([float("nan"), float("inf")]))
        why.append(f"weight_offset {offset}")
    run, _ = _leaf_requiring_grad(draw, op, buf, why)  # a refusal: in why
    q_w = memory.buffer((q_heads * head_dim if all_heads else head_dim,), torch.float32)
    k_w = memory.buffer((k_heads * head_dim if all_heads else head_dim,), torch.float32)
    cos, sin = _tables(memory, draw, half)
    interleaved = draw(st.booleans())
    bad = tokens > 0 and draw(st.integers(0, 11)) == 0
    invalid = bad or bool(why)
    if draw(st.booleans()):
        rows = torch.randint(0, TABLE_LEN, (tokens,), generator=memory.g)
        if bad:
            rows[0] = TABLE_LEN + 1
        kwargs = {"positions": memory.adopt(rows.reshape(lead).clone())}  # (T,) or (1, T), as qkv
        rows = rows.numpy().reshape(lead)
    else:
        off = draw(st.integers(0, TABLE_LEN - tokens)) + (TABLE_LEN if bad else 0)
        kwargs = {"offsets": off}
        rows = np.broadcast_to(np.arange(tokens) + off, lead)
    cast_first = not all_heads and offset == 0
    if not invalid:
        q_width, k_width = q_heads * head_dim, k_heads * head_dim
        for part, heads, w in (
            (qkv[..., :q_width], q_heads, q_w),
            (qkv[..., q_width : q_width + k_width], k_heads, k_w),
        ):
            x = part.unflatten(-1, (heads, head_dim))
            normed = _rms_model(x.detach().clone(), w, eps, offset, all_heads, cast_first)
            want, bound = _rotated(normed, cos, sin, rows, interleaved)
            # One rounding of the normalised value: its float32 math may round the other way than float64.
            bound = bound + 2 * torch.finfo(dtype).eps * float(normed.abs().max() if normed.numel() else 0)
            memory.write(x, want, bound=bound)

    def call():
        if op:
            positions, off = kwargs.get("positions"), kwargs.get("offsets", 0)
            return run(lambda: torch.ops.ropekit.qk_norm_rotary_(
                qkv, q_w, k_w, cos, sin, positions, off, q_heads, k_heads, head_dim, eps, offset, all_heads,
                cast_first, interleaved, backend,
            ))  # fmt: skip
        return qk_norm_rotary_(
            qkv, q_w, k_w, cos, sin, num_q_heads=q_heads, num_kv_heads=k_heads, head_dim=head_dim, eps=eps,
            interleaved=interleaved, weight_offset=offset, norm="all_heads" if all_heads else "head",
            backend=backend, **kwargs,
        )  # fmt: skip

    def check_result(result):
        assert result is (None if op else qkv)

    why = [f"{'op ' if op else ''}{backend} {dtype} lead {lead} heads {q_heads}/{k_heads}",
           f"all_heads {all_heads} bad {bad}", *why]  # fmt: skip
    return Call(memory, call, "error" if invalid else "ok", check_result, ", ".join(why), [qkv])


# ---- compat.flashinfer: the paged append -------------------------------------------------------------------


def _cos_sin_cache(memory: Memory, half: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's / vLLM's float32 [cos | sin] cache, and its halves as the model reads them."""
    cos, sin = reference_tables(2 * half, TABLE_LEN)
    return memory.adopt(torch.cat([cos, sin], dim=-1).contiguous()), cos, sin


@st.composite
def paged_calls(draw):
    """FlashInfer's rope_quantize_fp8_append_paged_kv_cache (GQA): a page table of a few requests over a
    shuffled page pool, NHD or HND FP8 caches, partial rope (a nope part), both scales; sometimes a page
    index past the pool, or a position whose page lies past kv_indices (errors, the caches as they were)."""
    memory = Memory(_seed(draw))
    dtype = draw(st.sampled_from(DTYPES))
    backend = _backend(draw, dtype)
    fp8 = draw(st.sampled_from(FP8))
    layout = draw(st.sampled_from(["NHD", "HND"]))
    page_size = draw(st.integers(1, 4))
    half = draw(st.integers(1, 3))
    nope = draw(st.integers(0, 3))
    head_dim = 2 * half + nope
    q_heads, k_heads = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    # Requests: each holds pages of the pool, and appends new tokens after its existing ones.
    # New tokens per request, at least one in all (an empty call fails on the cpu backend today: see
    # test_an_empty_fp8_call_returns_empty_outputs_on_the_cpu_backend_as_on_torch).
    lengths = [draw(st.integers(1, 3)), *draw(st.lists(st.integers(0, 3), max_size=2))]
    existing = [draw(st.integers(0, 5)) for _ in lengths]
    pages_of = [-(-(e + n) // page_size) for e, n in zip(existing, lengths, strict=True)]
    pool = sum(pages_of) + draw(st.integers(0, 2))
    kv_indices = torch.randperm(max(pool, 1), generator=memory.g)[: sum(pages_of)]
    bad_page = sum(pages_of) > 0 and sum(lengths) > 0 and draw(st.integers(0, 4)) == 0
    kv_indptr = torch.tensor(np.cumsum([0, *pages_of]), dtype=torch.int32)
    batch_indices = torch.tensor([b for b, n in enumerate(lengths) for _ in range(n)], dtype=torch.int32)
    positions = torch.tensor([e + j for e, n in zip(existing, lengths, strict=True) for j in range(n)],
                             dtype=torch.int32)  # fmt: skip
    nnz = len(batch_indices)
    slots = [int(kv_indices[kv_indptr[b] + p // page_size]) * page_size + p % page_size
             for b, p in zip(batch_indices.tolist(), positions.tolist(), strict=True)]  # fmt: skip
    if bad_page and draw(st.booleans()):  # the first new token's page index: past the pool
        first = int(kv_indptr[batch_indices[0]] + positions[0] // page_size)
        kv_indices[first] = max(pool, 1) + draw(st.integers(0, 3))
    elif bad_page:  # the last new token's position: past every entry of kv_indices
        last = int(batch_indices[-1])
        positions[-1] = (len(kv_indices) - int(kv_indptr[last]) + draw(st.integers(0, 2))) * page_size
    for t in (kv_indices, kv_indptr, batch_indices, positions):
        memory.adopt(t)
    shape = (max(pool, 1), page_size, k_heads, head_dim) if layout == "NHD" else (
        max(pool, 1), k_heads, page_size, head_dim)  # fmt: skip
    k_cache, v_cache = memory.buffer(shape, fp8), memory.buffer(shape, fp8)
    scale = float(draw(st.sampled_from([0.5, 3.0])))
    q_rope = _padded_view(memory, (nnz, q_heads, 2 * half), dtype, draw, scale)
    k_rope = _padded_view(memory, (nnz, k_heads, 2 * half), dtype, draw, scale)
    q_nope = _padded_view(memory, (nnz, q_heads, nope), dtype, draw, scale) if nope else None
    k_nope = _padded_view(memory, (nnz, k_heads, nope), dtype, draw, scale) if nope else None
    v = _padded_view(memory, (nnz, k_heads, head_dim), dtype, draw, scale)
    cache, cos, sin = _cos_sin_cache(memory, half)
    pos_ids = memory.adopt(torch.randint(0, TABLE_LEN, (nnz,), generator=memory.g))
    is_neox = draw(st.booleans())
    qs, kvs = (float(draw(st.sampled_from([0.05, 1.0, 4.0]))) for _ in range(2))  # multiplying scales
    q_out = None if bad_page or not draw(st.booleans()) else memory.buffer((nnz, q_heads, 2 * half), fp8)
    rows = pos_ids.numpy()
    if not bad_page:
        k_full = k_rope if k_nope is None else torch.cat([k_rope, k_nope], -1)
        k_want = _rotated(k_full, cos, sin, rows, not is_neox)[0]
        kc4, vc4 = (c if layout == "NHD" else c.transpose(1, 2) for c in (k_cache, v_cache))
        inv = torch.tensor([1.0 / kvs])
        err = 16 * torch.finfo(torch.float32).eps * scale * kvs
        for t, s in enumerate(slots):
            for cache4, value in ((kc4, k_want[t]), (vc4, v[t].double())):
                want = _stored(value, inv, fp8)
                memory.write(_slot_view(cache4, s), want, bound=_fp8_bound(want, fp8, err))
        q_want = _stored(_rotated(q_rope, cos, sin, rows, not is_neox)[0], torch.tensor([1.0 / qs]), fp8)
        q_bound = _fp8_bound(q_want, fp8, 16 * torch.finfo(torch.float32).eps * scale * qs)
        if q_out is not None:
            memory.write(q_out, q_want, bound=q_bound)

    def call():
        return fi_compat.rope_quantize_fp8_append_paged_kv_cache(
            q_rope, k_rope, q_nope, k_nope, v, cache, pos_ids, (k_cache, v_cache), kv_indices, kv_indptr,
            batch_indices, positions, is_neox=is_neox, quantize_dtype=fp8, quant_scale_q=qs,
            quant_scale_kv=kvs, page_size=page_size, kv_layout=layout, q_rope_out=q_out, backend=backend,
        )  # fmt: skip

    def check_result(result):
        got = result[0]
        if q_out is not None:
            assert got is q_out
        assert ((got.double() - q_want).abs() <= q_bound).all(), "q_rope_out off the FP8 contract"

    why = f"{backend} {dtype} {fp8} {layout} page_size {page_size} lengths {lengths} bad_page {bad_page}"
    return Call(memory, call, "error" if bad_page else "ok", check_result, why, [k_cache, v_cache])


# ---- compat: vLLM, FlashInfer and flash-attn call conventions ----------------------------------------------


@st.composite
def compat_calls(draw, compiled: bool = False):
    """vLLM's rotary_embedding and its RotaryEmbedding module's forward (in place, the module with its own
    cache in the model dtype; query and key sometimes slices of one qkv buffer, sometimes the same
    tensor), FlashInfer's apply_rope_with_cos_sin_cache (out of place) and flash-attn's apply_rotary_emb (in
    place or not, int or per-sequence offsets); sometimes a position past the table."""
    memory = Memory(_seed(draw))
    calls = ["vllm.rotary_embedding", "vllm.RotaryEmbedding.forward", "flash_attn.apply_rotary_emb"]
    if not compiled:  # under torch.compile it fails in dynamo today (tests/test_fuzz.py,
        # test_the_out_of_place_vllm_rotation_runs_under_torch_compile)
        calls.append("flashinfer.apply_rope_with_cos_sin_cache")
    which = draw(st.sampled_from(calls))
    dtype = draw(st.sampled_from(DTYPES))
    backend = _backend(draw, dtype)
    half = draw(st.integers(1, 4))
    head_size = 2 * half + draw(st.integers(0, 2))
    q_heads, k_heads = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    interleaved = draw(st.booleans())
    scale = float(draw(st.sampled_from([0.5, 3.0, 50.0])))
    bad = draw(st.integers(0, 11)) == 0
    if which == "flash_attn.apply_rotary_emb":
        batch, seq = draw(st.integers(1, 3)), draw(st.integers(0, 4))
        bad = bad and seq > 0
        why = f"{which} {backend} {dtype} bad {bad}"
        x = _padded_view(memory, (batch, seq, q_heads, head_size), dtype, draw, scale)
        cos, sin = _tables(memory, draw, half)
        inplace = draw(st.booleans())
        if draw(st.booleans()):
            offs = [draw(st.integers(0, TABLE_LEN - seq)) for _ in range(batch)]
            if bad:
                offs[0] = TABLE_LEN
            offsets = memory.adopt(torch.tensor(offs))
            rows = np.arange(seq)[None] + np.array(offs)[:, None]
        else:
            offsets = draw(st.integers(0, TABLE_LEN - seq)) + (TABLE_LEN if bad else 0)
            rows = np.broadcast_to(np.arange(seq) + offsets, (batch, seq))
        if not bad:
            want, bound = _rotated(x, cos, sin, rows, interleaved)
            if inplace:
                memory.write(x, want, bound=bound)

        def call():
            return fa_compat.apply_rotary_emb(x, cos, sin, interleaved=interleaved, inplace=inplace,
                                              seqlen_offsets=offsets, backend=backend)  # fmt: skip

        def check_result(result):
            assert (result is x) if inplace else result.shape == x.shape
            assert ((result.double() - want).abs() <= bound).all(), "flash_attn.apply_rotary_emb off"

        return Call(memory, call, "error" if bad else "ok", check_result, why, [x] if inplace else [])

    tokens = draw(st.integers(0, 5))
    bad = bad and tokens > 0
    why = f"{which} {backend} {dtype} bad {bad}"
    cache, cos, sin = _cos_sin_cache(memory, half)
    module = None
    if which == "vllm.RotaryEmbedding.forward":  # the module's own [cos | sin] buffer, in the model dtype
        module = vllm_compat.RotaryEmbedding(
            head_size, 2 * half, TABLE_LEN, 10000.0, not interleaved, dtype, backend=backend
        )
        memory.buffers.remove(cache)
        cache = memory.adopt(module.cos_sin_cache)
        cos, sin = (t.float() for t in cache.split(half, dim=-1))
    elif dtype != torch.float32 and which.startswith("vllm") and draw(st.booleans()):
        memory.buffers.remove(cache)
        cache = memory.adopt(cache.to(dtype))  # vLLM keeps its cache in the model dtype
        cos, sin = (t.to(dtype).float() for t in (cos, sin))
    pos = torch.randint(0, TABLE_LEN, (tokens,), generator=memory.g)
    if bad:
        pos[-1] = TABLE_LEN
    positions = memory.adopt(pos)
    if draw(st.booleans()):  # query and key as slices of one packed qkv projection (tokens, width)
        qkv = memory.buffer((tokens, (q_heads + 2 * k_heads) * head_size), dtype, scale)
        query = qkv[:, : q_heads * head_size]
        key = qkv[:, q_heads * head_size : (q_heads + k_heads) * head_size]
    else:
        query = _padded_view(memory, (tokens, q_heads, head_size), dtype, draw, scale)
        key = _padded_view(memory, (tokens, k_heads, head_size), dtype, draw, scale)
    same = which.startswith("vllm") and tokens > 0 and draw(st.integers(0, 9)) == 0
    if same:
        key, k_heads = query, q_heads
        why += ", key is query"
    if draw(st.integers(0, 4)) == 0 and not same:
        key = None
    views = [(query, q_heads)] + ([] if key is None else [(key, k_heads)])
    wants = []
    if not bad:
        for t, heads in views:
            x = t.reshape(tokens, heads, head_size) if t.dim() == 2 else t
            wants.append(_rotated(x.detach().clone(), cos, sin, pos.numpy(), interleaved))
            if which.startswith("vllm") and not same:
                memory.write(t, wants[-1][0].reshape(t.shape), bound=wants[-1][1].reshape(t.shape))

    if module is not None:

        def call():
            return module(positions, query, key)

        def check_result(result):
            assert result[0] is query and result[1] is key

        outcome = "error" if bad or same else "ok"
    elif which.startswith("vllm"):

        def call():
            return vllm_compat.rotary_embedding(positions, query, key, head_size, cache, not interleaved,
                                                backend=backend)  # fmt: skip

        def check_result(result):
            assert result is None

        outcome = "error" if bad or same else "ok"
    else:

        def call():
            return fi_compat.apply_rope_with_cos_sin_cache(positions, query, key, head_size, cache,
                                                           not interleaved, backend=backend)  # fmt: skip

        def check_result(result):
            for out, (t, _), (want, bound) in zip(result, views, wants, strict=False):
                assert out.shape == t.shape and out.dtype == t.dtype
                assert ((out.double().reshape(want.shape) - want).abs() <= bound).all(), "out of place off"

        outcome = "error" if bad else "ok"
    in_place = [] if not which.startswith("vllm") or same else [query] + ([] if key is None else [key])
    return Call(memory, call, outcome, check_result, why, in_place)


# ---- the vLLM plugin's classes: ropekit.integrations.vllm's forwards on a module shaped like vLLM's ------


@st.composite
def plugin_calls(draw):
    """The vLLM plugin's forwards (``CacheForwards``: every vLLM class whose forward is a cache-row lookup;
    ``MRopeForwards``: M-RoPE with (3, T) positions), out of place (``forward_native``) or in place
    (``forward_cpu``), on query and key that are column slices of one qkv buffer, as vLLM passes them; the
    module's [cos | sin] cache in float32 or the query's dtype, partial rotary, both pair orders; sometimes a
    position outside the cache (past it, or negative) or a positions tensor of another length."""
    from ropekit.integrations import vllm as plugin
    from ropekit.schedules.mrope import mrope_axis_of_pair

    memory = Memory(_seed(draw))
    mrope = draw(st.booleans())
    dtype = draw(st.sampled_from(DTYPES))
    half = 3 if mrope else draw(st.integers(1, 4))  # M-RoPE: sections [1, 1, 1] of 3 pairs
    head_size = 2 * half + draw(st.integers(0, 2))
    q_heads, k_heads = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    tokens = draw(st.integers(1, 5))
    neox = draw(st.booleans())
    scale = float(draw(st.sampled_from([0.5, 3.0, 50.0])))
    extra = draw(st.integers(0, 2)) * head_size  # v's columns, or nothing
    qkv = memory.buffer((tokens, (q_heads + k_heads) * head_size + extra), dtype, scale)
    query, key = qkv[:, : q_heads * head_size], qkv[:, q_heads * head_size : (q_heads + k_heads) * head_size]
    cos, sin = reference_tables(2 * half, TABLE_LEN)
    cache = memory.adopt(torch.cat([cos, sin], -1).to(draw(st.sampled_from([torch.float32, dtype]))))
    module = SimpleNamespace(cos_sin_cache=cache, head_size=head_size, is_neox_style=neox)
    if mrope:
        module.mrope_section, module.mrope_interleaved = [1, 1, 1], draw(st.booleans())
    rows = torch.randint(0, TABLE_LEN, (3, tokens) if mrope else (tokens,), generator=memory.g)
    bad = draw(st.sampled_from([None] * 10 + ["past the cache", "negative", "length"]))
    if bad == "past the cache":
        rows[..., -1] = TABLE_LEN + draw(st.integers(0, 3))
    elif bad == "negative":
        rows[..., 0] = -1
    positions = memory.adopt(rows[..., : tokens - 1].contiguous() if bad == "length" else rows.clone())
    in_place = draw(st.booleans())
    forwards = plugin.MRopeForwards if mrope else plugin.CacheForwards
    stored = cache.double()
    if mrope:  # each pair's row from its own axis, then one row per token
        axis = mrope_axis_of_pair([1, 1, 1], bool(module.mrope_interleaved))
        picked = stored[rows.clamp(0, TABLE_LEN - 1)].gather(
            0, torch.cat([axis, axis]).expand(1, tokens, -1)
        )[0]
        tables, at = (picked[:, :half], picked[:, half:]), np.arange(tokens)
    else:
        tables, at = (stored[:, :half], stored[:, half:]), rows.clamp(0, TABLE_LEN - 1).numpy()
    wants = []
    for x, heads in ((query, q_heads), (key, k_heads)):
        want, bound = _rotated(x.view(tokens, heads, head_size), *tables, at, not neox)
        wants.append((want.reshape(x.shape), bound.reshape(x.shape)))
        if in_place and bad is None:
            memory.write(x, wants[-1][0], bound=wants[-1][1])

    def call():
        forward = forwards.forward_cpu if in_place else forwards.forward_native
        return forward(module, positions, query, key)

    def check_result(result):
        assert len(result) == 2
        for got, x, (want, bound) in zip(result, (query, key), wants, strict=True):
            assert got.shape == x.shape and got.dtype == x.dtype
            assert (got is x) == in_place, "forward_cpu returns its inputs, forward_native new tensors"
            assert ((got.double() - want).abs() <= bound).all(), "off the float64 rotation by the cache rows"

    why = f"{forwards.__name__} {'in place' if in_place else 'native'} {dtype} cache {cache.dtype} bad {bad}"
    return Call(
        memory, call, "ok" if bad is None else "error", check_result, why, [query, key] if in_place else []
    )


# The families a compiled call draws from (the compat family without the call that fails in dynamo).
COMPILED_FAMILIES = {
    "fused": fused_calls(),
    "fp8": fp8_calls(),
    "shift": shift_calls(),
    "qk_norm": qk_norm_calls(),
    "paged": paged_calls(),
    "compat": compat_calls(compiled=True),
}
FAMILIES = {
    "fused": fused_calls(),
    "fp8": fp8_calls(),
    "shift": shift_calls(),
    "qk_norm": qk_norm_calls(),
    "paged": paged_calls(),
    "compat": compat_calls(),
    # The registered ops called directly (issue 39: a registered op is a public door).
    "fp8_op": fp8_calls(op=True),
    "shift_op": shift_calls(op=True),
    "qk_norm_op": qk_norm_calls(op=True),
    "plugin": plugin_calls(),  # the vLLM plugin's classes (issue 39)
}
