"""RotaryFunction: backward is the inverse rotation (checked by gradcheck), and it saves only tables and
positions."""

from __future__ import annotations

import pytest
import torch

from c_compiler import CPU
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


def _packed_qkv_grads(rotate, inplace, backend, dtype=torch.float64):
    """Gradient of a fixed loss w.r.t. a packed (B, S, 3, H, D) qkv projection whose q and k slices are
    rotated in place (the flash-attn habit) or out of place."""
    torch.manual_seed(0)
    qkv = torch.randn(2, 5, 3, 4, 8, dtype=dtype, requires_grad=True)
    cos, sin = RopeConfig(8).cos_sin(16, dtype=torch.float32)
    weight = torch.randn(2, 5, 3, 4, 8, dtype=dtype)
    x = qkv * 1.0  # a non-leaf buffer: the projection's output
    q, k = x[:, :, 0], x[:, :, 1]  # views of one buffer, (B, S, H, D) each
    out_q, out_k = rotate(q, k, cos, sin, inplace=inplace, backend=backend, offsets=torch.tensor([0, 7]))
    full = x if inplace else torch.stack([out_q, out_k, x[:, :, 2]], 2)
    (full * weight).sum().backward()
    return full.detach(), qkv.grad


def _qk_separately(q, k, cos, sin, **kw):
    return apply_rotary(q, cos, sin, **kw), apply_rotary(k, cos, sin, **kw)


@pytest.mark.parametrize("backend", ["torch", CPU])
@pytest.mark.parametrize("rotate", [apply_rotary_qk, _qk_separately], ids=["apply_rotary_qk", "apply_rotary"])
def test_in_place_rotation_of_packed_qkv_views_trains_like_out_of_place(rotate, backend):
    dtype = torch.float64 if backend == "torch" else torch.float32
    out_in, grad_in = _packed_qkv_grads(rotate, True, backend, dtype)
    out_out, grad_out = _packed_qkv_grads(rotate, False, backend, dtype)
    torch.testing.assert_close(out_in, out_out, rtol=0, atol=0)
    torch.testing.assert_close(grad_in, grad_out, rtol=0, atol=0)  # the same conjugate rotation, same rows


def test_in_place_gradients_equal_out_of_place_gradients_with_an_int_offset():
    cos, sin = RopeConfig(8).cos_sin(32)
    grads = []
    for inplace in (False, True):
        torch.manual_seed(1)
        q = torch.randn(2, 5, 4, 8, requires_grad=True)
        k = torch.randn(2, 5, 2, 8, requires_grad=True)
        out_q, out_k = apply_rotary_qk(q * 1, k * 1, cos, sin, offsets=9, inplace=inplace)
        (out_q.square().sum() + (out_k * torch.arange(8)).sum()).backward()
        grads.append((q.grad, k.grad))
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


@pytest.mark.parametrize("inplace", [False, True])
def test_learnable_tables_train_in_place_and_out_of_place_alike(inplace):
    """In place, the rotation reads a copy of x, so backward still has the values the table gradient needs."""
    cos0, sin0 = RopeConfig(8).cos_sin(16, dtype=torch.float64)
    x0 = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    cos, sin = cos0.clone().requires_grad_(True), sin0.clone().requires_grad_(True)
    out = apply_rotary(x0.clone(), cos, sin, offsets=2, inplace=inplace)
    (out * torch.arange(8)).sum().backward()
    ref_cos, ref_sin = cos0.clone().requires_grad_(True), sin0.clone().requires_grad_(True)
    (apply_rotary(x0, ref_cos, ref_sin, offsets=2) * torch.arange(8)).sum().backward()
    torch.testing.assert_close(cos.grad, ref_cos.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(sin.grad, ref_sin.grad, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda c, s: apply_rotary(x0.clone(), c, s, offsets=2, inplace=True), (cos, sin)
    )


def test_in_place_on_a_leaf_that_requires_grad_is_a_value_error():
    q = torch.randn(1, 3, 2, 8, requires_grad=True)
    cos, sin = RopeConfig(8).cos_sin(4)
    with pytest.raises(ValueError, match=r"x: inplace=True on a leaf tensor that requires grad"):
        apply_rotary(q, cos, sin, inplace=True)
    with torch.no_grad():  # allowed, as for any in-place op on a leaf
        apply_rotary(q, cos, sin, inplace=True)


def test_in_place_on_an_expanded_tensor_is_a_value_error_and_leaves_it_untouched():
    k1 = torch.randn(1, 1, 8, 64)
    before = k1.clone()
    cos, sin = RopeConfig(64).cos_sin(8)
    with pytest.raises(
        ValueError, match=r"x: inplace=True needs a tensor whose elements do not share memory"
    ):
        apply_rotary(k1.expand(1, 4, 8, 64), cos, sin, inplace=True)
    assert torch.equal(k1, before)
    out = apply_rotary(k1.expand(1, 4, 8, 64), cos, sin)  # out of place reads the shared memory: fine
    torch.testing.assert_close(out[0, 1], apply_rotary(k1, cos, sin, offsets=1)[0, 0])


@pytest.mark.parametrize("backend", ["torch", CPU])
def test_in_place_rotation_of_packed_qkv_views_trains_under_torch_compile_fullgraph(backend):
    cos, sin = RopeConfig(16).cos_sin(64)
    qkv = torch.randn(2, 5, 3, 4, 16, requires_grad=True)

    def loss(qkv):
        x = qkv * 1.0
        apply_rotary_qk(x[:, :, 0], x[:, :, 1], cos, sin, offsets=2, inplace=True, backend=backend)
        return (x * x * torch.arange(16)).sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(qkv), qkv)[0]
    want = torch.autograd.grad(loss(qkv), qkv)[0]
    torch.testing.assert_close(got, want)
