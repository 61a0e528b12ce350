"""Launch plans (ropekit.backends.plan): a repeated call costs a lookup, its pointers and one launch, and a
plan never changes an answer: anything a check relied on misses the plan and takes the checked path."""

from __future__ import annotations

import pytest
import torch

import ropekit
from boundary_checks import (
    COMPAT_ENTRIES,
    CORE_ENTRIES,
    assert_planned_write_bumps_the_version,
    check_aliasing_storages_are_refused_when_planned,
)
from c_compiler import CPU
from call_count import ropekit_calls
from ropekit import apply_rotary, apply_rotary_qk
from ropekit.backends import BACKENDS, clear_backend_cache, plan
from rotary_cases import tables

# The issue-17 budgets: Python calls inside ropekit per steady-state decode step.
CALL_BUDGET = 12
MODULE_EXTRA = 4


def decode_step(backend: str, inplace: bool):
    cos, sin = ropekit.RopeConfig(head_dim=128).cos_sin(4096)
    q, k = torch.randn(1, 1, 32, 128), torch.randn(1, 1, 8, 128)  # Llama-3-8B heads, one token
    return lambda: apply_rotary_qk(q, k, cos, sin, offsets=1000, inplace=inplace, backend=backend)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("backend", ["auto", CPU, "torch"])
def test_steady_state_decode_step_makes_at_most_12_ropekit_calls(backend, inplace):
    step = decode_step(backend, inplace)
    step()  # the first call is checked in full and plans the next
    calls = ropekit_calls(step)
    assert len(calls) <= CALL_BUDGET, calls
    assert "check_x" not in calls and "resolve" not in calls  # checked once, on the first call


def test_module_decode_step_adds_at_most_4_calls_to_apply_rotary_qk():
    rope = ropekit.RotaryEmbedding(head_dim=128)
    q, k = torch.randn(1, 1, 32, 128), torch.randn(1, 1, 8, 128)
    step = lambda: rope(q, k, offsets=1000)  # noqa: E731
    step()
    core = decode_step("auto", False)
    core()
    assert len(ropekit_calls(step)) <= len(ropekit_calls(core)) + MODULE_EXTRA, ropekit_calls(step)


@pytest.mark.c_compiler
def test_the_first_call_checks_in_full_and_the_second_uses_the_plan():
    clear_backend_cache()
    step = decode_step("cpu", False)
    assert "check_x" in ropekit_calls(step)
    assert "check_x" not in ropekit_calls(step)
    assert "run" in ropekit_calls(step)


def _q_k():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 3, 4, 16, generator=g), torch.randn(2, 3, 2, 16, generator=g)


@pytest.mark.parametrize(
    "change",
    ["transposed q", "other dtype", "other shape", "other table", "interleaved", "inverse", "strided table"],
)
@pytest.mark.parametrize("backend", [CPU, "torch"])
def test_a_changed_layout_misses_the_plan_and_gets_its_own_answer(backend, change):
    """A plan made for one layout never serves another: each call equals the torch backend's answer."""
    cos, sin = tables(16)
    q, k = _q_k()
    kw = dict(offsets=5, backend=backend)
    apply_rotary_qk(q, k, cos, sin, **kw)  # plans this key
    flags: dict = {}
    if change == "transposed q":  # same shape, other strides
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    elif change == "other dtype":
        q, k = q.half(), k.half()
    elif change == "other shape":
        q, k = q[:, :2].contiguous(), k[:, :2].contiguous()
    elif change == "other table":
        cos, sin = cos[:, :4].contiguous(), sin[:, :4].contiguous()
    elif change == "strided table":
        cos, sin = tables(32)
        cos, sin = cos[:, :8], sin[:, :8]  # row stride 16
    else:
        flags[change] = True
    for _ in range(2):  # the second call runs the new key's own plan
        got = apply_rotary_qk(q, k, cos, sin, **kw, **flags)
        want = BACKENDS["torch"].rotate_qk(
            q, k, cos, sin, None, interleaved=flags.get("interleaved", False),
            conjugate=flags.get("inverse", False), inplace=False, offset=5,
        )  # fmt: skip
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("backend", [CPU, "torch"])
def test_a_planned_call_still_refuses_an_offset_past_the_table(backend):
    cos, sin = tables(16)  # 64 rows
    q, k = _q_k()
    apply_rotary_qk(q, k, cos, sin, offsets=5, backend=backend)
    with pytest.raises(ValueError, match=r"position 66 is (past|outside) the cos/sin table"):
        apply_rotary_qk(q, k, cos, sin, offsets=64, backend=backend)


