"""integrations/onnx.py: ropekit's rotation exports as ONNX's RotaryEmbedding and runs in onnxruntime within
one ulp of ropekit.

Needs the ``onnx`` extra (onnx, onnxruntime, onnxscript); every test skips without it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

for _name in ("onnx", "onnxscript", "onnxruntime"):
    pytest.importorskip(_name, reason=f"{_name} is not installed: pip install 'ropekit[onnx]'")

import onnxruntime as ort  # noqa: E402

import ropekit  # noqa: E402
from export_models import Attention, Decode, LlamaBlock, block_inputs, tiny_hf_llama  # noqa: E402
from ropekit.backends import BACKENDS  # noqa: E402
from ropekit.integrations import onnx as rk_onnx  # noqa: E402

HEAD_DIM = 16
SEQ = 8
pytestmark = pytest.mark.skipif(
    BACKENDS["cpu"].unavailable_reason(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1)) is not None,
    reason="the C loop is not built here: 'auto' runs the torch backend, whose ATen ops export as plain ONNX",
)
_INTS = {torch.float32: np.int32, torch.float16: np.int16}


def largest_term(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor, interleaved: bool
):
    """For each output element, the largest term of the sum it is (|a cos|, |b sin|; float64), or |x| past
    the rotary part."""
    half = cos.shape[-1]
    x = x.double()
    c, s = cos.double()[rows].unsqueeze(-2).abs(), sin.double()[rows].unsqueeze(-2).abs()  # (B, S, 1, R/2)
    if interleaved:
        a, b = x[..., 0 : 2 * half : 2].abs(), x[..., 1 : 2 * half : 2].abs()
        first, second = torch.maximum(a * c, b * s), torch.maximum(b * c, a * s)
        rotated = torch.stack((first, second), dim=-1).flatten(-2)
    else:
        a, b = x[..., :half].abs(), x[..., half : 2 * half].abs()
        rotated = torch.cat((torch.maximum(a * c, b * s), torch.maximum(b * c, a * s)), dim=-1)
    return torch.cat((rotated, x[..., 2 * half :].abs()), dim=-1).numpy()


def term_ulps(got: np.ndarray, want: torch.Tensor, terms: np.ndarray) -> float:
    """The largest |got - want| in float32 ulps of each element's largest value: the result itself or its
    largest product (``largest_term``). onnxruntime's CPU kernel fuses each multiply-add (one rounding),
    ropekit rounds each product (no FMA): where the two products cancel, the results differ by an ulp of
    the products, many ulps of their small difference."""
    error = np.abs(got.astype(np.float64) - want.double().numpy())
    largest = np.maximum(terms, np.abs(want.double().numpy())).astype(np.float32)
    return float((error / np.spacing(largest).astype(np.float64)).max(initial=0))


def ulps(got: np.ndarray, want: torch.Tensor) -> int:
    """The largest distance in units in the last place between got and want (same float dtype)."""
    bits = _INTS[want.dtype]
    a = got.astype(want.numpy().dtype).view(bits).astype(np.int64)
    b = want.numpy().view(bits).astype(np.int64)
    # sign-magnitude -> a monotone integer line (so -0.0 and 0.0 are 0 apart)
    top = np.int64(1) << (8 * np.dtype(bits).itemsize - 1)
    a, b = np.where(a < 0, top - a, a), np.where(b < 0, top - b, b)
    return int(np.abs(a - b).max(initial=0))


def run(program, inputs: dict[str, torch.Tensor]) -> list[np.ndarray]:
    session = ort.InferenceSession(
        program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    return session.run(None, {name: t.numpy() for name, t in inputs.items()})


def export_and_run(module: nn.Module, inputs: dict, rotations: int = 2) -> tuple[list[np.ndarray], tuple]:
    """Export module(*inputs.values()) with ropekit's translations, check it holds `rotations`
    RotaryEmbedding nodes and no ropekit domain, and run it in onnxruntime: (its outputs, eager's)."""
    args = tuple(inputs.values())
    with torch.no_grad():
        want = module(*args)
        program = rk_onnx.export(module, args)
    assert op_types(program).count("RotaryEmbedding") == rotations
    assert not any(node.domain.startswith("ropekit") for node in program.model_proto.graph.node)
    return run(program, {name: t for name, t in inputs.items() if t is not None}), want


def op_types(program) -> list[str]:
    return [node.op_type for node in program.model_proto.graph.node]


class Rotate(nn.Module):
    def __init__(self, config: ropekit.RopeConfig, **flags) -> None:
        super().__init__()
        cos, sin = config.cos_sin(64)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)
        self.flags = flags

    def forward(self, q, k, positions):
        extra = {} if positions is None else {"positions": positions}
        return ropekit.apply_rotary_qk(q, k, self.cos, self.sin, **extra, **self.flags)


