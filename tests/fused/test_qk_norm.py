"""ropekit.qk_norm_rotary_: QK-RMSNorm + RoPE on packed qkv, in place, on the torch path and the C loop (the
Triton kernel runs the same cases under the interpreter: qk_norm_triton_cases.py), against the float64
composition, transformers' Qwen3 / Gemma 3 / OLMo 2 attention pieces, and the unfused torch composition's
gradients."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from qk_norm_cases import (
    FORMS,
    HEAD_DIM,
    K_HEADS,
    LAYOUTS,
    Q_HEADS,
    check_bad_row_writes_nothing,
    check_gradients_match_unfused,
    check_matches_reference,
    make_case,
    tolerance,
)

import ropekit
from c_compiler import CPU
from ropekit.backends.c.qk_norm import NormSpec
from ropekit.backends.eager.qk_norm import rms_norm
from ropekit.fused.qk_norm import qk_norm_rotary_
from triton_interpreter import run_interpreter_cases, tiers

BACKENDS = ["torch", CPU]
HERE = Path(__file__).parent


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", list(FORMS))
def test_each_form_matches_the_float64_composition(backend, dtype, form):
    check_matches_reference(backend, dtype, form, "offsets_per_seq")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [HEAD_DIM, 8])
def test_every_position_form_pair_layout_and_partial_rotary(backend, layout, interleaved, rotary_dim):
    check_matches_reference(
        backend, torch.float32, "qwen3", layout, interleaved=interleaved, rotary_dim=rotary_dim
    )


@pytest.mark.c_compiler
@pytest.mark.parametrize("head_dim", [64, 128, 256, 20])
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("interleaved", [False, True])
def test_the_c_loops_copies_for_common_head_sizes_and_the_general_one(head_dim, form, interleaved):
    """head_dim 64, 128, 256 run the C loop's constant-size copies; 20 and partial rotary the general one."""
    for dtype in (torch.float32, torch.bfloat16):
        check_matches_reference("cpu", dtype, form, "positions", interleaved=interleaved, head_dim=head_dim)
    check_matches_reference("cpu", torch.float32, form, "offset", interleaved=interleaved, head_dim=head_dim,
                            rotary_dim=head_dim // 2 + head_dim // 2 % 2)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_strided_qkv_view_is_written_in_place_and_nothing_around_it(backend):
    """qkv a view into a wider buffer (rows of W + 7 features, as a slice of a fused projection): the same
    values as a contiguous copy, and the features around it untouched."""
    qkv, q_weight, k_weight, cos, sin, kw, _ = make_case(torch.float32, "gemma3", "offsets_per_seq")
    buffer = torch.randn(*qkv.shape[:-1], qkv.shape[-1] + 7)
    view = buffer[..., 3 : 3 + qkv.shape[-1]]
    view.copy_(qkv)
    outside = [buffer[..., :3].clone(), buffer[..., 3 + qkv.shape[-1] :].clone()]
    qk_norm_rotary_(qkv, q_weight, k_weight, cos, sin, backend=backend, **kw)
    qk_norm_rotary_(view, q_weight, k_weight, cos, sin, backend=backend, **kw)
    assert torch.equal(view, qkv)
    assert torch.equal(buffer[..., :3], outside[0]) and torch.equal(
        buffer[..., 3 + qkv.shape[-1] :], outside[1]
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_tokens_is_a_no_op(backend):
    qkv, q_weight, k_weight, cos, sin, kw, _ = make_case(torch.float32, "qwen3", "offset")
    empty = qkv[:, :0]
    assert qk_norm_rotary_(empty, q_weight, k_weight, cos, sin, backend=backend, **kw) is empty


def test_float64_runs_on_the_torch_path_and_matches_to_float64_rounding():
    check_matches_reference("auto", torch.float64, "gemma3", "cu_seqlens")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", list(FORMS))
def test_gradients_equal_the_unfused_compositions(backend, dtype, form):
    check_gradients_match_unfused(backend, dtype, form)


@pytest.mark.c_compiler
@pytest.mark.parametrize("layout", ["positions", "cu_seqlens"])
@pytest.mark.parametrize("form", list(FORMS))
def test_gradients_of_packed_token_rows_through_the_c_loop(layout, form):
    check_gradients_match_unfused("cpu", torch.float32, form, layout)


@pytest.mark.parametrize("form", list(FORMS))
def test_gradcheck_in_float64(form):
    qkv, q_weight, k_weight, cos, sin, kw, _ = make_case(torch.float64, form, "cu_seqlens", rotary_dim=8)
    q_weight.requires_grad_(True)
    k_weight.requires_grad_(True)
    qkv.requires_grad_(True)

    def fn(x, wq, wk):
        return qk_norm_rotary_(x.clone(), wq, wk, cos.double(), sin.double(), interleaved=True, **kw)

    assert torch.autograd.gradcheck(fn, (qkv, q_weight, k_weight))


def test_a_second_derivative_is_refused_rather_than_wrong():
    qkv, q_weight, k_weight, cos, sin, kw, _ = make_case(torch.float64, "qwen3", "offset")
    x = qkv.clone().requires_grad_(True)
    out = qk_norm_rotary_(x.clone(), q_weight, k_weight, cos.double(), sin.double(), **kw)
    (grad,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad.sum().backward()


@pytest.mark.c_compiler
def test_weights_get_gradients_when_qkv_does_not_require_grad():
    qkv, q_weight, k_weight, cos, sin, kw, _ = make_case(torch.float32, "qwen3", "offset")
    q_weight.requires_grad_(True)
    out = qk_norm_rotary_(qkv, q_weight, k_weight, cos, sin, backend="cpu", **kw)
    out.sum().backward()
    assert q_weight.grad is not None and q_weight.grad.abs().sum() > 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("grad_mode", [False, True])
def test_in_place_bumps_the_version_counter_so_autograd_sees_the_write(backend, grad_mode):
    qkv, q_weight, k_weight, cos, sin, kw, _ = make_case(torch.float32, "qwen3", "offset")
    x = qkv.clone().requires_grad_(True)
    y = x * 1.0
    s = y.sin()  # saves y: writing into y afterwards must make its backward refuse
    version = y._version
    with torch.set_grad_enabled(grad_mode):
        qk_norm_rotary_(y, q_weight, k_weight, cos, sin, backend=backend, **kw)
    assert y._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        s.sum().backward()


# ---- transformers' attention pieces, built from configs (no downloads) -------------------------------------


def _hf_pieces(family: str, dtype: torch.dtype):
    """(q_norm, k_norm, rotary_embedding, apply_rotary_pos_emb, form kwargs) of a tiny attention layer."""
    if family == "qwen3":
        from transformers import Qwen3Config
        from transformers.models.qwen3 import modeling_qwen3 as m

        config = Qwen3Config(hidden_size=64, num_attention_heads=Q_HEADS, num_key_value_heads=K_HEADS,
                             head_dim=HEAD_DIM, rms_norm_eps=1e-6)  # fmt: skip
        attn = m.Qwen3Attention(config, layer_idx=0)
        rope, form = m.Qwen3RotaryEmbedding(config), {}
    elif family == "gemma3":
        from transformers import Gemma3TextConfig
        from transformers.models.gemma3 import modeling_gemma3 as m

        config = Gemma3TextConfig(hidden_size=64, num_attention_heads=Q_HEADS, num_key_value_heads=K_HEADS,
                                  head_dim=HEAD_DIM, rms_norm_eps=1e-6, num_hidden_layers=1)  # fmt: skip
        attn = m.Gemma3Attention(config, layer_idx=0)
        module, layer_type = m.Gemma3RotaryEmbedding(config), config.layer_types[0]

        def rope(x, position_ids):  # Gemma 3 keeps one table per layer type
            return module(x, position_ids, layer_type=layer_type)

        form = {"weight_offset": 1.0}
    else:
        from transformers import Olmo2Config
        from transformers.models.olmo2 import modeling_olmo2 as m

        config = Olmo2Config(hidden_size=Q_HEADS * HEAD_DIM, num_attention_heads=Q_HEADS,
                             num_key_value_heads=K_HEADS, rms_norm_eps=1e-6)  # fmt: skip
        attn = m.Olmo2Attention(config, layer_idx=0)
        rope, form = m.Olmo2RotaryEmbedding(config), {"norm": "all_heads"}
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.copy_(0.3 + torch.rand(norm.weight.shape, generator=gen))
    attn = attn.to(dtype)
    return attn, rope, m.apply_rotary_pos_emb, form, config.rms_norm_eps


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "olmo2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_transformers_q_norm_k_norm_then_apply_rotary_pos_emb(family, dtype, backend):
    attn, rope, apply_rotary_pos_emb, form, eps = _hf_pieces(family, dtype)
    batch, seq = 2, 5
    hidden = torch.randn(batch, seq, attn.q_proj.in_features, generator=torch.Generator().manual_seed(4))
    hidden = hidden.to(dtype)
    with torch.no_grad():
        q, k, v = attn.q_proj(hidden), attn.k_proj(hidden), attn.v_proj(hidden)
        positions = torch.arange(seq).expand(batch, seq)
        cos, sin = rope(hidden, positions)  # (B, S, D) in dtype
        heads = (batch, seq, -1, HEAD_DIM)
        if family == "olmo2":  # OLMo 2 normalises the whole projection, then splits heads
            q_hf, k_hf = attn.q_norm(q).view(heads), attn.k_norm(k).view(heads)
        else:
            q_hf, k_hf = attn.q_norm(q.view(heads)), attn.k_norm(k.view(heads))
        q_hf, k_hf = apply_rotary_pos_emb(q_hf, k_hf, cos, sin, unsqueeze_dim=2)
        qkv = torch.cat([q, k, v], dim=-1)
        table_cos, table_sin = cos[0, :, : HEAD_DIM // 2], sin[0, :, : HEAD_DIM // 2]  # (S, D/2) rows 0..S-1
        packing = dict(num_q_heads=Q_HEADS, num_kv_heads=K_HEADS, head_dim=HEAD_DIM, eps=eps, backend=backend)
        weights = (attn.q_norm.weight, attn.k_norm.weight)
        qk_norm_rotary_(qkv, *weights, table_cos, table_sin, **packing, **form)
    q_size, k_size = Q_HEADS * HEAD_DIM, K_HEADS * HEAD_DIM
    for got, want in ((qkv[..., :q_size], q_hf), (qkv[..., q_size : q_size + k_size], k_hf)):
        want = want.reshape(got.shape)
        torch.testing.assert_close(got.double(), want.double(), **tolerance(dtype, float(want.abs().max())))
    assert torch.equal(qkv[..., q_size + k_size :], v)


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "olmo2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_norm_rounds_where_transformers_rounds(family, dtype, backend):
    """With an identity rotation (cos 1, sin 0) the output is the norm alone: the torch path equals
    transformers' RMSNorm bit for bit in each form; the C loop (another summation order) within one ulp."""
    attn, _, _, form, eps = _hf_pieces(family, dtype)
    qkv = (
        torch.randn(3, 4, (Q_HEADS + 2 * K_HEADS) * HEAD_DIM, generator=torch.Generator().manual_seed(5)) * 2
    )
    qkv = qkv.to(dtype)
    q_size, k_size = Q_HEADS * HEAD_DIM, K_HEADS * HEAD_DIM
    q, k = qkv[..., :q_size], qkv[..., q_size : q_size + k_size]
    with torch.no_grad():
        if family == "olmo2":
            want = torch.cat([attn.q_norm(q), attn.k_norm(k)], dim=-1)
        else:
            heads = (3, 4, -1, HEAD_DIM)
            want = torch.cat(
                [attn.q_norm(q.view(heads)).flatten(-2), attn.k_norm(k.view(heads)).flatten(-2)], -1
            )
    ones, zeros = torch.ones(8, HEAD_DIM // 2), torch.zeros(8, HEAD_DIM // 2)
    qk_norm_rotary_(qkv, attn.q_norm.weight, attn.k_norm.weight, ones, zeros, num_q_heads=Q_HEADS,
                    num_kv_heads=K_HEADS, head_dim=HEAD_DIM, eps=eps, backend=backend, **form)  # fmt: skip
    got = qkv[..., : q_size + k_size]
    if backend == "torch":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=torch.finfo(dtype).eps, atol=0)


def test_rms_norm_defaults_follow_the_form():
    spec = NormSpec(1, 1, 4, 1e-6, 0.0, False, True, False)
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]], dtype=torch.bfloat16)
    out = rms_norm(x, torch.full((4,), 3.0), spec)
    r = float(torch.rsqrt(torch.tensor(30.0 / 4 + 1e-6)))
    want = (torch.tensor([1.0, 2.0, 3.0, 4.0]) * r).to(torch.bfloat16).float() * 3
    assert torch.equal(out.flatten(), want.to(torch.bfloat16))


# ---- bad input: one ValueError naming the argument, and nothing written ------------------------------------


def _bad_calls():
    qkv, q_weight, _, cos, _, kw, _ = make_case(torch.float32, "qwen3", "offset")
    base = dict(kw)
    yield "qkv", dict(qkv=qkv[..., :-1].clone())  # width not (Hq + 2 Hk) * D
    yield "qkv", dict(kw={**base, "num_q_heads": 3})
    yield "qkv", dict(qkv=qkv.to(torch.int32))
    yield "qkv", dict(qkv=qkv.unsqueeze(0).clone())
    yield "qkv", dict(qkv=torch.zeros(*qkv.shape[:-1], 2 * qkv.shape[-1])[..., ::2])  # last stride 2
    yield "num_q_heads", dict(kw={**base, "num_q_heads": 0})
    yield "head_dim", dict(kw={**base, "head_dim": 2.5})
    yield "q_weight", dict(q_weight=q_weight[:-1])
    yield "k_weight", dict(k_weight=torch.ones(HEAD_DIM, dtype=torch.int64))
    yield "q_weight", dict(q_weight=[1.0] * HEAD_DIM)
    yield "q_weight", dict(kw={**base, "norm": "all_heads"})  # all_heads wants (Hq * D,) weights
    yield "eps", dict(kw={**base, "eps": 0.0})
    yield "eps", dict(kw={**base, "eps": -1e-6})
    yield "norm", dict(kw={**base, "norm": "per_token"})
    yield "weight_offset", dict(kw={**base, "weight_offset": float("nan")})
    yield "cast_before_weight", dict(kw={**base, "cast_before_weight": "yes"})
    yield "interleaved", dict(kw={**base, "interleaved": 1})
    yield "cos", dict(cos=torch.ones(16, HEAD_DIM), sin=torch.zeros(16, HEAD_DIM))  # rotary_dim > head_dim
    yield "cos", dict(cos=cos.clone().requires_grad_(True))
    yield "positions", dict(kw={**base, "offsets": 14})  # rows 14..16 past a 16-row table
    yield "offsets", dict(kw={**base, "offsets": -1})
    yield "backend", dict(kw={**base, "backend": "cuda"})
    yield "positions", dict(qkv=qkv[0].clone(), kw={**base, "positions": torch.tensor([1, 2])})
    # Issue 24: a meta table was NotImplementedError ("Cannot copy out of meta tensor").
    yield "cos: expected a tensor with values", dict(cos=cos.to("meta"), sin=cos.to("meta"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("name", "change"), list(_bad_calls()))
def test_bad_input_is_one_value_error_and_nothing_is_written(backend, name, change):
    qkv, q_weight, k_weight, cos, sin, kw, _ = make_case(torch.float32, "qwen3", "offset")
    args = dict(qkv=qkv, q_weight=q_weight, k_weight=k_weight, cos=cos, sin=sin)
    change = dict(change)  # the parameters are shared between the backends
    kw = {**kw, "backend": backend, **change.pop("kw", {})}
    args.update(change)
    before = args["qkv"].clone() if isinstance(args["qkv"], torch.Tensor) else None
    with pytest.raises(ValueError, match=name):
        qk_norm_rotary_(*args.values(), **kw)
    if before is not None:
        assert torch.equal(args["qkv"], before)


def test_a_leaf_that_requires_grad_is_refused_before_anything_is_written():
    qkv, q_weight, k_weight, cos, sin, kw, _ = make_case(torch.float32, "qwen3", "offset")
    qkv.requires_grad_(True)
    with pytest.raises(ValueError, match=r"qkv: a leaf tensor"):
        qk_norm_rotary_(qkv, q_weight, k_weight, cos, sin, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_position_past_the_table_writes_nothing(backend):
    check_bad_row_writes_nothing(backend)


def test_public_name_is_exported():
    assert ropekit.qk_norm_rotary_ is qk_norm_rotary_ and "qk_norm_rotary_" in ropekit.__all__


def test_aot_specializations_name_every_kernel_argument():
    pytest.importorskip("triton")
    from ropekit.backends.triton.qk_norm_kernel import aot_specializations, qk_norm_rotary_kernel

    specs = list(aot_specializations())
    # shapes x dtypes x 5 switches (the last: decode or prefill grid), head_dim 256 in decode's grid only
    assert len(specs) == 3 * 3 * 32 - 3 * 16
    assert {s[2]["BLOCK_T"] for s in specs} == {1, 4}  # one token a program, and PREFILL_BLOCK_T
    assert all(s[2]["BLOCK_T"] == 1 for s in specs if s[2]["HALF"] == 128)
    for kernel, signature, constexprs, num_warps in specs:
        assert kernel is qk_norm_rotary_kernel and num_warps > 0
        assert list(signature) == list(kernel.arg_names)
        assert {n for n, t in signature.items() if t == "constexpr"} == set(constexprs)
        blocks = [v for n, v in constexprs.items() if n.startswith("BLOCK")]
        assert all(v > 0 and v & (v - 1) == 0 for v in blocks), constexprs  # tl.arange needs powers of two


def test_a_bfloat16_olmo2_specialization_compiles_for_sm90_without_a_gpu():
    pytest.importorskip("triton")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ropekit.backends.triton.qk_norm_kernel import COMPILE_OPTIONS, aot_specializations

    spec = next(
        s
        for s in aot_specializations()
        if s[1]["qkv_ptr"] == "*bf16:16" and s[2]["ALL_HEADS"] and s[2]["CAST_BEFORE"]
    )
    kernel, signature, constexprs, num_warps = spec
    compiled = triton.compile(
        ASTSource(kernel, {k: v.split(":")[0] for k, v in signature.items()}, constexprs),  # no hints
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, **COMPILE_OPTIONS},
    )
    assert "qk_norm_rotary_kernel" in compiled.asm["ptx"]


# The fast tier runs every second case of the per-axis cover (17 CPU-s for all of it); make proofs runs every
# case. The C loop's and torch's QK-norm tests above hold the same forms in the fast tier.
@pytest.mark.parametrize("tier", tiers(2, fast_runs=1))
def test_triton_kernel_cases_pass_under_the_interpreter(tier):
    run_interpreter_cases(HERE / "qk_norm_triton_cases.py", cwd=HERE.parent.parent, timeout=900, tier=tier)


@pytest.mark.c_compiler
def test_heads_wider_than_the_c_loop_serves_take_the_torch_path_under_auto():
    from ropekit.backends.c.qk_norm import MAX_HEAD_DIM

    head_dim = MAX_HEAD_DIM + 2
    qkv = torch.randn(2, 3 * head_dim)
    weight = torch.ones(head_dim)
    cos, sin = torch.ones(4, 4), torch.zeros(4, 4)  # rotary_dim 8, identity rotation
    kw = dict(num_q_heads=1, num_kv_heads=1, head_dim=head_dim, eps=1e-6)
    with pytest.raises(ValueError, match=r"^backend: 'cpu' cannot serve these inputs: head_dim"):
        qk_norm_rotary_(qkv.clone(), weight, weight, cos, sin, backend="cpu", **kw)
    auto, torch_path = qkv.clone(), qkv.clone()
    qk_norm_rotary_(auto, weight, weight, cos, sin, **kw)
    qk_norm_rotary_(torch_path, weight, weight, cos, sin, backend="torch", **kw)
    assert torch.equal(auto, torch_path) and not torch.equal(auto, qkv)


def _packed(heads=(2, 1), head_dim=16, tokens=3):
    """qkv (T, (Hq + 2 Hk) D), weights (D,) and a (64, D / 2) table."""
    q_heads, k_heads = heads
    qkv = torch.randn(tokens, (q_heads + 2 * k_heads) * head_dim)
    kw = dict(num_q_heads=q_heads, num_kv_heads=k_heads, head_dim=head_dim, eps=1e-6)
    return qkv, torch.randn(head_dim), torch.randn(head_dim), *ropekit.RopeConfig(head_dim).cos_sin(64), kw


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("read", ["q_weight", "k_weight", "cos"])
def test_a_weight_or_table_inside_qkv_is_a_value_error_and_nothing_is_written(backend, read):
    """Issue 24, the memory rule: qkv is rotated in place of itself; a weight or table read from its own
    memory (here its v part, which the kernel never writes: the rule is about memory, not luck) is refused."""
    qkv, wq, wk, cos, sin, kw = _packed()
    args = dict(q_weight=wq, k_weight=wk, cos=cos, sin=sin)
    args[read] = qkv[0, -16:] if read != "cos" else qkv.view(-1)[: 3 * 8].view(3, 8)
    if read == "cos":
        args["sin"] = sin[:3]
    before = qkv.clone()
    with pytest.raises(ValueError, match=rf"qkv: it is written and shares memory with {read}"):
        qk_norm_rotary_(
            qkv, args["q_weight"], args["k_weight"], args["cos"], args["sin"], **kw, backend=backend
        )
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_view_of_a_leaf_or_an_inference_qkv_is_refused_before_writing(backend):
    """Issue 24: what PyTorch refuses in place (a view of a leaf that requires grad; an inference tensor
    outside inference mode) is refused before the kernel writes, as the RuntimeError PyTorch raises."""
    qkv, wq, wk, cos, sin, kw = _packed()
    leaf = qkv.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="qkv: a view of a leaf tensor that requires grad"):
        qk_norm_rotary_(leaf[:2], wq, wk, cos, sin, **kw, backend=backend)
    assert torch.equal(leaf.detach(), qkv)
    with torch.inference_mode():
        frozen = qkv.clone()
    with pytest.raises(RuntimeError, match="qkv: an inference tensor"):
        qk_norm_rotary_(frozen, wq, wk, cos, sin, **kw, backend=backend)
    assert torch.equal(frozen, qkv)


@pytest.mark.c_compiler
def test_a_planned_step_still_refuses_a_weight_inside_qkv_and_an_inference_qkv():
    """The launch plan of qk_norm_rotary_ (ropekit.fused.planned) writes through pointers: a q_weight inside
    qkv (the same layout as the planned key's) and an inference qkv outside inference mode still reach the
    checked path's errors, with nothing written."""
    from call_count import ropekit_calls

    qkv, wq, wk, cos, sin, kw = _packed()

    def step(x, q_weight=wq):
        return qk_norm_rotary_(x, q_weight, wk, cos, sin, **kw, offsets=2, backend="cpu")

    step(qkv.clone())
    assert "run" in ropekit_calls(lambda: step(qkv.clone()))  # the plan served it
    inside = qkv.clone()
    before = inside.clone()
    with pytest.raises(ValueError, match="qkv: it is written and shares memory with q_weight"):
        step(inside, q_weight=inside[0, -16:])  # the v part of token 0: a (16,) float32 like wq
    assert torch.equal(inside, before)
    with torch.inference_mode():
        frozen = qkv.clone()
    with pytest.raises(RuntimeError, match="qkv: an inference tensor"):
        step(frozen)
    assert torch.equal(frozen, qkv)