@pytest.mark.parametrize("value", [1, 0, "yes"])
def test_a_planned_call_still_refuses_a_flag_that_is_not_a_bool(value):
    """1 == True and hash(1) == hash(True): a plan made for True must not answer interleaved=1."""
    cos, sin = tables(16)
    q, k = _q_k()
    apply_rotary_qk(q, k, cos, sin, interleaved=True, inplace=True)
    apply_rotary_qk(q, k, cos, sin, interleaved=False, inverse=False)
    with pytest.raises(ValueError, match=r"interleaved: expected"):
        apply_rotary_qk(q, k, cos, sin, interleaved=value)
    with pytest.raises(ValueError, match=r"inplace: expected"):
        apply_rotary_qk(q, k, cos, sin, inplace=value)
    with pytest.raises(ValueError, match=r"inverse: expected"):
        apply_rotary_qk(q, k, cos, sin, inverse=value)


def test_in_place_q_and_k_that_overlap_are_refused_even_after_a_disjoint_call_planned_them():
    """The plan's key holds strides, not where q and k lie: their overlap is checked per distance."""
    cos, sin = tables(16)
    buf = torch.randn(2, 3, 8, 16)  # (batch, seq, heads, head_dim): q and k are head slices of it
    apply_rotary_qk(buf[:, :, :4], buf[:, :, 4:], cos, sin, inplace=True)  # disjoint: planned
    apply_rotary_qk(buf[:, :, :4], buf[:, :, 4:], cos, sin, inplace=True)  # served by the plan
    with pytest.raises(ValueError, match=r"k: inplace=True writes q and k, which share memory"):
        apply_rotary_qk(buf[:, :, :4], buf[:, :, 2:6], cos, sin, inplace=True)  # same strides, overlap


def test_calls_that_record_autograd_history_never_use_a_plan():
    cos, sin = tables(16)
    q, k = _q_k()
    apply_rotary_qk(q, k, cos, sin)
    q.requires_grad_()
    assert "run" not in ropekit_calls(lambda: apply_rotary_qk(q, k, cos, sin))
    out_q, _ = apply_rotary_qk(q, k, cos, sin)
    assert out_q.grad_fn is not None


def test_clear_backend_cache_forgets_the_plans():
    cos, sin = tables(16)
    q, k = _q_k()
    apply_rotary_qk(q, k, cos, sin)
    assert plan._plans
    clear_backend_cache()
    assert not plan._plans


def test_apply_rotary_alone_uses_a_plan_too():
    cos, sin = tables(16)
    x = torch.randn(2, 3, 4, 16)
    apply_rotary(x, cos, sin, offsets=2)
    calls = ropekit_calls(lambda: apply_rotary(x, cos, sin, offsets=2))
    assert "run" in calls and "check_x" not in calls


