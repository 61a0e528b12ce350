"""Launch plans of the serving fusions: a repeated :func:`~ropekit.apply_rotary_qk_and_cache`,
:func:`~ropekit.apply_rotary_qk_fp8`, :func:`~ropekit.qk_norm_rotary_` or :func:`~ropekit.shift_cache_` call
goes through the one gate (:func:`ropekit.backends.plan.gate`: its key, one lookup), the value checks that
cannot be planned, and one call of the C loop (two in the FP8 op's MLA form).

The first call of a kind takes the checked path (every argument checked, the backend chosen, one
:class:`~ropekit.backends.fused_launch.FusedLaunch` built); once it has served, :func:`cache_plan` (or
:func:`fp8_plan`, :func:`qk_norm_plan`, :func:`shift_plan`) gives the plan kept for its key: the C loop with
every integer of the launch packed (:func:`ropekit.backends.c.fused.plan`), or None when no plan serves that
kind. A later call with the same key runs the plan after the checks that depend on values:

* rows: an int offset (the shift's |delta|) against the table (integer arithmetic here); cu_seqlens' values
  (from 0, non-decreasing, to the tokens) and a packed batch's rows, worked out here as the checked path
  resolves them; positions, per-sequence offsets, packed rows and slots against the table and the cache, and
  slots given twice, by the C loop itself, before it writes anything;
* scales: a scale tensor's values, finite and > 0 (a number's value is in the key);
* memory: every written tensor (the caches, and q in place) against the others, by their byte ranges (for
  the cache write, by the C loop itself before it writes), and exactly
  (:func:`ropekit.validation.shares_memory`) where the ranges meet (QK-norm writes qkv alone, whose own
  layout the key holds; the shift's cache against its tables and slots: where those ranges meet, the checked
  path decides);
* an inference tensor written outside inference mode (PyTorch refuses the write): the checked path says so.

A plan never changes an answer: the key holds every fact a check relied on (shape, stride, dtype and device of
each tensor; the layout, the flags, the backend name); any value check that fails (a row past the table, a
slot outside the cache, shared memory) sends the call down the checked path, which raises the error it
always raised, with nothing written. Calls that trace or record autograd history, inputs the checked path
would copy or convert (a table not float32, positions not int64, a strided last axis or slot_mapping, a scale
tensor not float32), backends other than the C loop, and cache writes without q never use a plan.
"""

from __future__ import annotations

import math
import operator

