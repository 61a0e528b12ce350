"""Benchmark RoPE implementations against a copy of the same bytes: ropekit's backends and installed peers.

RoPE reads q and k and writes them once, so copying those bytes is the floor. Every row gets the same q and k
(in-place rows get their own copy of the same values), rows run interleaved round by round, and each figure is
the median over rounds of a ``torch.utils.benchmark`` measurement (``blocked_autorange``: as many calls per
block as make the timer's resolution negligible, blocks until ``min_run_time`` has passed, the median block;
on CUDA it synchronizes the device around each block). Each row's forward output is also checked against
ropekit's torch backend with the same pair layout, so a fast but wrong row shows up as a mismatch.

Rows:
    copy_ / clone: the floors (copy into existing buffers; a fresh allocation plus the copy).
    ropekit[<backend>] and ropekit[<backend>] in-place, for the backend ``backend="auto"`` picks for the
    inputs (the dispatch in :mod:`ropekit.backends` decides) and the plain torch backend.
    ropekit[<backend>] numerics=hf / numerics=vllm (and in-place): the peers' bits on request, on the backend
    ``backend="auto"`` picks for that mode (issue 36: the same speed as "exact").
    ropekit.compat.hf (HF's call on HF's (B, S, D) tables) and ropekit.compat.vllm in-place (vLLM's op on a
    [cos | sin] cache): the peers' call conventions through ropekit, to compare with the core rows.
    HF eager (transformers' apply_rotary_pos_emb), HF + torch.compile, Meta's complex form (written here,
    after Meta's LLaMA reference code), rotary-embedding-torch, torchtune, and on CUDA flash-attn and Liger.
    A peer that is not installed is skipped with a note.

Columns: fwd_ms and fwd_us (one forward call), fwd_bwd_ms, fwd_gbps (q and k read and written once, over
the forward time), x_copy and x_clone (forward time over the floors), saved_mb (what autograd keeps for
backward), peak_mb (the most memory held at once by fwd+bwd beyond the inputs; torch.cuda's counter on CUDA, a
count of live op outputs on the CPU, where compiled rows are not measured), max_err (against ropekit's torch
backend; peers that build their angles in float32 drift by ~1e-4 at position 4k, which is their precision,
not a bug; "MISMATCH" marks errors too large for that, such as a wrong pair layout).

Shape notation: B batch, S sequence, T packed tokens, Hq / Hk query / key heads, D head_dim.
"""

from __future__ import annotations

import csv
import importlib
import math
import statistics
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import ropekit
from ropekit.backends import BACKENDS, select_backend
from ropekit.tools.bench_fused import copy_floor, fused_records
from ropekit.validation import check_int

__all__ = [
    "COLUMNS",
    "PEER_ROWS",
    "SHAPES",
    "PeerRow",
    "Shape",
    "figure",
    "format_table",
    "plot",
    "run_benchmark",
    "write_csv",
]

COLUMNS = [
    "shape",
    "row",
    "device",
    "dtype",
    "fwd_ms",
    "fwd_us",
    "fwd_bwd_ms",
    "fwd_gbps",
    "x_copy",
    "x_clone",
    "saved_mb",
    "peak_mb",
    "max_err",
    "mb",
    "x_unfused",
    "note",
]
# Seconds of calls behind one measurement of one row in one round (torch.utils.benchmark's min_run_time).
MIN_RUN_TIME_S = 0.1
# max_err above this marks a row as disagreeing (a layout or input bug), beyond precision noise.
MISMATCH = {torch.float32: 1e-2, torch.float16: 5e-2, torch.bfloat16: 1e-1}


@dataclass(frozen=True)
class Shape:
    """One benchmark shape. Llama-3-8B attention: 32 query heads, 8 key heads, head_dim 128."""

    name: str
    batch: int
    seq: int
    q_heads: int = 32
    k_heads: int = 8
    head_dim: int = 128
    seqlens: tuple[int, ...] | None = None  # varlen pack: lengths summing to seq, packed with cu_seqlens
    decode: bool = False  # one token per sequence at a per-sequence offset (KV-cache decoding)
    int_offset: bool = False  # with decode: one int offset for the batch (no offsets tensor), as in serving


