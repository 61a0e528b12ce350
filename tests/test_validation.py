"""Every misuse is a ValueError that names the argument, the value received and what was expected.

Each case calls the public API the way a user would get it wrong; the match pattern pins the argument name,
the offending value and the expectation, so a bare IndexError, an assert or a silent broadcast fails the test.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ropekit import RopeConfig, RotaryEmbedding, apply_rotary, apply_rotary_qk
from ropekit.validation import (
    check_base,
    check_bool,
    check_even,
    check_fraction,
    check_int,
    check_number,
    check_numerics,
    check_positive,
    check_rotary_dim,
)

COS, SIN = RopeConfig(8).cos_sin(16)
X = torch.randn(2, 4, 3, 8)


@pytest.mark.parametrize(
    "rotary_dim, match",
    [
        (7, r"rotary_dim: expected a positive even integer <= head_dim \(8\), got 7"),
        (0, r"rotary_dim: expected a positive even integer <= head_dim \(8\), got 0"),
        (-2, r"rotary_dim: expected .*, got -2"),
        (10, r"rotary_dim: expected a positive even integer <= head_dim \(8\), got 10"),
        (4.0, r"rotary_dim: expected .*, got 4\.0"),
        (True, r"rotary_dim: expected .*, got True"),
    ],
)
def test_bad_rotary_dim_is_rejected(rotary_dim, match):
    with pytest.raises(ValueError, match=match):
        RopeConfig(8, rotary_dim=rotary_dim)


def test_odd_head_dim_needs_an_explicit_even_rotary_dim():
    with pytest.raises(ValueError, match=r"rotary_dim: expected .* \(9\), got 9 \(head_dim is odd"):
        RopeConfig(9)
    assert RopeConfig(9, rotary_dim=8).rotary_dim == 8


@pytest.mark.parametrize("head_dim", [0, -4, 8.0, "8", None])
def test_bad_head_dim_is_rejected(head_dim):
    with pytest.raises(ValueError, match=rf"head_dim: expected a positive integer, got {head_dim!r}"):
        RopeConfig(head_dim)


@pytest.mark.parametrize("base", [1.0, 0.5, 0, -10000.0, math.inf, math.nan, "10000", None, True])
def test_base_must_be_finite_and_greater_than_one(base):
    with pytest.raises(ValueError, match=r"base: expected a finite number > 1, got " + repr(base)):
        RopeConfig(8, base)


def test_numpy_scalars_are_accepted_as_numbers():
    config = RopeConfig(np.int64(8), np.float64(500000.0), rotary_dim=np.int32(4))
    assert (config.head_dim, config.base, config.rotary_dim) == (8, 500000.0, 4)
    assert check_base(np.float32(10.0)) == 10.0
    assert check_rotary_dim(np.int64(2), 8) == 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"interleaved": 1}, r"interleaved: expected a bool, got 1"),
        (
            {"max_position_embeddings": 0},
            r"max_position_embeddings: expected a positive integer or None, got 0",
        ),
        ({"scaling": 5}, r"scaling: expected a dict like HF's rope_scaling or None, got 5"),
        ({"scaling": {"rope_type": "nope"}}, r"scaling: unknown rope_type 'nope'; expected one of \["),
    ],
)
def test_bad_config_keywords_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RopeConfig(8, **kwargs)


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda c: c.cos_sin(-1),
            r"positions: expected a non-negative int n \(meaning arange\(n\)\), got -1",
        ),
        (lambda c: c.cos_sin([0, 1]), r"positions: expected an int or a tensor, got \[0, 1\]"),
        (
            lambda c: c.cos_sin(4, dtype=torch.int64),
            r"dtype: expected a floating-point dtype, got torch.int64",
        ),
        (lambda c: c.cos_sin(4, dtype="float32"), r"dtype: expected a floating-point dtype, got float32"),
        (lambda c: c.inv_freq(-1), r"seq_len: expected an integer >= 0 or None, got -1"),
    ],
)
def test_bad_cos_sin_arguments_are_rejected(call, match):
    with pytest.raises(ValueError, match=match):
        call(RopeConfig(8))


@pytest.mark.parametrize(
    "cos, sin, match",
    [
        (COS, SIN[:, :2], r"cos and sin: expected the same shape, got cos \(16, 4\) and sin \(16, 2\)"),
        (COS[:8], SIN, r"cos and sin: expected the same shape, got cos \(8, 4\) and sin \(16, 4\)"),
        (
            *RopeConfig(12).cos_sin(16),
            r"cos: table width 6 means rotary_dim 12; expected 0 < rotary_dim <= head_dim \(8\)",
        ),
        (COS[:, :0], SIN[:, :0], r"cos: table width 0 means rotary_dim 0; expected 0 < rotary_dim"),
        (COS[None], SIN[None], r"cos: expected shape \(table_len, rotary_dim // 2\), got shape \(1, 16, 4\)"),
        (COS.long(), SIN, r"cos: expected a floating-point torch.Tensor, got a torch.int64 tensor of shape"),
        (COS.numpy(), SIN, r"cos: expected a floating-point torch.Tensor, got array\("),
        (
            COS,
            SIN.double(),
            r"cos and sin: expected one device and dtype, got cos torch.float32 .* sin torch.float64",
        ),
    ],
)
def test_bad_tables_are_rejected(cos, sin, match):
    with pytest.raises(ValueError, match=match):
        apply_rotary(X, cos, sin)


@pytest.mark.parametrize(
    "x, kwargs, match",
    [
        (
            X[0],
            {},
            r"x: expected a 4-D tensor \(batch, seq, heads, head_dim\); a packed 3-D input needs "
            r"cu_seqlens, got shape \(4, 3, 8\)",
        ),
        (X[0, 0], {}, r"x: expected a 4-D tensor .*needs cu_seqlens, got shape \(3, 8\)"),
        (
            X[None],
            {},
            r"x: expected a 4-D tensor \(batch, seq, heads, head_dim\), got shape \(1, 2, 4, 3, 8\)",
        ),
        (
            X,
            {"cu_seqlens": torch.tensor([0, 2])},
            r"x: expected a 3-D tensor \(total_tokens, heads, head_dim\) when cu_seqlens is given, got shape",
        ),
        (X.long(), {}, r"x: expected a floating-point tensor, got dtype torch.int64"),
        (X.numpy(), {}, r"x: expected a torch.Tensor, got array\("),
    ],
)
def test_x_of_the_wrong_rank_or_type_is_rejected(x, kwargs, match):
    with pytest.raises(ValueError, match=match):
        apply_rotary(x, COS, SIN, **kwargs)


@pytest.mark.parametrize(
    "positions, match",
    [
        (
            torch.zeros(2, 3, dtype=torch.long),
            r"positions: expected shape \(batch, seq\) = \(2, 4\), got \(2, 3\)",
        ),
        (
            torch.zeros(8, dtype=torch.long),
            r"positions: expected shape \(batch, seq\) = \(2, 4\), got \(8,\)",
        ),
        (
            torch.zeros(2, 4),
            r"positions: expected an integer tensor, got a torch.float32 tensor of shape \(2, 4\)",
        ),
        (
            torch.zeros(2, 4, dtype=torch.bool),
            r"positions: expected an integer tensor, got a torch.bool tensor",
        ),
        ([[0, 1, 2, 3]] * 2, r"positions: expected an integer tensor, got \[\[0, 1, 2, 3\]"),
        (
            torch.tensor([[0, 1, 2, 3], [0, -1, 2, 3]]),
            r"positions: expected values >= 0, got a minimum of -1",
        ),
        (
            torch.tensor([[0, 1, 2, 3], [0, 1, 2, 16]]),
            r"positions: largest position 16 is past the cos/sin table \(table_len 16\); "
            r"expected positions < table_len",
        ),
    ],
)
def test_bad_positions_are_rejected(positions, match):
    with pytest.raises(ValueError, match=match):
        apply_rotary(X, COS, SIN, positions=positions)


def test_default_positions_past_the_table_are_rejected():
    with pytest.raises(
        ValueError, match=r"positions: largest position 16 is past the cos/sin table \(table_len 16"
    ):
        apply_rotary(X, COS, SIN, offsets=13)


def test_positions_and_non_zero_offsets_are_rejected_together():
    with pytest.raises(ValueError, match=r"offsets: expected 0 when positions is given .*got 2"):
        apply_rotary(X, COS, SIN, positions=torch.zeros(2, 4, dtype=torch.long), offsets=2)


PACKED = torch.randn(7, 3, 8)


@pytest.mark.parametrize(
    "cu_seqlens, match",
    [
        (
            torch.tensor([0, 3, 7], dtype=torch.float32),
            r"cu_seqlens: expected an int32 or int64 tensor, got a torch",
        ),
        ([0, 3, 7], r"cu_seqlens: expected an int32 or int64 tensor, got \[0, 3, 7\]"),
        (torch.tensor([7]), r"cu_seqlens: expected shape \(num_seqs \+ 1,\) with num_seqs >= 1, got \(1,\)"),
        (torch.tensor([[0, 7]]), r"cu_seqlens: expected shape \(num_seqs \+ 1,\) .*, got \(1, 2\)"),
        (
            torch.tensor([1, 3, 7]),
            r"cu_seqlens: expected non-decreasing offsets from 0 to total_tokens \(7\), got "
            r"\[1, 3, 7\]",
        ),
        (torch.tensor([0, 3, 6]), r"to total_tokens \(7\), got \[0, 3, 6\]"),
        (torch.tensor([0, 5, 3, 7]), r"to total_tokens \(7\), got \[0, 5, 3, 7\]"),
    ],
)
def test_malformed_cu_seqlens_is_rejected(cu_seqlens, match):
    with pytest.raises(ValueError, match=match):
        apply_rotary(PACKED, COS, SIN, cu_seqlens=cu_seqlens)


def test_malformed_cu_seqlens_is_rejected_even_with_explicit_positions():
    with pytest.raises(ValueError, match=r"cu_seqlens: expected non-decreasing offsets"):
        apply_rotary(
            PACKED, COS, SIN, cu_seqlens=torch.tensor([0, 3, 9]), positions=torch.zeros(7, dtype=torch.long)
        )


@pytest.mark.parametrize(
    "x, kwargs, match",
    [
        (
            X,
            {"offsets": torch.tensor([1, 2, 3])},
            r"offsets: expected an int or a tensor of shape \(2,\) \(one per batch row\), got shape \(3,\)",
        ),
        (
            X,
            {"offsets": torch.tensor(1)},
            r"offsets: expected an int or a tensor of shape \(2,\) .*got shape \(\)",
        ),
        (
            PACKED,
            {"cu_seqlens": torch.tensor([0, 3, 7]), "offsets": torch.tensor([1, 2, 3])},
            r"offsets: expected an int or a tensor of shape \(2,\) \(one per packed sequence\), "
            r"got shape \(3,\)",
        ),
        (
            X,
            {"offsets": torch.tensor([1.0, 2.0])},
            r"offsets: expected an int or an integer tensor, got a torch.float32",
        ),
        (X, {"offsets": 1.5}, r"offsets: expected a non-negative int or an integer tensor, got 1.5"),
        (X, {"offsets": -1}, r"offsets: expected a non-negative int or an integer tensor, got -1"),
        (X, {"offsets": torch.tensor([0, -3])}, r"offsets: expected values >= 0, got a minimum of -3"),
    ],
)
def test_bad_offsets_are_rejected(x, kwargs, match):
    with pytest.raises(ValueError, match=match):
        apply_rotary(x, COS, SIN, **kwargs)


@pytest.mark.parametrize(
    "k, match",
    [
        (
            torch.randn(2, 5, 1, 8),
            r"k: expected the same leading axes and head_dim as q \(2, 4, 3, 8\), got \(2, 5, 1, 8\)",
        ),
        (
            torch.randn(2, 4, 1, 6),
            r"k: expected the same leading axes and head_dim as q .*, got \(2, 4, 1, 6\)",
        ),
        (
            torch.randn(2, 4, 1, 8).double(),
            r"k: expected q's dtype torch.float32 and device cpu, got torch.float64",
        ),
        (None, r"k: expected a torch.Tensor, got None"),
    ],
)
def test_bad_k_is_rejected(k, match):
    with pytest.raises(ValueError, match=match):
        apply_rotary_qk(X, k, COS, SIN)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"interleaved": "yes"}, r"interleaved: expected a bool, got 'yes'"),
        ({"inplace": 1}, r"inplace: expected a bool, got 1"),
        ({"backend": "cuda"}, r"backend: expected 'auto' or one of \[.*'torch'.*\], got 'cuda'"),
        ({"backend": None}, r"backend: expected a string, got None"),
    ],
)
def test_bad_flags_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        apply_rotary(X, COS, SIN, **kwargs)


@pytest.mark.parametrize(
    "make, match",
    [
        (
            lambda: RotaryEmbedding(head_dim=8, layout="hbsd"),
            r"layout: expected one of \('bshd', 'bhsd', 'sbhd', 'thd'\), got 'hbsd'",
        ),
        (
            lambda: RotaryEmbedding(RopeConfig(8), head_dim=8),
            r"config_kwargs: pass either a RopeConfig or its keyword",
        ),
        (lambda: RotaryEmbedding({"head_dim": 8}), r"config: expected a RopeConfig or None, got dict"),
        (
            lambda: RotaryEmbedding(head_dim=8, backend="cuda"),
            r"backend: expected 'auto' or one of \[.*'torch'.*\], got 'cuda'",
        ),
    ],
)
def test_bad_module_arguments_are_rejected(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    "layout, q, kwargs, match",
    [
        (
            "bhsd",
            torch.randn(3, 4, 8),
            {},
            r"q: expected a 4-D tensor \(batch, heads, seq, head_dim\) for layout "
            r"'bhsd', got a torch.float32 tensor of shape \(3, 4, 8\)",
        ),
        (
            "thd",
            torch.randn(2, 7, 3, 8),
            {},
            r"q: expected a 3-D tensor \(total_tokens, heads, head_dim\) for layout",
        ),
        (
            "thd",
            torch.randn(7, 3, 8),
            {},
            r"cu_seqlens: layout 'thd' needs cu_seqlens or positions, got None",
        ),
    ],
)
def test_bad_module_inputs_are_rejected(layout, q, kwargs, match):
    rope = RotaryEmbedding(head_dim=8, layout=layout)
    with pytest.raises(ValueError, match=match):
        rope(q, q, **kwargs)


@pytest.mark.parametrize(
    ("check", "good", "bad"),
    [
        (lambda v: check_int("n", v), [1, 7, np.int64(3)], [0, -1, True, 2.0, "3", None]),
        (lambda v: check_int("n", v, minimum=0, maximum=3, expected="in [0, 3]"), [0, 3], [-1, 4, False]),
        (lambda v: check_even("rotary_dim", v), [2, 64], [0, 3, -2, True, 4.0]),
        (lambda v: check_bool("flag", v), [True, False], [0, 1, "true", None, np.bool_(True)]),
        (
            lambda v: check_number("x", v, minimum=1),
            [1, 1.5, np.float32(2)],
            [0.99, math.inf, math.nan, True, "2"],
        ),
        (lambda v: check_positive("x", v), [1e-9, 3], [0, -1.0, math.inf, False, "1"]),
        (lambda v: check_fraction("p", v), [1, 0.25], [0, 1.01, -0.5, math.nan, True]),
    ],
)
def test_the_shared_checks_accept_exactly_their_domain_and_name_the_argument(check, good, bad):
    for value in good:
        check(value)
    for value in bad:
        with pytest.raises(ValueError, match=r"^\w+: expected .*, got "):
            check(value)


def test_check_int_returns_a_python_int_and_quotes_the_value():
    assert type(check_int("n", np.int32(5))) is int
    with pytest.raises(ValueError, match=r"rank: expected an integer in \[0, 4\), got 4"):
        check_int("rank", 4, minimum=0, maximum=3, expected="an integer in [0, 4)")


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda: apply_rotary(X, COS, SIN, offsets=2**64),
            r"offsets: expected a non-negative int or an integer tensor, got 18446744073709551616 "
            r"\(past int64",
        ),
        (
            lambda: apply_rotary(X.to(torch.float8_e4m3fn), COS, SIN),
            r"x: expected a float16, bfloat16, float32 or float64 tensor, got dtype torch.float8_e4m3fn",
        ),
        (
            lambda: apply_rotary(X, COS, SIN, positions=torch.full((2, 4), float("nan"))),
            r"positions: expected an integer tensor, got a torch.float32 tensor of shape \(2, 4\)",
        ),
        (
            lambda: apply_rotary(X, COS, SIN, offsets=2**62),
            r"positions: largest position 4611686018427387907 is past the cos/sin table \(table_len 16\)",
        ),
        (
            lambda: apply_rotary_qk(X, X, COS, SIN, inplace=True),
            r"k: inplace=True writes q and k, which share memory",
        ),
        (
            lambda: apply_rotary_qk(X, X[:, :, 1:], COS, SIN, inplace=True),
            r"k: inplace=True writes q and k, which share memory",
        ),
    ],
)
def test_misuse_found_by_users_is_a_one_line_value_error(call, match):
    before = X.clone()
    with pytest.raises(ValueError, match=match) as info:
        call()
    assert "\n" not in str(info.value)
    assert torch.equal(X, before)


def test_views_of_one_packed_buffer_are_not_mistaken_for_shared_memory():
    qkv = torch.randn(2, 5, 3, 4, 8)  # (B, S, 3, H, D): q, k, v slices interleave in memory but never overlap
    q, k = qkv[:, :, 0], qkv[:, :, 1]
    flat = torch.randn(2, 5, (4 + 2 + 2) * 8)  # (B, S, (Hq + 2 Hk) * D), Llama-style fused projection
    fq, fk = flat[..., :32].view(2, 5, 4, 8), flat[..., 32:48].view(2, 5, 2, 8)
    for a, b in ((q, k), (fq, fk)):
        want_a, want_b = apply_rotary_qk(a, b, COS, SIN)
        got_a, got_b = apply_rotary_qk(a, b, COS, SIN, inplace=True)
        assert torch.equal(got_a, want_a) and torch.equal(got_b, want_b)


@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    perm_seed=st.integers(0, 10),
    starts=st.tuples(st.integers(0, 40), st.integers(0, 40)),
    steps=st.lists(st.integers(1, 3), min_size=3, max_size=3),
    same_strides=st.booleans(),
)
def test_shared_memory_check_agrees_with_marking_every_element(shape, perm_seed, starts, steps, same_strides):
    """validation.shares_memory against the brute force: mark one view's elements, look for the other's."""
    from ropekit.validation import shares_memory

    base = torch.zeros(4000)
    g = torch.Generator().manual_seed(perm_seed)
    strides = []
    extent = 1
    for n, step in zip(shape, steps, strict=False):  # nested strides: neither view overlaps itself
        strides.append(extent * step)
        extent = extent * step * n
    strides = [strides[i] for i in torch.randperm(len(shape), generator=g).tolist()]
    other = strides if same_strides else [s + 1 for s in strides]
    a = base.as_strided(shape, strides, starts[0])
    if torch._debug_has_internal_overlap(a) == 1:
        return
    b = base.as_strided(shape, other, starts[1])
    if torch._debug_has_internal_overlap(b) == 1:
        return
    marks = torch.zeros(4000, dtype=torch.bool)
    marks.as_strided(shape, strides, starts[0]).fill_(True)
    want = bool(marks.as_strided(shape, other, starts[1]).any())
    assert shares_memory(a, b) == want


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


_X = torch.randn(1, 4, 2, 16)  # (B, S, H, D) on the CPU
_TABLE = torch.randn(8, 8)
META_ARGUMENTS = {
    "per-token cos": ("cos", lambda: apply_rotary(_X, _meta(1, 4, 8), _meta(1, 4, 8), per_token=True)),
    "table": ("cos", lambda: apply_rotary(_X, _meta(8, 8), _meta(8, 8))),
    "positions": (
        "positions",
        lambda: apply_rotary(_X, _TABLE, _TABLE, positions=_meta(1, 4, dtype=torch.long)),
    ),
    "offsets": ("offsets", lambda: apply_rotary(_X, _TABLE, _TABLE, offsets=_meta(1, dtype=torch.long))),
    "cu_seqlens": (
        "cu_seqlens",
        lambda: apply_rotary(_X[0], _TABLE, _TABLE, cu_seqlens=_meta(2, dtype=torch.long)),
    ),
}


@pytest.mark.parametrize("case", list(META_ARGUMENTS))
def test_a_meta_argument_for_an_input_with_values_is_a_value_error_naming_it(case):
    """Issue 17, repro 7: these raised NotImplementedError ("Cannot copy out of meta tensor")."""
    name, call = META_ARGUMENTS[case]
    with pytest.raises(
        ValueError, match=rf"^{name}: expected a tensor with values, on x's device cpu, got a meta"
    ):
        call()


@pytest.mark.parametrize(("q_heads", "k_heads"), [(32, 8), (8, 32), (4, 4)])
def test_q_and_k_slices_of_one_packed_qkv_buffer_do_not_share_memory(q_heads, k_heads):
    """Views with the same strides but different head counts (GQA q and k of a packed projection): the offset
    between them must be solved with each view's own index range (a wrong sign flagged these as shared)."""
    from ropekit.validation import shares_memory

    head_dim = 16
    qkv = torch.zeros(5, (q_heads + 2 * k_heads) * head_dim)
    q = qkv[:, : q_heads * head_dim].unflatten(-1, (q_heads, head_dim))
    k = qkv[:, q_heads * head_dim : (q_heads + k_heads) * head_dim].unflatten(-1, (k_heads, head_dim))
    assert not shares_memory(q, k) and not shares_memory(k, q)
    wider = qkv[:, : (q_heads + 1) * head_dim].unflatten(-1, (q_heads + 1, head_dim))  # reaches k's head 0
    assert shares_memory(wider, k) and shares_memory(k, wider)


