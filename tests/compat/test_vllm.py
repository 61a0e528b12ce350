"""ropekit.compat.vllm against the cases of vLLM's own tests.

Follows vLLM's ``tests/kernels/core/test_pos_encoding.py`` (vllm-project/vllm, commit 0cf5d8e, 0.11):
``test_rotary_embedding`` (get_rope with rope_theta 10000 and partial_rotary_factor rotary_dim / head_size;
is_neox_style both ways; query shaped (B, S, H, D), flat (B, S, H * D) or sliced from (B, S, H, D + 64) (a
strided view); head sizes 64 and 80 (and 120, 256 scaled out), rotary_dim head_size or 32; bfloat16 and
float32; key given or None; positions random in [0, max_position); the in-place forward compared with the
reference, with vLLM's default tolerances: float32 atol 1e-5 / rtol 1.3e-6, bfloat16 atol 1e-3 / rtol 1.6e-2)
and ``test_rope_module_cache`` (one module per distinct configuration, the same one on a repeat, buffers in
the requested dtype). The reference is ropekit's float64 rotation by the module's own cache; sizes scaled for
a 2-core CPU (17 heads -> 5, seq 11 only).

The registered op ``torch.ops.ropekit.rotary_embedding`` follows vLLM's
``tests/kernels/core/test_rotary_embedding.py`` (``test_rotary_embedding_opcheck``: a float32
``RotaryEmbedding`` cache, 7 heads, batch 1, rotary_dim 32 of head sizes 32 and 108, max_position 11 and
4096, query sliced from (..., head_size + 64) or not, then the flat (tokens, heads * head_size) form, key or
None; ``torch.library.opcheck`` with its default checks). max_position 32768 and seq 1024 are scaled out.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from c_compiler import CPU
from ropekit import RopeConfig
from ropekit.compat.vllm import (
    RotaryEmbedding,
    apply_rope_with_cos_sin_cache,
    apply_rope_with_cos_sin_cache_inplace,
    get_rope,
    rotary_embedding,
)
from rotary_reference import reference_rotation, vllm_rotation

from .conftest import NO_DEFAULT, force_backend, signature_of, spy_cpu_kernel

BATCH, SEQ, HEADS, MAX_POSITION = 5, 11, 5, 8192
VLLM_TOL = {torch.float32: (1e-5, 1.3e-6), torch.bfloat16: (1e-3, 1.6e-2)}  # (atol, rtol)


def batch_shape(head_size):
    return (BATCH, SEQ, HEADS, head_size)


def flat_shape(head_size):
    return (BATCH, SEQ, HEADS * head_size)


def padded_shape(head_size):
    return (BATCH, SEQ, HEADS, head_size + 64)


def expected(rope: RotaryEmbedding, positions, x, heads_view):
    """ropekit's float64 rotation of x (shaped as vLLM passes it) by the module's own [cos | sin] cache."""
    half = rope.rotary_dim // 2
    cache = rope.cos_sin_cache
    x4 = heads_view(x)  # (B, S, H, D)
    return reference_rotation(
        x4, cache[:, :half], cache[:, half:], positions.numpy(), interleaved=not rope.is_neox_style
    )


@pytest.mark.parametrize("use_key", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rotary_dim", [None, 32])
@pytest.mark.parametrize("head_size", [64, 80])
@pytest.mark.parametrize("tensor_shape_fn", [batch_shape, flat_shape, padded_shape])
@pytest.mark.parametrize("is_neox_style", [True, False])
@torch.inference_mode()
def test_rotary_embedding_forward_is_the_reference_rotation_in_place(
    backend, is_neox_style, tensor_shape_fn, head_size, rotary_dim, dtype, use_key
):
    rotary_dim = head_size if rotary_dim is None else rotary_dim
    g = torch.Generator().manual_seed(0)
    rope_parameters = {
        "rope_type": "default",
        "rope_theta": 10000,
        "partial_rotary_factor": rotary_dim / head_size,
    }
    rope = get_rope(head_size, MAX_POSITION, is_neox_style, rope_parameters).to(dtype=dtype)
    positions = torch.randint(0, MAX_POSITION, (BATCH, SEQ), generator=g)
    # vLLM's slice: a no-op for (B, S, H, D), one head of the flat form, a strided view of the padded one
    query = torch.randn(tensor_shape_fn(head_size), generator=g).to(dtype)
    query = query[..., :head_size]
    key = torch.randn(query.shape, generator=g).to(dtype) if use_key else None
    heads_view = lambda t: t.reshape(BATCH, SEQ, -1, head_size)  # noqa: E731
    want_q = expected(rope, positions, query, heads_view)
    want_k = expected(rope, positions, key, heads_view) if use_key else None
    ref_query, ref_key = rope.forward_native(positions, query, key)  # out of place: inputs untouched
    out_query, out_key = rope.forward(positions, query, key)  # in place
    assert out_query is query and out_key is key
    atol, rtol = VLLM_TOL[dtype]
    torch.testing.assert_close(heads_view(out_query).double(), want_q, atol=atol, rtol=rtol)
    torch.testing.assert_close(out_query, ref_query, atol=atol, rtol=rtol)
    if use_key:
        torch.testing.assert_close(heads_view(out_key).double(), want_k, atol=atol, rtol=rtol)
        torch.testing.assert_close(out_key, ref_key, atol=atol, rtol=rtol)
    else:
        assert ref_key is None and out_key is None
    assert backend.calls > 0


@torch.inference_mode()
def test_rope_module_cache_shares_one_module_per_configuration():
    head_sizes, rotary_dims, max_positions = [64, 80], [None, 32], [123, 1234]
    thetas, neox, dtypes = [10000, 1000000], [True, False], [torch.bfloat16, torch.float32]
    parameter_sets = (
        {"rope_type": "default"},
        {"rope_type": "linear", "factor": (1,)},
        {"rope_type": "dynamic", "factor": 1},
    )
    settings = list(
        itertools.product(head_sizes, rotary_dims, max_positions, thetas, neox, parameter_sets, dtypes)
    )

    def build(setting):
        head_size, rotary_dim, max_position, theta, is_neox_style, params, dtype = setting
        params = {
            **params,
            "rope_theta": theta,
            "partial_rotary_factor": (rotary_dim or head_size) / head_size,
        }
        return get_rope(head_size, max_position, is_neox_style, params, dtype)

    ids = {}
    for setting in settings:
        rope = build(setting)
        assert id(rope) not in ids.values()  # different settings never share a module
        assert all(b.dtype == setting[-1] for b in rope.buffers())
        assert all(p.dtype == setting[-1] for p in rope.parameters())
        ids[str(setting)] = id(rope)
    for setting in settings:
        assert id(build(setting)) == ids[str(setting)]  # the cache takes effect


@pytest.mark.parametrize("is_neox", [True, False])
def test_flashinfer_functions_out_of_place_and_in_place(backend, is_neox):
    g = torch.Generator().manual_seed(3)
    rope = get_rope(64, 256, is_neox, {"rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    cache = rope.cos_sin_cache  # (256, 32) float32, as FlashInfer requires
    positions = torch.randint(0, 256, (7,), generator=g)
    query, key = (
        torch.randn(7, 4 * 64, generator=g),
        torch.randn(7, 2 * 64, generator=g),
    )  # (nnz, heads * head)
    q_before, k_before = query.clone(), key.clone()
    q_out, k_out = apply_rope_with_cos_sin_cache(positions, query, key, 64, cache, is_neox)
    assert torch.equal(query, q_before) and torch.equal(key, k_before)
    assert q_out.shape == query.shape and k_out.shape == key.shape
    assert torch.equal(q_out[:, 32:64], query[:, 32:64])  # features past rotary_dim pass through
    assert apply_rope_with_cos_sin_cache_inplace(positions, query, key, 64, cache, is_neox) is None
    torch.testing.assert_close(query, q_out, atol=0, rtol=0)
    torch.testing.assert_close(key, k_out, atol=0, rtol=0)
    q3 = q_before.clone()
    assert rotary_embedding(positions, q3, None, 64, cache, is_neox) is None  # key may be None
    assert torch.equal(q3, q_out)


@pytest.mark.parametrize(("rope_type", "extra"), [
    ("linear", {"factor": 2.0}),
    ("dynamic", {"factor": 2.0}),
    ("yarn", {"factor": 4.0, "original_max_position_embeddings": 32}),
    ("llama3", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}),
])  # fmt: skip
def test_scaled_caches_follow_ropekit_schedules_and_vllm_lengths(rope_type, extra):
    """Cache rows = vLLM's lengths; values = ropekit's schedule evaluated once for the whole cache."""
    from ropekit import RopeConfig

    rope = get_rope(32, 64, True, {"rope_type": rope_type, "rope_theta": 10000.0, **extra})
    rows = {"linear": 128, "dynamic": 128, "yarn": 128, "llama3": 64}[rope_type]
    assert rope.cos_sin_cache.shape == (rows, 32)
    config = RopeConfig(32, 10000.0, scaling={"rope_type": rope_type, **extra}, max_position_embeddings=64)
    seq_len = rows if config.length_dependent else None
    cos, sin = config.cos_sin(rows, seq_len=seq_len)
    torch.testing.assert_close(rope.cos_sin_cache, torch.cat([cos, sin], -1), atol=1e-7, rtol=0)


@pytest.mark.c_compiler
def test_cache_halves_are_read_where_they_lie(monkeypatch):
    """The CPU kernel reads cos at the cache's start and sin R/2 floats on (no gather, no copy), and rotates a
    strided query where it lies."""
    force_backend(monkeypatch, "cpu")
    seen = spy_cpu_kernel(monkeypatch)
    rope = get_rope(64, 512, True, {"rope_theta": 10000.0})
    query = torch.randn(9, 8, 64 + 16)[..., :64]  # a strided view, as vLLM's sliced qkv
    rope(torch.arange(9), query, None)
    base, ptr = rope.cos_sin_cache.data_ptr(), query.data_ptr()
    assert (seen["q"], seen["q_out"], seen["cos"], seen["sin"]) == (ptr, ptr, base, base + 32 * 4)


def test_a_cache_whose_strides_change_in_place_is_read_as_it_now_lies():
    """Issue 39, defect 9: the memo of a cache's halves was keyed on (pointer, shape), so after ``t_()`` on a
    square cache (same pointer, same shape, other strides) the stale halves rotated the query."""
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(64, 64, generator=g)
    positions = torch.tensor([3, 17, 40])
    query = torch.randn(3, 2 * 64, generator=g)
    apply_rope_with_cos_sin_cache(positions, query, None, 64, cache)  # the halves of the cache as it was
    cache.t_()
    got, _ = apply_rope_with_cos_sin_cache(positions, query, None, 64, cache)
    want, _ = apply_rope_with_cos_sin_cache(positions, query, None, 64, cache.contiguous())
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    in_place = query.clone()
    rotary_embedding(positions, in_place, None, 64, cache, True)
    torch.testing.assert_close(in_place, want, rtol=0, atol=0)


def test_a_cache_whose_dtype_changes_in_place_is_read_in_its_new_dtype():
    """The memo's key holds everything its halves depend on: a bfloat16 cache whose ``.data`` becomes a
    float16 view of the same bytes keeps its pointer, shape and strides, and must not be read as bfloat16."""
    cache = torch.randn(16, 8).to(torch.bfloat16)
    positions, query = torch.tensor([1, 5]), torch.randn(2, 8)
    apply_rope_with_cos_sin_cache(positions, query, None, 8, cache)
    cache.data = cache.data.view(torch.float16)
    got, _ = apply_rope_with_cos_sin_cache(positions, query, None, 8, cache)
    want, _ = apply_rope_with_cos_sin_cache(positions, query, None, 8, cache.clone())
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("good", "bad", "match"),
    [
        ((16, 128), (16.0, 128), r"^head_size: expected a positive int, got 16\.0"),
        ((16, 1), (16, True), r"^max_position: expected a positive int, got True"),
        ((16, 128, True, {"rope_type": "linear", "factor": 1}), (16, 128, True, {"rope_type": "linear",
         "factor": True}), r"factor"),
    ],
)  # fmt: skip
def test_get_rope_refuses_what_it_refuses_in_a_fresh_process_even_after_an_equal_key_was_cached(
    good, bad, match
):
    """Issue 39: the instance cache was read before the checks, so get_rope(16.0, ...) after
    get_rope(16, ...) returned the cached module (16.0 == 16 as a key)."""
    get_rope(*good)
    with pytest.raises(ValueError, match=match):
        get_rope(*bad)


def test_telechat3_yarn_original_length_that_is_not_an_integer_is_a_value_error():
    params = {"rope_type": "telechat3-yarn", "factor": 4.0, "original_max_position_embeddings": "4096"}
    with pytest.raises(ValueError, match=r"rope_parameters\['original_max_position_embeddings'\]: expected"):
        get_rope(64, 4096, True, params)
    with pytest.raises(ValueError, match=r"rope_parameters\['original_max_position_embeddings'\]"):
        deepseek = {**params, "rope_type": "deepseek_yarn", "original_max_position_embeddings": 0}
        get_rope(64, 4096, True, deepseek)


def test_errors_name_vllm_arguments():
    cache = get_rope(16, 32, True, {"rope_theta": 10000.0}).cos_sin_cache
    positions = torch.arange(4)
    with pytest.raises(ValueError, match=r"^positions: .*position 40 .*cos/sin table"):
        rotary_embedding(torch.tensor([0, 1, 2, 40]), torch.randn(4, 32), None, 16, cache, True)
    with pytest.raises(ValueError, match=r"^query: expected \(num_tokens, num_heads \* head_size\)"):
        rotary_embedding(positions, torch.randn(4, 24), None, 16, cache, True)
    with pytest.raises(ValueError, match=r"^key: expected"):
        rotary_embedding(positions, torch.randn(4, 32), torch.randn(3, 32), 16, cache, True)
    with pytest.raises(ValueError, match=r"^query: its strides"):
        rotary_embedding(positions, torch.randn(2, 2, 32).transpose(0, 1), None, 16, cache, True)
    with pytest.raises(ValueError, match=r"^cos_sin_cache: expected shape \(max_position, rotary_dim\)"):
        rotary_embedding(positions, torch.randn(4, 32), None, 16, torch.randn(32, 18), True)
    with pytest.raises(ValueError, match=r"^is_neox: expected a bool"):
        rotary_embedding(positions, torch.randn(4, 32), None, 16, cache, 1)
    with pytest.raises(ValueError, match=r"^rope_parameters\['rope_type'\]: expected one of"):
        get_rope(16, 32, True, {"rope_type": "longrope"})
    with pytest.raises(ValueError, match=r"^rope_parameters\['factor'\]: expected one number"):
        get_rope(16, 32, True, {"rope_type": "linear", "factor": [1.0, 2.0]})
    with pytest.raises(ValueError, match=r"^dual_chunk_attention_config"):
        get_rope(16, 32, True, None, None, {"chunk_size": 8})


def test_signatures_are_vllms_and_flashinfers():
    op = [
        ("positions", NO_DEFAULT),
        ("query", NO_DEFAULT),
        ("key", NO_DEFAULT),
        ("head_size", NO_DEFAULT),
        ("cos_sin_cache", NO_DEFAULT),
    ]
    # ropekit's keyword-only additions, after the peer's parameters
    backend = ("backend", "auto")
    added = backend, ("numerics", "exact")
    assert signature_of(rotary_embedding) == [*op, ("is_neox", NO_DEFAULT), *added]
    assert signature_of(apply_rope_with_cos_sin_cache) == [*op, ("is_neox", True), *added]
    assert signature_of(apply_rope_with_cos_sin_cache_inplace) == [*op, ("is_neox", True), *added]
    assert signature_of(get_rope)[:6] == [
        ("head_size", NO_DEFAULT),
        ("max_position", NO_DEFAULT),
        ("is_neox_style", True),
        ("rope_parameters", None),
        ("dtype", None),
        ("dual_chunk_attention_config", None),
    ]
    assert signature_of(RotaryEmbedding.__init__) == [
        ("head_size", NO_DEFAULT),
        ("rotary_dim", NO_DEFAULT),
        ("max_position_embeddings", NO_DEFAULT),
        ("base", NO_DEFAULT),
        ("is_neox_style", NO_DEFAULT),
        ("dtype", NO_DEFAULT),
        backend,
    ]
    assert signature_of(RotaryEmbedding.forward) == [
        ("positions", NO_DEFAULT),
        ("query", NO_DEFAULT),
        ("key", None),
    ]


def test_get_rope_reads_one_form_and_an_int_in_third_place_is_a_value_error():
    """Issue 17, repro 7: get_rope(64, 256, 1, {...}) was read as vLLM's pre-0.11 form (rotary_dim,
    max_position, base). One form now, vLLM >= 0.11's; an int is_neox_style names the argument, even when the
    module for True is already cached (1 == True as a cache key)."""
    params = {"rope_theta": 10000.0}
    get_rope(64, 256, True, params)
    for legacy in (1, 256):
        with pytest.raises(ValueError, match=rf"^is_neox_style: expected a bool, got {legacy} \(the third"):
            get_rope(64, 256, legacy, params)
    with pytest.raises(ValueError, match=r"^is_neox_style: expected a bool, got 2048"):
        get_rope(80, 32, 2048, 5000.0, False, None, torch.float32)  # the old 7-argument form
    with pytest.raises(TypeError):
        get_rope(80, 2048, rotary_dim=32)


def test_module_forward_compiles_with_fullgraph_and_still_writes_in_place():
    rope = get_rope(64, 256, True, {"rope_theta": 10000.0})
    g = torch.Generator().manual_seed(6)
    positions = torch.randint(0, 256, (7,), generator=g)
    query, key = torch.randn(7, 4 * 64, generator=g), torch.randn(7, 2 * 64, generator=g)
    want_q, want_k = rope.forward_native(positions, query, key)
    compiled = torch.compile(lambda p, q, k: rope(p, q, k), backend="aot_eager", fullgraph=True)
    compiled(positions, query, key)
    torch.testing.assert_close(query, want_q, atol=0, rtol=0)
    torch.testing.assert_close(key, want_k, atol=0, rtol=0)


@pytest.mark.cover  # fast tier: a per-axis cover; the other cases: make proofs
@pytest.mark.parametrize("head_stride_is_contiguous", [True, False])
@pytest.mark.parametrize("use_key", [True, False])
@pytest.mark.parametrize("head_size", [32, 108])
@pytest.mark.parametrize("is_neox_style", [True, False])
@pytest.mark.parametrize("max_position", [11, 4096])
def test_rotary_embedding_op_passes_opcheck(
    max_position, is_neox_style, head_size, use_key, head_stride_is_contiguous
):
    rot = RotaryEmbedding(head_size, 32, max_position, 10000, is_neox_style, torch.float32)
    g = torch.Generator().manual_seed(max_position + head_size)
    seq_len, num_heads = 11, 7
    positions = torch.randint(0, max_position, (1, seq_len), generator=g)
    head_stride = head_size + (64 if head_stride_is_contiguous else 0)
    query = torch.randn(1, seq_len, num_heads, head_stride, generator=g)
    key = torch.randn(query.shape, generator=g) if use_key else None
    query = query[..., :head_size]
    key = key[..., :head_size] if use_key else None
    cache = rot.cos_sin_cache.to(query.dtype)
    op = torch.ops.ropekit.rotary_embedding
    torch.library.opcheck(op, (positions, query, key, head_size, cache, is_neox_style))
    if head_stride_is_contiguous:  # vLLM's alternate (..., num_heads * head_size) form
        flat_key = key.flatten(start_dim=-2) if use_key else None
        torch.library.opcheck(
            op, (positions, query.flatten(start_dim=-2), flat_key, head_size, cache, is_neox_style)
        )
    # and the op rotates exactly as the compat function does
    want_q, want_k = query.clone(), None if key is None else key.clone()
    rotary_embedding(positions, want_q, want_k, head_size, cache, is_neox_style)
    op(positions, query, key, head_size, cache, is_neox_style)
    torch.testing.assert_close(query, want_q, atol=0, rtol=0)
    if use_key:
        torch.testing.assert_close(key, want_k, atol=0, rtol=0)


@pytest.mark.parametrize("backend_name", ["torch", CPU])
@pytest.mark.parametrize("through_op", [False, True])
def test_in_place_rotation_bumps_version_so_autograd_catches_the_overwrite(backend_name, through_op):
    """Issue 17's repro through vLLM's call: x saved for w's gradient, then rotated in place."""
    rope = get_rope(16, 32, True, {"rope_theta": 10000.0})
    x, w = torch.randn(4, 2 * 16), torch.randn(4, 2 * 16, requires_grad=True)
    key = torch.randn(4, 16)
    y = (x * w).sum()
    versions = x._version, key._version
    call = torch.ops.ropekit.rotary_embedding if through_op else rotary_embedding
    call(torch.arange(4), x, key, 16, rope.cos_sin_cache, True, backend=backend_name)
    assert x._version > versions[0] and key._version > versions[1]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@pytest.mark.c_compiler
