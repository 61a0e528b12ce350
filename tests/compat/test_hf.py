"""ropekit.compat.hf against transformers' own ``apply_rotary_pos_emb``.

Follows transformers 5.24 (installed): ``models/llama/modeling_llama.py``'s ``apply_rotary_pos_emb`` and
``LlamaRotaryEmbedding`` are the reference, run on the same inputs. transformers has no test file of its
own for the function; its users' test is Liger-Kernel's ``test/transformers/test_rope.py`` (commit 00fb8bf),
whose cases are used here: (bsz, seq, q heads, kv heads, head_dim) including GQA and an odd-sized shape,
position ids of batch 1 or expanded to the batch, float32 (atol = rtol = 1e-5) and bfloat16 (atol 1e-1),
forward outputs and q / k gradients against HF's. Sizes are scaled down for a 2-core CPU.

``ROPE_INIT_FUNCTIONS`` and ``rope_config_validation`` follow transformers'
``tests/utils/test_modeling_rope_utils.py`` (``RopeTest``, commit 087e800: the numerical snapshots of the
default, dynamic (factor 10, seq_len 16384) and yarn (factor 10, beta 32 / 1) frequencies of the default
``LlamaConfig``, to their printed 5 digits; linear = default / factor; dynamic unscaled up to
max_position_embeddings; yarn's attention factor 0.1 ln(factor) + 1 or the explicit one). Beyond that file,
every rope type transformers 5.24 registers is compared, value for value, with transformers' own function
on tiny configs (Llama; Phi-3 for longrope), and "default" with
``LlamaRotaryEmbedding.compute_default_rope_parameters``.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_apply_rotary_pos_emb

from ropekit import RopeConfig
from ropekit.compat.hf import ROPE_INIT_FUNCTIONS, apply_rotary_pos_emb, rope_config_validation
from ropekit.integrations.hf_probe import model_function

from .conftest import as_table, force_backend, llama_tables, signature_of, spy_cpu_kernel

# (bsz, seq_len, num_q_heads, num_kv_heads, head_dim): Liger's grid, scaled (32 -> 8 heads, 128 -> 24 tokens).
SHAPES = [(1, 24, 8, 8, 16), (2, 24, 8, 8, 16), (1, 24, 8, 2, 16), (2, 24, 8, 2, 16), (3, 23, 7, 5, 20)]
DTYPE_TOL = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 1e-1, 1e-5)]


@pytest.mark.parametrize("expand_position_ids", [True, False])
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPE_TOL, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("bsz", "seq_len", "q_heads", "kv_heads", "head_dim"), SHAPES)
def test_outputs_and_gradients_match_transformers(
    backend, bsz, seq_len, q_heads, kv_heads, head_dim, dtype, atol, rtol, expand_position_ids
):
    g = torch.Generator().manual_seed(0)
    # HF's layout: (bsz, heads, seq, head_dim) views of (bsz, seq, heads, head_dim) projections.
    q = torch.randn(bsz, seq_len, q_heads, head_dim, generator=g).transpose(1, 2).to(dtype)
    k = torch.randn(bsz, seq_len, kv_heads, head_dim, generator=g).transpose(1, 2).to(dtype)
    cos, sin = llama_tables(head_dim, bsz, seq_len, expand_position_ids, dtype)
    q1, k1 = q.clone().requires_grad_(), k.clone().requires_grad_()
    q2, k2 = q.clone().requires_grad_(), k.clone().requires_grad_()
    hf_q, hf_k = hf_apply_rotary_pos_emb(q1, k1, cos, sin)
    got_q, got_k = apply_rotary_pos_emb(q2, k2, cos, sin)
    assert got_q.dtype == dtype and got_q.shape == hf_q.shape and got_q.stride() == q2.stride()
    assert torch.allclose(got_q, hf_q, atol=atol, rtol=rtol)
    assert torch.allclose(got_k, hf_k, atol=atol, rtol=rtol)
    dq, dk = torch.randn(hf_q.shape, generator=g).to(dtype), torch.randn(hf_k.shape, generator=g).to(dtype)
    want = torch.autograd.grad((hf_q, hf_k), (q1, k1), (dq, dk))
    got = torch.autograd.grad((got_q, got_k), (q2, k2), (dq, dk))
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, atol=atol, rtol=rtol)
    assert torch.equal(q2, q) and torch.equal(k2, k)  # inputs untouched
    assert backend.calls > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_result_is_the_float64_rotation_by_the_tables_first_halves(backend, assert_matches_reference, dtype):
    """Closer to exact than HF's bf16 arithmetic: one rounding of float32 math, reading cos[..., :D/2]."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 9, 16, generator=g).to(dtype)  # (batch, heads, seq, head_dim)
    k = torch.randn(2, 2, 9, 16, generator=g).to(dtype)
    cos, sin = llama_tables(16, 2, 9, True, dtype)
    got_q, got_k = apply_rotary_pos_emb(q, k, cos, sin)
    rows_cos, rows_sin, pos = as_table(cos[..., :8], sin[..., :8], (2, 9))
    for got, x in ((got_q, q), (got_k, k)):
        assert_matches_reference(
            got.transpose(1, 2), x.transpose(1, 2), rows_cos, rows_sin, pos, interleaved=False
        )


