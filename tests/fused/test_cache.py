"""ropekit.fused.cache: RoPE + KV-cache write on the torch and cpu backends (Triton: test_fused_triton.py)."""

from __future__ import annotations

import inspect
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from fused_cases import (
    FP8,
    LAYOUTS,
    check_cache_write,
    check_cache_write_fp8,
    check_duplicate_slots_are_refused,
    check_errors_write_nothing,
    check_memory_rule,
    check_wide_heads,
    tables,
)

import ropekit
from c_compiler import CPU
from call_count import ropekit_frames

BACKENDS = ["torch", CPU]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", ["offsets", "offsets_per_seq", "cu_seqlens", "positions"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_cache_write_matches_the_float64_reference(backend, layout, mode, interleaved):
    check_cache_write(backend, mode, layout, torch.float32, interleaved, inplace=mode != "offsets")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("inplace", [False, True])
def test_cache_write_in_half_precision_and_partial_rotary(backend, dtype, inplace):
    check_cache_write(backend, "positions", "hnd", dtype, False, inplace, partial=True)


def test_cache_write_float64_on_the_torch_backend():
    check_cache_write("torch", "cu_seqlens", "nhd", torch.float64, True, True, partial=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_cache_holds_the_contract_bytes(backend, layout, fp8_dtype, per_head):
    check_cache_write_fp8(backend, layout, fp8_dtype, per_head)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_is_one_value_error_and_writes_nothing(backend):
    check_errors_write_nothing(backend)


@pytest.mark.c_compiler
def test_cpu_and_torch_write_identical_bytes():
    """The C loop rounds as the torch reference does: the same caches bit for bit (bf16, both pairings)."""
    cos, sin = tables(16)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(9, h, 16, generator=g).bfloat16() for h in (4, 2, 2))
    slots = torch.randperm(20, generator=g)[:9]
    out = {}
    for backend in ("torch", "cpu"):
        k_cache, v_cache = (
            torch.zeros(5, 2, 4, 16, dtype=torch.bfloat16),
            torch.zeros(5, 2, 4, 16, dtype=torch.bfloat16),
        )
        q_out = ropekit.apply_rotary_qk_and_cache(
            q, k, v, cos, sin, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots, cache_layout="hnd",
            positions=torch.arange(9) * 3, interleaved=True, backend=backend,
        )  # fmt: skip
        out[backend] = (q_out, k_cache, v_cache)
    assert all(torch.equal(a, b) for a, b in zip(out["torch"], out["cpu"], strict=True))


def test_cache_write_refuses_tensors_that_require_grad():
    cos, sin = tables(8)
    q = torch.randn(3, 2, 8, requires_grad=True)
    k = v = torch.randn(3, 1, 8)
    cache = torch.zeros(4, 1, 8)
    with pytest.raises(ValueError, match="q: apply_rotary_qk_and_cache is inference only"):
        ropekit.apply_rotary_qk_and_cache(
            q, k, v, cos, sin, k_cache=cache, v_cache=cache.clone(), slot_mapping=torch.arange(3),
            cache_layout="flat",
        )  # fmt: skip
    with torch.no_grad():
        ropekit.apply_rotary_qk_and_cache(
            q, k, v, cos, sin, k_cache=cache, v_cache=cache.clone(), slot_mapping=torch.arange(3),
            cache_layout="flat",
        )  # fmt: skip


def test_shared_k_and_v_cache_is_refused():
    cos, sin = tables(8)
    q, k, v = torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    cache = torch.zeros(4, 1, 8)
    with pytest.raises(ValueError, match="v_cache"):
        ropekit.apply_rotary_qk_and_cache(
            q, k, v, cos, sin, k_cache=cache, v_cache=cache, slot_mapping=torch.arange(3), cache_layout="flat"
        )