SHAPES = {
    s.name: s
    for s in [
        Shape("prefill-4k", 1, 4096),
        Shape("prefill-16k", 1, 16384),
        Shape("decode", 64, 1, decode=True),
        Shape("decode-1", 1, 1, decode=True, int_offset=True),  # one token of one sequence
        Shape("varlen", 1, 4096, seqlens=(256, 1792, 512, 1024, 512)),
        Shape("tiny", 2, 16, 4, 2, 32),  # for tests and smoke runs
        Shape("tiny-varlen", 1, 24, 4, 1, 16, seqlens=(5, 19)),
    ]
}


@dataclass
class Case:
    """The inputs every row shares. q, k: (B, S, Hq/Hk, D); positions: (B, S) int64; cos, sin: (L, D/2)."""

    shape: Shape
    q: torch.Tensor
    k: torch.Tensor
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    angle: torch.Tensor  # (L, D/2) float32 position * inv_freq, for peers that build their own tables
    ropekit_kwargs: dict

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.k.nbytes


def make_case(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Case:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(shape.batch, shape.seq, shape.q_heads, shape.head_dim, generator=g)  # (B, S, Hq, D)
    k = torch.randn(shape.batch, shape.seq, shape.k_heads, shape.head_dim, generator=g)  # (B, S, Hk, D)
    kwargs: dict = {}
    if shape.decode:
        offsets = torch.randint(0, 4096, (1 if shape.int_offset else shape.batch,), generator=g)
        positions = offsets[:, None] + torch.arange(shape.seq)[None, :]  # (B, S)
        positions = positions.expand(shape.batch, -1)
        kwargs["offsets"] = int(offsets[0]) if shape.int_offset else offsets.to(device)
    elif shape.seqlens is not None:
        positions = torch.cat([torch.arange(n) for n in shape.seqlens])[None, :]  # (1, T)
        cu = torch.tensor([0, *torch.tensor(shape.seqlens).cumsum(0).tolist()], dtype=torch.int32)
        kwargs["cu_seqlens"] = cu.to(device)
    else:
        positions = torch.arange(shape.seq)[None, :].repeat(shape.batch, 1)  # (B, S)
    config = ropekit.RopeConfig(shape.head_dim, base=500000.0)
    table_len = int(positions.max()) + 1
    cos, sin = config.cos_sin(table_len, dtype=torch.float32, device=device)
    angle = torch.arange(table_len, dtype=torch.float64)[:, None] * config.inv_freq()[None, :]
    return Case(
        shape,
        q.to(device=device, dtype=dtype),
        k.to(device=device, dtype=dtype),
        positions.to(device),
        cos,
        sin,
        angle.to(device=device, dtype=torch.float32),
        kwargs,
    )


@dataclass
class Row:
    """A row. setup(case) -> fn(q, k) -> (q_out, k_out); per-row tables are built in setup, outside timing."""

    name: str
    setup: Callable[[Case], Callable]
    interleaved: bool = False
    inplace: bool = False
    differentiable: bool = True
    compiled: bool = False


# ---- rows: ropekit --------------------------------------------------------------------------------------


def _ropekit_row(backend: str, inplace: bool, numerics: str = "exact") -> Row:
    mode = {} if numerics == "exact" else {"numerics": numerics}

    def setup(case: Case):
        packed = case.shape.seqlens is not None

        def fn(q, k):
            if packed:  # (1, T, H, D) -> (T, H, D): ropekit takes packed input as it is stored
                q, k = q[0], k[0]
            out = ropekit.apply_rotary_qk(
                q, k, case.cos, case.sin, inplace=inplace, backend=backend, **case.ropekit_kwargs, **mode
            )
            return tuple(o.unsqueeze(0) for o in out) if packed else out

        return fn

    suffix = ("" if numerics == "exact" else f" numerics={numerics}") + (" in-place" if inplace else "")
    return Row(f"ropekit[{backend}]{suffix}", setup, inplace=inplace, differentiable=not inplace)


def _module_row() -> Row:
    """RotaryEmbedding.forward on the case's inputs: the module's own cost over apply_rotary_qk's (issue 17
    target: at most 1.15x at decode-1)."""

    def setup(case: Case):
        packed = case.shape.seqlens is not None
        rope = ropekit.RotaryEmbedding(
            head_dim=case.shape.head_dim, base=500000.0, layout="thd" if packed else "bshd"
        ).to(case.q.device)

        def fn(q, k):
            if packed:  # (1, T, H, D) -> (T, H, D): layout "thd"
                q, k = q[0], k[0]
            out = rope(q, k, **case.ropekit_kwargs)
            return tuple(o.unsqueeze(0) for o in out) if packed else out

        return fn

    return Row("ropekit.RotaryEmbedding", setup)


def _compat_hf_row() -> Row:
    def setup(case: Case):
        from ropekit.compat.hf import apply_rotary_pos_emb

        cos, sin = _hf_tables(case, case.q.dtype)  # HF's own tables, read in place
        return lambda q, k: apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)  # bshd: heads are axis 2

    return Row("ropekit.compat.hf", setup)