@pytest.mark.parametrize("rope_parameters", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16, "rope_theta": 500000.0},
], ids=["yarn", "llama3"])  # fmt: skip
def test_scaled_tables_are_used_as_given(backend, rope_parameters):
    """YaRN's attention scaling lives in HF's cos / sin: the tables are read, never recomputed."""
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 4, 30, 16, generator=g), torch.randn(1, 2, 30, 16, generator=g)
    cos, sin = llama_tables(16, 1, 30, False, torch.float32, rope_parameters)
    want = hf_apply_rotary_pos_emb(q, k, cos, sin)
    got = apply_rotary_pos_emb(q, k, cos, sin)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("table_rank", [3, 2])
def test_unsqueeze_dim_selects_the_heads_axis_as_in_transformers(backend, table_rank):
    """unsqueeze_dim=2 (or 1 for an (S, D) table) is HF's (batch, seq, heads, head_dim) form."""
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 7, 4, 16, generator=g), torch.randn(2, 7, 2, 16, generator=g)  # (b, s, h, d)
    cos, sin = llama_tables(16, 2, 7, True, torch.float32)
    dim = 2
    if table_rank == 2:
        cos, sin, dim = cos[0], sin[0], 1  # (seq, head_dim), shared by the batch
    want = hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=dim)
    got = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=dim)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # and the bhsd form of a 2-D table: unsqueeze_dim=0
    if table_rank == 2:
        qt, kt = q.transpose(1, 2), k.transpose(1, 2)
        want = hf_apply_rotary_pos_emb(qt, kt, cos, sin, unsqueeze_dim=0)
        got = apply_rotary_pos_emb(qt, kt, cos, sin, unsqueeze_dim=0)
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)


@pytest.mark.c_compiler
def test_full_width_table_is_read_where_it_lies(monkeypatch):
    """The CPU kernel receives the caller's own table memory and q / k where they lie in HF's transposed
    layout: nothing is rebuilt or made contiguous."""
    force_backend(monkeypatch, "cpu")
    seen = spy_cpu_kernel(monkeypatch)
    q, k = torch.randn(2, 4, 9, 16), torch.randn(2, 2, 9, 16)
    cos, sin = llama_tables(16, 2, 9, True, torch.float32)
    apply_rotary_pos_emb(q, k, cos, sin)
    got = (seen["q"], seen["k"], seen["cos"], seen["sin"])
    assert got == (q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr())


def test_errors_name_the_argument_and_the_expected_shape():
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    cos, sin = llama_tables(8, 1, 5, False, torch.float32)
    with pytest.raises(ValueError, match=r"^cos: expected rows as wide as head_dim \(8\)"):
        apply_rotary_pos_emb(q, k, cos[..., :4], sin[..., :4])
    with pytest.raises(ValueError, match=r"^unsqueeze_dim: 3 makes cos"):
        apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=3)
    with pytest.raises(ValueError, match=r"^unsqueeze_dim: expected an int"):
        apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1.0)
    with pytest.raises(ValueError, match=r"^cos: expected per-token rows of shape \(batch, seq, width\)"):
        apply_rotary_pos_emb(q, k, cos[:, :3], sin[:, :3])
    with pytest.raises(ValueError, match=r"^k: expected a 4-D tensor"):
        apply_rotary_pos_emb(q, k[0], cos, sin)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("expand_position_ids", [True, False])