@pytest.mark.c_compiler
def test_a_planned_offsets_tensor_still_gets_the_checked_paths_errors():
    """Per-sequence offsets are checked by the C loop before it writes; a bad one falls back to the checked
    path, whose messages stay as they were."""
    cos, sin = tables(16)  # 64 rows
    q, k = _q_k()
    apply_rotary_qk(q, k, cos, sin, offsets=torch.tensor([1, 2]), backend="cpu")  # plans this key
    q_before = q.clone()
    with pytest.raises(ValueError, match=r"offsets: expected values >= 0, got a minimum of -1"):
        apply_rotary_qk(q, k, cos, sin, offsets=torch.tensor([3, -1]), backend="cpu", inplace=True)
    with pytest.raises(ValueError, match=r"position 64 is past the cos/sin table"):
        apply_rotary_qk(q, k, cos, sin, offsets=torch.tensor([3, 62]), backend="cpu", inplace=True)
    assert torch.equal(q, q_before)
    got = apply_rotary_qk(q, k, cos, sin, offsets=torch.tensor([3, 61]), backend="cpu")
    want = apply_rotary_qk(q, k, cos, sin, positions=torch.tensor([[3, 4, 5], [61, 62, 63]]), backend="torch")
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.c_compiler
def test_an_output_large_enough_for_huge_pages_is_still_exact():
    """Out of place, outputs of 8 MB or more get huge-page advice (page faults at prefill); the values are
    the same as the torch backend's, bit for bit."""
    cos, sin = tables(128)
    q = torch.randn(1, 64, 256, 128)  # (batch, seq, heads, head_dim): 8 MB of float32
    got = apply_rotary(q, cos, sin, backend="cpu")
    want = apply_rotary(q, cos, sin, backend="torch")
    assert got.nbytes >= 8 << 20
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.c_compiler
def test_a_key_without_a_plan_is_not_planned_again_every_call(monkeypatch):
    """A backend whose plan answers None for a kind (here the C loop's, made to refuse): the first call
    learns that and keeps None for its key; later calls of the same key take the checked path without
    asking the backend again, and stay exact."""
    clear_backend_cache()
    asked = []
    cpu = BACKENDS["cpu"]
    monkeypatch.setattr(cpu, "plan", lambda *a, **kw: asked.append(1))  # no plan for any kind
    q, k = torch.randn(1, 1, 4, 32), torch.randn(1, 1, 2, 32)
    angle = torch.rand(16, 16) * 6.0
    cos, sin = angle.cos(), angle.sin()
    first = apply_rotary_qk(q, k, cos, sin, offsets=3, backend="cpu")
    assert len(asked) == 1 and None in plan._plans.values()
    for _ in range(3):
        again = apply_rotary_qk(q, k, cos, sin, offsets=3, backend="cpu")
        torch.testing.assert_close(again, first, atol=0, rtol=0)
    assert len(asked) == 1
    monkeypatch.undo()
    clear_backend_cache()
    planned = apply_rotary_qk(q, k, cos, sin, offsets=3, backend="cpu")  # the real plan, once kept
    torch.testing.assert_close(planned, first, atol=0, rtol=0)


@pytest.mark.parametrize("backend", [CPU, "torch"])
def test_q_and_k_aliasing_through_two_storages_are_refused_by_a_plan_and_after_it(backend):
    """Issue 24, repro 7: see boundary_checks."""
    check_aliasing_storages_are_refused_when_planned(backend)


@pytest.mark.parametrize("backend", [CPU, "torch"])
@pytest.mark.parametrize("entry", sorted(CORE_ENTRIES))
def test_a_planned_in_place_write_bumps_the_version_counter(entry, backend):
    """Issue 24: deleting the bump from the C launch plan's run passed every test (each called once, so the
    checked path served it). The second call of a kind runs the plan."""
    assert_planned_write_bumps_the_version(*CORE_ENTRIES[entry], backend)


@pytest.mark.parametrize("entry", sorted(COMPAT_ENTRIES))
def test_a_planned_compat_in_place_write_bumps_the_version_counter(entry):
    assert_planned_write_bumps_the_version(*COMPAT_ENTRIES[entry], "auto")


@pytest.mark.c_compiler
def test_the_plan_served_the_planned_version_test():
    """The planned-version tests above reach a plan's run, not the checked path again."""
    cos, sin = tables(16)
    x = torch.randn(1, 4, 2, 16)
    apply_rotary(x, cos, sin, inplace=True, backend="cpu")
    calls = ropekit_calls(lambda: apply_rotary(x, cos, sin, inplace=True, backend="cpu"))
    assert "run" in calls and "check_x" not in calls


