"""Bench rows for the serving fusions, each beside the unfused sequence a model runs today.

Every entry of :data:`FUSED_ROWS` gives two rows, ``fused <name>`` and ``unfused <name>``, timed
interleaved round by round with the same inputs (in-place ops get their own copies), plus the floor: a
``copy_`` of the fused op's own bytes (``x_copy``): of q, k and v for the cache write; of one uint8 buffer
holding as many bytes as the FP8 op (or the QK-norm op) reads and writes. The
``mb`` column is what each row must read and write at least; ``x_unfused`` is the fused time over the unfused
time. :func:`ropekit.tools.bench.run_benchmark` calls :func:`fused_records` for every shape.

Adding a fusion is one entry in FUSED_ROWS: a :class:`FusedRow` whose ``setup(case)`` returns a
:class:`FusedPair`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

import ropekit

__all__ = ["FUSED_ROWS", "CopyFloor", "FusedPair", "FusedRow", "copy_floor", "fused_records", "random_bytes"]

PAGE_SIZE = 16  # tokens per cache page (vLLM's default block size)
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
    # The tensors whose copy_ into buffers of their own shape is the floor; None: one uint8 buffer of half
    # fused_bytes (a copy reads and writes it), for fusions whose outputs differ in dtype from their inputs.
    floor_tensors: tuple[torch.Tensor, ...] | None = None


@dataclass(frozen=True)
class FusedRow:
    name: str  # "rope+cache": the rows are "fused rope+cache" and "unfused rope+cache"
    setup: Callable  # setup(case) -> FusedPair


def _inputs(case):
    """q, k (B, S, H, D) or packed (T, H, D) as the case's ropekit call takes them, and its kwargs."""
    q, k = case.q.clone(), case.k.clone()
    if case.shape.seqlens is not None:  # packed: (1, T, H, D) -> (T, H, D)
        q, k = q[0], k[0]
    return q, k, case.ropekit_kwargs


