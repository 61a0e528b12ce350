"""The Triton backend's object ("triton"): the rotation's launcher (:mod:`.rotary`), its launch plans, and
the fused and QK-norm launchers (:mod:`.fused`, :mod:`.qk_norm`), imported at first use (they import Triton),
behind the one :class:`~ropekit.backends.kernel_op.KernelBackend` contract."""

from __future__ import annotations

import importlib.util

import torch

from ropekit.backends.kernel_op import MAX_HALF, KernelBackend
from ropekit.backends.triton.rotary import SUPPORTED_DTYPES, interpreter_enabled, launch
from ropekit.positions import check_cu_seqlens

__all__ = ["TritonBackend"]


class TritonBackend(KernelBackend):
    """The Triton kernels: CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1`` (the tests)."""

    def __init__(self) -> None:
        super().__init__("triton", launch)

    def plan(
        self,
        q,
        k,
        cos,
        sin,
        *,
        interleaved,
        conjugate,
        inplace,
        per_sequence=False,
        cu_seqlens=None,
        positions=False,
    ):
        """The launch for one key (:mod:`ropekit.backends.plan`), for an int offset and for per-sequence
        offsets alike: the launcher takes either (the kernel reads the offsets tensor and computes each
        token's row), so a decode step with per-sequence offsets is a lookup and one launch, as one with an
        int offset; no positions tensor is built. With ``cu_seqlens`` (a packed batch), q and k are
        (T, H, D) and the run takes the call's cu_seqlens too (``run(q, k, cos, sin, offset, cu_seqlens)``):
        the kernel finds each token's sequence in it, so a packed (varlen) step is a lookup and one launch
        as well. With ``positions``, ``offset`` is the call's positions tensor (contiguous int64, a row per
        token: (B, S), or (T,) with cu_seqlens), read by the kernel (ROWS_POSITIONS), which checks every row
        as it does for the checked path; cu_seqlens, which the kernel does not read then, is checked as the
        checked path checks it (:func:`ropekit.positions.check_cu_seqlens`: on the host for CPU tensors, a
        device-side assert otherwise). None when the inputs need the conversions of :meth:`rotate_qk`. The
        run returns None, having written nothing, when the launcher refuses a value on the host (an offset
        or a position whose rows leave the table, malformed cu_seqlens): the checked path then raises its
        own error."""
        units = [t.stride(-1) == 1 for t in (q, cos, sin) + (() if k is None else (k,))]
        if not all(units) or cos.dtype != torch.float32:
            return None

        def run(q, k, cos, sin, offset, cu_seqlens=None):
            if inplace:
                q_out, k_out = q, k
            else:
                q_out, k_out = torch.empty_like(q), None if k is None else torch.empty_like(k)
            rows, offset = (offset, 0) if positions else (None, offset)  # explicit positions: rows
            try:
                if cu_seqlens is None:
                    launch(q, k, q_out, k_out, cos, sin, rows, offset, interleaved, conjugate)
                else:  # (T, H, D) as (1, T, H, D); in place, one view object is input and output
                    q4, k4 = q[None], None if k is None else k[None]
                    q_out4 = q4 if inplace else q_out[None]
                    k_out4 = k4 if inplace or k is None else k_out[None]
                    if positions:  # rows (T,) read as (1, T); cu_seqlens checked as the checked path does
                        check_cu_seqlens(cu_seqlens, q.shape[0])
                    launch(
                        q4, k4, q_out4, k_out4, cos, sin, rows, offset, interleaved, conjugate,
                        cu_seqlens=None if positions else cu_seqlens,
                    )  # fmt: skip
            except ValueError:  # refused before the launch: nothing written
                return None
            if inplace:  # what the dispatcher would do: tell autograd that q and k changed
                torch._C._increment_version((q,) if k is None else (q, k))
            return q_out, k_out

        return run

    def device_reason(self, device: torch.device) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "Triton is not installed (pip install 'ropekit[triton]')"
        if device.type == "cpu" and not interpreter_enabled():
            return "q is on the CPU; the Triton kernel needs a CUDA device (or TRITON_INTERPRET=1 in tests)"
        if device.type not in ("cuda", "cpu"):
            return f"q is on {device.type}; the Triton kernel needs a CUDA device"
        return None

    def unavailable_reason(self, q: torch.Tensor, cos: torch.Tensor) -> str | None:
        reason = self.device_reason(q.device)
        if reason is not None:
            return reason
        if q.dtype not in SUPPORTED_DTYPES:
            return f"dtype {q.dtype} is not supported (float32, float16, bfloat16)"
        if cos.shape[-1] > MAX_HALF:
            return f"rotary_dim {2 * cos.shape[-1]} is wider than the kernel serves ({2 * MAX_HALF})"
        return None

    def kernels(self):
        from ropekit.backends.triton import fused as fused_triton  # imported at first use: they import triton
        from ropekit.backends.triton import qk_norm as qk_norm_triton

        return fused_triton.launch, qk_norm_triton.launch

    def auto_skip_reason(self, q: torch.Tensor, cos: torch.Tensor) -> str | None:
        """Like unavailable_reason, but "auto" also refuses the (slow) interpreter."""
        if q.device.type == "cpu":
            return "q is on the CPU; the Triton interpreter is for tests, not speed"
        return self.unavailable_reason(q, cos)
