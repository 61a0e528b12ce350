"""Launch plans of the serving fusions (ropekit.fused.planned): a steady decode step of
apply_rotary_qk_and_cache is a key, a lookup, the value checks that cannot be planned and one C call; a plan
never changes an answer: a row past the table, a slot outside the cache or shared memory still raises the
checked path's error with nothing written, and anything a check relied on misses the plan."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fused_cases import contract_bytes, float32_rotation

import ropekit
from call_count import ropekit_calls
from ropekit.backends import clear_backend_cache, plan
from rotary_reference import assert_matches_reference

# The issue-25 budget: Python calls inside ropekit per steady-state fused decode step.
CALL_BUDGET = 8
SHAPES = {"flat": (64, 8, 128), "nhd": (4, 16, 8, 128), "hnd": (4, 8, 16, 128)}


def decode_inputs(batch: int, layout: str, per_sequence: bool, seed: int = 0):
    """Llama-3-8B heads (32 q, 8 kv, head_dim 128), one token per sequence, and a cache of 64 slots."""
    g = torch.Generator().manual_seed(seed)
    cos, sin = ropekit.RopeConfig(head_dim=128).cos_sin(2048)
    q, k, v = (torch.randn(batch, 1, h, 128, generator=g) for h in (32, 8, 8))
    caches = [torch.randn(SHAPES[layout], generator=g) for _ in range(2)]
    slots = torch.randperm(64, generator=g)[:batch].view(batch, 1)
    offsets = torch.randint(0, 2000, (batch,), generator=g) if per_sequence else 1000
    return q, k, v, cos, sin, caches, slots, offsets


def call(q, k, v, cos, sin, caches, slots, offsets, layout, inplace, backend="cpu"):
    return ropekit.apply_rotary_qk_and_cache(
        q, k, v, cos, sin, k_cache=caches[0], v_cache=caches[1], slot_mapping=slots, cache_layout=layout,
        offsets=offsets, inplace=inplace, backend=backend,
    )  # fmt: skip


@pytest.mark.c_compiler
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("per_sequence", [False, True])
@pytest.mark.parametrize("layout", ["flat", "nhd", "hnd"])
def test_steady_fused_decode_step_makes_at_most_8_ropekit_calls_and_matches_the_torch_path(
    layout, per_sequence, inplace
):
    q, k, v, cos, sin, caches, slots, offsets = decode_inputs(4, layout, per_sequence)
    want_caches = [c.clone() for c in caches]
    want = call(q.clone(), k, v, cos, sin, want_caches, slots, offsets, layout, inplace, backend="torch")
    call(q.clone(), k, v, cos, sin, [c.clone() for c in caches], slots, offsets, layout, inplace)  # plans
    q_in = q.clone()
    got = []
    calls = ropekit_calls(
        lambda: got.append(call(q_in, k, v, cos, sin, caches, slots, offsets, layout, inplace))
    )
    assert len(calls) <= CALL_BUDGET, calls
    assert "run" in calls and "check_slots" not in calls and "resolve" not in calls  # the plan served it
    torch.testing.assert_close(got[0], want, rtol=0, atol=1e-6)
    assert (got[0] is q_in) == inplace
    for cache, ref in zip(caches, want_caches, strict=True):
        torch.testing.assert_close(cache, ref, rtol=0, atol=1e-6)


def planned_step(per_sequence=False, inplace=True, layout="nhd"):
    """Inputs whose key has a plan (one call made), to call again with a changed value."""
    plan.clear_plans()
    q, k, v, cos, sin, caches, slots, offsets = decode_inputs(2, layout, per_sequence)
    call(q.clone(), k, v, cos, sin, caches, slots, offsets, layout, inplace)
    assert "run" in ropekit_calls(
        lambda: call(q.clone(), k, v, cos, sin, caches, slots, offsets, layout, inplace)
    )
    return q, k, v, cos, sin, caches, slots, offsets


@pytest.mark.c_compiler
def test_an_int_offset_past_the_table_raises_the_checked_error_and_writes_nothing():
    q, k, v, cos, sin, caches, slots, _ = planned_step()
    before = [c.clone() for c in caches]
    with pytest.raises(ValueError, match="positions: largest position 2048 is past the cos/sin table"):
        call(q, k, v, cos, sin, caches, slots, 2048, "nhd", True)
    assert all(torch.equal(a, b) for a, b in zip(caches, before, strict=True))


@pytest.mark.c_compiler
def test_per_sequence_offsets_past_the_table_or_negative_raise_the_checked_error():
    q, k, v, cos, sin, caches, slots, _ = planned_step(per_sequence=True)
    before = [c.clone() for c in caches]
    with pytest.raises(ValueError, match="positions: largest position 5000 is past the cos/sin table"):
        call(q, k, v, cos, sin, caches, slots, torch.tensor([3, 5000]), "nhd", True)
    with pytest.raises(ValueError, match="offsets: expected values >= 0, got a minimum of -1"):
        call(q, k, v, cos, sin, caches, slots, torch.tensor([-1, 4]), "nhd", True)
    assert all(torch.equal(a, b) for a, b in zip(caches, before, strict=True))


@pytest.mark.c_compiler
@pytest.mark.parametrize("bad", [64, -2])
def test_a_slot_outside_the_cache_raises_the_checked_error_and_writes_nothing(bad):
    q, k, v, cos, sin, caches, _, offsets = planned_step()
    before, q_before = [c.clone() for c in caches], q.clone()
    with pytest.raises(ValueError, match=f"slot_mapping: slot {bad}"):
        call(q, k, v, cos, sin, caches, torch.tensor([[1], [bad]]), offsets, "nhd", True)
    assert all(torch.equal(a, b) for a, b in zip(caches, before, strict=True)) and torch.equal(q, q_before)


@pytest.mark.c_compiler
def test_shared_memory_still_raises_after_a_plan():
    q, k, v, cos, sin, caches, slots, offsets = planned_step()
    with pytest.raises(ValueError, match="v_cache: the call writes k_cache and v_cache, which share memory"):
        call(q, k, v, cos, sin, [caches[0], caches[0]], slots, offsets, "nhd", True)
    buffer = torch.randn(2, 1, 48, 128)  # q and k as views of one buffer, k's heads inside q's
    q_view, k_view = buffer[:, :, :32], buffer[:, :, 24:32]
    call(q.clone(), k_view.clone(), v, cos, sin, caches, slots, offsets, "nhd", True)  # plan the strides
    with pytest.raises(ValueError, match="q: it is written and shares memory with k, which the call reads"):
        call(q_view, k_view, v, cos, sin, caches, slots, offsets, "nhd", True)


@pytest.mark.c_compiler
def test_views_of_one_packed_qkv_buffer_use_the_plan():
    q, k, v, cos, sin, caches, slots, offsets = planned_step()
    qkv = torch.cat([q, k, v], dim=2)  # (B, 1, 48, 128): vLLM's packed projection
    qkv_before = qkv.clone()
    views = qkv[:, :, :32], qkv[:, :, 32:40], qkv[:, :, 40:]
    want = [c.clone() for c in caches]
    ref = call(views[0].clone(), views[1], views[2], cos, sin, want, slots, offsets, "nhd", True, "torch")
    spare = qkv.clone()  # same strides: its call plans the key
    call(spare[:, :, :32], spare[:, :, 32:40], spare[:, :, 40:], cos, sin, [c.clone() for c in caches], slots,
         offsets, "nhd", True)  # fmt: skip
    call(*views, cos, sin, [c.clone() for c in caches], slots, offsets, "nhd", True)  # learns the distances
    views[0].copy_(qkv_before[:, :, :32])
    calls = ropekit_calls(lambda: call(*views, cos, sin, caches, slots, offsets, "nhd", True))
    assert "run" in calls and "check_disjoint" not in calls and len(calls) <= CALL_BUDGET, calls
    torch.testing.assert_close(views[0], ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(caches[0], want[0], rtol=0, atol=1e-6)


@pytest.mark.c_compiler
def test_the_plan_tells_autograd_what_it_wrote():
    q, k, v, cos, sin, caches, slots, offsets = planned_step()
    versions = [t._version for t in (q, *caches)]
    call(q, k, v, cos, sin, caches, slots, offsets, "nhd", True)
    assert [t._version for t in (q, *caches)] == [n + 1 for n in versions]


@pytest.mark.c_compiler
@pytest.mark.parametrize(
    "change", ["transposed cache", "other dtype", "requires grad", "positions", "scale", "float64 table"]
)
def test_anything_a_check_relied_on_misses_the_plan(change):
    q, k, v, cos, sin, caches, slots, offsets = planned_step()
    kw = {}
    if change == "transposed cache":  # same shape, other strides: a cache that is not stride-1 per head
        caches = [c.transpose(-1, -2).contiguous().transpose(-1, -2) for c in caches]
        match = "k_cache: expected a last axis of stride 1"
    elif change == "other dtype":
        k = k.double()
        match = "k: expected q's dtype torch.float32"
    elif change == "requires grad":
        k = k.requires_grad_()
        match = "k: apply_rotary_qk_and_cache is inference only"
    elif change == "positions":
        kw = dict(positions=torch.tensor([[1], [2]]), offsets=0)
        match = None
    elif change == "float64 table":  # converted per call by the checked path: never planned
        cos, sin = cos.double(), sin.double()
        match = None
    else:
        kw = dict(k_scale=1.0)
        match = "k_scale: expected None for a torch.float32 cache"
    step = lambda: ropekit.apply_rotary_qk_and_cache(  # noqa: E731
        q, k, v, cos, sin, k_cache=caches[0], v_cache=caches[1], slot_mapping=slots,
        **({"offsets": offsets} | kw), inplace=True, backend="cpu",
    )  # fmt: skip
    if match is None:  # a new kind: its first call takes the checked path (positions: then its own plan)
        assert "check_slots" in ropekit_calls(step)
        if change == "float64 table":
            assert "check_slots" in ropekit_calls(step)
    else:
        with pytest.raises(ValueError, match=match):
            step()


def test_other_backends_have_no_plan_and_keep_the_checked_path():
    clear_backend_cache()
    q, k, v, cos, sin, caches, slots, offsets = decode_inputs(2, "nhd", False)
    for _ in range(2):
        call(q, k, v, cos, sin, caches, slots, offsets, "nhd", True, backend="torch")
    assert "check_slots" in ropekit_calls(
        lambda: call(q, k, v, cos, sin, caches, slots, offsets, "nhd", True, "torch")
    )


def qk_norm_inputs(form: str, seed: int = 0):
    """A Qwen3-style packed qkv of 4 tokens (32 q, 8 kv heads, head_dim 128) and its position kwargs."""
    g = torch.Generator().manual_seed(seed)
    cos, sin = ropekit.RopeConfig(head_dim=128).cos_sin(2048)
    weights = [1 + 0.1 * torch.randn(128, generator=g) for _ in range(2)]
    if form == "positions":  # vLLM's (T, W) with a position per token
        qkv = torch.randn(4, 48 * 128, generator=g)
        kw = dict(positions=torch.tensor([7, 100, 3, 2000]))
    else:  # (B, 1, W): a decode step
        qkv = torch.randn(4, 1, 48 * 128, generator=g)
        kw = dict(offsets=torch.tensor([7, 100, 3, 2000]) if form == "offsets_per_seq" else 1000)
    return qkv, weights, cos, sin, kw


def qk_norm_call(qkv, weights, cos, sin, kw, backend="cpu"):
    return ropekit.qk_norm_rotary_(qkv, *weights, cos, sin, num_q_heads=32, num_kv_heads=8, head_dim=128,
                                   eps=1e-6, backend=backend, **kw)  # fmt: skip


@pytest.mark.c_compiler
@pytest.mark.parametrize("form", ["offset", "offsets_per_seq", "positions"])
def test_steady_qk_norm_step_makes_at_most_8_ropekit_calls_and_matches_the_torch_path(form):
    qkv, weights, cos, sin, kw = qk_norm_inputs(form)
    want = qk_norm_call(qkv.clone(), weights, cos, sin, kw, backend="torch")
    qk_norm_call(qkv.clone(), weights, cos, sin, kw)  # plans the key
    got = qkv.clone()
    versions = got._version
    calls = ropekit_calls(lambda: qk_norm_call(got, weights, cos, sin, kw))
    assert len(calls) <= CALL_BUDGET, calls
    assert "run" in calls and "resolve" not in calls and "_check_weight" not in calls
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got._version == versions + 1


@pytest.mark.c_compiler
@pytest.mark.parametrize("form", ["offset", "offsets_per_seq", "positions"])
def test_qk_norm_rows_past_the_table_raise_the_checked_error_after_a_plan(form):
    qkv, weights, cos, sin, kw = qk_norm_inputs(form)
    qk_norm_call(qkv.clone(), weights, cos, sin, kw)
    assert "run" in ropekit_calls(lambda: qk_norm_call(qkv.clone(), weights, cos, sin, kw))
    bad = {"offset": dict(offsets=2048), "offsets_per_seq": dict(offsets=torch.tensor([1, 2, 3, 2048]))}
    bad["positions"] = dict(positions=torch.tensor([1, 2, 2048, 3]))
    before = qkv.clone()
    with pytest.raises(ValueError, match="positions: largest position 2048 is past the cos/sin table"):
        qk_norm_call(qkv, weights, cos, sin, bad[form])
    assert torch.equal(qkv, before)


@pytest.mark.c_compiler
@pytest.mark.parametrize("offset", [1 << 64, -(1 << 64)])
def test_an_int_offset_past_int64_after_a_plan_raises_the_checked_error_not_a_packing_error(offset):
    """The plans check an int offset against the table before packing it for the C loop: one past int64
    would otherwise stop the packing with struct.error, not the checked path's ValueError."""
    qkv, weights, cos, sin, kw = qk_norm_inputs("offset")
    qk_norm_call(qkv.clone(), weights, cos, sin, kw)
    assert "run" in ropekit_calls(lambda: qk_norm_call(qkv.clone(), weights, cos, sin, kw))
    before = qkv.clone()
    with pytest.raises(ValueError, match="offsets: expected a non-negative int or an integer tensor"):
        qk_norm_call(qkv, weights, cos, sin, dict(kw, offsets=offset))
    assert torch.equal(qkv, before)
    q, k, cos, sin, _ = planned_fp8_step()
    with pytest.raises(ValueError, match="offsets: expected a non-negative int or an integer tensor"):
        fp8_call(q, k, cos, sin, offset, SCALES["0-d tensors"])


