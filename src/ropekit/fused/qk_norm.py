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

from ropekit.backends import named_backend, select_backend
from ropekit.backends.c.qk_norm import SUPPORTED_DTYPES, NormSpec
from ropekit.backends.eager.qk_norm import heads as _heads
from ropekit.backends.eager.rotary import rotate, table_rows
from ropekit.backends.kernel_op import plain_eager, register_op
from ropekit.backends.plan import gate, keep
from ropekit.dtensor_inputs import check_no_dtensor
from ropekit.fused.planned import qk_norm_plan
from ropekit.positions import check_offsets_beside_positions, resolve
from ropekit.validation import (
    check_bool,
    check_in_place_allowed,
    check_int,
    check_movable,
    check_no_alias,
    check_positive,
    check_tables,
    check_writable,
    describe,
)

__all__ = ["qk_norm_rotary_"]

# The public function's arguments, named in a DTensor's refusal (dtensor_inputs.check_no_dtensor).
_ARGUMENTS = ("qkv", "q_weight", "k_weight", "cos", "sin", "positions", "offsets", "cu_seqlens")

_NORMS = ("head", "all_heads")
# The op's launch-plan gate (ropekit.backends.plan.gate): its arguments in the order its plans' runs take.
_launch_planned = gate(
    "qk_norm_rotary_",
    "qkv q_weight k_weight cos sin positions? offsets# cu_seqlens?",
    "num_q_heads:int num_kv_heads:int head_dim:int eps:number interleaved:bool weight_offset:number norm:str "
    "cast_before_weight:bool? backend:str",
)


class QKNormRotaryFunction(torch.autograd.Function):
    """In place: qkv's q and k become rotate(rms_norm(.)); backward covers the rotation and the norm.

    Saved for backward: a copy of q and k as they were (the norm's gradient needs its input), the weights,
    the tables and the rows. The rotation's gradient is the conjugate rotation (docs/math.md); the norm's,
    with ``n = x r``, ``r = rsqrt(mean(x^2) + eps)``, u = g * (w + offset) over a group of N features:
    ``dx = r (u - n * mean(u n))`` and ``dw = sum(g n)`` over tokens (and heads).
    """

    @staticmethod
    def forward(ctx: Any, qkv, q_weight, k_weight, cos, sin, positions, offset, spec, launch):
        qk_width = (spec.q_heads + spec.k_heads) * spec.head_dim
        ctx.save_for_backward(qkv[..., :qk_width].clone(), q_weight, k_weight, cos, sin, positions)
        ctx.offset, ctx.spec = offset, spec
        launch(qkv, q_weight, k_weight, cos, sin, positions, offset, spec)
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
        return grad_input, weights[0], weights[1], None, None, None, None, None, None


def _check_weight(name: str, w: object, features: int, qkv: torch.Tensor, form: str) -> None:
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got {describe(w)}")
    if tuple(w.shape) != (features,):
        raise ValueError(f"{name}: expected shape ({features},) ({form}), got {tuple(w.shape)}")
    if w.device != qkv.device:
        raise ValueError(f"{name}: expected a tensor on qkv's device {qkv.device}, got one on {w.device}")


def _check_norm_numbers(eps: object, weight_offset: object) -> tuple[float, float]:
    """eps a finite number > 0 and weight_offset a finite number, as floats (a NaN in either, or eps <= 0,
    makes every normalised value NaN)."""
    eps = check_positive("eps", eps)
    if (
        isinstance(weight_offset, bool)
        or not isinstance(weight_offset, (int, float))
        or not math.isfinite(weight_offset)
    ):
        raise ValueError(f"weight_offset: expected a finite number, got {describe(weight_offset)}")
    return eps, float(weight_offset)