def test_rotary_embedding_adds_few_python_calls_to_the_core_in_place_call():
    """The compat call is the op's checks plus the core's own call: at most 20 Python and C calls more than
    ``apply_rotary_qk(..., inplace=True)`` on the same (1, T, H, D) views (a count, not a time: the
    machine's load cannot move it). Wall clock, interleaved, decode-1 on a loaded 2-core machine:
    1.06x to 1.13x."""
    import sys

    from ropekit.functional import apply_rotary_qk

    cache = get_rope(128, 64, True, {"rope_theta": 10000.0}).cos_sin_cache
    positions, query, key = torch.tensor([9]), torch.randn(1, 4 * 128), torch.randn(1, 2 * 128)
    q4, k4, rows = query.view(1, 1, 4, 128), key.view(1, 1, 2, 128), positions.view(1, 1)
    cos, sin = cache[:, :64], cache[:, 64:]

    def count(f) -> int:
        f()  # warm every cache first
        calls = [0]

        def profile(frame, event, arg):
            if event in ("call", "c_call"):
                calls[0] += 1

        sys.setprofile(profile)
        try:
            f()
        finally:
            sys.setprofile(None)
        return calls[0]

    core = count(lambda: apply_rotary_qk(q4, k4, cos, sin, positions=rows, inplace=True))
    compat = count(lambda: rotary_embedding(positions, query, key, 128, cache, True))
    assert compat - core <= 20, (compat, core)  # 19 when this was written