def _compat_vllm_row() -> Row:
    def setup(case: Case):
        from ropekit.compat.vllm import rotary_embedding

        cache = torch.cat([case.cos, case.sin], dim=-1)  # (L, D): vLLM's [cos | sin] cache
        positions = case.positions.reshape(-1)  # (T,): one position per token
        head_dim = case.shape.head_dim

        def fn(q, k):
            rotary_embedding(positions, q, k, head_dim, cache, True)  # in place, as vLLM's op
            return q, k

        return fn

    return Row("ropekit.compat.vllm in-place", setup, inplace=True, differentiable=False)


# ---- rows: peers ----------------------------------------------------------------------------------------


def _hf_tables(case: Case, dtype: torch.dtype):
    """HF's per-token tables: (B, S, D), each frequency twice (the half layout)."""
    cos = torch.cat([case.cos, case.cos], dim=-1)[case.positions].to(dtype)  # (B, S, D)
    sin = torch.cat([case.sin, case.sin], dim=-1)[case.positions].to(dtype)
    return cos, sin


def _hf_row(compiled: bool) -> Row:
    def setup(case: Case):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        fn = torch.compile(apply_rotary_pos_emb) if compiled else apply_rotary_pos_emb
        cos, sin = _hf_tables(case, case.q.dtype)
        return lambda q, k: fn(q, k, cos, sin, unsqueeze_dim=2)  # bshd: heads are axis 2

    return Row("HF + torch.compile" if compiled else "HF eager", setup, compiled=compiled)


