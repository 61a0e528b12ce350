"""backends/decompose.py: exported programs lower ropekit's ops to core ATen ops and equal eager bit for bit.

Each case exports with torch.export.export (static, or a dynamic sequence length through torch.export.Dim),
checks that the exported graph holds a ropekit op (so the decomposition has something to do), lowers it with
``run_decompositions()`` (no table passed: the default one) and checks that no ropekit op is left and that the
lowered program's outputs equal eager's with torch.equal.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.export import Dim, export

import ropekit
from export_models import Attention, Decode, LlamaBlock, block_inputs, tiny_hf_llama
from ropekit.backends import BACKENDS
from ropekit.backends.decompose import DECOMPOSED_OPS, rotary_decomposition

HEAD_DIM = 16
SEQ = 8
needs_cpu_kernel = pytest.mark.skipif(
    BACKENDS["cpu"].unavailable_reason(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1)) is not None,
    reason="the C loop is not built here: 'auto' exports the torch backend's ATen ops, no ropekit op",
)


def ropekit_nodes(ep) -> list[str]:
    return [str(n.target) for n in ep.graph.nodes if n.op == "call_function" and "ropekit" in str(n.target)]


def lowered(module: nn.Module, args: tuple, shapes=None):
    """Export module(*args) (with dynamic_shapes=shapes), check a ropekit op is in the graph, decompose,
    check none is left."""
    ep = export(module, args, dynamic_shapes=shapes)
    assert ropekit_nodes(ep), "nothing to lower: the export holds no ropekit op"
    ep = ep.run_decompositions()
    assert ropekit_nodes(ep) == []
    return ep


class Rotate(nn.Module):
    """apply_rotary / apply_rotary_qk with buffer tables, the flags fixed at construction."""

    def __init__(self, rotary_dim: int = HEAD_DIM, interleaved: bool = False, **flags) -> None:
        super().__init__()
        cos, sin = ropekit.RopeConfig(head_dim=HEAD_DIM, rotary_dim=rotary_dim).cos_sin(64)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)
        self.flags = dict(interleaved=interleaved, **flags)

    def forward(self, q, k=None, positions=None):
        extra = {} if positions is None else {"positions": positions}
        if k is None:
            return ropekit.apply_rotary(q.clone(), self.cos, self.sin, **extra, **self.flags)
        return ropekit.apply_rotary_qk(q.clone(), k.clone(), self.cos, self.sin, **extra, **self.flags)


def _same(got, want) -> None:
    got, want = (
        (got,) if isinstance(got, torch.Tensor) else got,
        (want,) if isinstance(want, torch.Tensor) else want,
    )
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w)


FORMS = {
    "half": dict(),
    "interleaved": dict(interleaved=True),
    "partial": dict(rotary_dim=8),
    "inverse": dict(inverse=True),
    "inplace": dict(inplace=True),
    "offset": dict(offsets=5),
    "positions": dict(positions=True),
    "bfloat16": dict(dtype=torch.bfloat16),
}
CASES = [(name, False) for name in FORMS] + [(name, True) for name in ("half", "offset", "positions")]


@pytest.mark.cover  # fast tier: a per-axis cover; the other cases: make proofs
@needs_cpu_kernel
@pytest.mark.parametrize("qk", [False, True], ids=["apply_rotary", "apply_rotary_qk"])
@pytest.mark.parametrize(
    ("form", "dynamic"), CASES, ids=[f"{name}-{'dynamic_seq' if d else 'static'}" for name, d in CASES]
)
def test_functional_api_exports_lowers_and_equals_eager_bit_for_bit(form, qk, dynamic):
    form = dict(FORMS[form])
    dtype = form.pop("dtype", torch.float32)
    use_positions = form.pop("positions", False)
    module = Rotate(**form)
    q = torch.randn(2, SEQ, 4, HEAD_DIM, dtype=dtype)
    args = (q, torch.randn(2, SEQ, 2, HEAD_DIM, dtype=dtype)) if qk else (q, None)
    if use_positions:
        args = (*args, torch.randint(0, 64, (2, SEQ)))
    if not qk and not use_positions:
        args = args[:1]
    shapes = None
    if dynamic:  # axis 1 of each tensor argument: q and k (B, S, H, D), positions (B, S)
        seq = Dim("seq", min=2, max=32)
        shapes = tuple(None if a is None else {1: seq} for a in args)
    with torch.no_grad():
        want = module(*args)
        ep = lowered(module, args, shapes)
        _same(ep.module()(*args), want)
        if dynamic:  # another length through the same program
            longer = tuple(
                torch.cat((a, a[:, :3]), dim=1) if isinstance(a, torch.Tensor) else a for a in args
            )
            _same(ep.module()(*longer), module(*longer))


@pytest.mark.cover  # fast tier: a per-axis cover; the other cases: make proofs
@needs_cpu_kernel
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic_seq"])
@pytest.mark.parametrize("call", ["offsets", "positions", "one_tensor"])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_rotary_embedding_exports_lowers_and_equals_eager_bit_for_bit(call, layout, dynamic):
    rope = ropekit.RotaryEmbedding(head_dim=HEAD_DIM, layout=layout, max_position_embeddings=64)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rope = rope

        def forward(self, q, k, positions):
            if call == "positions":
                return self.rope(q, k, positions=positions)
            if call == "one_tensor":
                return self.rope(q)
            return self.rope(q, k, offsets=3)

    shape = (2, SEQ, 4, HEAD_DIM) if layout == "bshd" else (2, 4, SEQ, HEAD_DIM)
    q, k = torch.randn(shape), torch.randn(shape)
    positions = torch.randint(0, 64, (2, SEQ))
    model = Model()
    with torch.no_grad():
        want = model(q, k, positions)
        shapes = None
        if dynamic:
            seq, axis = Dim("seq", min=2, max=32), 1 if layout == "bshd" else 2
            shapes = {"q": {axis: seq}, "k": {axis: seq}, "positions": {1: seq}}
        ep = lowered(model, (q, k, positions), shapes)
        _same(ep.module()(q, k, positions), want)


@needs_cpu_kernel
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic_seq"])
def test_llama_block_lowers_to_core_aten_and_equals_eager_bit_for_bit(dynamic):
    block = LlamaBlock().eval()
    x, positions = block_inputs()
    shapes = {"x": {1: Dim("seq", min=2, max=64)}, "positions": {1: Dim("seq", min=2, max=64)}}
    with torch.no_grad():
        ep = lowered(block, (x, positions), shapes if dynamic else None)
        assert torch.equal(ep.module()(x, positions), block(x, positions))
        if dynamic:
            x2, positions2 = block_inputs(20)
            assert torch.equal(ep.module()(x2, positions2), block(x2, positions2))


@needs_cpu_kernel
def test_lowered_program_runs_in_a_process_without_ropekit(tmp_path):
    """The saved, decomposed program loads and runs where ropekit was never imported (its ops unknown)."""
    block = LlamaBlock().eval()
    x, positions = block_inputs()
    with torch.no_grad():
        ep = export(block, (x, positions)).run_decompositions()
        torch.export.save(ep, tmp_path / "block.pt2")
        torch.save({"x": x, "positions": positions, "want": block(x, positions)}, tmp_path / "io.pt")
    script = f"""
