"""RoPE fused with FP8 quantisation: :func:`apply_rotary_qk_fp8`, including DeepSeek's MLA form.

An FP8 attention kernel wants q and k as FP8. Unfused, a model rotates q and k (a read and write in the
input dtype), then scales and casts them (another read, and an FP8 write); fused, each is read once and
written once as FP8 bytes, which for float32 inputs removes about 60% of the traffic (docs/serving.md).
Inference only.

Rounding contract: each output byte equals ``(r / scale).clamp(-fmax, fmax).to(fp8_dtype)``, where r is the
float32 rotation (each product and sum rounded to float32, as the torch backend computes it) and fmax the
format's largest finite value, so float8_e5m2 saturates too, unlike a bare cast. Every backend meets it bit
for bit (tests/fused/test_fp8.py).
"""

from __future__ import annotations

import torch

from ropekit.backends import named_backend, select_backend
from ropekit.backends.fused_launch import FP8_KINDS, Channel, FusedLaunch
from ropekit.backends.kernel_op import plain_eager, register_op
from ropekit.backends.plan import gate, keep
from ropekit.dtensor_inputs import check_no_dtensor
from ropekit.fused.checks import check_inference, check_kernel_scale, check_scale
from ropekit.fused.planned import fp8_plan
from ropekit.positions import check_offsets_beside_positions, resolve
from ropekit.validation import check_bool, check_movable, check_tables, describe

__all__ = ["apply_rotary_qk_fp8"]

# The public function's arguments, named in a DTensor's refusal (dtensor_inputs.check_no_dtensor).
_ARGUMENTS = ("q", "k", "cos", "sin", "q_scale", "k_scale", "q_nope", "k_nope", "positions", "offsets",
              "cu_seqlens")  # fmt: skip

# The op's launch-plan gate (ropekit.backends.plan.gate): its arguments in the order its plans' runs take. A
# scale (q_scale$ / k_scale$) is a tensor (its values checked by the plan's run) or a number (its value in
# the key: the checked path proved it).
_launch_planned = gate(
    "apply_rotary_qk_fp8",
    "q k cos sin q_scale$ k_scale$ q_nope? k_nope? positions? offsets# cu_seqlens?",
    "fp8_dtype:dtype interleaved:bool backend:str",
)


