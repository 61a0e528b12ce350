"""The Triton backend: the fused kernel of :mod:`ropekit.backends.triton_kernel` behind the backend contract.

It serves CUDA tensors in float32, float16 and bfloat16 (math in float32). With ``TRITON_INTERPRET=1`` set
before the first import of Triton, it also accepts CPU tensors and runs the same kernel through Triton's
interpreter: that is how the tests check the kernel on machines without a GPU. ``backend="auto"`` never picks
the interpreter, which is orders of magnitude slower than the CPU backends.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os

import torch

from ropekit.backends.kernel_op import MAX_HALF, KernelBackend, check_launch, check_offset_rows, row_error

__all__ = ["TritonBackend", "interpreter_enabled", "launch"]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TRITON_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_ROW_MESSAGE = "ropekit: a position is outside the cos/sin table (positions >= table_len)"


def interpreter_enabled() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _rows_on_host(positions: torch.Tensor) -> bool:
    """Whether to check the rows on the host: CPU tensors (the interpreter); never CUDA ones (a sync)."""
    return positions.device.type == "cpu"


# device -> a 1 that the kernel clears on a bad row. A cleared flag fails the device-side assert, which ends
# the CUDA context, so a flag that reached 0 is never read again; CPU (interpreter) flags are fresh per call.
_FLAGS: dict[torch.device, torch.Tensor] = {}


def _error_flag(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.ones(1, dtype=torch.int32)
    flag = _FLAGS.get(device)
    if flag is None:
        flag = torch.ones(1, dtype=torch.int32, device=device)
        if not torch.cuda.is_current_stream_capturing():  # a graph's pool would free it with the graph
            _FLAGS[device] = flag
    return flag


def launch(q, k, q_out, k_out, cos, sin, positions, offset, interleaved, conjugate) -> None:
    """Run the kernel: one program per token; see :data:`ropekit.backends.kernel_op.Launch`.

    Table rows are checked twice, without a host sync. First on the host: an int offset with integer
    arithmetic; a positions tensor when it is a CPU tensor (the interpreter). Then in the kernel, for every
    call: a row outside the table is clamped into it (the kernel never reads outside the table) and clears an
    error flag, which ``torch._assert_async`` asserts on the device, so a bad call fails with a device-side
    assert instead of returning a result, whatever the host check let through.

    The specialization (constexprs, ``num_warps``) is :func:`ropekit.backends.triton_kernel.kernel_config`,
    the same function the ahead-of-time compile tests enumerate; the compile options
    (``COMPILE_OPTIONS``: no FP contraction, the register cap) are passed explicitly at every launch.

    Raises:
        ValueError: on anything :func:`~ropekit.backends.kernel_op.check_launch` rejects, or (host-checked
            rows) a table row outside the table.
    """
    from ropekit.backends.triton_kernel import COMPILE_OPTIONS, kernel_config, rotary_kernel

    check_launch(q, k, q_out, k_out, cos, sin, positions, offset, SUPPORTED_DTYPES)
    batch, seq, q_heads, head_dim = q.shape  # (batch, seq, heads, head_dim)
    table_len, half = cos.shape  # (table_len, rotary_dim // 2)
    grid = (batch * seq,)
    if grid[0] == 0:
        return
    if positions is None:
        check_offset_rows(offset, batch, seq, table_len)
    elif _rows_on_host(positions):
        lo, hi = torch.stack(torch.aminmax(positions)).tolist()
        if lo < 0 or hi >= table_len:
            raise row_error(lo if lo < 0 else hi, table_len)
    has_k = k is not None
    k_args = (k, k_out) if has_k else (q, q_out)  # with k_heads 0 the kernel never touches them
    constexprs, num_warps = kernel_config(
        _TRITON_DTYPE[q.dtype],
        half,
        head_dim - 2 * half,
        interleaved=interleaved,
        conjugate=conjugate,
        has_pos=positions is not None,
        copy_tail=q_out.data_ptr() != q.data_ptr() or (has_k and k_out.data_ptr() != k.data_ptr()),
        interpret=interpreter_enabled(),
    )
    flag = _error_flag(q.device)  # cleared by a program that meets a bad row
    # Triton launches on the current CUDA device; make it q's (multi-GPU).
    device_guard = torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext()
    with device_guard:
        rotary_kernel[grid](
            q,
            k_args[0],
            q_out,
            k_args[1],
            cos,
            sin,
            q if positions is None else positions,  # unused pointer when HAS_POS is False
            flag,
            offset,
            table_len,
            seq,
            q_heads,
            k.shape[2] if has_k else 0,
            *q.stride()[:3],
            *k_args[0].stride()[:3],
            *q_out.stride()[:3],
            *k_args[1].stride()[:3],
            cos.stride(0),
            sin.stride(0),
            **constexprs,
            num_warps=num_warps,
            **COMPILE_OPTIONS,
        )
    torch._assert_async(flag, _ROW_MESSAGE)


class TritonBackend(KernelBackend):
    def __init__(self) -> None:
        super().__init__("triton", launch)

    def unavailable_reason(self, q: torch.Tensor, cos: torch.Tensor) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "Triton is not installed (pip install 'ropekit[triton]')"
        if q.device.type == "cpu" and not interpreter_enabled():
            return "q is on the CPU; the Triton kernel needs a CUDA device (or TRITON_INTERPRET=1 in tests)"
        if q.device.type not in ("cuda", "cpu"):
            return f"q is on {q.device.type}; the Triton kernel needs a CUDA device"
        if q.dtype not in SUPPORTED_DTYPES:
            return f"dtype {q.dtype} is not supported (float32, float16, bfloat16)"
        if cos.shape[-1] > MAX_HALF:
            return f"rotary_dim {2 * cos.shape[-1]} is wider than the kernel serves ({2 * MAX_HALF})"
        return None

    def kernels(self):
        from ropekit.backends import fused_triton, qk_norm_triton  # imported at first use: they import triton

        return fused_triton.launch, qk_norm_triton.launch

    def auto_skip_reason(self, q: torch.Tensor, cos: torch.Tensor) -> str | None:
        """Like unavailable_reason, but "auto" also refuses the (slow) interpreter."""
        if q.device.type == "cpu":
            return "q is on the CPU; the Triton interpreter is for tests, not speed"
        return self.unavailable_reason(q, cos)
