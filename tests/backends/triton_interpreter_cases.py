"""Triton kernel cases run on CPU tensors through Triton's interpreter.

Run only by triton/test_triton_rotary.py, in a subprocess with TRITON_INTERPRET=1 (Triton reads it when the
kernel module
is imported, so it cannot be switched on inside a pytest worker that has already imported Triton). The
interpreter is slow, so the shapes are tiny and the grid touches each feature rather than every product.
"""

from __future__ import annotations

import pytest
import torch

from ropekit import RotaryEmbedding, apply_rotary, apply_rotary_qk
from ropekit.backends.triton.rotary import interpreter_enabled
from rotary_cases import (
    MODES,
    PACKED_LENGTHS,
    assert_matches_reference,
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
from rotary_reference import reference_tables

pytestmark = pytest.mark.skipif(
    not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (triton/test_triton_rotary.py)"
)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
def test_triton_matches_reference_in_every_mode(mode, interleaved, inplace):
    check_matches_reference("triton", mode, torch.float32, interleaved, inplace, partial=inplace)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_triton_half_precision_matches_reference(dtype, interleaved):
    check_matches_reference("triton", "positions", dtype, interleaved, False, partial=True)


@pytest.mark.parametrize("k_heads", [1, 2])
def test_triton_gqa_and_mqa_in_place(k_heads):
    check_matches_reference("triton", "offsets_per_seq", torch.float32, False, True, True, 4, k_heads)


@pytest.mark.parametrize("mode", ["offsets_per_seq", "cu_seqlens", "bhsd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_triton_gradient_is_the_conjugate_rotation(mode, interleaved):
    check_gradients("triton", mode, interleaved)


def test_triton_single_tensor_matches_reference():
    check_single_tensor("triton", interleaved=False)


def test_triton_custom_ops_pass_torch_library_opcheck():
    cos, sin = tables(8)
    q, k = torch.randn(1, 3, 2, 12), torch.randn(1, 3, 1, 12)
    pos = torch.tensor([[0, 5, 9]])
    torch.library.opcheck(torch.ops.ropekit.triton_rotary, (q, k, cos, sin, pos, True, False))
    args = (q.clone(), k.clone(), cos, sin, pos, False, True)
    torch.library.opcheck(torch.ops.ropekit.triton_rotary_, args)


def test_triton_runs_inside_torch_compile_fullgraph_with_gradients():
    cos, sin = tables(12)
    q = torch.randn(1, 4, 2, 12, requires_grad=True)
    k = torch.randn(1, 4, 1, 12, requires_grad=True)

    def step(q, k):
        out_q, out_k = apply_rotary_qk(q, k, cos, sin, offsets=3, backend="triton")
        return (out_q.square().sum() + out_k.sum()), out_q

    loss, out_q = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k)
    loss.backward()
    grads = q.grad.clone(), k.grad.clone()
    q.grad, k.grad = None, None
    eager_loss, eager_q = step(q, k)
    eager_loss.backward()
    torch.testing.assert_close(out_q, eager_q)
    torch.testing.assert_close(grads, (q.grad, k.grad))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("interleaved", [False, True])
def test_triton_outputs_equal_the_torch_backend_bit_for_bit(dtype, interleaved):
    """The rounding contract under the interpreter: float32 math, one round-to-nearest-even store, so the
    output equals the torch backend's bit for bit (a truncating store differs on about half the elements).
    Compiled, the same holds by construction: no FMA (enable_fp_fusion=False at launch) and cvt.rn stores,
    both checked in the PTX by tests/tools/test_triton_aot.py."""
    g = torch.Generator().manual_seed(7)
    cos, sin = tables(8)
    x = (torch.randn(1, 6, 3, 12, generator=g) * 4).to(dtype)
    pos = torch.randint(0, 64, (1, 6), generator=g)
    want = apply_rotary(x, cos, sin, positions=pos, interleaved=interleaved, backend="torch")
    got = apply_rotary(x, cos, sin, positions=pos, interleaved=interleaved, backend="triton")
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got.view(bits), want.view(bits))


def test_triton_ops_reject_what_the_kernel_cannot_serve():
    cos, sin = tables(8)
    q = torch.randn(1, 3, 2, 12)
    with pytest.raises(ValueError, match=r"positions: expected an int64 tensor, got a torch.int32"):
        torch.ops.ropekit.triton_rotary(q, None, cos, sin, torch.zeros(1, 3, dtype=torch.int32), False, False)
    with pytest.raises(ValueError, match=r"position 64 .*table_len 64"):
        torch.ops.ropekit.triton_rotary(q, None, cos, sin, torch.tensor([[0, 64, 1]]), False, False)
    with pytest.raises(ValueError, match=r"position 65 .*table_len 64"):
        torch.ops.ropekit.triton_rotary(q, None, cos, sin, None, False, False, 63)
    with pytest.raises(ValueError, match=r"cos: expected a 2-D float32 tensor"):
        torch.ops.ropekit.triton_rotary(q, None, cos.double(), sin.double(), None, False, False)


def test_triton_device_side_row_check_never_reads_past_the_table_and_fails(monkeypatch):
    """The kernel's own row check, reached with the host check off: bad rows are clamped (read row 0), the
    interpreter's kernel clears the flag, and the launcher raises when the kernel returns (compiled, the
    kernel traps: triton_kernel.flag_bad)."""
    from ropekit.backends.triton import rotary as triton_backend

    monkeypatch.setattr(triton_backend, "HOST_CHECKS", False)
    cos, sin = tables(8)
    q = torch.randn(1, 3, 2, 12)
    before = q.clone()
    with pytest.raises(RuntimeError, match="outside the cos/sin table"):
        torch.ops.ropekit.triton_rotary_(q, None, cos, sin, torch.tensor([[3, 1 << 40, -5]]), False, False)
    # The row in range was rotated; the clamped ones read row 0 (the identity), never memory past the table.
    assert not torch.allclose(q[:, 0], before[:, 0])
    assert torch.equal(q[:, 1:], before[:, 1:])


def test_triton_in_place_keeps_the_tail_of_a_strided_k_next_to_a_dense_q():
    """The tail copy is decided per tensor (a strided k runs through a scratch buffer, q in place)."""
    cos, sin = tables(8)
    q, k = torch.randn(1, 3, 2, 12), torch.randn(1, 3, 2, 24)[..., ::2]
    pos = torch.tensor([[0, 5, 9]])
    want = apply_rotary_qk(q, k, cos, sin, positions=pos, backend="torch")
    torch.ops.ropekit.triton_rotary_(q, k, cos, sin, pos, False, False)
    assert torch.equal(q, want[0]) and torch.equal(k, want[1])


@pytest.mark.parametrize("inplace", [False, True])
def test_triton_int_offset_past_the_table_fails_on_the_device_even_if_the_host_bound_is_off_by_one(
    monkeypatch, inplace
):
    """Issue 17, repro 5: the kernel's own row check guards an int offset too. With the host check's bound
    off by one (it lets offset + seq == table_len + 1 through), offset 3, seq 2 on a 4-row table must fail,
    not rotate the last token by row 0."""
    from ropekit.backends import kernel_op
    from ropekit.backends.triton import rotary as triton_backend

    def off_by_one(offset, batch, seq, table_len):
        if batch and seq and offset + seq > table_len + 1:
            raise kernel_op.row_error(offset + seq - 1, table_len)

    monkeypatch.setattr(triton_backend, "check_offset_rows", off_by_one)
    cos, sin = (t[:4] for t in tables(4))  # a 4-row table
    q = torch.randn(1, 2, 2, 4)
    op = torch.ops.ropekit.triton_rotary_ if inplace else torch.ops.ropekit.triton_rotary
    with pytest.raises(RuntimeError, match="outside the cos/sin table"):
        op(q, None, cos, sin, None, False, False, 3)
    # The rows in range still work through the same patched bound.
    op(q, None, cos, sin, None, False, False, 2)


def test_triton_launch_passes_the_kernel_config_and_the_explicit_compile_options(monkeypatch):
    """The launch uses kernel_config (the function the ahead-of-time tests enumerate) and passes
    COMPILE_OPTIONS, so FP fusion is never left to Triton's default."""
    from ropekit.backends.triton import rotary_kernel as triton_kernel

    seen = {}
    real = triton_kernel.rotary_kernel

    class Recorder:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                seen.update(kwargs)
                return real[grid](*args, **kwargs)

            return run

    monkeypatch.setattr(triton_kernel, "rotary_kernel", Recorder())
    cos, sin = tables(8)
    apply_rotary_qk(torch.randn(1, 3, 2, 20).bfloat16(), torch.randn(1, 3, 1, 20).bfloat16(), cos, sin,
                    offsets=1, backend="triton")  # fmt: skip
    constexprs, warps = triton_kernel.kernel_config(
        "bf16", 4, 12, interleaved=False, conjugate=False, rows=0, copy_tail=True, interpret=True
    )
    assert seen == {**constexprs, "num_warps": warps, **triton_kernel.COMPILE_OPTIONS}
    assert seen["enable_fp_fusion"] is False and seen["ROUND_BF16_IN_INTEGERS"] is True
    assert seen["TRAP_BAD_ROWS"] is False  # the interpreter cannot trap: its flag is read on the host


def _decode_inputs(batch=3, seq=1, q_heads=4, k_heads=2, head_dim=16, seed=5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, q_heads, head_dim, generator=g)  # (batch, seq, heads, head_dim)
    k = torch.randn(batch, seq, k_heads, head_dim, generator=g)
    return q, k


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_triton_per_sequence_offsets_are_planned_and_read_in_the_kernel(monkeypatch, inplace, interleaved):
    """Decode steps with per-sequence offsets: the first is checked, the next ones run the plan, which hands
    the offsets tensor to the kernel (no positions tensor: resolve never runs); every step matches the
    reference, with each token's row offsets[b] + t."""
    from ropekit import functional
    from ropekit.backends import clear_backend_cache

    clear_backend_cache()
    cos, sin = tables(16)
    q, k = _decode_inputs(seq=2)
    for step, offsets in enumerate(([3, 40, 7], [4, 41, 8], [5, 42, 9])):
        off = torch.tensor(offsets)
        if step:
            monkeypatch.setattr(functional, "resolve", None)  # a planned step never resolves positions
        q_in, k_in = q.clone(), k.clone()
        out_q, out_k = apply_rotary_qk(
            q_in, k_in, cos, sin, offsets=off, interleaved=interleaved, inplace=inplace, backend="triton"
        )
        want = off[:, None] + torch.arange(2)  # (batch, seq)
        assert_matches_reference(out_q, q, cos, sin, want.numpy(), interleaved=interleaved)
        assert_matches_reference(out_k, k, cos, sin, want.numpy(), interleaved=interleaved)
        assert (out_q.data_ptr() == q_in.data_ptr()) is inplace


def test_triton_planned_per_sequence_offsets_keep_the_checked_paths_errors():
    """An offset whose rows leave the table is refused on the host before the planned launch, which falls
    through to the checked path and its messages; nothing is written."""
    cos, sin = tables(16)  # 64 rows
    q, k = _decode_inputs(batch=2, seq=3)
    apply_rotary_qk(q, k, cos, sin, offsets=torch.tensor([1, 2]), inplace=True, backend="triton")  # plans
    before = q.clone()
    with pytest.raises(ValueError, match=r"offsets: expected values >= 0, got a minimum of -1"):
        apply_rotary_qk(q, k, cos, sin, offsets=torch.tensor([3, -1]), inplace=True, backend="triton")
    with pytest.raises(ValueError, match=r"position 64 is past the cos/sin table"):
        apply_rotary_qk(q, k, cos, sin, offsets=torch.tensor([3, 62]), inplace=True, backend="triton")
    assert torch.equal(q, before)


def test_triton_kernel_checks_per_sequence_offset_rows_itself(monkeypatch):
    """With the host check off, the kernel's own check: a batch row whose offset runs past the table is
    clamped to row 0 (the identity: nothing read past the table) and the launch fails; the good row
    rotates."""
    from ropekit.backends.triton import rotary as triton_backend

    monkeypatch.setattr(triton_backend, "HOST_CHECKS", False)
    cos, sin = tables(16)
    q, _ = _decode_inputs(batch=2, seq=2)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="outside the cos/sin table"):
        triton_backend.launch(q, None, out, None, cos, sin, None, torch.tensor([5, 63]), False, False)
    want = apply_rotary(q[:1], cos, sin, offsets=5, backend="torch")
    torch.testing.assert_close(out[:1], want, rtol=0, atol=0)
    torch.testing.assert_close(out[1, 1], q[1, 1], rtol=0, atol=0)  # row 64: clamped to row 0, the identity
    # and the flag is ready for the next launch
    triton_backend.launch(q, None, out, None, cos, sin, None, torch.tensor([5, 6]), False, False)


