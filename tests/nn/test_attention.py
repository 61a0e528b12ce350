"""Attention block: SDPA path vs an explicit reference, GQA, masks, rope swapping, KV cache equivalence."""

import math

import pytest
import torch

from ropekit import RopeConfig, RotaryEmbedding, apply_rotary_qk
from ropekit.nn import Attention

DIM, HEADS, KV_HEADS, HEAD_DIM = 32, 4, 2, 8


def make_block(rope=True, **kw):
    torch.manual_seed(0)
    r = RotaryEmbedding(head_dim=HEAD_DIM, max_position_embeddings=64) if rope else None
    return Attention(DIM, HEADS, KV_HEADS, r, **kw).eval()


def reference_attention(block, x, positions, key_mask=None, causal=True):
    """Textbook attention written from the formula, independent of the block's own code paths."""
    batch, seq, _ = x.shape
    q = block.wq(x).view(batch, seq, HEADS, HEAD_DIM)
    k = block.wk(x).view(batch, seq, KV_HEADS, HEAD_DIM)
    v = block.wv(x).view(batch, seq, KV_HEADS, HEAD_DIM)
    if block.rope is not None:
        q, k = apply_rotary_qk(q, k, block.rope.cos, block.rope.sin, positions=positions)
    out = torch.zeros(batch, seq, HEADS, HEAD_DIM)
    for b in range(batch):
        for h in range(HEADS):
            g = h // (HEADS // KV_HEADS)
            scores = q[b, :, h] @ k[b, :, g].T / math.sqrt(HEAD_DIM)
            allowed = torch.ones(seq, seq, dtype=torch.bool)
            if causal:
                allowed = allowed.tril()
            if key_mask is not None:
                allowed = allowed & key_mask[b][None, :]
            allowed |= torch.eye(seq, dtype=torch.bool)
            out[b, :, h] = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v[b, :, g]
    return block.wo(out.reshape(batch, seq, DIM))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_forward_matches_textbook_attention(causal, rope, masked):
    block = make_block(rope, causal=causal)
    x = torch.randn(2, 10, DIM)
    mask = torch.ones(2, 10, dtype=torch.bool)
    if masked:
        mask[1, :4] = False
    positions = torch.arange(10).expand(2, 10)
    with torch.no_grad():
        want = reference_attention(block, x, positions, mask if masked else None, causal)
        got = block(x, attn_mask=mask if masked else None)
        got_explicit, probs = block(x, attn_mask=mask if masked else None, need_weights=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_explicit, want, atol=1e-5, rtol=1e-5)
    assert probs.shape == (2, HEADS, 10, 10)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, HEADS, 10))
    if causal:
        assert probs.triu(1).abs().max() == 0


def test_offsets_and_positions_agree():
    block = make_block()
    x = torch.randn(2, 6, DIM)
    offsets = torch.tensor([3, 11])
    with torch.no_grad():
        by_offsets = block(x, offsets=offsets)
        by_positions = block(x, positions=offsets[:, None] + torch.arange(6))
        shifted = block(x, offsets=5)
        plain = block(x)
    torch.testing.assert_close(by_offsets, by_positions)
    # Attention depends only on relative positions: a shift of every token changes nothing.
    torch.testing.assert_close(shifted, plain, atol=1e-5, rtol=1e-5)


def test_gqa_equals_multi_head_with_repeated_kv_weights():
    block = make_block()
    mha = Attention(DIM, HEADS, HEADS, block.rope).eval()
    with torch.no_grad():
        mha.wq.weight.copy_(block.wq.weight)
        mha.wo.weight.copy_(block.wo.weight)
        for src, dst in ((block.wk, mha.wk), (block.wv, mha.wv)):
            w = src.weight.view(KV_HEADS, HEAD_DIM, DIM).repeat_interleave(HEADS // KV_HEADS, dim=0)
            dst.weight.copy_(w.reshape(HEADS * HEAD_DIM, DIM))
        x = torch.randn(2, 7, DIM)
        torch.testing.assert_close(block(x), mha(x), atol=1e-5, rtol=1e-5)


def test_rope_swap_takes_effect_without_rebuilding_the_block():
    block = make_block()
    x = torch.randn(1, 40, DIM)
    with torch.no_grad():
        before = block(x)
        block.rope = RotaryEmbedding(
            RopeConfig(HEAD_DIM, scaling={"rope_type": "default"}, max_position_embeddings=64)
        )
        same = block(x)
        block.rope = RotaryEmbedding(head_dim=HEAD_DIM, base=500.0)
        after = block(x)
    torch.testing.assert_close(same, before)
    assert (after - before).abs().max() > 1e-3


def test_rope_layout_bhsd_gives_the_same_result():
    block = make_block()
    x = torch.randn(2, 5, DIM)
    with torch.no_grad():
        want = block(x)
        block.rope = RotaryEmbedding(head_dim=HEAD_DIM, layout="bhsd")
        torch.testing.assert_close(block(x), want)


def test_kv_cache_continues_positions_and_equals_full_forward():
    block = make_block()
    x = torch.randn(2, 9, DIM)
    cache = block.new_kv_cache(2, 16)
    with torch.no_grad():
        full = block(x)
        parts = [block(x[:, :4], kv_cache=cache)] + [
            block(x[:, t : t + 1], kv_cache=cache) for t in range(4, 9)
        ]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)
    assert cache.lengths.tolist() == [9, 9]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(dim=30, n_heads=4), "dim"),
        (dict(dim=32, n_heads=4, n_kv_heads=3), "n_kv_heads"),
        (dict(dim=32, n_heads=0), "n_heads"),
        (dict(dim=32, n_heads=4, rope="yes"), "rope"),
    ],
)
def test_bad_construction_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Attention(**kwargs)


def test_bad_inputs_raise():
    block = make_block()
    with pytest.raises(ValueError, match="x"):
        block(torch.randn(2, 5, DIM + 1))
    with pytest.raises(ValueError, match="attn_mask"):
        block(torch.randn(2, 5, DIM), attn_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask"):
        block(torch.randn(2, 5, DIM), attn_mask=torch.ones(2, 5))
    block.rope = RotaryEmbedding(head_dim=HEAD_DIM, layout="thd")
    with pytest.raises(ValueError, match="layout"):
        block(torch.randn(2, 5, DIM))


def test_attention_probabilities_with_a_cache_cover_only_written_real_slots():
    block = make_block()
    x = torch.randn(2, 5, DIM)
    cache = block.new_kv_cache(2, 8)
    key_mask = torch.ones(2, 8, dtype=torch.bool)
    key_mask[1, 0] = False  # row 1's first token is padding
    with torch.no_grad():
        block(x[:, :4], kv_cache=cache, attn_mask=key_mask)
        y, probs = block(x[:, 4:], kv_cache=cache, attn_mask=key_mask, need_weights=True)
        cache.lengths.fill_(4)
        y_sdpa = block(x[:, 4:], kv_cache=cache, attn_mask=key_mask)
    assert probs.shape == (2, HEADS, 1, 8)
    assert probs[..., 5:].abs().max() == 0  # slots not yet written
    assert probs[1, :, :, 0].abs().max() == 0  # the padding slot
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, HEADS, 1))
    torch.testing.assert_close(y, y_sdpa, atol=1e-5, rtol=1e-5)
