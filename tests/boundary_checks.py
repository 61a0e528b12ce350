"""Checks every backend must pass at the functional boundary, shared by the torch / cpu tests and the
Triton interpreter cases (tests/backends/triton_boundary_cases.py). Import from here (pytest puts tests/ on
sys.path).

- Every in-place path bumps the version counter of what it wrote, as a PyTorch in-place op does, so backward
  through a graph that saved the old value raises instead of returning a wrong gradient (issue 17's repro:
  ``rope(x, inplace=True)`` after ``(x * w).sum()``).
- ``inverse=True`` and ``rotary_position="last"`` (issue 18) against the float64 reference, with gradients.
- The memory rule and PyTorch's in-place refusals (issue 24): a written tensor that shares memory with a table
  it reads, q and k that alias through two storages of one memory, a view of a leaf that requires grad, an
  inference tensor outside inference mode: each an error before anything is written, checked and planned.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

import ropekit
from ropekit.compat import flash_attn, vllm
from rotary_reference import assert_matches_reference, reference_tables, tolerance

__all__ = [
    "COMPAT_ENTRIES",
    "CORE_ENTRIES",
    "assert_autograd_sees_the_write",
    "assert_planned_write_bumps_the_version",
    "check_aliasing_storages_are_refused_when_planned",
    "check_inference_tensor_is_refused_before_writing",
    "check_inverse_undoes_forward",
    "check_rotary_last",
    "check_table_aliasing_the_input_is_refused",
    "check_view_of_a_leaf_is_refused_before_writing",
]

D = 16  # head_dim
BSHD = (1, 4, 2, D)  # (batch, seq, heads, head_dim)


def _tables() -> tuple[torch.Tensor, torch.Tensor]:
    return ropekit.RopeConfig(head_dim=D).cos_sin(8)  # (8, D / 2) each


def _apply_rotary(x: torch.Tensor, backend: str) -> None:
    ropekit.apply_rotary(x, *_tables(), inplace=True, backend=backend)


def _apply_rotary_qk(x: torch.Tensor, backend: str) -> None:
    ropekit.apply_rotary_qk(x[:, :, :1], x[:, :, 1:], *_tables(), inplace=True, backend=backend)


def _module(x: torch.Tensor, backend: str) -> None:
    ropekit.RotaryEmbedding(head_dim=D, backend=backend)(x, inplace=True)


def _inverse(x: torch.Tensor, backend: str) -> None:
    ropekit.apply_rotary(x, *_tables(), inplace=True, backend=backend, inverse=True)


def _nope_first(x: torch.Tensor, backend: str) -> None:
    cos, sin = _tables()
    ropekit.apply_rotary(x, cos[:, :4], sin[:, :4], inplace=True, backend=backend, rotary_position="last")


def _flash_attn(x: torch.Tensor, backend: str) -> None:
    flash_attn.apply_rotary_emb(x, *_tables(), inplace=True)


def _flash_attn_qkv(qkv: torch.Tensor, backend: str) -> None:
    flash_attn.apply_rotary_emb_qkv_(qkv, *_tables())


def _flash_attn_kv(kv: torch.Tensor, backend: str) -> None:
    flash_attn.apply_rotary_emb_kv_(kv, *_tables())


def _vllm(x: torch.Tensor, backend: str) -> None:
    cache = torch.cat(_tables(), dim=-1)  # (8, D): [cos | sin]
    query, key = x[0, :, 0], x[0, :, 1]  # (tokens, head_size) views of x
    vllm.rotary_embedding(torch.arange(4), query, key, D, cache, True)


# name -> (the shape of x, a function writing into x in place through that entry point on a backend).
CORE_ENTRIES: dict[str, tuple[tuple[int, ...], Callable[[torch.Tensor, str], None]]] = {
    "apply_rotary": (BSHD, _apply_rotary),
    "apply_rotary_qk": (BSHD, _apply_rotary_qk),
    "RotaryEmbedding.forward": (BSHD, _module),
    "apply_rotary(inverse=True)": (BSHD, _inverse),
    "apply_rotary(rotary_position='last')": (BSHD, _nope_first),
}
# Peers' in-place functions (backend "auto": they take no backend argument here).
COMPAT_ENTRIES: dict[str, tuple[tuple[int, ...], Callable[[torch.Tensor, str], None]]] = {
    "flash_attn.apply_rotary_emb": (BSHD, _flash_attn),
    "flash_attn.apply_rotary_emb_qkv_": ((1, 4, 3, 2, D), _flash_attn_qkv),
    "flash_attn.apply_rotary_emb_kv_": ((1, 4, 2, 2, D), _flash_attn_kv),
    "vllm.rotary_embedding": (BSHD, _vllm),
}


def assert_autograd_sees_the_write(shape: tuple[int, ...], entry: Callable[[torch.Tensor, str], None],
                                   backend: str) -> None:  # fmt: skip
    """x saved by autograd (for w's gradient), then written in place: x's version moves on and backward
    raises PyTorch's in-place error, exactly as after ``x.mul_(2)``."""
    x = torch.randn(shape)
    w = torch.randn(shape, requires_grad=True)
    y = (x * w).sum()
    before = x._version
    entry(x, backend)
    assert x._version > before, "the in-place write left x's version counter unchanged"
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def assert_planned_write_bumps_the_version(shape: tuple[int, ...], entry: Callable[[torch.Tensor, str], None],
                                           backend: str) -> None:  # fmt: skip
    """As :func:`assert_autograd_sees_the_write`, for a call served by a launch plan: a first call of the same
    kind (shape, strides, tables, flags) plans it, so the second runs the plan's own launch and bump."""
    entry(torch.randn(shape), backend)  # checked in full; plans this kind of call
    assert_autograd_sees_the_write(shape, entry, backend)


def check_table_aliasing_the_input_is_refused(backend: str) -> None:
    """Issue 24, repro 1: in place with cos a view of x. The C loop stored the first half of a row, then read
    the table (now overwritten) for the second half: off by 6.3. A ValueError naming x and cos, x untouched,
    on the checked path and on a planned one."""
    x = torch.randn(1, 4, 1, 16)  # (batch, seq, heads, head_dim)
    table = torch.randn(4, 16)[:, :8]  # the strides of x[0, :, 0, :8]: this call plans the kind refused below
    ropekit.apply_rotary(torch.randn(1, 4, 1, 16), table, torch.zeros(4, 8), inplace=True, backend=backend)
    for _ in range(2):
        before = x.clone()
        with pytest.raises(ValueError, match=r"x: it is written and shares memory with cos"):
            ropekit.apply_rotary(x, x[0, :, 0, :8], torch.zeros(4, 8), inplace=True, backend=backend)
        assert torch.equal(x, before)
    q, k = torch.randn(1, 4, 2, 16), torch.randn(1, 4, 1, 16)
    with pytest.raises(ValueError, match=r"k: it is written and shares memory with sin"):
        ropekit.apply_rotary_qk(q, k, torch.ones(4, 8), k[0, :, 0, 8:], inplace=True, backend=backend)
    out = ropekit.apply_rotary(x, x[0, :, 0, :8], torch.zeros(4, 8), backend=backend)  # out of place: fine
    want = ropekit.apply_rotary(x, x[0, :, 0, :8].clone(), torch.zeros(4, 8), backend="torch")
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def check_aliasing_storages_are_refused_when_planned(backend: str) -> None:
    """Issue 24, repro 7: q and k from two storages over one memory (two ``torch.from_numpy`` of one array,
    at different starts) that share elements. The overlap was decided by storage identity and the answer kept
    per byte distance: the pair passed once, and then so did the same overlap within one storage."""
    cos, sin = ropekit.RopeConfig(D).cos_sin(64)
    memory = np.random.default_rng(0).standard_normal(2 * 3 * 8 * D).astype(np.float32)
    whole = torch.from_numpy(memory).view(2, 3, 8, D)  # (batch, seq, heads, head_dim)
    later = torch.from_numpy(memory[2 * D :]).view(-1)  # a second storage, from head 2 of token 0 on
    k_other = later.as_strided((2, 3, 4, D), whole.stride())  # heads 2..5 of every token, through it
    kw = dict(offsets=1, inplace=True, backend=backend)
    ropekit.apply_rotary_qk(whole[:, :, :4], whole[:, :, 4:], cos, sin, **kw)  # disjoint: planned
    ropekit.apply_rotary_qk(whole[:, :, :4], whole[:, :, 4:], cos, sin, **kw)  # served by the plan
    before = memory.copy()
    for k in (k_other, whole[:, :, 2:6]):  # the same overlap, through the second storage, then within one
        with pytest.raises(ValueError, match=r"k: inplace=True writes q and k, which share memory"):
            ropekit.apply_rotary_qk(whole[:, :, :4], k, cos, sin, **kw)
        assert np.array_equal(memory, before)


def check_view_of_a_leaf_is_refused_before_writing(backend: str) -> None:
    """Issue 24: in place on a slice of a leaf that requires grad rotated the leaf, then raised (autograd's
    check ran after the kernel). PyTorch refuses it before writing, with a RuntimeError; so does ropekit (an
    error that is both that RuntimeError and a ValueError), and the leaf keeps its values."""
    cos, sin = ropekit.RopeConfig(D).cos_sin(64)
    x = torch.randn(2, 3, 4, D, requires_grad=True)
    before = x.detach().clone()
    with pytest.raises(RuntimeError, match=r"x: a view of a leaf tensor that requires grad") as info:
        ropekit.apply_rotary(x[:, :, :2], cos, sin, inplace=True, backend=backend)
    assert isinstance(info.value, ValueError)
    assert torch.equal(x.detach(), before)
    with pytest.raises(RuntimeError, match="a view of a leaf Variable"):  # PyTorch's own rule, for comparison
        x[:, :, :2].mul_(2)
    with torch.no_grad():  # allowed there, as for PyTorch
        ropekit.apply_rotary(x[:, :, :2], cos, sin, inplace=True, backend=backend)
    assert not torch.equal(x.detach(), before)


def check_inference_tensor_is_refused_before_writing(backend: str) -> None:
    """Issue 24: the cpu backend rotated inference tensors in place outside inference mode, where PyTorch
    raises; the torch backend wrote, then raised. Now refused before writing, checked or planned; inside
    inference mode the write is allowed, as for PyTorch."""
    cos, sin = ropekit.RopeConfig(D).cos_sin(64)
    with torch.inference_mode():
        x = torch.randn(2, 3, 4, D)
    ropekit.apply_rotary(torch.randn(2, 3, 4, D), cos, sin, inplace=True, offsets=1, backend=backend)
    for _ in range(2):  # the first call finds a plan for this kind (made above), then the checked path
        before = x.clone()
        with pytest.raises(RuntimeError, match=r"x: an inference tensor .* outside inference mode"):
            ropekit.apply_rotary(x, cos, sin, inplace=True, offsets=1, backend=backend)
        assert torch.equal(x, before)
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        x.mul_(2)  # PyTorch's own rule, for comparison
    with torch.inference_mode():
        want = ropekit.apply_rotary(x, cos, sin, offsets=1, backend=backend)
        got = ropekit.apply_rotary(x, cos, sin, inplace=True, offsets=1, backend=backend)
    assert got is x and torch.equal(x, want)


def _case(seed: int = 0):
    """x (2, 5, 3, 16), tables (64, 4) (R = 8 of D = 16: a position-free half), positions offsets 3."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, 3, D, generator=g)  # (batch, seq, heads, head_dim)
    cos, sin = reference_tables(8, 64)
    return x, cos, sin, np.arange(5)[None, :].repeat(2, 0) + 3


def check_inverse_undoes_forward(backend: str, inplace: bool, interleaved: bool) -> None:
    """inverse=True rotates by -theta: the reference's conjugate, it undoes the forward rotation to rounding,
    and its gradient is the rotation by +theta."""
    x, cos, sin, positions = _case()
    kw = dict(offsets=3, interleaved=interleaved, backend=backend)
    y = ropekit.apply_rotary(x.clone(), cos, sin, inplace=inplace, **kw)
    back = ropekit.apply_rotary(y, cos, sin, inplace=inplace, inverse=True, **kw)
    torch.testing.assert_close(back, x, **tolerance(torch.float32, 4.0))
    q, k = x.clone(), x[:, :, :1].clone()
    out_q, out_k = ropekit.apply_rotary_qk(q, k, cos, sin, inplace=inplace, inverse=True, **kw)
    assert_matches_reference(out_q, x, cos, sin, positions, interleaved=interleaved, conjugate=True)
    assert_matches_reference(out_k, x[:, :, :1], cos, sin, positions, interleaved=interleaved, conjugate=True)
    leaf = x.clone().requires_grad_()
    grad = torch.randn_like(x)
    start = leaf.clone() if inplace else leaf  # a leaf that requires grad is never written in place
    ropekit.apply_rotary(start, cos, sin, inplace=inplace, inverse=True, **kw).backward(grad)
    assert_matches_reference(leaf.grad, grad, cos, sin, positions, interleaved=interleaved)


def check_rotary_last(backend: str, inplace: bool, interleaved: bool) -> None:
    """rotary_position="last": the last R features rotate (NoPE first), the first D - R pass through; the
    gradient is the same split with the conjugate rotation."""
    x, cos, sin, positions = _case(1)
    nope = D - 2 * cos.shape[1]
    kw = dict(offsets=3, interleaved=interleaved, backend=backend, rotary_position="last")
    k_in = x[:, :, :1].clone()
    out_q, out_k = ropekit.apply_rotary_qk(x.clone(), k_in.clone(), cos, sin, inplace=inplace, **kw)
    for got, src in ((out_q, x), (out_k, k_in)):
        assert torch.equal(got[..., :nope], src[..., :nope])
        assert_matches_reference(
            got[..., nope:], src[..., nope:], cos, sin, positions, interleaved=interleaved
        )
    leaf = x.clone().requires_grad_()
    grad = torch.randn_like(x)
    start = leaf.clone() if inplace else leaf
    ropekit.apply_rotary(start, cos, sin, inplace=inplace, **kw).backward(grad)
    assert torch.equal(leaf.grad[..., :nope], grad[..., :nope])
    assert_matches_reference(leaf.grad[..., nope:], grad[..., nope:], cos, sin, positions,
                             interleaved=interleaved, conjugate=True)  # fmt: skip
