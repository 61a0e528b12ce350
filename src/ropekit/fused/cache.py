"""RoPE fused with the KV-cache write: :func:`apply_rotary_qk_and_cache`.

A serving step rotates q and k, then copies k and v into the paged cache. Unfused that is a read and write of
q and k (RoPE) and another read of k and v and write into the cache (``index_copy_``); fused, k is read once
and its rotation lands straight in the cache, so k's round trip through memory disappears (docs/serving.md
counts the bytes). Inference only.
"""

from __future__ import annotations

import torch

from ropekit.backends import named_backend, select_backend
from ropekit.backends.fused_launch import Channel, FusedLaunch, fp8_kind
from ropekit.backends.kernel_op import plain_eager, register_op
from ropekit.backends.plan import gate, keep
from ropekit.dtensor_inputs import check_no_dtensor
from ropekit.fused.checks import (
    cache_takes_scale,
    cache_view,
    check_distinct_slots,
    check_inference,
    check_kernel_scale,
    check_scale,
    check_slots,
    paged_view,
    pages,
)
from ropekit.fused.planned import cache_plan
from ropekit.positions import check_offsets_beside_positions, resolve
from ropekit.validation import (
    check_bool,
    check_in_place_allowed,
    check_movable,
    check_no_alias,
    check_tables,
    check_writable,
    describe,
)

__all__ = ["apply_rotary_qk_and_cache"]

# The public function's arguments, named in a DTensor's refusal (dtensor_inputs.check_no_dtensor).
_ARGUMENTS = ("q", "k", "v", "cos", "sin", "k_cache", "v_cache", "slot_mapping", "positions", "offsets",
              "cu_seqlens", "k_scale", "v_scale")  # fmt: skip

# The op's launch-plan gate (ropekit.backends.plan.gate): its arguments in the order its plans' runs take. A
# scale (k_scale$ / v_scale$) is a tensor (its values checked by the plan's run) or a number (its value in
# the key: the checked path proved it).
_launch_planned = gate(
    "apply_rotary_qk_and_cache",
    "q? k v cos sin k_cache v_cache slot_mapping positions? offsets# cu_seqlens? k_scale$ v_scale$",
    "cache_layout:str interleaved:bool inplace:bool backend:str",
)


