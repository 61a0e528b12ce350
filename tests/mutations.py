"""Mutation runs of the in-place write safety: each protection of an in-place path, removed, must fail a test.

Each entry of MUTATIONS names one protection (a version-counter bump, a memory-overlap check, a row / slot /
page bound) of one in-place path (functional, module, fused cache write, cache shift, QK-norm, compat), the
exact text that implements it in a file under src/, the text it becomes without it, and the pytest node ids
that must then fail. A run copies src/, tests/ and pyproject.toml to a temporary directory, applies one
mutation there (the working tree is never edited), and runs the named tests with the copy's src/ first on
PYTHONPATH and a C-kernel build cache that the mutants one process runs share (each library is cached under
a hash of its source, so a mutated kernel never loads another's build); the mutation is "caught" when they
fail, "survives" when they pass.

    python tests/mutations.py            # every mutation; exit status 1 if one survives
    python tests/mutations.py --list     # names only
    python tests/mutations.py --only NAME [--only NAME ...]

docs/safety.md (## Mutations) lists the results; tests/test_mutations.py checks that every entry still
applies (its old text occurs exactly once) and, as a proof, runs them.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent


class Mutation(NamedTuple):
    name: str
    path: str  # relative to src/
    old: str  # exact text, found exactly once in path
    new: str
    tests: tuple[str, ...]  # pytest node ids (relative to the repository root) of which one must fail
    # More (path, old, new) edits made with this one: two checks that guard the same write (a host check
    # and the C loop's) each survive alone by design; removed together, a test must fail.
    also: tuple[tuple[str, str, str], ...] = ()
    # Environment variables of the test run (e.g. the fuzzer's backends: a fuzz family finds a C-loop defect
    # only in the examples that draw the C loop, and Hypothesis draws afresh each run).
    env: tuple[tuple[str, str], ...] = ()

    def edits(self) -> list[tuple[str, str, str]]:
        return [(self.path, self.old, self.new), *self.also]


_BOUNDARY = "tests/test_boundary.py::test_in_place_write_bumps_the_version_counter_on_every_backend"
_COMPAT_BOUNDARY = "tests/test_boundary.py::test_compat_in_place_write_bumps_the_version_counter"
_FUZZ = "tests/test_fuzz.py::test_any_serving_call_is_right_or_a_value_error_and_writes_only_its_outputs"

# The C launch plan's run (backends/c/rotary.py), shared by the functional API, the module and compat.vllm's
# steady step.
_C_PLAN_BUMP = (
    "            if inplace:  # what the dispatcher would do: tell autograd that q and k changed\n"
    "                torch._C._increment_version((q,) if k is None else (q, k))\n"
    "            return q_out, k_out\n"
)
_C_ROW_BOUND = "        int64_t bad = first_bad_row(pos, tokens, offset, seq, table_len); \\\n"
_FUSED_BUMP = "        self.kernels()[0](launch, checked=checked)\n        tell_autograd(written)\n"
_NO_FUSED_BUMP = "        self.kernels()[0](launch, checked=checked)\n"
_NO_QK_NORM_BUMP = "        self.kernels()[1](qkv, *weights, cos, sin, positions, offset, spec)\n"
_QK_NORM_BUMP = _NO_QK_NORM_BUMP + "        tell_autograd(written)\n"
_FUNCTIONAL_ALIAS = (
    '        ((name, q), ("k", k)), ((name, q), ("k", k), ("cos", cos), ("sin", sin), ("positions", rows))\n'
)
_FUSED_SLOT_BOUND = "            if (slots[token] < -1 || slots[token] >= num_slots) return -2 - token; \\\n"

MUTATIONS: list[Mutation] = [
    # ---- functional: apply_rotary / apply_rotary_qk in place ----
    Mutation(
        "functional: no version bump on the direct (no-dispatcher) in-place path",
        "ropekit/backends/kernel_op.py",
        "            self._rotary_(*args)\n"
        "            # What the dispatcher would do: tell autograd that q and k changed (docs/safety.md).\n"
        "            torch._C._increment_version((q,) if k is None else (q, k))\n",
        "            self._rotary_(*args)\n",
        (
            _BOUNDARY,
            "tests/test_boundary.py::test_kernel_write_bumps_the_version_exactly_once_like_a_torch_op",
        ),
    ),
    Mutation(
        "functional: no version bump in the C launch plan's run",
        "ropekit/backends/c/rotary.py",
        _C_PLAN_BUMP,
        "            return q_out, k_out\n",
        (_BOUNDARY, "tests/backends/test_plan.py", "tests/backends/c/test_c_rotary.py"),
    ),
    Mutation(
        "functional: no q / k overlap check",
        "ropekit/functional.py",
        _FUNCTIONAL_ALIAS,
        '        ((name, q),), ((name, q), ("cos", cos), ("sin", sin), ("positions", rows))\n',
        ("tests/test_functional.py", "tests/backends/test_plan.py"),
    ),
    Mutation(
        "functional: no self-overlap check (an expanded x written in place)",
        "ropekit/functional.py",
        "            check_writable(t_name, t)\n",
        "            pass\n",
        (
            "tests/test_autograd.py::test_in_place_on_an_expanded_tensor_is_a_value_error_and_leaves_it_untouched",
            "tests/test_functional.py",
        ),
    ),
    Mutation(
        "functional: no row bound in the C rotary loop",
        "ropekit/backends/c/rotary.py",
        _C_ROW_BOUND,
        "        int64_t bad = -1; \\\n",
        (
            "tests/backends/c/test_c_rotary.py",
            "tests/backends/test_kernel_op.py",
            "tests/backends/test_plan.py",
        ),
    ),
    # ---- module: RotaryEmbedding.forward(inplace=True), whose steady step is the launch plan ----
    Mutation(
        "module: no version bump in the C launch plan's run (the module's steady step)",
        "ropekit/backends/c/rotary.py",
        _C_PLAN_BUMP,
        "            return q_out, k_out\n",
        (
            f"{_BOUNDARY}[RotaryEmbedding.forward-cpu]",
            "tests/backends/test_plan.py::test_a_planned_in_place_write_bumps_the_version_counter",
            "tests/test_module.py",
        ),
    ),
    Mutation(
        "module: the plan's q / k overlap verdict always 'disjoint'",
        "ropekit/backends/plan.py",
        "                        meet = shares_memory(q, k)\n",
        "                        meet = False\n",
        ("tests/backends/test_plan.py", "tests/test_module.py"),
    ),
    # ---- fused: apply_rotary_qk_and_cache ----
    Mutation(
        "fused: no version bump after a kernel writes the caches",
        "ropekit/backends/kernel_op.py",
        _FUSED_BUMP,
        _NO_FUSED_BUMP,
        ("tests/fused/test_cache.py",),
    ),
    Mutation(
        "fused: no k_cache / v_cache overlap check",
        "ropekit/fused/cache.py",
        '        (("q", q if inplace else None), ("k_cache", k_cache), ("v_cache", v_cache)),\n',
        # v_cache left out exactly when it lies in k_cache's storage: the k_cache / v_cache pair unchecked
        '        (("q", q if inplace else None), ("k_cache", k_cache), ("v_cache", None if '
        "k_cache.untyped_storage().data_ptr() == v_cache.untyped_storage().data_ptr() else v_cache)),\n",
        ("tests/fused/test_cache.py::test_shared_k_and_v_cache_is_refused",),
    ),
    Mutation(
        "fused: no overlap check of an in-place q",
        "ropekit/fused/cache.py",
        '        (("q", q if inplace else None), ("k_cache", k_cache), ("v_cache", v_cache)),\n',
        '        (("q", None), ("k_cache", k_cache), ("v_cache", v_cache)),\n',
        ("tests/fused/test_cache.py::test_inplace_q_that_shares_memory_with_k_is_refused_before_writing",),
    ),
    Mutation(
        "fused: no slot bound in the C loop",
        "ropekit/backends/c/fused.py",
        _FUSED_SLOT_BOUND,
        "            if (0) return -2 - token; \\\n",
        (
            "tests/fused/test_cache.py::test_bad_input_is_one_value_error_and_writes_nothing",
            f"{_FUZZ}[fused]",
        ),
    ),
    Mutation(
        "fused: no slot bound in the torch reference",
        "ropekit/backends/eager/fused.py",
        "            if lo < -1 or hi >= num_slots:\n",
        "            if False:\n",
        (
            "tests/fused/test_cache.py::test_bad_input_is_one_value_error_and_writes_nothing",
            f"{_FUZZ}[fused]",
        ),
    ),
    # ---- shift: shift_cache_ ----
    Mutation(
        "shift: no version bump after a kernel rotates the cache",
        "ropekit/backends/kernel_op.py",
        _FUSED_BUMP,
        _NO_FUSED_BUMP,
        ("tests/fused/test_shift.py",),
    ),
    Mutation(
        "shift: no slot bound in the C loop",
        "ropekit/backends/c/fused.py",
        _FUSED_SLOT_BOUND,
        "            if (0) return -2 - token; \\\n",
        (
            "tests/fused/test_shift.py",
            "tests/fused/test_cache.py::test_bad_input_is_one_value_error_and_writes_nothing",
            f"{_FUZZ}[shift]",
        ),
    ),
    Mutation(
        "shift: no bound on abs(delta)",
        "ropekit/fused/shift.py",
        "    if row >= cos.shape[0]:\n",
        "    if False:\n",
        (
            "tests/fused/test_cache.py::test_bad_input_is_one_value_error_and_writes_nothing",
            f"{_FUZZ}[shift]",
        ),
    ),
    # ---- QK-norm: qk_norm_rotary_ ----
    Mutation(
        "qk_norm: no version bump after a kernel writes qkv",
        "ropekit/backends/kernel_op.py",
        _QK_NORM_BUMP,
        _NO_QK_NORM_BUMP,
        ("tests/fused/test_qk_norm.py",),
    ),
    # ---- compat: vLLM's in-place rotary_embedding, FlashInfer's paged append ----
    Mutation(
        "compat.vllm: no version bump on the direct in-place path",
        "ropekit/compat/vllm.py",
        "    _increment_version([query] if key is None else [query, key])\n",
        "",
        (
            "tests/compat/test_vllm.py::test_in_place_rotation_bumps_version_so_autograd_catches_the_overwrite",
            _COMPAT_BOUNDARY,
            "tests/test_boundary.py::test_compat_vllm_planned_step_bumps_the_version_exactly_once",
        ),
    ),
    Mutation(
        "compat.flashinfer: no position bound on the page table (a position past its request's pages)",
        "ropekit/compat/flashinfer.py",
        "        bad = ((pos < 0) | (pos >= limit)).nonzero()\n",
        "        bad = (pos < 0).nonzero()\n",
        (
            "tests/compat/test_flashinfer.py::test_append_refuses_bad_input_and_leaves_the_caches_alone",
            f"{_FUZZ}[paged]",
        ),
    ),
    Mutation(
        # The page table's host check (page ids in [0, num_pages)) keeps every slot inside the caches: the C
        # loop's slot bound under it alone survives by design.
        "compat.flashinfer: no page-id bound in the page table nor slot bound in the C loop",
        "ropekit/compat/flashinfer.py",
        "    bad = ((used < 0) | (used >= num_pages)).nonzero()\n",
        "    bad = (used < 0).nonzero()\n",
        (
            "tests/compat/test_flashinfer.py::test_append_refuses_bad_input_and_leaves_the_caches_alone",
            f"{_FUZZ}[paged]",
        ),
        also=(
            (
                "ropekit/backends/c/fused.py",
                _FUSED_SLOT_BOUND,
                "            if (0) return -2 - token; \\\n",
            ),
        ),
    ),
]


# Checks that guard one write twice (a host check before the C loop's own), removed together: each alone
# survives by design (measured: docs/safety.md, ## Mutations).
MUTATIONS += [
    Mutation(
        "functional: no offset bound in the launch plan nor in the C rotary loop",
        "ropekit/backends/plan.py",
        "        if type(offset) is int and not 0 <= offset <= last_offset:\n",
        "        if False:\n",
        ("tests/backends/test_plan.py::test_a_planned_call_still_refuses_an_offset_past_the_table",),
        also=(("ropekit/backends/c/rotary.py", _C_ROW_BOUND, "        int64_t bad = -1; \\\n"),),
    ),
    Mutation(
        "fused: no row bound in the C fused loop nor in the op's host check",
        "ropekit/backends/c/fused.py",
        _C_ROW_BOUND,
        "        int64_t bad = -1; \\\n",
        (
            "tests/fused/test_cache.py::test_bad_input_is_one_value_error_and_writes_nothing",
            f"{_FUZZ}[fused]",
        ),
        also=(("ropekit/fused/cache.py", "    pos.check_table(cos.shape[0])\n", ""),),
    ),
    Mutation(
        "qk_norm: no row bound in the C loop nor in the op's host check",
        "ropekit/backends/c/qk_norm.py",
        _C_ROW_BOUND,
        "        int64_t bad = -1; \\\n",
        ("tests/fused/test_qk_norm.py::test_a_position_past_the_table_writes_nothing", f"{_FUZZ}[qk_norm]"),
        also=(("ropekit/fused/qk_norm.py", "    pos.check_table(cos.shape[0])\n", ""),),
    ),
]

# The same protections against the serving fuzzer alone (tests/serving_fuzz.py): it finds them without a
# directed test.
MUTATIONS += [
    Mutation(
        "fuzzer alone: fused, no version bump after a kernel writes the caches",
        "ropekit/backends/kernel_op.py",
        _FUSED_BUMP,
        _NO_FUSED_BUMP,
        (f"{_FUZZ}[fused]", f"{_FUZZ}[shift]", f"{_FUZZ}[paged]"),
    ),
    Mutation(
        "fuzzer alone: fused, no slot bound in the C loop",
        "ropekit/backends/c/fused.py",
        _FUSED_SLOT_BOUND,
        "            if (0) return -2 - token; \\\n",
        (f"{_FUZZ}[fused]", f"{_FUZZ}[shift]", f"{_FUZZ}[paged]"),
        # The C loop alone: with torch and auto drawn too, 40 examples missed a bad cpu slot in 2 of 4 runs.
        env=(("ROPEKIT_FUZZ_BACKENDS", "cpu"),),
    ),
    Mutation(
        "fuzzer alone: qk_norm, no version bump after a kernel writes qkv",
        "ropekit/backends/kernel_op.py",
        _QK_NORM_BUMP,
        _NO_QK_NORM_BUMP,
        (f"{_FUZZ}[qk_norm]",),
    ),
]


_NO_CALL = "(lambda *args, **kwargs: None)("  # a call removed, its arguments still evaluated
_PLANNED_SLOTS = "    if (slots && a[10] && first_repeated_slot(slots, tokens) != -1) return REPEATED; \\\n"
_DISTINCT = "    check_distinct_slots(name, flat)\n    return flat\n"
_WIDE = '        if op == "fused" and widest > MAX_WIDTH:\n'

# The memory rule (validation.check_no_alias) in each op, distinct slots, the launch plans' value checks, the
# wide-head bound and PyTorch's in-place refusals (issue 24).
MUTATIONS += [
    Mutation(
        "functional: no memory check of a table aliasing the input",
        "ropekit/functional.py",
        _FUNCTIONAL_ALIAS,
        '        ((name, q), ("k", k)), ((name, q), ("k", k))\n',
        ("tests/test_functional.py::test_in_place_with_a_table_that_aliases_the_input_is_a_value_error",),
    ),
    Mutation(
        "fused: no memory check of a source (k, v) that lies in a cache",
        "ropekit/fused/cache.py",
        '        (("q", None if cache_only else q), ("k", k), ("v", v), ("cos", cos), ("sin", sin),\n',
        '        (("q", None if cache_only else q), ("cos", cos), ("sin", sin),\n',
        ("tests/fused/test_cache.py::test_a_written_tensor_sharing_memory_with_a_read_one_is_a_value_error",),
    ),
    Mutation(
        "shift: no memory check (a table or the slots in the cache)",
        "ropekit/fused/shift.py",
        '    check_no_alias((("k_cache", k_cache),), reads, optional=False)\n    name = select_backend(',
        f'    {_NO_CALL}(("k_cache", k_cache),), reads, optional=False)\n    name = select_backend(',
        (
            "tests/fused/test_shift.py::test_a_table_or_slots_inside_the_cache_is_a_value_error_and_nothing_rotates",
        ),
    ),
    Mutation(
        "qk_norm: no memory check (a weight or a table in qkv)",
        "ropekit/fused/qk_norm.py",
        "    check_no_alias(  # the memory rule: qkv is rotated in place of itself;",
        f"    {_NO_CALL}  # the memory rule: qkv is rotated in place of itself;",
        (
            "tests/fused/test_qk_norm.py::test_a_weight_or_table_inside_qkv_is_a_value_error_and_nothing_is_written",
        ),
    ),
    Mutation(
        "compat.flashinfer: no memory check of rope_quantize_fp8's outputs",
        "ropekit/compat/flashinfer.py",
        '    check_no_alias(\n        (("q_rope_out", q_rope_out), ("k_rope_out", k_rope_out),',
        f'    {_NO_CALL}\n        (("q_rope_out", q_rope_out), ("k_rope_out", k_rope_out),',
        (
            "tests/compat/test_flashinfer.py::test_outputs_and_caches_that_share_memory_with_an_input_or_each_other_are_refused",
        ),
    ),
    Mutation(
        "compat.flashinfer: no memory check of the paged append's outputs and caches",
        "ropekit/compat/flashinfer.py",
        '    check_no_alias(\n        (("q_rope_out", q_rope_out), ("q_nope_out", q_nope_out),',
        f'    {_NO_CALL}\n        (("q_rope_out", q_rope_out), ("q_nope_out", q_nope_out),',
        (
            "tests/compat/test_flashinfer.py::test_outputs_and_caches_that_share_memory_with_an_input_or_each_other_are_refused",
        ),
    ),
    Mutation(
        "fused: no distinct-slots check of slot_mapping",
        "ropekit/fused/checks.py",
        _DISTINCT,
        "    return flat\n",
        ("tests/fused/test_cache.py::test_a_slot_given_twice_is_a_value_error_and_padding_may_repeat",),
    ),
    Mutation(
        "shift: no distinct-slots check of slots",
        "ropekit/fused/checks.py",
        _DISTINCT,
        "    return flat\n",
        ("tests/fused/test_shift.py::test_a_slot_given_twice_is_refused_before_anything_rotates",),
    ),
    Mutation(
        "fused, planned: no distinct-slots check (the C loop's)",
        "ropekit/backends/c/fused.py",
        _PLANNED_SLOTS,
        "",
        (
            "tests/fused/test_cache.py::test_a_planned_step_still_refuses_a_slot_given_twice_and_writes_nothing",
        ),
    ),
    Mutation(
        "fused, planned: no memory check",
        "ropekit/fused/planned.py",
        "                    if meet:\n                        return None\n",
        "                    if False:\n                        return None\n",
        (
            "tests/fused/test_planned.py::test_shared_memory_still_raises_after_a_plan",
            "tests/fused/test_cache.py::test_a_planned_step_still_refuses_caches_that_share_memory",
        ),
    ),
    Mutation(
        "fused, planned: no byte-range check (the C loop's)",
        "ropekit/backends/c/fused.py",
        "    if (ranges_meet(p, a + GLOBALS + 3 * CH_INTS)) return MEETS; \\\n",
        "",
        (
            "tests/fused/test_planned.py::test_shared_memory_still_raises_after_a_plan",
            "tests/fused/test_cache.py::test_a_planned_step_still_refuses_caches_that_share_memory",
        ),
    ),
    Mutation(
        "fused, planned: an inference q or cache written in place outside inference mode",
        "ropekit/fused/planned.py",
        "        if (q_inference or caches_inference) and not torch.is_inference_mode_enabled():\n",
        "        if False:\n",
        (
            "tests/fused/test_cache.py::test_a_planned_step_still_refuses_an_inference_q_outside_inference_mode",
            "tests/fused/test_planned.py::test_caches_that_share_memory_or_an_inference_cache_after_a_plan_raise_the_checked_error",
        ),
    ),
    Mutation(
        "fused, planned: no check of a scale tensor's values (FP8 outputs and FP8 caches)",
        "ropekit/fused/planned.py",
        "                if not 0 < values < math.inf:\n",
        "                if False:\n",
        (
            "tests/fused/test_planned.py::test_a_planned_fp8_step_with_an_invalid_scale_tensor_raises_the_checked_error",
            "tests/fused/test_planned.py::test_a_value_check_that_fails_on_the_planned_path_raises_the_checked_error_and_writes_nothing",
        ),
        also=(
            (
                "ropekit/fused/planned.py",
                "            elif not (0 < min(values) and sum(values) < math.inf):\n",
                "            elif False:\n",
            ),
        ),
    ),
    Mutation(
        "fused, planned: cu_seqlens' values unchecked (a packed batch's rows)",
        "ropekit/fused/planned.py",
        "    if cu[0] != 0 or cu[-1] != steps.shape[0] or (cu[1:] < cu[:-1]).any():\n",
        "    if False:\n",
        (
            "tests/fused/test_planned.py::test_a_value_check_that_fails_on_the_planned_path_raises_the_checked_error_and_writes_nothing",
            "tests/fused/test_planned.py::test_a_value_check_failing_on_a_planned_packed_fp8_step_raises_the_checked_error",
            "tests/fused/test_planned.py::test_a_planned_step_with_positions_and_cu_seqlens_still_checks_cu_seqlens",
        ),
    ),
    Mutation(
        "fused, planned: a negative offset of an empty packed sequence accepted",
        "ropekit/fused/planned.py",
        "        if first.min() < 0:\n",
        "        if False:\n",
        (
            "tests/fused/test_planned.py::test_a_value_check_that_fails_on_the_planned_path_raises_the_checked_error_and_writes_nothing",
            "tests/fused/test_planned.py::test_a_value_check_failing_on_a_planned_packed_fp8_step_raises_the_checked_error",
        ),
    ),
    Mutation(
        "fused, planned: cu_seqlens beside per-sequence offsets not checked against the written tensors",
        "ropekit/fused/planned.py",
        "                if size and start < lo + second_span and lo < start + size:\n",
        "                if False:\n",
        (
            "tests/fused/test_planned.py::test_a_tensor_the_planned_step_reads_inside_a_cache_raises_the_checked_error_and_writes_nothing",
        ),
    ),
    Mutation(
        "qk_norm, planned: cu_seqlens not checked against qkv",
        "ropekit/fused/planned.py",
        "                        (cu_seqlens, 0)):  # fmt: skip\n",
        "                        ):  # fmt: skip\n",
        (
            "tests/fused/test_planned.py::test_a_planned_packed_qk_norm_step_whose_qkv_holds_cu_seqlens_or_offsets_raises_the_checked_error",
        ),
    ),
    Mutation(
        "shift, planned: no memory check of the cache against the tables and slots",
        "ropekit/fused/planned.py",
        "            return None  # the cache meets a table or the slots: the checked path decides\n",
        "            pass\n",
        (
            "tests/fused/test_planned.py::test_a_planned_shift_whose_cache_holds_a_table_or_its_slots_raises_the_checked_error",
        ),
    ),
    Mutation(
        "shift, planned: an inference cache rotated outside inference mode",
        "ropekit/fused/planned.py",
        "        if inference and not torch.is_inference_mode_enabled():\n",
        "        if False:\n",
        (
            "tests/fused/test_planned.py::test_a_planned_shift_bumps_the_version_once_and_refuses_an_inference_cache_outside_inference_mode",
        ),
    ),
    Mutation(
        "qk_norm, planned: no memory check",
        "ropekit/fused/planned.py",
        "                if start < hi and lo < start + (size or t.numel() * t.element_size()):\n",
        "                if False:\n",
        (
            "tests/fused/test_qk_norm.py::test_a_planned_step_still_refuses_a_weight_inside_qkv_and_an_inference_qkv",
        ),
    ),
    Mutation(
        "qk_norm, planned: an inference qkv written outside inference mode",
        "ropekit/fused/planned.py",
        "        if qkv.is_inference() and not torch.is_inference_mode_enabled():\n",
        "        if False:\n",
        (
            "tests/fused/test_qk_norm.py::test_a_planned_step_still_refuses_a_weight_inside_qkv_and_an_inference_qkv",
        ),
    ),
    Mutation(
        "compat.vllm, planned: no memory check of query against the cache and positions",
        "ropekit/compat/vllm.py",
        "        if (c < q + q_span and q < c_end) or (p < q + q_span and q < p_end):\n",
        "        if False:\n",
        ("tests/test_boundary.py::test_compat_vllm_planned_step_still_refuses_a_cache_inside_query_or_key",),
    ),
    Mutation(
        "compat.vllm, planned: no memory check of key against the cache and positions",
        "ropekit/compat/vllm.py",
        "            if (c < k + k_span and k < c_end) or (p < k + k_span and k < p_end):\n",
        "            if False:\n",
        ("tests/test_boundary.py::test_compat_vllm_planned_step_still_refuses_a_cache_inside_query_or_key",),
    ),
    Mutation(
        "fused: no wide-head bound (select_backend(..., widest=...))",
        "ropekit/backends/kernel_op.py",
        _WIDE,
        "        if False:\n",
        (
            "tests/fused/test_cache.py::test_a_head_past_the_kernel_bound_is_refused_by_cpu_and_served_by_auto",
            "tests/fused/test_cache.py::test_a_very_wide_head_does_not_crash_the_process",
        ),
    ),
    Mutation(
        "in place: an inference tensor written outside inference mode",
        "ropekit/validation.py",
        "    if not compiling and local(t).is_inference() and not torch.is_inference_mode_enabled():\n",
        "    if False:\n",
        (
            "tests/test_functional.py::test_in_place_on_an_inference_tensor_outside_inference_mode_raises_before_writing",
            "tests/fused/test_qk_norm.py::test_a_view_of_a_leaf_or_an_inference_qkv_is_refused_before_writing",
            "tests/fused/test_shift.py::test_shift_bumps_the_version_counter_and_refuses_an_inference_cache_outside_inference_mode",
        ),
    ),
    Mutation(
        "in place: a view of a leaf that requires grad",
        "ropekit/validation.py",
        "    if base is not None and base.is_leaf and base.requires_grad:\n",
        "    if False:\n",
        (
            "tests/test_functional.py::test_in_place_on_a_view_of_a_leaf_that_requires_grad_raises_before_writing",
            "tests/fused/test_qk_norm.py::test_a_view_of_a_leaf_or_an_inference_qkv_is_refused_before_writing",
        ),
    ),
    Mutation(
        "registered ops: no in-place refusal in front of the autograd kernel",
        "ropekit/backends/kernel_op.py",
        "                check_in_place_allowed(arg_name, args[i])\n",
        "                pass\n",
        (
            "tests/backends/test_kernel_op.py::"
            "test_a_registered_in_place_op_refuses_what_pytorch_refuses_before_writing",
        ),
    ),
    Mutation(
        "registered ops: an offset beside positions taken",
        "ropekit/backends/kernel_op.py",
        "    if positions is not None:\n        check_offsets_beside_positions(offset)\n",
        "",
        (
            "tests/backends/test_kernel_op.py::test_cpu_op_refuses_an_offset_beside_positions_as_apply_rotary_does",
        ),
    ),
    Mutation(
        "registered ops: the fake does not check k against q",
        "ropekit/backends/kernel_op.py",
        "    if k is not None and (k.shape[:-2] != q.shape[:-2] or k.shape[-1] != q.shape[-1]):\n",
        "    if False:\n",
        ("tests/backends/test_kernel_op.py::test_cpu_op_fake_checks_k_against_q_as_the_real_op_does",),
    ),
    Mutation(
        "fp8 op: no check of the scales' values",
        "ropekit/fused/fp8.py",
        "            check_kernel_scale(name, scale, t.shape[-2] if t.dim() > 1 else 1, q.device)\n",
        "            pass\n",
        (
            "tests/fused/test_registered_ops.py::test_the_registered_fp8_op_refuses_a_scale_the_function_refuses",
        ),
    ),
    Mutation(
        "cache op: no scale rule nor values",
        "ropekit/fused/cache.py",
        "            if cache_takes_scale(name, cache, scale):"
        "  # the public call's scale rule, form and values\n"
        "                check_kernel_scale(name, scale, k.shape[-2] if k.dim() > 1 else 1, k.device)\n",
        "            pass\n",
        (
            "tests/fused/test_registered_ops.py::"
            "test_the_registered_cache_op_refuses_an_fp8_cache_scale_the_function_refuses",
            "tests/fused/test_registered_ops.py::"
            "test_the_registered_cache_op_refuses_a_scale_for_a_cache_that_is_not_fp8_and_needs_one_for_fp8",
        ),
    ),
    Mutation(
        "qk_norm op: no check of eps and the weight offset",
        "ropekit/fused/qk_norm.py",
        "    _check_norm_numbers(spec.eps, spec.weight_offset)  # the public call's value checks\n",
        "",
        (
            "tests/fused/test_registered_ops.py::"
            "test_the_registered_qk_norm_op_refuses_an_eps_or_offset_the_function_refuses_and_writes_nothing",
        ),
    ),
    Mutation(
        "functional: cu_seqlens or per-sequence offsets inside q, in place",
        "ropekit/functional.py",
        "    if inplace is True and (cu_seqlens is not None or type(offsets) is torch.Tensor):\n",
        "    if False:\n",
        (
            "tests/test_functional.py::"
            "test_in_place_with_cu_seqlens_or_offsets_inside_the_input_is_refused_as_plans_decline_it",
        ),
    ),
    Mutation(
        "jit trace: the registered op, not the pointer call",
        "ropekit/backends/kernel_op.py",
        "        and jit_tracing() is None\n",
        "",
        ("tests/backends/test_jit_trace.py",),
    ),
    Mutation(
        "jit trace: compat.vllm records its own op",
        "ropekit/compat/vllm.py",
        "        or _jit_tracing()\n",
        "",
        ("tests/backends/test_jit_trace.py",),
    ),
    Mutation(
        "compat.vllm: the halves memo keyed on the cache's pointer alone",
        "ropekit/compat/vllm.py",
        "    key = (cache.data_ptr(), cache.shape, cache.stride(), cache.dtype, cache.device)\n",
        "    key = cache.data_ptr()\n",
        (
            "tests/compat/test_vllm.py::test_a_cache_whose_strides_change_in_place_is_read_as_it_now_lies",
            "tests/compat/test_vllm.py::test_a_cache_whose_dtype_changes_in_place_is_read_in_its_new_dtype",
        ),
    ),
    Mutation(
        "module: the gate admits device rows before the table covers the module's context",
        "ropekit/module.py",
        "            if type(rows) is not torch.Tensor or rows.is_cpu or table.shape[0] >= cache._covered:\n",
        "            if True:\n",
        (
            "tests/test_module.py::test_device_rows_reach_the_modules_gate_only_once_the_table_covers_its_context",
        ),
    ),
    Mutation(
        "vLLM plugin: the cache cast to the query's dtype",
        "ropekit/integrations/vllm.py",
        "    return cache if cache.device == query.device else cache.to(query.device)\n",
        "    return cache.to(query.device, query.dtype)\n",
        (
            "tests/integrations/test_vllm.py::test_every_cache_and_query_dtype_pair_is_the_exact_rotation_rounded_once",
        ),
    ),
]


# The numerics contract (docs/numerics.md, issue 36): a path that rounds differently must fail the property
# test (tests/test_numerics.py), which compares any two paths bit for bit.
_NUMERICS = "tests/test_numerics.py::test_any_two_paths_rotate_the_same_tokens_to_the_same_bits"
MUTATIONS += [
    Mutation(
        "numerics: an FMA in the C loop (a * c - b * s rounded once)",
        "ropekit/backends/c/rotary.py",
        "                orow[i] = STORE(a * c[i] - b * s[i]); \\\n",
        "                orow[i] = STORE(__builtin_fmaf(a, c[i], -(b * s[i]))); \\\n",
        (f"{_NUMERICS}[cpu]",),
    ),
    Mutation(
        "numerics: a product in the input's dtype (bfloat16) in the torch backend",
        "ropekit/backends/eager/rotary.py",
        "    ra = a32 * c - b32 * s\n",
        "    ra = (a * c.to(a.dtype)).to(compute) - b32 * s\n",
        (f"{_NUMERICS}[torch]", f"{_NUMERICS}[cpu]"),
    ),
    Mutation(
        "numerics: compat.vllm (the engine plugins' path) casts the [cos | sin] cache to the query's dtype",
        "ropekit/compat/vllm.py",
        "    cos, sin = _halves(c)\n",
        "    cos, sin = (t.to(query.dtype) for t in _halves(c))\n",
        (f"{_NUMERICS}[torch]", f"{_NUMERICS}[cpu]"),
    ),
]


def occurrences(m: Mutation, root: Path = ROOT) -> list[int]:
    """How many times each old text of m occurs in its file under root/src (each must be 1)."""
    return [(root / "src" / path).read_text().count(old) for path, old, _ in m.edits()]


def _copy_tree(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", "*.egg-info")
    for name in ("src", "tests"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")


_PROBE = """
import sys, torch
import ropekit
assert ropekit.__file__.startswith(sys.argv[1]), f"ropekit imported from {ropekit.__file__}, not the copy"
from ropekit.backends import BACKENDS
from ropekit.backends.c import fused as fused_cpu
from ropekit.backends.c.qk_norm import NormSpec, unavailable_reason
spec = NormSpec(1, 1, 2, 1e-6, 0.0, False, True, False)
reasons = [BACKENDS["cpu"].unavailable_reason(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1)),
           fused_cpu.unavailable_reason(), unavailable_reason(spec)]
