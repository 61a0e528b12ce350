"""How the core treats a DTensor argument: checked on its local shard, lifted onto q's mesh, never gathered.

A DTensor (``torch.distributed.tensor``) is the global tensor of a sharded computation (tensor, context or
data parallel). ropekit rotates it shard by shard through its registered ops, whose sharding rules
(:mod:`ropekit.integrations.dtensor`) accept q and k sharded on batch, tokens or heads, with the positions
sharded alongside, and refuse anything else. This module is the core's side of that contract:

* :func:`is_dtensor` tells one apart without importing ``torch.distributed``: no tensor can be a DTensor
  before ``torch.distributed.tensor`` is imported, so the core only looks it up in ``sys.modules``.
* :func:`local` is the shard a host-side value check reads: checking the local rows needs no collective,
  and each rank checks the rows it rotates.
* :func:`positions_placements` maps q's placements to the positions' (one home for "sharded alongside").
* :func:`lift` makes the other arguments DTensors on q's mesh without communication: the cos/sin tables
  replicated (a table is never sharded: every rank may need any row), the positions sharded alongside q.
"""

from __future__ import annotations

import sys

import torch

__all__ = [
    "POSITIONS",
    "ROTATED",
    "SHARDED_OPS",
    "TABLE",
    "check_no_dtensor",
    "check_placements",
    "is_dtensor",
    "lift",
    "local",
    "positions_placements",
    "shards_tokens",
]

# The roles of an op's tensor arguments (ropekit.integrations.dtensor.OP_ARGUMENTS): rotated tensors
# (..., heads, head_dim), the first being q; cos / sin tables; the positions (q's leading axes).
ROTATED, TABLE, POSITIONS = "rotated", "table", "positions"
_ARGUMENT_NAMES = {ROTATED: ("q", "k"), TABLE: ("cos", "sin"), POSITIONS: ("positions",)}

# Names of the ops (torch.ops.ropekit.<name>) with a DTensor sharding rule, filled by
# ropekit.integrations.dtensor when it registers them; a DTensor reaching an op without one is refused here
# with the import that fixes it.
SHARDED_OPS: set[str] = set()


def is_dtensor(t: object) -> bool:
    """Whether t is a DTensor (False for plain tensors without touching torch.distributed)."""
    if type(t) is torch.Tensor or not isinstance(t, torch.Tensor):
        return False
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def check_no_dtensor(op: str, names: tuple[str, ...], values: tuple, instead: str) -> None:
    """Refuse a DTensor among ``values`` (the arguments ``names``) of an op that has no sharding rule: a
    ValueError naming the argument and its placements; ``instead`` says what to do. Without it a DTensor
    reached the op's dispatch ("got mixed torch.Tensor and DTensor") or, beside a plain q, a kernel that
    wrote through its pointer. No tensor can be a DTensor before ``torch.distributed.tensor`` is imported:
    until then this is one dictionary lookup."""
    module = sys.modules.get("torch.distributed.tensor")
    if module is None:
        return
    dtensor = module.DTensor
    for name, t in zip(names, values, strict=True):
        if t is not None and t.__class__ is not torch.Tensor and isinstance(t, dtensor):
            raise ValueError(
                f"{name}: {op} has no DTensor rule, got a DTensor with placements {tuple(t.placements)}; "
                f"{instead}"
            )


def local(t: torch.Tensor) -> torch.Tensor:
    """t's local shard if it is a DTensor (its values on this rank), else t itself."""
    return t.to_local() if is_dtensor(t) else t


def positions_placements(placements, q_dim: int) -> tuple | None:
    """The placements of the positions (q's leading axes: q.shape[:-2]) that shard them alongside q.

    Per mesh dimension: q sharded on a leading axis (batch, tokens) -> positions sharded on the same axis;
    q sharded on heads or replicated -> positions replicated. None when some placement has no such
    counterpart (q sharded on head_dim, a partial sum, a strided shard): the rows could not be matched
    locally.
    """
    from torch.distributed.tensor import Replicate, Shard

    lead = q_dim - 2
    out = []
    for p in placements:
        if type(p) is Replicate:
            out.append(Replicate())
        elif type(p) is Shard and p.dim % q_dim < lead:
            out.append(Shard(p.dim % q_dim))
        elif type(p) is Shard and p.dim % q_dim == lead:  # heads: every head of a token has its row
            out.append(Replicate())
        else:
            return None
    return tuple(out)