def test_triton_per_sequence_decode_step_takes_no_more_ropekit_calls_than_an_int_offset_one():
    """Issue 25: under the interpreter, a steady decode step with per-sequence offsets (the plan, the kernel
    reading the offsets) is no more Python calls inside ropekit than one with an int offset (59 against 20
    before: the per-sequence step built a positions tensor through the checked path every call)."""
    from call_count import ropekit_calls

    cos, sin = tables(16)
    q, k = _decode_inputs(batch=4, seq=1)
    offsets = torch.tensor([3, 9, 17, 30])
    counts = {}
    for form, off in (("int", 9), ("per_sequence", offsets)):

        def step(off=off):
            return apply_rotary_qk(q, k, cos, sin, offsets=off, inplace=True, backend="triton")

        step()  # the first call is checked in full and plans the next
        calls = ropekit_calls(step)
        assert "resolve" not in calls and "check_x" not in calls, calls
        counts[form] = len(calls)
    assert counts["per_sequence"] <= counts["int"], counts


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_prefill_tiles_tokens_and_heads_and_matches_reference(interleaved, dtype):
    """A prefill (PREFILL_TOKENS tokens or more) runs BLOCK_T tokens a program on a (token blocks, head
    blocks) grid; a token count that is not a multiple of BLOCK_T leaves a ragged last block."""
    from ropekit.backends.triton.rotary_kernel import PREFILL_TOKENS, grid, kernel_config

    seq = PREFILL_TOKENS + 3
    cos, sin = reference_tables(8, seq + 5)
    g = torch.Generator().manual_seed(11)
    q = torch.randn(1, seq, 3, 12, generator=g).to(dtype)
    k = torch.randn(1, seq, 1, 12, generator=g).to(dtype)
    constexprs, _ = kernel_config("bf16", 4, 4, interleaved=False, conjugate=False, rows=0, copy_tail=True,
                                  prefill=True)  # fmt: skip
    assert constexprs["BLOCK_T"] > 1
    assert grid(seq, 3, 1, constexprs)[0] == -(-seq // constexprs["BLOCK_T"])
    out_q, out_k = apply_rotary_qk(q, k, cos, sin, offsets=2, interleaved=interleaved, backend="triton")
    want = (torch.arange(seq) + 2)[None, :].numpy()
    assert_matches_reference(out_q, q, cos, sin, want, interleaved=interleaved)
    assert_matches_reference(out_k, k, cos, sin, want, interleaved=interleaved)


def test_triton_launch_queues_no_assert_kernel(monkeypatch):
    """Issue 25: the row check is the kernel's own (a trap compiled, the flag under the interpreter); no
    torch._assert_async launch follows the kernel (it did after every launch before)."""

    def refuse(*args, **kwargs):
        raise AssertionError("torch._assert_async was called")

    monkeypatch.setattr(torch, "_assert_async", refuse)
    cos, sin = tables(8)
    q, k = _decode_inputs(batch=2, seq=3, head_dim=12)
    pos = torch.tensor([[0, 5, 9], [1, 2, 63]])
    out_q, _ = apply_rotary_qk(q, k, cos, sin, positions=pos, backend="triton")
    assert_matches_reference(out_q, q, cos, sin, pos.numpy(), interleaved=False)


@pytest.mark.parametrize("is_neox", [True, False])
def test_triton_serves_compat_vllm_in_place_through_the_per_sequence_plan(is_neox):
    """compat.vllm rotates each token as a sequence of its own, its position the sequence's offset: with the
    Triton backend the steady step now takes the per-sequence plan (no positions resolved) and matches the
    torch backend."""
    from call_count import ropekit_calls
    from ropekit.compat.vllm import rotary_embedding

    g = torch.Generator().manual_seed(3)
    tokens, heads, k_heads, head_size = 5, 4, 2, 16
    cache = torch.randn(64, head_size, generator=g)  # (max_position, rotary_dim): [cos | sin]
    for _ in range(3):
        pos = torch.randint(0, 64, (tokens,), generator=g)
        q = torch.randn(tokens, heads * head_size, generator=g)
        k = torch.randn(tokens, k_heads * head_size, generator=g)
        want_q, want_k = q.clone(), k.clone()
        rotary_embedding(pos, want_q, want_k, head_size, cache, is_neox, backend="torch")
        rotary_embedding(pos, q, k, head_size, cache, is_neox, backend="triton")
        torch.testing.assert_close((q, k), (want_q, want_k))
    calls = ropekit_calls(lambda: rotary_embedding(pos, q, k, head_size, cache, is_neox, backend="triton"))
    assert "resolve" not in calls and "run" in calls, calls


@pytest.mark.parametrize("lengths", list(PACKED_LENGTHS))
@pytest.mark.parametrize("form", ["int", "per_sequence"])
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_packed_steps_are_planned_read_cu_seqlens_in_the_kernel_and_match_the_reference(
    monkeypatch, lengths, form, cu_dtype, inplace, dtype
):
    """Issue 25: a packed (varlen) step is checked once, then planned: the kernel finds each token's
    sequence in cu_seqlens and its row t - cu_seqlens[s] + offset (or offsets[s]); see
    rotary_cases.check_planned_packed_steps."""
    check_planned_packed_steps(monkeypatch, "triton", PACKED_LENGTHS[lengths], form, cu_dtype, inplace, dtype)


@pytest.mark.parametrize("interleaved", [False, True])
def test_triton_planned_packed_step_equals_the_torch_backend_bit_for_bit(interleaved):
    """The planned packed launch rotates as the checked path's positions did, in either pair layout."""
    cos, sin = tables(8)
    q, k, cu = packed_inputs([2, 0, 3], torch.int32)
    offsets = torch.tensor([7, 1, 30])
    kw = dict(offsets=offsets, cu_seqlens=cu, interleaved=interleaved)
    apply_rotary_qk(q, k, cos, sin, **kw, backend="triton")  # plans the next
    got = apply_rotary_qk(q, k, cos, sin, **kw, backend="triton")
    want = apply_rotary_qk(q, k, cos, sin, **kw, backend="torch")
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("form", ["int", "per_sequence"])
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64], ids=str)
def test_triton_planned_packed_steps_keep_the_checked_paths_errors(form, cu_dtype):
    """The host check (CPU tensors) refuses malformed cu_seqlens and bad rows before the planned launch; the
    checked path raises exactly its message (rotary_cases.check_planned_packed_errors)."""
    check_planned_packed_errors("triton", form, cu_dtype)