def meta_complex_rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Meta's LLaMA form: pairs (2i, 2i+1) as complex numbers times e^{i m theta}.

    Shape: x (B, S, H, D); freqs_cis (B, S, 1, D/2) complex.
    """
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (B, S, H, D/2) complex
    return torch.view_as_real(z * freqs_cis).flatten(3).type_as(x)  # (B, S, H, D)


def _meta_row() -> Row:
    def setup(case: Case):
        angle = case.angle[case.positions].unsqueeze(2)  # (B, S, 1, D/2)
        freqs_cis = torch.polar(torch.ones_like(angle), angle)
        return lambda q, k: (meta_complex_rotary(q, freqs_cis), meta_complex_rotary(k, freqs_cis))

    return Row("Meta complex", setup, interleaved=True)


def _rotary_embedding_torch_row() -> Row:
    def setup(case: Case):
        from rotary_embedding_torch import apply_rotary_emb

        freqs = case.angle.repeat_interleave(2, dim=-1)[case.positions].unsqueeze(
            2
        )  # (B, S, 1, D), GPT-J pairs
        return lambda q, k: (apply_rotary_emb(freqs, q), apply_rotary_emb(freqs, k))

    return Row("rotary-embedding-torch", setup, interleaved=True)


def _torchtune_row() -> Row:
    def setup(case: Case):
        from torchtune.modules import RotaryPositionalEmbeddings

        rope = RotaryPositionalEmbeddings(case.shape.head_dim, case.cos.shape[0], base=500000.0)
        rope = rope.to(case.q.device)
        return lambda q, k: (rope(q, input_pos=case.positions), rope(k, input_pos=case.positions))

    return Row("torchtune", setup, interleaved=True)


def _flash_attn_row() -> Row:
    def setup(case: Case):
        from flash_attn.layers.rotary import apply_rotary_emb

        cos, sin = case.cos.to(case.q.dtype), case.sin.to(case.q.dtype)
        kw = dict(case.ropekit_kwargs)
        if "offsets" in kw:
            offsets = kw.pop("offsets")
            kw["seqlen_offsets"] = offsets if isinstance(offsets, int) else offsets.to(torch.int32)
        if "cu_seqlens" in kw:
            kw["max_seqlen"] = max(case.shape.seqlens)

            def fn(q, k):
                return tuple(apply_rotary_emb(x[0], cos, sin, **kw).unsqueeze(0) for x in (q, k))

            return fn
        return lambda q, k: (apply_rotary_emb(q, cos, sin, **kw), apply_rotary_emb(k, cos, sin, **kw))

    return Row("flash-attn", setup)


def _liger_row() -> Row:
    def setup(case: Case):
        from liger_kernel.transformers.rope import liger_rotary_pos_emb

        cos, sin = _hf_tables(case, case.q.dtype)

        def fn(q, k):  # Liger takes (B, H, S, D)
            out_q, out_k = liger_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            return out_q.transpose(1, 2), out_k.transpose(1, 2)

        return fn

    return Row("Liger", setup)


@dataclass(frozen=True)
class PeerRow:
    """A row that is not one of ropekit's backends: make() -> Row; skipped with a note when ``requires``
    (a module name, or "" for none) cannot be imported or the device is not in ``devices``."""

    make: Callable[[], Row]
    requires: str = ""
    devices: tuple[str, ...] = ("cpu", "cuda")


# Every row beyond ropekit's backends, in table order. Append a PeerRow to add one (a peer library, or another
# way of calling ropekit such as its compat APIs).
PEER_ROWS: list[PeerRow] = [
    PeerRow(_module_row),
    PeerRow(_compat_hf_row),
    PeerRow(_compat_vllm_row),
    PeerRow(lambda: _hf_row(False), "transformers"),
    PeerRow(lambda: _hf_row(True), "transformers"),
    PeerRow(_meta_row),
    PeerRow(_rotary_embedding_torch_row, "rotary_embedding_torch"),
    PeerRow(_torchtune_row, "torchtune.modules"),
    PeerRow(_flash_attn_row, "flash_attn.layers.rotary", devices=("cuda",)),
    PeerRow(_liger_row, "liger_kernel.transformers.rope", devices=("cuda",)),
]


def ropekit_backends(case: Case) -> tuple[list[str], list[str]]:
    """The backends to time on these inputs and a note for each other registered one, as decided by the
    dispatch (:func:`ropekit.backends.select_backend`): the one ``backend="auto"`` picks, plus the plain
    torch backend as the baseline."""
    chosen = select_backend("auto", case.q, case.cos).name
    names = list(dict.fromkeys([chosen, "torch"]))
    notes = []
    for name in BACKENDS:
        if name in names:
            continue
        try:
            select_backend(name, case.q, case.cos)
        except ValueError as err:
            notes.append(f"ropekit[{name}] skipped: {err}")
        else:
            notes.append(f"ropekit[{name}] skipped: backend='auto' picks {chosen!r} for these inputs")
    return names, notes


def build_rows(case: Case, include: list[str] | None = None) -> tuple[list[Row], list[str]]:
    """All rows that can run on these inputs, and a note for each that cannot. include: keep names containing
    any of these substrings (case-insensitive)."""
    names, notes = ropekit_backends(case)
    rows = [_ropekit_row(name, inplace) for name in names for inplace in (False, True)]
    for numerics in ("hf", "vllm"):  # the peers' bits, on the backend auto picks for the mode
        name = select_backend("auto", case.q, case.cos, numerics=numerics).name
        rows += [_ropekit_row(name, inplace, numerics) for inplace in (False, True)]
    for peer in PEER_ROWS:
        if case.q.device.type not in peer.devices:
            continue
        row = peer.make()
        if peer.requires:
            try:
                importlib.import_module(peer.requires)
            except Exception as err:  # any import failure means the peer cannot run here
                notes.append(
                    f"{row.name} skipped: cannot import {peer.requires} ({type(err).__name__}: {err})"[:200]
                )
                continue
        rows.append(row)
    if include:
        rows = [r for r in rows if any(s.lower() in r.name.lower() for s in include)]
    return rows, notes


# ---- measurement ----------------------------------------------------------------------------------------


class _LiveBytes(TorchDispatchMode):
    """Counts bytes held by op outputs while active; ``peak`` is the most held at once (CPU tracking)."""

    def __init__(self) -> None:
        super().__init__()
        self.live, self.peak, self.seen = 0, 0, set()

    def _free(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                key, nbytes = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
                if key in self.seen:
                    continue
                self.seen.add(key)
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, key, nbytes)
        return out


def _leaves(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    return case.q.detach().clone().requires_grad_(True), case.k.detach().clone().requires_grad_(True)


def _fwd_bwd(fn, q, k, grads) -> None:
    q.grad = k.grad = None
    torch.autograd.backward(list(fn(q, k)), list(grads))


def measure_memory(row: Row, fn, case: Case) -> tuple[float, float]:
    """(saved_mb, peak_mb) of one fwd+bwd; peak is NaN where it cannot be measured (compiled rows on CPU)."""
    q, k = _leaves(case)
    grads = (torch.ones_like(q), torch.ones_like(k))
    _fwd_bwd(fn, q, k, grads)  # warm caches and compilation outside the measurement
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    cuda = case.q.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    tracker = _LiveBytes()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if cuda:
            _fwd_bwd(fn, q, k, grads)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        elif row.compiled:
            _fwd_bwd(fn, q, k, grads)
            peak = math.nan
        else:
            with tracker:
                _fwd_bwd(fn, q, k, grads)
            peak = tracker.peak
    inputs = {q.untyped_storage().data_ptr(), k.untyped_storage().data_ptr()}
    saved_bytes = sum(n for ptr, n in saved.items() if ptr not in inputs)
    return saved_bytes / 2**20, peak / 2**20


def measure(fn: Callable[[], object], min_run_time: float) -> float:
    """Seconds per call of fn: torch.utils.benchmark's blocked_autorange (median block; CUDA synchronized)."""
    from torch.utils import benchmark

    return (
        benchmark.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median
    )


