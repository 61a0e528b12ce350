"""The kernel boundary is a wall: the registered ops and the launchers check everything the kernels rely on.

Each case calls ``torch.ops.ropekit.cpu_rotary(_)`` or the C launcher directly, as a user (or a compiled
graph) could, with something the kernel cannot serve; each must be a ValueError naming the argument, with the
inputs untouched, never a crash or a read outside a tensor. The Triton ops share these checks
(tests/backends/triton_interpreter_cases.py runs them through the interpreter).
"""

from __future__ import annotations

import pytest
import torch

from ropekit import apply_rotary, apply_rotary_qk, backends
from ropekit.backends.c import rotary as cpu
from rotary_cases import tables

COS, SIN = tables(8)  # (64, 4): 64 table rows, rotary_dim 8
Q, K = torch.randn(2, 3, 4, 12), torch.randn(2, 3, 2, 12)
POS = torch.tensor([[0, 5, 9], [1, 2, 63]])


def op(*args):
    return torch.ops.ropekit.cpu_rotary(*args)


@pytest.mark.parametrize(
    "args, match",
    [
        (
            (Q, K, COS, SIN, POS.int(), False, False),
            r"positions: expected an int64 tensor, got a torch.int32",
        ),
        ((Q, K, COS, SIN, POS.float(), False, False), r"positions: expected an int64 tensor"),
        ((Q, K, COS, SIN, POS[:, :2], False, False), r"positions: expected a tensor of shape \(2, 3\)"),
        ((Q, K, COS.double(), SIN.double(), POS, False, False), r"cos: expected a 2-D float32 tensor"),
        ((Q, K, COS, SIN[:, :3], POS, False, False), r"sin: expected cos's shape \(64, 4\)"),
        ((Q, K, COS.t(), SIN.t(), None, False, False), r"cos: expected a last axis of stride 1"),
        ((Q[..., :6], K[..., :6], COS, SIN, POS, False, False), r"cos: expected 1 <= rotary_dim // 2"),
        ((Q, K[:, :2], COS, SIN, POS, False, False), r"k: expected q's batch, seq and head_dim"),
        ((Q, K.double(), COS, SIN, POS, False, False), r"k: expected q's dtype torch.float32"),
        ((Q.double(), None, COS, SIN, POS, False, False), r"q: expected a 4-D .* of \['torch.float32'"),
        ((Q[0, 0], None, COS, SIN, POS, False, False), r"q: expected a \(batch, seq, heads, head_dim\) or"),
        ((Q, K, COS[:0], SIN[:0], POS, False, False), r"cos: expected at least one row, got an empty table"),
        ((Q, K, COS, SIN, None, False, False, -1), r"offset: expected a non-negative int64"),
    ],
)
def test_cpu_op_rejects_what_the_kernel_cannot_serve(args, match):
    q_before = args[0].clone()
    with pytest.raises(ValueError, match=match):
        op(*args)
    assert torch.equal(args[0], q_before)


@pytest.mark.c_compiler
def test_cpu_op_accepts_int32_nowhere_but_the_functional_api_converts_it():
    want = op(Q, K, COS, SIN, POS, False, False)
    got = apply_rotary_qk(Q, K, COS, SIN, positions=POS.int(), backend="cpu")
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.c_compiler
@pytest.mark.parametrize("bad", [64, 1 << 40, -1, -(1 << 62)])
@pytest.mark.parametrize("inplace", [False, True])
def test_cpu_op_row_outside_the_table_is_a_value_error_and_nothing_is_written(bad, inplace):
    positions = POS.clone()
    positions[1, 1] = bad
    q, k = Q.clone(), K.clone()
    with pytest.raises(ValueError, match=rf"positions: position {bad} \(token 4\) is outside .*table_len 64"):
        if inplace:
            torch.ops.ropekit.cpu_rotary_(q, k, COS, SIN, positions, False, False)
        else:
            op(q, k, COS, SIN, positions, False, False)
    assert torch.equal(q, Q) and torch.equal(k, K)


@pytest.mark.parametrize("offset, last", [(62, 64), (1 << 62, (1 << 62) + 2), ((1 << 63) - 2, None)])
def test_cpu_op_offset_past_the_table_is_a_value_error(offset, last):
    match = rf"position {last} is outside" if last is not None else r"position \d+ is outside"
    with pytest.raises(ValueError, match=match):
        op(Q, K, COS, SIN, None, False, False, offset)


