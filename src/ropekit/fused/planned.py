"""Launch plans of the serving fusions: a repeated :func:`~ropekit.apply_rotary_qk_and_cache`,
:func:`~ropekit.apply_rotary_qk_fp8` or :func:`~ropekit.qk_norm_rotary_` decode step goes through the one
gate (:func:`ropekit.backends.plan.gate`: its key, one lookup), the value checks that cannot be planned,
and one call of the C loop (two in the FP8 op's MLA form).

The first call of a kind takes the checked path (every argument checked, the backend chosen, one
:class:`~ropekit.backends.fused_launch.FusedLaunch` built); once it has served, :func:`cache_plan` (or
:func:`fp8_plan`, :func:`qk_norm_plan`) gives the plan kept for its key: the C loop with every integer of
the launch packed (:func:`ropekit.backends.c.fused.plan`), or None when no plan serves that kind.
A later call with the same key runs the plan after the checks that depend on values:

* rows: an int offset against the table (integer arithmetic here); per-sequence offsets and slots against the
  table and the cache, and slots given twice, by the C loop itself, before it writes anything;
* memory: every written tensor (the caches, and q in place) against the others, by their byte ranges (for
  the cache write, by the C loop itself before it writes), and exactly
  (:func:`ropekit.validation.shares_memory`) where the ranges meet (QK-norm writes qkv alone, whose own
  layout the key holds).

A plan never changes an answer: the key holds every fact a check relied on (shape, stride, dtype and device of
each tensor; the layout, the flags, the backend name); any value check that fails (a row past the table, a
slot outside the cache, shared memory) sends the call down the checked path, which raises the error it
always raised, with nothing written. Calls that trace or record autograd history, and cache writes that take
positions, cu_seqlens or FP8 scales, or write the caches only, never use a plan.
"""

from __future__ import annotations

import math

import torch

from ropekit.backends.c import fused as fused_cpu
from ropekit.backends.c import qk_norm as qk_norm_cpu
from ropekit.backends.fused_launch import FusedLaunch
from ropekit.backends.plan import MAX_PLANS, span
from ropekit.validation import shares_memory

__all__ = ["cache_plan", "fp8_plan", "qk_norm_plan", "shift_plan"]


def _pairs(written: tuple[int, ...], count: int) -> tuple[tuple[int, int], ...]:
    """(written, other) index pairs whose memory a call checks: every written tensor against every other
    tensor of the call (each pair of written tensors once); the memory rule of docs/safety.md."""
    pairs = []
    for w in written:
        pairs += [(w, o) for o in range(count) if o != w and not (o in written and o < w)]
    return tuple(pairs)


def _plannable(x, others, cos, sin, offsets, batch) -> bool:
    """Whether a plan could serve calls like this one (asked once per key): every tensor on x's device, a
    float32 table of unit stride (the launch converts any other), x 4-D (or (B, S, W)) with elements, and
    per-sequence offsets an int64 (batch,) contiguous tensor (the launch converts any other)."""
    tensors = (*others, cos, sin) if type(offsets) is int else (*others, cos, sin, offsets)
    return (
        all(t.device == x.device for t in tensors)
        and all(t.dtype == torch.float32 and t.stride(-1) == 1 for t in (cos, sin))
        and x.numel() > 0
        and all(t.numel() > 0 for t in others)
        and (type(offsets) is int or (offsets.dtype == torch.int64 and offsets.shape == batch
                                      and offsets.is_contiguous()))
    )  # fmt: skip


def cache_plan(backend: str, like: FusedLaunch, q, k, v, cos, sin, k_cache, v_cache, slot_mapping, positions,
               offsets, cu_seqlens, k_scale, v_scale, inplace: bool):  # fmt: skip
    """The plan of a call the checked path served with ``like`` (its launch) on backend:
    ``run(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, positions, offsets, cu_seqlens, k_scale,
    v_scale)`` (the gate's arguments) -> q rotated, or None. None when no plan serves its kind: another
    backend than the C loop, an input the launch copied, a 3-D q, positions, cu_seqlens, scales, no q."""
    units = q is not None and all(t.shape[-1] <= 1 or t.stride(-1) == 1 for t in (q, k, v))
    if (
        backend != "cpu"
        or not units
        or q.dim() != 4
        or positions is not None
        or cu_seqlens is not None
        or k_scale is not None
        or v_scale is not None
        or not slot_mapping.is_contiguous()  # the checked path copies it; the plan reads it where it lies
        or not _plannable(q, (k, v, k_cache, v_cache, slot_mapping), cos, sin, offsets, q.shape[:1])
    ):
        return None
    return _cache_plan(like, q, k, v, k_cache, v_cache, offsets, inplace)


