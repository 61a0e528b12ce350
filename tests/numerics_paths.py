"""The paths of docs/numerics.md's contract: a registry that tests/test_numerics.py draws two paths from.

A *case* is one set of logical tokens: a RoPE config, a dtype, q and k of shape (T, H, D) (T tokens, sequence
by sequence), and a batch composition (each sequence's length and first position, so token ``t`` of sequence
``s`` sits at position ``offsets[s] + t``), plus the float32 tables every functional path takes. A *path* is
one way of handing those tokens to ropekit: a backend, an entry point, a layout, a batch form (packed with
cu_seqlens, padded with per-sequence offsets, explicit positions, each sequence alone, one decode step a
token), in place or not, eager, traced or compiled. Each returns the rotated q and k in the canonical
(T, H, D) form, and the contract says any two return the same bits (``torch.equal``).

Two paths observe the rotation through something else, and are compared by its definition instead:

* ``fp8/*``: the rotation is not observable before quantisation. The contract: ``fp8 = (r / scale).clamp(
  -fmax, fmax).to(fp8)`` of the float32 rotation ``r``; ``r`` is what any other path returns for the same
  tokens in float32 (a float32 output is the float32 rotation, unrounded), so the FP8 bytes are compared with
  that definition applied to the other path's float32 output.
* ``qk_norm/*``: the rotation of the normalised values. The norm's own summation order is each backend's
  (the C loop's mean differs from torch's by up to an ulp), so the normalised values are the same backend's
  ``qk_norm_rotary_`` with an identity table (cos 1, sin 0: the norm alone, rounded to the dtype); the other
  path then rotates those, and the fused result must equal it.

These two are only compared with a plain path. Engines' paths (the vLLM / SGLang plugins, torchtitan's
override) live in their own tier: a test there adds its entries to :data:`PATHS` with :func:`register`.
Triton's paths run in a process started with ``TRITON_INTERPRET=1`` (tests/numerics_triton_cases.py).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from ropekit import (
    RopeConfig,
    RotaryEmbedding,
    apply_rotary,
    apply_rotary_qk,
    apply_rotary_qk_and_cache,
    apply_rotary_qk_fp8,
    qk_norm_rotary_,
)
from ropekit.compat import flash_attn as compat_flash_attn
from ropekit.compat import hf as compat_hf
from ropekit.compat import vllm as compat_vllm

__all__ = ["PATHS", "Case", "Path", "cases", "draw_paths", "observe", "register"]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Case:
    """One set of logical tokens and the float32 tables every path reads (see the module docstring)."""

    config: RopeConfig
    q: torch.Tensor  # (T, Hq, D)
    k: torch.Tensor  # (T, Hk, D)
    lengths: tuple[int, ...]  # each sequence's tokens
    offsets: tuple[int, ...]  # each sequence's first position
    seq_len: int | None  # the frequencies' length of a length-dependent schedule
    table_len: int
    garbage: int  # seed of the padding's values

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return torch.tensor([0, *torch.tensor(self.lengths).cumsum(0).tolist()], dtype=torch.int32)

    @property
    def positions(self) -> torch.Tensor:  # (T,) int64
        return torch.cat([torch.arange(o, o + n) for o, n in zip(self.offsets, self.lengths, strict=True)])

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.config.cos_sin(self.table_len, seq_len=self.seq_len)  # float32 (L, R/2)

    def with_inputs(self, q: torch.Tensor, k: torch.Tensor) -> Case:
        return dataclasses.replace(self, q=q, k=k)

    def __repr__(self) -> str:
        c = self.config
        return (
            f"Case(head_dim={c.head_dim}, rotary_dim={c.rotary_dim}, interleaved={c.interleaved}, "
            f"rotary_position={c.rotary_position!r}, scaling={c.scaling and dict(c.scaling)}, "
            f"dtype={self.dtype}, heads=({self.q.shape[1]}, {self.k.shape[1]}), lengths={self.lengths}, "
            f"offsets={self.offsets}, seq_len={self.seq_len}, table_len={self.table_len})"
        )


Rotated = tuple[torch.Tensor, torch.Tensor]  # q, k as (T, H, D)


@dataclass(frozen=True)
class Path:
    """run(case) -> (q, k) rotated, (T, H, D); applies(case): whether this path takes the case (a fused op
    has no rotary_position, HF's call no interleaved pairs); kind: "plain", "fp8" or "qk_norm" (see the
    module docstring)."""

    name: str
    run: Callable[[Case], Rotated]
    applies: Callable[[Case], bool] = lambda case: True
    kind: str = "plain"
    backend: str = "torch"
    compiles: bool = False  # a torch.compile a draw: seconds each, drawn by the compiled tests alone


PATHS: dict[str, Path] = {}


def register(path: Path) -> Path:
    if path.name in PATHS:
        raise ValueError(f"a path named {path.name!r} is registered already")
    PATHS[path.name] = path
    return path


# ---- the batch forms -----------------------------------------------------------------------------------


def _padded(case: Case, t: torch.Tensor) -> torch.Tensor:
    """(B, S_max, H, D): sequence b in row b, its tail filled with other values (padding)."""
    g = torch.Generator().manual_seed(case.garbage)
    batch, longest = len(case.lengths), max(case.lengths)
    out = (torch.randn(batch, longest, *t.shape[1:], generator=g) * 4).to(t.dtype)
    for b, piece in enumerate(_pieces(case, t)):
        out[b, : piece.shape[0]] = piece
    return out


def _unpad(case: Case, t: torch.Tensor) -> torch.Tensor:
    """(B, S_max, H, D) back to (T, H, D)."""
    return torch.cat([t[b, :n] for b, n in enumerate(case.lengths)])


def _pieces(case: Case, t: torch.Tensor) -> list[torch.Tensor]:
    return list(t.split(list(case.lengths)))


def _offsets(case: Case) -> torch.Tensor:
    return torch.tensor(case.offsets, dtype=torch.int64)


def _flags(case: Case) -> dict:
    return dict(interleaved=case.config.interleaved, rotary_position=case.config.rotary_position)


def _first(case: Case) -> bool:  # the fused ops and the peers rotate the leading rotary_dim features
    return case.config.rotary_position == "first"


# ---- functional ----------------------------------------------------------------------------------------


def _packed(backend: str, inplace: bool = False) -> Callable[[Case], Rotated]:
    def run(case):
        cos, sin = case.tables()
        q, k = (case.q.clone(), case.k.clone()) if inplace else (case.q, case.k)
        out = apply_rotary_qk(
            q, k, cos, sin, cu_seqlens=case.cu_seqlens, offsets=_offsets(case), inplace=inplace,
            backend=backend, **_flags(case),
        )  # fmt: skip
        if inplace:
            assert out[0] is q and out[1] is k
        return out

    return run


def _each_tensor(backend: str) -> Callable[[Case], Rotated]:
    """apply_rotary on q, then on k (one tensor a call)."""

    def run(case):
        cos, sin = case.tables()
        kw = dict(cu_seqlens=case.cu_seqlens, offsets=_offsets(case), backend=backend, **_flags(case))
        return apply_rotary(case.q, cos, sin, **kw), apply_rotary(case.k, cos, sin, **kw)

    return run


def _positions(backend: str) -> Callable[[Case], Rotated]:
    """Explicit positions, one batch row of T tokens."""

    def run(case):
        cos, sin = case.tables()
        q, k = apply_rotary_qk(
            case.q[None], case.k[None], cos, sin, positions=case.positions[None], backend=backend,
            **_flags(case),
        )  # fmt: skip
        return q[0], k[0]

    return run


def _padded_offsets(backend: str) -> Callable[[Case], Rotated]:
    """(B, S_max) with padding and a (B,) offsets tensor."""

    def run(case):
        cos, sin = case.tables()
        q, k = apply_rotary_qk(
            _padded(case, case.q), _padded(case, case.k), cos, sin, offsets=_offsets(case), backend=backend,
            **_flags(case),
        )  # fmt: skip
        return _unpad(case, q), _unpad(case, k)

    return run


def _alone(backend: str) -> Callable[[Case], Rotated]:
    """Each sequence in a call of its own, batch 1, an int offset."""

    def run(case):
        cos, sin = case.tables()
        outs = [
            apply_rotary_qk(q[None], k[None], cos, sin, offsets=o, backend=backend, **_flags(case))
            for q, k, o in zip(_pieces(case, case.q), _pieces(case, case.k), case.offsets, strict=True)
        ]
        return torch.cat([q[0] for q, _ in outs]), torch.cat([k[0] for _, k in outs])

    return run


def _decode(backend: str) -> Callable[[Case], Rotated]:
    """One token a call, (1, 1, H, D) at offset = its position: a decode step."""

    def run(case):
        cos, sin = case.tables()
        outs = [
            apply_rotary_qk(
                q[None, None], k[None, None], cos, sin, offsets=p, backend=backend, **_flags(case)
            )
            for q, k, p in zip(case.q, case.k, case.positions.tolist(), strict=True)
        ]
        return torch.cat([q[0] for q, _ in outs]), torch.cat([k[0] for _, k in outs])

    return run


def _hf_tables(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, full-width rows as HF's rotary modules return them, (1, T, R), still float32."""
    cos, sin = case.tables()
    rows = case.positions
    if case.config.interleaved:
        return cos[rows].repeat_interleave(2, -1)[None], sin[rows].repeat_interleave(2, -1)[None]
    return torch.cat([cos[rows]] * 2, -1)[None], torch.cat([sin[rows]] * 2, -1)[None]