def apply_rotary_qk_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    q_scale: float | torch.Tensor,
    k_scale: float | torch.Tensor,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    q_nope: torch.Tensor | None = None,
    k_nope: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    offsets: int | torch.Tensor = 0,
    cu_seqlens: torch.Tensor | None = None,
    interleaved: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, ...]:
    """Rotate q and k and quantise them to FP8 in one pass.

    Shape notation: T packed tokens, B batch, S sequence, Hq / Hk heads, D head_dim, Dn the nope width.

    Args:
        q: (T, Hq, D) with cu_seqlens (or positions (T,)), or (B, S, Hq, D); never modified.
        k: (T, Hk, D) or (B, S, Hk, D); never modified.
        cos, sin, positions, offsets, cu_seqlens, interleaved: as in :func:`ropekit.apply_rotary`.
        q_scale, k_scale: stored = value / scale (dequantise by multiplying, as torch's scaled FP8 and vLLM):
            a float, a 0-d tensor (per tensor) or an (H,) tensor (per head), every value finite and > 0.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        q_nope, k_nope: the MLA form (DeepSeek): q and k are then the rope parts, and q_nope (.., Hq, Dn) and
            k_nope (.., Hk, Dn') the parts that are not rotated, only scaled (by q_scale / k_scale) and cast,
            as FlashInfer's ``mla_rope_quantize_fp8`` does. Give both or neither.
        backend: "auto", "torch", "cpu" or "triton".

    Returns:
        (q_fp8, k_fp8), or with q_nope / k_nope (q_rope_fp8, k_rope_fp8, q_nope_fp8, k_nope_fp8); new
        contiguous tensors of fp8_dtype shaped like their inputs.

    Raises:
        ValueError: inputs that require grad (inference only), shapes or dtypes that disagree, an fp8_dtype
            that is not one of the two, a scale of the wrong shape or not > 0, or a backend that cannot serve
            the inputs.
    """
    out, key = _launch_planned(
        q, k, cos, sin, q_scale, k_scale, q_nope, k_nope, positions, offsets, cu_seqlens, fp8_dtype=fp8_dtype,
        interleaved=interleaved, backend=backend,
    )  # fmt: skip
    if out is not None:  # a call seen before: its launch plan (ropekit.fused.planned.fp8_plan)
        return out
    # The plan's arguments: a scale given as a number is None there (its value is in the key).
    q_tensor = q_scale if type(q_scale) is torch.Tensor else None
    k_tensor = k_scale if type(k_scale) is torch.Tensor else None
    planned = (q, k, cos, sin, q_tensor, k_tensor, q_nope, k_nope, positions, offsets, cu_seqlens)
    check_inference("apply_rotary_qk_fp8", q=q, k=k, q_nope=q_nope, k_nope=k_nope)
    check_no_dtensor(
        "apply_rotary_qk_fp8", _ARGUMENTS,
        (q, k, cos, sin, q_scale, k_scale, q_nope, k_nope, positions, offsets, cu_seqlens),
        "quantise each rank's local tensors (t.to_local())",
    )  # fmt: skip
    check_bool("interleaved", interleaved)
    _check_fp8_dtype(fp8_dtype)
    _check_nope_pair(q_nope, k_nope)
    if not isinstance(q, torch.Tensor):
        raise ValueError(f"q: expected a torch.Tensor, got {describe(q)}")
    ropes = _as_4d([q, k])
    if isinstance(positions, torch.Tensor) and q.dim() == 3 and cu_seqlens is None and positions.dim() == 1:
        positions = positions[None]
    q4, k4 = ropes
    x = q4 if cu_seqlens is None else q
    pos = resolve(x, positions=positions, offsets=offsets, cu_seqlens=cu_seqlens, name="q")
    q_heads, head_dim = q4.shape[2:]
    _check_like("k", k4, q4, q, head_dim)
    k_heads = k4.shape[2]
    check_tables(cos, sin, head_dim)
    check_movable("cos", cos, q.device, where="q's device")
    check_movable("sin", sin, q.device, where="q's device")
    if cos.device != q.device:
        cos, sin = cos.to(q.device), sin.to(q.device)
    pos.check_table(cos.shape[0])
    scales = [
        check_scale("q_scale", q_scale, q_heads, q.device),
        check_scale("k_scale", k_scale, k_heads, q.device),
    ]
    nopes = None
    if q_nope is not None:
        nopes = _as_4d([q_nope, k_nope])
        for name, t, heads in (("q_nope", nopes[0], q_heads), ("k_nope", nopes[1], k_heads)):
            _check_like(name, t, q4, q, None)
            if t.shape[2] != heads:
                raise ValueError(
                    f"{name}: expected {heads} heads (as its rope part), got shape {tuple(t.shape)}"
                )
    widest = max([head_dim] + ([] if nopes is None else [t.shape[3] for t in nopes]))
    name = select_backend(backend, q4, cos, op="fused", widest=widest).name
    rows = None if pos.tensor is None else pos.tensor.reshape(-1).contiguous()  # (B * S,)
    args = (
        q,
        k,
        cos,
        sin,
        rows,
        pos.offset,
        scales[0],
        scales[1],
        fp8_dtype,
        q_nope,
        k_nope,
        interleaved,
        name,
    )
    if not plain_eager(q):  # traced: the registered op, one node of a compiled graph
        return tuple(_OP(*args))
    outs, launches = _launch(*args, checked=True)
    if key is not None:  # plan the next call like this one
        keep(key, fp8_plan(name, launches, *planned, fp8_dtype))
    return tuple(outs)


