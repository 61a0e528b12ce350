"""RotaryFunction: backward is the inverse rotation (checked by gradcheck), and it saves only tables and
positions."""

from __future__ import annotations

import pytest
import torch

from ropekit import RopeConfig, apply_rotary, apply_rotary_qk


def _inputs(layout, head_dim=6, rotary_dim=4, q_heads=2, k_heads=1):
    cos, sin = RopeConfig(head_dim, rotary_dim=rotary_dim).cos_sin(12, dtype=torch.float64)
    if layout == "thd":
        shape_q, shape_k = (5, q_heads, head_dim), (5, k_heads, head_dim)
        kwargs = {"cu_seqlens": torch.tensor([0, 2, 5]), "offsets": torch.tensor([2, 5])}
    else:
        shape_q, shape_k = (2, 3, q_heads, head_dim), (2, 3, k_heads, head_dim)
        kwargs = {"offsets": torch.tensor([0, 8])}
    q = torch.randn(shape_q, dtype=torch.float64, requires_grad=True)
    k = torch.randn(shape_k, dtype=torch.float64, requires_grad=True)
    return q, k, cos, sin, kwargs


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_gradcheck_float64(layout, interleaved):
    q, k, cos, sin, kwargs = _inputs(layout)
    kw = dict(interleaved=interleaved, **kwargs)
    assert torch.autograd.gradcheck(lambda q, k: apply_rotary_qk(q, k, cos, sin, **kw), (q, k))
    assert torch.autograd.gradcheck(lambda q: apply_rotary(q, cos, sin, **kw), (q,))


def test_gradcheck_through_the_inplace_path():
    q, k, cos, sin, kwargs = _inputs("bshd")
    assert torch.autograd.gradcheck(
        lambda q, k: apply_rotary_qk(q.clone(), k.clone(), cos, sin, inplace=True, **kwargs), (q, k)
    )


def test_gradient_is_the_inverse_rotation():
    """For y = R x, dL/dx = R^T g, and R^T rotates by -theta: rotating g back with sin negated."""
    q, _, cos, sin, kwargs = _inputs("bshd")
    g = torch.randn_like(q)
    apply_rotary(q, cos, sin, **kwargs).backward(g)
    torch.testing.assert_close(q.grad, apply_rotary(g, cos, -sin, **kwargs), rtol=0, atol=1e-15)
    # ... which undoes the forward rotation exactly (up to rounding).
    back = apply_rotary(apply_rotary(q, cos, sin, **kwargs), cos, -sin, **kwargs)
    torch.testing.assert_close(back, q, rtol=0, atol=1e-14)


def test_only_the_output_that_is_used_gets_a_gradient_rule():
    q, k, cos, sin, kwargs = _inputs("bshd")
    _, k_out = apply_rotary_qk(q, k, cos, sin, **kwargs)
    k_out.sum().backward()
    assert torch.count_nonzero(q.grad) == 0  # q's output was unused: zero gradient, not an error
    assert torch.count_nonzero(k.grad) > 0


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_nothing_but_tables_and_positions_is_saved_for_backward(backend):
    q, k = torch.randn(2, 5, 4, 8, requires_grad=True), torch.randn(2, 5, 2, 8, requires_grad=True)
    cos, sin = RopeConfig(8).cos_sin(16)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        apply_rotary_qk(q, k, cos, sin, offsets=torch.tensor([3, 3]), backend=backend)
    assert len(saved) == 3
    assert saved[0] is cos and saved[1] is sin
    assert saved[2].dtype == torch.int64 and saved[2].shape == (2, 5)  # resolved positions, (batch, seq)
    assert all(t.numel() < q.numel() for t in saved)  # no activations


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_an_int_offset_saves_only_the_tables(backend):
    """The int-offset fast path has no positions tensor to save: the offset travels as a number."""
    q, k = torch.randn(2, 5, 4, 8, requires_grad=True), torch.randn(2, 5, 2, 8, requires_grad=True)
    cos, sin = RopeConfig(8).cos_sin(16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        q_out, _ = apply_rotary_qk(q, k, cos, sin, offsets=3, backend=backend)
    assert len(saved) == 2 and saved[0] is cos and saved[1] is sin
    q_out.sum().backward()
    want = apply_rotary(torch.ones_like(q), cos, -sin, offsets=3, backend="torch")  # R(-theta) applied to 1s
    torch.testing.assert_close(q.grad, want)


def test_double_backward_of_the_torch_backend_is_available():
    q, _, cos, sin, kwargs = _inputs("bshd")
    assert torch.autograd.gradgradcheck(lambda q: apply_rotary(q, cos, sin, backend="torch", **kwargs), (q,))
