"""Launch plans: a decode loop's steady state as one lookup, the data pointers and one kernel call.

A decode loop calls with the same shapes, strides, dtypes and flags every step; only the data and the int
offset change. The first call of a kind takes the checked path (:mod:`ropekit.functional`: every argument
checked, the backend chosen); once it has succeeded, :func:`remember` stores a plan for its key: the chosen
backend's launch with everything that depends on the key alone (strides, the packed kernel arguments, the
table bound) worked out. A later call with the same key runs the plan after the checks that depend on values
and addresses: the offset against the table and, in place, the memory rule (docs/safety.md) from this call's
data pointers: q and k may not meet the tables' bytes, nor share an element with each other.

A plan never changes an answer: every fact a check relied on is in the key (shape, stride, dtype and device
of q, k, cos and sin; the flags; the backend name), so a changed stride, shape or dtype misses and takes the
checked path. Calls that record autograd history, trace (torch.compile, dispatch modes, tensor subclasses) or
read positions from a tensor never use a plan.

Shape notation: B batch, S sequence, H heads, D head_dim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ropekit.validation import byte_extent, shares_memory

__all__ = ["Plan", "clear_plans", "keep", "known", "launch_planned", "lookup", "remember", "span"]

# run(q, k, cos, sin, offset) -> (q_out, k_out): the launch with the key's facts bound in.
Run = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
# Plans kept before the cache starts over: a process sees a handful of (shape, layout) kinds; a workload
# whose shapes never repeat (variable-length prefill) must not grow this without bound.
MAX_PLANS = 256


class Plan(NamedTuple):
    """One key's launch. ``last_offset``: the largest int offset whose rows fit the table (table_len - S).
    For per-sequence offsets ``last_offset`` is unused: the kernel checks each row.
    ``spans``: in place, the bytes from the first to the last byte of q, k (0 without k), cos, sin and the
    per-sequence offsets (-1 for an int offset), which the key fixes; each call compares the byte ranges its
    pointers give. ``shared``: for in-place q and k
    whose ranges meet, whether they share an element, per byte distance k - q: the key fixes both layouts,
    so the answer (decided from addresses, :func:`~ropekit.validation.shares_memory`) is a function of the
    distance alone, whichever storages the tensors belong to."""

    run: Run
    last_offset: int
    spans: tuple[int, int, int, int, int] | None
    shared: dict[int, bool]


_plans: dict[tuple, Plan | None] = {}  # None: the key's backend has no plan for it
# The one cache serves every op: another op's key starts with its name (ropekit.fused.planned), and its plan
# is that op's own run. lookup(key): the plan or None; known(key): planned already, or known to have none.
lookup = _plans.get
known = _plans.__contains__


def clear_plans() -> None:
    """Forget every plan (with the backend choices: :func:`ropekit.backends.clear_backend_cache`)."""
    _plans.clear()


def _key(q, k, cos, sin, offset, interleaved, inplace, backend, conjugate) -> tuple:
    if type(offset) is not int:  # a tensor of per-sequence offsets: its layout is part of the key
        layout = (offset.shape, offset.stride(), offset.dtype, offset.device)
        return (*_key(q, k, cos, sin, 0, interleaved, inplace, backend, conjugate), *layout)
    if k is None:
        return (q.shape, q.stride(), q.dtype, q.device, cos.shape, cos.stride(), cos.dtype, cos.device,
                sin.shape, sin.stride(), sin.dtype, sin.device, interleaved, inplace, backend,
                conjugate)  # fmt: skip
    return (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device, cos.shape,
            cos.stride(), cos.dtype, cos.device, sin.shape, sin.stride(), sin.dtype, sin.device, interleaved,
            inplace, backend, conjugate)  # fmt: skip


def _plain(q, k, cos, sin) -> bool:
    """Eager tensors no trace, mode or subclass is watching, and no autograd history to record."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    if type(q) is not torch.Tensor or type(cos) is not torch.Tensor or type(sin) is not torch.Tensor:
        return False
    if k is not None and type(k) is not torch.Tensor:
        return False
    needs_grad = (
        q.requires_grad or (k is not None and k.requires_grad) or cos.requires_grad or sin.requires_grad
    )
    return not (needs_grad and torch.is_grad_enabled())


