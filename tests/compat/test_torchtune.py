"""ropekit.compat.torchtune against the cases of torchtune's own tests.

Follows torchtune 0.6's ``tests/torchtune/modules/test_position_embeddings.py`` (pytorch/torchtune, commit
0e08081: ``TestRotaryPositionEmbedding``) and ``tests/torchtune/models/llama3_1/test_position_embeddings.py``
(commit 3110bf9: ``TestLlama3ScaledRoPE``): the same input (seed 0, x = randn(4, 2048, 32, 128), dim 128,
max_seq_len 4096), the same golden statistics of the output (mean, sum, max) and of the Llama 3.1 cache, and
the same position cases (input_pos None, arange(seq) and arange(seq) expanded to the batch give the same
output). The golden values are torchtune's, which forms its angles in float32; ropekit forms them in float64,
so the sum of 2^25 outputs differs by 0.057 where torchtune allows 1e-5 relative: that check allows 0.1
absolute, and the elementwise checks against ropekit's float64 reference carry the rest. The two golden
forward tests keep torchtune's full size (a few hundred MB, about a second) because statistics of a smaller
input have no published values; the other tests are small.
"""

from __future__ import annotations

import math

import pytest
import torch

from ropekit.compat.torchtune import Llama3ScaledRoPE, RotaryPositionalEmbeddings

from .conftest import NO_DEFAULT, signature_of

GOLDEN = {  # torchtune's EXPECTED_X_OUT_{MEAN, SUM, MAX}
    RotaryPositionalEmbeddings: (6.4543e-05, 2165.7053, 5.4546),
    Llama3ScaledRoPE: (-2.4781e-06, -83.1523, 5.4625),
}


@pytest.fixture(scope="module")
def torchtune_input() -> torch.Tensor:
    torch.manual_seed(0)  # torchtune's set_seed(0) on one process
    return torch.randn(4, 2048, 32, 128)  # (bsz, seq_len, num_heads, head_dim)


@pytest.mark.slow
@pytest.mark.parametrize("cls", [RotaryPositionalEmbeddings, Llama3ScaledRoPE], ids=lambda c: c.__name__)
def test_forward_reproduces_torchtune_golden_statistics(backend, torchtune_input, cls):
    mean, total, top = GOLDEN[cls]
    rope = cls(dim=128, max_seq_len=4096)
    x_out = rope(torchtune_input)
    assert x_out.shape == torchtune_input.shape
    torch.testing.assert_close(x_out.mean(), torch.tensor(mean), atol=1e-5, rtol=1.3e-6)
    torch.testing.assert_close(x_out.max(), torch.tensor(top), atol=1e-4, rtol=1e-5)
    # torchtune's float32 angles move the sum of 2^25 outputs by 0.057 (measured, both modules); 0.1 is 3e-9
    # per output. The elementwise check against the float64 reference is test_rotates_interleaved_pairs_...
    torch.testing.assert_close(x_out.sum(), torch.tensor(total), atol=0.1, rtol=0)
    seq = torchtune_input.shape[1]
    # input_pos covering the whole sequence, shared (seq,) or per sample (bsz, seq): the same output.
    assert torch.equal(rope(torchtune_input, input_pos=torch.arange(seq)), x_out)
    packed = torch.arange(seq).unsqueeze(0).expand(torchtune_input.shape[0], seq)
    assert torch.equal(rope(torchtune_input, input_pos=packed), x_out)


def test_llama3_cache_reproduces_torchtune_golden_statistics():
    """torchtune's test_cache_equality: the (4096, 64, 2) cache has mean 0.1738 and sum 91141.7656."""
    cache = Llama3ScaledRoPE(dim=128, max_seq_len=4096).cache
    assert cache.shape == (4096, 64, 2)
    torch.testing.assert_close(cache.mean(), torch.tensor(0.1738), atol=1e-4, rtol=1.3e-6)
    torch.testing.assert_close(cache.sum(), torch.tensor(91141.7656), atol=1e-4, rtol=1.3e-6)
    assert cache.max() == 1.0