def shards_tokens(placements, q_dim: int) -> bool:
    """Whether q is sharded along the axis whose index is a token's position (seq, or packed tokens)."""
    from torch.distributed.tensor import Shard

    token_axis = q_dim - 3  # (batch, seq, H, D) -> 1; packed (tokens, H, D) -> 0
    return any(type(p) is Shard and p.dim % q_dim == token_axis for p in placements)


def check_placements(op_name: str, roles: tuple[str, ...], placed: tuple, q_dim: int) -> tuple:
    """Check that an op's tensor arguments are placed so that each rank rotates its own shard.

    Args:
        op_name: the op, for messages.
        roles: the role of each tensor argument (ROTATED, TABLE, POSITIONS), in order.
        placed: for each argument, its placements (a tuple, one per mesh dimension) or None when absent.
        q_dim: q's number of dimensions.

    Returns:
        q's placements (the outputs') and the positions' placements alongside them.

    Raises:
        ValueError: naming the argument, its placements and the placements expected.
    """
    from torch.distributed.tensor import Replicate

    names = _names(roles)
    q_placements = placed[0]
    alongside = positions_placements(q_placements, q_dim)
    if alongside is None:
        raise ValueError(
            f"q: {op_name} on DTensors expects q sharded on batch, tokens or heads (or replicated) on "
            f"each mesh dimension, got placements {q_placements}; ropekit rotates each shard locally and "
            f"cannot place the positions alongside these"
        )
    for name, role, placements in zip(names, roles, placed, strict=True):
        if placements is None:
            continue
        if role == ROTATED and placements != q_placements:
            raise ValueError(
                f"{name}: expected q's placements {q_placements} (q and k sharded alike), got {placements}"
            )
        if role == TABLE and any(type(p) is not Replicate for p in placements):
            raise ValueError(
                f"{name}: expected a replicated cos/sin table (every rank may read any row), got "
                f"placements {placements}"
            )
        if role == POSITIONS and placements != alongside:
            raise ValueError(
                f"positions: expected placements {alongside}, sharded alongside q's {q_placements} (the "
                f"rows of the tokens each rank holds), got {placements}"
            )
    if POSITIONS in roles and placed[roles.index(POSITIONS)] is None and shards_tokens(q_placements, q_dim):
        raise ValueError(
            f"positions: {op_name} got q sharded on tokens {q_placements} and no positions: each shard would "
            f"rotate as if its first token were at the offset. Pass the positions as a DTensor sharded like "
            f"q's tokens (ropekit.apply_rotary does this for you)"
        )
    return q_placements, alongside


def _names(roles: tuple[str, ...]) -> list[str]:
    seen: dict[str, int] = {}
    names = []
    for role in roles:
        index = seen.get(role, 0)
        seen[role] = index + 1
        options = _ARGUMENT_NAMES[role]
        names.append(options[index] if index < len(options) else f"{role} argument {index}")
    return names


def lift(q: torch.Tensor, cos, sin, rows, offset, make_rows):
    """cos, sin and the positions as DTensors on q's mesh, without communication.

    Args:
        q: a DTensor (B, S, H, D) or (T, H, D).
        cos, sin: tables, plain (replicated onto the mesh) or DTensors (kept: their rule checks them).
        rows: the positions, (B, S) or (T,): a DTensor (kept), a plain tensor of the global shape (each rank
            keeps its own shard of it), or None for offset + arange(S).
        offset: the int offset when rows is None.
        make_rows: () -> the global rows as a plain tensor, used when rows is None but q is sharded on
            tokens (a shard's local arange would start at 0: the wrong rows).

    Returns:
        (cos, sin, rows, offset), rows None only when no mesh dimension shards q's tokens.

    q's placements must have been checked (:func:`check_placements`): positions can follow them.
    """
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    mesh, placements = q.device_mesh, q.placements
    replicated = [Replicate()] * mesh.ndim
    if not isinstance(cos, DTensor):
        cos = DTensor.from_local(cos, mesh, replicated, run_check=False)
    if not isinstance(sin, DTensor):
        sin = DTensor.from_local(sin, mesh, replicated, run_check=False)
    if rows is None and not shards_tokens(placements, q.dim()):
        return cos, sin, None, offset
    if rows is None:
        rows, offset = make_rows().contiguous(), 0
    if not isinstance(rows, DTensor):
        # src_data_rank=None: every rank already holds the global rows and keeps its shard (no scatter).
        rows = distribute_tensor(rows, mesh, positions_placements(placements, q.dim()), src_data_rank=None)
    return cos, sin, rows, offset