def test_the_gate_keys_every_fact_a_check_reads_and_refuses_what_no_plan_may_take():
    """plan.gate: one template for every op's gate. An int's value goes to the run, not the key; a flag's
    value is the key, of exactly its kind (1 == True, but interleaved=1 is refused by the checked path); a
    layout, a tensor subclass, a float where an int goes, a flag of another type, autograd history or an
    argument no plan serves never reach a plan."""
    plan.clear_plans()
    launch = plan.gate("test_op", "x y? n# z!", "flag:bool")
    x = torch.zeros(2, 3)
    out, key = launch(x, None, 3, None, flag=True)
    assert out is None and key is not None and key[0] == "test_op"
    plan.keep(key, lambda x, y, n, z: ("ran", n))
    assert launch(x, None, 4, None, flag=True) == (("ran", 4), None)
    assert launch(x.clone(), None, 5, None, flag=True) == (("ran", 5), None)  # another tensor, same layout
    for missed in (
        launch(x.t(), None, 4, None, flag=True),  # another stride
        launch(x, x, 4, None, flag=True),  # y given
        launch(x, None, torch.tensor([4]), None, flag=True),  # per-sequence offsets
    ):
        assert missed[0] is None and missed[1] is not None and missed[1] != key
    for refused in (
        launch(torch.nn.Parameter(x), None, 4, None, flag=True),  # a tensor subclass
        launch(x, None, 4.0, None, flag=True),  # a float where an int or a tensor goes
        launch(x, None, 4, None, flag=1),  # 1 == True, but not a bool: the checked path refuses it
        launch(x, None, 4, None, flag=[1]),  # a flag of another type (unhashable)
        launch(x.clone().requires_grad_(), None, 4, None, flag=True),  # autograd history to record
        launch(x, None, 4, x, flag=True),  # z given: no plan serves it
    ):
        assert refused == (None, None)
    plan.keep(key, None)  # the kind has no plan: no key is handed out again
    assert launch(x, None, 4, None, flag=True) == (None, None)
    plan.clear_plans()


def test_a_scale_argument_is_keyed_by_a_tensors_layout_or_a_numbers_value_and_reaches_the_run_as_given():
    """A ``name$`` argument (the FP8 scales): a tensor is keyed by its layout (its values go to the run), a
    number (int or float) by its value, None as None; a bool, a string, a tensor subclass or a tensor that
    requires grad never reach a plan (the checked path decides)."""
    plan.clear_plans()
    launch = plan.gate("test_scale", "x s$", "")
    x, scale = torch.zeros(2), torch.tensor(0.5)
    keys = {}
    for given in (0.5, 2, None, scale):
        out, keys[repr(given)] = launch(x, given)
        assert out is None and keys[repr(given)] is not None
        plan.keep(keys[repr(given)], lambda x, s: ("ran", s))
    assert len(set(keys.values())) == 4  # each kind and value a key of its own
    assert launch(x, 0.5) == (("ran", 0.5), None)
    other = torch.tensor(3.0)  # another 0-d tensor: the same key, and the run reads this one
    (ran, given), key = launch(x, other)
    assert ran == "ran" and given is other and key is None
    out, key = launch(x, 0.25)  # another value: another key
    assert out is None and key not in keys.values()
    out, key = launch(x, torch.ones(2))  # another layout: another key
    assert out is None and key not in keys.values()
    for refused in (
        launch(x, True),
        launch(x, "0.5"),
        launch(x, torch.nn.Parameter(scale)),  # a tensor subclass
        launch(x, scale.clone().requires_grad_()),  # autograd history to record, as for any tensor argument
    ):
        assert refused == (None, None)
    plan.clear_plans()