def run_benchmark(
    shapes: list[str],
    *,
    device: str = "cpu",
    dtype: str = "float32",
    repeats: int = 5,
    include: list[str] | None = None,
    memory: bool = True,
    min_run_time: float = MIN_RUN_TIME_S,
    log: Callable[[str], None] = lambda msg: None,
) -> tuple[list[dict], list[str]]:
    """Run every row on every shape; returns (records with :data:`COLUMNS`, notes on skipped rows).

    Each round measures every row for at least ``min_run_time`` seconds; figures are medians over rounds.

    Raises:
        ValueError: on an unknown shape, dtype or device, repeats < 1 or min_run_time <= 0.
    """
    for name in shapes:
        if name not in SHAPES:
            raise ValueError(f"shapes: expected names from {sorted(SHAPES)}, got {name!r}")
    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if dtype not in dtypes:
        raise ValueError(f"dtype: expected one of {sorted(dtypes)}, got {dtype!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' requested but torch.cuda.is_available() is False")
    check_int("repeats", repeats)
    if isinstance(min_run_time, bool) or not isinstance(min_run_time, (int, float)) or not min_run_time > 0:
        raise ValueError(f"min_run_time: expected a number of seconds > 0, got {min_run_time!r}")
    dev, torch_dtype = torch.device(device), dtypes[dtype]
    records, all_notes = [], []
    for shape_name in shapes:
        case = make_case(SHAPES[shape_name], torch_dtype, dev)
        rows, notes = build_rows(case, include)
        all_notes += [f"{shape_name}: {n}" for n in notes]
        records += _run_case(case, rows, min_run_time, repeats, memory, log)
        records += fused_records(case, COLUMNS, measure, include, min_run_time, repeats, log)
    return records, sorted(set(all_notes))