@pytest.mark.c_compiler
def test_a_strided_slot_mapping_is_read_as_the_checked_path_reads_it():
    q, k, v, cos, sin, caches, slots, offsets = decode_inputs(4, "nhd", True)
    strided = torch.stack([slots, torch.zeros_like(slots)], dim=-1)[..., 0]  # (4, 1), not contiguous
    assert not strided.is_contiguous() and torch.equal(strided, slots)
    want = [c.clone() for c in caches]
    call(q.clone(), k, v, cos, sin, want, slots, offsets, "nhd", True, backend="torch")
    for _ in range(3):  # the first call checks; a plan must not read the slots where they do not lie
        got = [c.clone() for c in caches]
        call(q.clone(), k, v, cos, sin, got, strided, offsets, "nhd", True)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def unchanged(tensors, before) -> bool:
    return all(torch.equal(a, b) for a, b in zip(tensors, before, strict=True))


@pytest.mark.c_compiler
def test_duplicate_slots_after_a_plan_raise_the_checked_error_and_write_nothing():
    q, k, v, cos, sin, caches, _, offsets = planned_step()
    before = [t.clone() for t in (q, *caches)]
    with pytest.raises(ValueError, match=r"slot_mapping: slot 3 is given twice \(tokens 0 and 1\)"):
        call(q, k, v, cos, sin, caches, torch.tensor([[3], [3]]), offsets, "nhd", True)
    assert unchanged((q, *caches), before)
    call(q, k, v, cos, sin, caches, torch.tensor([[-1], [-1]]), offsets, "nhd", True)  # -1 may repeat
    assert unchanged(caches, before[1:])


