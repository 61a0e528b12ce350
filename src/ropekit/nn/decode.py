"""The reference decode loop: a left-padded batch, a prefill, then one token per step through a KV cache.

Shape notation: B batch, S padded length, P prompt length (padded), L cache capacity.

Left padding aligns every row's *last* prompt token, so all rows write the same cache slot at each step; the
rotary position of a token is then its slot minus the row's padding count, one offset per sequence.
:func:`padding_positions` computes exactly that, and the same positions serve the full forward pass, which is
what makes incremental decoding equal to it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ropekit.validation import check_int

__all__ = ["incremental_forward", "left_pad", "padding_positions"]


def left_pad(sequences: Sequence[torch.Tensor], pad_value: float = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack sequences of different lengths, padding on the left.

    Args:
        sequences: tensors of shape (S_b, ...) with one trailing shape and dtype (ids or embeddings).
        pad_value: value written into the padding.

    Returns:
        (padded (B, S, ...), mask (B, S) bool, True at real tokens), S = the longest S_b.

    Raises:
        ValueError: for an empty list, or tensors whose trailing shapes or dtypes differ.
    """
    if not sequences:
        raise ValueError("sequences: expected at least one tensor, got an empty sequence")
    first = sequences[0]
    for i, s in enumerate(sequences):
        if (
            not isinstance(s, torch.Tensor)
            or s.dim() == 0
            or s.shape[1:] != first.shape[1:]
            or s.dtype != first.dtype
        ):
            raise ValueError(
                f"sequences[{i}]: expected a tensor of shape (len, *{tuple(first.shape[1:])}) and dtype "
                f"{first.dtype}, got {s!r:.80}"
            )
    longest = max(s.shape[0] for s in sequences)
    padded = first.new_full((len(sequences), longest, *first.shape[1:]), pad_value)  # (B, S, ...)
    mask = torch.zeros(len(sequences), longest, dtype=torch.bool, device=first.device)  # (B, S)
    for b, s in enumerate(sequences):
        padded[b, longest - s.shape[0] :] = s
        mask[b, longest - s.shape[0] :] = True
    return padded, mask


def padding_positions(mask: torch.Tensor) -> torch.Tensor:
    """Rotary positions of a left-padded batch: each row counts its real tokens from 0; padding gets 0.

    Args:
        mask: (B, S) bool, True at real tokens.

    Returns:
        (B, S) int64 positions.

    Raises:
        ValueError: if mask is not a 2-D bool tensor.
    """
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
        raise ValueError(f"mask: expected a (batch, seq) bool tensor, got {mask!r:.80}")
    return (mask.long().cumsum(dim=1) - 1).clamp(min=0)


def incremental_forward(
    block,
    x: torch.Tensor,
    *,
    prompt_len: int,
    attn_mask: torch.Tensor | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Run an attention block the way generation does: prefill x[:, :prompt_len], then one token per step.

    The result equals ``block(x, positions=padding_positions(attn_mask), attn_mask=attn_mask)`` (the full
    forward pass) up to floating-point rounding; the tests hold it to that.

    Args:
        block: a :class:`ropekit.nn.Attention`, or a ``torch.compile`` of one.
        x: (B, S, dim), left-padded.
        prompt_len: P, the tokens processed in the prefill (1 <= P <= S).
        attn_mask: (B, S) bool, True at real tokens; None means no padding.
        max_len: cache capacity L >= S; defaults to S.

    Returns:
        (B, S, dim), the block's output for every token.

    Raises:
        ValueError: for a prompt_len or max_len out of range, or a mask of the wrong shape.
    """
    batch, seq, _ = x.shape
    check_int("prompt_len", prompt_len, maximum=seq, expected=f"an integer in [1, {seq}]")
    max_len = seq if max_len is None else max_len
    check_int("max_len", max_len, minimum=seq, expected=f"an integer >= the sequence length {seq}")
    if attn_mask is None:
        attn_mask = torch.ones(batch, seq, dtype=torch.bool, device=x.device)
    if not isinstance(attn_mask, torch.Tensor) or tuple(attn_mask.shape) != (batch, seq):
        raise ValueError(f"attn_mask: expected a bool tensor of shape {(batch, seq)}, got {attn_mask!r:.80}")
    positions = padding_positions(attn_mask)  # (B, S)
    key_mask = torch.zeros(batch, max_len, dtype=torch.bool, device=x.device)  # (B, L): one entry per slot
    key_mask[:, :seq] = attn_mask
    cache = block.new_kv_cache(batch, max_len, dtype=x.dtype, device=x.device)

    outputs = [
        block(x[:, :prompt_len], positions=positions[:, :prompt_len], attn_mask=key_mask, kv_cache=cache)
    ]
    for t in range(prompt_len, seq):
        step = x[:, t : t + 1]  # (B, 1, dim)
        outputs.append(block(step, positions=positions[:, t : t + 1], attn_mask=key_mask, kv_cache=cache))
    return torch.cat(outputs, dim=1)  # (B, S, dim)