def test_inplace_q_that_shares_memory_with_k_is_refused_before_writing():
    cos, sin = tables(8)
    qk = torch.randn(3, 2, 8)
    before = qk.clone()
    cache = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="q: it is written and shares memory with k, which the call reads"):
        ropekit.apply_rotary_qk_and_cache(
            qk, qk, torch.randn(3, 2, 8), cos, sin, k_cache=cache, v_cache=cache.clone(),
            slot_mapping=torch.arange(3), cache_layout="flat", positions=torch.arange(3), inplace=True,
        )  # fmt: skip
    assert torch.equal(qk, before) and not cache.any()


@pytest.mark.c_compiler
def test_the_c_loop_with_two_threads_writes_the_bytes_of_the_torch_reference():
    """Big enough for OpenMP (one parallel region, channels without a barrier between them), FP8 caches."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(700, h, 64, generator=g) for h in (8, 2, 2))
        cos, sin = tables(64)
        slots = torch.randperm(1024, generator=g)[:700]
        positions = torch.randint(0, 64, (700,), generator=g)
        out = {}
        for backend in ("torch", "cpu"):
            k_cache = torch.zeros(64, 16, 2, 64, dtype=torch.float8_e4m3fn)
            v_cache = torch.zeros(64, 16, 2, 64, dtype=torch.float8_e5m2)
            q_work = q.clone()
            ropekit.apply_rotary_qk_and_cache(
                q_work, k, v, cos, sin, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots,
                positions=positions, inplace=True, k_scale=0.1, v_scale=torch.tensor([0.5, 0.25]),
                backend=backend,
            )  # fmt: skip
            out[backend] = (q_work, k_cache.view(torch.uint8), v_cache.view(torch.uint8))
        assert all(torch.equal(a, b) for a, b in zip(out["torch"], out["cpu"], strict=True))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.c_compiler
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_loops_specialised_head_shapes_write_the_bytes_of_the_torch_reference(
    head_dim, interleaved, dtype
):
    """head_dim 64 and 128 (and v of 128, FP8 or not) run compile-time specialisations of the C loop."""
    cos, sin = tables(head_dim)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(6, h, head_dim, generator=g).to(dtype) for h in (4, 2, 2))
    slots = torch.tensor([3, 0, -1, 9, 4, 7])
    for cache_dtype, scale in ((dtype, None), (torch.float8_e4m3fn, 0.02)):
        out = {}
        for backend in ("torch", "cpu"):
            k_cache = torch.zeros(3, 4, 2, head_dim, dtype=cache_dtype)
            v_cache = torch.zeros(3, 4, 2, head_dim, dtype=cache_dtype)
            q_out = ropekit.apply_rotary_qk_and_cache(
                q, k, v, cos, sin, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots,
                positions=torch.arange(6) * 5, interleaved=interleaved, k_scale=scale, v_scale=scale,
                backend=backend,
            )  # fmt: skip
            out[backend] = (q_out, k_cache.view(torch.uint8), v_cache.view(torch.uint8))
        assert all(torch.equal(a, b) for a, b in zip(out["torch"], out["cpu"], strict=True))


def _aligned(shape: tuple[int, ...], dtype: torch.dtype, aligned: bool) -> torch.Tensor:
    """Zeros whose first element starts a 64-byte line (aligned) or lies one element past one (a view)."""
    size = torch.Size(shape).numel()
    flat = torch.zeros(size + 64, dtype=dtype)
    skip = (-flat.data_ptr() // flat.element_size()) % (64 // flat.element_size())
    start = skip if aligned else skip + 1
    return flat[start : start + size].view(shape)


@pytest.mark.c_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [128, 64])
@pytest.mark.parametrize(("tokens", "aligned"), [(6, True), (6, False), (2100, True)])
def test_the_c_loops_three_store_modes_write_the_bytes_of_the_torch_reference(
    dtype, rotary_dim, tokens, aligned
):
    """Small calls store each head straight to its destination, cache rows of whole 64-byte lines with
    streaming stores (aligned), the rest with plain ones (one element off a line); calls past a million
    elements through the scratch row. Partial rotary: the tail passes through in every mode."""
    cos, sin = tables(rotary_dim)
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(tokens, h, 128, generator=g).to(dtype) for h in (4, 2, 2))
    slots = torch.randperm(2 * tokens + 2, generator=g)[:tokens]
    slots[1] = -1  # a skipped token
    positions = torch.randint(0, cos.shape[0], (tokens,), generator=g)
    pages = -(-(2 * tokens + 2) // 4)
    out = {}
    for backend in ("torch", "cpu"):
        k_cache, v_cache = (_aligned((pages, 4, 2, 128), dtype, aligned) for _ in range(2))
        q_work = q.clone()
        ropekit.apply_rotary_qk_and_cache(
            q_work, k, v, cos, sin, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots, positions=positions,
            inplace=True, backend=backend,
        )  # fmt: skip
        out[backend] = (q_work, k_cache, v_cache)
    assert all(torch.equal(a, b) for a, b in zip(out["torch"], out["cpu"], strict=True))
    assert not torch.equal(out["cpu"][1], torch.zeros_like(out["cpu"][1]))


@pytest.mark.parametrize("scale", [1e-46, 1e300, torch.tensor(1e-46, dtype=torch.float64)])
def test_an_fp8_cache_scale_is_checked_after_its_float32_cast(scale):
    """Issue 24, defect 4, for the cache's k_scale / v_scale: > 0 as given but 0 or inf in float32."""
    cos, sin = tables(8)
    q, k, v = torch.zeros(3, 2, 8), torch.zeros(3, 1, 8), torch.zeros(3, 1, 8)
    kc, vc = (
        torch.zeros(10, 1, 8, dtype=torch.float8_e4m3fn),
        torch.zeros(10, 1, 8, dtype=torch.float8_e4m3fn),
    )
    for name in ("k_scale", "v_scale"):
        scales = {"k_scale": 1.0, "v_scale": 1.0, name: scale}
        with pytest.raises(ValueError, match=rf"^{name}: expected .*finite.* > 0.*float32"):
            ropekit.apply_rotary_qk_and_cache(
                q, k, v, cos, sin, k_cache=kc, v_cache=vc, slot_mapping=torch.arange(3), cache_layout="flat",
                **scales,
            )  # fmt: skip
        assert not kc.view(torch.uint8).any() and not vc.view(torch.uint8).any()