@pytest.mark.c_compiler
def test_a_k_cache_inside_the_cos_table_after_a_plan_raises_and_writes_nothing():
    q, k, v, cos, sin, caches, slots, offsets = planned_step()
    storage = torch.zeros(cos.numel() + caches[0].numel())
    cos_view = storage.as_strided(cos.shape, cos.stride(), 0)  # the planned cos's layout
    cos_view.copy_(cos)
    k_cache = storage.as_strided(caches[0].shape, caches[0].stride(), 1000)  # the planned k_cache's layout
    before = [t.clone() for t in (q, storage, caches[1])]
    with pytest.raises(ValueError, match="k_cache: it is written and shares memory with cos, which the call"):
        call(q, k, v, cos_view, sin, [k_cache, caches[1]], slots, offsets, "nhd", True)
    assert unchanged((q, storage, caches[1]), before)


@pytest.mark.c_compiler
def test_per_sequence_offsets_inside_a_cache_after_a_plan_raise_and_write_nothing():
    q, k, v, cos, sin, caches, slots, _ = planned_step(per_sequence=True)
    # int64 offsets (2,) laid in v_cache's bytes, holding valid rows: only the memory rule refuses them.
    offsets = torch.empty(0, dtype=torch.int64).set_(caches[1].untyped_storage(), 100, (2,), (1,))
    offsets.copy_(torch.tensor([3, 5]))
    before = [t.clone() for t in (q, *caches)]
    with pytest.raises(ValueError, match="v_cache: it is written and shares memory with offsets, which the"):
        call(q, k, v, cos, sin, caches, slots, offsets, "nhd", True)
    assert unchanged((q, *caches), before)


@pytest.mark.c_compiler
def test_an_inference_q_written_in_place_outside_inference_mode_after_a_plan_raises_and_writes_nothing():
    q, k, v, cos, sin, caches, slots, offsets = planned_step()
    with torch.inference_mode():
        q_inference = q.clone()
    before = [t.clone() for t in (q_inference, *caches)]
    with pytest.raises(
        RuntimeError, match=r"q: an inference tensor \(made under torch.inference_mode\(\)\)"
    ) as e:
        call(q_inference, k, v, cos, sin, caches, slots, offsets, "nhd", True)
    assert isinstance(e.value, ValueError)  # ropekit's InPlaceError: both, as the checked path raises it
    assert unchanged((q_inference, *caches), before)


@pytest.mark.c_compiler
def test_qk_norm_weight_inside_qkv_after_a_plan_raises_and_writes_nothing():
    qkv, weights, cos, sin, kw = qk_norm_inputs("offset")
    qk_norm_call(qkv.clone(), weights, cos, sin, kw)
    assert "run" in ropekit_calls(lambda: qk_norm_call(qkv.clone(), weights, cos, sin, kw))
    q_weight = qkv.view(-1)[256:384]  # (128,), unit stride: the planned q_weight's layout, in qkv's bytes
    before = qkv.clone()
    with pytest.raises(
        ValueError, match="qkv: it is written and shares memory with q_weight, which the call"
    ):
        qk_norm_call(qkv, [q_weight, weights[1]], cos, sin, kw)
    assert torch.equal(qkv, before)


@pytest.mark.c_compiler
def test_qk_norm_of_an_inference_qkv_outside_inference_mode_after_a_plan_raises_and_writes_nothing():
    qkv, weights, cos, sin, kw = qk_norm_inputs("offset")
    qk_norm_call(qkv.clone(), weights, cos, sin, kw)
    assert "run" in ropekit_calls(lambda: qk_norm_call(qkv.clone(), weights, cos, sin, kw))
    with torch.inference_mode():
        qkv_inference = qkv.clone()
    with pytest.raises(ValueError, match=r"qkv: an inference tensor \(made under torch.inference_mode\(\)\)"):
        qk_norm_call(qkv_inference, weights, cos, sin, kw)
    assert torch.equal(qkv_inference, qkv)


def fp8_inputs(batch: int, per_sequence: bool, mla: bool = False, seed: int = 0):
    """A decode step of apply_rotary_qk_fp8: Llama-3-8B heads (32 q, 8 kv, head_dim 128), one token per
    sequence; mla: DeepSeek's form (16 heads, rope 64, nope 128)."""
    g = torch.Generator().manual_seed(seed)
    width = 64 if mla else 128
    cos, sin = ropekit.RopeConfig(head_dim=width).cos_sin(2048)
    heads = (16, 16) if mla else (32, 8)
    q, k = (torch.randn(batch, 1, h, width, generator=g) for h in heads)
    nope = dict(
        q_nope=torch.randn(batch, 1, 16, 128, generator=g), k_nope=torch.randn(batch, 1, 16, 128, generator=g)
    )
    offsets = torch.randint(0, 2000, (batch,), generator=g) if per_sequence else 1000
    return q, k, cos, sin, offsets, nope if mla else {}


def fp8_call(q, k, cos, sin, offsets, scales, backend="cpu", **kw):
    return ropekit.apply_rotary_qk_fp8(q, k, cos, sin, **scales, offsets=offsets, backend=backend, **kw)


SCALES = {
    "numbers": dict(q_scale=0.5, k_scale=3.0),
    "0-d tensors": dict(q_scale=torch.tensor(0.5), k_scale=torch.tensor(3.0)),
    "per head": dict(q_scale=torch.linspace(0.25, 2.0, 32), k_scale=torch.linspace(1.0, 4.0, 8)),
}


def same_bytes(got, want) -> bool:
    return len(got) == len(want) and all(
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(got, want, strict=True)
    )


@pytest.mark.c_compiler
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("per_sequence", [False, True])
@pytest.mark.parametrize("scales", list(SCALES))
def test_steady_fp8_decode_step_makes_at_most_8_ropekit_calls_and_equals_the_checked_path(
    scales, per_sequence, fp8_dtype
):
    plan.clear_plans()
    q, k, cos, sin, offsets, _ = fp8_inputs(4, per_sequence)
    kw = dict(fp8_dtype=fp8_dtype)
    checked = fp8_call(q, k, cos, sin, offsets, SCALES[scales], **kw)  # the checked path; plans the key
    want = fp8_call(q, k, cos, sin, offsets, SCALES[scales], backend="torch", **kw)
    assert same_bytes(checked, want)  # the C loop's checked path meets the contract (tests/fused/test_fp8.py)
    got = []
    calls = ropekit_calls(lambda: got.append(fp8_call(q, k, cos, sin, offsets, SCALES[scales], **kw)))
    assert len(calls) <= CALL_BUDGET, calls
    assert "run" in calls and "check_scale" not in calls and "resolve" not in calls  # the plan served it
    assert same_bytes(got[0], checked)
    assert all(t.is_contiguous() for t in got[0])


@pytest.mark.c_compiler
def test_a_planned_mla_step_equals_the_checked_path():
    plan.clear_plans()
    q, k, cos, sin, offsets, nope = fp8_inputs(2, False, mla=True)
    scales = dict(q_scale=torch.tensor(0.5), k_scale=2.0)
    checked = fp8_call(q, k, cos, sin, offsets, scales, **nope)
    got = []
    calls = ropekit_calls(lambda: got.append(fp8_call(q, k, cos, sin, offsets, scales, **nope)))
    assert "run" in calls and "check_scale" not in calls and len(calls) <= CALL_BUDGET, calls
    assert len(got[0]) == 4 and same_bytes(got[0], checked)
    assert same_bytes(got[0], fp8_call(q, k, cos, sin, offsets, scales, backend="torch", **nope))


def planned_fp8_step(scales="0-d tensors", per_sequence=False):
    """Inputs whose apply_rotary_qk_fp8 key has a plan (one call made), to call again with a changed value."""
    plan.clear_plans()
    q, k, cos, sin, offsets, _ = fp8_inputs(2, per_sequence)
    fp8_call(q, k, cos, sin, offsets, SCALES[scales])
    assert "run" in ropekit_calls(lambda: fp8_call(q, k, cos, sin, offsets, SCALES[scales]))
    return q, k, cos, sin, offsets