FORMS = {
    "half": dict(),
    "interleaved": dict(interleaved=True),
    "partial": dict(rotary_dim=8),
    "partial_interleaved": dict(rotary_dim=8, interleaved=True),
    "inverse": dict(inverse=True),
    "offset": dict(offsets=5),
    "positions": dict(positions=True),
}


@pytest.mark.cover  # fast tier: a per-axis cover; the other cases: make proofs
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("form", list(FORMS))
def test_functional_rotation_exports_as_rotary_embedding_within_one_ulp(form, dtype):
    flags = dict(FORMS[form])
    config = ropekit.RopeConfig(
        head_dim=HEAD_DIM,
        rotary_dim=flags.pop("rotary_dim", None),
        interleaved=flags.get("interleaved", False),
    )
    use_positions = flags.pop("positions", False)
    interleaved = flags.get("interleaved", False)
    module = Rotate(config, **flags).eval()
    torch.manual_seed(0)
    q, k = torch.randn(2, SEQ, 4, HEAD_DIM).to(dtype), torch.randn(2, SEQ, 2, HEAD_DIM).to(dtype)
    positions = torch.randint(0, 64, (2, SEQ)) if use_positions else None
    outs, want = export_and_run(module, {"q": q, "k": k, "positions": positions})
    rows = positions if positions is not None else torch.arange(SEQ).expand(2, SEQ) + flags.get("offsets", 0)
    for x, got, w in zip((q, k), outs, want, strict=True):
        if dtype == torch.float32:  # onnxruntime fuses multiply-adds: term_ulps
            assert term_ulps(got, w, largest_term(x, module.cos, module.sin, rows, interleaved)) <= 1
        else:  # float32 math either way, one rounding to float16
            assert ulps(got, w) <= 1


SCALINGS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "ntk": {"rope_type": "ntk", "factor": 2.0},
    "ntk_alpha": {"rope_type": "ntk_alpha", "alpha": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "llama3": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    "longrope": {
        "rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 16,
    },
    "proportional": {"rope_type": "proportional", "partial_rotary_factor": 0.5},
    "dual_chunk": {"rope_type": "dual_chunk", "chunk_size": 16, "local_size": 5},
}  # fmt: skip


@pytest.mark.cover  # fast tier: a per-axis cover; the other cases: make proofs
@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_every_scaling_type_round_trips_through_rotary_embedding(scaling, interleaved):
    """The table (each scaling's frequencies and attention scaling) is exported as initializers the
    operator reads: onnxruntime's rotation equals the module's within one ulp of the largest term."""
    config = ropekit.RopeConfig(
        head_dim=HEAD_DIM, scaling=SCALINGS[scaling], max_position_embeddings=64, interleaved=interleaved
    )
    module = Attention(ropekit.RotaryEmbedding(config)).eval()
    torch.manual_seed(0)
    q, k = torch.randn(2, SEQ, 4, HEAD_DIM), torch.randn(2, SEQ, 2, HEAD_DIM)
    positions = torch.randint(0, 48, (2, SEQ))
    outs, want = export_and_run(module, {"q": q, "k": k, "positions": positions})
    rope = module.rope
    for x, got, w in zip((q, k), outs, want, strict=True):
        assert term_ulps(got, w, largest_term(x, rope.cos, rope.sin, positions, interleaved)) <= 1


@pytest.mark.parametrize("call", ["positions", "offsets"])
def test_dynamic_sequence_length_exports_once_and_runs_every_length(call):
    module = Attention(
        ropekit.RotaryEmbedding(head_dim=HEAD_DIM, max_position_embeddings=64),
        offsets=3 if call == "offsets" else None,
    ).eval()
    seq = torch.export.Dim("seq", min=2, max=32)
    shapes = {"q": {1: seq}, "k": {1: seq}, "positions": {1: seq}}
    q, k = torch.randn(2, SEQ, 4, HEAD_DIM), torch.randn(2, SEQ, 2, HEAD_DIM)
    positions = torch.randint(0, 48, (2, SEQ))
    with torch.no_grad():
        program = rk_onnx.export(module, (q, k, positions), dynamic_shapes=shapes)
    assert op_types(program).count("RotaryEmbedding") == 2
    for length in (SEQ, 20):
        q, k = torch.randn(2, length, 4, HEAD_DIM), torch.randn(2, length, 2, HEAD_DIM)
        positions = torch.randint(0, 48, (2, length))
        inputs = {"q": q, "k": k, "positions": positions}  # an input of the graph, read or not
        rows = positions if call == "positions" else torch.arange(3, 3 + length).expand(2, length)
        with torch.no_grad():
            want = module(q, k, positions)
        rope = module.rope
        for x, got, w in zip((q, k), run(program, inputs), want, strict=True):
            assert term_ulps(got, w, largest_term(x, rope.cos, rope.sin, rows, False)) <= 1


