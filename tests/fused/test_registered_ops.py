"""The serving fusions as torch.library ops (registered in ropekit.fused.cache / fp8 / qk_norm / shift):
each passes torch.library.opcheck (schema, fake implementation, autograd registration, AOT dispatch) and
declares what it writes in place; a compiled decode step keeps them in one graph and agrees with eager."""

from __future__ import annotations

import pytest
import torch

import ropekit
from c_compiler import CPU

OPCHECK_BACKENDS = ["torch", CPU]
PAGES, PAGE_SIZE = 4, 4


def tables(head_dim: int = 16, rows: int = 64):
    return ropekit.RopeConfig(head_dim=head_dim).cos_sin(rows)


def cache_args(backend: str, layout: str = "nhd", fp8: bool = False):
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 3, 2, 16, generator=g), torch.randn(2, 3, 2, 16, generator=g)
    shape = {
        "flat": (PAGES * PAGE_SIZE, 2, 16),
        "nhd": (PAGES, PAGE_SIZE, 2, 16),
        "hnd": (PAGES, 2, PAGE_SIZE, 16),
    }
    dtype = torch.float8_e4m3fn if fp8 else torch.float32
    k_cache, v_cache = (torch.randn(shape[layout], generator=g).to(dtype) for _ in range(2))
    scale = torch.tensor([0.5]) if fp8 else None
    slots = torch.tensor([0, 5, -1, 3, 9, 12])
    cos, sin = tables()
    return (k, v, cos, sin, None, 2, slots, k_cache, v_cache, layout, False, scale, scale, backend)


@pytest.mark.parametrize("layout", ["flat", "nhd", "hnd"])
@pytest.mark.parametrize("backend", OPCHECK_BACKENDS)
def test_rope_and_cache_ops_pass_opcheck(backend, layout):
    q = torch.randn(2, 3, 4, 16)
    args = cache_args(backend, layout)
    torch.library.opcheck(torch.ops.ropekit.rotary_qk_and_cache.default, (q, torch.empty_like(q), *args))
    torch.library.opcheck(torch.ops.ropekit.rotary_qk_and_cache_.default, (q.clone(), *args))
    torch.library.opcheck(torch.ops.ropekit.rotary_qk_and_cache.default, (None, None, *args))  # caches only


@pytest.mark.parametrize("backend", OPCHECK_BACKENDS)
def test_rope_and_cache_op_with_fp8_caches_and_positions_passes_opcheck(backend):
    q = torch.randn(2, 3, 4, 16)
    args = list(cache_args(backend, fp8=True))
    args[4], args[5] = torch.tensor([0, 1, 2, 7, 8, 9]), 0  # positions (B * S,) instead of an offset
    # test_schema compares mutated values with float arithmetic that torch has no float8 kernel for;
    # the other float32 cases run it.
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    op = torch.ops.ropekit.rotary_qk_and_cache.default
    torch.library.opcheck(op, (q, torch.empty_like(q), *args), test_utils=utils)


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("backend", OPCHECK_BACKENDS)
def test_fp8_op_passes_opcheck(backend, mla):
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(7, 4, 16, generator=g), torch.randn(7, 2, 16, generator=g)  # packed (T, H, D)
    nopes = (torch.randn(7, 4, 8, generator=g), torch.randn(7, 2, 8, generator=g)) if mla else (None, None)
    cos, sin = tables()
    scale = torch.tensor([0.25])
    args = (q, k, cos, sin, torch.arange(3, 10), 0, scale, torch.full((2,), 0.5), torch.float8_e4m3fn, *nopes,
            False, backend)  # fmt: skip
    torch.library.opcheck(torch.ops.ropekit.rotary_qk_fp8.default, args)
    outs = torch.ops.ropekit.rotary_qk_fp8(*args)
    assert [o.shape for o in outs] == [t.shape for t in (q, k, *nopes) if t is not None]