@pytest.mark.c_compiler
def test_cpu_op_int_offset_equals_explicit_positions():
    rows = torch.arange(7, 10).expand(2, 3).contiguous()
    for interleaved in (False, True):
        by_offset = op(Q, K, COS, SIN, None, interleaved, False, 7)
        by_rows = op(Q, K, COS, SIN, rows, interleaved, False)
        for a, b in zip(by_offset, by_rows, strict=True):
            assert torch.equal(a, b)


def test_cpu_op_in_place_on_an_expanded_tensor_is_the_value_error_pytorch_users_know():
    k1 = torch.randn(1, 1, 8, 12)
    expanded = k1.expand(1, 4, 8, 12)
    with pytest.raises(
        ValueError, match=r"q(_out)?: inplace=True needs a tensor whose elements do not share memory"
    ):
        torch.ops.ropekit.cpu_rotary_(expanded, None, COS, SIN, None, False, False)
    strided = torch.randn(1, 1, 8, 24)[..., ::2].expand(1, 4, 8, 12)  # scratch-copy path: checked before
    with pytest.raises(
        ValueError, match=r"q(_out)?: inplace=True needs a tensor whose elements do not share memory"
    ):
        torch.ops.ropekit.cpu_rotary_(strided, None, COS, SIN, None, False, False)


def test_cpu_op_in_place_on_q_and_k_sharing_memory_is_a_value_error():
    x = Q.clone()
    with pytest.raises(ValueError, match=r"k: inplace=True writes q and k, which share memory"):
        torch.ops.ropekit.cpu_rotary_(x, x, COS, SIN, None, False, False)
    assert torch.equal(x, Q)


def test_cpu_launcher_checks_its_own_arguments():
    q_out = torch.empty(2, 3, 4, 10)
    with pytest.raises(ValueError, match=r"q_out: expected a torch.float32 tensor of shape \(2, 3, 4, 12\)"):
        cpu.launch(Q, None, q_out, None, COS, SIN, None, 0, False, False)
    with pytest.raises(ValueError, match=r"q: expected a last axis of stride 1"):
        cpu.launch(
            Q.transpose(2, 3).contiguous().transpose(2, 3), None, Q.clone(), None, COS, SIN, None, 0, 0, 0
        )
    with pytest.raises(ValueError, match=r"positions: expected a contiguous tensor of 6 rows"):
        cpu.launch(Q, None, Q.clone(), None, COS, SIN, POS.t().contiguous().t(), 0, False, False)


def test_cpu_launcher_rejects_tables_on_another_device():
    with pytest.raises(ValueError, match=r"cos: expected a tensor on q's device cpu, got one on meta"):
        cpu.launch(Q, None, Q.clone(), None, COS.to("meta"), SIN.to("meta"), None, 0, False, False)


@pytest.mark.c_compiler
def test_compiled_call_past_the_table_is_an_error_not_garbage():
    """Under torch.compile the functional range check cannot read values: the op checks as the graph runs."""

    def step(q, k, offset):
        return apply_rotary_qk(q, k, COS, SIN, offsets=offset, backend="cpu")

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(Q, K, 3), step(Q, K, 3), strict=True):
        assert torch.equal(got, want)
    for offset in (62, 100_000, 1 << 50):
        with pytest.raises(ValueError, match=r"is outside the cos/sin table \(table_len 64\)"):
            compiled(Q, K, offset)


@pytest.mark.c_compiler
def test_compiled_positions_past_the_table_are_an_error_not_garbage():
    def step(x, positions):
        return apply_rotary(x, COS, SIN, positions=positions, backend="cpu")

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(Q, POS), step(Q, POS))
    with pytest.raises(ValueError, match=r"position 64 \(token 1\) is outside the cos/sin table"):
        compiled(Q, torch.tensor([[0, 64, 1], [1, 2, 3]]))


@pytest.mark.parametrize(
    "positions", [torch.tensor([[0, 64, 1], [1, 2, 3]]), torch.tensor([[0, -1, 1], [1, 2, 3]])]
)
def test_compiled_torch_backend_never_indexes_outside_or_wraps(positions):
    """The torch backend under compile: a device-side assert, not a wrapped negative row or a wild read."""

    def step(x, positions):
        return apply_rotary(x, COS, SIN, positions=positions, backend="torch")

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(Q, POS), step(Q, POS))
    with pytest.raises(RuntimeError, match="outside the cos/sin table"):
        compiled(Q, positions)