def test_numerics_hf_gives_transformers_own_bits_and_gradients(backend, dtype, expand_position_ids):
    g = torch.Generator().manual_seed(0)
    q = (4 * torch.randn(2, 24, 8, 16, generator=g)).transpose(1, 2).to(dtype)  # (B, H, S, D) views
    k = (4 * torch.randn(2, 24, 2, 16, generator=g)).transpose(1, 2).to(dtype)
    cos, sin = llama_tables(16, 2, 24, expand_position_ids, dtype)
    q1, k1 = q.clone().requires_grad_(), k.clone().requires_grad_()
    q2, k2 = q.clone().requires_grad_(), k.clone().requires_grad_()
    want = hf_apply_rotary_pos_emb(q1, k1, cos, sin)
    for _ in range(2):  # the checked path, then the plan (no grad: the gate's steady state)
        with torch.no_grad():
            got = apply_rotary_pos_emb(q, k, cos, sin, numerics="hf")
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    got = apply_rotary_pos_emb(q2, k2, cos, sin, numerics="hf")
    grads = [torch.randn(t.shape, generator=g).to(dtype) for t in want]
    want_grads = torch.autograd.grad(want, (q1, k1), grads)
    got_grads = torch.autograd.grad(got, (q2, k2), grads)
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads, strict=True))
    assert backend.calls > 0


def test_signature_is_transformers():
    # transformers >= 5.25 (with kernels): HF's name holds a kernels function module around the function
    hf_function = model_function(hf_apply_rotary_pos_emb)
    ropekits = [("backend", "auto"), ("numerics", "exact")]
    assert signature_of(apply_rotary_pos_emb) == [*signature_of(hf_function), *ropekits]


def test_compiles_with_fullgraph():
    """The mapping is views and one core call: torch.compile keeps it in one graph."""
    q, k = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16)
    cos, sin = llama_tables(16, 2, 5, True, torch.float32)
    compiled = torch.compile(apply_rotary_pos_emb, backend="aot_eager", fullgraph=True)
    for got, want in zip(compiled(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin), strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def tiny_config(rope_parameters, cls_name="LlamaConfig", **extra):
    import transformers

    kwargs = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    if cls_name == "LlamaConfig":
        kwargs["head_dim"] = 16
    return getattr(transformers, cls_name)(**kwargs, **extra, rope_parameters=dict(rope_parameters))


SHORT, LONG = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7], [2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5]
INIT_CASES = {
    "linear": ({"rope_type": "linear", "factor": 2.0}, "LlamaConfig", {}),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0}, "LlamaConfig", {}),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, "LlamaConfig", {}),
    "yarn_mscale": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
         "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2},
        "LlamaConfig",
        {},
    ),
    "longrope": (
        {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "factor": 4.0,
         "original_max_position_embeddings": 64},
        "Phi3Config",
        {},
    ),
    "llama3": (
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
        "LlamaConfig",
        {},
    ),
    "proportional": ({"rope_type": "proportional", "partial_rotary_factor": 0.5}, "LlamaConfig", {}),
    "partial_linear": (
        {"rope_type": "linear", "factor": 3.0, "partial_rotary_factor": 0.5}, "LlamaConfig", {}
    ),
}  # fmt: skip


@pytest.mark.parametrize("seq_len", [None, 40, 300])
@pytest.mark.parametrize("case", list(INIT_CASES))
def test_rope_init_functions_equal_transformers_own(case, seq_len):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS as HF_ROPE_INIT_FUNCTIONS

    params, cls_name, extra = INIT_CASES[case]
    rope_type = params["rope_type"]
    config = tiny_config({"rope_theta": 10000.0, **params}, cls_name, **extra)
    want_inv_freq, want_factor = HF_ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len)
    got_inv_freq, got_factor = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len)
    assert got_inv_freq.dtype == torch.float32 and got_inv_freq.shape == want_inv_freq.shape
    torch.testing.assert_close(got_inv_freq, want_inv_freq, atol=0, rtol=1e-6)
    assert got_factor == pytest.approx(want_factor, rel=1e-12)


def test_rope_init_functions_cover_every_transformers_rope_type():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS as HF_ROPE_INIT_FUNCTIONS

    assert set(HF_ROPE_INIT_FUNCTIONS) <= set(ROPE_INIT_FUNCTIONS)
    assert {params["rope_type"] for params, _, _ in INIT_CASES.values()} >= set(HF_ROPE_INIT_FUNCTIONS)