def test_packed_tokens_with_positions_export_as_one_sequence():
    """A "thd" module (T, H, D) with explicit positions: the operator sees one sequence of T tokens."""
    module = Attention(ropekit.RotaryEmbedding(head_dim=HEAD_DIM, layout="thd", max_position_embeddings=64))
    q, k = torch.randn(12, 4, HEAD_DIM), torch.randn(12, 2, HEAD_DIM)
    positions = torch.cat((torch.arange(5), torch.arange(7)))  # two packed sequences
    outs, want = export_and_run(module.eval(), {"q": q, "k": k, "positions": positions})
    rope = module.rope
    for x, got, w in zip((q, k), outs, want, strict=True):
        terms = largest_term(x[None], rope.cos, rope.sin, positions[None], False)[0]
        assert term_ulps(got, w, terms) <= 1


def test_an_opset_without_rotary_embedding_is_refused_by_name():
    module = Attention(ropekit.RotaryEmbedding(head_dim=HEAD_DIM)).eval()
    args = (torch.randn(1, 2, 1, HEAD_DIM), torch.randn(1, 2, 1, HEAD_DIM), torch.arange(2)[None])
    with pytest.raises(ValueError, match=r"^opset_version: expected an int >= 23 .*got 22"):
        rk_onnx.export(module, args, opset_version=22)
    with pytest.raises(ValueError, match=r"^dynamo: expected True"):
        rk_onnx.export(module, args, dynamo=False)


def test_without_the_translation_the_op_lowers_to_plain_onnx_ops():
    """torch.onnx.export without ropekit's table: the op's ATen decomposition (backends/decompose.py), as
    plain ONNX ops (no RotaryEmbedding, no ropekit domain), bit for bit (onnxruntime rounds each Mul and
    Sub, as ropekit does)."""
    module = Attention(ropekit.RotaryEmbedding(head_dim=HEAD_DIM, max_position_embeddings=64)).eval()
    q, k = torch.randn(2, SEQ, 4, HEAD_DIM), torch.randn(2, SEQ, 2, HEAD_DIM)
    positions = torch.randint(0, 48, (2, SEQ))
    with torch.no_grad():
        want = module(q, k, positions)
        program = torch.onnx.export(module, (q, k, positions), dynamo=True, opset_version=23)
    domains = {node.domain for node in program.model_proto.graph.node}
    assert "RotaryEmbedding" not in op_types(program) and domains <= {"", "ai.onnx"}
    for got, w in zip(run(program, {"q": q, "k": k, "positions": positions}), want, strict=True):
        assert torch.equal(torch.from_numpy(got), w)


def test_llama_block_exports_its_rope_as_rotary_embedding():
    """A Llama-style block (tests/export_models.py): q and k through RotaryEmbedding, the rest plain ONNX ops;
    onnxruntime's output is close to eager's (its other kernels round otherwise: matmul, softmax)."""
    block = LlamaBlock().eval()
    x, positions = block_inputs()
    (got,), want = export_and_run(block, {"x": x, "positions": positions})
    torch.testing.assert_close(torch.from_numpy(got), want, atol=1e-5, rtol=1e-5)