@pytest.mark.parametrize(
    "values",
    [[0, 3, 2, 5], [1, 2, 3, 5], [0, 2, 3, 4], [0, 1 << 40, 2, 5]],
    ids=["decreasing", "start", "end", "huge"],
)
def test_triton_kernel_checks_cu_seqlens_itself_and_never_reads_past_its_tensors(monkeypatch, values):
    """With the host check off, the kernel's own check of cu_seqlens (no host sync, no assert kernel): a
    malformed one fails the launch (compiled: a trap; the interpreter: the flag), its search reading
    cu_seqlens[0 .. N - 1] only and its rows clamped into the table; the flag is ready for the next launch."""
    from ropekit.backends.triton import rotary as triton_backend

    monkeypatch.setattr(triton_backend, "HOST_CHECKS", False)
    cos, sin = tables(8)
    q, _, _ = packed_inputs([2, 1, 2], torch.int64)
    out = torch.empty_like(q)
    cu = torch.tensor(values)
    with pytest.raises(RuntimeError, match="cu_seqlens is malformed"):
        triton_backend.launch(q[None], None, out[None], None, cos, sin, None, 0, False, False, cu_seqlens=cu)
    good = torch.tensor([0, 2, 3, 5])
    triton_backend.launch(q[None], None, out[None], None, cos, sin, None, 0, False, False, cu_seqlens=good)
    want = apply_rotary(q, cos, sin, cu_seqlens=good, backend="torch")
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_triton_kernel_checks_packed_rows_itself(monkeypatch):
    """With the host check off, a packed sequence whose rows run past the table fails the launch; its rows
    read row 0 (the identity), the other sequence rotates."""
    from ropekit.backends.triton import rotary as triton_backend

    monkeypatch.setattr(triton_backend, "HOST_CHECKS", False)
    cos, sin = tables(8)  # 64 rows
    q, _, cu = packed_inputs([2, 2], torch.int32)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="outside the cos/sin table"):
        launch = triton_backend.launch
        launch(
            q[None], None, out[None], None, cos, sin, None, torch.tensor([4, 63]), False, False, cu_seqlens=cu
        )
    want = apply_rotary(q[:2], cos, sin, offsets=4, cu_seqlens=torch.tensor([0, 2]), backend="torch")
    torch.testing.assert_close(out[:2], want, rtol=0, atol=0)
    torch.testing.assert_close(out[3], q[3], rtol=0, atol=0)  # row 64: clamped to row 0, the identity