def _per_token(backend: str) -> Callable[[Case], Rotated]:
    """The table forms: per-token full-width rows (per_token=True, full_width=True)."""

    def run(case):
        cos, sin = _hf_tables(case)
        q, k = apply_rotary_qk(
            case.q[None], case.k[None], cos, sin, per_token=True, full_width=True, backend=backend,
            **_flags(case),
        )  # fmt: skip
        return q[0], k[0]

    return run


def _packed_call(case: Case, backend: str) -> Callable[[torch.Tensor, torch.Tensor], Rotated]:
    """fn(q, k): the packed call on this case's tables, cu_seqlens and offsets (to trace or compile)."""
    cos, sin = case.tables()
    kw = dict(cu_seqlens=case.cu_seqlens, offsets=_offsets(case), backend=backend, **_flags(case))

    def fn(q, k):
        return apply_rotary_qk(q, k, cos, sin, **kw)

    return fn


def _traced(backend: str) -> Callable[[Case], Rotated]:
    """torch.jit.trace of the packed call, run on the same tensors."""

    def run(case):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)  # the trace holds this call's shapes
            warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.trace: still an entry point
            traced = torch.jit.trace(_packed_call(case, backend), (case.q, case.k), check_trace=False)
            return traced(case.q, case.k)

    return run


