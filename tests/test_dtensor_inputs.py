"""The core's DTensor side: the placements positions follow, the placement checks, and no torch.distributed
import for plain tensors. (Rotations of real DTensors: tests/integrations/test_dtensor.py.)"""

import subprocess
import sys

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from ropekit.dtensor_inputs import (
    POSITIONS,
    ROTATED,
    TABLE,
    check_placements,
    is_dtensor,
    local,
    positions_placements,
    shards_tokens,
)

ROLES = (ROTATED, ROTATED, TABLE, TABLE, POSITIONS)


@pytest.mark.parametrize(
    ("q_placements", "q_dim", "expected"),
    [
        ((Shard(0),), 4, (Shard(0),)),  # batch: positions sharded on batch too
        ((Shard(1),), 4, (Shard(1),)),  # tokens
        ((Shard(2),), 4, (Replicate(),)),  # heads: every head of a token needs the token's row
        ((Shard(-2),), 4, (Replicate(),)),  # heads, counted from the end
        ((Shard(0), Shard(2)), 4, (Shard(0), Replicate())),  # data x tensor parallel
        ((Shard(0),), 3, (Shard(0),)),  # packed (tokens, heads, head_dim): tokens
        ((Shard(1),), 3, (Replicate(),)),  # packed: heads
        ((Replicate(),), 4, (Replicate(),)),
        ((Shard(3),), 4, None),  # head_dim: no placement of positions matches
        ((Partial(),), 4, None),
    ],
)
def test_positions_follow_q_on_batch_and_tokens_and_are_replicated_across_heads(
    q_placements, q_dim, expected
):
    assert positions_placements(q_placements, q_dim) == expected


def test_only_the_token_axis_counts_as_sharding_tokens():
    assert shards_tokens((Shard(1),), 4) and shards_tokens((Shard(0),), 3)
    assert not shards_tokens((Shard(0),), 4) and not shards_tokens((Shard(2), Replicate()), 4)


def test_placements_that_rotate_locally_pass_and_return_q_and_the_positions_placements():
    placed = ((Shard(1),), (Shard(1),), (Replicate(),), (Replicate(),), (Shard(1),))
    assert check_placements("op", ROLES, placed, 4) == ((Shard(1),), (Shard(1),))
    heads = ((Shard(2),), None, (Replicate(),), (Replicate(),), None)  # no k, no positions: heads only
    assert check_placements("op", ROLES, heads, 4) == ((Shard(2),), (Replicate(),))


@pytest.mark.parametrize(
    ("placed", "message"),
    [
        (
            ((Shard(3),), None, (Replicate(),), (Replicate(),), None),
            r"q: op on DTensors expects .*Shard\(dim=3\)",
        ),
        (
            ((Shard(1),), (Shard(2),), (Replicate(),), (Replicate(),), (Shard(1),)),
            "k: expected q's placements",
        ),
        (((Shard(2),), None, (Shard(0),), (Replicate(),), None), "cos: expected a replicated cos/sin table"),
        (((Shard(2),), None, (Replicate(),), (Partial(),), None), "sin: expected a replicated"),
        (
            ((Shard(1),), None, (Replicate(),), (Replicate(),), (Replicate(),)),
            "positions: expected placements",
        ),
        (((Shard(1),), None, (Replicate(),), (Replicate(),), None), "positions: op got q sharded on tokens"),
    ],
)
def test_placements_a_shard_cannot_rotate_locally_raise_naming_the_argument(placed, message):
    with pytest.raises(ValueError, match=message):
        check_placements("op", ROLES, placed, 4)


def test_a_plain_tensor_is_not_a_dtensor_and_is_its_own_local_shard():
    x = torch.zeros(2)
    assert not is_dtensor(x) and not is_dtensor(None) and local(x) is x


def test_importing_ropekit_does_not_import_torch_distributed_tensor():
    code = "import sys, ropekit; print('torch.distributed.tensor' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert out.stdout.strip() == "False"


def _no_rule_worker(rank):
    """Each entry point without a DTensor rule, given DTensors on a 1-rank mesh: (error type, message)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import ropekit
    import ropekit.compat.vllm as vllm

    mesh = init_device_mesh("cpu", (1,))
    cos, sin = ropekit.RopeConfig(16).cos_sin(64)
    q, k, v = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 2, 16), torch.randn(2, 3, 2, 16)
    dq = distribute_tensor(q, mesh, [Shard(2)])
    caches = torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16)
    d_cache = distribute_tensor(caches[0], mesh, [Replicate()])
    before = caches[0].clone()
    slots = torch.tensor([[0, 5, -1], [3, 9, 12]])
    pos, query = torch.arange(6), distribute_tensor(torch.randn(6, 64), mesh, [Shard(1)])
    cache = torch.cat([cos, sin], -1)
    ops = torch.ops.ropekit

    def fused(q, k_cache):
        return ropekit.apply_rotary_qk_and_cache(
            q, k, v, cos, sin, k_cache=k_cache, v_cache=caches[1], slot_mapping=slots
        )

    calls = {
        "apply_rotary_qk_and_cache q": lambda: fused(dq, caches[0]),
        # beside a plain q, a DTensor cache reached the C loop, which wrote through its pointer (a crash)
        "apply_rotary_qk_and_cache k_cache": lambda: fused(q, d_cache),
        "rotary_qk_and_cache_ op": lambda: ops.rotary_qk_and_cache_(
            dq, k, v, cos, sin, None, 0, slots.view(-1), *caches, "nhd", False, None, None, "cpu"
        ),
        "compat.vllm.rotary_embedding": lambda: vllm.rotary_embedding(pos, query, None, 16, cache, True),
        "rotary_embedding op": lambda: ops.rotary_embedding(pos, query, None, 16, cache, True),
    }
    results = {}
    with torch.no_grad():
        for name, call in calls.items():
            try:
                call()
                results[name] = "no error"
            except Exception as e:
                results[name] = f"{type(e).__name__}: {e}"
    results["cache written"] = not torch.equal(caches[0], before)
    return results


def test_entry_points_without_a_dtensor_rule_refuse_dtensors_with_a_value_error(tmp_path):
    """Issue 39: the fused cache op and compat.vllm.rotary_embedding given DTensors raised DTensor's "got
    mixed torch.Tensor and DTensor" (and a DTensor cache beside a plain q crashed the C loop); each is now a
    ValueError naming the argument, before anything is written."""
    from gloo_ranks import run_ranks

    (results,) = run_ranks(_no_rule_worker, tmp_path, world=1)
    assert results.pop("cache written") is False
    names = {
        "apply_rotary_qk_and_cache q": "q",
        "apply_rotary_qk_and_cache k_cache": "k_cache",
        "rotary_qk_and_cache_ op": "q",
        "compat.vllm.rotary_embedding": "query",
        "rotary_embedding op": "query",
    }
    for call, message in results.items():
        assert message.startswith(f"ValueError: {names[call]}: "), (call, message)
        assert "has no DTensor rule, got a DTensor with placements" in message, (call, message)