def test_triton_packed_decode_step_takes_no_more_ropekit_calls_than_an_int_offset_one():
    """Issue 25's target: under the interpreter, a steady packed decode step (N one-token sequences, an int
    or per-sequence offsets, cu_seqlens read in the kernel) is no more Python calls inside ropekit than the
    4-D decode step with an int offset (153 and 155 against 76 before: the packed step built a positions
    tensor through the checked path every call)."""
    from call_count import ropekit_calls

    cos, sin = tables(16)
    q, k = _decode_inputs(batch=4, seq=1)  # (batch, 1, heads, head_dim)
    q_packed, k_packed = q[:, 0].clone(), k[:, 0].clone()  # (T, heads, head_dim): 4 sequences of 1 token
    cu = torch.arange(5, dtype=torch.int32)
    steps = {
        "int": lambda: apply_rotary_qk(q, k, cos, sin, offsets=9, inplace=True, backend="triton"),
        "packed_int": lambda: apply_rotary_qk(
            q_packed, k_packed, cos, sin, offsets=9, cu_seqlens=cu, inplace=True, backend="triton"
        ),
        "packed_per_sequence": lambda: apply_rotary_qk(
            q_packed,
            k_packed,
            cos,
            sin,
            offsets=torch.tensor([3, 9, 17, 30]),
            cu_seqlens=cu,
            inplace=True,
            backend="triton",
        ),
    }
    counts = {}
    for form, step in steps.items():
        step()  # the first call is checked in full and plans the next
        calls = ropekit_calls(step)
        assert "resolve" not in calls and "check_x" not in calls, calls
        counts[form] = len(calls)
    assert counts["packed_int"] <= counts["int"] and counts["packed_per_sequence"] <= counts["int"], counts


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("form", ["batched", "packed"])
def test_triton_positions_steps_are_planned_and_read_in_the_kernel(monkeypatch, form, inplace):
    """Issue 25: explicit positions, (B, S) or packed (T,) with cu_seqlens, are checked once, then planned:
    the kernel reads the positions tensor (ROWS_POSITIONS); every step equals the reference and the torch
    backend bit for bit (rotary_cases.check_planned_positions_steps)."""
    check_planned_positions_steps(monkeypatch, "triton", form, inplace, torch.float32)


