"""Shared checks for the fused backends (cpu, triton): every layout and position mode vs ropekit.reference.

Not collected by pytest on its own (no ``test_`` prefix); c/test_c_rotary.py and the Triton interpreter cases
use it.
The reference rotation and the dtype tolerances come from the one home, ``tests/rotary_reference.py``; the
names below are re-exported for the files that import them from here.
"""

from __future__ import annotations

import numpy as np
import torch

from ropekit import apply_rotary, apply_rotary_qk
from rotary_reference import assert_matches_reference, reference_rotation, reference_tables, tolerance

__all__ = [
    "MODES",
    "PACKED_LENGTHS",
    "TABLE_LEN",
    "assert_matches_reference",
    "check_gradients",
    "check_matches_reference",
    "check_planned_packed_errors",
    "check_planned_packed_steps",
    "check_planned_positions_errors",
    "check_planned_positions_steps",
    "check_single_tensor",
    "make_inputs",
    "packed_inputs",
    "reference_rotation",
    "tables",
    "tolerance",
]

MODES = ["default", "positions", "offsets_int", "offsets_per_seq", "cu_seqlens", "bhsd"]
TABLE_LEN = 64


def tables(rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos/sin tables (TABLE_LEN, rotary_dim // 2) from the reference frequencies."""
    return reference_tables(rotary_dim, TABLE_LEN)


def make_inputs(mode: str, heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    """Return (x, kwargs for apply_rotary, expected int positions of shape x.shape[:-2]) for one mode."""
    g = torch.Generator().manual_seed(seed)
    batch, seq = 2, 5
    if mode == "cu_seqlens":
        x = torch.randn(7, heads, head_dim, generator=g).to(dtype)  # (total_tokens, heads, head_dim)
        lens = [3, 4]
        cu = torch.tensor([0, 3, 7], dtype=torch.int32)
        off = torch.tensor([2, 9])
        want = np.concatenate([np.arange(n) + int(o) for n, o in zip(lens, off, strict=True)])
        return x, {"cu_seqlens": cu, "offsets": off}, want
    x = torch.randn(batch, seq, heads, head_dim, generator=g).to(dtype)  # (batch, seq, heads, head_dim)
    base = np.arange(seq)[None, :].repeat(batch, 0)  # (batch, seq)
    if mode == "default":
        return x, {}, base
    if mode == "positions":
        pos = torch.randint(0, TABLE_LEN, (batch, seq), generator=g)
        return x, {"positions": pos}, pos.numpy()
    if mode == "offsets_int":
        return x, {"offsets": 7}, base + 7
    if mode == "offsets_per_seq":
        return x, {"offsets": torch.tensor([3, 40])}, base + np.array([[3], [40]])
    if mode == "bhsd":
        # HF's (batch, heads, seq, head_dim) arrives as a transposed, non-contiguous view.
        xt = torch.randn(batch, heads, seq, head_dim, generator=g).to(dtype).transpose(1, 2)
        return xt, {}, base
    raise ValueError(mode)


def check_matches_reference(backend, mode, dtype, interleaved, inplace, partial, q_heads=4, k_heads=2):
    """q and k through apply_rotary_qk equal the reference; out-of-place leaves the inputs untouched."""
    head_dim = 12
    rotary_dim = 8 if partial else head_dim
    cos, sin = tables(rotary_dim)
    q, kw, pos = make_inputs(mode, q_heads, head_dim, dtype, seed=1)
    k, _, _ = make_inputs(mode, k_heads, head_dim, dtype, seed=2)
    q_before, k_before = q.clone(), k.clone()
    kw.update(interleaved=interleaved, inplace=inplace, backend=backend)
    out_q, out_k = apply_rotary_qk(q, k, cos, sin, **kw)
    assert_matches_reference(out_q, q_before, cos, sin, pos, interleaved=interleaved)
    assert_matches_reference(out_k, k_before, cos, sin, pos, interleaved=interleaved)
    if inplace:
        assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    else:
        assert torch.equal(q, q_before) and torch.equal(k, k_before)
    assert out_q.stride() == q.stride()  # the output keeps the input's layout


def check_gradients(backend, mode, interleaved):
    """The backward pass is the reference rotation by -theta of the incoming gradient, for q and k."""
    cos, sin = tables(8)
    q, kw, pos = make_inputs(mode, 4, 12, torch.float32, seed=3)
    k, _, _ = make_inputs(mode, 1, 12, torch.float32, seed=4)
    q.requires_grad_(True)
    k.requires_grad_(True)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    out_q, out_k = apply_rotary_qk(q, k, cos, sin, interleaved=interleaved, backend=backend, **kw)
    ((out_q * gq).sum() + (out_k * gk).sum()).backward()
    assert_matches_reference(q.grad, gq, cos, sin, pos, interleaved=interleaved, conjugate=True)
    assert_matches_reference(k.grad, gk, cos, sin, pos, interleaved=interleaved, conjugate=True)


def check_single_tensor(backend, interleaved):
    """apply_rotary (no k) through the backend equals the reference."""
    cos, sin = tables(12)
    x, kw, pos = make_inputs("positions", 3, 12, torch.float32)
    out = apply_rotary(x, cos, sin, interleaved=interleaved, backend=backend, **kw)
    assert_matches_reference(out, x, cos, sin, pos, interleaved=interleaved)


# Packed batches (cu_seqlens): empty and one-token sequences among others, one sequence alone, a decode
# step of many one-token sequences.
PACKED_LENGTHS = {"mixed": [0, 1, 3, 0, 2], "one": [5], "decode": [1] * 6}


def packed_inputs(lengths, cu_dtype, dtype=torch.float32, q_heads=3, k_heads=1, head_dim=12, seed=7):
    """q (T, q_heads, head_dim), k (T, k_heads, head_dim) and their cu_seqlens (N + 1,) of cu_dtype."""
    g = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    q = torch.randn(tokens, q_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(tokens, k_heads, head_dim, generator=g).to(dtype)
    cu = torch.tensor(np.cumsum([0, *lengths]), dtype=cu_dtype)
    return q, k, cu


def _packed_rows(lengths, offsets) -> np.ndarray:
    """Each token's table row: its index in its sequence plus that sequence's offset (the formula)."""
    per_seq = offsets.tolist() if isinstance(offsets, torch.Tensor) else [offsets] * len(lengths)
    return np.array([off + t for n, off in zip(lengths, per_seq, strict=True) for t in range(n)])


def check_planned_packed_steps(monkeypatch, backend, lengths, form, cu_dtype, inplace, dtype):
    """Three packed (varlen) steps of one shape: the first is checked and plans the key, the next are served
    by the plan, which reads cu_seqlens and the offsets (an int, or one per sequence) in the kernel:
    ``resolve`` never runs again (no positions tensor). Every step equals the float64 reference within the
    dtype's tolerance and the torch backend bit for bit; out of place leaves the inputs untouched."""
    from ropekit import functional

    cos, sin = tables(8)  # rotary_dim 8 of head_dim 12: the tail passes through
    q, k, cu = packed_inputs(lengths, cu_dtype, dtype)
    steps = [4 * step + 1 if form == "int" else torch.arange(len(lengths)) * 7 + step for step in range(3)]
    wants = [apply_rotary_qk(q, k, cos, sin, offsets=off, cu_seqlens=cu, backend="torch") for off in steps]
    for step, offsets in enumerate(steps):
        if step:
            monkeypatch.setattr(functional, "resolve", None)  # a planned step never resolves positions
        q_in, k_in = q.clone(), k.clone()
        got = apply_rotary_qk(
            q_in, k_in, cos, sin, offsets=offsets, cu_seqlens=cu, inplace=inplace, backend=backend
        )
        rows = _packed_rows(lengths, offsets)
        for out, x, want in zip(got, (q, k), wants[step], strict=True):
            assert_matches_reference(out, x, cos, sin, rows, interleaved=False)
            assert torch.equal(out, want)
        assert (got[0].data_ptr() == q_in.data_ptr()) is inplace
        if not inplace:
            assert torch.equal(q_in, q) and torch.equal(k_in, k)


def check_planned_packed_errors(backend, form, cu_dtype):
    """Malformed cu_seqlens, a row past the table or a negative offset, after the key was planned: the plan
    refuses them before anything is written, and the checked path raises exactly its message (the torch
    backend's, which has no packed plan)."""
    cos, sin = tables(8)  # 64 rows
    q, k, cu = packed_inputs([2, 3], cu_dtype)
    good = 3 if form == "int" else torch.tensor([3, 9])
    apply_rotary_qk(q, k, cos, sin, offsets=good, cu_seqlens=cu, inplace=True, backend=backend)  # plans
    before = q.clone()
    bad_calls = [
        (good, [1, 2, 5]),  # does not start at 0
        (good, [0, 3, 2]),  # decreases (and misses T)
        (good, [0, 3, 4]),  # ends before T
        (62 if form == "int" else torch.tensor([3, 62]), [0, 2, 5]),  # a row past the table
    ]
    if form == "per_sequence":  # negative, of a sequence with tokens and of an empty one
        bad_calls += [(torch.tensor([-1, 3]), [0, 2, 5]), (torch.tensor([3, -1]), [0, 5, 5])]
    for offsets, values in bad_calls:
        kw = dict(offsets=offsets, cu_seqlens=torch.tensor(values, dtype=cu_dtype), inplace=True)
        messages = []
        for name in ("torch", backend):
            try:
                apply_rotary_qk(q, k, cos, sin, **kw, backend=name)
            except ValueError as e:
                messages.append(str(e))
        assert len(messages) == 2 and messages[0] == messages[1], (offsets, values, messages)
        assert torch.equal(q, before)


def _positions_inputs(form, dtype=torch.float32, seed=11):
    """q, k and the keyword arguments besides positions of one positions form: "batched" q (B, S, H, D)
    with positions (B, S), "packed" q (T, H, D) with positions (T,) and int32 cu_seqlens."""
    if form == "packed":
        q, k, cu = packed_inputs([2, 0, 3], torch.int32, dtype, seed=seed)
        return q, k, dict(cu_seqlens=cu)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, 3, 12, generator=g).to(dtype)  # (batch, seq, heads, head_dim)
    return q, torch.randn(2, 3, 1, 12, generator=g).to(dtype), {}


def check_planned_positions_steps(monkeypatch, backend, form, inplace, dtype):
    """Three steps with explicit positions of one shape (arbitrary rows: out of order, repeated, the table's
    first and last): the first is checked and plans the key, the next are served by the plan, which hands the
    positions to the kernel (``resolve`` never runs again). Every step equals the float64 reference within
    the dtype's tolerance and the checked path (the torch backend) bit for bit; out of place leaves the
    inputs untouched."""
    from ropekit import functional

    cos, sin = tables(8)  # rotary_dim 8 of head_dim 12: the tail passes through
    q, k, kw = _positions_inputs(form, dtype)
    g = torch.Generator().manual_seed(3)
    steps = [torch.randint(0, TABLE_LEN, q.shape[:-2], generator=g) for _ in range(3)]
    steps[1].view(-1)[:2] = torch.tensor([TABLE_LEN - 1, 0])  # the table's last and first rows
    wants = [apply_rotary_qk(q, k, cos, sin, positions=pos, **kw, backend="torch") for pos in steps]
    for step, pos in enumerate(steps):
        if step:
            monkeypatch.setattr(functional, "resolve", None)  # a planned step never resolves positions
        q_in, k_in = q.clone(), k.clone()
        got = apply_rotary_qk(q_in, k_in, cos, sin, positions=pos, **kw, inplace=inplace, backend=backend)
        for out, x, want in zip(got, (q, k), wants[step], strict=True):
            assert_matches_reference(out, x, cos, sin, pos.numpy(), interleaved=False)
            assert torch.equal(out, want)
        assert (got[0].data_ptr() == q_in.data_ptr()) is inplace
        if not inplace:
            assert torch.equal(q_in, q) and torch.equal(k_in, k)


def check_planned_positions_errors(backend, form):
    """A position past the table or negative (and, packed, malformed cu_seqlens) after the key was planned:
    the plan refuses it before anything is written, and the checked path raises exactly its message (the
    torch backend's, which has no positions plan), in place as out of place."""
    cos, sin = tables(8)  # 64 rows
    q, k, kw = _positions_inputs(form)
    good = torch.arange(q.shape[:-2].numel()).view(q.shape[:-2])
    for inplace in (True, False):  # plans both keys
        apply_rotary_qk(q, k, cos, sin, positions=good, **kw, inplace=inplace, backend=backend)
    before_q, before_k = q.clone(), k.clone()
    bad_calls = []
    for value in (TABLE_LEN, -1, TABLE_LEN + 100):
        pos = good.clone()
        pos.view(-1)[-1] = value
        bad_calls.append((pos, kw))
    if form == "packed":
        bad_calls.append((good, dict(cu_seqlens=torch.tensor([0, 2, 2, 4], dtype=torch.int32))))
        bad_calls.append((good, dict(cu_seqlens=torch.tensor([0, 3, 2, 5], dtype=torch.int32))))
    for pos, extra in bad_calls:
        for inplace in (True, False):
            messages = []
            for name in ("torch", backend):
                try:
                    apply_rotary_qk(q, k, cos, sin, positions=pos, **extra, inplace=inplace, backend=name)
                except ValueError as e:
                    messages.append(str(e))
            assert len(messages) == 2 and messages[0] == messages[1], (pos, extra, messages)
            assert torch.equal(q, before_q) and torch.equal(k, before_k)