def test_two_storages_over_one_memory_are_one_memory():
    """Issue 24, repro 7: two torch.from_numpy of one array are two storage objects; the overlap is decided
    from addresses, so they share memory where their elements meet, and not where they do not."""
    from ropekit.validation import shares_memory

    memory = np.zeros(64, dtype=np.float32)
    a, b = torch.from_numpy(memory), torch.from_numpy(memory[8:])
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    assert shares_memory(a[:16], b[:4]) and shares_memory(b[:4], a[:16])
    assert not shares_memory(a[:8], b[:4])  # a's first 8 floats end where b begins
    assert shares_memory(a[::2][4:8], b[::2][:2])  # strided views of the two storages meet at float 8


def test_tensors_of_different_dtypes_share_memory_by_bytes():
    """A float32 table read as bytes or as float16 halves overlaps the bytes it occupies, and only those."""
    from ropekit.validation import shares_memory

    x = torch.zeros(4, 8)
    raw = x.view(torch.uint8)  # (4, 32)
    assert shares_memory(x[1], raw[1, 3:4]) and not shares_memory(x[1], raw[2])
    halves = x.view(torch.float16)  # (4, 16)
    assert shares_memory(x[:, 0], halves[:, 1]) and not shares_memory(x[:, 0], halves[:, 2])
    assert not shares_memory(x, torch.zeros(4, 8)) and not shares_memory(x, x.to("meta"))


