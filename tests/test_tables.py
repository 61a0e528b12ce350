"""Per-token and full-width tables (ropekit.tables) through apply_rotary / apply_rotary_qk: read as views."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from c_compiler import CPU
from ropekit import RopeConfig, apply_rotary, apply_rotary_qk
from ropekit.tables import half_width, per_token_table

BACKENDS = ["torch", CPU]


def tables(rows: int, rotary_dim: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(rows, rotary_dim // 2, generator=torch.Generator().manual_seed(seed)) * 6.28
    return angles.cos(), angles.sin()


def full(half: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The full-width form of a half table: cat(f, f) (HF) or f.repeat_interleave(2) (Cohere)."""
    return half.repeat_interleave(2, dim=-1) if interleaved else torch.cat([half, half], dim=-1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("token_shape", ["batch", "shared", "shared_2d", "expanded"])
@pytest.mark.parametrize("width", ["half", "full"])
def test_per_token_rows_equal_a_table_read_at_those_positions(
    assert_matches_reference, backend, interleaved, token_shape, width
):
    g = torch.Generator().manual_seed(1)
    batch, seq, rotary_dim = 3, 5, 8
    x = torch.randn(batch, seq, 4, 12, generator=g)  # (batch, seq, heads, head_dim): partial rotary
    k = torch.randn(batch, seq, 2, 12, generator=g)
    cos, sin = tables(batch * seq, rotary_dim)
    per_token = {
        "batch": (cos.view(batch, seq, -1), sin.view(batch, seq, -1)),
        "shared": (cos[None, :seq], sin[None, :seq]),  # (1, seq, w): one row set for the batch
        "shared_2d": (cos[:seq], sin[:seq]),  # (seq, w)
        "expanded": (cos[None, :seq].expand(batch, -1, -1), sin[None, :seq].expand(batch, -1, -1)),
    }[token_shape]
    if token_shape == "batch":
        pos = np.arange(batch * seq).reshape(batch, seq)
    else:
        pos = np.broadcast_to(np.arange(seq), (batch, seq))
    c, s = per_token
    if width == "full":
        c, s = full(c, interleaved), full(s, interleaved)
    kw = dict(per_token=True, full_width=width == "full", interleaved=interleaved, backend=backend)
    out_q, out_k = apply_rotary_qk(x, k, c, s, **kw)
    assert_matches_reference(out_q, x, cos, sin, pos, interleaved=interleaved)
    assert_matches_reference(out_k, k, cos, sin, pos, interleaved=interleaved)
    assert torch.equal(apply_rotary(x, c, s, **kw), out_q)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_input_takes_one_row_per_token(assert_matches_reference, backend):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 3, 8, generator=g)  # (total_tokens, heads, head_dim)
    cos, sin = tables(7, 8)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    out = apply_rotary(x, full(cos, False), full(sin, False), cu_seqlens=cu, per_token=True, full_width=True,
                       backend=backend)  # fmt: skip
    assert_matches_reference(out, x, cos, sin, np.arange(7), interleaved=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_full_width_rows_table_is_indexed_by_positions(assert_matches_reference, backend):
    """full_width without per_token: an (L, R) duplicated table (HF's old cos_cached) read at positions."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 2, 8, generator=g)
    cos, sin = tables(20, 8)
    positions = torch.randint(0, 20, (2, 4), generator=g)
    out = apply_rotary(
        x, full(cos, False), full(sin, False), positions=positions, full_width=True, backend=backend
    )
    assert_matches_reference(out, x, cos, sin, positions.numpy(), interleaved=False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("inplace", [False, True])
def test_per_token_gradients_are_the_inverse_rotation(assert_matches_reference, backend, inplace):
    g = torch.Generator().manual_seed(4)
    base = torch.randn(2, 5, 3, 8, generator=g)
    leaf = base.clone().requires_grad_()
    x = leaf * 1.0 if inplace else leaf  # in place needs a non-leaf
    cos, sin = tables(10, 8)
    c, s = full(cos, False).view(2, 5, 8), full(sin, False).view(2, 5, 8)
    out = apply_rotary(x, c, s, per_token=True, full_width=True, inplace=inplace, backend=backend)
    upstream = torch.randn(out.shape, generator=g)
    out.backward(upstream)
    pos = np.arange(10).reshape(2, 5)
    assert_matches_reference(leaf.grad, upstream, cos, sin, pos, interleaved=False, conjugate=True)


def test_views_share_the_callers_memory():
    """Nothing is copied: the table rows the kernels get are views of the caller's tensors."""
    cos, sin = tables(6, 8)
    hf_cos = full(cos, False).view(2, 3, 8)  # (batch, seq, rotary_dim)
    half_cos, half_sin = half_width(hf_cos, full(sin, False).view(2, 3, 8), interleaved=False)
    rows_cos, _, positions = per_token_table(half_cos, half_sin, (2, 3), head_dim=8)
    assert rows_cos.data_ptr() == hf_cos.data_ptr() and rows_cos.stride() == (8, 1)
    assert positions.tolist() == [[0, 1, 2], [3, 4, 5]]
    shared_cos, _, shared_pos = per_token_table(cos[:3][None], sin[:3][None], (4, 3), head_dim=8)
    assert shared_cos.data_ptr() == cos.data_ptr() and shared_pos is None  # offset 0: rows read in order
    one_row_cos, _, one_row_pos = per_token_table(half_cos[:1], half_sin[:1], (1, 3), head_dim=8)
    assert one_row_cos.data_ptr() == hf_cos.data_ptr() and one_row_pos is None
    inter, _ = half_width(full(cos, True), full(sin, True), interleaved=True)
    assert inter.stride() == (8, 2) and torch.equal(inter, cos)


def test_per_token_matches_rope_config_tables(assert_matches_reference):
    """HF-style rows built from a RopeConfig at arbitrary position ids rotate like the table at those ids."""
    config = RopeConfig(
        16, 500000.0, scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    )
    positions = torch.tensor([[3, 90, 7], [0, 1, 127]])
    cos, sin = config.cos_sin(positions)  # (2, 3, 8): per-token rows, YaRN's attention scaling inside
    x = torch.randn(2, 3, 2, 16)
    table_cos, table_sin = config.cos_sin(128)
    want = apply_rotary(x, table_cos, table_sin, positions=positions)
    torch.testing.assert_close(apply_rotary(x, cos, sin, per_token=True), want, atol=1e-6, rtol=1e-6)


def test_errors_name_the_argument_and_the_accepted_shapes():
    x = torch.randn(2, 5, 3, 8)
    cos, sin = tables(10, 8)
    rows = cos.view(2, 5, 4), sin.view(2, 5, 4)
    with pytest.raises(ValueError, match=r"^cos: expected per-token rows of shape \(batch, seq, width\)"):
        apply_rotary(x, cos[:4], sin[:4], per_token=True)
    with pytest.raises(ValueError, match=r"^cos: expected per-token rows of shape \(total_tokens, width\)"):
        apply_rotary(x[0], cos, sin, per_token=True, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"^positions: expected None with per_token=True"):
        apply_rotary(x, *rows, per_token=True, positions=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^offsets: expected 0 with per_token=True"):
        apply_rotary(x, *rows, per_token=True, offsets=3)
    with pytest.raises(ValueError, match=r"^cos: a full-width table holds rotary_dim values per row"):
        apply_rotary(x, cos[:, :3], sin[:, :3], full_width=True)
    with pytest.raises(ValueError, match=r"^cos: table width 8 means rotary_dim 16"):
        apply_rotary(x, torch.cat(rows, -1), torch.cat(rows, -1), per_token=True)
    with pytest.raises(ValueError, match=r"^per_token: expected a bool"):
        apply_rotary(x, *rows, per_token=1)
    with pytest.raises(ValueError, match=r"^cos and sin: expected the same shape"):
        apply_rotary(x, rows[0], rows[1][:1], per_token=True)


def _per_token_forms(batch=3, seq=5, rotary_dim=8):
    """Per-token rows of every form plain_tables takes, with each token's row in the flat table."""
    cos, sin = tables(batch * seq, rotary_dim)
    flat = np.arange(batch * seq).reshape(batch, seq)
    shared = np.broadcast_to(np.arange(seq), (batch, seq))
    return (
        cos,
        sin,
        {
            "batch": ((cos.view(batch, seq, -1), sin.view(batch, seq, -1)), flat),
            "shared": ((cos[None, :seq], sin[None, :seq]), shared),
            "shared_2d": ((cos[:seq], sin[:seq]), shared),
            "expanded": (
                (cos[None, :seq].expand(batch, -1, -1), sin[None, :seq].expand(batch, -1, -1)),
                shared,
            ),
        },
    )


@pytest.mark.c_compiler
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("width", ["half", "full"])
@pytest.mark.parametrize("token_shape", ["batch", "shared", "shared_2d", "expanded"])
def test_a_repeated_per_token_call_is_served_by_a_plan_and_equals_the_checked_path(
    monkeypatch, assert_matches_reference, token_shape, width, inplace
):
    """Issue 25: per-token (and full-width) rows, as HF, Liger, Megatron and vLLM's M-RoPE pass them, are
    the plain table plus an int 0 or each batch row's start (tables.plain_tables): the second call is the
    launch plan (no token_tables, no resolve), bit for bit the checked path's answer (plain_tables switched
    off) and the float64 reference's within float32 tolerance."""
    from call_count import ropekit_calls
    from ropekit import functional

    g = torch.Generator().manual_seed(4)
    x, k = torch.randn(3, 5, 4, 12, generator=g), torch.randn(3, 5, 2, 12, generator=g)
    cos, sin, forms = _per_token_forms()
    (c, s), pos = forms[token_shape]
    if width == "full":
        c, s = full(c, False), full(s, False)
    kw = dict(per_token=True, full_width=width == "full", inplace=inplace, backend="cpu")

    def step():
        return apply_rotary_qk(x.clone(), k.clone(), c, s, **kw)

    first = step()
    calls = ropekit_calls(step)
    assert "run" in calls and "token_tables" not in calls and "resolve" not in calls, calls
    planned = step()
    monkeypatch.setattr(functional, "plain_tables", lambda *args, **kwargs: None)
    checked = step()  # the checked path, as every call took it before
    for got, want, again, inp in zip(planned, checked, first, (x, k), strict=True):
        assert torch.equal(got, want) and torch.equal(again, want)
        assert_matches_reference(got, inp, cos, sin, pos, interleaved=False)


def test_plain_tables_takes_only_the_forms_token_tables_certainly_accepts():
    """plain_tables answers the plain form (views of the caller's rows) for the forms it knows, and None
    for anything token_tables would refuse, convert or read differently: the checked path then decides."""
    from ropekit.tables import plain_tables, row_starts

    x = torch.randn(3, 5, 4, 12)
    _, _, forms = _per_token_forms()
    (rows_c, rows_s), _ = forms["batch"]
    plain = dict(per_token=True, full_width=False)
    c, s, off = plain_tables(x, rows_c, rows_s, None, 0, None, False, **plain)
    assert c.shape == (15, 4) and c.data_ptr() == rows_c.data_ptr() and off is row_starts(3, 5, x.device)
    assert torch.equal(off, torch.tensor([0, 5, 10]))
    (shared_c, shared_s), _ = forms["expanded"]
    c, s, off = plain_tables(x, shared_c, shared_s, None, 0, None, False, **plain)
    assert c.shape == (5, 4) and s.data_ptr() == shared_s.data_ptr() and off == 0 and type(off) is int
    wide_c, wide_s = full(rows_c, True), full(rows_s, True)
    c, _, _ = plain_tables(x, wide_c, wide_s, None, 0, None, True, per_token=True, full_width=True)
    assert torch.equal(c, rows_c.reshape(15, 4)) and c.data_ptr() == wide_c.data_ptr()
    refused = {
        "positions": dict(positions=torch.zeros(3, 5, dtype=torch.long)),
        "offsets": dict(offsets=3),
        "offsets tensor": dict(offsets=torch.zeros(3, dtype=torch.long)),
        "bool offsets": dict(offsets=False),
        "a flag not a bool": dict(interleaved=0),
        "per_token not a bool": dict(per_token=1),
        "other shapes": dict(sin=rows_s[:, :4]),
        "integer rows": dict(cos=rows_c.long(), sin=rows_s.long()),
        "rows that need grad": dict(cos=rows_c.clone().requires_grad_()),
        "too wide": dict(x=x[..., :6]),
        "other rows": dict(x=x[:, :4]),
        "3-D x": dict(x=x[0]),
        "not viewable": dict(cos=rows_c.transpose(0, 1).contiguous().transpose(0, 1), sin=rows_s),
        "odd full width": dict(full_width=True, cos=rows_c[..., :3], sin=rows_s[..., :3]),
        "full-width rows not 2-D": dict(per_token=False, full_width=True),
    }
    for name, change in refused.items():
        args = dict(x=x, cos=rows_c, sin=rows_s, positions=None, offsets=0, interleaved=False, **plain)
        args.update(change)
        call = [args.pop(n) for n in ("x", "cos", "sin", "positions", "offsets")]
        flag = args.pop("interleaved")
        assert plain_tables(*call, None, flag, **args) is None, name


@pytest.mark.c_compiler
def test_a_planned_per_token_kind_keeps_the_checked_paths_errors():
    """After a per-token call of a kind was planned, calls of the same layout that token_tables refuses
    still get its messages (plain_tables leaves them to it)."""
    x = torch.randn(2, 5, 3, 8)
    cos, sin = tables(10, 8)
    rows = cos.view(2, 5, 4), sin.view(2, 5, 4)
    apply_rotary(x, *rows, per_token=True, backend="cpu")
    apply_rotary(x, *rows, per_token=True, backend="cpu")  # served by the plan
    with pytest.raises(ValueError, match=r"^offsets: expected 0 with per_token=True"):
        apply_rotary(x, *rows, per_token=True, offsets=3, backend="cpu")
    with pytest.raises(ValueError, match=r"^positions: expected None with per_token=True"):
        apply_rotary(x, *rows, per_token=True, positions=torch.zeros(2, 5, dtype=torch.long), backend="cpu")
    with pytest.raises(ValueError, match=r"^per_token: expected a bool"):
        apply_rotary(x, *rows, per_token=1, backend="cpu")
