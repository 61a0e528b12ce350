"""Re-rotating cached keys by delta positions, in place: :func:`shift_cache_`.

Rotations compose: R(p + delta) = R(delta) R(p) (docs/math.md), so keys cached at positions p move to
p + delta by one more rotation by delta, with the table row |delta| (its conjugate when delta < 0).
llama.cpp's context shift and attention sinks (StreamingLLM) evict the oldest tokens this way and keep the
rest without recomputing their keys. Inference only.
"""

from __future__ import annotations

import torch

from ropekit.backends import named_backend, select_backend
from ropekit.backends.fused_launch import Channel, FusedLaunch
from ropekit.backends.kernel_op import plain_eager, register_op
from ropekit.backends.plan import gate, keep
from ropekit.dtensor_inputs import check_no_dtensor
from ropekit.fused.checks import cache_view, check_distinct_slots, check_slots, paged_view, pages
from ropekit.fused.planned import shift_plan
from ropekit.validation import check_bool, check_int, check_movable, check_no_alias, check_tables, describe

__all__ = ["shift_cache_"]

# The op's launch-plan gate (ropekit.backends.plan.gate): its arguments in the order its plans' runs take.
_launch_planned = gate(
    "shift_cache_", "k_cache cos sin delta# slots?", "cache_layout:str interleaved:bool backend:str"
)