def test_check_no_alias_allows_only_a_write_in_place_of_its_own_source():
    from ropekit.validation import check_no_alias

    x, table = torch.randn(2, 3, 4, 16), torch.randn(8, 8)
    check_no_alias((("x", x),), (("x", x), ("cos", table)))  # x over x: in place
    check_no_alias((("x", x),), (("x", x.view(2, 3, 4, 16)), ("cos", table)))  # the same elements, a new view
    with pytest.raises(ValueError, match=r"x: it is written and shares memory with x_source"):
        check_no_alias((("x", x),), (("x_source", x),))  # the same memory under another argument's name
    with pytest.raises(ValueError, match=r"x: it is written and shares memory with x"):
        check_no_alias((("x", x[:, :, :2]),), (("x", x[:, :, 1:3]),))  # its own source, shifted
    with pytest.raises(ValueError, match=r"b: the call writes a and b, which share memory"):
        check_no_alias((("a", x), ("b", x[0])), (), optional=False)
    check_no_alias((("x", x), ("k", None)), (("scale", 0.5), ("cos", None)))  # non-tensors are skipped


def test_an_empty_tensor_with_a_stride_0_axis_is_writable_while_compiling_as_in_eager(monkeypatch):
    """Found by the fuzzer: an empty (0, 4, 1, 2) tensor with strides (2, 0, 0, 1) has no elements, so none
    share memory; eager (torch's own overlap query) accepts it and the compiled check must too."""
    from ropekit import validation

    empty = torch.empty(0, 1, 1, 2).expand(0, 4, 1, 2)
    validation.check_writable("k", empty)
    monkeypatch.setattr(validation, "is_compiling", lambda: True)
    validation.check_writable("k", empty)
    with pytest.raises(ValueError, match="k: inplace=True needs a tensor whose elements do not share memory"):
        validation.check_writable("k", torch.empty(1, 1, 2).expand(3, 1, 2))


@pytest.mark.parametrize("numerics", ["exact", "hf", "vllm"])
def test_check_numerics_returns_each_mode(numerics):
    assert check_numerics(numerics) == numerics


@pytest.mark.parametrize("numerics", ["HF", "vLLM", "", None, 0, ("hf",)])
def test_check_numerics_names_the_argument_the_value_and_the_choices(numerics):
    message = r"numerics: expected 'exact' .* 'hf' .* 'vllm' .*, got " + re.escape(repr(numerics))
    with pytest.raises(ValueError, match=message):
        check_numerics(numerics)