def _cache_plan(like: FusedLaunch, q, k, v, k_cache, v_cache, offsets, inplace: bool):
    """The run of one key: the value checks that cannot be planned, then the C loop (see the module doc).

    The memory rule's byte ranges are checked by the C loop itself, before anything else (its spans and pairs
    are this key's constants); where two ranges meet it writes nothing and answers MEETS, and the run decides
    exactly here, then launches again without the range check. A key whose ranges met once (views of one
    packed qkv buffer) decides here first from then on."""
    seq = q.shape[1]
    last_offset = like.cos.shape[0] - seq  # an int offset's rows offset .. offset + seq - 1 fit the table
    steps = None if seq == 1 else torch.arange(seq, device=q.device)  # (seq,): per-sequence rows
    # (q, k, v, k_cache, v_cache, cos, sin, slot_mapping[, offsets]): q in place and the caches are written.
    spans = tuple(span(t) for t in (q, k, v, k_cache, v_cache, like.cos, like.sin, like.slots))
    per_sequence = type(offsets) is not int
    spans += (span(offsets),) if per_sequence else ()
    pairs = _pairs((0, 3, 4) if inplace else (3, 4), len(spans))
    # Each tensor's pointer word in the C loop's launch (fused_cpu.plan): q's source, k's, v's, the caches,
    # cos, sin, the slots, and the offsets (word 14, which the loop reads for this check alone).
    words = (4, 7, 10, 8, 11, 0, 1, 3, 14)
    memory = tuple((words[a], words[b]) for a, b in pairs), {words[a]: spans[a] for a in range(len(spans))}
    c_loop = fused_cpu.plan(like, memory)
    shared: dict[tuple[int, int, int], bool] = {}  # (written, other, byte distance) -> share an element
    meets = fused_cpu.MEETS
    ranges_met = False  # whether this key's ranges have met (then they are decided here first)
    increment_version = torch._C._increment_version

    def run(q, k, v, cos, sin, k_cache, v_cache, slots, positions, offsets, cu_seqlens, k_scale, v_scale):
        nonlocal ranges_met
        q_inference = inplace and q.is_inference()  # q is the tensor written (q_out) in place
        if q_inference and not torch.is_inference_mode_enabled():
            return None  # PyTorch refuses this write: the checked path says so
        if per_sequence:
            rows = offsets if steps is None else (offsets[:, None] + steps).view(-1)  # (batch * seq,)
            offsets_start = offsets.data_ptr()
            positions, offset = offsets_start if steps is None else rows.data_ptr(), 0
        elif 0 <= offsets <= last_offset:
            positions, offset, offsets_start = 0, offsets, 0
        else:
            return None
        q_start = q.data_ptr()
        q_out = q if inplace else torch.empty_like(q)
        pointers = (cos.data_ptr(), sin.data_ptr(), positions, slots.data_ptr(), q_start,
                    q_start if inplace else q_out.data_ptr(), 0, k.data_ptr(), k_cache.data_ptr(), 0,
                    v.data_ptr(), v_cache.data_ptr(), 0)  # fmt: skip
        code = meets if ranges_met else c_loop(pointers, offset, offsets_start)
        if code == meets:
            # Two spans meet (views of one buffer, as q, k and v of a packed projection): decided exactly,
            # once per distance (the key fixes everything else shares_memory reads).
            ranges_met = True
            p = pointers  # each tensor's start, in the order of spans (words)
            starts = (p[4], p[7], p[10], p[8], p[11], p[0], p[1], p[3], offsets_start)
            for a, b in pairs:
                if starts[a] < starts[b] + spans[b] and starts[b] < starts[a] + spans[a]:
                    meet = shared.get((a, b, starts[b] - starts[a]))
                    if meet is None:
                        tensors = (q, k, v, k_cache, v_cache, cos, sin, slots, offsets)
                        meet = shares_memory(tensors[a], tensors[b])
                        if len(shared) < MAX_PLANS:
                            shared[(a, b, starts[b] - starts[a])] = meet
                    if meet:
                        return None
            code = c_loop(pointers, offset, offsets_start, False)
        if code != -1:  # a row or slot out of range, nothing written: the checked path says which
            return None
        written = (q_out, k_cache, v_cache)
        if not ((q_inference if inplace else q_out.is_inference()) or k_cache.is_inference()
                or v_cache.is_inference()):  # fmt: skip
            increment_version(written)
        else:
            increment_version(tuple(t for t in written if not t.is_inference()))
        return q_out

    return run