@pytest.mark.parametrize("shape", [(0, 32), (0, 2, 16), (2, 0, 32)], ids=str)
def test_no_tokens_is_a_no_op_in_place_and_empty_tensors_out_of_place(shape):
    """Issue 17, repro 7: an empty input failed with a message about strides."""
    cache = get_rope(16, 32, True, {"rope_theta": 10000.0}).cos_sin_cache
    query, key = torch.randn(shape), torch.randn(shape)
    assert rotary_embedding(torch.arange(0), query, key, 16, cache, True) is None
    q, k = apply_rope_with_cos_sin_cache(torch.arange(0), query, key, 16, cache, True)
    assert q.shape == query.shape and k.shape == key.shape
    with pytest.raises(ValueError, match=r"^query: expected .* with num_tokens = 0"):
        rotary_embedding(
            torch.arange(0), torch.randn(4, 32), None, 16, cache, True
        )  # tokens but no positions


def test_positions_on_meta_for_a_query_with_values_is_a_value_error():
    """Issue 17, repro 7: vLLM positions on meta with the query on the CPU raised NotImplementedError."""
    cache = get_rope(16, 32, True, {"rope_theta": 10000.0}).cos_sin_cache
    positions = torch.zeros(4, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match=r"^positions: expected a tensor with values.* got a meta tensor"):
        rotary_embedding(positions, torch.randn(4, 32), None, 16, cache, True)