def test_a_meta_table_is_a_value_error_naming_it_and_writes_nothing():
    """Issue 24: a meta cos / sin beside CPU inputs was NotImplementedError ("Cannot copy out of meta")."""
    cos, sin = tables(8)
    tabs = {"cos": cos.to("meta"), "sin": sin.to("meta")}
    q, k, v = torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    kc, vc = torch.zeros(10, 1, 8), torch.zeros(10, 1, 8)
    with pytest.raises(ValueError, match=r"^cos: expected a tensor with values.* got a meta tensor"):
        ropekit.apply_rotary_qk_and_cache(
            q, k, v, tabs["cos"], tabs["sin"], k_cache=kc, v_cache=vc, slot_mapping=torch.arange(3),
            cache_layout="flat",
        )  # fmt: skip
    assert not kc.any() and not vc.any()


@pytest.mark.parametrize("backend", ["torch", CPU])
def test_a_written_tensor_sharing_memory_with_a_read_one_is_a_value_error(backend):
    """Issue 24, repro 2 (the cpu backend was off by 3.7): see fused_cases."""
    check_memory_rule(backend)


@pytest.mark.parametrize("backend", ["torch", CPU])
def test_a_slot_given_twice_is_a_value_error_and_padding_may_repeat(backend):
    """Issue 24, defect 3: see fused_cases."""
    check_duplicate_slots_are_refused(backend)


@pytest.mark.c_compiler
def test_a_head_past_the_kernel_bound_is_refused_by_cpu_and_served_by_auto():
    """Issue 24, defect 8 (20,000 passed silently): see fused_cases."""
    check_wide_heads("cpu")


