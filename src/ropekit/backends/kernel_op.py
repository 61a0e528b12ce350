"""Wrapping a raw RoPE kernel (Triton, or the compiled CPU loop) as a backend registered with torch.library.

A raw kernel writes through data pointers, which torch.compile cannot trace. Registering it as a pair of
custom ops (one out-of-place, one in-place) with shape-only fake implementations lets
``torch.compile(fullgraph=True)`` keep the call in its graph as one opaque node instead of breaking the graph.

The kernels themselves see a simplified contract (a :data:`Launch`): 4-D (batch, seq, heads, head_dim) views
whose last axis has stride 1, flat int64 positions or an int offset, and output tensors to write. Everything
else (packed 3-D input, a strided last axis, allocation) is handled here once for both kernels.

The kernel boundary is a wall (docs/safety.md): :func:`check_launch` checks, in every launcher, everything a
kernel relies on to stay inside its tensors (dtypes, shapes, strides, devices, no self-overlapping output),
and the kernels check every table row they read: the C loop on the host before it writes anything, the
Triton kernel on the device (a clamped row and an error flag, asserted without a host sync).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ropekit.validation import check_disjoint, check_writable

__all__ = ["MAX_HALF", "KernelBackend", "Launch", "check_launch", "row_error"]

# launch(q, k, q_out, k_out, cos, sin, positions, offset, interleaved, conjugate): rotate q (and k if not
# None) into q_out (and k_out). q, k, q_out, k_out: (batch, seq, heads, head_dim), last stride 1; q_out may be
# q itself. positions: contiguous int64 (batch * seq,), or None for rows offset + arange(seq).
Launch = Callable[..., None]

# The widest table (rotary_dim / 2) the kernels serve: the C loop keeps ~10 floats per pair on its stack, so
# this bounds it to 160 KB; Triton keeps a row in registers. Wider tables use the torch backend.
MAX_HALF = 4096

_OUT_OF_PLACE = (
    "(Tensor q, Tensor? k, Tensor cos, Tensor sin, Tensor? positions, bool interleaved, "
    "bool conjugate, SymInt offset=0) -> Tensor[]"
)
_IN_PLACE = (
    "(Tensor(a!) q, Tensor(b!)? k, Tensor cos, Tensor sin, Tensor? positions, bool interleaved, "
    "bool conjugate, SymInt offset=0) -> ()"
)


def _fail(name: str, expected: str, got: str) -> None:
    raise ValueError(f"{name}: expected {expected}, got {got}")


def check_launch(q, k, q_out, k_out, cos, sin, positions, offset, dtypes) -> None:
    """Everything a raw kernel relies on to stay inside its tensors; ValueError naming the argument otherwise.

    Values (the table rows of positions) are not read here: each kernel checks them where they live.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        _fail("q", "a 4-D tensor (batch, seq, heads, head_dim)", _describe(q))
    if q.dtype not in dtypes:
        _fail("q", f"one of {[str(d) for d in dtypes]}", str(q.dtype))
    device = q.device
    for name, x, out in (("q", q, q_out), ("k", k, k_out)):
        if x is None:
            if out is not None:
                _fail(f"{name}_out", f"None when {name} is None", _describe(out))
            continue
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[:2] != q.shape[:2]:
            _fail(name, f"a 4-D tensor with q's (batch, seq) {tuple(q.shape[:2])}", _describe(x))
        if x.shape[3] != q.shape[3] or x.dtype != q.dtype or x.device != device:
            _fail(
                name, f"head_dim {q.shape[3]}, dtype {q.dtype} on {device}", f"{_describe(x)} on {x.device}"
            )
        if not isinstance(out, torch.Tensor) or out.shape != x.shape or out.dtype != x.dtype:
            _fail(f"{name}_out", f"a {x.dtype} tensor of shape {tuple(x.shape)}", _describe(out))
        if out.device != device:
            _fail(f"{name}_out", f"a tensor on {device}", f"one on {out.device}")
        for label, t in ((name, x), (f"{name}_out", out)):
            if t.shape[3] > 1 and t.stride(3) != 1:
                _fail(label, "a last axis of stride 1", f"strides {t.stride()}")
        check_writable(f"{name}_out", out)
    if k_out is not None:
        check_disjoint("q_out", q_out, "k_out", k_out)
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 2:
            _fail(name, "a 2-D float32 tensor (table_len, rotary_dim // 2)", _describe(t))
        if t.device != device:
            _fail(name, f"a tensor on q's device {device}", f"one on {t.device}")
        if t.shape[1] > 1 and t.stride(1) != 1:
            _fail(name, "a last axis of stride 1", f"strides {t.stride()}")
    if cos.shape != sin.shape:
        _fail("sin", f"cos's shape {tuple(cos.shape)}", str(tuple(sin.shape)))
    half = cos.shape[1]
    if not 1 <= half <= MAX_HALF or 2 * half > q.shape[3]:
        _fail("cos", f"1 <= rotary_dim // 2 <= min(head_dim // 2, {MAX_HALF})", f"width {half}")
    tokens = q.shape[0] * q.shape[1]
    if positions is not None:
        if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int64:
            _fail("positions", "an int64 tensor", _describe(positions))
        if positions.numel() != tokens or not positions.is_contiguous() or positions.device != device:
            _fail(
                "positions",
                f"a contiguous tensor of {tokens} rows (batch * seq) on {device}",
                f"{_describe(positions)} on {positions.device}",
            )
    elif isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < 1 << 63:
        _fail("offset", "a non-negative int64 when positions is None", repr(offset))
    if tokens and cos.shape[0] == 0:
        _fail("cos", "at least one row", "an empty table")