import sys, torch
sys.modules["ropekit"] = None  # importing ropekit fails here
ep = torch.export.load({str(tmp_path / "block.pt2")!r})
io = torch.load({str(tmp_path / "io.pt")!r})
assert not hasattr(torch.ops, "ropekit") or not list(torch.ops.ropekit)
with torch.no_grad():
    assert torch.equal(ep.module()(io["x"], io["positions"]), io["want"])
print("ok")
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


@needs_cpu_kernel
def test_patched_hf_llama_lowers_to_core_aten_and_equals_eager_bit_for_bit():
    pytest.importorskip("transformers")
    wrapper = tiny_hf_llama()
    ids = torch.randint(0, 64, (2, SEQ))
    with torch.no_grad():
        ep = lowered(wrapper, (ids,))
        assert torch.equal(ep.module()(ids), wrapper(ids))


@needs_cpu_kernel
@pytest.mark.parametrize("op_name", DECOMPOSED_OPS)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("conjugate", [False, True])
@pytest.mark.parametrize("rows", ["offset", "positions", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decomposition_equals_the_cpu_kernel_bit_for_bit(op_name, interleaved, conjugate, rows, dtype):
    """The decomposition of either rotary op (the Triton op's kernel is not run here: its math is the C
    loop's) equals the C loop, for every form the op takes: partial rotary, packed (T, H, D), rows."""
    cos, sin = ropekit.RopeConfig(head_dim=HEAD_DIM, rotary_dim=12).cos_sin(40)
    shape = (SEQ * 2, 3, HEAD_DIM) if rows == "packed" else (2, SEQ, 3, HEAD_DIM)
    q, k = torch.randn(shape).to(dtype), torch.randn((*shape[:-2], 2, HEAD_DIM)).to(dtype)
    positions = torch.randint(0, 40, shape[:-2]) if rows != "offset" else None
    args = (q, k, cos, sin, positions, interleaved, conjugate, 7 if rows == "offset" else 0)
    want = torch.ops.ropekit.cpu_rotary(*args)
    got = rotary_decomposition(*args)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@needs_cpu_kernel
def test_eager_op_calls_still_run_the_kernel_not_the_decomposition():
    """The composite kernel serves export's decomposition only: an eager call of the op still reaches the
    C loop, whose wall refuses a row past the table with its ValueError (ATen's index would raise
    IndexError)."""
    cos, sin = ropekit.RopeConfig(head_dim=HEAD_DIM).cos_sin(4)
    q = torch.randn(1, SEQ, 2, HEAD_DIM)
    with pytest.raises(ValueError, match="outside the cos/sin table"):
        torch.ops.ropekit.cpu_rotary(q, None, cos, sin, None, False, False, 0)


@needs_cpu_kernel
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_compiled_graph_keeps_the_kernel_op(grad):
    """torch.compile keeps the op as one node (its kernel), the decomposition notwithstanding: the
    composite kernel answers only while torch.export traces."""
    cos, sin = ropekit.RopeConfig(head_dim=HEAD_DIM).cos_sin(64)
    seen: list[str] = []

    def backend(gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_module_simplified

        def inner(graph, _):
            seen.extend(str(n.target) for n in graph.graph.nodes if n.op == "call_function")
            return make_boxed_func(graph.forward)

        return aot_module_simplified(gm, example_inputs, fw_compiler=inner)

    torch._dynamo.reset()
    fn = torch.compile(lambda q: ropekit.apply_rotary(q, cos, sin), backend=backend, fullgraph=True)
    q = torch.randn(2, SEQ, 2, HEAD_DIM, requires_grad=grad)
    with torch.set_grad_enabled(grad):
        got = fn(q)
        assert torch.equal(got, ropekit.apply_rotary(q, cos, sin))
    if grad:
        got.sum().backward()
        assert torch.equal(q.grad, ropekit.apply_rotary(torch.ones_like(q), cos, sin, inverse=True))
    assert "ropekit.cpu_rotary.default" in seen


@needs_cpu_kernel
def test_rotary_embedding_past_its_first_rows_exports_a_dynamic_length():
    """max_position_embeddings past the 2048 rows a module builds first: the exported call computes its own
    rows (table_cache), for any length, and still equals eager bit for bit."""
    model = Attention(ropekit.RotaryEmbedding(head_dim=HEAD_DIM, max_position_embeddings=4096)).eval()
    q, k, positions = torch.randn(1, SEQ, 2, HEAD_DIM), torch.randn(1, SEQ, 2, HEAD_DIM), torch.arange(SEQ)
    seq = Dim("seq", min=2, max=4096)
    with torch.no_grad():
        ep = lowered(model, (q, k, positions[None]), ({1: seq}, {1: seq}, {1: seq}))
        q, k, positions = (
            torch.randn(1, 20, 2, HEAD_DIM),
            torch.randn(1, 20, 2, HEAD_DIM),
            torch.arange(3000, 3020),
        )
        _same(ep.module()(q, k, positions[None]), model(q, k, positions[None]))


@needs_cpu_kernel
def test_an_offset_from_a_dynamic_cache_length_lowers_bit_for_bit():
    """offsets=past.shape[1]: the op's offset is a symbolic int, which the decomposition's arange takes."""
    model = Decode().eval()
    q, k = torch.randn(1, 4, 2, HEAD_DIM), torch.randn(1, 4, 2, HEAD_DIM)
    shapes = {"q": None, "k": None, "past": {1: Dim("past", min=1, max=32)}}
    with torch.no_grad():
        ep = lowered(model, (q, k, torch.zeros(1, 5)), shapes)
        _same(ep.module()(q, k, torch.zeros(1, 9)), model(q, k, torch.zeros(1, 9)))


@needs_cpu_kernel
def test_mrope_positions_lower_bit_for_bit():
    scaling = {"rope_type": "default", "mrope_section": [2, 3, 3]}
    model = Attention(
        ropekit.RotaryEmbedding(head_dim=HEAD_DIM, scaling=scaling, max_position_embeddings=64)
    ).eval()
    q, k = torch.randn(2, SEQ, 4, HEAD_DIM), torch.randn(2, SEQ, 2, HEAD_DIM)
    positions = torch.randint(0, 48, (3, 2, SEQ))
    with torch.no_grad():
        ep = lowered(model, (q, k, positions))
        _same(ep.module()(q, k, positions), model(q, k, positions))


@pytest.mark.c_compiler
def test_inductor_compiles_the_c_op_that_has_an_export_decomposition():
    """Inductor collects composite kernels as decompositions and refused its fallback to the op ("both a
    fallback and a decomp for same op"): torch.compile's default backend keeps the C kernel, as eager."""
    cos, sin = ropekit.RopeConfig(16).cos_sin(32)
    q = torch.randn(2, 8, 3, 16)
    compiled = torch.compile(lambda x: ropekit.apply_rotary(x, cos, sin, backend="cpu"), fullgraph=True)
    assert torch.equal(compiled(q), ropekit.apply_rotary(q, cos, sin, backend="cpu"))