@pytest.mark.parametrize("all_heads", [False, True])
@pytest.mark.parametrize("backend", OPCHECK_BACKENDS)
def test_qk_norm_op_passes_opcheck(backend, all_heads):
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(2, 3, (4 + 2 * 2) * 16, generator=g)
    q_weight = torch.randn(4 * 16 if all_heads else 16, generator=g)
    k_weight = torch.randn(2 * 16 if all_heads else 16, generator=g)
    cos, sin = tables()
    args = (qkv, q_weight, k_weight, cos, sin, None, 5, 4, 2, 16, 1e-6, 0.0, all_heads, not all_heads, False,
            backend)  # fmt: skip
    torch.library.opcheck(torch.ops.ropekit.qk_norm_rotary_.default, args)


@pytest.mark.parametrize("with_slots", [False, True])
@pytest.mark.parametrize("backend", OPCHECK_BACKENDS)
def test_shift_op_passes_opcheck(backend, with_slots):
    k_cache = torch.randn(PAGES, PAGE_SIZE, 2, 16)
    cos, sin = tables()
    slots = torch.tensor([0, 3, -1, 7]) if with_slots else None
    for delta in (5, -3):
        args = (k_cache, cos, sin, delta, "nhd", slots, False, backend)
        torch.library.opcheck(torch.ops.ropekit.shift_cache_.default, args)


def test_ops_declare_what_they_write_in_place():
    mutated = {
        name: [a.name for a in getattr(torch.ops.ropekit, name).default._schema.arguments if a.is_write]
        for name in ("rotary_qk_and_cache", "rotary_qk_and_cache_", "rotary_qk_fp8", "qk_norm_rotary_",
                     "shift_cache_")
    }  # fmt: skip
    assert mutated == {
        "rotary_qk_and_cache": ["q_out", "k_cache", "v_cache"],
        "rotary_qk_and_cache_": ["q", "k_cache", "v_cache"],
        "rotary_qk_fp8": [],
        "qk_norm_rotary_": ["qkv"],
        "shift_cache_": ["k_cache"],
    }


def test_the_registered_ops_keep_the_kernel_wall():
    k, v, cos, sin, pos, offset, slots, k_cache, v_cache, *rest = cache_args("cpu")
    with pytest.raises(ValueError, match=r"k: expected a torch.float32 tensor of shape \(2, 3, 1, 16\)"):
        torch.ops.ropekit.rotary_qk_and_cache(
            None, None, k, v, cos, sin, pos, offset, slots, k_cache[:, :, :1], v_cache, *rest
        )
    with pytest.raises(ValueError, match="v_cache: the call writes k_cache and v_cache, which share memory"):
        torch.ops.ropekit.rotary_qk_and_cache(
            None, None, k, v, cos, sin, pos, offset, slots, k_cache, k_cache, *rest
        )
    with pytest.raises(ValueError, match="delta"):
        torch.ops.ropekit.shift_cache_(k_cache, cos, sin, 64, "nhd", None, False, "cpu")
    with pytest.raises(ValueError, match="qkv: expected 128 features"):
        torch.ops.ropekit.qk_norm_rotary_(
            torch.zeros(2, 3, 64), torch.ones(16), torch.ones(16), cos, sin, None, 0, 4, 2, 16, 1e-6, 0.0,
            False, True, False, "cpu",
        )  # fmt: skip


def _decode_step(q, k, v, qkv, k_cache, v_cache, slots, offsets, cos, sin, q_weight, k_weight, backend):
    """One serving decode step through the three fusions: QK-norm + RoPE on the packed projection, RoPE +
    the cache write, RoPE + FP8 (per-sequence offsets, as a batch of sequences at different lengths)."""
    ropekit.qk_norm_rotary_(qkv, q_weight, k_weight, cos, sin, num_q_heads=4, num_kv_heads=2, head_dim=16,
                            eps=1e-6, offsets=offsets, backend=backend)  # fmt: skip
    q_rot = ropekit.apply_rotary_qk_and_cache(
        q,
        k,
        v,
        cos,
        sin,
        k_cache=k_cache,
        v_cache=v_cache,
        slot_mapping=slots,
        offsets=offsets,
        backend=backend,
    )
    q8, k8 = ropekit.apply_rotary_qk_fp8(q, k, cos, sin, q_scale=0.5, k_scale=0.5, offsets=offsets,
                                         backend=backend)  # fmt: skip
    return q_rot, q8.float(), k8.float()