@pytest.mark.c_compiler
def test_a_planned_fp8_step_past_the_table_raises_the_checked_error_and_leaves_its_inputs():
    q, k, cos, sin, _ = planned_fp8_step()
    before = q.clone(), k.clone()
    with pytest.raises(ValueError, match="positions: largest position 2048 is past the cos/sin table"):
        fp8_call(q, k, cos, sin, 2048, SCALES["0-d tensors"])
    with pytest.raises(ValueError, match="offsets: expected a non-negative int or an integer tensor, got -1"):
        fp8_call(q, k, cos, sin, -1, SCALES["0-d tensors"])
    q, k, cos, sin, _ = planned_fp8_step(per_sequence=True)
    with pytest.raises(ValueError, match="positions: largest position 5000 is past the cos/sin table"):
        fp8_call(q, k, cos, sin, torch.tensor([3, 5000]), SCALES["0-d tensors"])
    with pytest.raises(ValueError, match="offsets: expected values >= 0, got a minimum of -1"):
        fp8_call(q, k, cos, sin, torch.tensor([-1, 4]), SCALES["0-d tensors"])
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])  # inputs are never written


@pytest.mark.c_compiler
@pytest.mark.parametrize("scales", ["0-d tensors", "per head"])
@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
@pytest.mark.parametrize("name", ["q_scale", "k_scale"])
def test_a_planned_fp8_step_with_an_invalid_scale_tensor_raises_the_checked_error(name, bad, scales):
    """A scale tensor's values are not in the key: the plan's run checks them as check_scale does."""
    q, k, cos, sin, offsets = planned_fp8_step(scales)
    given = {key: value.clone() for key, value in SCALES[scales].items()}
    given[name].view(-1)[-1] = bad  # the one value of a 0-d tensor; the last head's of a per-head one
    with pytest.raises(
        ValueError, match=rf"^{name}: expected every value a finite scale > 0 in float32"
    ) as e:
        fp8_call(q, k, cos, sin, offsets, given)
    plan.clear_plans()  # the checked path alone says the same, word for word
    with pytest.raises(ValueError) as checked:
        fp8_call(q, k, cos, sin, offsets, given)
    assert str(e.value) == str(checked.value)


@pytest.mark.c_compiler
def test_anything_the_fp8_checks_relied_on_misses_its_plan():
    q, k, cos, sin, offsets = planned_fp8_step()
    scales = SCALES["0-d tensors"]
    for changed, match in (
        (dict(k=k.double()), "k: expected q's dtype torch.float32"),
        (dict(k=k[:, :, :4]), None),  # fewer heads: a new key, served by the checked path
        (dict(scales=dict(q_scale=torch.tensor(0.5, dtype=torch.float64), k_scale=scales["k_scale"])), None),
        (
            dict(scales=dict(q_scale=torch.ones(3), k_scale=scales["k_scale"])),
            r"q_scale: expected a 0-d tensor",
        ),
        (dict(scales=dict(q_scale=0.0, k_scale=scales["k_scale"])), r"q_scale: expected a finite scale > 0"),
        (dict(scales=dict(q_scale=True, k_scale=scales["k_scale"])), r"q_scale: expected a float"),
        (dict(fp8_dtype=torch.float16), "fp8_dtype: expected one of"),
    ):
        args = dict(q=q, k=k, cos=cos, sin=sin, offsets=offsets, scales=scales) | changed
        fp8_dtype = args.pop("fp8_dtype", torch.float8_e4m3fn)
        step = lambda: fp8_call(**args, fp8_dtype=fp8_dtype)  # noqa: E731, B023
        if match is None:  # its first call misses (the checked path serves it)
            assert "check_scale" in ropekit_calls(step)
        else:
            with pytest.raises(ValueError, match=match):
                step()
    float64_scale = dict(q_scale=torch.tensor(0.5, dtype=torch.float64), k_scale=scales["k_scale"])
    assert "check_scale" in ropekit_calls(lambda: fp8_call(q, k, cos, sin, offsets, float64_scale))  # no plan


@pytest.mark.c_compiler
def test_a_planned_fp8_number_scale_is_in_its_key():
    q, k, cos, sin, offsets = planned_fp8_step("numbers")
    other = dict(q_scale=0.25, k_scale=3.0)  # another value: another key, the checked path, then its plan
    assert "check_scale" in ropekit_calls(lambda: fp8_call(q, k, cos, sin, offsets, other))
    got = fp8_call(q, k, cos, sin, offsets, other)
    assert same_bytes(got, fp8_call(q, k, cos, sin, offsets, other, backend="torch"))


def test_other_backends_keep_no_fp8_plan():
    plan.clear_plans()
    q, k, cos, sin, offsets, _ = fp8_inputs(2, False)
    for _ in range(2):
        fp8_call(q, k, cos, sin, offsets, SCALES["numbers"], backend="torch")
    assert "check_scale" in ropekit_calls(
        lambda: fp8_call(q, k, cos, sin, offsets, SCALES["numbers"], "torch")
    )


def packed_fp8_step(nope_width: int = 0):
    """vLLM's / FlashInfer's packed form: q (T, Hq, D) with a position per token, and nope parts of
    nope_width (FlashInfer passes width-0 nope parts for a plain rope)."""
    plan.clear_plans()
    g = torch.Generator().manual_seed(1)
    cos, sin = ropekit.RopeConfig(head_dim=64).cos_sin(2048)
    q, k = torch.randn(5, 16, 64, generator=g), torch.randn(5, 2, 64, generator=g)
    nope = dict(
        q_nope=torch.randn(5, 16, nope_width, generator=g), k_nope=torch.randn(5, 2, nope_width, generator=g)
    )
    positions = torch.tensor([0, 7, 100, 2047, 3])
    return q, k, cos, sin, positions, nope


@pytest.mark.c_compiler
@pytest.mark.parametrize("nope_width", [0, 32])
def test_a_planned_step_with_positions_per_token_equals_the_checked_path(nope_width):
    q, k, cos, sin, positions, nope = packed_fp8_step(nope_width)
    scales = SCALES["numbers"]
    step = lambda: fp8_call(q, k, cos, sin, 0, scales, positions=positions, **nope)  # noqa: E731
    checked = step()
    got = []
    calls = ropekit_calls(lambda: got.append(step()))
    assert "run" in calls and "check_scale" not in calls and len(calls) <= CALL_BUDGET, calls
    assert len(got[0]) == 4 and same_bytes(got[0], checked)
    assert same_bytes(
        got[0], fp8_call(q, k, cos, sin, 0, scales, positions=positions, backend="torch", **nope)
    )


@pytest.mark.c_compiler
def test_planned_positions_past_the_table_negative_or_with_an_offset_raise_the_checked_error():
    q, k, cos, sin, positions, nope = packed_fp8_step()
    scales = SCALES["numbers"]
    fp8_call(q, k, cos, sin, 0, scales, positions=positions, **nope)  # plans the key
    for bad, offset, match in (
        (torch.tensor([0, 7, 2048, 1, 3]), 0, "positions: largest position 2048 is past the cos/sin table"),
        (torch.tensor([0, 7, -1, 1, 3]), 0, "positions: expected values >= 0, got a minimum of -1"),
        (positions, 5, "offsets: expected 0 when positions is given"),
    ):
        with pytest.raises(ValueError, match=match):
            fp8_call(q, k, cos, sin, offset, scales, positions=bad, **nope)
    assert "run" in ropekit_calls(lambda: fp8_call(q, k, cos, sin, 0, scales, positions=positions, **nope))


# ---- shift_cache_ ----------------------------------------------------------------------------------------

# The shift's steady call: shift_cache_, its gate, the plan's run and the C loop's packed call.
SHIFT_CALL_BUDGET = 4