def _compiled(backend: str) -> Callable[[Case], Rotated]:
    """torch.compile(fullgraph=True) of the packed call (inductor)."""

    def run(case):
        torch._dynamo.reset()  # a fresh compile a draw: no cache limit reached, no eager fallback
        return torch.compile(_packed_call(case, backend), fullgraph=True, dynamic=False)(case.q, case.k)

    return run


# ---- the module, in its four layouts --------------------------------------------------------------------


def _module(layout: str, backend: str) -> Callable[[Case], Rotated]:
    def run(case):
        rope = RotaryEmbedding(case.config, layout=layout, backend=backend)
        if case.seq_len is not None:
            rope.freeze(case.seq_len)  # a length-dependent schedule: the tables' frequencies
        if layout == "thd":
            return rope(case.q, case.k, cu_seqlens=case.cu_seqlens, offsets=_offsets(case))
        q, k = _padded(case, case.q), _padded(case, case.k)  # (B, S, H, D)
        order = {"bshd": (0, 1, 2, 3), "bhsd": (0, 2, 1, 3), "sbhd": (1, 0, 2, 3)}[layout]
        q, k = rope(q.permute(order).contiguous(), k.permute(order).contiguous(), offsets=_offsets(case))
        return _unpad(case, q.permute(order)), _unpad(case, k.permute(order))

    return run