def launch_planned(q, k, cos, sin, offset, interleaved, inplace, backend, conjugate, *, head_dim=None):
    """Run the plan for these arguments; None when there is none or a value check fails (the checked path
    then runs, and raises where it should).

    Args:
        q, k, cos, sin, interleaved, inplace, backend: as :func:`ropekit.apply_rotary_qk` takes them (k may be
            None).
        offset: an int, or a tensor of per-sequence offsets (the caller checked the type is exactly one of
            those); a tensor's values are checked by the kernel before it writes anything.
        conjugate: rotate by -theta (``inverse=True``).
        head_dim: a caller that serves one head width (a :class:`ropekit.RotaryEmbedding`) names it: a plan
            made elsewhere for a 4-D q of another width (partial rotary with a table of the same shape) then
            misses, and the caller's checked path raises. Read from the key, which holds q's shape already.
    """
    if (
        (interleaved is not True and interleaved is not False)
        or (inplace is not True and inplace is not False)
        or (conjugate is not True and conjugate is not False)
        or type(backend) is not str
        or not _plain(q, k, cos, sin)
    ):
        return None
    key = _key(q, k, cos, sin, offset, interleaved, inplace, backend, conjugate)
    if head_dim is not None and (len(key[0]) != 4 or key[0][3] != head_dim):  # key[0]: q.shape
        return None
    plan = _plans.get(key)
    if plan is None or (type(offset) is int and not 0 <= offset <= plan.last_offset):
        return None
    if plan.spans is not None:  # in place: the memory rule, from this call's addresses (docs/safety.md)
        inference = q.is_inference() or (k is not None and k.is_inference())
        if inference and not torch.is_inference_mode_enabled():
            return None  # PyTorch refuses this write: the checked path raises as it would, writing nothing
        q_span, k_span, cos_span, sin_span, offsets_span = plan.spans
        q_lo, cos_lo, sin_lo = q.data_ptr(), cos.data_ptr(), sin.data_ptr()
        if (cos_lo <= q_lo + q_span and q_lo <= cos_lo + cos_span) or (
            sin_lo <= q_lo + q_span and q_lo <= sin_lo + sin_span
        ):
            return None  # q's bytes meet a table's: the checked path decides, and raises
        if offsets_span >= 0:  # per-sequence offsets, read by the kernel as it writes
            off_lo = offset.data_ptr()
            if (off_lo <= q_lo + q_span and q_lo <= off_lo + offsets_span) or (
                k is not None and off_lo <= k.data_ptr() + k_span and k.data_ptr() <= off_lo + offsets_span
            ):
                return None
        if k is not None:
            k_lo = k.data_ptr()
            if (cos_lo <= k_lo + k_span and k_lo <= cos_lo + cos_span) or (
                sin_lo <= k_lo + k_span and k_lo <= sin_lo + sin_span
            ):
                return None
            if k_lo <= q_lo + q_span and q_lo <= k_lo + k_span:  # views of one buffer (packed qkv)
                distance = k_lo - q_lo
                shared = plan.shared.get(distance)
                if shared is None:
                    shared = shares_memory(q, k)
                    if len(plan.shared) < MAX_PLANS:
                        plan.shared[distance] = shared
                if shared:
                    return None
    return plan.run(q, k, cos, sin, offset)


def _span(t: torch.Tensor | None) -> int:
    return 0 if t is None else byte_extent(t)


def span(t: torch.Tensor) -> int:
    """Bytes from t's first element to one past its last (strides are never negative in torch)."""
    return byte_extent(t) + 1


def remember(impl, q, k, cos, sin, offset, interleaved, inplace, backend, conjugate) -> None:
    """Store the plan for a call that the checked path has just served with an int offset, or a tensor of
    per-sequence offsets (4-D q).

    ``impl`` is the backend it chose; a backend with a ``plan(q, k, cos, sin, *, interleaved, conjugate,
    inplace, per_sequence=False)`` method returns its own run (or None: no plan); any other gets its
    rotate_qk, flags bound (int offsets only).
    """
    if not _plain(q, k, cos, sin) or cos.device != q.device or q.dim() != 4 or q.numel() == 0:
        return
    if k is not None and k.numel() == 0:
        return
    key = _key(q, k, cos, sin, offset, interleaved, inplace, backend, conjugate)
    if key in _plans:  # planned already, or known to have no plan: a miss must not redo this every call
        return
    per_sequence = type(offset) is not int
    if per_sequence and not (
        offset.dtype == torch.int64
        and offset.shape == q.shape[:1]
        and offset.is_contiguous()
        and offset.device == q.device
    ):
        return
    make = getattr(impl, "plan", None)
    if make is not None:
        flags = dict(interleaved=interleaved, conjugate=conjugate, inplace=inplace)
        run = (
            make(q, k, cos, sin, **flags, per_sequence=True)
            if per_sequence
            else make(q, k, cos, sin, **flags)
        )
        if run is None:
            keep(key, None)  # the key alone decided it (layout, dtype): the checked path serves this kind
            return
    elif per_sequence:
        return
    else:

        def run(q, k, cos, sin, offset):
            return impl.rotate_qk(
                q,
                k,
                cos,
                sin,
                None,
                interleaved=interleaved,
                conjugate=conjugate,
                inplace=inplace,
                offset=offset,
            )

    offsets_span = byte_extent(offset) if per_sequence and offset.numel() else -1  # -1: no bytes to meet
    spans = (_span(q), _span(k), _span(cos), _span(sin), offsets_span) if inplace else None
    keep(key, Plan(run, cos.shape[0] - q.shape[1], spans, {}))


def keep(key: tuple, plan: object) -> None:
    """Store key's plan (None: the key has none), starting over past MAX_PLANS."""
    if len(_plans) >= MAX_PLANS:
        _plans.clear()
    _plans[key] = plan