def shift_cache_(
    k_cache: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    delta: int,
    *,
    cache_layout: str = "nhd",
    slots: torch.Tensor | None = None,
    interleaved: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """Rotate the keys in k_cache by delta positions, in place (the version counter moves).

    Args:
        k_cache: a "flat" (num_slots, H, D), "nhd" (P, N, H, D) or "hnd" (P, H, N, D) key cache of float32,
            float16, bfloat16 (or float64 on the torch backend). An FP8 cache is refused: re-rotating its
            bytes would need its scale and a second rounding.
        cos, sin: (L, R/2) tables, as in :func:`ropekit.apply_rotary`; row |delta| must exist.
        delta: positions to move by; may be negative (towards 0).
        cache_layout: "flat", "nhd" or "hnd", as in :func:`ropekit.apply_rotary_qk_and_cache`.
        slots: None (every slot), or an int64 (n,) tensor of distinct flat slot ids (-1 entries skipped).
        interleaved: the pair layout the keys were rotated with.
        backend: "auto", "torch", "cpu" or "triton".

    Returns:
        k_cache.

    Raises:
        ValueError: before anything is written, for a cache of the wrong layout, rank or dtype, |delta| past
            the table, slots that are not int64 (n,), outside [-1, num_slots) or given twice, tables or
            slots that share the cache's memory, or an unusable backend.
    """
    done, key = _launch_planned(k_cache, cos, sin, delta, slots, cache_layout=cache_layout,
                                interleaved=interleaved, backend=backend)  # fmt: skip
    if done is not None:  # a shift seen before: its launch plan (ropekit.fused.planned.shift_plan)
        return k_cache
    planned = (k_cache, cos, sin, delta, slots)
    check_no_dtensor(
        "shift_cache_",
        ("k_cache", "cos", "sin", "slots"),
        (k_cache, cos, sin, slots),
        "shift each rank's local cache (t.to_local())",
    )
    check_bool("interleaved", interleaved)
    delta = check_int("delta", delta, minimum=-(1 << 62), expected="an int (positions to move by)")
    _check_cache_dtype(k_cache)
    if k_cache.dim() not in (3, 4):
        raise ValueError(f"k_cache: expected a 3-D or 4-D cache, got {describe(k_cache)}")
    if k_cache.is_meta:  # its keys are rotated in place: there must be keys (PyTorch fails inside the op)
        raise ValueError(
            f"k_cache: expected a tensor with values (its keys are rotated in place), got a meta tensor "
            f"(shape {tuple(k_cache.shape)}: no data); fill it after to_empty()"
        )
    heads_axis = 1 if cache_layout in ("flat", "hnd") else 2
    heads, width = k_cache.shape[heads_axis], k_cache.shape[-1]
    view = cache_view("k_cache", k_cache, cache_layout, heads, width, k_cache.dtype, k_cache.device)
    check_tables(cos, sin, width)
    check_movable("cos", cos, k_cache.device, where="k_cache's device")
    check_movable("sin", sin, k_cache.device, where="k_cache's device")
    row = abs(delta)
    if row >= cos.shape[0]:
        raise ValueError(
            f"delta: |delta| = {row} is past the cos/sin table (table_len {cos.shape[0]}); expected a table "
            f"with at least {row + 1} rows"
        )
    num_slots = view.shape[0] * view.shape[1]
    if slots is not None:
        if isinstance(slots, torch.Tensor) and slots.dim() != 1:
            raise ValueError(f"slots: expected an int64 (n,) tensor of flat slot ids, got {describe(slots)}")
        n = slots.shape[0] if isinstance(slots, torch.Tensor) else 0
        flat_slots = check_slots("slots", slots, (n,), k_cache.device)
    else:
        n, flat_slots = num_slots, None
    # The memory rule: the cache is rotated in place of itself; the tables and slots it reads stay apart.
    reads = (("k_cache", k_cache), ("cos", cos), ("sin", sin), ("slots", slots))
    check_no_alias((("k_cache", k_cache),), reads, optional=False)
    name = select_backend(
        backend, view if view.dtype != torch.uint8 else k_cache, cos, op="fused", widest=width
    ).name
    if cos.device != k_cache.device:
        cos, sin = cos.to(k_cache.device), sin.to(k_cache.device)
    args = (k_cache, cos, sin, delta, cache_layout, flat_slots, interleaved, name)
    if plain_eager(k_cache):
        launch = _launch(*args, checked=True)
        if key is not None:  # plan the next call like this one
            keep(key, shift_plan(name, launch, *planned))
    else:  # traced: the registered op, one node of a compiled graph
        _OP(*args)
    return k_cache


def _check_cache_dtype(k_cache: object) -> None:
    """A cache of a float dtype of at least 16 bits: re-rotating FP8 bytes would need their scale and a
    second rounding."""
    if not isinstance(k_cache, torch.Tensor) or not k_cache.is_floating_point() or k_cache.dtype.itemsize < 2:
        raise ValueError(
            f"k_cache: expected a float32, float16, bfloat16 or float64 cache (FP8 caches cannot be shifted "
            f"in place), got {describe(k_cache)}"
        )


def _launch(k_cache, cos, sin, delta, cache_layout, slots, interleaved, backend, *,
            checked: bool) -> FusedLaunch:  # fmt: skip
    """Rotate k_cache's keys (slots: flat ids, -1 skipped; None: every slot) by delta, in place; returns the
    launch it ran (the model of a launch plan: :func:`ropekit.fused.planned.shift_plan`).
    checked=False (the registered op): the launcher checks the kernel wall and the slots; the row |delta|
    is checked here."""
    impl = named_backend(backend, "fused", None if checked else k_cache.device)
    view = pages(k_cache, cache_layout) if checked else paged_view("k_cache", k_cache, cache_layout)
    row = abs(delta)
    if not checked:  # a registered op called directly: the public call's value checks
        _check_cache_dtype(k_cache)
        if not 0 <= row < cos.shape[0]:
            raise ValueError(f"delta: |delta| = {row} is past the cos/sin table (table_len {cos.shape[0]})")
        reads = (("k_cache", k_cache), ("cos", cos), ("sin", sin), ("slots", slots))
        check_no_alias((("k_cache", k_cache),), reads, optional=False)
        if slots is not None:
            check_distinct_slots("slots", slots)
    n = view.shape[0] * view.shape[1] if slots is None else slots.shape[0]
    # Every token reads the same row |delta|: a table of n rows that all alias it (row stride 0).
    half = cos.shape[1]
    row_cos, row_sin = cos[row : row + 1].expand(max(n, 1), half), sin[row : row + 1].expand(max(n, 1), half)
    if impl.name != "torch":  # the kernels read float32 rows: convert the one row, then alias it n times
        row_cos, row_sin = (t.float().contiguous()[:1].expand(max(n, 1), half) for t in (row_cos, row_sin))
    channel = Channel(None, view, rotate=True, by_slot=slots is not None)
    launch = FusedLaunch(
        1, n, row_cos, row_sin, None, 0, slots, interleaved, delta < 0, (None, channel, None)
    )
    try:
        impl.launch_fused(launch, checked=checked, written=[k_cache] if checked else ())
    except ValueError as err:  # the launchers check slot values under the launch's name, slot_mapping
        text = str(err)
        if text.startswith("slot_mapping:"):
            raise ValueError("slots:" + text.removeprefix("slot_mapping:")) from None
        raise
    return launch


# torch.ops.ropekit.shift_cache_: k_cache rotated in place.
_OP = register_op(
    "shift_cache_",
    lambda *args: _launch(*args, checked=False) and None,
    lambda *args: None,
    mutates_args=("k_cache",),
    schema=(
        "(Tensor(a!) k_cache, Tensor cos, Tensor sin, SymInt delta, str cache_layout, Tensor? slots, "
        "bool interleaved, str backend) -> ()"
    ),
)