def row_error(position: int, table_len: int, token: int | None = None) -> ValueError:
    """The error for a table row outside [0, table_len)."""
    where = "" if token is None else f" (token {token})"
    return ValueError(
        f"positions: position {position}{where} is outside the cos/sin table (table_len {table_len}); "
        f"expected 0 <= position < table_len"
    )


def check_offset_rows(offset: int, seq: int, table_len: int) -> None:
    """Rows offset .. offset + seq - 1 must lie in the table: integer arithmetic, no tensor."""
    if seq and offset + seq > table_len:
        raise row_error(offset + seq - 1, table_len)


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return repr(value)[:80]


def _as_4d(x: torch.Tensor) -> torch.Tensor:
    return x.unsqueeze(0) if x.dim() == 3 else x  # packed (T, H, D) -> (1, T, H, D)


def _check_op_inputs(q, k, positions) -> None:
    """The op's own shape contract, before the 4-D views: q and k (T, H, D) or (B, S, H, D) alike."""
    if not isinstance(q, torch.Tensor) or q.dim() not in (3, 4):
        _fail("q", "a (batch, seq, heads, head_dim) or (total_tokens, heads, head_dim) tensor", _describe(q))
    if k is not None and (not isinstance(k, torch.Tensor) or k.dim() != q.dim()):
        _fail("k", f"a {q.dim()}-D tensor like q", _describe(k))
    if positions is not None and (not isinstance(positions, torch.Tensor) or positions.shape != q.shape[:-2]):
        _fail(
            "positions", f"a tensor of shape {tuple(q.shape[:-2])} (q's leading axes)", _describe(positions)
        )