# ---- fused_qk_norm_rope: vLLM's tests/kernels/core/test_fused_qk_norm_rope.py compares the fused op with
# vLLM's RMSNorm (float32 mean square, cast to the input dtype, times the weight) on q and k per head, then
# its rotary embedding. Here: the same composition, written out, then rotary_embedding above.


def _qwen3_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_fused_qk_norm_rope_equals_rms_norm_then_rotary_embedding(dtype, is_neox, rotary_dim):
    from ropekit.compat.vllm import fused_qk_norm_rope

    tokens, q_heads, k_heads, head_dim, eps = 7, 4, 2, 64, 1e-6
    g = torch.Generator().manual_seed(11)
    qkv = (torch.randn(tokens, (q_heads + 2 * k_heads) * head_dim, generator=g) * 2).to(dtype)
    q_weight = (0.5 + torch.rand(head_dim, generator=g)).to(dtype)
    k_weight = (0.5 + torch.rand(head_dim, generator=g)).to(dtype)
    params = {"rope_theta": 1e6, "partial_rotary_factor": rotary_dim / head_dim}
    cache = get_rope(head_dim, MAX_POSITION, is_neox, params).cos_sin_cache
    positions = torch.randint(0, MAX_POSITION, (tokens,), generator=g)
    q_size, k_size = q_heads * head_dim, k_heads * head_dim
    q = _qwen3_rms_norm(qkv[:, :q_size].unflatten(-1, (q_heads, head_dim)), q_weight, eps).flatten(1)
    k = _qwen3_rms_norm(qkv[:, q_size : q_size + k_size].unflatten(-1, (k_heads, head_dim)), k_weight, eps)
    k = k.flatten(1)
    rotary_embedding(positions, q, k, head_dim, cache, is_neox)
    v = qkv[:, q_size + k_size :].clone()
    assert fused_qk_norm_rope(qkv, q_heads, k_heads, k_heads, head_dim, eps, q_weight, k_weight, cache,
                              is_neox, positions) is None  # fmt: skip
    atol, rtol = VLLM_TOL[dtype]
    torch.testing.assert_close(qkv[:, :q_size], q, atol=atol, rtol=rtol)
    torch.testing.assert_close(qkv[:, q_size : q_size + k_size], k, atol=atol, rtol=rtol)
    assert torch.equal(qkv[:, q_size + k_size :], v)


