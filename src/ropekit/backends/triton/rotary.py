"""The Triton backend: the fused kernel of :mod:`ropekit.backends.triton.rotary_kernel` behind the backend
contract.

It serves CUDA tensors in float32, float16 and bfloat16 (math in float32). With ``TRITON_INTERPRET=1`` set
before the first import of Triton, it also accepts CPU tensors and runs the same kernel through Triton's
interpreter: that is how the tests check the kernel on machines without a GPU. ``backend="auto"`` never picks
the interpreter, which is orders of magnitude slower than the CPU backends.
"""

from __future__ import annotations

import contextlib
import os

import torch

from ropekit.backends.kernel_op import (
    check_launch,
    check_offset_rows,
    check_packed_rows,
    row_error,
)

__all__ = ["SUPPORTED_DTYPES", "error_flag", "flagged", "interpreter_enabled", "launch"]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TRITON_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_ROW_MESSAGE = "ropekit: a position is outside the cos/sin table (positions >= table_len)"
_PACKED_MESSAGE = (
    f"{_ROW_MESSAGE}, or cu_seqlens is malformed (expected non-decreasing offsets from 0 to total_tokens)"
)


def interpreter_enabled() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Rows of CPU tensors (the interpreter) are checked on the host, before the launch; never those of CUDA
# tensors (a sync). Tests switch it off to reach the kernel's own check.
HOST_CHECKS = True


# device -> the kernel's error flag. Compiled kernels never write it (a bad row traps: see
# triton_kernel.flag_bad); the interpreter's kernel clears it, and the launcher reads it back on the host.
_FLAGS: dict[torch.device, torch.Tensor] = {}


def error_flag(device: torch.device) -> torch.Tensor:
    """The device's error flag (a 1), kept across launches: see :func:`flagged`."""
    flag = _FLAGS.get(device)
    if flag is None:
        flag = torch.ones(1, dtype=torch.int32, device=device)
        if device.type == "cpu" or not torch.cuda.is_current_stream_capturing():  # a graph would free it
            _FLAGS[device] = flag
    return flag


# device -> an int64 tensor the kernel's offsets pointer holds when no offsets tensor is read (a load masked
# off reads nothing; the pointer's type is the one its compiled specializations list).
_NO_OFFSETS: dict[torch.device, torch.Tensor] = {}


def _no_offsets(device: torch.device) -> torch.Tensor:
    offsets = torch.zeros(1, dtype=torch.int64, device=device)
    if device.type == "cpu" or not torch.cuda.is_current_stream_capturing():  # as error_flag
        _NO_OFFSETS[device] = offsets
    return offsets


def flagged(flag: torch.Tensor, message: str) -> RuntimeError:
    """The error for a launch whose kernel cleared ``flag`` (the interpreter), the flag set again for the
    next launch."""
    flag.fill_(1)
    return RuntimeError(message)