def _run(launch: Launch, q, k, q_out, k_out, cos, sin, positions, offset, interleaved, conjugate) -> None:
    """Call the kernel on 4-D views; outputs with a strided last axis are computed in a scratch copy."""
    pos = None if positions is None else positions.reshape(-1)  # (batch * seq,)
    if pos is not None and pos.dtype == torch.int64:
        pos = pos.contiguous()
    dense = torch.contiguous_format
    if any(out is not None and out.stride(-1) != 1 for out in (q_out, k_out)):
        # The launcher checks the outputs it writes; a scratch copy would hide an overlapping output.
        for name, out in (("q", q_out), ("k", k_out)):
            if out is not None:
                check_writable(name, out)
        if k_out is not None:
            check_disjoint("q", q_out, "k", k_out)
    scratch = [
        out if out is None or out.stride(-1) == 1 else torch.empty_like(out, memory_format=dense)
        for out in (q_out, k_out)
    ]
    inputs = [x if x is None or x.stride(-1) == 1 else x.contiguous() for x in (q, k)]
    launch(
        _as_4d(inputs[0]),
        None if k is None else _as_4d(inputs[1]),
        _as_4d(scratch[0]),
        None if k is None else _as_4d(scratch[1]),
        cos,
        sin,
        pos,
        offset,
        interleaved,
        conjugate,
    )
    for out, tmp in zip((q_out, k_out), scratch, strict=True):
        if out is not None and tmp is not out:
            out.copy_(tmp)


class KernelBackend:
    """A :class:`~ropekit.backends.base.Backend` around a raw kernel, callable under torch.compile.

    Subclasses set ``name`` and implement ``unavailable_reason``; ``launch`` is the raw kernel. The ops are
    ``torch.ops.ropekit.<name>_rotary`` (out of place, returns [q_out] or [q_out, k_out]) and
    ``torch.ops.ropekit.<name>_rotary_`` (in place), both
    ``(q, k, cos, sin, positions, interleaved, conjugate, offset=0)``.
    """

    name: str

    def __init__(self, name: str, launch: Launch) -> None:
        self.name = name

        def rotary(q, k, cos, sin, positions, interleaved, conjugate, offset=0):
            _check_op_inputs(q, k, positions)
            q_out = torch.empty_like(q)
            k_out = None if k is None else torch.empty_like(k)
            _run(launch, q, k, q_out, k_out, cos, sin, positions, offset, interleaved, conjugate)
            return [q_out] if k is None else [q_out, k_out]

        def rotary_(q, k, cos, sin, positions, interleaved, conjugate, offset=0):
            _check_op_inputs(q, k, positions)
            _run(launch, q, k, q, k, cos, sin, positions, offset, interleaved, conjugate)

        def rotary_fake(q, k, cos, sin, positions, interleaved, conjugate, offset=0):
            _check_op_inputs(q, k, positions)
            return [torch.empty_like(q)] + ([] if k is None else [torch.empty_like(k)])

        def rotary_fake_(q, k, cos, sin, positions, interleaved, conjugate, offset=0):
            _check_op_inputs(q, k, positions)
            check_writable("q", q)
            if k is not None:
                check_writable("k", k)

        self._rotary, self._rotary_ = rotary, rotary_
        self.op = torch.library.custom_op(
            f"ropekit::{name}_rotary", rotary, mutates_args=(), schema=_OUT_OF_PLACE
        )
        self.op.register_fake(rotary_fake)
        self.op_ = torch.library.custom_op(
            f"ropekit::{name}_rotary_", rotary_, mutates_args=("q", "k"), schema=_IN_PLACE
        )
        self.op_.register_fake(rotary_fake_)

    def unavailable_reason(self, q: torch.Tensor, cos: torch.Tensor) -> str | None:
        raise NotImplementedError

    def rotate_qk(self, q, k, cos, sin, positions, *, interleaved, conjugate, inplace, offset=0):
        # Plain eager tensors skip the op dispatcher (tens of microseconds, most of a decode step); anything
        # that traces (torch.compile, fake tensors, dispatch modes) goes through the registered ops.
        direct = (
            not torch.compiler.is_compiling()
            and type(q) is torch.Tensor
            and _get_current_dispatch_mode() is None
        )
        if (
            cos.dtype != torch.float32
        ):  # the kernels read float32 tables (a float64 table: converted per call)
            cos, sin = cos.float(), sin.float()
        args = (q, k, cos, sin, positions, interleaved, conjugate, offset)
        if inplace:
            (self._rotary_ if direct else self.op_)(*args)
            return q, k
        outs = (self._rotary if direct else self.op)(*args)
        return outs[0], (outs[1] if k is not None else None)