@pytest.mark.parametrize("backend", [CPU, "torch"])
def test_compiled_decode_step_has_no_graph_break_and_matches_eager(backend):
    g = torch.Generator().manual_seed(3)
    cos, sin = tables()
    q, k, v = (
        torch.randn(2, 1, 4, 16, generator=g),
        torch.randn(2, 1, 2, 16, generator=g),
        torch.randn(2, 1, 2, 16, generator=g),
    )
    qkv = torch.randn(2, 1, 8 * 16, generator=g)
    q_weight, k_weight = 1 + 0.1 * torch.randn(16, generator=g), 1 + 0.1 * torch.randn(16, generator=g)
    slots, offsets = torch.tensor([[3], [9]]), torch.tensor([5, 17])
    caches = [torch.zeros(PAGES, PAGE_SIZE, 2, 16) for _ in range(4)]
    eager_qkv, compiled_qkv = qkv.clone(), qkv.clone()
    args = (slots, offsets, cos, sin, q_weight, k_weight, backend)
    seen = []

    def record(gm, inputs):  # the captured graph's calls, then AOT autograd (functionalization) as usual
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return torch._dynamo.lookup_backend("aot_eager")(gm, inputs)

    torch._dynamo.reset()
    with torch.no_grad():
        want = _decode_step(q, k, v, eager_qkv, caches[0], caches[1], *args)
        step = torch.compile(_decode_step, fullgraph=True, backend=record)
        got = step(q, k, v, compiled_qkv, caches[2], caches[3], *args)
    ops = {
        "ropekit.qk_norm_rotary_.default",
        "ropekit.rotary_qk_and_cache.default",
        "ropekit.rotary_qk_fp8.default",
    }
    assert ops <= set(seen), seen  # one opaque node each, in the one graph fullgraph=True demands
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch.equal(compiled_qkv, eager_qkv)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    assert caches[2].abs().sum() > 0  # the compiled step wrote the cache


def _in_place_step(q, k, v, k_cache, v_cache, slots, offsets, cos, sin):
    """RoPE into the caches with q rotated in place, then the cache shifted back by two positions."""
    ropekit.apply_rotary_qk_and_cache(q, k, v, cos, sin, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots,
                                      offsets=offsets, inplace=True, backend="cpu")  # fmt: skip
    ropekit.shift_cache_(k_cache, cos, sin, -2, backend="cpu")