def test_fused_qk_norm_rope_signature_and_errors_are_vllms():
    from ropekit.compat.vllm import fused_qk_norm_rope

    names = ["qkv", "num_heads_q", "num_heads_k", "num_heads_v", "head_dim", "eps", "q_weight", "k_weight",
             "cos_sin_cache", "is_neox", "position_ids"]  # fmt: skip
    assert signature_of(fused_qk_norm_rope) == [(name, NO_DEFAULT) for name in names] + [("backend", "auto")]
    qkv, w = torch.randn(3, 6 * 16), torch.ones(16)
    cache = get_rope(16, 8, True, {"rope_theta": 1e4}).cos_sin_cache
    args = (qkv, 4, 1, 1, 16, 1e-6, w, w, cache, True)
    before = qkv.clone()
    with pytest.raises(ValueError, match=r"^position_ids: "):
        fused_qk_norm_rope(*args, torch.tensor([0, 1, 8]))
    with pytest.raises(ValueError, match=r"^num_heads_v: "):
        fused_qk_norm_rope(qkv, 4, 1, 2, 16, 1e-6, w, w, cache, True, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"^num_heads_q: "):
        fused_qk_norm_rope(qkv, 0, 1, 1, 16, 1e-6, w, w, cache, True, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"^cos_sin_cache: "):
        fused_qk_norm_rope(*args[:8], cache[:, :5], True, torch.tensor([0, 1, 2]))
    assert torch.equal(qkv, before)


