"""QK-RMSNorm + RoPE on a packed qkv buffer, in place: :func:`qk_norm_rotary_`.

Qwen3, Gemma 3 and OLMo 2 normalise q and k with an RMSNorm before rotating them. Run apart, the norm reads
and writes q and k, then the rotation reads and writes them again; fused, each is read and written once, so
the pass moves about half the bytes (docs/serving.md).

Shape notation:
    B batch, S sequence, T total tokens of a packed batch, Hq / Hk query / key-value heads, D head_dim,
    R rotary_dim = 2 * cos.shape[-1] <= D, L table_len, W = (Hq + 2 Hk) * D the packed width.

The three RMSNorm forms (transformers' modeling_qwen3.py, modeling_gemma3.py, modeling_olmo2.py), all with the
mean square in float32, ``n = x * rsqrt(mean(x^2) + eps)``:
    Qwen3 (and Llama's RMSNorm): per head over D; ``w * n.to(dtype)``: n is rounded to the storage dtype,
        then the weight multiplies it. The defaults.
    Gemma 3: per head over D; ``(n * (1 + w.float())).to(dtype)``: weight_offset=1.0, one rounding at the end
        (cast_before_weight defaults to False when weight_offset is not 0).
    OLMo 2: over all of q's Hq * D features at once (and all of k's), weights (Hq * D,) and (Hk * D,),
        ``(w * n).to(dtype)``: norm="all_heads" (cast_before_weight defaults to False).
The normalised, weighted value is rounded to the storage dtype (as the unfused model stores it), then rotated
in float32 with the table row and rounded once, exactly as :func:`ropekit.apply_rotary` rotates it.

Pair layout of the rotation: interleaved=False pairs (i, i + R/2) (GPT-NeoX / HF: Qwen3, Gemma 3, OLMo 2);
interleaved=True pairs (2i, 2i+1) (GPT-J / Meta).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from ropekit.backends import select_backend
from ropekit.backends.eager import rotate, table_rows
from ropekit.backends.qk_norm_cpu import SUPPORTED_DTYPES, NormSpec, unavailable_reason
from ropekit.backends.qk_norm_cpu import launch as cpu_launch
from ropekit.positions import resolve
from ropekit.validation import (
    check_bool,
    check_int,
    check_movable,
    check_positive,
    check_tables,
    check_writable,
    describe,
)

__all__ = ["qk_norm_rotary_", "rms_norm"]

_NORMS = ("head", "all_heads")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, spec: NormSpec) -> torch.Tensor:
    """The readable RMSNorm of q or k (..., H, D) in the form ``spec`` names; returns x's shape and dtype.

    The torch path of :func:`qk_norm_rotary_` and the reference its kernels are tested against.
    """
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    groups = x.flatten(-2) if spec.all_heads else x  # (..., H * D) for OLMo 2, else (..., H, D)
    x32 = groups.to(compute)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + spec.eps)
    w = weight.to(compute) + spec.weight_offset
    if spec.cast_before_weight:
        normed = normed.to(x.dtype).to(compute)
    return (normed * w).to(x.dtype).view(x.shape)


def _torch_launch(qkv, q_weight, k_weight, cos, sin, positions, offset, spec: NormSpec) -> None:
    """The readable path: RMSNorm, then the torch backend's rotation, written back into qkv (B, S, W)."""
    batch, seq, _ = qkv.shape
    rows = table_rows(None if positions is None else positions.view(batch, seq), offset, qkv, cos.shape[0])
    q, k = _heads(qkv, spec)
    for x, weight in ((q, q_weight), (k, k_weight)):
        normed = rms_norm(x, weight, spec)
        x.copy_(rotate(normed, cos, sin, rows, interleaved=spec.interleaved, conjugate=False, inplace=True))


_LAUNCH = {"torch": _torch_launch, "cpu": cpu_launch}


def _launcher(name: str):
    if name == "triton":
        from ropekit.backends.qk_norm_triton import launch

        return launch
    return _LAUNCH.get(name, _torch_launch)  # a registered third-party backend: the torch path


