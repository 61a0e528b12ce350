"""Launch plans of the serving fusions: a repeated :func:`~ropekit.apply_rotary_qk_and_cache` decode step is
a key, one lookup in the launch-plan cache (:mod:`ropekit.backends.plan`), the value checks that cannot be
planned, and one call of the C loop.

The first call of a kind takes the checked path (every argument checked, the backend chosen, one
:class:`~ropekit.backends.fused_launch.FusedLaunch` built); once it has served, :func:`remember_cache` stores
the plan for its key: the C loop with every integer of the launch packed
(:func:`ropekit.backends.fused_cpu.plan`).
A later call with the same key runs the plan after the checks that depend on values:

* rows: an int offset against the table (integer arithmetic here); per-sequence offsets and slots against the
  table and the cache by the C loop itself, before it writes anything;
* memory: every written tensor (the caches, and q in place) against the others, by their byte ranges, and
  exactly (:func:`ropekit.validation._share_elements`) where the ranges meet.

A plan never changes an answer: the key holds every fact a check relied on (shape, stride, dtype and device of
each tensor; the layout, the flags, the backend name); any value check that fails (a row past the table, a
slot outside the cache, shared memory) sends the call down the checked path, which raises the error it
always raised, with nothing written. Calls that trace, record autograd history, take positions, cu_seqlens or
FP8 scales, or write the caches only, never use a plan.
"""

from __future__ import annotations

import torch

from ropekit.backends import fused_cpu
from ropekit.backends.fused_launch import FusedLaunch
from ropekit.backends.plan import keep, known, lookup, span
from ropekit.validation import _share_elements

__all__ = ["planned_cache", "remember_cache"]

# Pairs (written, other) of (q, k, v, k_cache, v_cache) whose memory a call checks: q is written in place.
Tensor = torch.Tensor
_IN_PLACE_PAIRS = ((0, 1), (0, 2), (0, 3), (0, 4), (3, 1), (3, 2), (3, 4), (4, 1), (4, 2))
_OUT_OF_PLACE_PAIRS = ((3, 0), (3, 1), (3, 2), (3, 4), (4, 0), (4, 1), (4, 2))


def planned_cache(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, cache_layout, positions, offsets,
                  cu_seqlens, interleaved, inplace, k_scale, v_scale, backend):  # fmt: skip
    """(q rotated by the call's plan, key) when a plan served it; (None, key) when the checked path must, and
    may remember its launch under key; (None, None) when no plan may serve a call like this one."""
    if (
        positions is not None
        or cu_seqlens is not None
        or k_scale is not None
        or v_scale is not None
        or type(q) is not Tensor
        or type(k) is not Tensor
        or type(v) is not Tensor
        or type(cos) is not Tensor
        or type(sin) is not Tensor
        or type(k_cache) is not Tensor
        or type(v_cache) is not Tensor
        or type(slot_mapping) is not Tensor
        or (interleaved is not True and interleaved is not False)
        or (inplace is not True and inplace is not False)
        or type(backend) is not str
        or type(cache_layout) is not str
        or torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack()
    ):
        return None, None
    if torch.is_grad_enabled() and (
        q.requires_grad
        or k.requires_grad
        or v.requires_grad
        or k_cache.requires_grad
        or v_cache.requires_grad
    ):
        return None, None
    if type(offsets) is int:
        layout = None
    elif type(offsets) is Tensor:
        layout = (offsets.shape, offsets.stride(), offsets.dtype, offsets.device)
    else:
        return None, None
    key = (
        "apply_rotary_qk_and_cache", q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype,
        k.device, v.shape, v.stride(), v.dtype, v.device, cos.shape, cos.stride(), cos.dtype, cos.device,
        sin.shape, sin.stride(), sin.dtype, sin.device, k_cache.shape, k_cache.stride(), k_cache.dtype,
        k_cache.device, v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device, slot_mapping.shape,
        slot_mapping.stride(), slot_mapping.dtype, slot_mapping.device, layout, cache_layout, interleaved,
        inplace, backend,
    )  # fmt: skip
    plan = lookup(key)
    if plan is None:
        return None, key
    return plan(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, offsets), key


def remember_cache(key, backend: str, like: FusedLaunch, q, k, v, k_cache, v_cache, offsets, inplace) -> None:
    """Store the plan for key after the checked path served it with ``like`` (its launch), or that key has
    none (another backend than the C loop, a table or input the launch converted, a 3-D q)."""
    if known(key):
        return
    units = all(t.shape[-1] <= 1 or t.stride(-1) == 1 for t in (q, k, v))
    per_sequence = type(offsets) is not int
    if (
        backend != "cpu"
        or not units
        or q.dim() != 4
        or q.numel() == 0
        or k.numel() == 0
        or like.cos.dtype != torch.float32
        or (
            per_sequence
            and not (
                offsets.dtype == torch.int64
                and offsets.shape == q.shape[:1]
                and offsets.is_contiguous()
                and offsets.device == q.device
            )
        )
    ):
        keep(key, None)  # the key alone decided it: the checked path serves this kind
        return
    keep(key, _cache_plan(like, q, k, v, k_cache, v_cache, per_sequence, inplace))


def _cache_plan(like: FusedLaunch, q, k, v, k_cache, v_cache, per_sequence: bool, inplace: bool):
    """The run of one key: the value checks that cannot be planned, then the C loop (see the module doc)."""
    c_loop = fused_cpu.plan(like)
    seq = q.shape[1]
    last_offset = like.cos.shape[0] - seq  # an int offset's rows offset .. offset + seq - 1 fit the table
    steps = None if seq == 1 else torch.arange(seq, device=q.device)  # (seq,): per-sequence rows
    spans = tuple(span(t) for t in (q, k, v, k_cache, v_cache))
    pairs = _IN_PLACE_PAIRS if inplace else _OUT_OF_PLACE_PAIRS
    increment_version = torch._C._increment_version

    def run(q, k, v, cos, sin, k_cache, v_cache, slots, offsets):
        if per_sequence:
            rows = offsets if steps is None else (offsets[:, None] + steps).view(-1)  # (batch * seq,)
            positions, offset = rows.data_ptr(), 0
        elif 0 <= offsets <= last_offset:
            positions, offset = 0, offsets
        else:
            return None
        starts = (q.data_ptr(), k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr())
        for a, b in pairs:
            if starts[a] < starts[b] + spans[b] and starts[b] < starts[a] + spans[a]:
                tensors = (q, k, v, k_cache, v_cache)
                if _share_elements(tensors[a], tensors[b]):
                    return None
        q_out = q if inplace else torch.empty_like(q)
        code = c_loop(
            (cos.data_ptr(), sin.data_ptr(), positions, slots.data_ptr(), starts[0], q_out.data_ptr(), 0,
             starts[1], starts[3], 0, starts[2], starts[4], 0),
            offset,
        )  # fmt: skip
        if code != -1:  # a row or slot out of range, nothing written: the checked path says which
            return None
        written = (q_out, k_cache, v_cache)
        if not (q_out.is_inference() or k_cache.is_inference() or v_cache.is_inference()):
            increment_version(written)
        else:
            increment_version(tuple(t for t in written if not t.is_inference()))
        return q_out

    return run