def fp8_plan(backend: str, launches: list[FusedLaunch], q, k, cos, sin, q_scale, k_scale, q_nope, k_nope,
             positions, offsets, cu_seqlens, fp8_dtype: torch.dtype):  # fmt: skip
    """The plan of an :func:`~ropekit.apply_rotary_qk_fp8` call the checked path served with ``launches``
    (its rope launch, then its nope launch in the MLA form) on backend: ``run(q, k, cos, sin, q_scale,
    k_scale, q_nope, k_nope, positions, offsets, cu_seqlens)`` (the gate's arguments; a scale given as a
    number is None there, its value is in the key) -> the FP8 outputs, or None. None when no plan serves its
    kind: another backend than the C loop, cu_seqlens, an input the launch copied or converted (a strided
    last axis, a table not float32, positions or a scale tensor not contiguous, positions not int64, a scale
    not float32), an empty q or k.

    The outputs are new tensors, so the memory rule has nothing to check (nothing the caller passed is
    written); the run checks the values a key cannot hold: an int offset against the table (positions and
    per-sequence offsets: the C loop, before it writes), and a scale tensor's values, finite and > 0
    (float32, as the checked path's :func:`~ropekit.fused.checks.check_scale`)."""
    nopes = () if q_nope is None else tuple(t for t in (q_nope, k_nope) if t.numel())  # the parts written
    tensor_scales = tuple(s for s in (q_scale, k_scale) if s is not None)
    q4 = q if q.dim() == 4 else q[None]
    if (
        backend != "cpu"
        or cu_seqlens is not None
        or q.dim() not in (3, 4)
        or len(launches) != 1 + bool(nopes)
        or not all(t.shape[-1] <= 1 or t.stride(-1) == 1 for t in (q, k, *nopes))
        or not all(s.dtype == torch.float32 and s.is_contiguous() for s in tensor_scales)
        or not _plannable(q4, (k, *nopes, *tensor_scales), cos, sin, 0 if positions is not None else offsets,
                          q4.shape[:1])
        or (positions is not None and not (positions.dtype == torch.int64 and positions.is_contiguous()
                                           and positions.device == q.device))
    ):  # fmt: skip
        return None
    like = launches[0]
    rope_loop = fused_cpu.plan(like)
    nope_loop = fused_cpu.plan(launches[1]) if nopes else None
    # The scales the checked path made of numbers ((1,) float32 tensors, kept alive here), by channel.
    made = [
        ch.scale if s is None else None for ch, s in zip(like.channels[:2], (q_scale, k_scale), strict=True)
    ]
    per_head = tuple(s is not None and s.numel() > 1 for s in (q_scale, k_scale))
    seq = like.seq
    given = positions is not None  # positions: the rows themselves (offsets must be 0)
    per_sequence = not given and type(offsets) is not int
    last_offset = like.cos.shape[0] - seq  # an int offset's rows offset .. offset + seq - 1 fit the table
    steps = None if seq == 1 else torch.arange(seq, device=q.device)  # (seq,): per-sequence rows
    empty, inf = torch.empty, math.inf

    def run(q, k, cos, sin, q_scale, k_scale, q_nope, k_nope, positions, offsets, cu_seqlens):
        if given:
            if type(offsets) is not int or offsets != 0:
                return None  # positions with offsets: the checked path refuses them
            row_pointer, offset = positions.data_ptr(), 0
        elif per_sequence:
            rows = offsets if steps is None else (offsets[:, None] + steps).view(-1)  # (batch * seq,)
            row_pointer, offset = rows.data_ptr(), 0
        elif 0 <= offsets <= last_offset:
            row_pointer, offset = 0, offsets
        else:
            return None  # a row past the table: the checked path says which
        # A scale tensor's values, as check_scale checks them (float32 here): finite and > 0. min() sees a
        # value <= 0 (or -inf); sum() is nan or inf when any value is (float64: no overflow of float32s).
        if q_scale is None:
            q_ptr = made[0].data_ptr()
        else:
            q_values = q_scale.tolist() if per_head[0] else (q_scale.item(),)
            if not (0 < min(q_values) and sum(q_values) < inf):
                return None
            q_ptr = q_scale.data_ptr()
        if k_scale is None:
            k_ptr = made[1].data_ptr()
        else:
            k_values = k_scale.tolist() if per_head[1] else (k_scale.item(),)
            if not (0 < min(k_values) and sum(k_values) < inf):
                return None
            k_ptr = k_scale.data_ptr()
        q_out = empty(q.shape, dtype=fp8_dtype, device=q.device)
        k_out = empty(k.shape, dtype=fp8_dtype, device=k.device)
        table = (cos.data_ptr(), sin.data_ptr(), row_pointer, 0)
        pointers = (*table, q.data_ptr(), q_out.data_ptr(), q_ptr, k.data_ptr(), k_out.data_ptr(), k_ptr,
                    0, 0, 0)  # fmt: skip
        if rope_loop(pointers, offset) != -1:  # a row outside the table, nothing written: the checked path
            return None
        if q_nope is None:
            return q_out, k_out
        q_nope_out = empty(q_nope.shape, dtype=fp8_dtype, device=q.device)
        k_nope_out = empty(k_nope.shape, dtype=fp8_dtype, device=q.device)
        if nope_loop is not None:  # an empty part's channel is off: its pointers are not read
            pointers = (*table, q_nope.data_ptr(), q_nope_out.data_ptr(), q_ptr, k_nope.data_ptr(),
                        k_nope_out.data_ptr(), k_ptr, 0, 0, 0)  # fmt: skip
            nope_loop(pointers, offset)  # the same rows, checked by the first launch
        return q_out, k_out, q_nope_out, k_nope_out

    return run