def shift_inputs(layout: str, with_slots: bool, dtype=torch.float32, seed: int = 0):
    """A key cache of 64 slots (8 kv heads, head_dim 128) in layout, its tables and slots to shift."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(SHAPES[layout], generator=g).to(dtype)
    cos, sin = ropekit.RopeConfig(head_dim=128).cos_sin(2048)
    slots = torch.tensor([3, 17, -1, 40, 63]) if with_slots else None
    return cache, cos, sin, slots


def shift(cache, cos, sin, delta, slots, layout="nhd", backend="cpu", **kw):
    return ropekit.shift_cache_(
        cache, cos, sin, delta, cache_layout=layout, slots=slots, backend=backend, **kw
    )


def checked_shift(cache, cos, sin, delta, slots, layout="nhd", **kw):
    """The checked path's answer (no plan held): a shifted copy of cache."""
    plan.clear_plans()
    out = cache.clone()
    shift(out, cos, sin, delta, slots, layout, **kw)
    return out


def slot_rows(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """(num_slots, heads, head_dim): slot s = page * page_size + index."""
    return {"flat": cache, "nhd": cache.flatten(0, 1), "hnd": cache.transpose(1, 2).flatten(0, 1)}[layout]


def planned_shift(layout="nhd", with_slots=True, delta=7, dtype=torch.float32):
    """Inputs whose shift_cache_ key has a plan (one call made, on a copy), to call again with others."""
    plan.clear_plans()
    cache, cos, sin, slots = shift_inputs(layout, with_slots, dtype)
    shift(cache.clone(), cos, sin, delta, slots, layout)
    assert "run" in ropekit_calls(lambda: shift(cache.clone(), cos, sin, delta, slots, layout))
    return cache, cos, sin, slots


@pytest.mark.c_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("delta", [-13, 0, 300])
@pytest.mark.parametrize("with_slots", [False, True])
@pytest.mark.parametrize("layout", ["flat", "nhd", "hnd"])
def test_a_steady_shift_makes_at_most_4_ropekit_calls_and_equals_the_checked_path(
    layout, with_slots, delta, dtype
):
    """Planned with delta 7, served with another delta (of either sign: the key holds delta's type only):
    the checked path's bytes, and the float64 rotation by delta of the slots shifted, the others untouched."""
    cache, cos, sin, slots = planned_shift(layout, with_slots, delta=7, dtype=dtype)
    got, before = cache.clone(), slot_rows(cache, layout).clone()
    calls = ropekit_calls(lambda: shift(got, cos, sin, delta, slots, layout))
    assert len(calls) <= SHIFT_CALL_BUDGET, calls
    assert "run" in calls and "cache_view" not in calls and "check_slots" not in calls  # the plan served it
    assert torch.equal(got, checked_shift(cache, cos, sin, delta, slots, layout))
    moved = torch.arange(64) if slots is None else slots[slots >= 0]
    rows = slot_rows(got, layout)
    assert_matches_reference(rows[moved], before[moved], cos, sin, np.full(len(moved), abs(delta)),
                             interleaved=False, conjugate=delta < 0)  # fmt: skip
    others = torch.ones(64, dtype=torch.bool)
    others[moved] = False
    assert torch.equal(rows[others], before[others])


@pytest.mark.c_compiler
def test_a_planned_interleaved_shift_equals_the_checked_path():
    plan.clear_plans()
    cache, cos, sin, slots = shift_inputs("nhd", True)
    shift(cache.clone(), cos, sin, 5, slots, interleaved=True)
    got = cache.clone()
    assert "run" in ropekit_calls(lambda: shift(got, cos, sin, -9, slots, interleaved=True))
    assert torch.equal(got, checked_shift(cache, cos, sin, -9, slots, interleaved=True))
    assert not torch.equal(got, checked_shift(cache, cos, sin, -9, slots))  # the pairing is in the key


def same_bits(tensors, others) -> bool:
    """Whether each tensor holds exactly the other's bytes (NaN bit patterns included)."""
    pairs = zip(tensors, others, strict=True)
    return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in pairs)


def raises_as_checked(step, *written):
    """step() raises on the planned path exactly the error the checked path (no plan) raises, and neither
    writes anything into the tensors ``written``; returns the message."""
    before = [t.clone() for t in written]
    with pytest.raises(ValueError) as planned:
        step()
    assert same_bits(written, before)
    plan.clear_plans()
    with pytest.raises(ValueError) as checked:
        step()
    assert same_bits(written, before)
    assert type(planned.value) is type(checked.value) and str(planned.value) == str(checked.value)
    return str(planned.value)


@pytest.mark.c_compiler
@pytest.mark.parametrize("delta", [2048, -2048, 5000])
def test_a_planned_shift_past_the_table_raises_the_checked_error_and_writes_nothing(delta):
    cache, cos, sin, slots = planned_shift()
    message = raises_as_checked(lambda: shift(cache, cos, sin, delta, slots), cache)
    assert message.startswith(f"delta: |delta| = {abs(delta)} is past the cos/sin table")


@pytest.mark.c_compiler
@pytest.mark.parametrize("bad", [[3, 64, -1, 40, 63], [3, 17, -2, 40, 63], [3, 17, -1, 17, 63]])
def test_a_planned_shift_with_a_slot_outside_the_cache_or_given_twice_raises_the_checked_error(bad):
    cache, cos, sin, _ = planned_shift()
    message = raises_as_checked(lambda: shift(cache, cos, sin, 7, torch.tensor(bad)), cache)
    assert message.startswith("slots: slot ")
    shift(cache, cos, sin, 7, torch.tensor([-1, -1, -1, 5, 6]))  # -1 may repeat: the plan serves it


@pytest.mark.c_compiler
@pytest.mark.parametrize("read", ["cos", "sin", "slots"])
def test_a_planned_shift_whose_cache_holds_a_table_or_its_slots_raises_the_checked_error(read):
    """The memory rule from this call's addresses: the tables and slots keep the planned layouts, and lie
    inside the cache's memory."""
    cache, cos, sin, slots = planned_shift()
    storage = torch.randn(cache.numel() + cos.numel())
    k_cache = storage.as_strided(cache.shape, cache.stride(), 0)
    if read == "slots":
        inside = storage[-2 * len(slots) :].view(torch.int64)  # (5,) int64 over the cache's last floats
        inside.copy_(slots)
        slots = inside
        k_cache = storage.as_strided(cache.shape, cache.stride(), cos.numel())
    else:
        table = storage.as_strided(cos.shape, cos.stride(), 1000)  # inside the cache, the planned layout
        table.copy_(cos if read == "cos" else sin)
        cos, sin = (table, sin) if read == "cos" else (cos, table)
    message = raises_as_checked(lambda: shift(k_cache, cos, sin, 7, slots), storage)
    assert message.startswith(f"k_cache: it is written and shares memory with {read}")


@pytest.mark.c_compiler
def test_a_planned_shift_bumps_the_version_once_and_refuses_an_inference_cache_outside_inference_mode():
    cache, cos, sin, slots = planned_shift()
    version = cache._version
    shift(cache, cos, sin, 7, slots)
    assert cache._version == version + 1
    with torch.inference_mode():
        frozen = cache.clone()
    message = raises_as_checked(lambda: shift(frozen, cos, sin, 7, slots), frozen)
    assert message.startswith("k_cache: an inference tensor")
    shift(cache.clone(), cos, sin, 7, slots)  # plans the key again
    with torch.inference_mode():
        assert "run" in ropekit_calls(lambda: shift(frozen, cos, sin, 7, slots))
    assert torch.equal(frozen, checked_shift(cache, cos, sin, 7, slots))


