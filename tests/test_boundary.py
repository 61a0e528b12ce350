"""The functional boundary on every backend: in-place writes bump the version counter like a PyTorch in-place
op through every entry point (core, module, compat), so a graph that saved the old value fails in backward
instead of returning a wrong gradient (issue 17); inverse=True and rotary_position="last" (issue 18)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from boundary_checks import (
    COMPAT_ENTRIES,
    CORE_ENTRIES,
    assert_autograd_sees_the_write,
    check_inverse_undoes_forward,
    check_rotary_last,
)
from c_compiler import CPU
from ropekit import apply_rotary, apply_rotary_qk
from ropekit.backends import BACKENDS
from triton_interpreter import TIERS, run_interpreter_cases

HERE = Path(__file__).parent


@pytest.mark.parametrize("backend", ["torch", CPU])
@pytest.mark.parametrize("entry", sorted(CORE_ENTRIES))
def test_in_place_write_bumps_the_version_counter_on_every_backend(entry, backend):
    assert_autograd_sees_the_write(*CORE_ENTRIES[entry], backend)


@pytest.mark.parametrize("entry", sorted(COMPAT_ENTRIES))
def test_compat_in_place_write_bumps_the_version_counter(entry):
    assert_autograd_sees_the_write(*COMPAT_ENTRIES[entry], "auto")


@pytest.mark.parametrize("tier", TIERS)
def test_boundary_checks_pass_on_triton(tier):
    """tests/backends/triton_boundary_cases.py, run with TRITON_INTERPRET=1 in a fresh interpreter."""
    run_interpreter_cases(HERE / "backends" / "triton_boundary_cases.py", cwd=HERE, timeout=300, tier=tier)


@pytest.mark.c_compiler
def test_kernel_write_bumps_the_version_exactly_once_like_a_torch_op():
    """One call, one bump, as ``x.mul_(1)``: the direct (no-dispatcher) path counts like the op."""
    backend = BACKENDS["cpu"]
    x = torch.randn(1, 3, 2, 8)
    cos, sin = torch.ones(4, 4), torch.zeros(4, 4)
    before = x._version
    backend.rotate_qk(x, None, cos, sin, None, interleaved=False, conjugate=False, inplace=True)
    assert x._version == before + 1
    before = x._version
    backend.op_(x, None, cos, sin, None, False, False, 0)  # through the dispatcher
    assert x._version == before + 1


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("backend", ["torch", CPU])
def test_inverse_undoes_forward_and_is_the_conjugate_rotation(backend, inplace, interleaved):
    check_inverse_undoes_forward(backend, inplace, interleaved)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("backend", ["torch", CPU])
def test_rotary_last_rotates_the_end_of_each_head(backend, inplace, interleaved):
    check_rotary_last(backend, inplace, interleaved)


@pytest.mark.parametrize("value", ["middle", "LAST", 1, None])
def test_rotary_position_other_than_first_or_last_is_a_value_error(value):
    x, (cos, sin) = torch.randn(1, 2, 1, 8), (torch.ones(4, 2), torch.zeros(4, 2))
    with pytest.raises(ValueError, match=r"rotary_position: expected 'first' .* or 'last'"):
        apply_rotary(x, cos, sin, rotary_position=value)
    with pytest.raises(ValueError, match=r"rotary_position: expected"):
        apply_rotary_qk(x, x.clone(), cos, sin, rotary_position=value, inplace=True)


def test_inverse_must_be_a_bool():
    x, (cos, sin) = torch.randn(1, 2, 1, 8), (torch.ones(4, 2), torch.zeros(4, 2))
    with pytest.raises(ValueError, match=r"inverse: expected"):
        apply_rotary(x, cos, sin, inverse="yes")


@pytest.mark.c_compiler
@pytest.mark.parametrize("written", ["query", "key"])
def test_compat_vllm_planned_step_still_refuses_a_cache_inside_query_or_key(written):
    """The memory rule on compat.vllm's own launch plan (_plan): a steady in-place step whose query or key
    lies in the cos/sin cache it reads (the same layouts as the planned key) reaches the checked path's
    error, with nothing written. (Here, not in tests/compat/test_vllm.py, while another branch edits that.)"""
    import ropekit.backends.plan as plan
    from call_count import ropekit_calls
    from ropekit.compat.vllm import rotary_embedding

    g = torch.Generator().manual_seed(5)
    cache = torch.randn(64, 64, generator=g)  # (max_position, rotary_dim): [cos | sin]
    positions = torch.tensor([1, 7, 3, 0, 9])
    plan.clear_plans()
    step = lambda q, k, c: rotary_embedding(positions, q, k, 64, c, True)  # noqa: E731
    query, key = torch.randn(5, 4 * 64, generator=g), torch.randn(5, 2 * 64, generator=g)
    step(query.clone(), key.clone(), cache)
    assert "run" in ropekit_calls(lambda: step(query.clone(), key.clone(), cache))  # the plan served it
    memory = torch.randn(64 * 64, generator=g)  # the cache, and query or key as a view of its first rows
    inside = memory.view(64, 64)
    if written == "query":
        query = memory[: 5 * 256].view(5, 256)
    else:
        key = memory[: 5 * 128].view(5, 128)
    before = memory.clone(), query.clone(), key.clone()
    with pytest.raises(ValueError, match="shares memory"):
        step(query, key, inside)
    assert all(torch.equal(a, b) for a, b in zip((memory, query, key), before, strict=True))


@pytest.mark.c_compiler
def test_compat_vllm_planned_step_bumps_the_version_exactly_once():
    """compat.vllm's steady step runs its own launch plan (pointers, one C call): the bump after it is the
    only one, as a PyTorch in-place op makes one; a step without it would let autograd miss the write."""
    import ropekit.backends.plan as plan
    from call_count import ropekit_calls
    from ropekit.compat.vllm import rotary_embedding

    g = torch.Generator().manual_seed(6)
    cache = torch.randn(64, 64, generator=g)
    positions = torch.tensor([1, 7, 3])
    query, key = torch.randn(3, 2 * 64, generator=g), torch.randn(3, 64, generator=g)
    plan.clear_plans()
    rotary_embedding(positions, query, key, 64, cache, True)  # plans the kind
    versions = query._version, key._version
    assert "run" in ropekit_calls(lambda: rotary_embedding(positions, query, key, 64, cache, True))
    assert (query._version, key._version) == (versions[0] + 1, versions[1] + 1)