# ---- fused ---------------------------------------------------------------------------------------------


def _cache(backend: str) -> Callable[[Case], Rotated]:
    """apply_rotary_qk_and_cache: q returned, k read back from a flat cache at shuffled slots."""

    def run(case):
        cos, sin = case.tables()
        tokens, heads, dim = case.k.shape
        g = torch.Generator().manual_seed(case.garbage)
        slots = torch.randperm(tokens + 3, generator=g)[:tokens]
        k_cache = torch.zeros(tokens + 3, heads, dim, dtype=case.dtype)
        v_cache = torch.zeros_like(k_cache)
        q = apply_rotary_qk_and_cache(
            case.q, case.k, case.k.clone(), cos, sin, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots,
            cache_layout="flat", cu_seqlens=case.cu_seqlens, offsets=_offsets(case),
            interleaved=case.config.interleaved, backend=backend,
        )  # fmt: skip
        assert torch.equal(v_cache[slots], case.k)
        return q, k_cache[slots]

    return run


def _fp8(backend: str) -> Callable[[Case], Rotated]:
    """(q_fp8, k_fp8) as bytes; compared through the quantisation's definition (:func:`observe`)."""

    def run(case):
        cos, sin = case.tables()
        q_scale, k_scale = _fp8_scales(case)
        q, k = apply_rotary_qk_fp8(
            case.q, case.k, cos, sin, q_scale=q_scale, k_scale=k_scale, cu_seqlens=case.cu_seqlens,
            offsets=_offsets(case), interleaved=case.config.interleaved, backend=backend,
        )  # fmt: skip
        return q.view(torch.uint8), k.view(torch.uint8)

    return run


def _fp8_scales(case: Case) -> tuple[float, torch.Tensor]:
    """A per-tensor q scale and a per-head k scale, from the case's seed."""
    g = torch.Generator().manual_seed(case.garbage)
    return 0.125 * (1 + case.garbage % 7), torch.rand(case.k.shape[1], generator=g) + 0.05


