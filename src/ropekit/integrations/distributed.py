"""Context parallelism: splitting one sequence across ranks, each rank rotating with its *global* positions.

Shape notation: B batch, S global sequence length, S_r = S / world_size tokens per rank, H query heads,
Hk key/value heads, D head_dim, W world size.

Once a sequence is sharded, position 0 of a rank's shard is not position 0 of the sequence. RoPE must see
the global index of every token, or attention between shards is computed at the wrong relative distances
(silently: nothing fails). :func:`shard_positions` is the one source of those indices; :func:`shard_sequence`
cuts a batch and hands back the matching positions, to pass as ``positions=`` to any ropekit call.

Schemes:
    contiguous: rank r holds tokens [r*S_r, (r+1)*S_r).
    zigzag: the sequence is cut into 2W chunks and rank r holds chunks r and 2W-1-r. Under a causal mask the
        late chunks attend to more keys, so pairing an early chunk with a late one gives every rank the same
        work (the layout ring attention and PyTorch's context-parallel "round robin" load balancing use).

See docs/integrations.md for use with PyTorch's context-parallel API and with ring attention.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ropekit.validation import check_int

__all__ = ["SCHEMES", "all_gather_sequence", "gathered_kv_attention", "shard_positions", "shard_sequence"]

SCHEMES = ("contiguous", "zigzag")


def shard_positions(
    seq_len: int, world_size: int, rank: int, scheme: str = "contiguous", *, device=None
) -> torch.Tensor:
    """The global positions of the tokens rank ``rank`` holds, in the order it holds them.

    Args:
        seq_len: S, the global sequence length.
        world_size: W, the number of ranks sharing the sequence.
        rank: this rank, 0 <= rank < W.
        scheme: "contiguous" or "zigzag" (see the module docstring).
        device: device of the result.

    Returns:
        (S_r,) int64 positions.

    Raises:
        ValueError: for an unknown scheme, a rank out of range, or a seq_len not divisible by W
            ("contiguous") or by 2W ("zigzag").
    """
    for name, value in (("seq_len", seq_len), ("world_size", world_size)):
        check_int(name, value)
    check_int("rank", rank, minimum=0, maximum=world_size - 1, expected=f"an integer in [0, {world_size})")
    if scheme not in SCHEMES:
        raise ValueError(f"scheme: expected one of {SCHEMES}, got {scheme!r}")
    chunks = world_size if scheme == "contiguous" else 2 * world_size
    if seq_len % chunks:
        raise ValueError(
            f"seq_len: {scheme} sharding over {world_size} ranks cuts the sequence into {chunks} chunks, "
            f"so seq_len must be a multiple of {chunks}; got {seq_len} (pad the sequence)"
        )
    chunk = seq_len // chunks
    held = [rank] if scheme == "contiguous" else [rank, chunks - 1 - rank]
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in held])


def shard_sequence(
    x: torch.Tensor,
    world_size: int,
    rank: int,
    scheme: str = "contiguous",
    *,
    positions: torch.Tensor | None = None,
    seq_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of a batch along the sequence axis, with the global positions of its tokens.

    Call it once per tensor that has a sequence axis (input ids, labels, a padding mask); the positions are
    the same for all of them.

    Args:
        x: a tensor with the sequence on axis ``seq_dim``, e.g. (B, S) ids or (B, S, ...) activations.
        world_size, rank, scheme: as in :func:`shard_positions`.
        positions: (B, S) global position ids to shard alongside x (packed or offset batches), or None for
            ``arange(S)`` in every row.
        seq_dim: the sequence axis of x.

    Returns:
        (x_shard with S_r on seq_dim, positions (B, S_r) int64), ready for ``positions=`` of ropekit calls.

    Raises:
        ValueError: as :func:`shard_positions`, or for positions whose shape is not (B, S).
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError(f"x: expected a tensor with batch and sequence axes, got {x!r:.80}")
    seq_dim = seq_dim % x.dim()
    seq_len = x.shape[seq_dim]
    index = shard_positions(seq_len, world_size, rank, scheme, device=x.device)  # (S_r,)
    batch = x.shape[0]
    if positions is None:
        positions = index.expand(batch, -1)  # (B, S_r): the token indices are the positions
    else:
        if not isinstance(positions, torch.Tensor) or tuple(positions.shape) != (batch, seq_len):
            raise ValueError(f"positions: expected shape {(batch, seq_len)}, got {positions!r:.80}")
        positions = positions.to(x.device).index_select(1, index)  # (B, S_r)
    return x.index_select(seq_dim, index), positions.to(torch.int64)


def all_gather_sequence(
    x: torch.Tensor, scheme: str = "contiguous", *, seq_dim: int = 1, group=None
) -> torch.Tensor:
    """Gather every rank's shard and restore global sequence order (differentiable).

    Args:
        x: this rank's shard, S_r tokens on seq_dim (all ranks the same shape).
        scheme: how the sequence was sharded.
        seq_dim: the sequence axis.
        group: the process group (default: the world).

    Returns:
        The whole sequence, S = W * S_r tokens on seq_dim, in global order.
    """
    import torch.distributed as dist
    from torch.distributed.nn.functional import all_gather

    world_size = dist.get_world_size(group)
    seq_dim = seq_dim % x.dim()
    gathered = torch.cat(all_gather(x.contiguous(), group=group), dim=seq_dim)  # rank-major order
    if scheme == "contiguous":
        return gathered
    seq_len = gathered.shape[seq_dim]
    held = torch.cat([shard_positions(seq_len, world_size, r, scheme) for r in range(world_size)])
    return gathered.index_select(seq_dim, torch.argsort(held).to(x.device))  # back to global order


def gathered_kv_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    scheme: str = "contiguous",
    *,
    causal: bool = True,
    group=None,
) -> torch.Tensor:
    """Context-parallel attention by all-gathering keys and values (the simple alternative to ring attention).

    Each rank keeps its queries, gathers every rank's (already rotated) keys and values, and masks by global
    position. Memory grows with S, so this suits moderate lengths; ring attention streams the shards instead.

    Args:
        q: (B, S_r, H, D) this rank's queries, rotated with ``positions``.
        k, v: (B, S_r, Hk, D) this rank's keys (rotated) and values.
        positions: (B, S_r) global positions of this rank's tokens (from :func:`shard_sequence`); with no
            padding or packing they are also the tokens' indices in the gathered sequence.
        scheme: how the sequence was sharded.
        causal: mask keys at later positions.
        group: the process group.

    Returns:
        (B, S_r, H, D) attention output for this rank's queries.
    """
    k_all = all_gather_sequence(k, scheme, group=group)  # (B, S, Hk, D)
    v_all = all_gather_sequence(v, scheme, group=group)
    mask = None
    if causal:
        key_pos = torch.arange(k_all.shape[1], device=q.device)  # (S,)
        mask = (key_pos[None, None, :] <= positions[:, :, None])[:, None]  # (B, 1, S_r, S)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k_all.transpose(1, 2), v_all.transpose(1, 2), attn_mask=mask,
        scale=1.0 / math.sqrt(q.shape[-1]), enable_gqa=q.shape[2] != k.shape[2],
    )  # fmt: skip
    return out.transpose(1, 2)  # (B, S_r, H, D)
