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

from ropekit.backends.kernel_op import KernelBackend

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


def launch(q, k, q_out, k_out, cos, sin, positions, interleaved, conjugate) -> None:
    """Run the kernel: one program per token; see :data:`ropekit.backends.kernel_op.Launch`."""
    from ropekit.backends.triton_kernel import rotary_kernel

    batch, seq, q_heads, head_dim = q.shape  # (batch, seq, heads, head_dim)
    half = cos.shape[-1]
    tail = head_dim - 2 * half
    cos, sin = cos.contiguous(), sin.contiguous()  # (table_len, half): one row stride serves both
    has_k = k is not None
    k_heads = k.shape[2] if has_k else 0
    block_half = _next_pow2(half)
    k_args = (k, k_out) if has_k else (q, q_out)  # unused pointers when HAS_K is False
    grid = (batch * seq,)
    if grid[0] == 0:
        return
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
            positions,
            seq,
            q_heads,
            k_heads,
            *q.stride()[:3],
            *k_args[0].stride()[:3],
            *q_out.stride()[:3],
            *k_args[1].stride()[:3],
            cos.stride(0),
            HALF=half,
            TAIL=tail,
            BLOCK_HALF=block_half,
            BLOCK_TAIL=_next_pow2(max(tail, 1)),
            BLOCK_HQ=_head_block(q_heads, block_half),
            BLOCK_HK=_head_block(max(k_heads, 1), block_half),
            HAS_K=has_k,
            INTERLEAVED=interleaved,
            CONJUGATE=conjugate,
            COPY_TAIL=tail > 0 and q_out.data_ptr() != q.data_ptr(),
        )


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
        return None

    def auto_skip_reason(self, q: torch.Tensor, cos: torch.Tensor) -> str | None:
        """Like unavailable_reason, but "auto" also refuses the (slow) interpreter."""
        if q.device.type == "cpu":
            return "q is on the CPU; the Triton interpreter is for tests, not speed"
        return self.unavailable_reason(q, cos)