@pytest.mark.c_compiler
@pytest.mark.parametrize("strided", ["q", "k"])
def test_cpu_in_place_keeps_the_tail_of_a_strided_tensor_next_to_a_dense_one(strided):
    """Found by the fuzzer: the tail copy was decided for q alone, so a k computed in a scratch buffer
    (strided last axis) while q was rotated in place got an uninitialised tail."""
    q = torch.randn(2, 3, 4, 12)
    k = torch.randn(2, 3, 2, 24)[..., ::2]  # (2, 3, 2, 12), last-axis stride 2
    if strided == "q":
        q, k = torch.randn(2, 3, 4, 24)[..., ::2], torch.randn(2, 3, 2, 12)
    want_q, want_k = op(q.contiguous(), k.contiguous(), COS, SIN, POS, False, False)
    torch.ops.ropekit.cpu_rotary_(q, k, COS, SIN, POS, False, False)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


def test_a_second_backend_instance_shares_the_registered_ops():
    """Registering ropekit::cpu_rotary(_) again would replace the ops a compiled graph already holds."""
    again = cpu.CpuBackend()
    assert again.op is backends.BACKENDS["cpu"].op and again.op_ is backends.BACKENDS["cpu"].op_


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("meta", ["positions", "cos", "k"])
def test_cpu_op_with_one_argument_on_meta_is_a_value_error_not_garbage(meta, inplace):
    """A meta tensor among CPU ones sends the dispatcher to the op's fake kernel (issue 17, repro 2): it must
    refuse the mix, not return uninitialised memory or leave q unrotated."""
    q, k, cos, sin, pos = Q.clone(), K.clone(), COS, SIN, POS
    if meta == "positions":
        pos = pos.to("meta")
    elif meta == "cos":
        cos, sin = cos.to("meta"), sin.to("meta")
    else:
        k = k.to("meta")
    name = "sin" if meta == "cos" else meta  # cos and sin both moved: either may be named; sin is checked
    with pytest.raises(ValueError, match=rf"(cos|{name}): expected .*on q's device cpu"):
        (torch.ops.ropekit.cpu_rotary_ if inplace else op)(q, k, cos, sin, pos, False, False, 0)
    assert torch.equal(q, Q)


def test_cpu_op_refuses_an_output_sharing_memory_with_a_table():
    """The kernel wall keeps the memory rule for the registered ops too (issue 24, repro 1 through the op)."""
    x = torch.randn(1, 4, 1, 16)
    before = x.clone()
    with pytest.raises(ValueError, match=r"q: it is written and shares memory with cos"):
        torch.ops.ropekit.cpu_rotary_(x, None, x[0, :, 0, :8], torch.zeros(4, 8), None, False, False)
    assert torch.equal(x, before)


def _in_place_op_calls():
    """(name of the written tensor, its shape, a call of a registered in-place op writing it): every op that
    writes an argument in place (issue 39, defect 2)."""
    import ropekit.compat.vllm  # registers ropekit::rotary_embedding
    import ropekit.fused  # noqa: F401  registers the serving fusions

    ops = torch.ops.ropekit
    cos16, sin16 = tables(16)  # (64, 8)
    k, v = torch.randn(2, 3, 2, 16), torch.randn(2, 3, 2, 16)
    slots = torch.tensor([0, 5, -1, 3, 9, 12])

    def caches(cache=None):
        return (torch.zeros(4, 4, 2, 16) if cache is None else cache), torch.zeros(4, 4, 2, 16)

    cache_args = ("nhd", False, None, None, "cpu")
    return {
        "cpu_rotary_": ("q", (2, 3, 4, 12), lambda x: ops.cpu_rotary_(x, None, COS, SIN, None, False, False)),
        "cpu_rotary_ k": (
            "k",
            (2, 3, 2, 12),
            lambda x: ops.cpu_rotary_(Q.clone(), x, COS, SIN, None, False, False),
        ),
        "shift_cache_": (
            "k_cache",
            (4, 4, 2, 16),
            lambda x: ops.shift_cache_(x, cos16, sin16, 5, "nhd", None, False, "cpu"),
        ),
        "qk_norm_rotary_": (
            "qkv",
            (2, 3, 128),
            lambda x: ops.qk_norm_rotary_(
                x,
                torch.ones(16),
                torch.ones(16),
                cos16,
                sin16,
                None,
                0,
                4,
                2,
                16,
                1e-6,
                0.0,
                False,
                True,
                False,
                "cpu",
            ),
        ),
        "rotary_embedding": (
            "query",
            (6, 64),
            lambda x: ops.rotary_embedding(torch.arange(6), x, None, 16, torch.cat([cos16, sin16], -1), True),
        ),
        "rotary_qk_and_cache_": (
            "q",
            (2, 3, 4, 16),
            lambda x: ops.rotary_qk_and_cache_(x, k, v, cos16, sin16, None, 2, slots, *caches(), *cache_args),
        ),
        "rotary_qk_and_cache q_out": (
            "q_out",
            (2, 3, 4, 16),
            lambda x: ops.rotary_qk_and_cache(
                torch.randn(2, 3, 4, 16), x, k, v, cos16, sin16, None, 2, slots, *caches(), *cache_args
            ),
        ),
        "rotary_qk_and_cache k_cache": (
            "k_cache",
            (4, 4, 2, 16),
            lambda x: ops.rotary_qk_and_cache(
                None, None, k, v, cos16, sin16, None, 2, slots, *caches(x), *cache_args
            ),
        ),
    }