def meta_frequencies(dim, base, scale=None):
    """Meta's llama-models formula, in Python floats: base^(-2i/dim), then Llama 3.1's apply_scaling."""
    freqs = [1.0 / base ** (2 * i / dim) for i in range(dim // 2)]
    if scale is None:
        return freqs
    factor, low, high, old = scale
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(f)
        elif wavelen > old / low:
            out.append(f / factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


@pytest.mark.parametrize("input_pos_kind", ["none", "shared", "per_sample"])
@pytest.mark.parametrize("llama3", [False, True])
def test_rotates_interleaved_pairs_by_meta_frequencies(
    backend, assert_matches_reference, llama3, input_pos_kind
):
    """torchtune pairs (2i, 2i+1), as Meta's LLaMA code does; angles = position * frequency."""
    g = torch.Generator().manual_seed(4)
    bsz, seq, heads, dim = 2, 9, 3, 32
    x = torch.randn(bsz, seq, heads, dim, generator=g)
    if llama3:
        rope, scale = Llama3ScaledRoPE(dim, 64, 500000, 8, 1, 4, 32), (8, 1, 4, 32)
        base = 500000
    else:
        rope, scale, base = RotaryPositionalEmbeddings(dim, 64, 10000), None, 10000
    positions = {
        "none": torch.arange(seq).expand(bsz, seq),
        "shared": torch.tensor([3, 9, 0, 40, 63, 2, 7, 7, 1]).expand(bsz, seq),
        "per_sample": torch.randint(0, 64, (bsz, seq), generator=g),
    }[input_pos_kind]
    input_pos = {"none": None, "shared": positions[0], "per_sample": positions}[input_pos_kind]
    x_before = x.clone()
    out = rope(x, input_pos=input_pos)
    assert torch.equal(x, x_before)
    angles = torch.arange(64, dtype=torch.float64)[:, None] * torch.tensor(meta_frequencies(dim, base, scale))
    assert_matches_reference(out, x, angles.cos(), angles.sin(), positions.numpy(), interleaved=True)
    assert backend.calls > 0


def test_bfloat16_input_keeps_its_dtype_and_trains(backend):
    rope = RotaryPositionalEmbeddings(16, max_seq_len=32)
    x = torch.randn(2, 5, 2, 16, dtype=torch.bfloat16, requires_grad=True)
    out = rope(x)
    assert out.dtype == torch.bfloat16
    (out.float() * out.float()).sum().backward()  # a rotation keeps norms: d/dx |Rx|^2 = 2x
    torch.testing.assert_close(x.grad.float(), 2 * x.detach().float(), atol=0.1, rtol=0.02)


def test_positions_past_max_seq_len_grow_the_table():
    rope = RotaryPositionalEmbeddings(16, max_seq_len=8)
    x = torch.randn(1, 20, 1, 16)
    assert torch.equal(rope(x)[:, :8], RotaryPositionalEmbeddings(16, max_seq_len=32)(x)[:, :8])


def test_errors_name_torchtune_arguments():
    rope = RotaryPositionalEmbeddings(16, max_seq_len=8)
    with pytest.raises(ValueError, match=r"^x: expected shape \(batch, seq, heads, dim = 16\)"):
        rope(torch.randn(1, 4, 2, 8))
    with pytest.raises(ValueError, match=r"^input_pos: expected shape \(batch, seq\)"):
        rope(torch.randn(2, 4, 2, 16), input_pos=torch.arange(3))
    with pytest.raises(ValueError, match=r"^input_pos: expected values >= 0"):
        rope(torch.randn(1, 4, 2, 16), input_pos=torch.tensor([0, 1, -2, 3]))
    with pytest.raises(ValueError, match=r"^max_seq_len: expected a positive int"):
        RotaryPositionalEmbeddings(16, max_seq_len=0)
    with pytest.raises(ValueError, match=r"head_dim|rotary_dim"):
        RotaryPositionalEmbeddings(15)


@pytest.mark.parametrize("base", [10_000, 500_000])
@pytest.mark.parametrize("cls", [RotaryPositionalEmbeddings, Llama3ScaledRoPE], ids=lambda c: c.__name__)
def test_frequencies_are_torchtunes_float32_values_bit_for_bit(cls, base):
    """torchtune: 1 / base ** (arange(0, dim, 2).float() / dim) in float32, then (Llama 3.1) its
    apply_scaling, element by element on float32 scalars."""
    dim = 128
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
    if cls is Llama3ScaledRoPE:
        scaled = []
        for f in freqs:  # 0-d float32 tensors, as in torchtune
            wavelen = 2 * math.pi / f
            if wavelen < 8192 / 4:
                scaled.append(f)
            elif wavelen > 8192 / 1:
                scaled.append(f / 8)
            else:
                smooth = (8192 / wavelen - 1) / (4 - 1)
                scaled.append((1 - smooth) * f / 8 + smooth * f)
        freqs = torch.tensor(scaled, dtype=torch.float32)
    got = cls(dim, 64, base).rope.config.inv_freq()
    assert torch.equal(got.float(), freqs) and torch.equal(got, got.float().double())


def test_signatures_are_torchtunes():
    assert signature_of(RotaryPositionalEmbeddings.__init__) == [
        ("dim", NO_DEFAULT),
        ("max_seq_len", 4096),
        ("base", 10_000),
    ]
    assert signature_of(Llama3ScaledRoPE.__init__) == [
        ("dim", NO_DEFAULT),
        ("max_seq_len", 4096),
        ("base", 10_000),
        ("scale_factor", 8),
        ("low_freq_factor", 1),
        ("high_freq_factor", 4),
        ("old_context_len", 8192),
    ]
    assert signature_of(RotaryPositionalEmbeddings.forward) == [("x", NO_DEFAULT), ("input_pos", None)]