def test_default_rope_init_equals_the_models_own_and_dynamic_takes_a_tensor_seq_len():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = tiny_config({"rope_type": "default", "rope_theta": 500000.0})
    want, factor = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    got, got_factor = ROPE_INIT_FUNCTIONS["default"](config)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert got_factor == factor == 1.0
    dynamic = tiny_config({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    by_int = ROPE_INIT_FUNCTIONS["dynamic"](dynamic, None, 700)[0]
    torch.testing.assert_close(ROPE_INIT_FUNCTIONS["dynamic"](dynamic, None, torch.tensor(700))[0], by_int)
    with pytest.raises(ValueError, match=r"^config: its rope_type is 'default'; expected 'yarn'"):
        ROPE_INIT_FUNCTIONS["yarn"](config)


def test_rope_config_validation_warns_where_transformers_accepts_and_raises_where_it_cannot_work():
    import warnings

    ok = tiny_config(
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e4}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rope_config_validation(ok)  # factor == max_position_embeddings / original: silent
    mismatch = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "rope_theta": 1e4}
    with pytest.warns(UserWarning, match=r"rope_parameters\['factor'\]: 2.0 differs from .* = 4.0"):
        rope_config_validation({"max_position_embeddings": 256, "head_dim": 16, "rope_parameters": mismatch})
    implicit = {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                "original_max_position_embeddings": 64, "rope_theta": 1e4}  # fmt: skip
    with pytest.warns(UserWarning, match=r"rope_parameters\['factor'\]: missing, so it is implicit"):
        rope_config_validation({"max_position_embeddings": 256, "head_dim": 16, "rope_parameters": implicit})
    no_original = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "rope_theta": 1e4}  # fmt: skip
    with pytest.warns(
        UserWarning, match=r"\['original_max_position_embeddings'\]: missing for rope_type 'llama3'"
    ):
        rope_config_validation(
            {"max_position_embeddings": 256, "head_dim": 16, "rope_parameters": no_original}
        )
    shrinking = {"rope_type": "linear", "factor": 0.5, "rope_theta": 1e4}
    with pytest.raises(ValueError, match=r"factor"):  # transformers warns, then shrinks the context
        rope_config_validation({"max_position_embeddings": 256, "head_dim": 16, "rope_parameters": shrinking})
    no_factor = {"rope_type": "linear", "rope_theta": 1e4}
    with pytest.raises(ValueError, match=r"factor"):  # a required key missing
        rope_config_validation({"max_position_embeddings": 256, "head_dim": 16, "rope_parameters": no_factor})


# transformers' RopeTest snapshots (tests/utils/test_modeling_rope_utils.py), as printed there: default
# LlamaConfig (head_dim 128, rope_theta 1e4, max_position_embeddings 2048).
EXPECTED_DEFAULT_HEAD = [1.0000e00, 8.6596e-01, 7.4989e-01, 6.4938e-01, 5.6234e-01, 4.8697e-01]
EXPECTED_DYNAMIC_TAIL = [3.0683e-06, 2.4832e-06, 2.0097e-06, 1.6265e-06]  # factor 10, seq_len 16384
EXPECTED_YARN_MIDDLE = [1.0000e-01, 8.3479e-02, 6.9590e-02, 5.7925e-02, 4.8136e-02, 3.9931e-02]  # [16:22]


def test_rope_init_numerics_match_transformers_snapshots():
    import math

    from transformers import LlamaConfig

    def llama(params):
        return LlamaConfig(rope_parameters={"rope_theta": 10000.0, **params})

    default, scale = ROPE_INIT_FUNCTIONS["default"](llama({"rope_type": "default"}))
    assert scale == 1.0 and default.shape == (64,)
    torch.testing.assert_close(default[:6], torch.tensor(EXPECTED_DEFAULT_HEAD), rtol=1e-4, atol=0)
    for factor in (2.0, 10.0, 20.0):
        linear, scale = ROPE_INIT_FUNCTIONS["linear"](llama({"rope_type": "linear", "factor": factor}))
        torch.testing.assert_close(linear, default / factor)
        dynamic = llama({"rope_type": "dynamic", "factor": factor})
        torch.testing.assert_close(ROPE_INIT_FUNCTIONS["dynamic"](dynamic)[0], default)
        torch.testing.assert_close(ROPE_INIT_FUNCTIONS["dynamic"](dynamic, None, 1)[0], default)
        yarn = llama({"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": 2048})
        assert ROPE_INIT_FUNCTIONS["yarn"](yarn)[1] == pytest.approx(0.1 * math.log(factor) + 1.0)
        explicit = llama({"rope_type": "yarn", "factor": factor, "attention_factor": 0.5,
                          "original_max_position_embeddings": 2048})  # fmt: skip
        assert ROPE_INIT_FUNCTIONS["yarn"](explicit, None, 1)[1] == 0.5
    dynamic, _ = ROPE_INIT_FUNCTIONS["dynamic"](llama({"rope_type": "dynamic", "factor": 10.0}), None, 16384)
    torch.testing.assert_close(dynamic[-4:], torch.tensor(EXPECTED_DYNAMIC_TAIL), rtol=1e-4, atol=0)
    yarn = llama({"rope_type": "yarn", "factor": 10.0, "beta_fast": 32, "beta_slow": 1,
                  "original_max_position_embeddings": 2048})  # fmt: skip
    torch.testing.assert_close(
        ROPE_INIT_FUNCTIONS["yarn"](yarn)[0][16:22], torch.tensor(EXPECTED_YARN_MIDDLE), rtol=1e-4, atol=0
    )


