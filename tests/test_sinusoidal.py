"""The 2017 sinusoidal encoding and the module that adds it to token embeddings."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ropekit import SinusoidalPositionalEmbedding, sinusoidal_embedding
from ropekit import reference as ref


@pytest.mark.parametrize("dim, base", [(4, 10000.0), (64, 10000.0), (10, 500.0)])
def test_sinusoidal_embedding_matches_reference(dim, base):
    positions = torch.tensor([0, 1, 2, 17, 4095])
    got = sinusoidal_embedding(positions, dim, base, dtype=torch.float64)
    # Angles up to 4095 rad: one float64 ulp of the frequency moves them by ~1e-12.
    np.testing.assert_allclose(got.numpy(), ref.sinusoidal(positions.numpy(), dim, base), rtol=0, atol=1e-11)
    assert torch.equal(sinusoidal_embedding(5, dim, base), sinusoidal_embedding(torch.arange(5), dim, base))


def test_sinusoidal_embedding_reproduces_the_textbook_d4_example():
    pe = sinusoidal_embedding(torch.tensor([1, 2]), 4, dtype=torch.float64)
    assert pe[0, 0] == pytest.approx(math.sin(1)) and round(float(pe[0, 0]), 3) == 0.841
    assert pe[1, 0] == pytest.approx(math.sin(2)) and round(float(pe[1, 0]), 3) == 0.909
    assert pe[0, 3] == pytest.approx(math.cos(0.01)) and round(float(pe[0, 3]), 5) == 0.99995
    assert pe[1, 3] == pytest.approx(math.cos(0.02)) and round(float(pe[1, 3]), 4) == 0.9998


def test_module_adds_the_encoding_without_touching_x():
    module = SinusoidalPositionalEmbedding(8, max_len=16)
    x = torch.randn(2, 5, 8)
    before = x.clone()
    out = module(x)
    assert torch.equal(x, before)
    torch.testing.assert_close(out, x + sinusoidal_embedding(5, 8)[None])


def test_module_offsets_shift_positions_per_row_and_the_table_grows():
    module = SinusoidalPositionalEmbedding(8, max_len=4)
    x = torch.zeros(2, 3, 8, dtype=torch.float64)
    out = module(x, offsets=torch.tensor([0, 10]))
    assert module.pe.shape[0] >= 13 and module.pe.dtype == torch.float64
    want = sinusoidal_embedding(torch.tensor([[0, 1, 2], [10, 11, 12]]).flatten(), 8, dtype=torch.float64)
    torch.testing.assert_close(out, want.view(2, 3, 8), rtol=0, atol=0)
    torch.testing.assert_close(module(x, offsets=10)[0], want.view(2, 3, 8)[1], rtol=0, atol=0)


def test_module_table_is_non_persistent_and_output_keeps_dtype():
    module = SinusoidalPositionalEmbedding(8)
    assert module.state_dict() == {}
    out = module(torch.zeros(1, 3, 8, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: sinusoidal_embedding(4, 5), r"dim: expected a positive even integer, got 5"),
        (lambda: sinusoidal_embedding(4, 0), r"dim: expected a positive even integer, got 0"),
        (lambda: sinusoidal_embedding(4, 8, base=1.0), r"base: expected a finite number > 1, got 1.0"),
        (lambda: sinusoidal_embedding(-1, 8), r"positions: expected an int n >= 0, got -1"),
        (
            lambda: sinusoidal_embedding(torch.zeros(2, 2), 8),
            r"positions: expected a 1-D tensor, got shape \(2, 2\)",
        ),
        (
            lambda: sinusoidal_embedding([0, 1], 8),
            r"positions: expected an int or a 1-D tensor, got \[0, 1\]",
        ),
        (lambda: SinusoidalPositionalEmbedding(8, max_len=0), r"max_len: expected a positive integer, got 0"),
        (
            lambda: SinusoidalPositionalEmbedding(8)(torch.zeros(2, 3, 6)),
            r"x: expected a float tensor of shape \(batch, seq, 8\), got a torch.float32 tensor of shape "
            r"\(2, 3, 6\)",
        ),
        (
            lambda: SinusoidalPositionalEmbedding(8)(torch.zeros(2, 3, 8), offsets=-1),
            r"offsets: expected .*non-negative.*, got -1",
        ),
        (
            lambda: SinusoidalPositionalEmbedding(8)(torch.zeros(2, 3, 8), offsets=torch.tensor([1])),
            r"offsets: expected an int or a tensor of shape \(2,\) \(one per batch row\), got shape \(1,\)",
        ),
        (
            lambda: SinusoidalPositionalEmbedding(8)(torch.zeros(2, 3, 8), offsets=torch.tensor([1, -4])),
            r"offsets: expected values >= 0, got a minimum of -4",
        ),
        (
            lambda: SinusoidalPositionalEmbedding(8)(torch.zeros(2, 3, 8), offsets=torch.tensor([1.0, 2.0])),
            r"offsets: expected an int or an integer tensor, got a torch.float32 tensor",
        ),
    ],
)
def test_bad_sinusoidal_arguments_are_rejected(call, match):
    with pytest.raises(ValueError, match=match):
        call()