@pytest.mark.c_compiler
@pytest.mark.parametrize("change", ["layout", "dtype", "strided slots", "float64 table", "torch backend"])
def test_anything_the_shift_checks_relied_on_misses_its_plan(change):
    cache, cos, sin, slots = planned_shift()
    kw = dict(layout="nhd")
    if change == "layout":  # the same tensor read as another layout (32 slots of 16 heads): another key
        kw["layout"], slots = "hnd", torch.tensor([3, 17, -1, 20, 31])
    elif change == "dtype":
        cache = cache.half()
    elif change == "strided slots":  # the checked path reads a contiguous copy: never planned
        slots = torch.stack([slots, slots], dim=-1)[:, 0]
    elif change == "float64 table":  # converted per call by the checked path: never planned
        cos, sin = cos.double(), sin.double()
    else:
        kw["backend"] = "torch"
    got = cache.clone()
    assert "cache_view" in ropekit_calls(lambda: shift(got, cos, sin, 7, slots, **kw))  # the checked path
    if change not in ("layout", "dtype"):  # a kind no plan serves: the checked path again
        assert "cache_view" in ropekit_calls(lambda: shift(cache.clone(), cos, sin, 7, slots, **kw))
    assert torch.equal(got, checked_shift(cache, cos, sin, 7, slots, **kw))


# ---- apply_rotary_qk_and_cache with positions, cu_seqlens, FP8 caches -----------------------------------

SERVING_FORMS = ("positions (T,)", "positions (B, S)", "cu_seqlens", "cu_seqlens, offsets per sequence",
                 "one packed sequence (T,)")  # fmt: skip
CACHE_KINDS = {  # cache dtype and its scales
    "float32": (torch.float32, {}),
    "e4m3, numbers": (torch.float8_e4m3fn, dict(k_scale=0.5, v_scale=2.0)),
    "e4m3, 0-d tensors": (torch.float8_e4m3fn, dict(k_scale=torch.tensor(0.5), v_scale=torch.tensor(2.0))),
    "e5m2, per head": (
        torch.float8_e5m2, dict(k_scale=torch.linspace(0.5, 2.0, 8), v_scale=torch.linspace(1.0, 3.0, 8))
    ),
}  # fmt: skip