def test_a_number_or_none_flag_and_a_dtype_flag_are_keyed_by_value_and_exact_kind():
    """The FP8 op's flags: a scale given as a number (number?: an int, a float or None) and its FP8 dtype
    (dtype: a torch.dtype) are in the key by value; a bool, a string or a tensor in their place never reach a
    plan (the checked path decides)."""
    plan.clear_plans()
    launch = plan.gate("test_kinds", "x", "scale:number? dtype:dtype")
    x = torch.zeros(2)
    keys = [launch(x, scale=s, dtype=torch.float8_e4m3fn)[1] for s in (0.5, 2, None)]
    keys.append(launch(x, scale=0.5, dtype=torch.float8_e5m2)[1])
    assert None not in keys and len(set(keys)) == 4
    plan.keep(keys[0], lambda x: "ran")
    assert launch(x, scale=0.5, dtype=torch.float8_e4m3fn) == ("ran", None)
    fp8 = torch.float8_e4m3fn
    for scale, dtype in ((True, fp8), ("0.5", fp8), (torch.tensor(0.5), fp8), (0.5, "float8_e4m3fn")):
        assert launch(x, scale=scale, dtype=dtype) == (None, None)
    plan.clear_plans()


class _PackedRecorder:
    """A backend whose plan records what it was asked for and whose launch reports its arguments."""

    name = "recorder"

    def __init__(self):
        self.asked = []

    def plan(self, q, k, cos, sin, *, interleaved, conjugate, inplace, per_sequence=False, cu_seqlens=None):
        self.asked.append((per_sequence, cu_seqlens))
        return lambda *args: ("launched", len(args))


def _packed(lengths=(2, 0, 3)):
    g = torch.Generator().manual_seed(1)
    tokens = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)  # (N + 1,)
    return torch.randn(tokens, 4, 16, generator=g), torch.randn(tokens, 2, 16, generator=g), cu


def test_a_packed_plan_hands_cu_seqlens_to_the_backends_launch_and_checks_the_int_offset():
    """rotary_plan with cu_seqlens: the backend plans a packed launch (given the key's cu_seqlens;
    per-sequence offsets one per packed sequence), the run passes the call's cu_seqlens on, and an int
    offset whose first row is already past the table never launches (the launch checks each sequence's
    rows)."""
    cos, sin = tables(16)  # 64 rows
    q, k, cu = _packed()
    impl = _PackedRecorder()
    flags = dict(interleaved=False, inplace=False, conjugate=False)
    run = plan.rotary_plan(impl, q, k, cos, sin, 3, **flags, cu_seqlens=cu)
    assert impl.asked == [(False, cu)]
    assert run(q, k, cos, sin, 63, cu) == ("launched", 6)
    assert run(q, k, cos, sin, 64, cu) is None
    offsets = torch.tensor([1, 2, 3])
    assert plan.rotary_plan(impl, q, k, cos, sin, offsets, **flags, cu_seqlens=cu) is not None
    assert impl.asked[-1] == (True, cu)
    refused = [
        (torch.tensor([1, 2, 3, 4, 5]), cu),  # one offset per token, not one per sequence
        (torch.tensor([1, 2, 3], dtype=torch.int32), cu),  # converted by the checked path
        (3, cu.to(torch.int16)),  # a dtype the kernels do not read
        (3, cu[None]),  # not (N + 1,)
        (3, torch.zeros(8, dtype=torch.int32)[::2]),  # not contiguous
    ]
    for offset, cu_seqlens in refused:
        assert plan.rotary_plan(impl, q, k, cos, sin, offset, **flags, cu_seqlens=cu_seqlens) is None
    # (1, T, H, D): a packed plan takes (T, H, D) only
    assert plan.rotary_plan(impl, q[None], k[None], cos, sin, 3, **flags, cu_seqlens=cu) is None


