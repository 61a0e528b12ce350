"""Wrapping a raw RoPE kernel (Triton, or the compiled CPU loop) as a backend registered with torch.library.

A raw kernel writes through data pointers, which torch.compile cannot trace. Registering it as a pair of
custom ops (one out-of-place, one in-place) with shape-only fake implementations lets
``torch.compile(fullgraph=True)`` keep the call in its graph as one opaque node instead of breaking the graph.

The kernels themselves see a simplified contract (a :data:`Launch`): 4-D (batch, seq, heads, head_dim) views
whose last axis has stride 1, flat int64 positions, and output tensors to write. Everything else (packed 3-D
input, a strided last axis, allocation) is handled here once for both kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = ["KernelBackend", "Launch"]

# launch(q, k, q_out, k_out, cos, sin, positions, interleaved, conjugate): rotate q (and k if not None) into
# q_out (and k_out). q, k, q_out, k_out: (batch, seq, heads, head_dim), last stride 1; q_out may be q itself.
# positions: contiguous int64 (batch * seq,).
Launch = Callable[..., None]

_OUT_OF_PLACE = (
    "(Tensor q, Tensor? k, Tensor cos, Tensor sin, Tensor positions, bool interleaved, "
    "bool conjugate) -> Tensor[]"
)
_IN_PLACE = (
    "(Tensor(a!) q, Tensor(b!)? k, Tensor cos, Tensor sin, Tensor positions, bool interleaved, "
    "bool conjugate) -> ()"
)


def _as_4d(x: torch.Tensor) -> torch.Tensor:
    return x.unsqueeze(0) if x.dim() == 3 else x  # packed (T, H, D) -> (1, T, H, D)


def _run(launch: Launch, q, k, q_out, k_out, cos, sin, positions, interleaved, conjugate) -> None:
    """Call the kernel on 4-D views; outputs with a strided last axis are computed in a scratch copy."""
    pos = positions.reshape(-1).contiguous()  # (batch * seq,)
    dense = torch.contiguous_format
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
        interleaved,
        conjugate,
    )
    for out, tmp in zip((q_out, k_out), scratch, strict=True):
        if out is not None and tmp is not out:
            out.copy_(tmp)


class KernelBackend:
    """A :class:`~ropekit.backends.base.Backend` around a raw kernel, callable under torch.compile.

    Subclasses set ``name`` and implement ``unavailable_reason``; ``launch`` is the raw kernel.
    """

    name: str

    def __init__(self, name: str, launch: Launch) -> None:
        self.name = name

        def rotary(q, k, cos, sin, positions, interleaved, conjugate):
            q_out = torch.empty_like(q)
            k_out = None if k is None else torch.empty_like(k)
            _run(launch, q, k, q_out, k_out, cos, sin, positions, interleaved, conjugate)
            return [q_out] if k is None else [q_out, k_out]

        def rotary_(q, k, cos, sin, positions, interleaved, conjugate):
            _run(launch, q, k, q, k, cos, sin, positions, interleaved, conjugate)

        def rotary_fake(q, k, cos, sin, positions, interleaved, conjugate):
            return [torch.empty_like(q)] + ([] if k is None else [torch.empty_like(k)])

        self._rotary, self._rotary_ = rotary, rotary_
        self.op = torch.library.custom_op(
            f"ropekit::{name}_rotary", rotary, mutates_args=(), schema=_OUT_OF_PLACE
        )
        self.op.register_fake(rotary_fake)
        self.op_ = torch.library.custom_op(
            f"ropekit::{name}_rotary_", rotary_, mutates_args=("q", "k"), schema=_IN_PLACE
        )
        self.op_.register_fake(lambda *args: None)

    def unavailable_reason(self, q: torch.Tensor, cos: torch.Tensor) -> str | None:
        raise NotImplementedError

    def rotate_qk(self, q, k, cos, sin, positions, *, interleaved, conjugate, inplace):
        # Plain eager tensors skip the op dispatcher (tens of microseconds, most of a decode step); anything
        # that traces (torch.compile, fake tensors, dispatch modes) goes through the registered ops.
        direct = (
            not torch.compiler.is_compiling()
            and type(q) is torch.Tensor
            and _get_current_dispatch_mode() is None
        )
        if inplace:
            (self._rotary_ if direct else self.op_)(q, k, cos, sin, positions, interleaved, conjugate)
            return q, k
        outs = (self._rotary if direct else self.op)(q, k, cos, sin, positions, interleaved, conjugate)
        return outs[0], (outs[1] if k is not None else None)
