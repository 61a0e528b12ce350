"""Dual chunk attention RoPE (Qwen2.5-1M; An et al. 2024, "Training-Free Long-Context Scaling of LLMs").

The frequencies are the plain ones; what changes is which position each role sees. The sequence is cut into
chunks of ``chunk_len = chunk_size - local_size`` tokens and every key takes its position within its chunk,
``p mod chunk_len``, so no relative distance ever exceeds what the model was trained on. A query is rotated
once per attention it takes part in (vLLM, ``model_executor/layers/rotary_embedding/dual_chunk_rope.py``):

==================  ======================================================  ===========================
role                query position (r = p mod chunk_len)                    attends to
==================  ======================================================  ===========================
``intra``           r                                                       keys of its own chunk
``succ``            min(r + chunk_len, chunk_size)                          keys of the previous chunk
``inter``           min(2 chunk_len - 1, chunk_size), the same for all      keys of older chunks
``succ_critical``   r + chunk_len (not clamped)                             vLLM's sparse kernels
``inter_critical``  r + chunk_size                                          vLLM's sparse kernels
==================  ======================================================  ===========================

:func:`dual_chunk_positions` gives these positions; :meth:`ropekit.RopeConfig.dual_chunk_cos_sin` their
tables. ``original_max_position_embeddings`` (Qwen's config records the trained length) is accepted and
does not change the tables.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ropekit.schedules.params import check_length
from ropekit.schedules.registry import RopeSpec, register_schedule
from ropekit.validation import check_int, describe

__all__ = ["DualChunkPositions", "DualChunkTables", "dual_chunk_positions"]


class DualChunkPositions(NamedTuple):
    """The position each role of dual chunk attention sees, each shaped like the token positions."""

    key: torch.Tensor
    intra: torch.Tensor
    succ: torch.Tensor
    inter: torch.Tensor
    succ_critical: torch.Tensor
    inter_critical: torch.Tensor


class DualChunkTables(NamedTuple):
    """(cos, sin) for every role of dual chunk attention, each (..., rotary_dim // 2)."""

    key: tuple[torch.Tensor, torch.Tensor]
    intra: tuple[torch.Tensor, torch.Tensor]
    succ: tuple[torch.Tensor, torch.Tensor]
    inter: tuple[torch.Tensor, torch.Tensor]
    succ_critical: tuple[torch.Tensor, torch.Tensor]
    inter_critical: tuple[torch.Tensor, torch.Tensor]


def dual_chunk_positions(positions: torch.Tensor, chunk_size: int, local_size: int) -> DualChunkPositions:
    """Map token positions to the positions of every dual-chunk role (see the module docstring).

    Args:
        positions: integer tensor of token positions (any shape), >= 0.
        chunk_size: the chunk length of the model's config.
        local_size: the local window; chunk_len = chunk_size - local_size.

    Returns:
        :class:`DualChunkPositions`, int64 tensors shaped like positions.

    Raises:
        ValueError: for a non-integer or negative positions tensor, or sizes with local_size >= chunk_size.
    """
    chunk_size, local_size = _check_sizes(chunk_size, local_size, "chunk_size", "local_size")
    if not isinstance(positions, torch.Tensor) or positions.is_floating_point() or positions.is_complex():
        raise ValueError(f"positions: expected an integer tensor, got {describe(positions)}")
    if positions.numel() and not positions.is_meta and int(positions.min()) < 0:  # meta: shapes only
        raise ValueError(f"positions: expected positions >= 0, got minimum {int(positions.min())}")
    chunk_len = chunk_size - local_size
    within = positions.to(torch.int64) % chunk_len  # (...,)
    inter = min(2 * chunk_len - 1, chunk_size)
    return DualChunkPositions(
        key=within,
        intra=within,
        succ=(within + chunk_len).clamp(max=chunk_size),
        inter=torch.full_like(within, inter),
        succ_critical=within + chunk_len,
        inter_critical=within + chunk_size,
    )


def _check_sizes(chunk_size: object, local_size: object, chunk_name: str, local_name: str) -> tuple[int, int]:
    chunk_size = check_int(chunk_name, chunk_size)
    local_size = check_int(local_name, local_size, minimum=0, expected="an integer >= 0")
    if local_size >= chunk_size:
        raise ValueError(f"{local_name}: expected less than chunk_size ({chunk_size}), got {local_size}")
    return chunk_size, local_size


def _validate(spec: RopeSpec) -> None:
    _check_sizes(
        spec.params.get("chunk_size"),
        spec.params.get("local_size"),
        "scaling['chunk_size']",
        "scaling['local_size']",
    )
    check_length(spec, "original_max_position_embeddings")


@register_schedule(
    "dual_chunk",
    required=("chunk_size", "local_size"),
    optional=("original_max_position_embeddings",),
    validate=_validate,
)
def dual_chunk(spec: RopeSpec, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    return spec.default_inv_freq(), 1.0