IN_PLACE_OPS = [
    "cpu_rotary_",
    "cpu_rotary_ k",
    "shift_cache_",
    "qk_norm_rotary_",
    "rotary_embedding",
    "rotary_qk_and_cache_",
    "rotary_qk_and_cache q_out",
    "rotary_qk_and_cache k_cache",
]


@pytest.mark.parametrize("case", ["leaf", "view of a leaf", "inference tensor"])
@pytest.mark.parametrize("op_name", IN_PLACE_OPS)
def test_a_registered_in_place_op_refuses_what_pytorch_refuses_before_writing(op_name, case):
    """Issue 39, defect 2: ``x.mul_(2)`` raises for a leaf that requires grad, a view of one and an inference
    tensor outside inference mode; the registered op called directly raises InPlaceError (a ValueError and
    the RuntimeError PyTorch raises) and leaves the tensor as it was."""
    from ropekit.validation import InPlaceError

    name, shape, call = _in_place_op_calls()[op_name]
    values = torch.randn(shape)

    def make():  # (the tensor to write, the tensor that must keep its values)
        if case == "inference tensor":
            with torch.inference_mode():
                x = values.clone()
            return x, x
        leaf = values.clone().requires_grad_()
        return (leaf if case == "leaf" else leaf[:]), leaf

    with pytest.raises(RuntimeError):  # PyTorch refuses the same write (an inference tensor's: after it)
        make()[0].mul_(2)
    x, written = make()
    with pytest.raises(InPlaceError, match=rf"^{name}: "):
        call(x)
    assert torch.equal(written.detach(), values)


@pytest.mark.c_compiler  # the ops are called with backend 'cpu'
@pytest.mark.parametrize("op_name", IN_PLACE_OPS)
def test_a_registered_in_place_op_writes_a_leaf_under_no_grad_as_pytorch_does(op_name):
    """The refusal follows the caller's grad mode, as PyTorch's: under no_grad a leaf may be written."""
    _, shape, call = _in_place_op_calls()[op_name]
    leaf = torch.randn(shape).requires_grad_()
    before = leaf.detach().clone()
    with torch.no_grad():
        leaf.mul_(1)  # PyTorch allows it
        call(leaf)
    assert not torch.equal(leaf.detach(), before)


@pytest.mark.parametrize("inplace", [False, True])
def test_cpu_op_refuses_an_offset_beside_positions_as_apply_rotary_does(inplace):
    """Issue 39, defect 3: cpu_rotary(q, None, cos, sin, positions, ..., 5) dropped the offset (it equalled
    offset 0); apply_rotary refuses the combination, and so does the op, in the same words."""
    q = Q.clone()
    with pytest.raises(ValueError, match=r"^offsets: expected 0 when positions is given") as want:
        apply_rotary(q, COS, SIN, positions=POS, offsets=5)
    with pytest.raises(ValueError) as got:
        (torch.ops.ropekit.cpu_rotary_ if inplace else op)(q, None, COS, SIN, POS, False, False, 5)
    assert str(got.value) == str(want.value)
    assert torch.equal(q, Q)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
def test_cpu_op_fake_checks_k_against_q_as_the_real_op_does(inplace, packed):
    """Issue 39: the fake kernels check the same shapes as the real ops (docs/safety.md); the fake of
    cpu_rotary did not check k's batch against q, so a compiled graph traced a call the op refuses."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    # k of batch 1 against q's 2; packed (T, H, D): 2 tokens against q's 3
    q, k = (Q[0], torch.randn(2, 2, 12)) if packed else (Q, K[:1])
    call = torch.ops.ropekit.cpu_rotary_ if inplace else op
    match = r"^k: expected q's (batch, seq|tokens) and head_dim"
    with pytest.raises(ValueError, match=match):
        call(q.clone(), k, COS, SIN, None, False, False)
    with FakeTensorMode() as mode, pytest.raises(ValueError, match=match):
        fake = [mode.from_tensor(t) for t in (q, k, COS, SIN)]
        call(*fake, None, False, False)