@pytest.mark.parametrize(("index", "name"), [(4, "head_dim"), (2, "num_heads_k"), (1, "num_heads_q")])
@pytest.mark.parametrize("bad", [None, "16", 0])
def test_fused_qk_norm_rope_head_counts_and_head_dim_that_are_not_ints_are_value_errors(index, name, bad):
    """Issue 24: head_dim=None was a TypeError from '<=' inside the cache check."""
    from ropekit.compat.vllm import fused_qk_norm_rope

    qkv, w = torch.randn(3, 6 * 16), torch.ones(16)
    cache = get_rope(16, 8, True, {"rope_theta": 1e4}).cos_sin_cache
    args = [qkv, 4, 1, 1, 16, 1e-6, w, w, cache, True, torch.tensor([0, 1, 2])]
    args[index] = bad
    before = qkv.clone()
    with pytest.raises(ValueError, match=rf"^{name}: expected a positive int, got {bad!r}"):
        fused_qk_norm_rope(*args)
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("is_neox", [True, False])
def test_steady_decode_steps_take_the_launch_plan_and_stay_exact(is_neox):
    """From the second step on, rotary_embedding runs its launch plan (the C loop the core's
    per-sequence-offset plan proved, each token a sequence of its own): every step equals the float64
    reference, and a position past the cache on a planned step is still a ValueError naming positions,
    with query and key unchanged."""
    import ropekit.backends.plan as plan

    cache = get_rope(64, 64, is_neox, {"rope_theta": 10000.0}).cos_sin_cache
    cos, sin = cache[:, :32], cache[:, 32:]
    g = torch.Generator().manual_seed(3)
    plan.clear_plans()
    for _ in range(3):
        positions = torch.randint(0, 64, (5,), generator=g)
        query, key = torch.randn(5, 4 * 64, generator=g), torch.randn(5, 2 * 64, generator=g)
        rows, pair = positions.numpy(), dict(interleaved=not is_neox)
        want_q = reference_rotation(query.view(5, 4, 64), cos, sin, rows, **pair)
        want_k = reference_rotation(key.view(5, 2, 64), cos, sin, rows, **pair)
        rotary_embedding(positions, query, key, 64, cache, is_neox)
        torch.testing.assert_close(query.view(5, 4, 64), want_q.float(), atol=2e-6, rtol=2e-6)
        torch.testing.assert_close(key.view(5, 2, 64), want_k.float(), atol=2e-6, rtol=2e-6)
        assert len(plan._plans) == 1  # the first step made vLLM's plan (its one gate), later ones use it
    bad = torch.tensor([0, 1, 64, 2, 3])
    query, key = torch.randn(5, 4 * 64), torch.randn(5, 2 * 64)
    before = query.clone(), key.clone()
    with pytest.raises(ValueError, match=r"^positions: largest position 64 is past the cos/sin table"):
        rotary_embedding(bad, query, key, 64, cache, is_neox)
    assert torch.equal(query, before[0]) and torch.equal(key, before[1])


