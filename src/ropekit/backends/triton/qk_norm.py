"""Launching the QK-RMSNorm + RoPE Triton kernel (:mod:`ropekit.backends.triton.qk_norm_kernel`).

CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1`` (the tests). Table rows are checked without a host
sync, as in :mod:`ropekit.backends.triton.rotary`: with integers for an int offset, on the host for CPU
positions,
and in the kernel always (it clamps a bad row and fails the launch: compiled, it traps, and the CUDA error
surfaces at the next synchronising call; under the interpreter, the launcher raises when it returns), so a
bad call fails instead of returning a result.
"""

from __future__ import annotations

import contextlib

import torch

from ropekit.backends.kernel_op import check_offset_rows, row_error
from ropekit.backends.triton.qk_norm_blocks import NUM_WARPS, block_sizes

__all__ = ["launch"]


def launch(qkv, q_weight, k_weight, cos, sin, positions, offset, spec) -> None:
    """Normalise and rotate q and k of qkv (batch, seq, width) in place; arguments as
    :func:`ropekit.backends.c.qk_norm.launch` (checked by the public call).

    Raises:
        ValueError: a host-checked table row outside the table.
        RuntimeError: under the interpreter, a row outside the table that the host did not check.
    """
    from ropekit.backends.triton import rotary as triton_backend
    from ropekit.backends.triton.qk_norm_kernel import COMPILE_OPTIONS, qk_norm_rotary_kernel
    from ropekit.backends.triton.rotary_kernel import PREFILL_TOKENS

    batch, seq, _ = qkv.shape
    table_len, half = cos.shape
    tokens = batch * seq
    if tokens == 0:
        return
    if positions is None:
        check_offset_rows(offset, batch, seq, table_len)
    elif triton_backend.HOST_CHECKS and positions.device.type == "cpu":
        lo, hi = torch.stack(torch.aminmax(positions)).tolist()
        if lo < 0 or hi >= table_len:
            raise row_error(lo if lo < 0 else hi, table_len)
    interpret = triton_backend.interpreter_enabled()
    flag = triton_backend.error_flag(qkv.device)
    blocks = block_sizes(
        spec.head_dim, half, spec.q_heads, spec.k_heads, qkv.dtype.itemsize, spec.interleaved,
        tokens >= PREFILL_TOKENS,
    )  # fmt: skip
    guard = torch.cuda.device(qkv.device) if qkv.is_cuda else contextlib.nullcontext()
    with guard:
        qk_norm_rotary_kernel[(-(-tokens // blocks["BLOCK_T"]),)](
            qkv,
            q_weight,
            k_weight,
            cos,
            sin,
            qkv if positions is None else positions,  # unused pointer when HAS_POS is False
            flag,
            offset,
            table_len,
            seq,
            tokens,
            qkv.stride(0),
            qkv.stride(1),
            spec.q_heads,
            spec.k_heads,
            spec.head_dim,
            cos.stride(0),
            sin.stride(0),
            spec.eps,
            spec.weight_offset,
            **blocks,
            HAS_POS=positions is not None,
            INTERLEAVED=spec.interleaved,
            ALL_HEADS=spec.all_heads,
            CAST_BEFORE=spec.cast_before_weight,
            ROUND_BF16_IN_INTEGERS=qkv.dtype == torch.bfloat16 and interpret,
            TRAP_BAD_ROWS=not interpret,
            num_warps=NUM_WARPS,
            **COMPILE_OPTIONS,
        )
    if interpret and not flag[0]:  # the interpreter's kernel cleared it (compiled kernels trap instead)
        raise triton_backend.flagged(
            flag, "ropekit: a position is outside the cos/sin table (positions >= table_len)"
        )
