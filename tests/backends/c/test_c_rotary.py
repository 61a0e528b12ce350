"""The compiled CPU backend: right against the reference in every mode; an unsafe cache is refused, logged."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from ropekit import apply_rotary, apply_rotary_qk, backends
from ropekit.backends.c import rotary as cpu
from rotary_cases import (
    MODES,
    PACKED_LENGTHS,
    check_gradients,
    check_matches_reference,
    check_planned_packed_errors,
    check_planned_packed_steps,
    check_planned_positions_errors,
    check_planned_positions_steps,
    check_single_tensor,
    packed_inputs,
    tables,
)

pytestmark = pytest.mark.c_compiler  # the fallback without one: tests/backends/c/test_c_build.py


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("partial", [False, True])
def test_cpu_matches_reference_in_every_mode(mode, interleaved, inplace, partial):
    check_matches_reference("cpu", mode, torch.float32, interleaved, inplace, partial)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
def test_cpu_half_precision_matches_reference(dtype, interleaved, inplace):
    check_matches_reference("cpu", "positions", dtype, interleaved, inplace, partial=True)


@pytest.mark.parametrize("k_heads", [1, 8])
def test_cpu_gqa_mqa_and_more_kv_heads_in_place(k_heads):
    check_matches_reference("cpu", "default", torch.float32, False, True, True, q_heads=8, k_heads=k_heads)


@pytest.mark.parametrize("mode", ["default", "cu_seqlens", "bhsd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_cpu_gradient_is_the_conjugate_rotation(mode, interleaved):
    check_gradients("cpu", mode, interleaved)


def test_cpu_single_tensor_matches_reference():
    check_single_tensor("cpu", interleaved=True)


def test_cpu_strided_last_axis_is_rotated_correctly_in_place():
    cos, sin = tables(8)
    base = torch.randn(2, 5, 3, 16)
    x = base[..., ::2]  # (2, 5, 3, 8) with a last-axis stride of 2
    pos = torch.arange(5).repeat(2, 1)  # (batch, seq)
    want = torch.ops.ropekit.cpu_rotary(x.contiguous(), None, cos, sin, pos, False, False)[0]
    torch.ops.ropekit.cpu_rotary_(x, None, cos, sin, pos, False, False)
    torch.testing.assert_close(x, want)


def test_cpu_custom_ops_pass_torch_library_opcheck():
    cos, sin = tables(8)
    q, k = torch.randn(2, 5, 4, 12), torch.randn(2, 5, 2, 12)
    pos = torch.randint(0, 64, (2, 5))
    torch.library.opcheck(torch.ops.ropekit.cpu_rotary, (q, k, cos, sin, pos, False, False))
    torch.library.opcheck(torch.ops.ropekit.cpu_rotary_, (q.clone(), k.clone(), cos, sin, pos, True, False))


def test_cpu_runs_inside_torch_compile_fullgraph():
    from ropekit import apply_rotary_qk

    cos, sin = tables(12)
    q, k = torch.randn(1, 6, 4, 12), torch.randn(1, 6, 2, 12)

    def step(q, k):
        return apply_rotary_qk(q, k, cos, sin, backend="cpu")

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(q, k), step(q, k), strict=True):
        torch.testing.assert_close(got, want)


def test_an_unsafe_cache_is_logged_and_auto_falls_back_to_torch(tmp_path, monkeypatch, caplog):
    from ropekit.backends import select_backend

    directory = tmp_path / "shared"
    directory.mkdir()
    directory.chmod(0o777)
    monkeypatch.setenv("ROPEKIT_CACHE_DIR", str(directory))
    monkeypatch.setattr(cpu, "_LIBRARY", dataclasses.replace(cpu._LIBRARY))
    monkeypatch.setattr(backends, "_choices", {})
    x, cos = torch.randn(1, 3, 2, 4), torch.randn(3, 2)
    with caplog.at_level(logging.WARNING, logger="ropekit.backends"):
        assert select_backend("auto", x, cos).name == "torch"
    assert "refusing the kernel cache" in caplog.text
    assert not list(directory.glob("*.so"))


@pytest.mark.parametrize("interleaved", [False, True])
def test_cpu_multithreaded_path_matches_reference(interleaved, monkeypatch):
    monkeypatch.setattr(cpu, "PARALLEL_THRESHOLD", 0)  # every call runs the OpenMP loop on all threads
    check_matches_reference("cpu", "offsets_per_seq", torch.float32, interleaved, False, True)
    check_matches_reference("cpu", "cu_seqlens", torch.bfloat16, interleaved, True, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
def test_cpu_outputs_equal_the_torch_backend_bit_for_bit(dtype, interleaved, inplace):
    """The rounding contract: same float32 math (no FMA contraction), then one round-to-nearest-even store.

    A truncating store differs from round-to-nearest-even on about half of the elements, so this fails for
    any store that does not round to nearest even (or for math that rounds differently)."""
    g = torch.Generator().manual_seed(7)
    cos, sin = tables(12)  # partial rotary: 12 of 16 features, the tail passes through
    x = (torch.randn(3, 16, 4, 16, generator=g) * 4).to(dtype)
    pos = torch.randint(0, 64, (3, 16), generator=g)
    want = apply_rotary(x, cos, sin, positions=pos, interleaved=interleaved, backend="torch")
    got = apply_rotary(
        x.clone(), cos, sin, positions=pos, interleaved=interleaved, inplace=inplace, backend="cpu"
    )
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got.view(bits), want.view(bits))


@pytest.mark.parametrize("lengths", list(PACKED_LENGTHS))
@pytest.mark.parametrize("form", ["int", "per_sequence"])
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_packed_steps_are_planned_and_read_cu_seqlens_in_the_loop(
    monkeypatch, lengths, form, cu_dtype, inplace, dtype
):
    """Issue 25: a packed (varlen) step on the C loop is checked once, then planned: the loop reads
    cu_seqlens and the offsets itself (each token's sequence by a binary search), so no positions tensor is
    resolved (rotary_cases.check_planned_packed_steps: the reference, and the torch backend bit for bit)."""
    check_planned_packed_steps(monkeypatch, "cpu", PACKED_LENGTHS[lengths], form, cu_dtype, inplace, dtype)


@pytest.mark.parametrize("form", ["int", "per_sequence"])
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64], ids=str)
def test_cpu_planned_packed_steps_keep_the_checked_paths_errors(form, cu_dtype):
    """The C loop refuses malformed cu_seqlens and bad rows before it writes; the checked path raises
    exactly its message (rotary_cases.check_planned_packed_errors)."""
    check_planned_packed_errors("cpu", form, cu_dtype)


def test_cpu_packed_decode_step_is_as_few_ropekit_calls_as_an_int_offset_one():
    """The packed plan makes a varlen decode step on the C loop what a 4-D decode step is: the gate, the
    plan's run and the loop (6 ropekit calls, as the int-offset step)."""
    from call_count import ropekit_calls

    cos, sin = tables(8)
    q, k, cu = packed_inputs([1] * 4, torch.int32)
    q4, k4 = q[:, None], k[:, None]  # (batch, 1, heads, head_dim)
    steps = {
        "int": lambda: apply_rotary_qk(q4, k4, cos, sin, offsets=9, inplace=True, backend="cpu"),
        "packed_per_sequence": lambda: apply_rotary_qk(
            q, k, cos, sin, offsets=torch.tensor([3, 9, 17, 30]), cu_seqlens=cu, inplace=True, backend="cpu"
        ),
    }
    counts = {}
    for form, step in steps.items():
        step()
        calls = ropekit_calls(step)
        assert "resolve" not in calls, calls
        counts[form] = len(calls)
    assert counts["packed_per_sequence"] <= counts["int"], counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("form", ["batched", "packed"])
def test_cpu_positions_steps_are_planned_and_read_by_the_loop(monkeypatch, form, inplace, dtype):
    """Issue 25: explicit positions, (B, S) or packed (T,) with cu_seqlens, on the C loop are checked once,
    then planned: the loop reads the positions tensor itself (rotary_cases.check_planned_positions_steps:
    the reference, and the torch backend bit for bit)."""
    check_planned_positions_steps(monkeypatch, "cpu", form, inplace, dtype)


@pytest.mark.parametrize("form", ["batched", "packed"])
def test_cpu_planned_positions_keep_the_checked_paths_errors(form):
    """A position past the table or negative, or malformed cu_seqlens, after the key was planned: the loop
    refuses it before writing, and the checked path raises exactly its message."""
    check_planned_positions_errors("cpu", form)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("conjugate", [False, True])
@pytest.mark.parametrize("strided", [False, True])
def test_the_loops_per_op_rounding_equals_the_torch_backends_peer_arithmetic(
    dtype, interleaved, conjugate, strided
):
    cos, sin = tables(10)  # partial rotary: rotary_dim 10 of head_dim 16
    x = (8 * torch.randn(2, 5, 3, 16)).to(dtype)
    if strided:
        x = x.transpose(1, 2).contiguous().transpose(1, 2)  # (B, S, H, D) view of (B, H, S, D)
    rows = torch.randint(0, 16, (2, 5))
    flags = dict(interleaved=interleaved, conjugate=conjugate, inplace=False, numerics="hf")
    got, _ = backends.BACKENDS["cpu"].rotate_qk(x, None, cos, sin, rows, **flags)
    want, _ = backends.BACKENDS["torch"].rotate_qk(x, None, cos, sin, rows, **flags)
    assert torch.equal(got, want)
    exact, _ = backends.BACKENDS["cpu"].rotate_qk(x, None, cos, sin, rows, **{**flags, "numerics": "exact"})
    assert torch.equal(exact, got) == (dtype == torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_the_loops_per_op_rounding_equals_pytorchs_at_the_edges_of_the_dtype(dtype, interleaved):
    """Products and sums that overflow to infinity, land among the subnormals or tie: the loop's roundings
    (bf16_round, a _Float16 round trip) against PyTorch's own ops in the dtype."""
    magnitudes = torch.linspace(1, 2, 33)[:, None] * 2.0 ** torch.arange(-30, 17)[None, :]  # (33, 47)
    extra = torch.tensor([65504, 65519, 65520, 65536, 7e4, 6.1e-5, 6.09e-5, 5.96e-8, 2.98e-8, 1e-8, 0.0])
    values = torch.cat((magnitudes.flatten(), -magnitudes.flatten(), extra, -extra))
    x = values[: values.numel() // 64 * 64].reshape(1, -1, 1, 64)  # (1, S, 1, 64)
    g = torch.Generator().manual_seed(0)
    cos = 2 * torch.rand(x.shape[1], 32, generator=g) - 1
    sin = 300 * torch.rand(x.shape[1], 32, generator=g) - 150  # products past float16's range, and tiny ones
    for scale in (1.0, 200.0, 1e-3):
        stored = (x * scale).to(dtype)
        stored = torch.where(stored.isinf(), torch.zeros_like(stored), stored)  # finite inputs
        flags = dict(numerics="hf", interleaved=interleaved)
        got = apply_rotary(stored, cos, sin, backend="cpu", **flags)
        want = apply_rotary(stored, cos, sin, backend="torch", **flags)
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
        if dtype == torch.float16 and scale == 200.0:
            assert got.isinf().any()  # the case reaches the overflow
