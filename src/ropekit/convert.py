"""Converting q/k projection weights between the two RoPE pair layouts.

Shape notation: H heads, D head_dim, R rotary_dim (<= D), E hidden size (the projection's input width).

Meta's LLaMA code rotates features (2i, 2i+1) of each head together ("interleaved", GPT-J style);
Hugging Face's ``LlamaAttention`` rotates (i, i + R/2) ("half", GPT-NeoX style). Both compute the same
attention scores if the rows of the q and k projections are permuted within each head, which is what HF's
``convert_llama_weights_to_hf.py`` does. A converter that forgets the permutation produces a model that loads,
runs, and is silently wrong. See docs/integrations.md for how to tell which layout a checkpoint uses.

Only q and k change: v and the output projection never see the rotation, and neither does any feature past R.
"""

from __future__ import annotations

import numpy as np
import torch

from ropekit.reference import half_to_interleaved_permutation, interleaved_to_half_permutation
from ropekit.validation import check_even, check_int

__all__ = ["half_to_interleaved", "interleaved_to_half"]


def interleaved_to_half(
    weight: torch.Tensor, num_heads: int, *, rotary_dim: int | None = None
) -> torch.Tensor:
    """Permute a q or k projection from the interleaved (Meta / GPT-J) layout to the half (HF / GPT-NeoX) one.

    Args:
        weight: (H*D, E) projection weight, or (H*D,) bias.
        num_heads: H (for k under GQA, the number of key/value heads).
        rotary_dim: R, the rotated features of each head; defaults to D. Features past R stay in place.

    Returns:
        A new tensor, shaped like weight, whose per-head rows are in the half layout.

    Raises:
        ValueError: if weight is not 1-D or 2-D, its first axis is not a multiple of num_heads, or
            rotary_dim is odd or larger than head_dim.
    """
    return _permute_heads(weight, num_heads, rotary_dim, interleaved_to_half_permutation)


def half_to_interleaved(
    weight: torch.Tensor, num_heads: int, *, rotary_dim: int | None = None
) -> torch.Tensor:
    """Inverse of :func:`interleaved_to_half`: from the half (HF) layout to the interleaved (Meta) one.

    Arguments, return value and errors as in :func:`interleaved_to_half`.
    """
    return _permute_heads(weight, num_heads, rotary_dim, half_to_interleaved_permutation)


def _permute_heads(weight, num_heads, rotary_dim, permutation) -> torch.Tensor:
    if not isinstance(weight, torch.Tensor) or weight.dim() not in (1, 2):
        raise ValueError(
            f"weight: expected a (num_heads * head_dim, hidden) weight or a (num_heads * head_dim,) bias, "
            f"got {weight!r:.80}"
        )
    num_heads = check_int("num_heads", num_heads)
    if weight.shape[0] % num_heads:
        raise ValueError(f"num_heads: weight's first axis {weight.shape[0]} is not a multiple of {num_heads}")
    head_dim = weight.shape[0] // num_heads
    rotary_dim = check_even("rotary_dim", head_dim if rotary_dim is None else rotary_dim)
    if rotary_dim > head_dim:
        raise ValueError(f"rotary_dim: expected at most head_dim ({head_dim}), got {rotary_dim}")
    order = np.concatenate([permutation(rotary_dim), np.arange(rotary_dim, head_dim)])
    index = torch.as_tensor(order, device=weight.device)
    per_head = weight.reshape(num_heads, head_dim, *weight.shape[1:])  # (H, D, E) or (H, D)
    return per_head.index_select(1, index).reshape(weight.shape)  # (H*D, E) or (H*D,)