def _heads(qkv: torch.Tensor, spec: NormSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k of qkv (..., W) as views (..., Hq, D) and (..., Hk, D)."""
    q_width, k_width = spec.q_heads * spec.head_dim, spec.k_heads * spec.head_dim
    q = qkv[..., :q_width].unflatten(-1, (spec.q_heads, spec.head_dim))
    k = qkv[..., q_width : q_width + k_width].unflatten(-1, (spec.k_heads, spec.head_dim))
    return q, k


class QKNormRotaryFunction(torch.autograd.Function):
    """In place: qkv's q and k become rotate(rms_norm(.)); backward covers the rotation and the norm.

    Saved for backward: a copy of q and k as they were (the norm's gradient needs its input), the weights,
    the tables and the rows. The rotation's gradient is the conjugate rotation (docs/math.md); the norm's,
    with ``n = x r``, ``r = rsqrt(mean(x^2) + eps)``, u = g * (w + offset) over a group of N features:
    ``dx = r (u - n * mean(u n))`` and ``dw = sum(g n)`` over tokens (and heads).
    """

    @staticmethod
    def forward(ctx: Any, qkv, q_weight, k_weight, cos, sin, positions, offset, spec, launch, kernel_weights):
        qk_width = (spec.q_heads + spec.k_heads) * spec.head_dim
        ctx.save_for_backward(qkv[..., :qk_width].clone(), q_weight, k_weight, cos, sin, positions)
        ctx.offset, ctx.spec = offset, spec
        launch(qkv, *kernel_weights, cos, sin, positions, offset, spec)
        ctx.mark_dirty(qkv)
        return qkv

    @staticmethod
    @once_differentiable  # the saved input is a constant copy: a second derivative through it would be wrong
    def backward(ctx: Any, grad: torch.Tensor):
        x_qk, q_weight, k_weight, cos, sin, positions = ctx.saved_tensors
        spec: NormSpec = ctx.spec
        batch, seq, _ = grad.shape
        rows = table_rows(
            None if positions is None else positions.view(batch, seq), ctx.offset, grad, cos.shape[0]
        )
        compute = torch.float64 if grad.dtype == torch.float64 else torch.float32
        grad_q, grad_k = _heads(grad, spec)
        x_q, x_k = _heads(x_qk, spec)
        grad_qkv = grad.clone()
        out_q, out_k = _heads(grad_qkv, spec)
        weights = []
        for g, x, w, out in ((grad_q, x_q, q_weight, out_q), (grad_k, x_k, k_weight, out_k)):
            g = rotate(
                g.to(compute), cos, sin, rows, interleaved=spec.interleaved, conjugate=True, inplace=False
            )
            if spec.all_heads:
                g, x = g.flatten(-2), x.flatten(-2)  # (B, S, H * D): one group per token
            x = x.to(compute)
            r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + spec.eps)
            n = x * r
            u = g * (w.to(compute) + spec.weight_offset)
            dx = r * (u - n * (u * n).mean(-1, keepdim=True))
            out.copy_(dx.view(out.shape))
            weights.append((g * n).reshape(-1, w.shape[0]).sum(0).to(w.dtype))
        grad_input = grad_qkv if ctx.needs_input_grad[0] else None
        return grad_input, weights[0], weights[1], None, None, None, None, None, None, None


def _check_weight(name: str, w: object, features: int, qkv: torch.Tensor, form: str) -> None:
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got {describe(w)}")
    if tuple(w.shape) != (features,):
        raise ValueError(f"{name}: expected shape ({features},) ({form}), got {tuple(w.shape)}")
    if w.device != qkv.device:
        raise ValueError(f"{name}: expected a tensor on qkv's device {qkv.device}, got one on {w.device}")


def _check_qkv(qkv: object, varlen: bool) -> torch.Tensor:
    if not isinstance(qkv, torch.Tensor) or not qkv.is_floating_point():
        raise ValueError(f"qkv: expected a floating-point tensor, got {describe(qkv)}")
    if qkv.dtype not in (*SUPPORTED_DTYPES, torch.float64):
        raise ValueError(
            f"qkv: expected a float16, bfloat16, float32 or float64 tensor, got dtype {qkv.dtype}"
        )
    if qkv.dim() not in (2, 3) or (varlen and qkv.dim() != 2):
        want = "(T, W) when cu_seqlens is given" if varlen else "(T, W) or (B, S, W)"
        raise ValueError(f"qkv: expected a packed tensor {want}, got shape {tuple(qkv.shape)}")
    if qkv.shape[-1] > 1 and qkv.stride(-1) != 1 and qkv.numel():
        raise ValueError(f"qkv: expected a last axis of stride 1, got strides {qkv.stride()}")
    return qkv


def qk_norm_rotary_(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    positions: torch.Tensor | None = None,
    offsets: int | torch.Tensor = 0,
    cu_seqlens: torch.Tensor | None = None,
    interleaved: bool = False,
    weight_offset: float = 0.0,
    norm: str = "head",
    cast_before_weight: bool | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """RMSNorm q and k of a packed qkv buffer, then rotate them, in place; v is untouched.

    Args:
        qkv: (T, W) or (B, S, W), W = (Hq + 2 Hk) * D, laid out [q heads | k heads | v heads] per token
            (vLLM's and SGLang's packed projection). float16, bfloat16, float32 (float64: torch path only).
            The last axis must have stride 1; other axes may be strided (a view into a larger buffer).
        q_weight, k_weight: the q_norm / k_norm weights: (D,), or (Hq * D,) and (Hk * D,) with
            norm="all_heads". Any float dtype; read in float32. (A float32 weight on bfloat16 qkv makes
            transformers' Qwen3 norm return float32; here the result is rounded to qkv's dtype, in place.)
        cos, sin: tables (L, R/2) as for :func:`ropekit.apply_rotary`; features of a head past R are
            normalised but not rotated (partial rotary).
        num_q_heads, num_kv_heads, head_dim: the packing.
        eps: the norm's epsilon, > 0.
        positions, offsets, cu_seqlens: as for :func:`ropekit.apply_rotary`. For (T, W) input, positions is
            (T,); without cu_seqlens the T tokens are one sequence (positions offsets + arange(T)).
        interleaved: pair layout; False = half / GPT-NeoX / HF, True = GPT-J / Meta.
        weight_offset: the norm multiplies by ``w + weight_offset`` (Gemma 3: 1.0).
        norm: "head" (Qwen3, Gemma 3: over each head's D features) or "all_heads" (OLMo 2: over all Hq * D
            features of q, and all Hk * D of k).
        cast_before_weight: round the normalised value to qkv's dtype before the weight multiplies it (Qwen3 /
            Llama) rather than multiplying in float32 and rounding once (Gemma 3, OLMo 2). None: True for
            norm="head" with weight_offset 0, else False (the module docstring lists the forms).
        backend: "auto", "torch", "cpu" or "triton" (as for :func:`ropekit.apply_rotary`).

    Returns:
        qkv, modified in place (its version counter bumped). Differentiable with respect to qkv (when it is
        not a leaf), q_weight and k_weight; the tables are constants.

    Raises:
        ValueError: a qkv that is not a float tensor of rank 2 / 3 with unit last stride; head counts whose
            packing does not give qkv's width; weights of the wrong shape, type or device; eps <= 0; an
            unknown norm; tables that are malformed, too wide for head_dim, or require grad; positions,
            offsets or cu_seqlens as :func:`ropekit.apply_rotary` refuses them; a read-only or overlapping
            qkv, or a leaf that requires grad; an unavailable backend. Nothing is written then.
    """
    qkv = _check_qkv(qkv, cu_seqlens is not None)
    q_heads = check_int("num_q_heads", num_q_heads, minimum=1, expected="a positive int")
    k_heads = check_int("num_kv_heads", num_kv_heads, minimum=1, expected="a positive int")
    head_dim = check_int("head_dim", head_dim, minimum=1, expected="a positive int")
    width = (q_heads + 2 * k_heads) * head_dim
    if qkv.shape[-1] != width:
        raise ValueError(
            f"qkv: expected a last axis of (num_q_heads + 2 * num_kv_heads) * head_dim = ({q_heads} + 2 * "
            f"{k_heads}) * {head_dim} = {width} features, got {qkv.shape[-1]}"
        )
    if norm not in _NORMS:
        raise ValueError(f"norm: expected one of {_NORMS}, got {norm!r}")
    all_heads = norm == "all_heads"
    form = (
        "norm='all_heads': one weight per feature of all heads"
        if all_heads
        else "one weight per head feature"
    )
    _check_weight("q_weight", q_weight, q_heads * head_dim if all_heads else head_dim, qkv, form)
    _check_weight("k_weight", k_weight, k_heads * head_dim if all_heads else head_dim, qkv, form)
    eps = check_positive("eps", eps)
    if (
        isinstance(weight_offset, bool)
        or not isinstance(weight_offset, (int, float))
        or not math.isfinite(weight_offset)
    ):
        raise ValueError(f"weight_offset: expected a finite number, got {describe(weight_offset)}")
    if cast_before_weight is None:
        cast_before_weight = not all_heads and weight_offset == 0
    spec = NormSpec(
        q_heads, k_heads, head_dim, eps, float(weight_offset), all_heads,
        check_bool("cast_before_weight", cast_before_weight), check_bool("interleaved", interleaved),
    )  # fmt: skip
    check_tables(cos, sin, head_dim)
    check_movable("cos", cos, qkv.device, where="qkv's device")
    check_movable("sin", sin, qkv.device, where="qkv's device")
    if cos.requires_grad or sin.requires_grad:
        raise ValueError(
            "cos, sin: expected tables that do not require grad (qk_norm_rotary_ treats them as constants)"
        )
    if not isinstance(backend, str):
        raise ValueError(f"backend: expected a string, got {backend!r}")

    view = qkv.unsqueeze(0) if qkv.dim() == 2 else qkv  # (B, S, W); packed (T, W) as (1, T, W)
    if qkv.dim() == 2 and cu_seqlens is None and isinstance(positions, torch.Tensor):
        if tuple(positions.shape) != (qkv.shape[0],):
            raise ValueError(
                f"positions: expected shape (T,) = ({qkv.shape[0]},), got {tuple(positions.shape)}"
            )
        positions = positions.unsqueeze(0)  # (1, T): the T tokens are one sequence
    # q's heads as resolve expects them: (T, Hq, D) with cu_seqlens, else (B, S, Hq, D).
    q_view = _heads(qkv if cu_seqlens is not None else view, spec)[0]
    pos = resolve(q_view, positions=positions, offsets=offsets, cu_seqlens=cu_seqlens, name="qkv")
    pos.check_table(cos.shape[0])
    if qkv.is_leaf and qkv.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            "qkv: a leaf tensor that requires grad cannot be modified in place; pass qkv.clone() (the output "
            "of the qkv projection is not a leaf)"
        )
    check_writable("qkv", qkv)
    if cos.device != qkv.device:
        cos, sin = cos.to(qkv.device), sin.to(qkv.device)

    impl = select_backend(backend, q_view, cos).name
    reason = unavailable_reason(spec) if impl == "cpu" else None
    if reason is not None:
        if backend == "cpu":
            raise ValueError(f"backend: 'cpu' cannot serve these inputs: {reason}")
        impl = "torch"
    if impl != "torch" and (cos.dtype != torch.float32 or cos.stride(-1) != 1 or sin.stride(-1) != 1):
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
    rows = None if pos.tensor is None else pos.tensor.reshape(-1)  # (B * S,) int64, contiguous
    launch = _launcher(impl)
    # The kernels read contiguous float32 weights; the torch path reads them as they are (float64 stays).
    weights = [
        w.detach() if impl == "torch" else w.detach().float().contiguous() for w in (q_weight, k_weight)
    ]
    if torch.is_grad_enabled() and (qkv.requires_grad or q_weight.requires_grad or k_weight.requires_grad):
        QKNormRotaryFunction.apply(
            view, q_weight, k_weight, cos, sin, rows, pos.offset, spec, launch, weights
        )
        return qkv
    launch(view, *weights, cos, sin, rows, pos.offset, spec)
    if impl != "torch":
        torch.autograd.graph.increment_version(qkv)  # the kernels write through pointers: tell autograd
    return qkv
    if impl == "torch":
        launch(view, q_weight, k_weight, cos, sin, rows, pos.offset, spec)
    else:
        launch(view, q_weight.float().contiguous(), k_weight.float().contiguous(), cos, sin, rows,
               pos.offset, spec)  # fmt: skip
        torch.autograd.graph.increment_version(qkv)  # the kernels write through pointers: tell autograd
    return qkv