class Serving:
    """One step of apply_rotary_qk_and_cache in a form the launch plan once refused (Llama-3-8B heads, a
    cache of 64 slots in "nhd"): rows, every token's table row (the float64 reference's positions)."""

    def __init__(self, form: str, cache: str = "float32", seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.cos, self.sin = ropekit.RopeConfig(head_dim=128).cos_sin(2048)
        lead = (3, 2) if form == "positions (B, S)" else (7,)
        self.q, self.k, self.v = (torch.randn(*lead, h, 128, generator=g) for h in (32, 8, 8))
        slots = torch.randperm(64, generator=g)[: self.k.shape[:-2].numel()]
        slots[1] = -1  # padding: skipped
        self.slots = slots.reshape(lead)
        if form.startswith("positions"):
            self.kw = dict(positions=torch.randint(0, 2048, lead, generator=g))
            self.rows = self.kw["positions"].numpy()
        elif (
            form == "one packed sequence (T,)"
        ):  # (T, H, D) without cu_seqlens: rows offset .. offset + T - 1
            self.kw = dict(offsets=1000)
            self.rows = 1000 + np.arange(7)
        else:  # three packed sequences of 3, 0 and 4 tokens
            per_sequence = form.endswith("per sequence")
            offsets = torch.tensor([5, 1000, 2040]) if per_sequence else 100
            cu = torch.tensor([0, 3, 3, 7], dtype=torch.int64 if per_sequence else torch.int32)
            self.kw = dict(cu_seqlens=cu, offsets=offsets)
            starts = offsets.tolist() if per_sequence else [offsets] * 3
            self.rows = np.concatenate([starts[s] + np.arange(n) for s, n in enumerate((3, 0, 4))])
        self.cache_dtype, scales = CACHE_KINDS[cache]
        self.kw |= scales
        self.caches = [torch.randn(SHAPES["nhd"], generator=g).to(self.cache_dtype) for _ in range(2)]

    def __call__(self, q=None, caches=None, inplace=True, backend="cpu", **changes):
        """The step on q and caches (copies of this step's when None) -> (q's result, the caches)."""
        q = self.q.clone() if q is None else q
        caches = [c.clone() for c in self.caches] if caches is None else caches
        kw = dict(k=self.k, v=self.v, cos=self.cos, sin=self.sin, slot_mapping=self.slots) | self.kw | changes
        k, v, cos, sin = (kw.pop(name) for name in ("k", "v", "cos", "sin"))
        out = ropekit.apply_rotary_qk_and_cache(
            q, k, v, cos, sin, k_cache=caches[0], v_cache=caches[1], inplace=inplace, backend=backend, **kw
        )
        return out, caches

    def planned(self, inplace=True) -> Serving:
        """This step's key with a plan (its first call, on copies, made it)."""
        plan.clear_plans()
        self(inplace=inplace)
        assert "run" in ropekit_calls(lambda: self(inplace=inplace))
        return self


@pytest.mark.c_compiler
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("cache", list(CACHE_KINDS))
@pytest.mark.parametrize("form", SERVING_FORMS)
def test_a_steady_step_with_positions_cu_seqlens_or_fp8_scales_takes_its_plan_and_equals_the_checked_path(
    form, cache, inplace
):
    step = Serving(form, cache)
    plan.clear_plans()
    checked = step(inplace=inplace)  # the checked path; it plans the key
    q, caches, got = step.q.clone(), [c.clone() for c in step.caches], []
    calls = ropekit_calls(lambda: got.append(step(q, caches, inplace=inplace)))
    assert len(calls) <= CALL_BUDGET, calls
    assert "run" in calls and not {"resolve", "check_cu_seqlens", "check_scale", "check_slots"} & set(calls)
    out, caches = got[0]
    assert (out is q) == inplace and torch.equal(out, checked[0])
    assert same_bits(caches, checked[1])
    # The float64 reference for q and k, the FP8 rounding contract for FP8 caches; v is copied.
    assert_matches_reference(out, step.q, step.cos, step.sin, step.rows, interleaved=False)
    written = step.slots.reshape(-1) >= 0
    slots = step.slots.reshape(-1)[written]
    k, v = (t.reshape(-1, 8, 128)[written] for t in (step.k, step.v))
    k_rows, v_rows = (c.flatten(0, 1)[slots] for c in caches)  # (written tokens, heads, head_dim)
    if step.cache_dtype == torch.float32:
        assert_matches_reference(k_rows, k, step.cos, step.sin, step.rows.reshape(-1)[written.numpy()],
                                 interleaved=False)  # fmt: skip
        assert torch.equal(v_rows, v)
    else:
        r = float32_rotation(k, step.cos, step.sin, step.rows.reshape(-1)[written.numpy()], False)
        assert torch.equal(k_rows.view(torch.uint8), contract_bytes(r, step.kw["k_scale"], step.cache_dtype))
        assert torch.equal(v_rows.view(torch.uint8), contract_bytes(v, step.kw["v_scale"], step.cache_dtype))
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert same_bits([c.flatten(0, 1)[untouched] for c in caches],
                     [c.flatten(0, 1)[untouched] for c in step.caches])  # fmt: skip


@pytest.mark.c_compiler
def test_a_planned_step_tells_autograd_what_it_wrote_with_positions_and_an_fp8_cache():
    step = Serving("positions (T,)", "e4m3, 0-d tensors").planned()
    q, caches = step.q.clone(), [c.clone() for c in step.caches]
    versions = [t._version for t in (q, *caches)]
    assert "run" in ropekit_calls(lambda: step(q, caches))
    assert [t._version for t in (q, *caches)] == [n + 1 for n in versions]


def _in_memory_of(cache: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(storage, a cache like cache, a tensor like t with t's values) where t's bytes are the cache's last."""
    storage = torch.zeros(cache.numel() * cache.element_size(), dtype=torch.uint8)
    inside = storage[storage.numel() - t.numel() * t.element_size() :].view(t.dtype)
    inside = inside.view(t.shape) if t.dim() else inside.squeeze(0)
    inside.copy_(t)
    return storage, storage.view(cache.dtype).view(cache.shape), inside


# (form, cache kind, the change, the start of the checked path's message)
BAD_SERVING = [
    ("positions (T,)", "float32", dict(positions=torch.tensor([0, 7, 2048, 1, 3, 9, 4])),
     "positions: largest position 2048 is past the cos/sin table"),
    ("positions (B, S)", "float32", dict(positions=torch.tensor([[0, 7], [-1, 2], [3, 4]])),
     "positions: expected values >= 0, got a minimum of -1"),
    ("positions (T,)", "float32", dict(offsets=5), "offsets: expected 0 when positions is given"),
    ("cu_seqlens", "float32", dict(cu_seqlens=torch.tensor([0, 3, 3, 6], dtype=torch.int32)),
     "cu_seqlens: expected non-decreasing offsets from 0 to total_tokens (7)"),
    ("cu_seqlens", "float32", dict(cu_seqlens=torch.tensor([0, 4, 3, 7], dtype=torch.int32)),
     "cu_seqlens: expected non-decreasing offsets"),
    ("cu_seqlens", "float32", dict(cu_seqlens=torch.tensor([1, 3, 3, 7], dtype=torch.int32)),
     "cu_seqlens: expected non-decreasing offsets"),
    ("cu_seqlens", "float32", dict(offsets=2045), "positions: largest position 2048 is past the cos/sin"),
    ("cu_seqlens", "float32", dict(offsets=1 << 63), "offsets: expected a non-negative int or an integer"),
    ("cu_seqlens, offsets per sequence", "float32", dict(offsets=torch.tensor([5, 10, 2045])),
     "positions: largest position 2048 is past the cos/sin table"),
    ("cu_seqlens, offsets per sequence", "float32", dict(offsets=torch.tensor([5, -3, 10])),
     "offsets: expected values >= 0, got a minimum of -3"),  # the empty sequence's: no row reads it
    ("one packed sequence (T,)", "float32", dict(offsets=2045), "positions: largest position 2051 is past"),
    ("one packed sequence (T,)", "float32", dict(offsets=1 << 64), "offsets: expected a non-negative int"),
    ("one packed sequence (T,)", "e4m3, numbers", dict(offsets=-(1 << 64)), "offsets: expected a non-neg"),
    ("positions (T,)", "float32", dict(slot_mapping=torch.tensor([3, 64, -1, 5, 6, 7, 8])),
     "slot_mapping: slot 64"),
    ("cu_seqlens", "e4m3, numbers", dict(slot_mapping=torch.tensor([3, 9, -1, 5, 9, 7, 8])),
     "slot_mapping: slot 9 is given twice (tokens 1 and 4)"),
    ("cu_seqlens", "e4m3, 0-d tensors", dict(k_scale=torch.tensor(0.0)), "k_scale: expected every value"),
    ("positions (T,)", "e5m2, per head", dict(v_scale=torch.tensor([1.0] * 7 + [float("nan")])),
     "v_scale: expected every value"),
    ("positions (B, S)", "e4m3, 0-d tensors", dict(v_scale=torch.tensor(float("inf"))),
     "v_scale: expected every value"),
    ("cu_seqlens, offsets per sequence", "e5m2, per head", dict(k_scale=-torch.ones(8)),
     "k_scale: expected every value"),
]  # fmt: skip


@pytest.mark.c_compiler
@pytest.mark.parametrize(("form", "cache", "change", "message"), BAD_SERVING)
def test_a_value_check_that_fails_on_the_planned_path_raises_the_checked_error_and_writes_nothing(
    form, cache, change, message
):
    step = Serving(form, cache).planned()
    q, caches = step.q.clone(), [c.clone() for c in step.caches]
    got = raises_as_checked(lambda: step(q, caches, **change), q, *caches)
    assert got.startswith(message), got


@pytest.mark.c_compiler
@pytest.mark.parametrize("form", SERVING_FORMS)
def test_caches_that_share_memory_or_an_inference_cache_after_a_plan_raise_the_checked_error(form):
    step = Serving(form, "e4m3, 0-d tensors").planned()
    q, caches = step.q.clone(), [c.clone() for c in step.caches]
    message = raises_as_checked(lambda: step(q, [caches[0], caches[0]]), q, caches[0])
    assert message.startswith("v_cache: the call writes k_cache and v_cache, which share memory")
    with torch.inference_mode():
        frozen = [c.clone() for c in caches]
    step.planned()
    message = raises_as_checked(lambda: step(q, frozen), q, *frozen)
    assert message.startswith("k_cache: an inference tensor")
    step.planned()
    with torch.inference_mode():  # there it is allowed: the plan serves it, as the checked path would
        assert "run" in ropekit_calls(lambda: step(q.clone(), frozen))
    assert same_bits(frozen, step()[1])


@pytest.mark.c_compiler
@pytest.mark.parametrize(
    ("form", "read"),
    [
        ("positions (T,)", "positions"),
        ("positions (B, S)", "positions"),
        ("cu_seqlens", "cu_seqlens"),  # read by the memory check alone (the C loop's word 14)
        ("cu_seqlens, offsets per sequence", "cu_seqlens"),  # with per-sequence offsets: checked in Python
        ("cu_seqlens, offsets per sequence", "offsets"),
        ("positions (T,)", "k_scale"),
    ],
)
def test_a_tensor_the_planned_step_reads_inside_a_cache_raises_the_checked_error_and_writes_nothing(
    form, read
):
    """The memory rule from this call's addresses: positions, cu_seqlens, per-sequence offsets or a scale
    tensor, in the planned layout, lying in the value cache's memory."""
    step = Serving(form, "e4m3, 0-d tensors").planned()
    q = step.q.clone()
    storage, v_cache, inside = _in_memory_of(step.caches[1], step.kw[read])
    k_cache = step.caches[0].clone()
    message = raises_as_checked(lambda: step(q, [k_cache, v_cache], **{read: inside}), q, k_cache, storage)
    assert message.startswith(f"v_cache: it is written and shares memory with {read}"), message


@pytest.mark.c_compiler
def test_a_planned_step_with_positions_and_cu_seqlens_still_checks_cu_seqlens():
    """positions are the rows; cu_seqlens given beside them is checked all the same (the checked path's
    resolve does), so a malformed one raises on the planned path too."""
    step = Serving("positions (T,)")
    step.kw["cu_seqlens"] = torch.tensor([0, 3, 3, 7])
    step.planned()
    q, caches = step.q.clone(), [c.clone() for c in step.caches]
    message = raises_as_checked(lambda: step(q, caches, cu_seqlens=torch.tensor([0, 4, 3, 7])), q, *caches)
    assert message.startswith("cu_seqlens: expected non-decreasing offsets")


# ---- apply_rotary_qk_fp8 with cu_seqlens ------------------------------------------------------------------


def packed_fp8_cu_step(per_sequence: bool, nope_width: int = 0):
    """A packed batch of three sequences (3, 0 and 4 tokens: one is empty) with cu_seqlens, 16 q and 2 k
    heads of 64; with nope_width, DeepSeek's MLA parts. Returns the inputs and every token's row."""
    plan.clear_plans()
    q, k, cos, sin, _, nope = packed_fp8_step(nope_width)
    q, k = torch.cat([q, q[:2]]), torch.cat([k, k[:2]])  # (7, H, 64)
    nope = {name: torch.cat([t, t[:2]]) for name, t in nope.items()}
    offsets = torch.tensor([5, 1000, 2040]) if per_sequence else 100
    starts = offsets.tolist() if per_sequence else [offsets] * 3
    rows = np.concatenate([starts[s] + np.arange(n) for s, n in enumerate((3, 0, 4))])
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int64 if per_sequence else torch.int32)
    return q, k, cos, sin, offsets, dict(cu_seqlens=cu, **nope), rows


@pytest.mark.c_compiler
@pytest.mark.parametrize("nope_width", [0, 32])
@pytest.mark.parametrize("scales", list(SCALES)[:2])
@pytest.mark.parametrize("per_sequence", [False, True])
def test_a_steady_fp8_step_with_cu_seqlens_takes_its_plan_and_meets_the_rounding_contract(
    per_sequence, scales, nope_width
):
    q, k, cos, sin, offsets, kw, rows = packed_fp8_cu_step(per_sequence, nope_width)
    checked = fp8_call(q, k, cos, sin, offsets, SCALES[scales], **kw)  # the checked path; plans the key
    got = []
    calls = ropekit_calls(lambda: got.append(fp8_call(q, k, cos, sin, offsets, SCALES[scales], **kw)))
    assert len(calls) <= CALL_BUDGET, calls
    assert "run" in calls and not {"resolve", "check_cu_seqlens", "check_scale"} & set(calls)
    assert same_bytes(got[0], checked) and len(got[0]) == 4
    q_scale, k_scale = (torch.as_tensor(SCALES[scales][name]) for name in ("q_scale", "k_scale"))
    want = [contract_bytes(float32_rotation(x, cos, sin, rows, False), s, torch.float8_e4m3fn)
            for x, s in ((q, q_scale), (k, k_scale))]  # fmt: skip
    want += [contract_bytes(kw[name], s, torch.float8_e4m3fn) for name, s in (("q_nope", q_scale),
             ("k_nope", k_scale))]  # fmt: skip
    assert all(torch.equal(a.view(torch.uint8), b) for a, b in zip(got[0], want, strict=True))


BAD_FP8_PACKED = [
    (False, dict(cu_seqlens=torch.tensor([0, 3, 3, 6], dtype=torch.int32)),
     "cu_seqlens: expected non-decreasing offsets from 0 to total_tokens (7)"),
    (False, dict(cu_seqlens=torch.tensor([0, 3, 2, 7], dtype=torch.int32)),
     "cu_seqlens: expected non-decreasing offsets"),
    (False, dict(offsets=2045), "positions: largest position 2048 is past the cos/sin table"),
    (True, dict(offsets=torch.tensor([5, 10, 2045])), "positions: largest position 2048 is past the cos/sin"),
    (True, dict(offsets=torch.tensor([5, -3, 10])), "offsets: expected values >= 0, got a minimum of -3"),
    (True, dict(q_scale=torch.tensor(float("nan"))), "q_scale: expected every value"),
    (False, dict(k_scale=torch.tensor(-2.0)), "k_scale: expected every value"),
]  # fmt: skip


@pytest.mark.c_compiler
@pytest.mark.parametrize(("per_sequence", "change", "message"), BAD_FP8_PACKED)
def test_a_value_check_failing_on_a_planned_packed_fp8_step_raises_the_checked_error(
    per_sequence, change, message
):
    q, k, cos, sin, offsets, kw, _ = packed_fp8_cu_step(per_sequence)
    scales = SCALES["0-d tensors"]
    fp8_call(q, k, cos, sin, offsets, scales, **kw)
    assert "run" in ropekit_calls(lambda: fp8_call(q, k, cos, sin, offsets, scales, **kw))
    args = dict(offsets=offsets) | scales | kw | change
    before = q.clone(), k.clone()
    message_got = raises_as_checked(
        lambda: ropekit.apply_rotary_qk_fp8(q, k, cos, sin, backend="cpu", **args)
    )
    assert message_got.startswith(message), message_got
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])  # inputs are never written