@pytest.mark.c_compiler
def test_a_steady_in_place_step_is_its_own_plan_costing_no_more_calls_than_the_core():
    """vLLM's call keys its own plan: no (tokens, heads, head_size) views are built on a steady step; query
    and key as views of one packed qkv buffer still take it; a key sharing query's memory still raises."""
    import ropekit.backends.plan as plan
    from call_count import ropekit_calls
    from ropekit import apply_rotary_qk

    cache = get_rope(64, 64, True, {"rope_theta": 10000.0}).cos_sin_cache
    cos, sin = cache[:, :32], cache[:, 32:]
    g = torch.Generator().manual_seed(4)
    plan.clear_plans()
    qkv = torch.randn(5, 8 * 64, generator=g)  # [q (4 heads) | k (2) | v (2)] per token
    positions = torch.randint(0, 64, (5,), generator=g)
    spare = qkv.clone()
    for _ in range(2):  # plans the kind, then learns that these views share no element
        rotary_embedding(positions, spare[:, :256], spare[:, 256:384], 64, cache, True)
    query, key = qkv[:, :256], qkv[:, 256:384]
    want_q = reference_rotation(query.reshape(5, 4, 64), cos, sin, positions.numpy(), interleaved=False)
    want_k = reference_rotation(key.reshape(5, 2, 64), cos, sin, positions.numpy(), interleaved=False)
    calls = ropekit_calls(lambda: rotary_embedding(positions, query, key, 64, cache, True))
    core_q, core_k = torch.randn(1, 5, 4, 64), torch.randn(1, 5, 2, 64)
    core = lambda: apply_rotary_qk(core_q, core_k, cos, sin, offsets=3, inplace=True)  # noqa: E731
    core()
    assert len(calls) <= len(ropekit_calls(core)) and "_token_heads" not in calls, calls
    torch.testing.assert_close(query.reshape(5, 4, 64), want_q.float(), atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(key.reshape(5, 2, 64), want_k.float(), atol=2e-6, rtol=2e-6)
    clash = qkv.clone()  # key's heads inside query's: same strides, shared elements
    with pytest.raises(ValueError, match="key"):
        rotary_embedding(positions, clash[:, :256], clash[:, 128:256], 64, cache, True)


def _planned_vllm_step(rope, positions):
    """Two in-place calls of good values with query (5, 4 * 64) and key (5, 2 * 64): vLLM's plan for the kind
    exists after them."""
    import ropekit.backends.plan as plan

    plan.clear_plans()
    for _ in range(2):
        rope.forward(positions, torch.randn(5, 4 * 64), torch.randn(5, 2 * 64))
    assert any(
        key[0] == "compat.vllm.rotary_embedding" and run is not None for key, run in plan._plans.items()
    )


@pytest.mark.c_compiler
@pytest.mark.parametrize("written", ["query", "key"])
@pytest.mark.parametrize("through", ["forward", "rotary_embedding", "op"])
def test_query_or_key_inside_the_cos_sin_cache_after_a_plan_raises_and_writes_nothing(through, written):
    rope = get_rope(64, 64, True, {"rope_theta": 10000.0})
    positions = torch.randint(0, 64, (5,), generator=torch.Generator().manual_seed(5))
    _planned_vllm_step(rope, positions)
    storage = torch.zeros(2 * 64 * 64)
    cache = storage[: 64 * 64].view(64, 64)  # the planned cache's layout
    cache.copy_(rope.cos_sin_cache)
    query, key = torch.randn(5, 4 * 64), torch.randn(5, 2 * 64)
    if written == "query":
        query = storage[1024 : 1024 + 5 * 256].view(5, 256)  # rows 16 .. 35 of the cache
    else:
        key = storage[2048 : 2048 + 5 * 128].view(5, 128)
    before = [t.clone() for t in (storage, query, key)]
    with pytest.raises(ValueError, match=f"^{written}: it is written and shares memory with cos"):
        if through == "forward":
            rope.cos_sin_cache = cache
            rope.forward(positions, query, key)
        elif through == "rotary_embedding":
            rotary_embedding(positions, query, key, 64, cache, True)
        else:
            torch.ops.ropekit.rotary_embedding(positions, query, key, 64, cache, True)
    assert all(torch.equal(a, b) for a, b in zip((storage, query, key), before, strict=True))


@pytest.mark.c_compiler
def test_an_inference_query_outside_inference_mode_after_a_plan_raises_and_writes_nothing():
    rope = get_rope(64, 64, True, {"rope_theta": 10000.0})
    positions = torch.randint(0, 64, (5,), generator=torch.Generator().manual_seed(6))
    _planned_vllm_step(rope, positions)
    with torch.inference_mode():
        query, key = torch.randn(5, 4 * 64), torch.randn(5, 2 * 64)
    before = query.clone(), key.clone()
    with pytest.raises(ValueError, match=r"^query: an inference tensor \(made under torch.inference_mode"):
        rope.forward(positions, query, key)
    assert torch.equal(query, before[0]) and torch.equal(key, before[1])


@pytest.mark.parametrize("backend", ["torch", CPU])
def test_an_error_names_only_the_arguments_a_vllm_caller_passed(backend):
    """Issue 24: an error names the argument as the caller named it, in its body too: a query inside
    cos_sin_cache says query and cos_sin_cache, never the core's q, k, cos or sin."""
    import re

    cache = torch.randn(64, 32)  # (max_position, rotary_dim): [cos | sin]
    query = cache[:4]  # four tokens of one 32-wide head, inside the cache
    before = cache.clone()
    with pytest.raises(ValueError) as info:
        rotary_embedding(torch.arange(4), query, None, 32, cache, True, backend=backend)
    message = str(info.value)
    assert message.startswith("query:") and "cos_sin_cache" in message, message
    assert not re.search(r"(?<![\w/-])(q|k|x|cos|sin)(?![\w/-])", message), message
    assert torch.equal(cache, before)  # nothing written


class PerSequencePlanned:
    """A registered backend whose launch plan takes per-sequence offsets, as the Triton kernel's does (the
    torch backend's math; its plan's runs counted). A row past the table: its run writes nothing and says so
    (None), as a launcher that refuses it on the host."""

    name = "per_sequence_planned"

    def __init__(self) -> None:
        self.runs = 0

    def unavailable_reason(self, q, cos):
        return None

    def rotate_qk(self, *args, **kwargs):
        from ropekit.backends import BACKENDS

        return BACKENDS["torch"].rotate_qk(*args, **kwargs)

    def plan(self, q, k, cos, sin, *, interleaved, conjugate, inplace, per_sequence=False):
        def run(q, k, cos, sin, offset):
            self.runs += 1
            rows = offset[:, None] + torch.arange(q.shape[1]) if per_sequence else None  # (B, S)
            flags = dict(interleaved=interleaved, conjugate=conjugate, inplace=inplace)
            try:
                return self.rotate_qk(q, k, cos, sin, rows, **flags, offset=0 if per_sequence else offset)
            except ValueError:
                return None

        return run


def test_a_backend_with_a_per_sequence_plan_serves_the_steady_in_place_step_through_it(monkeypatch):
    """On a backend other than the C loop, vLLM's one gate keeps the core's per-sequence plan on the call's
    (T, 1, H, D) views: a steady step resolves no positions and matches the torch backend; a position past
    the cache still raises the checked path's error with query and key unchanged."""
    import ropekit.backends as backends
    from call_count import ropekit_calls

    monkeypatch.setattr(backends, "BACKENDS", dict(backends.BACKENDS))
    backend = PerSequencePlanned()
    backends.register_backend(backend)
    monkeypatch.setattr(backends, "_choices", {})  # the choices of the registered backend go with it
    g = torch.Generator().manual_seed(5)
    cache = get_rope(64, 64, True, {"rope_theta": 10000.0}).cos_sin_cache
    for _ in range(3):
        positions = torch.randint(0, 64, (5,), generator=g)
        query, key = torch.randn(5, 4 * 64, generator=g), torch.randn(5, 2 * 64, generator=g)
        want = query.clone(), key.clone()
        rotary_embedding(positions, *want, 64, cache, True, backend="torch")
        rotary_embedding(positions, query, key, 64, cache, True, backend=backend.name)
        torch.testing.assert_close((query, key), want, rtol=0, atol=0)
    runs = backend.runs
    step = lambda: rotary_embedding(positions, query, key, 64, cache, True, backend=backend.name)  # noqa: E731
    calls = ropekit_calls(step)
    assert backend.runs == runs + 1 and "resolve" not in calls, calls
    bad, before = torch.tensor([0, 1, 64, 2, 3]), (query.clone(), key.clone())
    with pytest.raises(ValueError, match=r"^positions: largest position 64 is past the cos/sin table"):
        rotary_embedding(bad, query, key, 64, cache, True, backend=backend.name)
    assert torch.equal(query, before[0]) and torch.equal(key, before[1])


@pytest.mark.c_compiler
@pytest.mark.parametrize("entry", ["forward_native", "apply_rope_with_cos_sin_cache"])
def test_a_steady_out_of_place_step_takes_the_positions_plan_and_keeps_the_checked_errors(entry):
    """Issue 25: vLLM's out-of-place calls reach the core's positions gate on their (1, T, H, D) views: a
    steady step is the plan (the C loop reads the positions; 11-13 ropekit calls, 63-65 before), bit for
    bit the checked first call and the in-place op's answer; a position past the cache, once planned, still
    raises the checked path's message (vLLM's names), and nothing is written."""
    from call_count import assert_planned, steady_step

    rope = get_rope(64, 512, True, {"rope_theta": 10000.0})
    cache = rope.cos_sin_cache
    g = torch.Generator().manual_seed(9)
    positions = torch.tensor([500, 3, 511, 0])
    query, key = torch.randn(4, 4 * 64, generator=g), torch.randn(4, 2 * 64, generator=g)
    if entry == "forward_native":
        step = lambda pos=positions: rope.forward_native(pos, query, key)  # noqa: E731
    else:
        step = lambda pos=positions: apply_rope_with_cos_sin_cache(pos, query, key, 64, cache)  # noqa: E731
    before = query.clone(), key.clone()
    calls, first, planned = steady_step(step)
    assert_planned(calls, 14)
    want = query.clone(), key.clone()
    rotary_embedding(positions, *want, 64, cache, True)
    for got, again, w in zip(planned, first, want, strict=True):
        assert torch.equal(got, again) and torch.equal(got, w)
    messages = []
    for bad in (torch.tensor([500, 3, 512, 0]), torch.tensor([500, -1, 4, 0])):
        for backend in ("torch", "cpu"):
            with pytest.raises(ValueError) as err:
                apply_rope_with_cos_sin_cache(bad, query, key, 64, cache, backend=backend)
            messages.append(str(err.value))
    assert messages[0] == messages[1] and messages[2] == messages[3], messages
    assert messages[0].startswith("positions: largest position 512 is past the cos/sin table")
    assert torch.equal(query, before[0]) and torch.equal(key, before[1])


@pytest.mark.parametrize("call", ["apply_rope_with_cos_sin_cache", "rotary_embedding"])
@pytest.mark.parametrize(("tokens", "heads", "rows"), [(2, 2, 1), (3, 2, 2), (2, 2, 4), (2, 1, 1)])
def test_positions_that_do_not_count_the_query_tokens_are_a_value_error(call, tokens, heads, rows):
    """Found by the fuzzer's plugin family in the proof tier (issue 39): query (2, 2 * 8) with one position
    was read as one token of 4 heads (divisibility was all the check asked) and rotated silently; (2, 8)
    with one position as one token's (2 heads, 8) form."""
    from ropekit import RopeConfig
    from ropekit.compat import vllm as compat_vllm

    cos, sin = RopeConfig(8, 10000.0).cos_sin(24)
    cache = torch.cat([cos, sin], -1)
    query, key = torch.randn(tokens, heads * 8), torch.randn(tokens, 8)
    before = query.clone()
    fn = getattr(compat_vllm, call)
    with pytest.raises(ValueError, match=rf"^query: expected .* with num_tokens = {rows} \(positions\)"):
        fn(torch.zeros(rows, dtype=torch.int64), query, key, 8, cache, True)
    assert torch.equal(query, before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("is_neox", [True, False])
def test_numerics_vllm_gives_forward_natives_bits_in_place_and_out_of_place(dtype, is_neox):
    g = torch.Generator().manual_seed(0)
    cos, sin = RopeConfig(32, rotary_dim=24).cos_sin(64)
    cache = torch.cat((cos, sin), -1).to(dtype)  # (P, R): vLLM's cache in the model's dtype
    positions = torch.randint(0, 64, (9,), generator=g)
    query, key = (8 * torch.randn(9, 4 * 32, generator=g)).to(dtype), (8 * torch.randn(9, 2 * 32)).to(dtype)
    want = [
        vllm_rotation(t.view(1, 9, -1, 32), cos, sin, positions[None], interleaved=not is_neox).view(t.shape)
        for t in (query, key)
    ]
    for _ in range(2):  # checked, then planned
        got = apply_rope_with_cos_sin_cache(positions, query, key, 32, cache, is_neox, numerics="vllm")
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        q, k = query.clone(), key.clone()
        rotary_embedding(positions, q, k, 32, cache, is_neox, numerics="vllm")
        assert torch.equal(q, want[0]) and torch.equal(k, want[1])
