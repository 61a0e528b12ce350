"""Shared checks for the fused backends (cpu, triton): every layout and position mode vs ropekit.reference.

Not collected by pytest on its own (no ``test_`` prefix); test_cpu.py and the Triton interpreter cases use it.
"""

from __future__ import annotations

import numpy as np
import torch

from ropekit import apply_rotary, apply_rotary_qk, reference

MODES = ["default", "positions", "offsets_int", "offsets_per_seq", "cu_seqlens", "bhsd"]
# Tolerance per storage dtype: a few ulps of the output plus float32 math error.
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
TABLE_LEN = 64


def tables(rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos/sin tables (TABLE_LEN, rotary_dim // 2) from the reference frequencies."""
    angle = np.arange(TABLE_LEN)[:, None] * reference.inv_freq(rotary_dim)[None, :]
    return torch.from_numpy(np.cos(angle)).float(), torch.from_numpy(np.sin(angle)).float()


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


def expected(x: torch.Tensor, pos: np.ndarray, cos, sin, interleaved: bool, conjugate: bool = False):
    """The float64 reference rotation of x (conjugate: rotate by -theta, the backward pass)."""
    c, s = cos.double().numpy(), (-sin if conjugate else sin).double().numpy()
    return torch.from_numpy(reference.apply_tables(x.double().numpy(), c, s, pos, interleaved))


def check_matches_reference(backend, mode, dtype, interleaved, inplace, partial, q_heads=4, k_heads=2):
    """q and k through apply_rotary_qk equal the reference; out-of-place leaves the inputs untouched."""
    head_dim = 12
    rotary_dim = 8 if partial else head_dim
    cos, sin = tables(rotary_dim)
    q, kw, pos = make_inputs(mode, q_heads, head_dim, dtype, seed=1)
    k, _, _ = make_inputs(mode, k_heads, head_dim, dtype, seed=2)
    q_before, k_before = q.clone(), k.clone()
    want_q = expected(q, pos, cos, sin, interleaved)
    want_k = expected(k, pos, cos, sin, interleaved)
    kw.update(interleaved=interleaved, inplace=inplace, backend=backend)
    out_q, out_k = apply_rotary_qk(q, k, cos, sin, **kw)
    tol = TOL[dtype]
    torch.testing.assert_close(out_q.double(), want_q, atol=tol, rtol=tol)
    torch.testing.assert_close(out_k.double(), want_k, atol=tol, rtol=tol)
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
    want_q = expected(gq, pos, cos, sin, interleaved, conjugate=True)
    want_k = expected(gk, pos, cos, sin, interleaved, conjugate=True)
    torch.testing.assert_close(q.grad.double(), want_q, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(k.grad.double(), want_k, atol=2e-5, rtol=2e-5)


def check_single_tensor(backend, interleaved):
    """apply_rotary (no k) through the backend equals the reference."""
    cos, sin = tables(12)
    x, kw, pos = make_inputs("positions", 3, 12, torch.float32)
    out = apply_rotary(x, cos, sin, interleaved=interleaved, backend=backend, **kw)
    torch.testing.assert_close(out.double(), expected(x, pos, cos, sin, interleaved), atol=2e-5, rtol=2e-5)
