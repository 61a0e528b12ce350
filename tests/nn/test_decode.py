"""The reference decode loop: a left-padded batch decoded token by token equals the full forward pass."""

import pytest
import torch

from ropekit import RotaryEmbedding
from ropekit.nn import Attention, incremental_forward, left_pad, padding_positions


def test_left_pad_and_positions():
    padded, mask = left_pad([torch.tensor([5, 6, 7]), torch.tensor([8])], pad_value=-1)
    assert padded.tolist() == [[5, 6, 7], [-1, -1, 8]]
    assert mask.tolist() == [[True, True, True], [False, False, True]]
    assert padding_positions(mask).tolist() == [[0, 1, 2], [0, 0, 0]]


@pytest.mark.parametrize("prompt_len", [1, 5, 12])
def test_incremental_decoding_of_left_padded_batch_equals_full_forward(prompt_len):
    torch.manual_seed(0)
    block = Attention(32, 4, 2, RotaryEmbedding(head_dim=8, max_position_embeddings=64)).eval()
    x, mask = left_pad([torch.randn(n, 32) for n in (12, 7, 2)])
    with torch.no_grad():
        full = block(x, positions=padding_positions(mask), attn_mask=mask)
        inc = incremental_forward(block, x, prompt_len=prompt_len, attn_mask=mask, max_len=20)
    torch.testing.assert_close(inc[mask], full[mask], atol=1e-5, rtol=1e-5)
    # Row 2's two real tokens see only each other: the padding really is masked out.
    with torch.no_grad():
        alone = block(x[2:, -2:])
    torch.testing.assert_close(inc[2, -2:], alone[0], atol=1e-5, rtol=1e-5)


def test_bad_arguments_raise():
    block = Attention(8, 2)
    with pytest.raises(ValueError, match="prompt_len"):
        incremental_forward(block, torch.randn(1, 3, 8), prompt_len=0)
    with pytest.raises(ValueError, match="max_len"):
        incremental_forward(block, torch.randn(1, 3, 8), prompt_len=1, max_len=2)
    with pytest.raises(ValueError, match="sequences"):
        left_pad([])
    with pytest.raises(ValueError, match="mask"):
        padding_positions(torch.ones(2, 3))