def test_a_growing_tables_packed_plan_serves_only_rows_inside_the_table_and_host_checked_offsets():
    """table_grows (the module, which grows its table where the functional call raises): a packed int offset
    launches only when all T rows fit (offset + T <= table_len, whatever the lengths), and per-sequence
    offsets are planned on CPU tensors only, whose rows the launch checks on the host before it writes; off
    the CPU (a kernel would flag the rows, not hand them back) there is no plan."""
    cos, sin = tables(16)  # 64 rows
    q, k, cu = _packed()  # T = 5
    impl = _PackedRecorder()
    flags = dict(interleaved=False, inplace=False, conjugate=False, cu_seqlens=cu, table_grows=True)
    run = plan.rotary_plan(impl, q, k, cos, sin, 3, **flags)
    assert run(q, k, cos, sin, 59, cu) == ("launched", 6)  # rows up to 63
    assert run(q, k, cos, sin, 60, cu) is None  # its rows fit (the longest sequence is 3), T does not
    offsets = torch.tensor([1, 2, 3])
    assert plan.rotary_plan(impl, q, k, cos, sin, offsets, **flags) is not None
    meta = [t.to("meta") for t in (q, k, cos, sin, offsets, cu)]
    assert plan.rotary_plan(impl, *meta[:5], **{**flags, "cu_seqlens": meta[5]}) is None
    assert plan.rotary_plan(impl, *meta[:4], 3, **{**flags, "cu_seqlens": meta[5]}) is not None


def test_a_packed_plan_refuses_an_in_place_q_that_meets_cu_seqlens():
    """The memory rule in a packed plan's run: cu_seqlens is read by the kernel as it writes q, so an in-place
    q whose bytes hold cu_seqlens never launches (the checked path decides)."""
    cos, sin = tables(16)
    q, k, cu = _packed()
    flags = dict(interleaved=False, inplace=True, conjugate=False)
    run = plan.rotary_plan(_PackedRecorder(), q, k, cos, sin, 3, **flags, cu_seqlens=cu)
    assert run(q, k, cos, sin, 3, cu) == ("launched", 6)
    inside = q.view(-1).view(torch.int32)[: cu.numel()]  # int32 elements in q's own bytes
    assert run(q, k, cos, sin, 3, inside) is None