@pytest.mark.parametrize("form", ["batched", "packed"])
def test_triton_planned_positions_keep_the_checked_paths_errors(form):
    """A position past the table or negative, or malformed cu_seqlens, after the key was planned: refused
    before the launch, then the checked path's exact message; nothing written."""
    check_planned_positions_errors("triton", form)


def test_triton_positions_decode_step_takes_no_more_ropekit_calls_than_an_int_offset_one():
    """Issue 25 ("a plan for every offset form"): under the interpreter, a steady decode step with explicit
    positions (B, 1) is no more Python calls inside ropekit than one with an int offset (it went through
    the checked path every call: resolve, the host checks, the backend's launch)."""
    from call_count import ropekit_calls

    cos, sin = tables(16)
    q, k = _decode_inputs(batch=4, seq=1)
    positions = torch.tensor([[3], [9], [17], [30]])  # (batch, 1)
    counts = {}
    for form, kw in (("int", dict(offsets=9)), ("positions", dict(positions=positions))):

        def step(kw=kw):
            return apply_rotary_qk(q, k, cos, sin, **kw, inplace=True, backend="triton")

        step()  # the first call is checked in full and plans the next
        calls = ropekit_calls(step)
        assert "resolve" not in calls and "check_x" not in calls, calls
        counts[form] = len(calls)
    assert counts["positions"] <= counts["int"], counts


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "thd"])
def test_triton_module_positions_are_planned_grow_the_table_and_keep_the_checked_paths_errors(layout):
    """RotaryEmbedding(backend="triton") with explicit positions: the second call is the module's positions
    plan and equals the checked path, out of place and in place; a position past the table misses the plan
    (the launcher's host check) and the checked path grows the table as a fresh module's does; a negative
    position raises the checked path's message, planned or not, and writes nothing."""
    from call_count import ropekit_calls

    g = torch.Generator().manual_seed(8)
    if layout == "thd":
        q, k = torch.randn(6, 4, 16, generator=g), torch.randn(6, 2, 16, generator=g)
        positions, kw = torch.tensor([3, 1, 4, 1, 5, 9]), {"cu_seqlens": torch.tensor([0, 2, 6])}
    else:
        q, k = torch.randn(2, 3, 4, 16, generator=g), torch.randn(2, 3, 2, 16, generator=g)
        if layout == "bhsd":
            q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
        positions, kw = torch.tensor([[1, 5, 9], [0, 2, 40]]), {}
    for inplace in (False, True):
        rope = RotaryEmbedding(head_dim=16, backend="triton", layout=layout)

        def call(rows, rope=rope, inplace=inplace):
            qq, kk = (q.clone(), k.clone()) if inplace else (q, k)
            return rope(qq, kk, positions=rows, inplace=inplace, **kw)

        want = call(positions)  # checked in full; plans the next call
        calls = ropekit_calls(lambda call=call: call(positions))
        assert "run" in calls and "resolve" not in calls, calls
        got = call(positions)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        far = positions.clone()
        far.view(-1)[1] = 5000
        got = call(far)
        fresh = RotaryEmbedding(head_dim=16, backend="triton", layout=layout)
        expected = fresh(q.clone(), k.clone(), positions=far, **kw)
        assert rope.cos.shape[0] == fresh.cos.shape[0] > 5000
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        negative = positions.clone()
        negative.view(-1)[2] = -3
        for _ in range(2):  # the grown table's key: checked, then planned
            qq, kk = q.clone(), k.clone()
            with pytest.raises(ValueError, match=r"^positions: expected values >= 0, got a minimum of -3$"):
                rope(qq, kk, positions=negative, inplace=inplace, **kw)
            assert torch.equal(qq, q) and torch.equal(kk, k)
            call(far)