def _run_case(case, rows, min_run_time, repeats, memory, log) -> list[dict]:
    floors = {
        "copy_": copy_floor((case.q, case.k)),
        "clone": lambda: (case.q.clone(), case.k.clone()),
    }
    tasks: dict[str, dict[str, Callable]] = {name: {"fwd": f} for name, f in floors.items()}
    errors, notes = {}, {}
    grads = (torch.ones_like(case.q), torch.ones_like(case.k))
    # One pair of leaves serves every differentiable row (grads are reset per call): memory stays flat.
    q_leaf, k_leaf = _leaves(case)
    wants: dict[bool, tuple] = {}
    fns = {}
    for row in rows:
        log(f"{case.shape.name}: preparing {row.name}")
        try:
            fn = row.setup(case)
            if row.interleaved not in wants:
                wants[row.interleaved] = BACKENDS["torch"].rotate_qk(
                    case.q, case.k, case.cos, case.sin, case.positions, interleaved=row.interleaved,
                    conjugate=False, inplace=False,
                )  # fmt: skip
            # In-place rows get their own copy; the others read the shared inputs, which they never modify.
            q_in, k_in = (case.q.clone(), case.k.clone()) if row.inplace else (case.q, case.k)
            got = fn(q_in, k_in)
            errors[row.name] = max(
                float((g.float() - w.float()).abs().max())
                for g, w in zip(got, wants[row.interleaved], strict=True)
            )
            del got
        except Exception as err:  # a peer that fails on these inputs is reported, not fatal
            notes[row.name] = f"failed: {type(err).__name__}: {err}"[:200]
            continue
        fns[row.name] = fn
        task = {"fwd": (lambda fn=fn, q=q_in, k=k_in: fn(q, k))}
        if row.differentiable:
            task["fwd_bwd"] = lambda fn=fn: _fwd_bwd(fn, q_leaf, k_leaf, grads)
        tasks[row.name] = task
    del wants
    samples: dict[tuple[str, str], list[float]] = {(n, kind): [] for n, t in tasks.items() for kind in t}
    for r in range(repeats):  # interleaved: each round measures every row once, so drift hits all rows alike
        log(f"{case.shape.name}: round {r + 1}/{repeats}")
        for name, t in tasks.items():
            for kind, f in t.items():
                samples[(name, kind)].append(measure(f, min_run_time))
    med = {key: statistics.median(v) for key, v in samples.items()}
    records = []
    by_name = {row.name: row for row in rows}
    for name in tasks:
        row = by_name.get(name)
        fwd = med[(name, "fwd")]
        saved_mb = peak_mb = math.nan
        if memory and row is not None and row.differentiable:
            saved_mb, peak_mb = measure_memory(row, fns[name], case)
        err = errors.get(name, math.nan)
        tol = MISMATCH[case.q.dtype]
        records.append(
            {
                "shape": case.shape.name,
                "row": name,
                "device": case.q.device.type,
                "dtype": str(case.q.dtype).removeprefix("torch."),
                "fwd_ms": fwd * 1e3,
                "fwd_us": fwd * 1e6,
                "fwd_bwd_ms": med.get((name, "fwd_bwd"), math.nan) * 1e3,
                "fwd_gbps": 2 * case.nbytes / fwd / 1e9,
                "x_copy": fwd / med[("copy_", "fwd")],
                "x_clone": fwd / med[("clone", "fwd")],
                "saved_mb": saved_mb,
                "peak_mb": peak_mb,
                "max_err": err,
                "mb": 2 * case.nbytes / 2**20,  # q and k read and written once
                "x_unfused": math.nan,
                "note": "MISMATCH vs reference" if err > tol else "",
            }
        )
    for name, note in notes.items():
        records.append({c: math.nan for c in COLUMNS} | {"shape": case.shape.name, "row": name, "note": note})
    return records


