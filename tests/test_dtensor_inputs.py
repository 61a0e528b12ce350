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