def _check_constant_tables(cos: torch.Tensor, sin: torch.Tensor) -> None:
    """The tables are constants here: a table that requires grad would get no gradient."""
    if cos.requires_grad or sin.requires_grad:
        raise ValueError(
            "cos, sin: expected tables that do not require grad (qk_norm_rotary_ treats them as constants)"
        )


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
    out, key = _launch_planned(
        qkv, q_weight, k_weight, cos, sin, positions, offsets, cu_seqlens,
        num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, eps=eps,
        interleaved=interleaved, weight_offset=weight_offset, norm=norm,
        cast_before_weight=cast_before_weight, backend=backend,
    )  # fmt: skip
    if out is not None:  # a decode step seen before: its launch plan (ropekit.fused.planned)
        return out
    check_no_dtensor(
        "qk_norm_rotary_", _ARGUMENTS, (qkv, q_weight, k_weight, cos, sin, positions, offsets, cu_seqlens),
        "normalise and rotate each rank's local tensors (t.to_local())",
    )  # fmt: skip
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
    eps, weight_offset = _check_norm_numbers(eps, weight_offset)
    if cast_before_weight is None:
        cast_before_weight = not all_heads and weight_offset == 0
    spec = NormSpec(
        q_heads, k_heads, head_dim, eps, weight_offset, all_heads,
        check_bool("cast_before_weight", cast_before_weight), check_bool("interleaved", interleaved),
    )  # fmt: skip
    check_tables(cos, sin, head_dim)
    check_movable("cos", cos, qkv.device, where="qkv's device")
    check_movable("sin", sin, qkv.device, where="qkv's device")
    _check_constant_tables(cos, sin)
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
    check_in_place_allowed("qkv", qkv)  # a view of such a leaf, an inference tensor outside inference mode
    check_writable("qkv", qkv)
    check_no_alias(  # the memory rule: qkv is rotated in place of itself; what it reads stays apart
        (("qkv", qkv),),
        (("qkv", qkv), ("q_weight", q_weight), ("k_weight", k_weight), ("cos", cos), ("sin", sin),
         ("positions", positions), ("offsets", offsets), ("cu_seqlens", cu_seqlens)),
    )  # fmt: skip
    if cos.device != qkv.device:
        cos, sin = cos.to(qkv.device), sin.to(qkv.device)

    impl = select_backend(backend, q_view, cos, op="qk_norm", spec=spec)
    rows = None if pos.tensor is None else pos.tensor.reshape(-1)  # (B * S,) int64, contiguous
    if torch.is_grad_enabled() and (qkv.requires_grad or q_weight.requires_grad or k_weight.requires_grad):
        QKNormRotaryFunction.apply(
            view, q_weight, k_weight, cos, sin, rows, pos.offset, spec, impl.launch_qk_norm,
        )  # fmt: skip
        return qkv
    args = (qkv, q_weight, k_weight, cos, sin, rows, pos.offset, *spec, impl.name)
    if plain_eager(qkv):
        _launch(*args, checked=True)
        if key is not None:  # plan the next call like this one
            plan = qk_norm_plan(
                impl.name, qkv, q_weight, k_weight, cos, sin, spec, positions, offsets, cu_seqlens
            )
            keep(key, plan)
    else:  # traced: the registered op, one node of a compiled graph
        _OP(*args)
    return qkv


def _launch(qkv, q_weight, k_weight, cos, sin, positions, offset, *spec_and_backend, checked: bool) -> None:
    """Normalise and rotate qkv's q and k in place on the named backend. checked=False (the registered op):
    the kernel wall is checked here (shapes, dtypes, strides, devices, no self-overlap); the kernels check the
    table rows."""
    *fields, name = spec_and_backend
    spec = NormSpec(*fields)
    impl = named_backend(name, "qk_norm", None if checked else qkv.device)
    if not checked:
        _check_op(qkv, q_weight, k_weight, cos, sin, positions, spec)
        if positions is not None:
            check_offsets_beside_positions(offset)
    view = qkv.unsqueeze(0) if qkv.dim() == 2 else qkv  # (B, S, W); packed (T, W) as (1, T, W)
    # The kernels write through pointers: checked, tell autograd (the registered op's dispatcher does it).
    impl.launch_qk_norm(
        view, q_weight, k_weight, cos, sin, positions, offset, spec, written=(qkv,) if checked else ()
    )


def _check_op(qkv, q_weight, k_weight, cos, sin, positions, spec: NormSpec) -> None:
    """What the kernels rely on to stay inside their tensors, for the registered op's own callers."""
    qkv = _check_qkv(qkv, False)
    _check_norm_numbers(spec.eps, spec.weight_offset)  # the public call's value checks
    width = (spec.q_heads + 2 * spec.k_heads) * spec.head_dim
    if min(spec.q_heads, spec.k_heads, spec.head_dim) < 1 or qkv.shape[-1] != width:
        raise ValueError(f"qkv: expected {width} features ((Hq + 2 Hk) * D), got shape {tuple(qkv.shape)}")
    for name, w, heads in (("q_weight", q_weight, spec.q_heads), ("k_weight", k_weight, spec.k_heads)):
        features = heads * spec.head_dim if spec.all_heads else spec.head_dim
        _check_weight(name, w, features, qkv, "the packing's")
    check_tables(cos, sin, spec.head_dim)
    for name, t in (("cos", cos), ("sin", sin)):
        if t.device != qkv.device:
            raise ValueError(f"{name}: expected a tensor on qkv's device {qkv.device}, got one on {t.device}")
    tokens = qkv.shape[:-1].numel()
    if positions is not None and (
        positions.dtype != torch.int64
        or positions.numel() != tokens
        or not positions.is_contiguous()
        or positions.device != qkv.device
    ):
        raise ValueError(
            f"positions: expected a contiguous int64 tensor of {tokens} rows, got {describe(positions)}"
        )
    check_writable("qkv", qkv)


# torch.ops.ropekit.qk_norm_rotary_: qkv's q and k normalised and rotated in place.
_OP = register_op(
    "qk_norm_rotary_",
    lambda *args: _launch(*args, checked=False),
    lambda *args: None,
    mutates_args=("qkv",),
    guard=lambda qkv, q_weight, k_weight, cos, sin, *rest: _check_constant_tables(cos, sin),
    schema=(
        "(Tensor(a!) qkv, Tensor q_weight, Tensor k_weight, Tensor cos, Tensor sin, Tensor? positions, "
        "SymInt offset, int num_q_heads, int num_kv_heads, int head_dim, float eps, float weight_offset, "
        "bool all_heads, bool cast_before_weight, bool interleaved, str backend) -> ()"
    ),
)