@pytest.mark.c_compiler
def test_compiled_in_place_step_writes_q_and_the_caches_as_eager_does():
    g = torch.Generator().manual_seed(5)
    cos, sin = tables()
    q, k, v = (torch.randn(2, 1, h, 16, generator=g) for h in (4, 2, 2))
    slots, offsets = torch.tensor([[3], [9]]), torch.tensor([5, 17])
    caches = [torch.randn(PAGES, PAGE_SIZE, 2, 16, generator=g) for _ in range(2)]
    eager = (q.clone(), *(c.clone() for c in caches))
    compiled = (q.clone(), *(c.clone() for c in caches))
    torch._dynamo.reset()
    with torch.no_grad():
        _in_place_step(eager[0], k, v, eager[1], eager[2], slots, offsets, cos, sin)
        torch.compile(_in_place_step, fullgraph=True, backend="aot_eager")(
            compiled[0], k, v, compiled[1], compiled[2], slots, offsets, cos, sin
        )
    assert not torch.equal(eager[0], q)  # q was rotated in place
    for a, b in zip(compiled, eager, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("backend", OPCHECK_BACKENDS)
def test_the_registered_cache_ops_refuse_duplicate_slots_and_write_nothing(backend, in_place):
    q = torch.randn(2, 3, 4, 16)
    k, v, cos, sin, pos, offset, _, k_cache, v_cache, *rest = cache_args(backend)
    before = [t.clone() for t in (q, k_cache, v_cache)]
    slots = torch.tensor([0, 5, -1, 5, 9, 12])
    args = (k, v, cos, sin, pos, offset, slots, k_cache, v_cache, *rest)
    with pytest.raises(ValueError, match=r"slot_mapping: slot 5 is given twice \(tokens 1 and 3\)"):
        if in_place:
            torch.ops.ropekit.rotary_qk_and_cache_(q, *args)
        else:
            torch.ops.ropekit.rotary_qk_and_cache(q, torch.empty_like(q), *args)
    assert all(torch.equal(a, b) for a, b in zip((q, k_cache, v_cache), before, strict=True))
    skipped = torch.tensor([0, -1, -1, 3, 9, 12])  # -1 (a skipped token) may repeat
    torch.ops.ropekit.rotary_qk_and_cache(None, None, k, v, cos, sin, pos, offset, skipped, k_cache, v_cache,
                                          *rest)  # fmt: skip
    assert not torch.equal(k_cache, before[1])


def _sharing_tables(cache_shape):
    """cos and sin as (64, 8) tables whose memory a cache of cache_shape, laid inside cos, shares."""
    cos, sin = tables()
    storage = torch.zeros(cos.numel() + 1024)
    cos_view = storage[: cos.numel()].view(cos.shape)
    cos_view.copy_(cos)
    return cos_view, sin, storage[256 : 256 + torch.Size(cache_shape).numel()].view(cache_shape), storage


@pytest.mark.parametrize(
    "case", ["k_cache in cos", "v_cache in k", "q in k_cache", "slot_mapping in v_cache"]
)
@pytest.mark.parametrize("backend", OPCHECK_BACKENDS)
def test_the_registered_cache_ops_refuse_a_written_tensor_sharing_memory_and_write_nothing(backend, case):
    q = torch.randn(2, 3, 4, 16)
    k, v, cos, sin, pos, offset, slots, k_cache, v_cache, *rest = cache_args(backend)
    if case == "k_cache in cos":
        cos, sin, k_cache, storage = _sharing_tables(k_cache.shape)
        match = "k_cache: it is written and shares memory with cos, which the call reads"
    elif case == "v_cache in k":
        storage = torch.zeros(k.numel() + v_cache.numel())
        storage[: k.numel()].copy_(k.view(-1))
        k, v_cache = (
            storage[: k.numel()].view(k.shape),
            storage[64 : 64 + v_cache.numel()].view(v_cache.shape),
        )
        match = "v_cache: it is written and shares memory with k, which the call reads"
    elif case == "q in k_cache":  # q rotated in place inside k_cache's memory
        storage = k_cache.view(-1)
        q = storage[: q.numel()].view(q.shape)
        match = "k_cache: the call writes q and k_cache, which share memory"
    else:  # int64 slots laid in v_cache's bytes (the torch backend would write through them unchecked)
        storage = v_cache.view(-1)
        slots = torch.empty(0, dtype=torch.int64).set_(v_cache.untyped_storage(), 200, (6,), (1,))
        slots.copy_(cache_args(backend)[6])
        match = "v_cache: it is written and shares memory with slot_mapping, which the call reads"
    before = [t.clone() for t in (q, k_cache, v_cache, storage)]
    with pytest.raises(ValueError, match=match):
        torch.ops.ropekit.rotary_qk_and_cache_(q, k, v, cos, sin, pos, offset, slots, k_cache, v_cache, *rest)
    for a, b in zip((q, k_cache, v_cache, storage), before, strict=True):  # bit for bit: slot -1 reads as NaN
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("backend", OPCHECK_BACKENDS)
def test_the_registered_shift_op_refuses_duplicate_slots_and_writes_nothing(backend):
    k_cache = torch.randn(PAGES, PAGE_SIZE, 2, 16)
    cos, sin = tables()
    before = k_cache.clone()
    with pytest.raises(ValueError, match=r"slots: slot 3 is given twice \(tokens 1 and 2\)"):
        torch.ops.ropekit.shift_cache_(k_cache, cos, sin, 5, "nhd", torch.tensor([0, 3, 3]), False, backend)
    assert torch.equal(k_cache, before)
    torch.ops.ropekit.shift_cache_(k_cache, cos, sin, 5, "nhd", torch.tensor([0, -1, -1]), False, backend)
    assert not torch.equal(k_cache, before)  # -1 (a skipped slot) may repeat


@pytest.mark.parametrize("backend", OPCHECK_BACKENDS)
def test_the_registered_shift_op_refuses_a_cache_sharing_the_table_and_writes_nothing(backend):
    cos, sin, k_cache, storage = _sharing_tables((PAGES, PAGE_SIZE, 2, 16))
    before = storage.clone()
    with pytest.raises(ValueError, match="k_cache: it is written and shares memory with cos, which the call"):
        torch.ops.ropekit.shift_cache_(k_cache, cos, sin, 5, "nhd", None, False, backend)
    assert torch.equal(storage, before)


BAD_SCALES = [0.0, -1.0, float("nan"), float("inf")]


@pytest.mark.parametrize("bad", BAD_SCALES)
@pytest.mark.parametrize("which", ["q_scale", "k_scale"])
@pytest.mark.parametrize("backend", OPCHECK_BACKENDS)
def test_the_registered_fp8_op_refuses_a_scale_the_function_refuses(backend, which, bad):
    """Issue 39, defect 1: scale 0 saturated every byte of q; the op checks each scale's values as
    apply_rotary_qk_fp8 does (finite and > 0 in float32, as the kernel divides by it)."""
    q, k = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 2, 16)
    cos, sin = tables()
    scales = {"q_scale": torch.ones(1), "k_scale": torch.full((2,), 0.5)}
    scales[which] = torch.tensor([bad]) if which == "q_scale" else torch.tensor([0.5, bad])
    with pytest.raises(ValueError, match=rf"^{which}: expected every value a finite scale > 0"):
        torch.ops.ropekit.rotary_qk_fp8(q, k, cos, sin, None, 0, scales["q_scale"], scales["k_scale"],
                                        torch.float8_e4m3fn, None, None, False, backend)  # fmt: skip
    with pytest.raises(ValueError, match=rf"^{which}: expected every value a finite scale > 0"):
        public = {n: t.reshape(()) if t.numel() == 1 else t for n, t in scales.items()}  # (1,): 0-d
        ropekit.apply_rotary_qk_fp8(q, k, cos, sin, **public, backend=backend)  # the function's own words


