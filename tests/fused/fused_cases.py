"""Shared checks of the serving fusions, run per backend: torch and cpu in test_cache.py / test_fp8.py /
test_shift.py, Triton in fused_triton_cases.py under the interpreter.

Not collected on its own (no ``test_`` prefix). References: the float64 rotation of tests/rotary_reference.py
for values, and the FP8 rounding contract written out with torch ops (``(r / scale).clamp(-fmax, fmax)
.to(fp8)`` on the float32 rotation) for bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ropekit
from ropekit.backends import BACKENDS
from rotary_reference import reference_rotation, reference_tables, tolerance

TABLE_LEN = 64
LAYOUTS = ("flat", "nhd", "hnd")
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
PAGE_SIZE, PAGES = 4, 5  # 20 slots


def tables(rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return reference_tables(rotary_dim, TABLE_LEN)


def empty_cache(layout: str, heads: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A cache filled with random values, so that a test sees any slot written that should not be."""
    shape = {
        "flat": (PAGES * PAGE_SIZE, heads, width),
        "nhd": (PAGES, PAGE_SIZE, heads, width),
        "hnd": (PAGES, heads, PAGE_SIZE, width),
    }[layout]
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def slot_rows(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """The cache as (num_slots, heads, width): slot s = page * page_size + index."""
    if layout == "flat":
        return cache
    if layout == "nhd":
        return cache.flatten(0, 1)
    return cache.transpose(1, 2).flatten(0, 1)


def token_inputs(mode: str, heads: tuple[int, ...], width: int, dtype: torch.dtype, seed: int = 0):
    """(tensors with the given head counts, position kwargs, int positions of shape leading axes, leading).

    Modes: "offsets" (4-D, int offset), "offsets_per_seq" (4-D, one offset per row), "cu_seqlens" (packed),
    "positions" (packed (T, H, D) with positions (T,), no cu_seqlens)."""
    g = torch.Generator().manual_seed(seed)
    if mode in ("cu_seqlens", "positions"):
        lead = (7,)
    else:
        lead = (2, 3)
    tensors = [torch.randn(*lead, h, width, generator=g).to(dtype) for h in heads]
    if mode == "offsets":
        return tensors, {"offsets": 5}, np.arange(3)[None].repeat(2, 0) + 5, lead
    if mode == "offsets_per_seq":
        return tensors, {"offsets": torch.tensor([2, 30])}, np.arange(3)[None] + np.array([[2], [30]]), lead
    if mode == "cu_seqlens":
        cu = torch.tensor([0, 3, 7], dtype=torch.int32)
        return tensors, {"cu_seqlens": cu}, np.concatenate([np.arange(3), np.arange(4)]), lead
    pos = torch.randint(0, TABLE_LEN, lead, generator=g)
    return tensors, {"positions": pos}, pos.numpy(), lead


def some_slots(lead: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Distinct slots for every token, one of them -1 (padding, skipped)."""
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(lead))
    slots = torch.randperm(PAGES * PAGE_SIZE, generator=g)[:n]
    slots[1] = -1
    return slots.reshape(lead)


def contract_bytes(r: torch.Tensor, scale, fp8_dtype: torch.dtype) -> torch.Tensor:
    """The FP8 rounding contract on the float32 values r (..., heads, width): the bytes it stores."""
    scale = torch.as_tensor(scale, dtype=torch.float32).reshape(-1)
    fmax = torch.finfo(fp8_dtype).max
    return (r.float() / scale[:, None]).clamp(-fmax, fmax).to(fp8_dtype).view(torch.uint8)


def float32_rotation(x: torch.Tensor, cos, sin, positions: np.ndarray, interleaved: bool) -> torch.Tensor:
    """The float32 rotation r of the contract (the torch backend's float32 math on x in float32)."""
    rows = torch.from_numpy(np.asarray(positions)).long()
    return BACKENDS["torch"].rotate_qk(
        x.float(), None, cos, sin, rows, interleaved=interleaved, conjugate=False, inplace=False
    )[0]


# ---- RoPE + KV-cache write -------------------------------------------------------------------------------


def check_cache_write(backend, mode, layout, dtype, interleaved, inplace, partial=False):
    """q rotated, k rotated into the key cache and v copied into the value cache at the slots; every other
    slot, and k and v themselves, untouched; q unchanged unless inplace; version counters moved."""
    head_dim = 12
    cos, sin = tables(8 if partial else head_dim)
    (q, k, v), kw, pos, lead = token_inputs(mode, (4, 2, 2), head_dim, dtype, seed=3)
    slots = some_slots(lead)
    k_cache = empty_cache(layout, 2, head_dim, dtype, seed=4)
    v_cache = empty_cache(layout, 2, head_dim, dtype, seed=5)
    before = [t.clone() for t in (q, k, v, k_cache, v_cache)]
    versions = (k_cache._version, v_cache._version, q._version)
    out = ropekit.apply_rotary_qk_and_cache(
        q, k, v, cos, sin, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots, cache_layout=layout,
        interleaved=interleaved, inplace=inplace, backend=backend, **kw,
    )  # fmt: skip
    assert (out is q) == inplace
    assert torch.equal(k, before[1]) and torch.equal(v, before[2])
    if not inplace:
        assert torch.equal(q, before[0])
    tol = tolerance(dtype, 4.0)
    torch.testing.assert_close(
        out.double(), reference_rotation(before[0], cos, sin, pos, interleaved=interleaved), **tol
    )
    want_k = slot_rows(before[3], layout).double().clone()
    want_v = slot_rows(before[4], layout).clone()
    flat_slots, keep = slots.reshape(-1), slots.reshape(-1) >= 0
    k_rot = reference_rotation(k, cos, sin, pos, interleaved=interleaved).reshape(-1, 2, head_dim)
    want_k[flat_slots[keep]] = k_rot[keep]
    want_v[flat_slots[keep]] = v.reshape(-1, 2, head_dim)[keep]
    torch.testing.assert_close(slot_rows(k_cache, layout).double(), want_k, **tol)
    assert torch.equal(slot_rows(v_cache, layout), want_v)
    assert k_cache._version > versions[0] and v_cache._version > versions[1]
    if inplace:
        assert q._version > versions[2]


def check_cache_write_fp8(backend, layout, fp8_dtype, per_head):
    """An FP8 cache holds exactly the contract's bytes of the rotated k and the scaled v."""
    head_dim = 16
    cos, sin = tables(head_dim)
    (q, k, v), kw, pos, lead = token_inputs("positions", (4, 2, 2), head_dim, torch.float32, seed=6)
    k, v = k * 40, v * 40  # reach the saturating range of e4m3fn (448) through small scales
    slots = some_slots(lead, seed=1)
    k_scale = torch.tensor([0.05, 0.5]) if per_head else 0.05
    v_scale = torch.tensor(0.25)
    k_cache = empty_cache(layout, 2, head_dim, torch.float32, seed=7).to(fp8_dtype)
    v_cache = empty_cache(layout, 2, head_dim, torch.float32, seed=8).to(fp8_dtype)
    k_before, v_before = slot_rows(k_cache, layout).clone(), slot_rows(v_cache, layout).clone()
    ropekit.apply_rotary_qk_and_cache(
        q, k, v, cos, sin, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots, cache_layout=layout,
        k_scale=k_scale, v_scale=v_scale, backend=backend, **kw,
    )  # fmt: skip
    keep = slots >= 0
    want_k = k_before.view(torch.uint8).clone()
    want_v = v_before.view(torch.uint8).clone()
    want_k[slots[keep]] = contract_bytes(float32_rotation(k, cos, sin, pos, False), k_scale, fp8_dtype)[keep]
    want_v[slots[keep]] = contract_bytes(v, v_scale, fp8_dtype)[keep]
    assert torch.equal(slot_rows(k_cache, layout).view(torch.uint8), want_k)
    assert torch.equal(slot_rows(v_cache, layout).view(torch.uint8), want_v)


# ---- RoPE + FP8 ------------------------------------------------------------------------------------------


def check_fp8(backend, mode, fp8_dtype, interleaved, per_head, partial=False):
    """q_fp8 and k_fp8 equal the contract bit for bit, and the float64 reference to FP8 precision."""
    head_dim = 16
    cos, sin = tables(8 if partial else head_dim)
    (q, k), kw, pos, _ = token_inputs(mode, (4, 2), head_dim, torch.float32, seed=9)
    q = q * 100  # beyond e4m3fn's 448 after the 0.2 scale: saturation is exercised
    q_scale = torch.tensor([0.2, 0.5, 1.0, 3.0]) if per_head else 0.2
    k_scale = torch.tensor(0.01)
    q_before, k_before = q.clone(), k.clone()
    q8, k8 = ropekit.apply_rotary_qk_fp8(
        q, k, cos, sin, q_scale=q_scale, k_scale=k_scale, fp8_dtype=fp8_dtype, interleaved=interleaved,
        backend=backend, **kw,
    )  # fmt: skip
    assert torch.equal(q, q_before) and torch.equal(k, k_before)
    assert q8.dtype == k8.dtype == fp8_dtype and q8.shape == q.shape and k8.shape == k.shape
    for got, x, scale in ((q8, q, q_scale), (k8, k, k_scale)):
        r = float32_rotation(x, cos, sin, pos, interleaved)
        assert torch.equal(got.view(torch.uint8), contract_bytes(r, scale, fp8_dtype))
        fmax = torch.finfo(fp8_dtype).max
        want = reference_rotation(x, cos, sin, pos, interleaved=interleaved)
        want = (want / torch.as_tensor(scale, dtype=torch.float64).reshape(-1)[:, None]).clamp(-fmax, fmax)
        eps = torch.finfo(fp8_dtype).eps
        torch.testing.assert_close(got.double(), want, rtol=eps, atol=2 * torch.finfo(fp8_dtype).tiny)


def check_fp8_mla(backend, fp8_dtype):
    """The MLA form: four outputs; rope parts rotated, nope parts only scaled and cast."""
    cos, sin = tables(8)
    (q, k, q_nope, k_nope), kw, pos, _ = token_inputs("cu_seqlens", (4, 1, 4, 1), 8, torch.float32, seed=10)
    q_nope = torch.randn(7, 4, 24)
    k_nope = torch.randn(7, 1, 20)
    outs = ropekit.apply_rotary_qk_fp8(
        q, k, cos, sin, q_scale=0.5, k_scale=0.25, fp8_dtype=fp8_dtype, q_nope=q_nope, k_nope=k_nope,
        backend=backend, **kw,
    )  # fmt: skip
    assert len(outs) == 4
    assert [o.shape for o in outs] == [q.shape, k.shape, q_nope.shape, k_nope.shape]
    assert torch.equal(
        outs[0].view(torch.uint8), contract_bytes(float32_rotation(q, cos, sin, pos, False), 0.5, fp8_dtype)
    )
    assert torch.equal(
        outs[1].view(torch.uint8), contract_bytes(float32_rotation(k, cos, sin, pos, False), 0.25, fp8_dtype)
    )
    assert torch.equal(outs[2].view(torch.uint8), contract_bytes(q_nope, 0.5, fp8_dtype))
    assert torch.equal(outs[3].view(torch.uint8), contract_bytes(k_nope, 0.25, fp8_dtype))


# ---- cache shift -----------------------------------------------------------------------------------------


def check_shift(backend, layout, dtype, delta, interleaved, with_slots):
    """A cache written at positions p, then shifted by delta, equals one written at p + delta (to rounding);
    slots not named are untouched; the version counter moved."""
    head_dim = 12
    cos, sin = tables(head_dim)
    (k, v), _, _, lead = token_inputs("positions", (2, 2), head_dim, dtype, seed=11)
    slots = some_slots(lead, seed=2)
    p = torch.randint(20, 40, lead, generator=torch.Generator().manual_seed(12))
    caches = []
    for positions in (p, p + delta):
        k_cache = empty_cache(layout, 2, head_dim, dtype, seed=13)
        v_cache = empty_cache(layout, 2, head_dim, dtype, seed=14)
        ropekit.apply_rotary_qk_and_cache(
            torch.zeros(7, 1, head_dim, dtype=dtype), k, v, cos, sin, k_cache=k_cache, v_cache=v_cache,
            slot_mapping=slots, cache_layout=layout, positions=positions, interleaved=interleaved,
            backend="torch",
        )  # fmt: skip
        caches.append(k_cache)
    shifted, want = caches
    if with_slots:
        named = slots[slots >= 0]
        shift_slots = torch.cat([named, torch.tensor([-1])])
    else:
        shift_slots = None
    before = shifted.clone()
    version = shifted._version
    out = ropekit.shift_cache_(
        shifted, cos, sin, delta, cache_layout=layout, slots=shift_slots, interleaved=interleaved,
        backend=backend,
    )  # fmt: skip
    assert out is shifted and shifted._version > version
    got, want, before = (slot_rows(t, layout) for t in (shifted, want, before))
    written = slots[slots >= 0]
    tol = tolerance(dtype, 4.0)
    tol = {"rtol": 4 * tol["rtol"], "atol": 4 * tol["atol"]}  # two rotations: two roundings
    torch.testing.assert_close(got[written].double(), want[written].double(), **tol)
    others = torch.ones(got.shape[0], dtype=torch.bool)
    others[written] = False
    if with_slots:
        assert torch.equal(got[others], before[others])
    else:  # every slot moved: an unwritten slot is the reference rotation of its old value by delta
        rows = np.full(int(others.sum()), abs(delta))
        old = before[others].reshape(1, -1, 2, head_dim)
        moved = reference_rotation(old, cos, sin, rows[None], interleaved=interleaved, conjugate=delta < 0)
        torch.testing.assert_close(got[others].double(), moved.reshape(-1, 2, head_dim), **tol)


# ---- bad input: one ValueError, nothing written ----------------------------------------------------------


def check_errors_write_nothing(backend):
    """Each bad argument is one ValueError naming it, and both caches are unchanged afterwards."""
    head_dim = 8
    cos, sin = tables(head_dim)
    (q, k, v), kw, _, lead = token_inputs("positions", (2, 1, 1), head_dim, torch.float32, seed=15)
    slots = some_slots(lead)
    k_cache = empty_cache("nhd", 1, head_dim, torch.float32, seed=16)
    v_cache = empty_cache("nhd", 1, head_dim, torch.float32, seed=17)
    fp8_cache = empty_cache("nhd", 1, head_dim, torch.float32, seed=18).to(torch.float8_e4m3fn)
    saved = [t.clone() for t in (k_cache, v_cache, fp8_cache, q)]
    good = dict(
        k_cache=k_cache, v_cache=v_cache, slot_mapping=slots, cache_layout="nhd", backend=backend, **kw
    )
    late_slot = slots.clone()
    late_slot[-1] = PAGES * PAGE_SIZE  # one past the end, after tokens that would already be written
    cases = [
        ("cache_layout", dict(cache_layout="paged")),
        ("k_cache", dict(cache_layout="hnd")),  # shape says nhd; the layout is taken as given
        ("k_cache", dict(k_cache=k_cache[..., :4])),
        ("k_cache", dict(k_cache=k_cache.double())),
        ("v_cache", dict(v_cache=v_cache[:, :2])),
        ("slot_mapping", dict(slot_mapping=late_slot)),
        ("slot_mapping", dict(slot_mapping=slots.int())),
        ("slot_mapping", dict(slot_mapping=slots[:3])),
        ("k_scale", dict(k_cache=fp8_cache)),
        ("k_scale", dict(k_cache=fp8_cache, k_scale=0.0)),
        ("k_scale", dict(k_cache=fp8_cache, k_scale=torch.tensor([1.0, 2.0]))),
        ("k_scale", dict(k_cache=fp8_cache, k_scale=torch.tensor(-1.0))),
        ("v_scale", dict(v_scale=1.0)),
        ("backend", dict(backend="nope")),
    ]
    for name, change in cases:
        with pytest.raises(ValueError, match=name):
            ropekit.apply_rotary_qk_and_cache(q, k, v, cos, sin, **(good | change), inplace=True)
        for t, s in zip((k_cache, v_cache, fp8_cache, q), saved, strict=True):
            assert torch.equal(t.view(torch.uint8), s.view(torch.uint8)), (name, change)
    big = torch.full(lead, 63)
    big[-1] = TABLE_LEN  # a position past the table, after rows that would already be written
    with pytest.raises(ValueError, match="position"):
        ropekit.apply_rotary_qk_and_cache(q, k, v, cos, sin, **(good | {"positions": big}))
    with pytest.raises(ValueError, match="k_cache"):
        ropekit.shift_cache_(fp8_cache, cos, sin, 3, backend=backend)
    with pytest.raises(ValueError, match="slots"):
        ropekit.shift_cache_(k_cache, cos, sin, 3, slots=torch.tensor([0, 99]), backend=backend)
    with pytest.raises(ValueError, match="delta"):
        ropekit.shift_cache_(k_cache, cos, sin, -TABLE_LEN, backend=backend)
    with pytest.raises(ValueError, match="q_scale"):
        ropekit.apply_rotary_qk_fp8(
            q, k, cos, sin, q_scale=torch.zeros(2), k_scale=1.0, backend=backend, **kw
        )
    with pytest.raises(ValueError, match="fp8_dtype"):
        ropekit.apply_rotary_qk_fp8(
            q, k, cos, sin, q_scale=1.0, k_scale=1.0, fp8_dtype=torch.int8, backend=backend, **kw
        )
    for t, s in zip((k_cache, v_cache, fp8_cache, q), saved, strict=True):
        assert torch.equal(t.view(torch.uint8), s.view(torch.uint8))


def check_memory_rule(backend):
    """Issue 24, repro 2 and its kin: a written tensor (a cache, q in place) that shares memory with a tensor
    the call reads (k, v, a table, the slots) or another written one is a ValueError naming both, and nothing
    is written. Repro 2 (k a slice of the key cache) was off by 3.7 on the cpu backend."""
    cos, sin = ropekit.RopeConfig(16).cos_sin(64)
    kc, vc = torch.randn(10, 1, 16), torch.randn(10, 1, 16)  # "flat" caches (slots, heads, head_dim)
    q, v = torch.randn(6, 2, 16), torch.randn(6, 1, 16)
    common = dict(
        slot_mapping=torch.arange(1, 7), positions=torch.arange(6), cache_layout="flat", backend=backend
    )
    shared = torch.randn(12, 1, 16)
    cases = [  # (written, read, arguments)
        ("k_cache", "k", dict(k=kc[0:6])),  # repro 2
        ("v_cache", "v", dict(v=vc[4:10])),
        ("k_cache", "cos", dict(cos=kc.view(-1)[:48].view(6, 8), sin=sin[:6])),  # a table in the cache
        ("v_cache", "k_cache", dict(k_cache=shared[:10], v_cache=shared[2:])),
        ("q", "k", dict(q=q, k=q[:, :1], inplace=True)),
        ("q", "v_cache", dict(inplace=True)),  # q: the value cache's first six slots, rotated in place
    ]
    for written, read, change in cases:
        args = dict(q=None, k=torch.randn(6, 1, 16), v=v, cos=cos, sin=sin, k_cache=kc, v_cache=vc) | change
        if written == "q" and read == "v_cache":  # q a view of the value cache, rotated in place
            args["q"] = vc[:6]
        saved = [t.clone() for t in (kc, vc, shared, q)]
        names = rf"({written}|{read})"  # two written tensors are named in either order
        with pytest.raises(
            ValueError, match=rf"{names}: (it is written and shares memory with|the call writes) {names}"
        ):
            ropekit.apply_rotary_qk_and_cache(
                args.pop("q"),
                args.pop("k"),
                args.pop("v"),
                args.pop("cos"),
                sin=args.pop("sin"),
                **args,
                **common,
            )
        for t, s in zip((kc, vc, shared, q), saved, strict=True):
            assert torch.equal(t, s), (written, read)
    cache = torch.randn(4, 2, 1, 16)  # nhd: 8 slots
    before = cache.clone()
    with pytest.raises(ValueError, match=r"k_cache: it is written and shares memory with cos"):
        ropekit.shift_cache_(cache, cache.view(-1)[:64].view(8, 8), sin[:8], 1, backend=backend)
    assert torch.equal(cache, before)
    # The same memory through two storages (two from_numpy of one array): still one memory.
    memory = np.random.default_rng(0).standard_normal(10 * 16).astype(np.float32)
    k_cache = torch.from_numpy(memory).view(10, 1, 16)
    k_alias = torch.from_numpy(memory[16:]).view(9, 1, 16)[
        :6
    ]  # the cache's slots 1..6, through another storage
    before = memory.copy()
    with pytest.raises(ValueError, match=r"k_cache: it is written and shares memory with k"):
        ropekit.apply_rotary_qk_and_cache(None, k_alias, v, cos, sin, k_cache=k_cache, v_cache=vc, **common)
    assert np.array_equal(memory, before)


def check_duplicate_slots_are_refused(backend):
    """Issue 24, defect 3: shift_cache_ with slots [3, 3] rotated slot 3 twice on the cpu backend and once on
    torch; a slot twice in slot_mapping was "last token wins" on two backends and a race on a parallel one.
    Refused everywhere, before anything is written; -1 (a skipped token, vLLM's padding) may repeat."""
    cos, sin = ropekit.RopeConfig(16).cos_sin(64)
    cache = torch.randn(5, 1, 16)
    before = cache.clone()
    with pytest.raises(ValueError, match=r"slots: slot 3 is given twice \(tokens 0 and 1\)"):
        ropekit.shift_cache_(
            cache, cos, sin, 3, cache_layout="flat", slots=torch.tensor([3, 3]), backend=backend
        )
    assert torch.equal(cache, before)
    ropekit.shift_cache_(
        cache, cos, sin, 3, cache_layout="flat", slots=torch.tensor([-1, 3, -1]), backend=backend
    )
    once = before.clone()
    ropekit.shift_cache_(once[3:4], cos, sin, 3, cache_layout="flat", backend="torch")
    torch.testing.assert_close(cache, once, **tolerance(torch.float32))
    k, v = torch.randn(4, 1, 16), torch.randn(4, 1, 16)
    kc, vc = torch.zeros(8, 1, 16), torch.zeros(8, 1, 16)
    kw = dict(k_cache=kc, v_cache=vc, positions=torch.arange(4), cache_layout="flat", backend=backend)
    with pytest.raises(ValueError, match=r"slot_mapping: slot 5 is given twice \(tokens 1 and 3\)"):
        ropekit.apply_rotary_qk_and_cache(None, k, v, cos, sin, slot_mapping=torch.tensor([0, 5, 2, 5]), **kw)
    assert not kc.any() and not vc.any()
    ropekit.apply_rotary_qk_and_cache(None, k, v, cos, sin, slot_mapping=torch.tensor([-1, 5, -1, 2]), **kw)
    assert torch.equal(vc[5], v[1]) and torch.equal(vc[2], v[3]) and not vc[[0, 1, 3, 4, 6, 7]].any()


def check_wide_heads(backend):
    """Issue 24, defect 8: a head past the kernels' MAX_WIDTH (16,384 features) passed silently (20,000) or
    crashed the process (4,000,000: a scratch row sized by the input on the C stack). An explicit kernel
    backend refuses it; "auto" serves it with torch, exactly."""
    cos, sin = ropekit.RopeConfig(16).cos_sin(64)
    k = torch.randn(2, 1, 16)
    for width in (20000, 16385):
        v = torch.randn(2, 1, width)
        kc, vc = torch.zeros(4, 1, 16), torch.zeros(4, 1, width)
        kw = dict(k_cache=kc, v_cache=vc, slot_mapping=torch.tensor([0, 1]), positions=torch.arange(2),
                  cache_layout="flat")  # fmt: skip
        with pytest.raises(
            ValueError, match=rf"backend: '{backend}' serves heads of up to 16384 features, got"
        ):
            ropekit.apply_rotary_qk_and_cache(None, k, v, cos, sin, **kw, backend=backend)
        assert not vc.any()
        ropekit.apply_rotary_qk_and_cache(None, k, v, cos, sin, **kw, backend="auto")
        assert torch.equal(vc[:2], v)