NO_ORIGINAL = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4},
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, rope_theta=1e4),
    "longrope": dict(rope_type="longrope", short_factor=SHORT, long_factor=LONG, factor=4.0, rope_theta=1e4),
}


@pytest.mark.parametrize("rope_type", list(NO_ORIGINAL))
def test_rope_config_validation_without_original_length_does_what_transformers_function_does(rope_type):
    """Issue 24 said transformers 5.24 raises KeyError here. Its ``rope_config_validation`` is called on the
    same config as ropekit's: it standardises first (``standardize_rope_params``: the missing
    original_max_position_embeddings becomes max_position_embeddings) and accepts all three; only
    ``config.validate_rope()`` on a config never standardised raises KeyError. ropekit accepts too, with
    the same original length (and a warning that says so), and the frequencies agree."""
    import copy
    import warnings

    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS as HF_INIT
    from transformers.modeling_rope_utils import rope_config_validation as hf_validation

    config = tiny_config({"rope_type": "default", "rope_theta": 1e4})
    config.rope_parameters = dict(NO_ORIGINAL[rope_type])  # as a user sets it; not yet standardised
    theirs, ours = copy.deepcopy(config), copy.deepcopy(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_validation(theirs)  # accepts
    assert theirs.rope_parameters["original_max_position_embeddings"] == config.max_position_embeddings
    with pytest.warns(UserWarning, match=r"original_max_position_embeddings'\]: missing .* using "):
        rope_config_validation(ours)
    got, got_scale = ROPE_INIT_FUNCTIONS[rope_type](ours)
    want, want_scale = HF_INIT[rope_type](theirs)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)  # transformers forms them in float32
    assert got_scale == pytest.approx(want_scale, rel=1e-6)
    with pytest.raises(KeyError):  # the method, unstandardised: not what the function does
        copy.deepcopy(config).validate_rope()


@pytest.mark.c_compiler
def test_a_steady_bfloat16_decode_step_is_planned_and_equals_its_checked_first_call():
    """Issue 25: HF's rows come in the model's dtype; bf16 rows (B, 1, D) are converted to float32 by the
    plan's run, as the checked path converts them, so a steady bf16 decode step is a launch plan (8 ropekit
    calls; 71 before), bit for bit its first (checked) call."""
    from call_count import assert_planned, steady_step

    cos, sin = RopeConfig(head_dim=64).cos_sin(4096)
    at = torch.tensor([1000, 7, 4000, 300])
    rows_cos = torch.cat([cos[at]] * 2, -1)[:, None].bfloat16()  # (B, 1, D), full width
    rows_sin = torch.cat([sin[at]] * 2, -1)[:, None].bfloat16()
    g = torch.Generator().manual_seed(2)
    q = torch.randn(4, 8, 1, 64, generator=g).bfloat16()  # (B, H, 1, D)
    k = torch.randn(4, 2, 1, 64, generator=g).bfloat16()
    calls, first, planned = steady_step(lambda: apply_rotary_pos_emb(q, k, rows_cos, rows_sin, backend="cpu"))
    assert_planned(calls, 9)
    want = hf_apply_rotary_pos_emb(q.float(), k.float(), rows_cos.float(), rows_sin.float())
    for got, again, w in zip(planned, first, want, strict=True):
        assert torch.equal(got, again)
        torch.testing.assert_close(got.float(), w, rtol=1.6e-2, atol=1e-2)  # bf16 outputs