def quantised(r: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """The contract's FP8 store of a float32 rotation r (T, H, D), as bytes."""
    scale = torch.as_tensor(scale, dtype=torch.float32).reshape(-1, 1)  # (1 or H, 1): per head
    fmax = torch.finfo(FP8).max
    return (r / scale).clamp(-fmax, fmax).to(FP8).view(torch.uint8)


_EPS = 1e-6


def _qk_norm_call(case: Case, backend: str, cos: torch.Tensor, sin: torch.Tensor) -> Rotated:
    q_heads, dim = case.q.shape[1:]
    k_heads = case.k.shape[1]
    g = torch.Generator().manual_seed(case.garbage)
    q_weight, k_weight = ((torch.rand(dim, generator=g) + 0.5).to(case.dtype) for _ in range(2))
    qkv = torch.cat([case.q.flatten(1), case.k.flatten(1), case.k.flatten(1)], 1)  # (T, W)
    qk_norm_rotary_(
        qkv, q_weight, k_weight, cos, sin, num_q_heads=q_heads, num_kv_heads=k_heads, head_dim=dim, eps=_EPS,
        cu_seqlens=case.cu_seqlens, offsets=_offsets(case), interleaved=case.config.interleaved,
        backend=backend,
    )  # fmt: skip
    q = qkv[:, : q_heads * dim].unflatten(1, (q_heads, dim))
    k = qkv[:, q_heads * dim : (q_heads + k_heads) * dim].unflatten(1, (k_heads, dim))
    return q, k


def _qk_norm(backend: str) -> Callable[[Case], Rotated]:
    def run(case):
        return _qk_norm_call(case, backend, *case.tables())

    return run


def normalised(case: Case, backend: str) -> Rotated:
    """The same backend's QK-norm alone: an identity rotation (cos 1, sin 0) of the normalised values."""
    cos, _ = case.tables()
    return _qk_norm_call(case, backend, torch.ones_like(cos), torch.zeros_like(cos))


# ---- the peers' call conventions -----------------------------------------------------------------------


def _flash_attn(backend: str) -> Callable[[Case], Rotated]:
    def run(case):
        cos, sin = case.tables()
        kw = dict(
            interleaved=case.config.interleaved, seqlen_offsets=_offsets(case), cu_seqlens=case.cu_seqlens,
            max_seqlen=max(case.lengths), backend=backend,
        )  # fmt: skip
        return (
            compat_flash_attn.apply_rotary_emb(case.q, cos, sin, **kw),
            compat_flash_attn.apply_rotary_emb(case.k, cos, sin, **kw),
        )

    return run


def _vllm(backend: str) -> Callable[[Case], Rotated]:
    """vLLM's / FlashInfer's apply_rope_with_cos_sin_cache: (T, H * D) tokens, a [cos | sin] cache."""

    def run(case):
        cos, sin = case.tables()
        q, k = compat_vllm.apply_rope_with_cos_sin_cache(
            case.positions, case.q.flatten(1), case.k.flatten(1), case.q.shape[-1], torch.cat([cos, sin], -1),
            is_neox=not case.config.interleaved, backend=backend,
        )  # fmt: skip
        return q.view(case.q.shape), k.view(case.k.shape)

    return run


def _hf(backend: str) -> Callable[[Case], Rotated]:
    """transformers' apply_rotary_pos_emb in ropekit: (1, H, T, D) and HF's per-token full-width rows."""

    def run(case):
        cos, sin = _hf_tables(case)
        q, k = compat_hf.apply_rotary_pos_emb(
            case.q.transpose(0, 1)[None], case.k.transpose(0, 1)[None], cos, sin, backend=backend
        )
        return q[0].transpose(0, 1), k[0].transpose(0, 1)

    return run


def _hf_form(case: Case) -> bool:  # HF's rotate_half on the whole head
    return _first(case) and not case.config.interleaved and case.config.rotary_dim == case.config.head_dim


# ---- the registry --------------------------------------------------------------------------------------

BACKENDS = ("torch", "cpu", "triton")
_EVERYWHERE = {
    "packed": _packed,
    "packed-inplace": lambda b: _packed(b, inplace=True),
    "each-tensor": _each_tensor,
    "positions": _positions,
    "padded": _padded_offsets,
    "alone": _alone,
    "decode": _decode,
    "per-token": _per_token,
    "traced": _traced,
}
_LAYOUTS = ("thd", "bshd", "bhsd", "sbhd")
_FIRST_ONLY = {"cache": _cache, "flash_attn": _flash_attn, "vllm": _vllm}
for _backend in BACKENDS:
    for _name, _make in _EVERYWHERE.items():
        register(Path(f"{_name}/{_backend}", _make(_backend), backend=_backend))
    for _layout in _LAYOUTS:
        register(Path(f"module-{_layout}/{_backend}", _module(_layout, _backend), backend=_backend))
    for _name, _make in _FIRST_ONLY.items():
        register(Path(f"{_name}/{_backend}", _make(_backend), _first, backend=_backend))
    register(Path(f"hf/{_backend}", _hf(_backend), _hf_form, backend=_backend))
    register(Path(f"compiled/{_backend}", _compiled(_backend), backend=_backend, compiles=True))
    register(Path(f"fp8/{_backend}", _fp8(_backend), _first, kind="fp8", backend=_backend))
    register(Path(f"qk_norm/{_backend}", _qk_norm(_backend), _first, kind="qk_norm", backend=_backend))


def observe(a: Path, b: Path, case: Case) -> tuple[Rotated, Rotated]:
    """What the contract holds equal for paths a and b on this case: their outputs, or, for an fp8 or
    qk_norm path (b must then be plain), its output and the plain path's through the fused op's definition."""
    if a.kind == "plain":
        a, b = b, a
    if b.kind != "plain":
        raise ValueError(f"{a.name} and {b.name}: a fused path is compared with a plain one")
    if a.kind == "plain":
        return a.run(case), b.run(case)
    if a.kind == "fp8":
        r_q, r_k = b.run(case.with_inputs(case.q.float(), case.k.float()))  # the float32 rotation
        q_scale, k_scale = _fp8_scales(case)
        return a.run(case), (quantised(r_q, q_scale), quantised(r_k, k_scale))
    normed = normalised(case, a.backend)
    return a.run(case), b.run(case.with_inputs(*(t.contiguous() for t in normed)))


# ---- drawing a case ------------------------------------------------------------------------------------


def _scalings(rotary_dim: int) -> st.SearchStrategy:
    """A scaling dict of each family, with the length it is read at (length-dependent ones: drawn)."""
    half = rotary_dim // 2
    factors = st.sampled_from([2.0, 4.0, 8.0])
    lists = st.lists(st.floats(1.0, 8.0, width=32), min_size=half, max_size=half)
    return st.one_of(
        st.none(),
        factors.map(lambda f: {"rope_type": "linear", "factor": f}),
        factors.map(lambda f: {"rope_type": "ntk", "factor": f}),
        factors.map(lambda f: {"rope_type": "dynamic", "factor": f}),
        factors.map(lambda f: {"rope_type": "yarn", "factor": f, "original_max_position_embeddings": 16}),
        factors.map(
            lambda f: dict(
                rope_type="llama3",
                factor=f,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            )
        ),
        st.tuples(lists, lists).map(
            lambda sl: dict(
                rope_type="longrope",
                short_factor=sl[0],
                long_factor=sl[1],
                original_max_position_embeddings=16,
            )
        ),
    )


@st.composite
def cases(draw, *, max_tokens: int = 24) -> Case:
    head_dim = draw(st.sampled_from([4, 8, 12, 16, 32, 64]))
    rotary_dim = draw(st.sampled_from(sorted({head_dim, *range(4, head_dim, 2)})))  # NTK forms need > 2)
    scaling = draw(_scalings(rotary_dim))
    config = RopeConfig(
        head_dim, draw(st.sampled_from([10000.0, 500000.0])), rotary_dim=rotary_dim,
        interleaved=draw(st.booleans()), scaling=scaling, max_position_embeddings=32,
        rotary_position=draw(st.sampled_from(["first", "first", "last"])),
    )  # fmt: skip
    n = draw(st.integers(1, 4))
    lengths = tuple(draw(st.lists(st.integers(1, 8), min_size=n, max_size=n)))
    while sum(lengths) > max_tokens:
        lengths = lengths[:-1]
    offsets = tuple(draw(st.lists(st.integers(0, 40), min_size=len(lengths), max_size=len(lengths))))
    table_len = max(offsets) + max(lengths) + draw(st.integers(0, 3))  # the padded rows read the table too
    seq_len = draw(st.sampled_from([8, 16, 17, 64, 100])) if config.length_dependent else None
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    q_heads, k_heads = draw(st.integers(1, 4)), draw(st.integers(1, 2))
    magnitude = draw(st.sampled_from([1.0, 30.0]))
    q = (torch.randn(sum(lengths), q_heads, head_dim, generator=g) * magnitude).to(dtype)
    k = (torch.randn(sum(lengths), k_heads, head_dim, generator=g) * magnitude).to(dtype)
    return Case(config, q, k, lengths, offsets, seq_len, table_len, seed)


def draw_paths(data, case: Case, first: tuple[str, ...], other: tuple[str, ...], *, compiles: bool = False):
    """Two paths that take case: a of a backend in first (with compiles, a compiled one), b any other one of
    a backend in other (plain when a is not: a fused path is compared with a plain one)."""
    firsts = [p for p in PATHS.values() if p.backend in first and p.compiles == compiles and p.applies(case)]
    a = data.draw(st.sampled_from(firsts), label="path a")
    others = [
        p
        for p in PATHS.values()
        if p.backend in other and not p.compiles and p is not a and p.applies(case)
        and (a.kind == "plain" or p.kind == "plain")
    ]  # fmt: skip
    return a, data.draw(st.sampled_from(others), label="path b")