# Scales a registered op does not take (the function turns numbers and 0-d tensors into (1,) float32).
MISSHAPEN_SCALES = {
    "0-d": torch.tensor(0.5),
    "float64": torch.tensor([0.5], dtype=torch.float64),
    "3 values for 2 heads": torch.full((3,), 0.5),
    "strided": torch.full((4,), 0.5)[::2],
    "2-D": torch.full((1, 1), 0.5),
}


@pytest.mark.parametrize("form", list(MISSHAPEN_SCALES))
@pytest.mark.parametrize("backend", OPCHECK_BACKENDS)
def test_the_registered_fp8_and_cache_ops_refuse_a_scale_not_in_the_ops_form_on_every_backend(backend, form):
    """Found by the fuzzer's op families (issue 39): a 0-d scale given to the op on the torch backend was an
    IndexError from inside the eager kernel; each backend now names the scale and its expected form."""
    bad = MISSHAPEN_SCALES[form]
    q, k = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 2, 16)
    cos, sin = tables()
    expected = r"^k_scale: expected a contiguous float32 tensor of 1 or 2 values on cpu"
    with pytest.raises(ValueError, match=expected):
        torch.ops.ropekit.rotary_qk_fp8(q, k, cos, sin, None, 0, torch.ones(1), bad, torch.float8_e4m3fn,
                                        None, None, False, backend)  # fmt: skip
    args = list(cache_args(backend, fp8=True))
    args[11] = bad
    k_cache = args[7]
    before = k_cache.view(torch.uint8).clone()
    with pytest.raises(ValueError, match=expected):
        torch.ops.ropekit.rotary_qk_and_cache(q, torch.empty_like(q), *args)
    assert torch.equal(k_cache.view(torch.uint8), before)


@pytest.mark.parametrize("given", ["q_nope", "k_nope"])
def test_the_registered_fp8_op_refuses_one_nope_part_without_the_other(given):
    """Issue 39 (an unclear error): q_nope without k_nope was an AttributeError."""
    q, k = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 2, 16)
    nopes = {"q_nope": None, "k_nope": None}
    nopes[given] = torch.randn(2, 3, 4 if given == "q_nope" else 2, 8)
    cos, sin = tables()
    with pytest.raises(ValueError, match=r"^q_nope, k_nope: expected both \(the MLA form\) or neither"):
        torch.ops.ropekit.rotary_qk_fp8(q, k, cos, sin, None, 0, torch.ones(1), torch.ones(1),
                                        torch.float8_e4m3fn, *nopes.values(), False, "cpu")  # fmt: skip