def _launch(q, k, cos, sin, positions, offset, q_scale, k_scale, fp8_dtype, q_nope, k_nope, interleaved,
            backend, *, checked: bool) -> tuple[list[torch.Tensor], list[FusedLaunch]]:  # fmt: skip
    """The FP8 outputs, shaped like q, k (and q_nope, k_nope), and the launches run. checked=True: the public
    call checked everything; False (the registered op): the launcher checks the kernel wall."""
    impl = named_backend(backend, "fused", None if checked else q.device)
    kind = _check_fp8_dtype(fp8_dtype)
    if not checked:  # a registered op called directly: the public call's value checks
        _check_nope_pair(q_nope, k_nope)
        if positions is not None:
            check_offsets_beside_positions(offset)
        for name, scale, t in (("q_scale", q_scale, q), ("k_scale", k_scale, k)):
            check_kernel_scale(name, scale, t.shape[-2] if t.dim() > 1 else 1, q.device)
    q4 = _as_4d([q])[0]
    outs = []

    def channel(src: torch.Tensor, scale: torch.Tensor, rotate: bool) -> Channel | None:
        out = torch.empty(src.shape, dtype=fp8_dtype, device=src.device)  # shaped like the input
        outs.append(out)
        if out.numel() == 0:  # an empty nope part (FlashInfer passes width 0): nothing to write
            return None
        src, out = _as_4d([src, out])
        src = src if src.shape[-1] <= 1 or src.stride(-1) == 1 else src.contiguous()
        return Channel(src, out.view(torch.uint8), rotate=rotate, by_slot=False, fp8=kind, scale=scale)

    channels = (channel(q, q_scale, True), channel(k, k_scale, True), None)
    launch = FusedLaunch(q4.shape[0], q4.shape[1], cos, sin, positions, offset, None, interleaved, False,
                         channels)  # fmt: skip
    launches = []
    if channels != (None, None, None):  # no token (or no head): nothing to write, on every backend
        impl.launch_fused(launch, checked=checked)
        launches.append(launch)
    if q_nope is not None:  # the nope parts: scaled and cast only (one more pass over bytes not yet read)
        channels = (channel(q_nope, q_scale, False), channel(k_nope, k_scale, False), None)
        if channels != (None, None, None):
            launches.append(launch._replace(channels=channels))
            impl.launch_fused(launches[-1], checked=checked)
    return outs, launches


def _fake(q, k, cos, sin, positions, offset, q_scale, k_scale, fp8_dtype, q_nope, k_nope, *flags):
    parts = (q, k) if q_nope is None else (q, k, q_nope, k_nope)
    return [torch.empty(t.shape, dtype=fp8_dtype, device=t.device) for t in parts]


# torch.ops.ropekit.rotary_qk_fp8: new FP8 tensors, nothing written in place.
_OP = register_op(
    "rotary_qk_fp8",
    lambda *args: _launch(*args, checked=False)[0],
    _fake,
    mutates_args=(),
    guard=lambda q, k, cos, sin, positions, offset, q_scale, k_scale, fp8_dtype, q_nope, k_nope, *flags: (
        check_inference("apply_rotary_qk_fp8", q=q, k=k, q_nope=q_nope, k_nope=k_nope)
    ),
    schema=(
        "(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor? positions, SymInt offset, Tensor q_scale, "
        "Tensor k_scale, ScalarType fp8_dtype, Tensor? q_nope, Tensor? k_nope, bool interleaved, "
        "str backend) -> Tensor[]"
    ),
)


def _check_fp8_dtype(fp8_dtype: object) -> int:
    """The kernels' code for fp8_dtype, one of the two FP8 formats."""
    kind = FP8_KINDS.get(fp8_dtype) if isinstance(fp8_dtype, torch.dtype) else None
    if kind is None:
        raise ValueError(f"fp8_dtype: expected one of {[str(d) for d in FP8_KINDS]}, got {fp8_dtype!r}")
    return kind


def _check_nope_pair(q_nope: object, k_nope: object) -> None:
    """The MLA form takes both nope parts or neither."""
    if (q_nope is None) != (k_nope is None):
        raise ValueError(
            f"q_nope, k_nope: expected both (the MLA form) or neither, got {describe(q_nope)} and "
            f"{describe(k_nope)}"
        )


def _as_4d(tensors: list) -> list:
    """Packed (T, H, D) inputs as (1, T, H, D) views (the kernels' (batch, seq) axes); others as they are."""
    return [t[None] if isinstance(t, torch.Tensor) and t.dim() == 3 else t for t in tensors]


def _check_like(name: str, t: object, q4: torch.Tensor, q: torch.Tensor, head_dim: int | None) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[:2] != q4.shape[:2]:
        raise ValueError(f"{name}: expected the same leading axes as q {tuple(q.shape)}, got {describe(t)}")
    if t.dtype != q.dtype or t.device != q.device:
        raise ValueError(f"{name}: expected q's dtype {q.dtype} on {q.device}, got {t.dtype} on {t.device}")
    if head_dim is not None and t.shape[3] != head_dim:
        raise ValueError(f"{name}: expected q's head_dim {head_dim}, got shape {tuple(t.shape)}")
