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
# Heads rotated per inner step: enough to keep the loads wide, small enough to keep registers.
MAX_BLOCK_ELEMENTS = 4096


def interpreter_enabled() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _head_block(heads: int, block_half: int) -> int:
    return max(1, min(_next_pow2(heads), MAX_BLOCK_ELEMENTS // block_half))


def _rows_on_host(positions: torch.Tensor) -> bool:
    """Whether to check the rows on the host: CPU tensors (the interpreter); never CUDA ones (a sync)."""
    return positions.device.type == "cpu"


def launch(q, k, q_out, k_out, cos, sin, positions, offset, interleaved, conjugate) -> None:
    """Run the kernel: one program per token; see :data:`ropekit.backends.kernel_op.Launch`.

    Table rows are checked without a host sync: an int offset with integer arithmetic here; a positions
    tensor on the host when it is a CPU tensor (the interpreter), and on the device otherwise: the kernel
    clamps a row outside the table into it (it never reads outside the table) and clears an error flag, which
    ``torch._assert_async`` then asserts on the device, so the bad call fails with a device-side assert
    instead of returning a result.

    Raises:
        ValueError: on anything :func:`~ropekit.backends.kernel_op.check_launch` rejects, or (host-checked
            rows) a table row outside the table.
    """
    from ropekit.backends.triton_kernel import rotary_kernel

    check_launch(q, k, q_out, k_out, cos, sin, positions, offset, SUPPORTED_DTYPES)
    batch, seq, q_heads, head_dim = q.shape  # (batch, seq, heads, head_dim)
    table_len, half = cos.shape  # (table_len, rotary_dim // 2)
    tail = head_dim - 2 * half
    has_k = k is not None
    k_heads = k.shape[2] if has_k else 0
    block_half = _next_pow2(half)
    k_args = (k, k_out) if has_k else (q, q_out)  # unused pointers when HAS_K is False
    grid = (batch * seq,)
    if grid[0] == 0:
        return
    device_check = False
    if positions is None:
        check_offset_rows(offset, batch, seq, table_len)
    elif _rows_on_host(positions):
        lo, hi = torch.stack(torch.aminmax(positions)).tolist()
        if lo < 0 or hi >= table_len:
            raise row_error(lo if lo < 0 else hi, table_len)
    else:
        device_check = True
    flag = torch.ones(1, dtype=torch.int32, device=q.device)  # cleared by a program that meets a bad row
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
            k_heads,
            *q.stride()[:3],
            *k_args[0].stride()[:3],
            *q_out.stride()[:3],
            *k_args[1].stride()[:3],
            cos.stride(0),
            sin.stride(0),
            HALF=half,
            TAIL=tail,
            BLOCK_HALF=block_half,
            BLOCK_TAIL=_next_pow2(max(tail, 1)),
            BLOCK_HQ=_head_block(q_heads, block_half),
            BLOCK_HK=_head_block(max(k_heads, 1), block_half),
            HAS_K=has_k,
            HAS_POS=positions is not None,
            INTERLEAVED=interleaved,
            CONJUGATE=conjugate,
            COPY_TAIL_Q=tail > 0 and q_out.data_ptr() != q.data_ptr(),
            COPY_TAIL_K=tail > 0 and has_k and k_out.data_ptr() != k.data_ptr(),
            BF16=q.dtype == torch.bfloat16,
        )
    if device_check:
        torch._assert_async(flag, "ropekit: a position is outside the cos/sin table (positions >= table_len)")


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

    def auto_skip_reason(self, q: torch.Tensor, cos: torch.Tensor) -> str | None:
        """Like unavailable_reason, but "auto" also refuses the (slow) interpreter."""
        if q.device.type == "cpu":
            return "q is on the CPU; the Triton interpreter is for tests, not speed"
        return self.unavailable_reason(q, cos)
