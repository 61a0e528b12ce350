"""DeepSeek-V4's RoPE on shared keys-values: the values turn too, and the output turns back.

DeepSeek-V4's attention has one key-value head whose tensor is both the key and the value. RoPE rotates the
trailing rotary_dim features of q and kv (the position-free features come first, pairs interleaved
(2i, 2i+1)), so each value reaches query i turned by its own position p_j. The attention output is then
rotated by -p_i (the inverse rotation at the query's position), which leaves each value's contribution
turned by p_j - p_i: relative, like the scores (transformers' ``DeepseekV4Attention``; reference
:func:`ropekit.reference.shared_kv_attention`).

These two calls are :func:`ropekit.apply_rotary_qk` and :func:`ropekit.apply_rotary` with DeepSeek-V4's
layout fixed (``rotary_position="last"``, interleaved pairs) and, for the output, ``inverse=True``; every
backend serves them. The tables are those of ``RopeConfig.from_hf(config, layer_type="main" or
"compress")``.

Shape notation: B batch, S sequence, H query heads, D head_dim (kv has one head).
"""

from __future__ import annotations

import torch

from ropekit.functional import apply_rotary, apply_rotary_qk

__all__ = ["rotate_shared_kv", "unrotate_output"]


def rotate_shared_kv(
    q: torch.Tensor,
    kv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    positions: torch.Tensor | None = None,
    offsets: int | torch.Tensor = 0,
    interleaved: bool = True,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (B, S, H, D) and the shared key-value kv (B, S, 1, D) on their trailing features.

    cos, sin: (L, R/2) tables (R = rotary_dim <= D); positions / offsets as in :func:`ropekit.apply_rotary`.
    interleaved: DeepSeek-V4 pairs (2i, 2i+1); pass False for a half-paired checkpoint.

    Returns:
        (q, kv) rotated, new tensors. Use kv as both keys and values, then :func:`unrotate_output`.

    Raises:
        ValueError: as :func:`ropekit.apply_rotary_qk`.
    """
    return apply_rotary_qk(
        q, kv, cos, sin, positions=positions, offsets=offsets, interleaved=interleaved, backend=backend,
        rotary_position="last",
    )  # fmt: skip


def unrotate_output(
    out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    positions: torch.Tensor | None = None,
    offsets: int | torch.Tensor = 0,
    interleaved: bool = True,
    backend: str = "auto",
) -> torch.Tensor:
    """Rotate the attention output (B, S, H, D) by -theta at each query's position (trailing features).

    The same tables and positions as :func:`rotate_shared_kv`; returns a new tensor.

    Raises:
        ValueError: as :func:`ropekit.apply_rotary`.
    """
    return apply_rotary(
        out, cos, sin, positions=positions, offsets=offsets, interleaved=interleaved, backend=backend,
        inverse=True, rotary_position="last",
    )  # fmt: skip