def _qk_norm_op(qkv, eps=1e-6, weight_offset=0.0, backend="cpu"):
    cos, sin = tables()
    torch.ops.ropekit.qk_norm_rotary_(qkv, torch.ones(16), torch.ones(16), cos, sin, None, 0, 4, 2, 16, eps,
                                      weight_offset, False, True, False, backend)  # fmt: skip


@pytest.mark.parametrize(
    "name, value",
    [("eps", -1.0), ("eps", 0.0), ("eps", float("nan")), ("eps", float("inf")),
     ("weight_offset", float("nan")), ("weight_offset", float("inf"))],
)  # fmt: skip
@pytest.mark.parametrize("backend", OPCHECK_BACKENDS)
def test_the_registered_qk_norm_op_refuses_an_eps_or_offset_the_function_refuses_and_writes_nothing(
    backend, name, value
):
    """Issue 39, defect 1: eps -1 (or NaN, or a NaN weight offset) wrote NaN into qkv."""
    qkv = torch.randn(2, 3, 128)
    before = qkv.clone()
    with pytest.raises(ValueError, match=rf"^{name}: expected a finite number"):
        _qk_norm_op(qkv, backend=backend, **{name: value})
    assert torch.equal(qkv, before)
    with pytest.raises(ValueError, match=rf"^{name}: expected a finite number"):  # the function's own words
        cos, sin = tables()
        ropekit.qk_norm_rotary_(qkv, torch.ones(16), torch.ones(16), cos, sin, num_q_heads=4, num_kv_heads=2,
                                head_dim=16, backend=backend, **{"eps": 1e-6, name: value})  # fmt: skip