import numpy as np
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
    v_scale)`` (the gate's arguments: a scale given as a number reaches the run as it is, its value in the
    key; here, None) -> q rotated, or None. None when no plan serves its kind: another backend than the C
    loop, an input the launch copied or converted (a strided last axis, a table not float32, slots, positions,
    cu_seqlens or a scale tensor not contiguous, positions or per-sequence offsets not int64, a scale not
    float32), no q."""
    scales = tuple(s for s in (k_scale, v_scale) if s is not None)
    units = q is not None and all(t.shape[-1] <= 1 or t.stride(-1) == 1 for t in (q, k, v))
    sequences = like.batch if cu_seqlens is None else cu_seqlens.shape[0] - 1  # offsets: one per sequence
    if (
        backend != "cpu"
        or not units
        or q.dim() not in (3, 4)
        or not slot_mapping.is_contiguous()  # the checked path copies it; the plan reads it where it lies
        or not all(s.dtype == torch.float32 and s.is_contiguous() for s in scales)
        or not all(t is None or (t.is_contiguous() and t.device == q.device) for t in (positions, cu_seqlens))
        or (positions is not None and positions.dtype != torch.int64)
        or not _plannable(q, (k, v, k_cache, v_cache, slot_mapping, *scales), cos, sin,
                          0 if positions is not None else offsets, (sequences,))
    ):  # fmt: skip
        return None
    return _cache_plan(
        like, q, k, v, k_cache, v_cache, positions, offsets, cu_seqlens, k_scale, v_scale, inplace
    )


def _packed_rows(cu_seqlens: torch.Tensor, offsets, steps: np.ndarray, table_len: int) -> np.ndarray | None:
    """Every token's table row in a packed batch, as the checked path resolves it
    (:func:`ropekit.positions.resolve`): token t of sequence s (``cu_seqlens[s] <= t < cu_seqlens[s + 1]``)
    reads row ``offsets[s] + t - cu_seqlens[s]`` (an int offset: the same for every sequence). None, having
    read nothing more, when a value check of the checked path fails: cu_seqlens not non-decreasing from 0 to
    the tokens, an offset negative (per sequence) or an int offset outside the table (a token reads it). The
    rows themselves are checked against the table by the C loop. steps: ``arange(tokens)``, int64."""
    cu = cu_seqlens.numpy().astype(np.int64, copy=False)  # (sequences + 1,): the tensor's memory, no copy
    if cu[0] != 0 or cu[-1] != steps.shape[0] or (cu[1:] < cu[:-1]).any():
        return None
    if type(offsets) is int:
        if not 0 <= offsets < table_len:
            return None
        first = offsets - cu[:-1]  # (sequences,): each sequence's row at token 0
    else:
        first = offsets.numpy()
        if first.min() < 0:
            return None
        first = first - cu[:-1]
    rows = np.repeat(first, cu[1:] - cu[:-1])  # (tokens,)
    rows += steps
    return rows


def _row_source(seq: int, tokens: int, table_len: int, positions, offsets, cu_seqlens, device):
    """The rows a plan's C loop reads, for one key's form: ``(rows, last_offset)``. ``rows(positions,
    offsets, cu_seqlens)`` -> ``(pointer, 0, made)`` (the loop's positions pointer; rows made here, to keep
    alive until the loop returns), or None, having read nothing more, when a value check the key cannot hold
    fails (the checked path then raises its own error). The forms, as the checked path resolves them
    (:func:`ropekit.positions.resolve`): positions, the rows themselves (offsets must be 0; with cu_seqlens,
    its values are checked); a packed batch's rows (:func:`_packed_rows`); per-sequence offsets, each
    sequence's rows ``offsets[b] + arange(seq)``. Rows read through the pointer are checked against the table
    by the C loop. An int offset's form has no rows function (None): the run checks ``0 <= offset <=
    last_offset`` itself and passes the offset."""
    packed_steps = None if cu_seqlens is None else np.arange(tokens, dtype=np.int64)  # (tokens,)
    if positions is not None:

        def rows(positions, offsets, cu_seqlens):
            if type(offsets) is not int or offsets != 0:
                return None  # positions with offsets: the checked path refuses them
            if cu_seqlens is not None and _packed_rows(cu_seqlens, 0, packed_steps, table_len) is None:
                return None  # malformed cu_seqlens: the checked path says how
            return positions.data_ptr(), 0, None

    elif cu_seqlens is not None:

        def rows(positions, offsets, cu_seqlens):
            made = _packed_rows(cu_seqlens, offsets, packed_steps, table_len)
            return None if made is None else (made.ctypes.data, 0, made)

    elif type(offsets) is not int:
        steps = None if seq == 1 else torch.arange(seq, device=device)  # (seq,): per-sequence rows

        def rows(positions, offsets, cu_seqlens):
            made = offsets if steps is None else (offsets[:, None] + steps).view(-1)  # (batch * seq,)
            return made.data_ptr(), 0, made

    else:  # an int offset: the run checks it against the table itself (a decode step spares the call)
        rows = None
    return rows, table_len - seq  # an int offset's rows offset .. offset + seq - 1 fit the table


def _cache_plan(like: FusedLaunch, q, k, v, k_cache, v_cache, positions, offsets, cu_seqlens, k_scale,
                v_scale, inplace: bool):  # fmt: skip
    """The run of one key: the value checks that cannot be planned, then the C loop (see the module doc).

    Rows: an int offset against the table here; positions, per-sequence offsets and the rows of a packed
    batch (cu_seqlens: :func:`_packed_rows`) by the C loop, which reads them as its positions. Scales: an FP8
    cache's scale tensor is read by the loop where it lies (its values checked here), a number's was made
    once by the checked path (kept here).

    The memory rule's byte ranges are checked by the C loop itself, before anything else (its spans and pairs
    are this key's constants); where two ranges meet it writes nothing and answers MEETS, and the run decides
    exactly here, then launches again without the range check. A key whose ranges met once (views of one
    packed qkv buffer) decides here first from then on."""
    seq, tokens = like.seq, like.batch * like.seq
    rows_of, last_offset = _row_source(
        seq, tokens, like.cos.shape[0], positions, offsets, cu_seqlens, q.device
    )
    # The tensors the memory rule reads, in the order of the run's `tensors`, and each one's pointer word in
    # the C loop's launch (fused_cpu.plan): q's source, k's, v's, the caches, cos, sin, the slots, the
    # positions, the scale tensors, then word 14 (read by the memory check alone): the per-sequence offsets,
    # or else cu_seqlens. cu_seqlens with per-sequence offsets is checked here (one word 14).
    tensor_offsets = type(offsets) is not int
    extra = offsets if tensor_offsets else cu_seqlens
    second = cu_seqlens if tensor_offsets else None
    candidates = (q, k, v, k_cache, v_cache, like.cos, like.sin, like.slots, positions, k_scale, v_scale,
                  extra)  # fmt: skip
    all_words = (4, 7, 10, 8, 11, 0, 1, 3, 2, 9, 12, 14)
    order = tuple(i for i, t in enumerate(candidates) if t is not None)
    words = tuple(all_words[i] for i in order)
    spans = tuple(span(candidates[i]) for i in order)
    pairs = _pairs((0, 3, 4) if inplace else (3, 4), len(spans))
    memory = tuple((words[a], words[b]) for a, b in pairs), {words[a]: spans[a] for a in range(len(spans))}
    c_loop = fused_cpu.plan(like, memory)
    starts_of = operator.itemgetter(*words)  # the pointer words -> the starts, in the order of spans
    second_span = 0 if second is None else span(second)
    written_spans = (span(q) if inplace else 0, span(k_cache), span(v_cache))
    shared: dict[tuple[int, int, int], bool] = {}  # (written, other, byte distance) -> share an element
    meets = fused_cpu.MEETS
    ranges_met = False  # whether this key's ranges have met (then they are decided here first)
    increment_version = torch._C._increment_version
    # The scales the checked path made of numbers ((1,) float32 tensors, kept alive here), by channel: their
    # pointers are this key's (its number is in the key).
    made = [
        ch.scale if s is None else None for ch, s in zip(like.channels[1:], (k_scale, v_scale), strict=True)
    ]
    made_pointers = [0 if t is None else t.data_ptr() for t in made]
    k_tensor, v_tensor = k_scale is not None, v_scale is not None  # the key's: a tensor (else a number, None)
    check_scales = k_tensor or v_tensor

    def run(q, k, v, cos, sin, k_cache, v_cache, slots, positions, offsets, cu_seqlens, k_scale, v_scale):
        nonlocal ranges_met
        q_inference = inplace and q.is_inference()  # q is the tensor written (q_out) in place
        caches_inference = k_cache.is_inference() or v_cache.is_inference()
        if (q_inference or caches_inference) and not torch.is_inference_mode_enabled():
            return None  # PyTorch refuses this write: the checked path says so
        if check_scales and not _valid_scales(k_scale if k_tensor else None, v_scale if v_tensor else None):
            return None
        got = (  # an int offset against the table here; any other form, its rows function
            rows_of(positions, offsets, cu_seqlens) if rows_of else (0, offsets, None)
            if 0 <= offsets <= last_offset else None
        )  # fmt: skip
        if got is None:
            return None
        row_pointer, offset, _made = got  # _made: rows made here, alive until the loop returns
        q_start = q.data_ptr()
        q_out = q if inplace else torch.empty_like(q)
        k_cache_start, v_cache_start = k_cache.data_ptr(), v_cache.data_ptr()
        if second_span:  # cu_seqlens, read with per-sequence offsets: against each written tensor here
            lo = cu_seqlens.data_ptr()
            for start, size in zip((q_start, k_cache_start, v_cache_start), written_spans, strict=True):
                if size and start < lo + second_span and lo < start + size:
                    return None  # they meet: the checked path decides
        pointers = (cos.data_ptr(), sin.data_ptr(), row_pointer, slots.data_ptr(), q_start,
                    q_start if inplace else q_out.data_ptr(), 0, k.data_ptr(), k_cache_start,
                    k_scale.data_ptr() if k_tensor else made_pointers[0], v.data_ptr(), v_cache_start,
                    v_scale.data_ptr() if v_tensor else made_pointers[1])  # fmt: skip
        extra_start = 0
        if tensor_offsets:
            extra_start = offsets.data_ptr()
        elif cu_seqlens is not None:
            extra_start = cu_seqlens.data_ptr()
        code = meets if ranges_met else c_loop(pointers, offset, extra_start)
        if code == meets:
            # Two spans meet (views of one buffer, as q, k and v of a packed projection): decided exactly,
            # once per distance (the key fixes everything else shares_memory reads).
            ranges_met = True
            starts = starts_of((*pointers, offset, extra_start))  # each tensor's start, as in spans
            for a, b in pairs:
                if starts[a] < starts[b] + spans[b] and starts[b] < starts[a] + spans[a]:
                    meet = shared.get((a, b, starts[b] - starts[a]))
                    if meet is None:
                        tensors = (q, k, v, k_cache, v_cache, cos, sin, slots, positions, k_scale, v_scale,
                                   offsets if tensor_offsets else cu_seqlens)  # fmt: skip
                        meet = shares_memory(tensors[order[a]], tensors[order[b]])
                        if len(shared) < MAX_PLANS:
                            shared[(a, b, starts[b] - starts[a])] = meet
                    if meet:
                        return None
            code = c_loop(pointers, offset, extra_start, False)
        if code != -1:  # a row or slot out of range, nothing written: the checked path says which
            return None
        written = (q_out, k_cache, v_cache)
        if not (q_inference or caches_inference or (not inplace and q_out.is_inference())):
            increment_version(written)
        else:
            increment_version(tuple(t for t in written if not t.is_inference()))
        return q_out

    run.keeps = made  # the made scales, whose pointers the run passes, live as long as the plan
    return run


def _valid_scales(*scales) -> bool:
    """Whether every value of these float32 scale tensors (None: a number, its value proved and in the key)
    is finite and > 0, as :func:`~ropekit.fused.checks.check_scale` checks them. min() sees a value <= 0 (or
    -inf); sum() is nan or inf when any value is (float64: no overflow of float32s)."""
    for scale in scales:
        if scale is not None:
            values = scale.tolist()
            if type(values) is float:  # a 0-d tensor
                if not 0 < values < math.inf:
                    return False
            elif not (0 < min(values) and sum(values) < math.inf):
                return False
    return True


def fp8_plan(backend: str, launches: list[FusedLaunch], q, k, cos, sin, q_scale, k_scale, q_nope, k_nope,
             positions, offsets, cu_seqlens, fp8_dtype: torch.dtype):  # fmt: skip
    """The plan of an :func:`~ropekit.apply_rotary_qk_fp8` call the checked path served with ``launches``
    (its rope launch, then its nope launch in the MLA form) on backend: ``run(q, k, cos, sin, q_scale,
    k_scale, q_nope, k_nope, positions, offsets, cu_seqlens)`` (the gate's arguments: a scale given as a
    number reaches the run as it is, its value in the key; here, None) -> the FP8 outputs, or None. None when
    no plan serves its kind: another backend than the C loop, an input the launch copied or converted (a
    strided last axis, a table not float32, positions, cu_seqlens or a scale tensor not contiguous, positions
    or per-sequence offsets not int64, a scale not float32), an empty q or k.

    The outputs are new tensors, so the memory rule has nothing to check (nothing the caller passed is
    written); the run checks the values a key cannot hold: an int offset against the table (positions,
    per-sequence offsets and a packed batch's rows: the C loop, before it writes; cu_seqlens' own values:
    :func:`_packed_rows`), and a scale tensor's values, finite and > 0 (float32, as the checked path's
    :func:`~ropekit.fused.checks.check_scale`)."""
    nopes = () if q_nope is None else tuple(t for t in (q_nope, k_nope) if t.numel())  # the parts written
    tensor_scales = tuple(s for s in (q_scale, k_scale) if s is not None)
    q4 = q if q.dim() == 4 else q[None]
    sequences = q4.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1  # offsets: one per sequence
    if (
        backend != "cpu"
        or q.dim() not in (3, 4)
        or len(launches) != 1 + bool(nopes)
        or not all(t.shape[-1] <= 1 or t.stride(-1) == 1 for t in (q, k, *nopes))
        or not all(s.dtype == torch.float32 and s.is_contiguous() for s in tensor_scales)
        or not _plannable(q4, (k, *nopes, *tensor_scales), cos, sin, 0 if positions is not None else offsets,
                          (sequences,))
        or (positions is not None and not (positions.dtype == torch.int64 and positions.is_contiguous()
                                           and positions.device == q.device))
        or (cu_seqlens is not None and not (cu_seqlens.is_contiguous() and cu_seqlens.device == q.device))
    ):  # fmt: skip
        return None
    like = launches[0]
    rope_loop = fused_cpu.plan(like)
    nope_loop = fused_cpu.plan(launches[1]) if nopes else None
    # The scales the checked path made of numbers ((1,) float32 tensors, kept alive here), by channel.
    made = [
        ch.scale if s is None else None for ch, s in zip(like.channels[:2], (q_scale, k_scale), strict=True)
    ]
    rows_of, last_offset = _row_source(
        like.seq, like.batch * like.seq, like.cos.shape[0], positions, offsets, cu_seqlens, q.device
    )
    q_tensor, k_tensor = q_scale is not None, k_scale is not None  # the key's: a tensor (else a number)
    check_scales = bool(tensor_scales)
    empty = torch.empty

    def run(q, k, cos, sin, q_scale, k_scale, q_nope, k_nope, positions, offsets, cu_seqlens):
        got = (  # an int offset against the table here; any other form, its rows function
            rows_of(positions, offsets, cu_seqlens) if rows_of else (0, offsets, None)
            if 0 <= offsets <= last_offset else None
        )  # fmt: skip
        if got is None:
            return None
        row_pointer, offset, _made = got  # _made: rows made here, alive until the loops return
        if check_scales and not _valid_scales(q_scale if q_tensor else None, k_scale if k_tensor else None):
            return None
        q_ptr = q_scale.data_ptr() if q_tensor else made[0].data_ptr()
        k_ptr = k_scale.data_ptr() if k_tensor else made[1].data_ptr()
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
    kind (another backend than the C loop, an input the launch would convert; cu_seqlens: the rows of a
    packed batch, :func:`_packed_rows`)."""
    weights = (q_weight, k_weight)
    sequences = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else qkv.shape[0] if qkv.dim() == 3 else 1
    if (
        backend != "cpu"
        or qkv.dim() not in (2, 3)
        or not all(w.dtype == torch.float32 and w.is_contiguous() for w in weights)
        or not _plannable(qkv, weights, cos, sin, 0 if positions is not None else offsets, (sequences,))
        or (positions is not None and not (positions.dtype == torch.int64 and positions.is_contiguous()
                                           and positions.device == qkv.device))
        or (cu_seqlens is not None and not (cu_seqlens.is_contiguous() and cu_seqlens.device == qkv.device))
    ):  # fmt: skip
        return None
    view = qkv if qkv.dim() == 3 else qkv.unsqueeze(0)  # (B, S, W)
    c_loop = qk_norm_cpu.plan(view, cos, sin, spec)
    rows_of, last_offset = _row_source(
        view.shape[1], view.shape[0] * view.shape[1], cos.shape[0], positions, offsets, cu_seqlens, qkv.device
    )
    increment_version = torch._C._increment_version
    qkv_span, table_span = span(qkv), span(cos)

    def run(qkv, q_weight, k_weight, cos, sin, positions, offsets, cu_seqlens):
        if cos.requires_grad or sin.requires_grad:
            return None  # refused in any grad mode (constants to qk_norm_rotary_): the checked path says so
        if qkv.is_inference() and not torch.is_inference_mode_enabled():
            return None  # PyTorch refuses this write: the checked path says so
        # The memory rule: qkv (written) meets nothing it reads; where byte ranges meet, the checked path
        # decides exactly. The key holds every read tensor's layout: weights, positions and offsets are
        # contiguous here.
        lo = qkv.data_ptr()
        hi = lo + qkv_span
        rows_read = positions if positions is not None else None if type(offsets) is int else offsets
        for t, size in ((q_weight, 0), (k_weight, 0), (cos, table_span), (sin, table_span), (rows_read, 0),
                        (cu_seqlens, 0)):  # fmt: skip
            if t is not None:
                start = t.data_ptr()
                if start < hi and lo < start + (size or t.numel() * t.element_size()):
                    return None
        got = (  # an int offset against the table here; any other form, its rows function
            rows_of(positions, offsets, cu_seqlens) if rows_of else (0, offsets, None)
            if 0 <= offsets <= last_offset else None
        )  # fmt: skip
        if got is None:
            return None
        rows, offset, _made = got  # _made: rows made here, alive until the loop returns
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
            return None  # the cache meets a table or the slots: the checked path decides
        row = -delta if delta < 0 else delta
        pointers = (cos_lo + row * row_bytes, sin_lo + row * sin_row_bytes, 0, slots_lo, 0, 0, 0, 0, lo, 0,
                    0, 0, 0)  # fmt: skip
        if loops[delta < 0](pointers, 0) != -1:  # a slot outside the cache or given twice: nothing written
            return None
        if not inference:
            increment_version((k_cache,))
        return k_cache

    return run
