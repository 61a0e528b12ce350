"""Context parallelism: shard positions; rotation and attention split over 2 gloo processes equal 1 process.

The 2 processes are spawned once for the whole file (a module fixture); each test then checks one property of
what they computed.
"""

import pytest
import torch

from gloo_ranks import run_ranks
from ropekit import RotaryEmbedding
from ropekit.integrations.distributed import (
    all_gather_sequence,
    gathered_kv_attention,
    shard_positions,
    shard_sequence,
)
from ropekit.nn import Attention

WORLD = 2
BATCH, SEQ, DIM, HEADS, KV_HEADS = 2, 16, 32, 4, 2
HEAD_DIM = DIM // HEADS


def make_inputs():
    torch.manual_seed(0)
    rope = RotaryEmbedding(head_dim=HEAD_DIM, base=100.0)  # a small base: far tokens differ a lot
    block = Attention(DIM, HEADS, KV_HEADS, rope).eval()
    q = torch.randn(BATCH, SEQ, HEADS, HEAD_DIM)
    k = torch.randn(BATCH, SEQ, KV_HEADS, HEAD_DIM)
    x = torch.randn(BATCH, SEQ, DIM)
    return block, q, k, x


def sharded_attention(block, x, scheme, rank):
    """The block's forward with the sequence split over the ranks (keys and values all-gathered)."""
    x_local, positions = shard_sequence(x, WORLD, rank, scheme)
    b, s, _ = x_local.shape
    q = block.wq(x_local).view(b, s, HEADS, HEAD_DIM)  # (B, S_r, H, D)
    k = block.wk(x_local).view(b, s, KV_HEADS, HEAD_DIM)
    v = block.wv(x_local).view(b, s, KV_HEADS, HEAD_DIM)
    q, k = block.rope(q, k, positions=positions)
    out = gathered_kv_attention(q, k, v, positions, scheme)  # (B, S_r, H, D)
    return block.wo(out.reshape(b, s, DIM))


def worker(rank):
    block, q, k, x = make_inputs()
    results = {}
    for scheme in ("contiguous", "zigzag"):
        q_local, positions = shard_sequence(q, WORLD, rank, scheme)
        k_local, _ = shard_sequence(k, WORLD, rank, scheme)
        q_rot, k_rot = block.rope(q_local, k_local, positions=positions)
        results[f"rotated_{scheme}"] = (
            all_gather_sequence(q_rot, scheme),
            all_gather_sequence(k_rot, scheme),
        )
        # Rotating with shard-local positions (the bug this module prevents) for contrast.
        q_naive, k_naive = block.rope(q_local, k_local)
        results[f"naive_{scheme}"] = (
            all_gather_sequence(q_naive, scheme),
            all_gather_sequence(k_naive, scheme),
        )
        with torch.no_grad():
            results[f"attention_{scheme}"] = all_gather_sequence(
                sharded_attention(block, x, scheme, rank), scheme
            )
    # Gradients flow back through the gather: each rank gets the gradient of its own shard.
    x_local, _ = shard_sequence(x.clone().requires_grad_(), WORLD, rank, "zigzag")
    x_local = x_local.detach().requires_grad_()
    (all_gather_sequence(x_local, "zigzag") * torch.arange(SEQ)[None, :, None]).sum().backward()
    results["grad"] = x_local.grad
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(worker, tmp_path_factory.mktemp("cp"))


def test_zigzag_positions_balance_chunks():
    assert shard_positions(8, 2, 0, "zigzag").tolist() == [0, 1, 6, 7]
    assert shard_positions(8, 2, 1, "zigzag").tolist() == [2, 3, 4, 5]
    assert shard_positions(8, 2, 1).tolist() == [4, 5, 6, 7]
    # Every position is held exactly once.
    held = torch.cat([shard_positions(24, 3, r, "zigzag") for r in range(3)])
    assert sorted(held.tolist()) == list(range(24))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((10, 4, 0, "contiguous"), "seq_len"),
        ((12, 4, 0, "zigzag"), "seq_len"),
        ((8, 2, 2, "contiguous"), "rank"),
        ((8, 2, 0, "ring"), "scheme"),
        ((0, 2, 0, "contiguous"), "seq_len"),
    ],
)
def test_bad_arguments_raise(args, match):
    with pytest.raises(ValueError, match=match):
        shard_positions(*args)


def test_shard_sequence_carries_given_positions():
    x = torch.arange(2 * 8).view(2, 8)
    positions = torch.arange(8).expand(2, 8) + torch.tensor([[0], [100]])
    shard, pos = shard_sequence(x, 2, 1, "zigzag", positions=positions)
    assert shard.tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert pos.tolist() == [[2, 3, 4, 5], [102, 103, 104, 105]]
    with pytest.raises(ValueError, match="positions"):
        shard_sequence(x, 2, 1, positions=positions[:, :4])


@pytest.mark.parametrize("scheme", ["contiguous", "zigzag"])
def test_sharded_rotation_gathers_to_single_process_result(ranks, scheme):
    block, q, k, _ = make_inputs()
    want_q, want_k = block.rope(q, k)
    for result in ranks:
        got_q, got_k = result[f"rotated_{scheme}"]
        torch.testing.assert_close(got_q, want_q)
        torch.testing.assert_close(got_k, want_k)
        naive_q, _ = result[f"naive_{scheme}"]
        assert (naive_q - want_q).abs().max() > 0.1  # local positions would be wrong


@pytest.mark.parametrize("scheme", ["contiguous", "zigzag"])
def test_attention_split_over_ranks_equals_one_process(ranks, scheme):
    block, _, _, x = make_inputs()
    with torch.no_grad():
        want = block(x)
    for result in ranks:
        torch.testing.assert_close(result[f"attention_{scheme}"], want, atol=1e-5, rtol=1e-5)


def test_gather_backward_returns_each_shards_gradient(ranks):
    for rank, result in enumerate(ranks):
        positions = shard_positions(SEQ, WORLD, rank, "zigzag")
        want = positions.float()[None, :, None].expand(BATCH, -1, DIM)
        torch.testing.assert_close(result["grad"], want * WORLD)
