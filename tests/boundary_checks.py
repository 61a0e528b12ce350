"""Checks every backend must pass at the functional boundary, shared by the torch / cpu tests and the
Triton interpreter cases (tests/backends/triton_boundary_cases.py). Import from here (pytest puts tests/ on
sys.path).

- Every in-place path bumps the version counter of what it wrote, as a PyTorch in-place op does, so backward
  through a graph that saved the old value raises instead of returning a wrong gradient (issue 17's repro:
  ``rope(x, inplace=True)`` after ``(x * w).sum()``).
- ``inverse=True`` and ``rotary_position="last"`` (issue 18) against the float64 reference, with gradients.
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
    "check_inverse_undoes_forward",
    "check_rotary_last",
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
