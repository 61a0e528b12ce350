"""Layout conversion of q/k projections: exact inverses, HF's permutation, and unchanged attention scores."""

import numpy as np
import pytest
import torch

from ropekit import reference
from ropekit.convert import half_to_interleaved, interleaved_to_half

HEADS, HEAD_DIM, HIDDEN = 4, 16, 32


def hf_permute(w, n_heads):
    """The permutation in HF's convert_llama_weights_to_hf.py (Meta -> HF), written from its formula."""
    dim1, dim2 = w.shape
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def scores(wq, wk, x, positions, interleaved, rotary_dim=HEAD_DIM):
    """q.k for every head and pair of tokens, rotated with the float64 reference."""
    theta = reference.inv_freq(rotary_dim)
    rotate = reference.rotate_interleaved if interleaved else reference.rotate_half
    q = (x @ wq.T).reshape(len(x), HEADS, HEAD_DIM).numpy()
    k = (x @ wk.T).reshape(len(x), HEADS, HEAD_DIM).numpy()
    q = rotate(q, positions[:, None], theta)
    k = rotate(k, positions[:, None], theta)
    return np.einsum("mhd,nhd->hmn", q, k)


@pytest.mark.parametrize("shape", [(HEADS * HEAD_DIM, HIDDEN), (HEADS * HEAD_DIM,)])
@pytest.mark.parametrize("rotary_dim", [None, 8])
def test_conversions_are_exact_inverses(shape, rotary_dim):
    w = torch.randn(shape)
    half = interleaved_to_half(w, HEADS, rotary_dim=rotary_dim)
    assert not torch.equal(half, w)
    assert torch.equal(half_to_interleaved(half, HEADS, rotary_dim=rotary_dim), w)
    assert torch.equal(interleaved_to_half(half_to_interleaved(w, HEADS), HEADS), w)


def test_matches_hf_conversion_script_permutation():
    w = torch.randn(HEADS * HEAD_DIM, HIDDEN)
    assert torch.equal(interleaved_to_half(w, HEADS), hf_permute(w, HEADS))


def test_bias_follows_weight_rows():
    w, b = torch.randn(HEADS * HEAD_DIM, HIDDEN), torch.randn(HEADS * HEAD_DIM)
    x = torch.randn(3, HIDDEN)
    p = reference.interleaved_to_half_permutation(HEAD_DIM)
    got = x @ interleaved_to_half(w, HEADS).T + interleaved_to_half(b, HEADS)
    want = (x @ w.T + b).view(3, HEADS, HEAD_DIM)[..., p].reshape(3, -1)  # each head's outputs permuted
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("rotary_dim", [HEAD_DIM, 8])
def test_interleaved_rope_on_old_weights_equals_half_rope_on_new_weights(rotary_dim):
    torch.manual_seed(0)
    wq, wk = (
        torch.randn(HEADS * HEAD_DIM, HIDDEN, dtype=torch.float64),
        torch.randn(HEADS * HEAD_DIM, HIDDEN, dtype=torch.float64),
    )
    x = torch.randn(7, HIDDEN, dtype=torch.float64)
    positions = np.array([0, 1, 2, 5, 9, 100, 4000])
    meta = scores(wq, wk, x, positions, interleaved=True, rotary_dim=rotary_dim)
    hf = scores(
        interleaved_to_half(wq, HEADS, rotary_dim=rotary_dim),
        interleaved_to_half(wk, HEADS, rotary_dim=rotary_dim),
        x,
        positions,
        interleaved=False,
        rotary_dim=rotary_dim,
    )
    np.testing.assert_allclose(hf, meta, rtol=1e-12, atol=1e-10)
    # The silent-corruption case: the same weights read with the wrong pairing give different scores.
    wrong = scores(wq, wk, x, positions, interleaved=False, rotary_dim=rotary_dim)
    assert np.abs(wrong - meta).max() > 1e-2


def test_gqa_key_projection_uses_kv_head_count():
    wk = torch.randn(2 * HEAD_DIM, HIDDEN)
    per_head = [interleaved_to_half(wk[h * HEAD_DIM : (h + 1) * HEAD_DIM], 1) for h in range(2)]
    assert torch.equal(interleaved_to_half(wk, 2), torch.cat(per_head))


@pytest.mark.parametrize(
    ("weight", "num_heads", "rotary_dim", "match"),
    [
        (torch.zeros(2, 3, 4), 1, None, "weight"),
        (torch.zeros(10, 4), 3, None, "num_heads"),
        (torch.zeros(8, 4), 0, None, "num_heads"),
        (torch.zeros(8, 4), 2, 3, "rotary_dim"),
        (torch.zeros(8, 4), 2, 6, "rotary_dim"),
    ],
)
def test_bad_arguments_raise(weight, num_heads, rotary_dim, match):
    with pytest.raises(ValueError, match=match):
        interleaved_to_half(weight, num_heads, rotary_dim=rotary_dim)
