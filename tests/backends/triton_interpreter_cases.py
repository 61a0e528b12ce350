"""Triton kernel cases run on CPU tensors through Triton's interpreter.

Run only by test_triton.py, in a subprocess with TRITON_INTERPRET=1 (Triton reads it when the kernel module
is imported, so it cannot be switched on inside a pytest worker that has already imported Triton). The
interpreter is slow, so the shapes are tiny and the grid touches each feature rather than every product.
"""

from __future__ import annotations

import pytest
import torch
from rotary_cases import MODES, check_gradients, check_matches_reference, check_single_tensor, tables

from ropekit import apply_rotary, apply_rotary_qk
from ropekit.backends.triton import interpreter_enabled

pytestmark = pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (test_triton.py)")


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
    """The CUDA path, run on the interpreter: rows are checked in the kernel (clamped, flag cleared) and the
    flag is asserted with torch._assert_async, which on a CPU tensor fails at once."""
    from ropekit.backends import triton as triton_backend

    monkeypatch.setattr(triton_backend, "_rows_on_host", lambda positions: False)
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
    from ropekit.backends import triton as triton_backend

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
    from ropekit.backends import triton_kernel

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
        "bf16", 4, 12, interleaved=False, conjugate=False, has_pos=False, copy_tail=True, interpret=True
    )
    assert seen == {**constexprs, "num_warps": warps, **triton_kernel.COMPILE_OPTIONS}
    assert seen["enable_fp_fusion"] is False and seen["ROUND_BF16_IN_INTEGERS"] is True