# ---- output ---------------------------------------------------------------------------------------------


def write_csv(records: list[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for rec in records:
            writer.writerow({c: (f"{v:.4g}" if isinstance(v, float) else v) for c, v in rec.items()})


TABLE_COLUMNS = ("fwd_ms", "fwd_us", "fwd_bwd_ms", "fwd_gbps", "x_copy", "x_clone", "saved_mb", "peak_mb")


def format_table(records: list[dict]) -> str:
    """A fixed-width text table, one block per shape."""
    head = f"{'row':<26} {'fwd ms':>9} {'fwd us':>8} {'fwd+bwd ms':>10} {'GB/s':>7} {'x copy_':>7} "
    head += (
        f"{'x clone':>7} {'saved MB':>8} {'peak MB':>8} {'max err':>8} {'MB r+w':>8} {'x unfused':>9}  note"
    )
    lines = []
    for shape in dict.fromkeys(r["shape"] for r in records):
        lines += [f"== {shape} ==", head]
        for r in (r for r in records if r["shape"] == shape):
            nums = [r[c] for c in COLUMNS[COLUMNS.index("fwd_ms") : COLUMNS.index("max_err")]]
            widths = (9, 8, 10, 7, 7, 7, 8, 8)
            cells = " ".join(_fmt(v, w) for v, w in zip(nums, widths, strict=True))
            moved = f"{_fmt(r['mb'], 8)} {_fmt(r['x_unfused'], 9, '.2f')}"
            lines.append(f"{r['row']:<26} {cells} {_fmt(r['max_err'], 8, '.1e')} {moved}  {r['note']}")
    return "\n".join(lines)


def _fmt(value, width: int, spec: str = ".3g") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"{'-':>{width}}"
    return f"{value:>{width}{spec}}"


def figure(records: list[dict]):
    """Bar chart of forward time over copy_ per row, one group per shape; the legend sits right of the axes,
    so it never covers a bar. Returns the matplotlib Figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in records))
    names = list(dict.fromkeys(r["row"] for r in records if not math.isnan(r["x_copy"])))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(shapes) * len(names) / 4), 4))
    width = 0.8 / max(len(names), 1)
    palette = plt.get_cmap("tab20").colors  # 20 distinct colours: the default cycle repeats after 10 rows
    for i, name in enumerate(names):
        vals = [
            next((r["x_copy"] for r in records if r["shape"] == s and r["row"] == name), math.nan)
            for s in shapes
        ]
        ax.bar([j + i * width for j in range(len(shapes))], vals, width, label=name, color=palette[i % 20])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes)
    ax.set_yscale("log")
    ax.set_ylabel("forward time / copy_ of the same bytes")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    return fig


def plot(records: list[dict], path: str) -> None:
    """Save :func:`figure` to path (cropped to include the legend)."""
    import matplotlib.pyplot as plt

    fig = figure(records)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