def _fp8_cache_call(k_scale, v_scale, *, fp8=True, in_place=False):
    q = torch.randn(2, 3, 4, 16)
    k, v, cos, sin, pos, offset, slots, k_cache, v_cache, layout, interleaved, _, _, backend = cache_args(
        "cpu", fp8=fp8
    )
    before = [t.clone() for t in (q, k_cache, v_cache)]
    args = (k, v, cos, sin, pos, offset, slots, k_cache, v_cache, layout, interleaved, k_scale, v_scale,
            backend)  # fmt: skip
    try:
        if in_place:
            torch.ops.ropekit.rotary_qk_and_cache_(q, *args)
        else:
            torch.ops.ropekit.rotary_qk_and_cache(q, torch.empty_like(q), *args)
    finally:  # bit for bit (FP8 bytes)
        for a, b in zip((q, k_cache, v_cache), before, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "a refused call wrote"


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("bad", BAD_SCALES)
@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
def test_the_registered_cache_op_refuses_an_fp8_cache_scale_the_function_refuses(which, bad, in_place):
    """Issue 39, defect 1: k_scale 0 and v_scale -1 (which stored -v) were taken."""
    scales = {"k_scale": torch.ones(1), "v_scale": torch.ones(2)}
    scales[which] = torch.tensor([bad])
    with pytest.raises(ValueError, match=rf"^{which}: expected every value a finite scale > 0"):
        _fp8_cache_call(scales["k_scale"], scales["v_scale"], in_place=in_place)


@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
def test_the_registered_cache_op_refuses_a_scale_for_a_cache_that_is_not_fp8_and_needs_one_for_fp8(which):
    """Issue 39, defect 1: a scale given for a float32 cache was ignored silently; the function refuses it.
    An FP8 cache without its scale is refused in the function's words."""
    scales = {"k_scale": None, "v_scale": None}
    scales[which] = torch.full((1,), 2.0)
    with pytest.raises(ValueError, match=rf"^{which}: expected None for a torch.float32 cache"):
        _fp8_cache_call(scales["k_scale"], scales["v_scale"], fp8=False)
    scales = {"k_scale": torch.ones(1), "v_scale": torch.ones(1)}
    scales[which] = None
    with pytest.raises(ValueError, match=rf"^{which}: expected a scale for the torch.float8_e4m3fn cache"):
        _fp8_cache_call(scales["k_scale"], scales["v_scale"])


@pytest.mark.c_compiler  # the ops are called with backend 'cpu'
@pytest.mark.parametrize("op", ["rotary_qk_and_cache", "rotary_qk_and_cache_", "rotary_qk_fp8"])
def test_the_registered_serving_ops_are_inference_only_as_their_functions(op):
    """A source that requires grad (grad mode on) is refused before anything is written, as the function
    refuses it; under no_grad it is served."""
    q = torch.randn(2, 3, 4, 16)
    k, v, cos, sin, pos, offset, slots, k_cache, v_cache, *rest = cache_args("cpu")
    k = k.requires_grad_()
    before = k_cache.clone()
    if op == "rotary_qk_fp8":
        args = (q, k, cos, sin, None, 0, torch.ones(1), torch.ones(1), torch.float8_e4m3fn, None, None, False,
                "cpu")  # fmt: skip
    else:
        args = (k, v, cos, sin, pos, offset, slots, k_cache, v_cache, *rest)
        args = (q, *args) if op.endswith("_") else (q, torch.empty_like(q), *args)
    with pytest.raises(ValueError, match=r"^k: .* is inference only"):
        getattr(torch.ops.ropekit, op)(*args)
    assert torch.equal(k_cache, before)
    with torch.no_grad():
        getattr(torch.ops.ropekit, op)(*args)


SERVING_OPS = ["rotary_qk_and_cache", "rotary_qk_and_cache_", "rotary_qk_fp8", "qk_norm_rotary_"]


@pytest.mark.parametrize("op", SERVING_OPS)
def test_the_registered_serving_ops_refuse_an_offset_beside_positions(op):
    """Issue 39, defect 3 on the serving ops: positions are absolute, an offset beside them was dropped."""
    q = torch.randn(2, 3, 4, 16)
    k, v, cos, sin, _, _, slots, k_cache, v_cache, *rest = cache_args("cpu")
    positions = torch.arange(6)
    qkv = torch.randn(2, 3, 128)
    before = [t.clone() for t in (q, k_cache, qkv)]
    if op == "rotary_qk_fp8":
        args = (q, k, cos, sin, positions, 3, torch.ones(1), torch.ones(1), torch.float8_e4m3fn, None, None,
                False, "cpu")  # fmt: skip
    elif op == "qk_norm_rotary_":
        args = (qkv, torch.ones(16), torch.ones(16), cos, sin, positions, 3, 4, 2, 16, 1e-6, 0.0, False, True,
                False, "cpu")  # fmt: skip
    else:
        args = (k, v, cos, sin, positions, 3, slots, k_cache, v_cache, *rest)
        args = (q, *args) if op.endswith("_") else (q, torch.empty_like(q), *args)
    with pytest.raises(ValueError, match=r"^offsets: expected 0 when positions is given"):
        getattr(torch.ops.ropekit, op)(*args)
    assert all(torch.equal(a, b) for a, b in zip((q, k_cache, qkv), before, strict=True))


@pytest.mark.parametrize("backend", OPCHECK_BACKENDS)
def test_the_registered_shift_op_refuses_an_fp8_cache_as_the_function_does(backend):
    """The torch backend shifted an FP8 cache's bytes through the op; shift_cache_ refuses FP8 caches."""
    k_cache = torch.randn(PAGES, PAGE_SIZE, 2, 16).to(torch.float8_e4m3fn)
    cos, sin = tables()
    before = k_cache.view(torch.uint8).clone()
    with pytest.raises(ValueError, match=r"^k_cache: expected a float32, float16, bfloat16 or float64 cache"):
        torch.ops.ropekit.shift_cache_(k_cache, cos, sin, 5, "nhd", None, False, backend)
    assert torch.equal(k_cache.view(torch.uint8), before)


def test_the_registered_qk_norm_op_refuses_tables_that_require_grad_as_the_function_does():
    """qk_norm_rotary_ treats the tables as constants and refuses tables that require grad (they would get
    no gradient); so does its op."""
    qkv = torch.randn(2, 3, 128)
    before = qkv.clone()
    cos, sin = tables()
    cos.requires_grad_()
    with pytest.raises(ValueError, match=r"^cos, sin: expected tables that do not require grad"):
        torch.ops.ropekit.qk_norm_rotary_(qkv, torch.ones(16), torch.ones(16), cos, sin, None, 0, 4, 2, 16,
                                          1e-6, 0.0, False, True, False, "cpu")  # fmt: skip
    assert torch.equal(qkv, before)
