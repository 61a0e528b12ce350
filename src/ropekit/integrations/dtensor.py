"""DTensor sharding rules for ropekit's registered ops: each shard rotated locally, or a clear error.

Importing this module registers, with ``torch.distributed.tensor.experimental.register_sharding``, a rule
for every op in :data:`OP_ARGUMENTS`. From then on ``ropekit.apply_rotary``, ``apply_rotary_qk`` and
``RotaryEmbedding`` take DTensors, as do the in-place ops themselves::

    import ropekit.integrations.dtensor  # once per process (torchtitan's override module imports it)

Registering on import, not lazily from the core, keeps ``torch.distributed`` out of ``import ropekit``; a
DTensor that reaches ropekit before this import is refused with a ValueError that names it.

A rotation reads, for each token, its own features and one table row. So a call runs on the local shards
with no communication exactly when every rank holds the positions of its own tokens:

* q and k placed alike, each mesh dimension sharding batch, tokens (seq, or packed tokens) or heads, or
  replicating;
* positions (q's leading axes) sharded alongside: on the axis where q's batch or tokens are sharded,
  replicated where q's heads are; no positions (rows ``offset + arange(seq)``) only when no mesh dimension
  shards the tokens, since a shard's own arange would start at 0;
* the cos/sin tables replicated (ropekit never shards a table: any rank may need any row).

Anything else (head_dim sharded, a partial sum, positions placed otherwise, a sharded table) raises a
ValueError naming the argument and its placements (DTensor re-raises it as a RuntimeError with the same
text), rather than letting DTensor redistribute: a gather of q without its positions would rotate the wrong
rows without a sound. The rule offers DTensor exactly the placements it was given, so DTensor never
chooses a redistribution. The checks themselves are :func:`ropekit.dtensor_inputs.check_placements`, which
``apply_rotary`` runs first.

The out-of-place ops (``<backend>_rotary``) return ``Tensor[]``, which ``register_sharding`` (one spec per
declared return) cannot describe; on DTensors ropekit rotates local copies with the in-place op instead,
and the out-of-place op's rule says so.

A new op is one entry of :data:`OP_ARGUMENTS`: the roles of its tensor arguments in schema order.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.experimental import register_sharding

import ropekit.backends  # noqa: F401  (registers the ops this module gives rules to)
from ropekit import dtensor_inputs
from ropekit.dtensor_inputs import POSITIONS, ROTATED, TABLE

__all__ = ["OP_ARGUMENTS", "register"]

_ROTARY = (ROTATED, ROTATED, TABLE, TABLE, POSITIONS)  # (q, k, cos, sin, positions, flags...)

# op name (torch.ops.ropekit.<name>) -> the roles of its leading tensor arguments in schema order (the
# arguments after them are not tensors).
OP_ARGUMENTS: dict[str, tuple[str, ...]] = {
    "cpu_rotary": _ROTARY,
    "cpu_rotary_": _ROTARY,
    "triton_rotary": _ROTARY,
    "triton_rotary_": _ROTARY,
}


def _rule(op_name: str, roles: tuple[str, ...], outputs: int, returns_list: bool):
    """The sharding function of one op: the placements it was given, checked, as its only strategy."""
    name = f"ropekit::{op_name}"

    def sharding(*args, **kwargs):
        specs = args[: len(roles)]
        if returns_list:
            raise ValueError(
                f"q: {name} returns a list (Tensor[]), which a DTensor sharding rule cannot describe; on "
                f"DTensors call ropekit.apply_rotary / apply_rotary_qk (they rotate copies in place), or the "
                f"in-place {name}_ on copies"
            )
        placed = tuple(None if spec is None else tuple(spec.placements) for spec in specs)
        q_placements, alongside = dtensor_inputs.check_placements(name, roles, placed, specs[0].ndim)
        # One strategy per mesh dimension's placements; expanded over the mesh, the combination that is the
        # inputs' own placements costs nothing, so DTensor chooses it and moves no data.
        strategies = []
        for mesh_dim, q_placement in enumerate(q_placements):
            inputs = []
            for role, spec in zip(roles, specs, strict=True):
                if spec is None:
                    inputs.append(None)
                elif role == ROTATED:
                    inputs.append(q_placement)
                elif role == TABLE:
                    inputs.append(Replicate())
                else:
                    inputs.append(alongside[mesh_dim])
            inputs += [None] * (len(args) - len(roles) + len(kwargs))
            strategy = ([q_placement] * outputs, inputs)
            if strategy not in strategies:
                strategies.append(strategy)
        return strategies

    return sharding


def register(op_name: str) -> None:
    """Register the rule of ``torch.ops.ropekit.<op_name>`` (an entry of :data:`OP_ARGUMENTS`); idempotent."""
    roles = OP_ARGUMENTS[op_name]
    overload = getattr(torch.ops.ropekit, op_name).default
    returns = overload._schema.returns
    returns_list = len(returns) == 1 and isinstance(returns[0].type, torch.ListType)
    register_sharding(overload)(_rule(op_name, roles, len(returns), returns_list))
    dtensor_inputs.SHARDED_OPS.add(op_name)


for _name in OP_ARGUMENTS:
    register(_name)