def _cache_pair(case) -> FusedPair:
    """RoPE + KV-cache write against: rotate q and k in place, then index_copy_ k and v into the cache."""
    q, k, kw = _inputs(case)
    q_ref = q.clone()
    v = torch.randn_like(k)
    tokens = q.shape[:-2].numel()
    # Twice the pages the tokens need (a decode token per page): the writes scatter over a half-full cache.
    pages = 2 * (tokens if case.shape.decode else -(-tokens // PAGE_SIZE))
    g = torch.Generator().manual_seed(0)
    if case.shape.decode:  # one new token per sequence, each in its own page
        slots = torch.randperm(pages, generator=g)[:tokens] * PAGE_SIZE + torch.randint(
            0, PAGE_SIZE, (tokens,), generator=g
        )
    else:  # a prefill fills whole pages, handed out in any order (as vLLM's block table)
        page_of = torch.randperm(pages, generator=g)[: -(-tokens // PAGE_SIZE)]
        slots = (page_of[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).reshape(-1)[:tokens]
    slots = slots.to(q.device).reshape(q.shape[:-2])
    heads, dim = k.shape[-2:]
    caches = [torch.zeros(pages, PAGE_SIZE, heads, dim, dtype=q.dtype, device=q.device) for _ in range(4)]
    flat = slots.reshape(-1)

    def fused():
        ropekit.apply_rotary_qk_and_cache(
            q, k, v, case.cos, case.sin, k_cache=caches[0], v_cache=caches[1], slot_mapping=slots,
            cache_layout="nhd", inplace=True, **kw,
        )  # fmt: skip
        return caches[0], caches[1]

    k_work = k.clone()

    def unfused():
        ropekit.apply_rotary_qk(q_ref, k_work, case.cos, case.sin, inplace=True, **kw)
        caches[2].view(-1, heads, dim).index_copy_(0, flat, k_work.reshape(-1, heads, dim))
        caches[3].view(-1, heads, dim).index_copy_(0, flat, v.reshape(-1, heads, dim))
        return caches[2], caches[3]

    q_bytes, kv_bytes = q.nbytes, k.nbytes + v.nbytes
    return FusedPair(
        fused,
        unfused,
        fused_bytes=2 * (q_bytes + kv_bytes),
        unfused_bytes=2 * (q_bytes + k.nbytes) + 2 * kv_bytes,
        floor_tensors=(q, k, v),  # a copy_ of q, k and v: what the fused op reads, and as much as it writes
    )


def _fp8_pair(case) -> FusedPair:
    """RoPE + FP8 against: rotate q and k in place, then scale and cast each (stored = value / scale)."""
    q, k, kw = _inputs(case)
    q_ref, k_ref = q.clone(), k.clone()
    fp8 = torch.float8_e4m3fn
    fmax = torch.finfo(fp8).max
    scale = 0.05

    def fused():
        return ropekit.apply_rotary_qk_fp8(
            q, k, case.cos, case.sin, q_scale=scale, k_scale=scale, fp8_dtype=fp8, **kw
        )

    def unfused():
        ropekit.apply_rotary_qk(q_ref, k_ref, case.cos, case.sin, inplace=True, **kw)
        return tuple((x / scale).clamp_(-fmax, fmax).to(fp8) for x in (q_ref, k_ref))

    n = q.numel() + k.numel()
    size = q.element_size()
    return FusedPair(
        fused, unfused, fused_bytes=n * (size + 1), unfused_bytes=n * (2 * size + size + 1), tolerance=32.0
    )


def _qk_norm_pair(case) -> FusedPair:
    """QK-RMSNorm + RoPE on packed qkv, in place, against: Qwen3's RMSNorm written back into q and k (float32
    mean square, rounded, times the weight), then ``apply_rotary_qk`` in place on the q and k views."""
    q_heads, k_heads, head_dim = case.q.shape[-2], case.k.shape[-2], case.q.shape[-1]
    v = torch.randn(case.k.shape, generator=torch.Generator().manual_seed(1)).to(case.k)
    qkv = torch.cat([case.q.flatten(-2), case.k.flatten(-2), v.flatten(-2)], dim=-1)  # (B, S, W)
    kw = dict(case.ropekit_kwargs)
    if "cu_seqlens" in kw:
        qkv = qkv[0]  # packed: (T, W)
    # Weights of magnitude 1 (random signs): the rows run in place over and over, and weights near 1 but not 1
    # would grow some features and shrink the rest by w**calls, into subnormal floats whose arithmetic is many
    # times slower (a decode-1 step measured 160 us instead of 15). A sign keeps every head's norm.
    weights = torch.Generator().manual_seed(2)
    q_weight, k_weight = (
        (2 * torch.randint(0, 2, (head_dim,), generator=weights) - 1).to(case.q) for _ in range(2)
    )
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
    FusedRow("rope+cache", _cache_pair),
    FusedRow("rope+fp8", _fp8_pair),
    FusedRow("qknorm+rope", _qk_norm_pair),
]


@dataclass(frozen=True)
class CopyFloor:
    """A floor row: ``copy_`` of each source into a buffer of its own shape. Every tensor here holds
    written values before the first timed call: a ``torch.empty`` buffer never written maps the kernel's
    shared zero page, whose reads hit one cached page, and that floor would be cheaper than any real read."""

    sources: tuple[torch.Tensor, ...]
    buffers: tuple[torch.Tensor, ...]

    def __call__(self) -> None:
        for src, dst in zip(self.sources, self.buffers, strict=True):
            dst.copy_(src)


def copy_floor(sources: tuple[torch.Tensor, ...]) -> CopyFloor:
    """The copy floor of sources (tensors holding values); its destinations are written (ones) first."""
    return CopyFloor(tuple(sources), tuple(torch.ones_like(t) for t in sources))


def random_bytes(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 buffer of nbytes random non-zero bytes: a floor source whose every page holds values."""
    g = torch.Generator().manual_seed(3)
    return torch.randint(1, 256, (nbytes,), dtype=torch.uint8, generator=g).to(device)


def _max_err(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))


def fused_records(case, columns, measure, include, min_run_time, repeats, log) -> list[dict]:
    """The records of every fused row that include selects (None: all), with bench's columns.

    Args:
        case: a :class:`ropekit.tools.bench.Case`; columns: bench's COLUMNS.
        measure: measure(fn, min_run_time) -> seconds per call.
        include: substrings of row names to keep; repeats: rounds; log: progress messages.

    In-place rows rotate their own copies again on every call: a rotation keeps each pair's norm, so the
    values stay in range, and max_err compares the first call of each, made on the same values.
    """
    records = []
    for row in FUSED_ROWS:
        names = (f"fused {row.name}", f"unfused {row.name}")
        if include and not any(s.lower() in n.lower() for n in names for s in include):
            continue
        log(f"{case.shape.name}: preparing {names[0]}")
        pair = row.setup(case)
        err = _max_err(pair.fused(), pair.unfused())
        floor = copy_floor(pair.floor_tensors or (random_bytes(pair.fused_bytes // 2, case.q.device),))
        tasks = {names[0]: pair.fused, names[1]: pair.unfused, "floor": floor}
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