def launch(q, k, q_out, k_out, cos, sin, positions, offset, interleaved, conjugate, cu_seqlens=None) -> None:
    """Run the kernel on a (token blocks, head blocks) grid; see :data:`ropekit.backends.kernel_op.Launch`.

    ``offset`` is an int, or (this launcher only, with positions None) an int64 tensor of per-sequence
    offsets, one per batch row: the kernel reads it and computes each token's row ``offsets[b] + t``, so no
    positions tensor is built.

    ``cu_seqlens`` (this launcher only, with positions None): a packed batch of N sequences, q of shape
    (1, T, heads, head_dim) and cu_seqlens a contiguous int32 or int64 (N + 1,) tensor on q's device; offset
    an int or an int64 (N,) tensor, one per packed sequence. The kernel finds each token's sequence s in
    cu_seqlens (a binary search) and its row ``t - cu_seqlens[s] + offset`` (or ``+ offsets[s]``); it checks
    cu_seqlens' values itself (from 0 to T, never decreasing), as it checks rows.

    Table rows are checked twice. First on the host, without a sync: an int offset with integer arithmetic;
    a positions or offsets tensor when it is a CPU tensor (the interpreter). Then in the kernel, for every
    call: a row outside the table is clamped into it (the kernel never reads outside the table) and fails the
    launch (:func:`ropekit.backends.triton.rotary_kernel.flag_bad`), whatever the host check let through.
    Where it
    fails: compiled, the kernel traps, and the CUDA error surfaces at the next synchronising call on the
    device (as a device-side assert), with no separate assert kernel per launch; under the interpreter, this
    function raises RuntimeError when the kernel returns.

    The specialization (constexprs, ``num_warps``) is
    :func:`ropekit.backends.triton.rotary_kernel.kernel_config`,
    the same function the ahead-of-time compile tests enumerate; the compile options
    (``COMPILE_OPTIONS``: no FP contraction, the register cap) are passed explicitly at every launch.

    Raises:
        ValueError: on anything :func:`~ropekit.backends.kernel_op.check_launch` rejects, or (host-checked
            rows) a table row outside the table, or (host-checked cu_seqlens) malformed cu_seqlens.
        RuntimeError: under the interpreter, a row outside the table (or malformed cu_seqlens) that the host
            did not check.
    """
    from ropekit.backends.triton.rotary_kernel import (
        COMPILE_OPTIONS,
        INTERPRETED,
        PREFILL_TOKENS,
        ROWS_CU_SEQLENS,
        ROWS_OFFSET,
        ROWS_POSITIONS,
        ROWS_SEQ_OFFSETS,
        grid,
        kernel_config,
        rotary_kernel,
    )

    per_sequence = positions is None and type(offset) is not int and isinstance(offset, torch.Tensor)
    check_launch(q, k, q_out, k_out, cos, sin, positions, 0 if per_sequence else offset, SUPPORTED_DTYPES)
    batch, seq, q_heads, head_dim = q.shape  # (batch, seq, heads, head_dim)
    table_len, half = cos.shape  # (table_len, rotary_dim // 2)
    tokens = batch * seq
    n_seqs = search_steps = 0  # a packed batch's sequences, and the steps that find a token's sequence
    offsets = _NO_OFFSETS.get(q.device)  # replaced by a packed batch's per-sequence offsets
    if offsets is None:
        offsets = _no_offsets(q.device)
    if tokens == 0 and cu_seqlens is None:
        return
    if cu_seqlens is not None:  # a packed batch (1, T, heads, head_dim): checked inline, as the offsets
        if positions is not None or batch != 1:
            raise ValueError(
                f"cu_seqlens: expected q of shape (1, total_tokens, heads, head_dim) and no positions, got q "
                f"of shape {tuple(q.shape)}{'' if positions is None else ' and positions'}"
            )
        if (
            cu_seqlens.dtype not in (torch.int32, torch.int64)
            or cu_seqlens.dim() != 1
            or cu_seqlens.shape[0] < 2
            or not cu_seqlens.is_contiguous()
            or cu_seqlens.device != q.device
        ):
            raise ValueError(
                f"cu_seqlens: expected a contiguous int32 or int64 tensor of shape (num_seqs + 1,) with "
                f"num_seqs >= 1 on {q.device}, got a {cu_seqlens.dtype} tensor of shape "
                f"{tuple(cu_seqlens.shape)} on {cu_seqlens.device}"
            )
        n_seqs = cu_seqlens.shape[0] - 1
    if per_sequence:  # read by the kernel as they are: checked inline (a decode step's budget of calls)
        n, each = (batch, "batch row") if cu_seqlens is None else (n_seqs, "packed sequence")
        if (
            offset.dtype != torch.int64
            or offset.shape != (n,)
            or not offset.is_contiguous()
            or offset.device != q.device
        ):
            raise ValueError(
                f"offsets: expected a contiguous int64 tensor of shape ({n},) (one per {each}) on "
                f"{q.device}, got a {offset.dtype} tensor of shape {tuple(offset.shape)} on {offset.device}"
            )
    if cu_seqlens is not None:
        if per_sequence:
            offsets, offset = offset, -1  # -1: the kernel reads offsets[s]
        if HOST_CHECKS and cu_seqlens.device.type == "cpu":  # no sync; the kernel checks them again
            check_packed_rows(cu_seqlens, offsets if offset < 0 else offset, tokens, table_len)
        if tokens == 0:
            return
        rows, form, search_steps = cu_seqlens, ROWS_CU_SEQLENS, (n_seqs - 1).bit_length()
    elif per_sequence:
        if HOST_CHECKS and offset.device.type == "cpu":  # no sync; the kernel checks every row again
            lo, hi = torch.stack(torch.aminmax(offset)).tolist()
            if lo < 0 or hi + seq > table_len:
                raise row_error(lo if lo < 0 else hi + seq - 1, table_len)
        rows, form, offset = offset, ROWS_SEQ_OFFSETS, 0
    elif positions is None:
        check_offset_rows(offset, batch, seq, table_len)
        rows, form = q, ROWS_OFFSET  # an unused pointer
    else:
        if HOST_CHECKS and positions.device.type == "cpu":
            lo, hi = torch.stack(torch.aminmax(positions)).tolist()
            if lo < 0 or hi >= table_len:
                raise row_error(lo if lo < 0 else hi, table_len)
        rows, form = positions, ROWS_POSITIONS
    has_k = k is not None
    k_heads = k.shape[2] if has_k else 0
    k_args = (k, k_out) if has_k else (q, q_out)  # with k_heads 0 the kernel never touches them
    interpret = INTERPRETED
    constexprs, num_warps = kernel_config(
        _TRITON_DTYPE[q.dtype],
        half,
        head_dim - 2 * half,
        interleaved=interleaved,
        conjugate=conjugate,
        rows=form,
        copy_tail=q_out.data_ptr() != q.data_ptr() or (has_k and k_out.data_ptr() != k.data_ptr()),
        prefill=tokens >= PREFILL_TOKENS,
        interpret=interpret,
    )
    blocks = grid(tokens, q_heads, k_heads, constexprs)
    if blocks[1] == 0:  # no head to rotate (a launch of an empty grid is refused)
        return
    flag = error_flag(q.device)
    # Triton launches on the current CUDA device; make it q's (multi-GPU).
    device_guard = torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext()
    with device_guard:
        rotary_kernel[blocks](
            q,
            k_args[0],
            q_out,
            k_args[1],
            cos,
            sin,
            rows,
            offsets,
            flag,
            offset,
            table_len,
            tokens,
            seq,
            q_heads,
            k_heads,
            n_seqs,
            search_steps,
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
    if interpret and not flag[0]:  # the interpreter's kernel cleared it (a host tensor: no sync)
        raise flagged(flag, _ROW_MESSAGE if cu_seqlens is None else _PACKED_MESSAGE)