@pytest.mark.c_compiler
def test_a_very_wide_head_does_not_crash_the_process():
    """Issue 24, defect 8: a v head of 4,000,000 floats killed the process (SIGSEGV) with backend "cpu" or
    "auto". Run in a child so a crash fails this test instead of ending pytest."""
    code = """
import torch, ropekit
cos, sin = ropekit.RopeConfig(16).cos_sin(64)
k, v = torch.randn(2, 1, 16), torch.randn(2, 1, 4_000_000)
kw = dict(slot_mapping=torch.tensor([0, 1]), positions=torch.arange(2), cache_layout="flat")
vc = torch.zeros(4, 1, 4_000_000)
try:
    ropekit.apply_rotary_qk_and_cache(None, k, v, cos, sin, k_cache=torch.zeros(4, 1, 16), v_cache=vc,
                                      backend="cpu", **kw)
except ValueError as err:
    print("refused:", err)
ropekit.apply_rotary_qk_and_cache(None, k, v, cos, sin, k_cache=torch.zeros(4, 1, 16), v_cache=vc,
                                  backend="auto", **kw)
print("auto exact:", torch.equal(vc[:2], v))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert "refused: backend: 'cpu' serves heads of up to 16384" in result.stdout
    assert "auto exact: True" in result.stdout


@pytest.mark.c_compiler
def test_the_c_loop_checks_its_own_width_bound_before_writing(monkeypatch):
    """Defence in depth for defect 8: even if the Python bound were skipped, the C loop refuses a head wider
    than its fixed scratch row (it returns before writing; the launcher raises)."""
    from ropekit.backends.c import fused as fused_cpu
    from ropekit.backends.fused_launch import Channel, FusedLaunch

    monkeypatch.setattr(fused_cpu, "check_bounds", lambda plan: None)
    cos, sin = tables(16)
    src, dst = torch.randn(1, 2, 1, 20000), torch.zeros(1, 2, 1, 20000)
    plan = FusedLaunch(1, 2, cos, sin, None, 0, None, False, False,
                       (None, None, Channel(src, dst, rotate=False, by_slot=False)))  # fmt: skip
    with pytest.raises(ValueError, match="wider than the C loop's scratch row"):
        fused_cpu.launch(plan, checked=True)
    assert not dst.any()


def _planned_decode(seed: int = 0):
    """Inputs of an in-place decode step on the C loop whose key has a launch plan (two calls made: the first
    plans it, the second is served by it), and a function to call it again with changed arguments."""
    from call_count import ropekit_calls

    g = torch.Generator().manual_seed(seed)
    cos, sin = ropekit.RopeConfig(16).cos_sin(64)
    q, k, v = (torch.randn(2, 1, h, 16, generator=g) for h in (4, 2, 2))
    caches = [torch.zeros(4, 8, 2, 16) for _ in range(2)]  # "nhd" (pages, page_size, heads, head_dim)

    def step(q, slots, caches=caches):
        return ropekit.apply_rotary_qk_and_cache(
            q, k, v, cos, sin, k_cache=caches[0], v_cache=caches[1], slot_mapping=slots, cache_layout="nhd",
            offsets=5, inplace=True, backend="cpu",
        )  # fmt: skip

    slots = torch.tensor([[3], [9]])
    step(q.clone(), slots)
    assert "run" in ropekit_calls(lambda: step(q.clone(), slots))  # the plan served it
    return q, caches, step


@pytest.mark.c_compiler
def test_a_planned_step_still_refuses_a_slot_given_twice_and_writes_nothing():
    """Issue 24, defect 3, on the launch plan (ropekit.fused.planned): a slot twice sends the call to the
    checked path, which names it; "last token wins" was the C loop's answer without the check."""
    q, caches, step = _planned_decode()
    before, q_before = [c.clone() for c in caches], q.clone()
    with pytest.raises(ValueError, match=r"slot_mapping: slot 6 is given twice \(tokens 0 and 1\)"):
        step(q, torch.tensor([[6], [6]]))
    assert all(torch.equal(a, b) for a, b in zip(caches, before, strict=True)) and torch.equal(q, q_before)
    step(q, torch.tensor([[-1], [-1]]))  # padding may repeat: the plan writes q, no cache slot
    assert all(torch.equal(a, b) for a, b in zip(caches, before, strict=True)) and not torch.equal(
        q, q_before
    )