assert reasons == [None, None, None], f"a C kernel does not build in the mutated tree: {reasons}"
"""


_BUILD_MODULE = "ropekit/backends/c/build.py"


@functools.cache
def _shared_cache() -> Path:
    """This process's kernel cache for mutants (mode 0700, as build.private_dir requires), made on first use
    and removed at exit."""
    path = Path(tempfile.mkdtemp(prefix="ropekit-mutant-cache-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _kernel_cache(m: Mutation, dest: Path) -> Path:
    """The mutant's C library cache. A library is cached under a hash of its source (build.cache_key), so a
    mutant whose C differs builds its own, and every other mutant run by this process loads the libraries
    the first one built: one set of C builds a process (about 13 s of CPU) instead of one a mutation. A
    mutation of the build module itself, which could change that key, gets an empty cache in its copy."""
    if any(path == _BUILD_MODULE for path, _, _ in m.edits()):
        cache = dest / "kernel-cache"
        cache.mkdir(mode=0o700)
        return cache
    return _shared_cache()


def run_one(m: Mutation, *, timeout: int = 1200) -> tuple[str, str, float]:
    """(verdict, detail, seconds): verdict "caught", "survives" or "error" (not applied, or the tests could
    not run: a mutation that breaks the build or the collection proves nothing)."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ropekit-mutant-") as tmp:
        dest = Path(tmp)
        _copy_tree(dest)
        for path, old, new in m.edits():
            target = dest / "src" / path
            text = target.read_text()
            if text.count(old) != 1:
                return "error", f"old text found {text.count(old)} times in src/{path}", 0.0
            target.write_text(text.replace(old, new))
        cache = _kernel_cache(m, dest)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(dest / "src"), os.environ.get("PYTHONPATH", "")]),
            "ROPEKIT_CACHE_DIR": str(cache),
            "PYTHONDONTWRITEBYTECODE": "1",
            **dict(m.env),
        }
        probe = subprocess.run(
            [sys.executable, "-c", _PROBE, str(dest / "src")],
            env=env,
            cwd=dest,
            capture_output=True,
            text=True,
        )
        if probe.returncode != 0:
            return "error", probe.stderr.strip().splitlines()[-1], time.monotonic() - start
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
        cmd += ["-W", "ignore::pytest.PytestUnknownMarkWarning", *m.tests]
        result = subprocess.run(cmd, env=env, cwd=dest, capture_output=True, text=True, timeout=timeout)
    seconds = time.monotonic() - start
    last = (result.stdout.strip().splitlines() or [""])[-1]
    if result.returncode == 1:
        failed = next((line for line in result.stdout.splitlines() if line.startswith("FAILED")), last)
        return "caught", failed, seconds
    if result.returncode == 0:
        return "survives", last, seconds
    if result.returncode < 0:  # the test process died (a write outside a buffer corrupted the heap)
        return "caught", f"the tests crashed (signal {-result.returncode}): {last}", seconds
    return "error", f"pytest exit {result.returncode}: {last}", seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--only", action="append", default=[], metavar="NAME", help="run this mutation only")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    unknown = set(args.only) - {m.name for m in MUTATIONS}
    if unknown:
        parser.error(f"unknown mutation(s): {sorted(unknown)}")
    if args.list:
        for m in chosen:
            print(f"{m.name}\t(src/{m.path})")
        return 0
    bad = 0
    for m in chosen:
        verdict, detail, seconds = run_one(m)
        bad += verdict != "caught"
        print(f"{verdict:9s} {seconds:6.1f}s  {m.name}\n{'':18s}{detail}", flush=True)
    print(f"{len(chosen) - bad} of {len(chosen)} caught")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
