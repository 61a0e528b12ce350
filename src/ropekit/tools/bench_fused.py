"""Bench rows for the serving fusions, each beside the unfused sequence a model runs today.

Every entry of :data:`FUSED_ROWS` gives two rows, ``fused <name>`` and ``unfused <name>``, timed interleaved
round by round with the same inputs (in-place ops get their own copies), plus the floor: a ``copy_`` of the
fused op's own bytes (``x_copy``). The ``mb`` column is what each row must read and write at least;
``x_unfused`` is the fused time over the unfused time.

Adding a fusion is one entry in FUSED_ROWS: a :class:`FusedRow` whose ``setup(case)`` returns a
:class:`FusedPair`. (This branch carries the QK-norm row; the RoPE + cache and RoPE + FP8 rows and the wiring
into ``ropekit bench`` come with the same file from the serving-fusions branch.)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

import ropekit

__all__ = ["FUSED_ROWS", "FusedPair", "FusedRow", "fused_records"]

# The QK-norm row's epsilon and weights: Qwen3's (rms_norm_eps 1e-6, weights near 1).
QK_NORM_EPS = 1e-6


@dataclass
class FusedPair:
    """What one fusion runs: fused() and unfused() do the same work; each returns the tensors it produced,
    which must agree (max_err). The byte counts are each sequence's minimum traffic (reads + writes)."""

    fused: Callable[[], tuple[torch.Tensor, ...]]
    unfused: Callable[[], tuple[torch.Tensor, ...]]
    fused_bytes: int
    unfused_bytes: int
    tolerance: float = 1e-5


@dataclass(frozen=True)
class FusedRow:
    name: str  # "qknorm+rope": the rows are "fused qknorm+rope" and "unfused qknorm+rope"
    setup: Callable  # setup(case) -> FusedPair


def _qk_norm_pair(case) -> FusedPair:
    """QK-RMSNorm + RoPE on packed qkv, in place, against: Qwen3's RMSNorm written back into q and k (float32
    mean square, rounded, times the weight), then ``apply_rotary_qk`` in place on the q and k views."""
    q_heads, k_heads, head_dim = case.q.shape[-2], case.k.shape[-2], case.q.shape[-1]
    v = torch.randn(case.k.shape, generator=torch.Generator().manual_seed(1)).to(case.k)
    qkv = torch.cat([case.q.flatten(-2), case.k.flatten(-2), v.flatten(-2)], dim=-1)  # (B, S, W)
    kw = dict(case.ropekit_kwargs)
    if "cu_seqlens" in kw:
        qkv = qkv[0]  # packed: (T, W)
    weights = torch.Generator().manual_seed(2)
    q_weight = (1 + 0.1 * torch.randn(head_dim, generator=weights)).to(case.q)
    k_weight = (1 + 0.1 * torch.randn(head_dim, generator=weights)).to(case.q)
    fused_qkv, unfused_qkv = qkv.clone(), qkv.clone()
    q_size, k_size = q_heads * head_dim, k_heads * head_dim
    heads = (*unfused_qkv.shape[:-1], -1, head_dim)
    q_view = unfused_qkv[..., :q_size].view(heads)  # (B, S, Hq, D) or (T, Hq, D) views into the buffer
    k_view = unfused_qkv[..., q_size : q_size + k_size].view(heads)
    packing = dict(num_q_heads=q_heads, num_kv_heads=k_heads, head_dim=head_dim, eps=QK_NORM_EPS)

    def fused():
        ropekit.qk_norm_rotary_(fused_qkv, q_weight, k_weight, case.cos, case.sin, **packing, **kw)
        return (fused_qkv,)

    def unfused():
        for x, weight in ((q_view, q_weight), (k_view, k_weight)):
            x32 = x.float()
            x.copy_(weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + QK_NORM_EPS)).to(x.dtype))
        ropekit.apply_rotary_qk(q_view, k_view, case.cos, case.sin, inplace=True, **kw)
        return (unfused_qkv,)

    qk_bytes = (q_size + k_size) * qkv[..., 0].numel() * qkv.element_size()
    # Fused: q and k read and written once. Unfused: the norm reads and writes them, then the rotation again.
    return FusedPair(fused, unfused, fused_bytes=2 * qk_bytes, unfused_bytes=4 * qk_bytes, tolerance=1e-4)


# One entry per fusion; the rows appear in this order.
FUSED_ROWS: list[FusedRow] = [
    FusedRow("qknorm+rope", _qk_norm_pair),
]


def _max_err(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))


def fused_records(case, columns, measure, include, min_run_time, repeats, log) -> list[dict]:
    """The records of every fused row that include selects (None: all), with bench's columns.

    In-place rows work on their own copies again on every call (the norm keeps the values in range), and
    max_err compares the first call of each, made on the same values.
    """
    records = []
    for row in FUSED_ROWS:
        names = (f"fused {row.name}", f"unfused {row.name}")
        if include and not any(s.lower() in n.lower() for n in names for s in include):
            continue
        log(f"{case.shape.name}: preparing {names[0]}")
        pair = row.setup(case)
        err = _max_err(pair.fused(), pair.unfused())
        src = torch.empty(pair.fused_bytes // 2, dtype=torch.uint8, device=case.q.device)
        dst = torch.empty_like(src)
        tasks = {names[0]: pair.fused, names[1]: pair.unfused, "floor": lambda d=dst, s=src: d.copy_(s)}
        samples: dict[str, list[float]] = {name: [] for name in tasks}
        for _ in range(repeats):  # interleaved: drift hits every row alike
            for name, fn in tasks.items():
                samples[name].append(measure(fn, min_run_time))
        med = {name: statistics.median(v) for name, v in samples.items()}
        for name, nbytes in zip(names, (pair.fused_bytes, pair.unfused_bytes), strict=True):
            t = med[name]
            values = {
                "shape": case.shape.name,
                "row": name,
                "device": case.q.device.type,
                "dtype": str(case.q.dtype).removeprefix("torch."),
                "fwd_ms": t * 1e3,
                "fwd_us": t * 1e6,
                "fwd_gbps": nbytes / t / 1e9,
                "x_copy": t / med["floor"],
                "max_err": err,
                "mb": nbytes / 2**20,
                "x_unfused": t / med[names[1]],
                "note": "MISMATCH fused vs unfused" if err > pair.tolerance else "",
            }
            records.append({c: values.get(c, math.nan) for c in columns})
    return records