@pytest.mark.c_compiler
@pytest.mark.parametrize("tokens", [64, 65, 300])
def test_a_planned_step_of_many_tokens_refuses_a_slot_given_twice_wherever_it_lies(tokens):
    """The plan's C loop checks distinct slots itself: every pair up to 64 tokens, a hash set above. A
    repeat anywhere (the last two tokens, the first and last) goes to the checked path, which names it."""
    from call_count import ropekit_calls

    g = torch.Generator().manual_seed(3)
    cos, sin = ropekit.RopeConfig(16).cos_sin(64)
    q, k, v = (torch.randn(tokens, 1, h, 16, generator=g) for h in (2, 1, 1))
    caches = [torch.zeros(3 * tokens, 4, 1, 16) for _ in range(2)]  # 12 * tokens slots

    def step(slots):
        return ropekit.apply_rotary_qk_and_cache(
            q, k, v, cos, sin, k_cache=caches[0], v_cache=caches[1], slot_mapping=slots.view(tokens, 1),
            cache_layout="nhd", offsets=5, inplace=True, backend="cpu",
        )  # fmt: skip

    slots = torch.randperm(8 * tokens, generator=g)[:tokens]
    slots[::7] = -1  # padding may repeat
    step(slots)
    assert "run" in ropekit_calls(lambda: step(slots))  # the plan served it
    before, q_before = [c.clone() for c in caches], q.clone()
    for first, second in ((tokens - 2, tokens - 1), (1, tokens - 1)):
        repeated = slots.clone()
        repeated[first] = repeated[second] = 10 * tokens + 1
        with pytest.raises(
            ValueError, match=rf"slot {10 * tokens + 1} is given twice \(tokens {first} and {second}\)"
        ):
            step(repeated)
        assert all(torch.equal(a, b) for a, b in zip(caches, before, strict=True)) and torch.equal(
            q, q_before
        )


@pytest.mark.c_compiler
def test_a_planned_step_still_refuses_an_inference_q_outside_inference_mode():
    """Issue 24: PyTorch refuses an in-place write of an inference tensor outside inference mode; a planned
    step (which writes through pointers) sends it to the checked path, which raises it before writing."""
    q, caches, step = _planned_decode()
    with torch.inference_mode():
        frozen = q.clone()
    before = [c.clone() for c in caches]
    with pytest.raises(RuntimeError, match=r"q: an inference tensor .* outside inference mode"):
        step(frozen, torch.tensor([[1], [2]]))
    assert torch.equal(frozen, q) and all(torch.equal(a, b) for a, b in zip(caches, before, strict=True))


@pytest.mark.c_compiler
def test_a_planned_step_still_refuses_caches_that_share_memory():
    """The memory rule on the launch plan: k_cache and v_cache over one memory (the same strides as the
    planned key) send the call to the checked path, which names them; nothing is written."""
    q, _, step = _planned_decode()
    shared = torch.zeros(4, 8, 2, 16)
    q_before = q.clone()
    with pytest.raises(ValueError, match="v_cache: the call writes k_cache and v_cache, which share memory"):
        step(q, torch.tensor([[1], [2]]), caches=[shared, shared])
    assert not shared.any() and torch.equal(q, q_before)