def qk_norm_plan(backend: str, qkv, q_weight, k_weight, cos, sin, spec: qk_norm_cpu.NormSpec, positions,
                 offsets, cu_seqlens):  # fmt: skip
    """The plan of a call the checked path served on backend: ``run(qkv, q_weight, k_weight, cos, sin,
    positions, offsets, cu_seqlens)`` (the gate's arguments) -> qkv, or None; None when no plan serves its
    kind (another backend than the C loop, cu_seqlens, an input the launch would convert)."""
    weights = (q_weight, k_weight)
    if (
        backend != "cpu"
        or cu_seqlens is not None
        or qkv.dim() not in (2, 3)
        or not all(w.dtype == torch.float32 and w.is_contiguous() for w in weights)
        or not _plannable(qkv, weights, cos, sin, offsets, qkv.shape[:1] if qkv.dim() == 3 else (1,))
        or (positions is not None and not (positions.dtype == torch.int64 and positions.is_contiguous()
                                           and positions.device == qkv.device))
    ):  # fmt: skip
        return None
    view = qkv if qkv.dim() == 3 else qkv.unsqueeze(0)  # (B, S, W)
    c_loop = qk_norm_cpu.plan(view, cos, sin, spec)
    seq = view.shape[1]
    per_sequence = positions is None and type(offsets) is not int
    last_offset = cos.shape[0] - seq  # an int offset's rows offset .. offset + seq - 1 fit the table
    steps = None if seq == 1 else torch.arange(seq, device=qkv.device)  # (seq,): per-sequence rows
    increment_version = torch._C._increment_version
    qkv_span, table_span = span(qkv), span(cos)

    def run(qkv, q_weight, k_weight, cos, sin, positions, offsets, cu_seqlens):
        if positions is not None and offsets != 0:
            return None  # positions and offsets together: the checked path refuses them
        if cos.requires_grad or sin.requires_grad:
            return None  # refused in any grad mode (constants to qk_norm_rotary_): the checked path says so
        if qkv.is_inference() and not torch.is_inference_mode_enabled():
            return None  # PyTorch refuses this write: the checked path says so
        # The memory rule: qkv (written) meets nothing it reads; where byte ranges meet, the checked path
        # decides exactly. The key holds every read tensor's layout: weights, positions and offsets are
        # contiguous here.
        lo = qkv.data_ptr()
        hi = lo + qkv_span
        rows_read = positions if positions is not None else offsets if per_sequence else None
        for t, size in ((q_weight, 0), (k_weight, 0), (cos, table_span), (sin, table_span), (rows_read, 0)):
            if t is not None:
                start = t.data_ptr()
                if start < hi and lo < start + (size or t.numel() * t.element_size()):
                    return None
        if positions is not None:
            rows, offset = positions.data_ptr(), 0
        elif per_sequence:
            rows = (offsets if steps is None else (offsets[:, None] + steps).view(-1)).data_ptr()
            offset = 0
        elif 0 <= offsets <= last_offset:
            rows, offset = None, offsets
        else:
            return None
        pointers = (qkv.data_ptr(), q_weight.data_ptr(), k_weight.data_ptr(), cos.data_ptr(), sin.data_ptr())
        code = c_loop(*pointers, rows, offset)
        if code != -1:  # a row outside the table, nothing written: the checked path says which
            return None
        if not qkv.is_inference():
            increment_version((qkv,))
        return qkv

    return run


