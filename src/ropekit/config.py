"""RopeConfig: one description of a model's RoPE, from which frequencies and cos/sin tables follow.

Angles are always formed in float64 and only then cast, so tables stay accurate at million-token positions
(see docs/math.md). Scaling methods come from :mod:`ropekit.schedules`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ropekit.schedules import RopeSpec, Schedule, split_scaling
from ropekit.validation import check_base, check_head_dim, check_rotary_dim

__all__ = ["RopeConfig"]


@dataclass(frozen=True, init=False)
class RopeConfig:
    """Rotary embedding configuration.

    Args:
        head_dim: width of one attention head.
        base: RoPE base (HF's ``rope_theta``); theta_i = base^(-2i/rotary_dim). Must be finite and > 1.
        rotary_dim: number of leading features that rotate (partial rotary); defaults to head_dim. Even.
        interleaved: pair layout. False = GPT-NeoX / Hugging Face "half" pairing (i, i + d/2);
            True = GPT-J / Meta pairing (2i, 2i+1).
        scaling: a context-extension dict in HF's ``rope_scaling`` vocabulary (``{"rope_type": "linear",
            "factor": 4.0}``), or None.
        max_position_embeddings: the model's context length; some schedules need it.

    Raises:
        ValueError: for a non-positive head_dim, an odd / too large rotary_dim, a base that is not finite and > 1,
            or a scaling dict with an unknown rope_type, missing or unknown keys, or bad values.
    """

    head_dim: int
    base: float = 10000.0
    rotary_dim: int | None = None
    interleaved: bool = False
    scaling: Mapping[str, Any] | None = None
    max_position_embeddings: int | None = None
    _schedule: Schedule = field(init=False, repr=False, compare=False)
    _spec: RopeSpec = field(init=False, repr=False, compare=False)

    def __init__(
        self,
        head_dim: int,
        base: float = 10000.0,
        *,
        rotary_dim: int | None = None,
        interleaved: bool = False,
        scaling: Mapping[str, Any] | None = None,
        max_position_embeddings: int | None = None,
    ) -> None:
        head_dim = check_head_dim(head_dim)
        base = check_base(base)
        rotary_dim = head_dim if rotary_dim is None else check_rotary_dim(rotary_dim, head_dim)
        if rotary_dim == head_dim and head_dim % 2:
            raise ValueError(
                f"rotary_dim: expected a positive even integer <= head_dim ({head_dim}), got {rotary_dim!r} "
                "(head_dim is odd, so pass an even rotary_dim)"
            )
        if max_position_embeddings is not None and (
            isinstance(max_position_embeddings, bool)
            or not isinstance(max_position_embeddings, int)
            or max_position_embeddings <= 0
        ):
            raise ValueError(
                f"max_position_embeddings: expected a positive integer or None, got {max_position_embeddings!r}"
            )
        if not isinstance(interleaved, bool):
            raise ValueError(f"interleaved: expected a bool, got {interleaved!r}")
        scaling = dict(scaling) if isinstance(scaling, Mapping) else scaling  # split_scaling rejects the rest
        object.__setattr__(self, "head_dim", head_dim)
        object.__setattr__(self, "base", base)
        object.__setattr__(self, "rotary_dim", rotary_dim)
        object.__setattr__(self, "interleaved", interleaved)
        object.__setattr__(self, "scaling", scaling)
        object.__setattr__(self, "max_position_embeddings", max_position_embeddings)
        sched, params = split_scaling(scaling)
        spec = RopeSpec(base, rotary_dim, head_dim, max_position_embeddings, params)
        if sched.validate is not None:
            sched.validate(spec)
        object.__setattr__(self, "_schedule", sched)
        object.__setattr__(self, "_spec", spec)

    # -- schedule ------------------------------------------------------------------------------------------
    @property
    def rope_type(self) -> str:
        """The registered schedule name ("default", "linear", "yarn", ...)."""
        return self._schedule.name

    @property
    def length_dependent(self) -> bool:
        """True when frequencies depend on seq_len (dynamic NTK, LongRoPE)."""
        return self._schedule.length_dependent

    def _compute(self, seq_len: int | None) -> tuple[torch.Tensor, float]:
        if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0):
            raise ValueError(f"seq_len: expected a positive integer or None, got {seq_len!r}")
        inv_freq, scaling = self._schedule.fn(self._spec, seq_len)
        return inv_freq.to(torch.float64), float(scaling)

    def inv_freq(self, seq_len: int | None = None) -> torch.Tensor:
        """Angular frequencies theta_i, float64, shape (rotary_dim // 2,)."""
        return self._compute(seq_len)[0]

    def attention_scaling(self, seq_len: int | None = None) -> float:
        """Factor the cos/sin tables are multiplied by (1.0 unless a schedule such as YaRN sets it)."""
        return self._compute(seq_len)[1]

    def cos_sin(
        self,
        positions: int | torch.Tensor,
        *,
        dtype: torch.dtype = torch.float32,
        seq_len: int | None = None,
        device: torch.device | str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of position * theta, times attention_scaling.

        Args:
            positions: an int n (meaning arange(n)) or an integer/float tensor of any shape.
            dtype: output dtype; angles are always computed in float64 first.
            seq_len: the sequence length length-dependent schedules should assume.
            device: output device; defaults to positions' device (or CPU).

        Returns:
            (cos, sin), each of shape ``positions.shape + (rotary_dim // 2,)``.
        """
        if isinstance(positions, bool) or not isinstance(positions, (int, torch.Tensor)):
            raise ValueError(f"positions: expected an int or a tensor, got {positions!r:.80}")
        if isinstance(positions, int):
            if positions < 0:
                raise ValueError(f"positions: expected a non-negative int n (meaning arange(n)), got {positions}")
            positions = torch.arange(positions, dtype=torch.float64, device=device)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype: expected a floating-point dtype, got {dtype}")
        inv_freq, scale = self._compute(seq_len)
        device = positions.device if device is None else torch.device(device)
        angles = positions.to(device=device, dtype=torch.float64)[..., None] * inv_freq.to(device)
        cos, sin = torch.cos(angles), torch.sin(angles)
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        return cos.to(dtype), sin.to(dtype)