# The argument checks of apply_rotary_qk_and_cache (and the kernel wall, check_launch), by function name.
CHECKS = ("resolve", "check_x", "check_tables", "check_movable", "cache_view", "paged_view", "check_scale",
          "check_slots", "check_distinct_slots", "check_in_place_allowed", "check_writable", "check_no_alias",
          "check_inference", "check_launch", "_check_channel", "_check_memory")  # fmt: skip


def _holds(value, q: torch.Tensor) -> bool:
    """Whether value is q's memory: a tensor whose first element is q's, or a tuple (a launch, a channel,
    an argument list) or a dict (keyword arguments) holding one."""
    if isinstance(value, torch.Tensor):
        return value.numel() > 0 and value.data_ptr() == q.data_ptr()
    if isinstance(value, dict):
        value = tuple(value.values())
    return isinstance(value, tuple) and any(_holds(v, q) for v in value)


def _follow(q: torch.Tensor, fn) -> list[tuple[str, str, bool]]:
    """(file under ropekit/, function, whether one of its arguments holds q) for every ropekit Python call
    that fn makes, in order (sys.setprofile)."""
    root = len(str(Path(ropekit.__file__).parent)) + 1

    def record(frame):
        code = frame.f_code
        star = bool(code.co_flags & inspect.CO_VARARGS) + bool(code.co_flags & inspect.CO_VARKEYWORDS)
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount + star]
        return code.co_filename[root:], code.co_name, any(_holds(frame.f_locals.get(n), q) for n in names)

    return ropekit_frames(fn, record)


@pytest.mark.c_compiler
def test_q_enters_each_check_once_down_to_its_kernel_and_a_planned_step_enters_only_the_value_checks():
    """Issue 25: following q from apply_rotary_qk_and_cache down to the C loop, every check runs once on the
    first call of a kind (each cache is checked once, q once, the kernel wall is trusted, not re-run), and a
    planned step is the gate, the plan's value check of the slots and the kernel: no argument check again."""
    g = torch.Generator().manual_seed(25)
    cos, sin = ropekit.RopeConfig(head_dim=64).cos_sin(128)
    q, k, v = (torch.randn(3, 1, h, 64, generator=g) for h in (4, 2, 2))
    caches = [torch.zeros(4, 8, 2, 64) for _ in range(2)]
    slots = torch.tensor([[3], [9], [17]])

    def step():
        ropekit.apply_rotary_qk_and_cache(
            q, k, v, cos, sin, k_cache=caches[0], v_cache=caches[1], slot_mapping=slots, offsets=5,
            inplace=True, backend="cpu",
        )  # fmt: skip

    ropekit.backends.clear_backend_cache()
    first, steady = _follow(q, step), _follow(q, step)
    entered = Counter(name for _, name, _ in first if name in CHECKS)
    assert entered == {
        "resolve": 1, "check_x": 1, "check_tables": 1, "check_movable": 2, "cache_view": 2, "paged_view": 2,
        "check_slots": 1, "check_distinct_slots": 1, "check_in_place_allowed": 3, "check_writable": 3,
        "check_no_alias": 1, "check_inference": 1,
    }, entered  # fmt: skip
    with_q = Counter(name for _, name, held in first if held and name in CHECKS)
    assert with_q == {"resolve": 1, "check_x": 1, "check_in_place_allowed": 1, "check_writable": 1,
                      "check_no_alias": 1, "check_inference": 1}, with_q  # fmt: skip
    assert ("backends/c/fused.py", "launch", True) in first  # q reached the C loop's launcher
    # A planned step enters no argument check: its slots' distinctness is the C loop's (fused_cpu), which
    # hands a repeat back to the checked path and its error.
    assert not [name for _, name, _ in steady if name in CHECKS], steady
    assert [(f, n) for f, n, held in steady if held] == [
        ("fused/cache.py", "apply_rotary_qk_and_cache"),
        ("backends/plan.py (the gate of apply_rotary_qk_and_cache)", "launch_planned"),
        ("fused/planned.py", "run"),
    ]  # fmt: skip