def apply_rotary_qk_and_cache(
    q: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache_layout: str = "nhd",
    positions: torch.Tensor | None = None,
    offsets: int | torch.Tensor = 0,
    cu_seqlens: torch.Tensor | None = None,
    interleaved: bool = False,
    inplace: bool = False,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor | None:
    """Rotate q, rotate k into the key cache and copy v into the value cache, in one pass.

    Shape notation: T packed tokens, B batch, S sequence, Hq / Hk query / key heads, D head_dim, Dv v's
    head_dim, P pages, N page_size.

    Args:
        q: (T, Hq, D) packed (with cu_seqlens, or positions (T,), or an int offset), or (B, S, Hq, D); or
            None to write the caches only (then nothing is returned).
        k: (T, Hk, D) or (B, S, Hk, D), like q; read, never modified.
        v: (T, Hk, Dv) or (B, S, Hk, Dv); read, never modified.
        cos, sin: (L, R/2) tables, as in :func:`ropekit.apply_rotary`.
        k_cache, v_cache: written in place at the slots, in ``cache_layout``: "flat" (P*N, Hk, D), "nhd"
            (P, N, Hk, D) or "hnd" (P, Hk, N, D) (v_cache with Dv). Their dtype is q's, or an FP8 dtype
            (``torch.float8_e4m3fn`` / ``float8_e5m2``) with k_scale / v_scale.
        slot_mapping: int64 (T,) or (B, S): each token's flat slot ``page * page_size + index_in_page``;
            -1 skips the token (padding), as in vLLM. Distinct: a slot twice is an error (two tokens
            written to one slot race on a parallel backend); -1 may repeat.
        cache_layout: "flat", "nhd" or "hnd"; always explicit, never guessed from the shapes.
        positions, offsets, cu_seqlens, interleaved: as in :func:`ropekit.apply_rotary`.
        inplace: rotate q in place and return it; otherwise q is untouched and a new tensor is returned.
        k_scale, v_scale: FP8 caches only: stored = value / scale (dequantise by multiplying), a float, a 0-d
            tensor or one per head (Hk,); see :func:`ropekit.apply_rotary_qk_fp8` for the rounding contract.
        backend: "auto", "torch", "cpu" or "triton".

    Returns:
        q rotated (q itself when inplace=True); None when q is None.

    Raises:
        ValueError: before anything is written, for: inputs that require grad (inference only), shapes that
            disagree, a cache of the wrong layout, shape, dtype or device, a slot outside [-1, num_slots)
            or given twice (on the host for CPU tensors; a device-side assert otherwise), a missing,
            misshaped or non-positive scale, a written tensor (q in place, the caches) that shares memory
            with another written or read one, or a backend that cannot serve the inputs.
    """
    out, key = _launch_planned(
        q, k, v, cos, sin, k_cache, v_cache, slot_mapping, positions, offsets, cu_seqlens, k_scale, v_scale,
        cache_layout=cache_layout, interleaved=interleaved, inplace=inplace, backend=backend,
    )  # fmt: skip
    if out is not None:  # a decode step seen before: its launch plan (ropekit.fused.planned)
        return out
    # The plan's arguments: a scale given as a number is None there (its value is in the key).
    k_tensor = k_scale if type(k_scale) is torch.Tensor else None
    v_tensor = v_scale if type(v_scale) is torch.Tensor else None
    args = (q, k, v, cos, sin, k_cache, v_cache, slot_mapping, positions, offsets, cu_seqlens, k_tensor,
            v_tensor)  # fmt: skip
    check_inference("apply_rotary_qk_and_cache", q=q, k=k, v=v)
    check_no_dtensor(
        "apply_rotary_qk_and_cache", _ARGUMENTS,
        (q, k, v, cos, sin, k_cache, v_cache, slot_mapping, positions, offsets, cu_seqlens, k_scale, v_scale),
        "write each rank's cache with its local tensors (t.to_local())",
    )  # fmt: skip
    check_bool("interleaved", interleaved)
    check_bool("inplace", inplace)
    cache_only = q is None
    if cache_only:  # k stands in for q in the shape checks; nothing rotates into q
        if inplace:
            raise ValueError("inplace: expected False when q is None (there is no q to rotate in place)")
        if not isinstance(k, torch.Tensor):
            raise ValueError(f"k: expected a torch.Tensor, got {describe(k)}")
        q = k
    if isinstance(q, torch.Tensor) and q.dim() == 3 and cu_seqlens is None:
        # One packed sequence without cu_seqlens: (T, H, D) -> (1, T, H, D), its positions (T,) -> (1, T).
        if positions is not None and isinstance(positions, torch.Tensor) and positions.dim() == 1:
            positions = positions[None]
        views = [t[None] if isinstance(t, torch.Tensor) else t for t in (q, k, v)]
        slot_mapping = slot_mapping[None] if isinstance(slot_mapping, torch.Tensor) else slot_mapping
    else:
        views = [q, k, v]
    q4, k4, v4 = views
    pos = resolve(q4, positions=positions, offsets=offsets, cu_seqlens=cu_seqlens, name="q")
    if q4.dim() == 3:  # packed with cu_seqlens: the kernels see (1, T, H, D)
        q4, k4, v4 = (t[None] if isinstance(t, torch.Tensor) else t for t in (q4, k4, v4))
        slot_mapping = slot_mapping[None] if isinstance(slot_mapping, torch.Tensor) else slot_mapping
    batch, seq, _, head_dim = q4.shape
    for name, t in (("k", k4), ("v", v4)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or tuple(t.shape[:2]) != (batch, seq):
            raise ValueError(
                f"{name}: expected the same leading axes as q {tuple(q.shape)}, got {describe(t)}"
            )
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(
                f"{name}: expected q's dtype {q.dtype} on {q.device}, got {t.dtype} on {t.device}"
            )
    if k4.shape[3] != head_dim:
        raise ValueError(f"k: expected q's head_dim {head_dim}, got shape {tuple(k.shape)}")
    k_heads = k4.shape[2]
    if v4.shape[2] != k_heads:
        raise ValueError(f"v: expected k's {k_heads} heads, got shape {tuple(v.shape)}")
    check_tables(cos, sin, head_dim)
    check_movable("cos", cos, q.device, where="q's device")
    check_movable("sin", sin, q.device, where="q's device")
    if cos.device != q.device:
        cos, sin = cos.to(q.device), sin.to(q.device)
    pos.check_table(cos.shape[0])
    kc = cache_view("k_cache", k_cache, cache_layout, k_heads, head_dim, q.dtype, q.device)
    vc = cache_view("v_cache", v_cache, cache_layout, k_heads, v4.shape[3], q.dtype, q.device)
    if kc.shape[:2] != vc.shape[:2]:
        raise ValueError(
            f"v_cache: expected k_cache's pages and page size {tuple(kc.shape[:2])}, got shape "
            f"{tuple(v_cache.shape)}"
        )
    scales = [
        check_scale(name, scale, k_heads, q.device) if cache_takes_scale(name, cache, scale) else None
        for name, cache, scale in (("k_scale", k_cache, k_scale), ("v_scale", v_cache, v_scale))
    ]
    slots = check_slots("slot_mapping", slot_mapping, (batch, seq), q.device)
    if inplace:
        check_in_place_allowed("q", q)
        check_writable("q", q)
    # The memory rule: q (in place), k_cache and v_cache share memory with nothing the call reads (a cache
    # holding k's own memory would be written while k is read: issue 24, repro 2) nor with each other.
    check_no_alias(
        (("q", q if inplace else None), ("k_cache", k_cache), ("v_cache", v_cache)),
        (("q", None if cache_only else q), ("k", k), ("v", v), ("cos", cos), ("sin", sin),
         ("positions", positions), ("offsets", offsets), ("cu_seqlens", cu_seqlens),
         ("slot_mapping", slot_mapping), ("k_scale", k_scale), ("v_scale", v_scale)),
        optional=False,
    )  # fmt: skip
    name = select_backend(backend, q4, cos, op="fused", widest=max(head_dim, v4.shape[3])).name
    rows = None if pos.tensor is None else pos.tensor.reshape(-1).contiguous()  # (B * S,)
    q_out = None if cache_only or inplace else torch.empty_like(q)
    launch_args = (k, v, cos, sin, rows, pos.offset, slots, k_cache, v_cache, cache_layout, interleaved,
                   scales[0], scales[1], name)  # fmt: skip
    if plain_eager(q):
        launch = _launch(None if cache_only else q, q if inplace else q_out, *launch_args, checked=True)
        if key is not None:  # plan the next call like this one
            keep(key, None if cache_only else cache_plan(name, launch, *args, inplace))
    elif inplace:  # traced: the registered op, one node of a compiled graph
        _OP_(q, *launch_args)
    else:
        _OP(None if cache_only else q, q_out, *launch_args)
    return q if inplace else q_out


_ARGS = (
    "Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor? positions, SymInt offset, Tensor slot_mapping, "
    "Tensor(a!) k_cache, Tensor(b!) v_cache, str cache_layout, bool interleaved, Tensor? k_scale, "
    "Tensor? v_scale, str backend"
)


def _launch(q, q_out, k, v, cos, sin, positions, offset, slots, k_cache, v_cache, cache_layout, interleaved,
            k_scale, v_scale, backend, *, checked: bool) -> FusedLaunch:  # fmt: skip
    """Rotate q into q_out (q itself: in place; None with q None: the caches only), k into k_cache, copy v
    into v_cache. checked=True: the public call checked everything; False (the registered ops): the kernel
    wall and the memory rule are checked here, the kernels check table rows and slots."""
    impl = named_backend(backend, "fused", None if checked else k.device)
    if not checked:  # a registered op called directly: the public call's memory rule and distinct slots
        if q_out is not None:
            check_writable("q_out", q_out)
        out_name = "q" if q_out is q else "q_out"  # in place: q is read as its own source
        check_no_alias(
            ((out_name, q_out), ("k_cache", k_cache), ("v_cache", v_cache)),
            (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin), ("positions", positions),
             ("slot_mapping", slots), ("k_scale", k_scale), ("v_scale", v_scale)),
            optional=False,
        )  # fmt: skip
        check_distinct_slots("slot_mapping", slots)
        if positions is not None:
            check_offsets_beside_positions(offset)
    q4, k4, v4, out4 = (t if t is None or t.dim() == 4 else t[None] for t in (q, k, v, q_out))  # (1, T, H, D)
    sources = [
        t if t is None or t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous() for t in (q4, k4, v4)
    ]
    scratch = out4 if out4 is None or out4.shape[-1] <= 1 or out4.stride(-1) == 1 else torch.empty_like(q4)
    if checked:  # the public call checked both caches (cache_view)
        views = [pages(k_cache, cache_layout), pages(v_cache, cache_layout)]
    else:
        views = [paged_view("k_cache", k_cache, cache_layout), paged_view("v_cache", v_cache, cache_layout)]
        for name, cache, scale in (("k_scale", k_cache, k_scale), ("v_scale", v_cache, v_scale)):
            if cache_takes_scale(name, cache, scale):  # the public call's scale rule, form and values
                check_kernel_scale(name, scale, k.shape[-2] if k.dim() > 1 else 1, k.device)
    kinds = [fp8_kind(c.dtype) for c in (k_cache, v_cache)]
    kc, vc = (view.view(torch.uint8) if kind else view for view, kind in zip(views, kinds, strict=True))
    batch, seq = k4.shape[:2]
    launch = FusedLaunch(
        batch, seq, cos, sin, positions, offset, slots, interleaved, False,
        (
            None if q is None else Channel(sources[0], scratch, rotate=True, by_slot=False),
            Channel(sources[1], kc, rotate=True, by_slot=True, fp8=kinds[0], scale=k_scale),
            Channel(sources[2], vc, rotate=False, by_slot=True, fp8=kinds[1], scale=v_scale),
        ),
    )  # fmt: skip
    written = [k_cache, v_cache] if q_out is None else [q_out, k_cache, v_cache]
    impl.launch_fused(launch, checked=checked, written=written if checked else ())
    if scratch is not out4:  # a strided last axis: rotated in a scratch copy
        out4.copy_(scratch)
    return launch


def _fake(*args) -> None:
    pass


def _inference_only(q, k, v) -> None:
    """The ops' check of the caller's grad mode (kernel_op.register_op): inference only, as the function."""
    check_inference("apply_rotary_qk_and_cache", q=q, k=k, v=v)


# torch.ops.ropekit.rotary_qk_and_cache(q, q_out, k, ...): q rotated into q_out (both None: the caches only);
# torch.ops.ropekit.rotary_qk_and_cache_(q, k, ...): q in place. Both write the caches.
_OP = register_op(
    "rotary_qk_and_cache",
    lambda *args: _launch(*args, checked=False) and None,
    _fake,
    mutates_args=("q_out", "k_cache", "v_cache"),
    schema=f"(Tensor? q, Tensor(c!)? q_out, {_ARGS}) -> ()",
    guard=lambda q, q_out, k, v, *rest: _inference_only(q, k, v),
)
_OP_ = register_op(
    "rotary_qk_and_cache_",
    lambda q, *args: _launch(q, q, *args, checked=False) and None,
    _fake,
    mutates_args=("q", "k_cache", "v_cache"),
    schema=f"(Tensor(c!) q, {_ARGS}) -> ()",
    guard=lambda q, k, v, *rest: _inference_only(q, k, v),
)
