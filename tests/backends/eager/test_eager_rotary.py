"""The plain torch backend's contract (ropekit.backends.base): rotate, conjugate, inplace, k optional."""

from __future__ import annotations

import pytest
import torch

from ropekit import RopeConfig
from ropekit.backends.eager.backend import EagerBackend
from ropekit.backends.eager.rotary import rotate

COS, SIN = RopeConfig(10, rotary_dim=6).cos_sin(8, dtype=torch.float64)
POSITIONS = torch.tensor([[0, 3, 7], [1, 1, 2]])  # (batch, seq)


def test_conjugate_rotation_undoes_the_rotation():
    x = torch.randn(2, 3, 4, 10, dtype=torch.float64)
    for interleaved in (False, True):
        kw = dict(interleaved=interleaved, inplace=False)
        y = rotate(x, COS, SIN, POSITIONS, conjugate=False, **kw)
        back = rotate(y, COS, SIN, POSITIONS, conjugate=True, **kw)
        torch.testing.assert_close(back, x, rtol=0, atol=1e-15)
        assert not torch.equal(y[..., :6], x[..., :6]) and torch.equal(y[..., 6:], x[..., 6:])


def test_inplace_returns_the_input_and_leaves_the_tail():
    x = torch.randn(2, 3, 4, 10, dtype=torch.float64)
    tail = x[..., 6:].clone()
    expected = rotate(x, COS, SIN, POSITIONS, interleaved=True, conjugate=False, inplace=False)
    out = rotate(x, COS, SIN, POSITIONS, interleaved=True, conjugate=False, inplace=True)
    assert out is x and torch.equal(x, expected) and torch.equal(x[..., 6:], tail)


def test_strided_input_gives_an_output_of_the_same_values_as_contiguous():
    x = torch.randn(2, 4, 3, 10, dtype=torch.float64).transpose(1, 2)  # (B, S, H, D) view of (B, H, S, D)
    got = rotate(x, COS, SIN, POSITIONS, interleaved=False, conjugate=False, inplace=False)
    want = rotate(x.contiguous(), COS, SIN, POSITIONS, interleaved=False, conjugate=False, inplace=False)
    assert torch.equal(got, want)


def test_backend_serves_everything_and_k_is_optional():
    backend = EagerBackend()
    q = torch.randn(2, 3, 4, 10, dtype=torch.float64)
    assert backend.name == "torch" and backend.unavailable_reason(q, COS) is None
    q_out, k_out = backend.rotate_qk(
        q, None, COS, SIN, POSITIONS, interleaved=False, conjugate=False, inplace=False
    )
    assert k_out is None and q_out.shape == q.shape


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_peer_numerics_round_after_each_op_in_the_inputs_dtype(dtype):
    cos, sin = COS.float(), SIN.float()
    x = (8 * torch.randn(2, 3, 4, 10)).to(dtype)
    got = rotate(x, cos, sin, POSITIONS, interleaved=False, conjugate=False, inplace=False, numerics="hf")
    c, s = cos[POSITIONS].to(dtype).unsqueeze(-2), sin[POSITIONS].to(dtype).unsqueeze(-2)
    a, b = x[..., :3], x[..., 3:6]
    want = torch.cat((a * c - b * s, b * c + a * s, x[..., 6:]), -1)  # each op in dtype: PyTorch's rounding
    assert torch.equal(got, want)
    exact = rotate(x, cos, sin, POSITIONS, interleaved=False, conjugate=False, inplace=False)
    assert not torch.equal(got, exact)