def test_patched_hf_llama_exports_its_rope_as_rotary_embedding():
    pytest.importorskip("transformers")
    model = tiny_hf_llama()
    ids = torch.randint(0, 64, (2, SEQ))
    (got,), want = export_and_run(model, {"ids": ids}, rotations=4)  # q and k, two layers
    torch.testing.assert_close(torch.from_numpy(got), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("layout", "where"),
    [("bhsd", "first"), ("sbhd", "first"), ("bshd", "last")],
    ids=["bhsd", "sbhd", "last"],
)
def test_layouts_and_nope_first_heads_export_as_rotary_embedding(layout, where):
    """The module's view of another layout, and rotary_position="last" (the rotated features end each head),
    are plain ONNX ops around the operator."""
    config = ropekit.RopeConfig(
        head_dim=HEAD_DIM, rotary_dim=8, rotary_position=where, max_position_embeddings=64
    )
    module = Attention(ropekit.RotaryEmbedding(config, layout=layout)).eval()
    shapes = {"bshd": (2, SEQ, 4, HEAD_DIM), "bhsd": (2, 4, SEQ, HEAD_DIM), "sbhd": (SEQ, 2, 4, HEAD_DIM)}
    shape = shapes[layout]
    q, k = torch.randn(shape), torch.randn(shape)
    positions = torch.randint(0, 48, (2, SEQ))
    outs, want = export_and_run(module, {"q": q, "k": k, "positions": positions})
    rope = module.rope
    for x, got, w in zip((q, k), outs, want, strict=True):
        view = {"bshd": x, "bhsd": x.transpose(1, 2), "sbhd": x.transpose(0, 1)}[layout]  # (B, S, H, D)
        back = {"bshd": w, "bhsd": w.transpose(1, 2), "sbhd": w.transpose(0, 1)}[layout]
        got = torch.from_numpy(got)
        got = {"bshd": got, "bhsd": got.transpose(1, 2), "sbhd": got.transpose(0, 1)}[layout]
        if where == "last":  # the rotated part is the last 8 features: the first 8 pass through
            assert torch.equal(got[..., :8], back[..., :8])
            view, back, got = view[..., 8:], back[..., 8:], got[..., 8:]
        terms = largest_term(view, rope.cos, rope.sin, positions, False)
        assert term_ulps(got.contiguous().numpy(), back.contiguous(), terms) <= 1


def test_an_offset_from_a_dynamic_cache_length_becomes_position_ids():
    model = Decode().eval()
    q, k = torch.randn(1, 4, 2, HEAD_DIM), torch.randn(1, 4, 2, HEAD_DIM)
    shapes = {"q": None, "k": None, "past": {1: torch.export.Dim("past", min=1, max=32)}}
    with torch.no_grad():
        program = rk_onnx.export(model, (q, k, torch.zeros(1, 5)), dynamic_shapes=shapes)
        want = model(q, k, torch.zeros(1, 9))
    assert op_types(program).count("RotaryEmbedding") == 2
    rows = torch.arange(9, 13)[None]
    for x, got, w in zip(
        (q, k), run(program, {"q": q, "k": k, "past": torch.zeros(1, 9)}), want, strict=True
    ):
        assert term_ulps(got, w, largest_term(x, model.rope.cos, model.rope.sin, rows, False)) <= 1


def test_mrope_positions_export_as_rotary_embedding_of_the_calls_own_rows():
    """M-RoPE (3, B, S) positions: the module builds each token's row in the graph, and the operator reads
    them at rows 0 .. B*S - 1."""
    scaling = {"rope_type": "default", "mrope_section": [2, 3, 3]}
    config = ropekit.RopeConfig(head_dim=HEAD_DIM, scaling=scaling, max_position_embeddings=64)
    module = Attention(ropekit.RotaryEmbedding(config)).eval()
    q, k = torch.randn(2, SEQ, 4, HEAD_DIM), torch.randn(2, SEQ, 2, HEAD_DIM)
    positions = torch.randint(0, 48, (3, 2, SEQ))
    outs, want = export_and_run(module, {"q": q, "k": k, "positions": positions})
    cos, sin = config.cos_sin(positions)  # (B, S, R/2): each token's row
    rows = torch.arange(2 * SEQ).reshape(2, SEQ)
    cos, sin = cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1])
    for x, got, w in zip((q, k), outs, want, strict=True):
        assert term_ulps(got, w, largest_term(x, cos, sin, rows, False)) <= 1


def test_a_serving_fusion_in_the_graph_is_refused_by_name():
    """apply_rotary_qk_and_cache writes its cache in place: no ONNX form, a ValueError naming the op (not
    torch.onnx's KeyError deep in its translation)."""
    cos, sin = ropekit.RopeConfig(head_dim=HEAD_DIM).cos_sin(64)

    class Cached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("k_cache", torch.zeros(4, 8, 2, HEAD_DIM))  # (pages, page_size, H, D)
            self.register_buffer("v_cache", torch.zeros(4, 8, 2, HEAD_DIM))

        def forward(self, q, k, v, slots):
            return ropekit.apply_rotary_qk_and_cache(
                q, k, v, cos, sin, k_cache=self.k_cache, v_cache=self.v_cache, slot_mapping=slots
            )

    q, k, v = torch.randn(SEQ, 4, HEAD_DIM), torch.randn(SEQ, 2, HEAD_DIM), torch.randn(SEQ, 2, HEAD_DIM)
    with pytest.raises(ValueError, match=r"^model: its exported graph holds ropekit::rotary_qk_and_cache, "):
        rk_onnx.export(Cached(), (q, k, v, torch.arange(SEQ)))