def shift_plan(backend: str, like: FusedLaunch, k_cache, cos, sin, delta, slots):
    """The plan of a :func:`~ropekit.shift_cache_` call the checked path served with ``like`` (its launch) on
    backend: ``run(k_cache, cos, sin, delta, slots)`` (the gate's arguments) -> k_cache, or None. None when no
    plan serves its kind: another backend than the C loop, a table the launch converts (not float32, a
    strided last axis), tables or slots on another device, slots not contiguous, no slot.

    The launch reads one table row, |delta|, for every slot (a table of row stride 0); the run points the
    loop at that row of this call's table, with the rotation conjugated when delta < 0 (a second packed
    loop: the key holds delta's type, never its sign). It checks what the key cannot hold: |delta| against
    the table, the cache against the tables and slots it reads (byte ranges; where they meet the checked path
    decides exactly), an inference cache outside inference mode; the C loop checks the slots (in the cache,
    none twice) before it writes."""
    if (
        backend != "cpu"
        or like.batch * like.seq == 0
        or k_cache.numel() == 0
        or (slots is not None and not (slots.is_contiguous() and slots.device == k_cache.device))
        or not all(
            t.dtype == torch.float32 and t.stride(-1) == 1 and t.device == k_cache.device for t in (cos, sin)
        )
    ):
        return None
    loops = fused_cpu.plan(like._replace(conjugate=False)), fused_cpu.plan(like._replace(conjugate=True))
    table_len, row_bytes = cos.shape[0], cos.stride(0) * cos.element_size()  # sin: the key holds its stride
    sin_row_bytes = sin.stride(0) * sin.element_size()
    cache_span, cos_span, sin_span = span(k_cache), span(cos), span(sin)
    slots_span = 0 if slots is None else span(slots)
    increment_version = torch._C._increment_version

    def run(k_cache, cos, sin, delta, slots):
        if not -table_len < delta < table_len:
            return None  # |delta| past the table: the checked path says so
        inference = k_cache.is_inference()
        if inference and not torch.is_inference_mode_enabled():
            return None  # PyTorch refuses this write: the checked path says so
        lo = k_cache.data_ptr()
        hi, cos_lo, sin_lo = lo + cache_span, cos.data_ptr(), sin.data_ptr()
        slots_lo = 0 if slots is None else slots.data_ptr()
        if (
            (cos_lo < hi and lo < cos_lo + cos_span)
            or (sin_lo < hi and lo < sin_lo + sin_span)
            or (slots_span and slots_lo < hi and lo < slots_lo + slots_span)
        ):
            return None  # the cache's bytes meet a table's or the slots': the checked path decides
        row = -delta if delta < 0 else delta
        pointers = (cos_lo + row * row_bytes, sin_lo + row * sin_row_bytes, 0, slots_lo, 0, 0, 0, 0, lo, 0,
                    0, 0, 0)  # fmt: skip
        if loops[delta < 0](pointers, 0) != -1:  # a slot outside the cache or given twice: nothing written
            return None
        if not inference:
            increment_version((k_cache,))
        return k_cache

    return run