def test_a_packed_call_takes_its_own_gate_and_a_backend_without_a_packed_plan_keeps_none(monkeypatch):
    """A packed (cu_seqlens) call is keyed by the packed gate; the torch backend has no plan, so the key is
    kept without one: every later step is served by the checked path (positions resolved), and the answers
    do not change."""
    clear_backend_cache()
    cos, sin = tables(16)
    q, k, cu = _packed()

    def step():
        return apply_rotary_qk(
            q, k, cos, sin, offsets=torch.tensor([1, 2, 3]), cu_seqlens=cu, backend="torch"
        )

    first = step()
    key = next(key for key in plan._plans if key[0] == "rotary_packed")
    assert plan._plans[key] is None
    for _ in range(2):
        calls = ropekit_calls(step)
        assert "launch_planned" in calls and "resolve" in calls
    for got, want in zip(step(), first, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


class _PositionsRecorder:
    """A backend whose plan takes explicit positions and records what it was asked for."""

    name = "positions_recorder"

    def __init__(self):
        self.asked = []

    def plan(
        self, q, k, cos, sin, *, interleaved, conjugate, inplace, per_sequence=False, cu_seqlens=None,
        positions=False,
    ):  # fmt: skip
        self.asked.append((per_sequence, cu_seqlens, positions))
        return lambda *args: ("launched", args[4])


def test_a_positions_plan_hands_the_calls_positions_to_the_backends_launch():
    """rotary_plan with positions: a backend whose plan takes ``positions`` plans the launch (with
    cu_seqlens for a packed (T,) form), and the run passes this call's positions on; positions the kernels
    cannot read as they are (another dtype, shape or layout) have no plan, and neither do backends that
    cannot check rows themselves (the torch backend, a plan without the keyword)."""
    cos, sin = tables(16)
    q, k = _q_k()  # (2, 3, heads, 16)
    flags = dict(interleaved=False, inplace=False, conjugate=False)
    impl = _PositionsRecorder()
    rows = torch.arange(6).view(2, 3)
    run = plan.rotary_plan(impl, q, k, cos, sin, 0, **flags, positions=rows)
    assert impl.asked == [(False, None, True)]
    other = rows.flip(0).contiguous()
    assert run(q, k, cos, sin, other) == ("launched", other)
    qp, kp, cu = _packed()
    packed_rows = torch.arange(qp.shape[0])
    assert plan.rotary_plan(impl, qp, kp, cos, sin, 0, **flags, positions=packed_rows, cu_seqlens=cu)
    assert impl.asked[-1] == (False, cu, True)
    for refused in (rows.int(), rows.t(), rows[:1], rows.view(-1)):
        assert plan.rotary_plan(impl, q, k, cos, sin, 0, **flags, positions=refused) is None
    for backend in (BACKENDS["torch"], _PackedRecorder()):
        assert plan.rotary_plan(backend, q, k, cos, sin, 0, **flags, positions=rows) is None


def test_a_positions_plan_refuses_an_in_place_q_or_k_that_meets_the_positions():
    """The memory rule in a positions plan's run: the kernel reads the positions as it writes q and k, so
    positions in either one's bytes never launch (the checked path decides)."""
    cos, sin = tables(16)
    q, k = _q_k()
    flags = dict(interleaved=False, inplace=True, conjugate=False)
    rows = torch.arange(6).view(2, 3)
    run = plan.rotary_plan(_PositionsRecorder(), q, k, cos, sin, 0, **flags, positions=rows)
    assert run(q, k, cos, sin, rows) == ("launched", rows)
    for holder in (q, k):
        inside = holder.view(-1).view(torch.int64)[:6].view(2, 3)  # int64 rows in its own bytes
        assert run(q, k, cos, sin, inside) is None


@pytest.mark.c_compiler
def test_explicit_positions_take_their_own_gate_keyed_by_their_layout():
    """apply_rotary_qk with positions goes through launch_rotary_positions (one gate(...) use): its key
    holds the positions' layout, so another dtype is another key; with non-zero offsets (refused by the
    checked path) no key is handed out."""
    clear_backend_cache()
    cos, sin = tables(16)
    q, k = _q_k()
    rows = torch.arange(6).view(2, 3)
    apply_rotary_qk(q, k, cos, sin, positions=rows, backend="cpu")
    apply_rotary_qk(q, k, cos, sin, positions=rows.int(), backend="cpu")
    keys = [key for key in plan._plans if key[0] == "rotary_positions"]
    assert len(keys) == 2
    assert {plan._plans[key] is None for key in keys} == {False, True}  # int32 rows: converted, no plan
    with pytest.raises(ValueError, match="offsets: expected 0 when positions is given"):
        apply_rotary_qk(q, k, cos, sin, positions=rows, offsets=1, backend="cpu")
    assert len([key for key in plan._plans if key[0] == "rotary_positions"]) == 2


@pytest.mark.c_compiler
@pytest.mark.parametrize("form", ["bfloat16", "float64", "strided rows"])
def test_tables_the_kernel_does_not_read_as_they_are_are_converted_by_the_run_each_call(form):
    """A plan on the C loop takes tables of another dtype or with strided rows (HF's bf16 rows, an
    interleaved full-width table's every other column): its run converts them per call, as the backend's
    rotate_qk does, so each call reads its own table's values, bit for bit the checked path's answer."""
    from call_count import steady_step
    from ropekit.backends.kernel_op import kernel_tables

    q, k = _q_k()

    def table(seed):
        cos, sin = tables(16)
        cos, sin = cos.roll(seed, 0), sin.roll(seed, 0)  # other rows at each position
        if form == "strided rows":
            return cos.repeat_interleave(2, -1)[:, ::2], sin.repeat_interleave(2, -1)[:, ::2]
        dtype = torch.bfloat16 if form == "bfloat16" else torch.float64
        return cos.to(dtype), sin.to(dtype)

    first_table, second_table = table(0), table(5)
    calls, first, _ = steady_step(lambda: apply_rotary_qk(q, k, *first_table, offsets=3, backend="cpu"))
    assert "run" in calls and "check_x" not in calls, calls
    got = apply_rotary_qk(q, k, *second_table, offsets=3, backend="cpu")  # same layout: the plan
    for table_pair, out in ((first_table, first), (second_table, got)):
        want = BACKENDS["cpu"].rotate_qk(
            q,
            k,
            *kernel_tables(*table_pair),
            None,
            interleaved=False,
            conjugate=False,
            inplace=False,
            offset=3,
        )
        for g, w in zip(out, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("form", ["offset", "positions", "packed", "module"])
@pytest.mark.parametrize("backend", ["auto", CPU, "torch"])
def test_a_plan_made_in_one_numerics_mode_never_serves_another(backend, form):
    clear_backend_cache()
    cos, sin = ropekit.RopeConfig(head_dim=64).cos_sin(64)
    q, k = (4 * torch.randn(2, 3, 4, 64)).bfloat16(), (4 * torch.randn(2, 3, 2, 64)).bfloat16()
    rows = torch.arange(5, 8).expand(2, 3)
    where = {
        "offset": dict(offsets=5),
        "module": dict(offsets=5),
        "positions": dict(positions=rows.contiguous()),
        "packed": dict(cu_seqlens=torch.tensor([0, 3, 6], dtype=torch.int32), offsets=5),
    }[form]
    if form == "packed":
        q, k = q.flatten(0, 1), k.flatten(0, 1)  # (T, H, D): two sequences of 3 tokens
    modules = {m: ropekit.RotaryEmbedding(head_dim=64, backend=backend, numerics=m) for m in ("exact", "hf")}
    want = {}
    for numerics in ("exact", "hf", "vllm"):  # each mode's checked path, no plan kept yet
        clear_backend_cache()
        want[numerics] = apply_rotary_qk(q, k, cos, sin, **where, backend=backend, numerics=numerics)
    assert not torch.equal(want["exact"][0], want["hf"][0])
    clear_backend_cache()
    for _ in range(3):  # alternating on the same shapes: every call after the first of its mode is planned
        for numerics in ("exact", "hf") if form == "module" else ("exact", "hf", "vllm", "hf"):
            if form == "module":
                out = modules[numerics](q, k, offsets=5)
            else:
                out = apply_rotary_qk(q, k, cos, sin, **where, backend=backend, numerics=numerics)
            assert all(torch.equal(a, b) for a, b in zip(out, want[numerics], strict=True)), numerics
    runs_on = ropekit.backends.select_backend(backend, q, cos).name  # "auto" without a C compiler: torch
    if runs_on == "torch" and form in ("positions", "packed"):
        return  # the torch backend plans neither (rows it cannot check itself; packed batches)
    served = {key[-1] for key, run in plan._plans.items() if run is not None}  # a key ends with its numerics
    assert served == ({"exact", "hf"} if form == "module" else {"exact", "hf", "vllm"})


def test_a_backend_that_declares_no_peer_numerics_gets_no_plan_for_them():
    """rotary_plan reads what a backend serves from its declared ``numerics`` (backends.base.served_numerics):
    a backend declaring none is never asked for a plan in "hf" / "vllm" (the checked path refuses it)."""
    asked = []

    class ExactOnly:
        name = "exact-only"

        def plan(self, q, k, cos, sin, **flags):
            asked.append(flags)
            return lambda *args: None

    cos, sin = ropekit.RopeConfig(head_dim=8).cos_sin(8)
    q = torch.zeros(1, 2, 1, 8)
    flags = dict(interleaved=False, inplace=False, conjugate=False)
    assert plan.rotary_plan(ExactOnly(), q, None, cos, sin, 0, **flags, numerics="hf") is None
    assert asked == []
    assert plan.rotary_plan(ExactOnly(), q, None, cos, sin, 0, **flags) is not None
    assert asked and "numerics" not in asked[0]