# ---- qk_norm_rotary_ with cu_seqlens, and per-sequence offsets over several tokens ------------------------


@pytest.mark.c_compiler
def test_a_steady_qk_norm_step_with_per_sequence_offsets_over_several_tokens_takes_its_plan():
    """Its rows (offsets[b] + t) are made per call; the plan read them after they were freed (the C loop then
    saw other values, found a row outside the table and sent every call to the checked path)."""
    qkv, weights, cos, sin, _ = qk_norm_inputs("offset")
    qkv = torch.cat([qkv, qkv.flip(0), qkv], dim=1)  # (4, 3, W): three tokens per sequence
    kw = dict(offsets=torch.tensor([7, 100, 3, 2000]))
    want = qk_norm_call(qkv.clone(), weights, cos, sin, kw, backend="torch")
    qk_norm_call(qkv.clone(), weights, cos, sin, kw)  # plans the key
    for _ in range(3):
        got = qkv.clone()
        calls = ropekit_calls(lambda: qk_norm_call(got, weights, cos, sin, kw))  # noqa: B023
        assert "run" in calls and "resolve" not in calls and len(calls) <= CALL_BUDGET, calls
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def packed_qk_norm_step(per_sequence: bool):
    """vLLM's packed (T, W) qkv of three sequences (3, 0 and 4 tokens) with cu_seqlens, its key planned."""
    plan.clear_plans()
    g = torch.Generator().manual_seed(5)
    cos, sin = ropekit.RopeConfig(head_dim=128).cos_sin(2048)
    weights = [1 + 0.1 * torch.randn(128, generator=g) for _ in range(2)]
    qkv = torch.randn(7, 48 * 128, generator=g)
    offsets = torch.tensor([5, 1000, 2040]) if per_sequence else 100
    kw = dict(cu_seqlens=torch.tensor([0, 3, 3, 7], dtype=torch.int64 if per_sequence else torch.int32),
              offsets=offsets)  # fmt: skip
    qk_norm_call(qkv.clone(), weights, cos, sin, kw)
    return qkv, weights, cos, sin, kw


@pytest.mark.c_compiler
@pytest.mark.parametrize("per_sequence", [False, True])
def test_a_steady_packed_qk_norm_step_with_cu_seqlens_takes_its_plan_and_equals_the_checked_path(
    per_sequence,
):
    qkv, weights, cos, sin, kw = packed_qk_norm_step(per_sequence)
    got = qkv.clone()
    version = got._version
    calls = ropekit_calls(lambda: qk_norm_call(got, weights, cos, sin, kw))
    assert len(calls) <= CALL_BUDGET, calls
    assert "run" in calls and "resolve" not in calls and "check_cu_seqlens" not in calls
    assert got._version == version + 1
    plan.clear_plans()
    checked = qk_norm_call(qkv.clone(), weights, cos, sin, kw)
    assert torch.equal(got, checked)
    torch.testing.assert_close(got, qk_norm_call(qkv.clone(), weights, cos, sin, kw, backend="torch"),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


BAD_PACKED_QK_NORM = [
    (False, dict(cu_seqlens=torch.tensor([0, 3, 3, 6], dtype=torch.int32)),
     "cu_seqlens: expected non-decreasing offsets from 0 to total_tokens (7)"),
    (False, dict(offsets=2045), "positions: largest position 2048 is past the cos/sin table"),
    (True, dict(offsets=torch.tensor([5, -3, 10])), "offsets: expected values >= 0, got a minimum of -3"),
    (True, dict(offsets=torch.tensor([5, 10, 2045])), "positions: largest position 2048 is past the cos/sin"),
]  # fmt: skip


@pytest.mark.c_compiler
@pytest.mark.parametrize(("per_sequence", "change", "message"), BAD_PACKED_QK_NORM)
def test_a_value_check_failing_on_a_planned_packed_qk_norm_step_raises_the_checked_error(
    per_sequence, change, message
):
    qkv, weights, cos, sin, kw = packed_qk_norm_step(per_sequence)
    assert "run" in ropekit_calls(lambda: qk_norm_call(qkv.clone(), weights, cos, sin, kw))
    got = raises_as_checked(lambda: qk_norm_call(qkv, weights, cos, sin, kw | change), qkv)
    assert got.startswith(message), got


@pytest.mark.c_compiler
@pytest.mark.parametrize("read", ["cu_seqlens", "offsets"])
def test_a_planned_packed_qk_norm_step_whose_qkv_holds_cu_seqlens_or_offsets_raises_the_checked_error(read):
    qkv, weights, cos, sin, kw = packed_qk_norm_step(per_sequence=True)
    storage, inside_qkv, inside = _in_memory_of(qkv, kw[read])
    inside_qkv.copy_(qkv)
    inside.copy_(kw[read])  # its values again, over qkv's last bytes
    got = raises_as_checked(lambda: qk_norm_call(inside_qkv, weights, cos, sin, kw | {read: inside}), storage)
    assert got.startswith(f"qkv: it is written and shares memory with {read}"), got
