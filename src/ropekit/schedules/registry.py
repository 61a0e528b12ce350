"""The frequency-schedule registry.

A schedule turns a RoPE description into ``(inv_freq, attention_scaling)`` for a given sequence length,
the same contract as Hugging Face's ``ROPE_INIT_FUNCTIONS``. Adding a method is one function plus one
:func:`register_schedule` call. Unlike HF, an invalid configuration raises a ``ValueError`` naming the key,
the value and what was expected; it is never a warning.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "SCHEDULES",
    "RopeSpec",
    "Schedule",
    "get_schedule",
    "register_schedule",
    "split_scaling",
]

# Keys HF configs carry inside rope_scaling / rope_parameters that describe the geometry rather than the
# schedule: RopeConfig reads them itself (base, rotary_dim, M-RoPE sections). A schedule that declares one of
# them (proportional declares partial_rotary_factor) receives it in its params as well.
# floor_scale / attn_scale are Llama 4's query temperature on its NoPE layers, llama_4_scaling_beta
# Ministral 3's and Mistral 4's on every layer (ropekit.schedules.softmax).
STRUCTURAL_KEYS = frozenset(
    {
        "rope_type",
        "type",
        "rope_theta",
        "partial_rotary_factor",
        "mrope_section",
        "mrope_interleaved",
        "mrope_layout",
        "floor_scale",
        "attn_scale",
        "llama_4_scaling_beta",
    }
)


@dataclass(frozen=True)
class RopeSpec:
    """What a schedule sees: the base geometry plus the schedule's own parameters.

    Attributes:
        base: RoPE base (rope_theta).
        rotary_dim: number of rotated features; a schedule returns rotary_dim // 2 frequencies.
        head_dim: full head width (some schedules, such as proportional, are defined against it).
        max_position_embeddings: the model's context length, or None.
        params: the schedule's keys from the scaling dict (rope_type removed).
        dtype: the precision schedules compute in. float64 by default; float32 reproduces Hugging Face's
            rounding of inv_freq bit for bit, because every schedule applies the operations in HF's order.
    """

    base: float
    rotary_dim: int
    head_dim: int
    max_position_embeddings: int | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    dtype: torch.dtype = torch.float64

    def exponents(self, dim: int | None = None) -> torch.Tensor:
        """2i/dim for i = 0 .. dim/2 - 1 in ``self.dtype``; dim defaults to rotary_dim. Shape (dim // 2,)."""
        dim = self.rotary_dim if dim is None else dim
        return torch.arange(0, dim, 2, dtype=torch.int64).to(self.dtype) / dim

    def default_inv_freq(self, base: float | None = None) -> torch.Tensor:
        """theta_i = base^(-2i/rotary_dim) in ``self.dtype``, shape (rotary_dim // 2,)."""
        b = self.base if base is None else base
        return 1.0 / (b ** self.exponents())

    def get(self, key: str, default: Any = None) -> Any:
        """A schedule parameter, or default when the key is absent or None (HF writes absent keys as null)."""
        value = self.params.get(key)
        return default if value is None else value

    def original_length(self) -> int:
        """original_max_position_embeddings, defaulting to max_position_embeddings as HF does.

        Raises:
            ValueError: when neither is known.
        """
        value = self.get("original_max_position_embeddings", self.max_position_embeddings)
        if value is None:
            raise ValueError(
                "scaling['original_max_position_embeddings']: expected the pre-training context length "
                "(or pass max_position_embeddings), got neither"
            )
        return value

    def factor_or_length_ratio(self) -> float:
        """params["factor"], defaulting to max_position_embeddings / original_max_position_embeddings.

        DeepSeek (YaRN) and Phi-3 (LongRoPE) derive the factor from the two lengths this way.

        Raises:
            ValueError: when neither the factor nor max_position_embeddings is known.
        """
        factor = self.get("factor")
        if factor is None:
            if self.max_position_embeddings is None:
                raise ValueError(
                    "scaling['factor']: expected a number (or pass max_position_embeddings), got neither"
                )
            factor = self.max_position_embeddings / self.original_length()
        return factor


ScheduleFn = Callable[[RopeSpec, "int | None"], "tuple[torch.Tensor, float]"]


@dataclass(frozen=True)
class Schedule:
    """A registered schedule.

    Attributes:
        name: the rope_type it answers to.
        fn: ``fn(spec, seq_len) -> (inv_freq float64 (rotary_dim//2,), attention_scaling float)``.
        required: keys that must be present in the scaling dict.
        optional: keys that may be present.
        validate: optional ``validate(spec) -> None`` raising ValueError on bad values.
        length_dependent: True if the frequencies change with seq_len (dynamic NTK, LongRoPE).
        keeps_longest: for a length-dependent schedule, True if a module should keep the frequencies of the
            longest sequence seen until a sequence shorter than max_position_embeddings arrives (HF's dynamic
            NTK); False if every call uses its own length (LongRoPE).
    """

    name: str
    fn: ScheduleFn
    required: frozenset[str] = frozenset()
    optional: frozenset[str] = frozenset()
    validate: Callable[[RopeSpec], None] | None = None
    length_dependent: bool = False
    keeps_longest: bool = False


SCHEDULES: dict[str, Schedule] = {}
_ALIASES: dict[str, str] = {}


def register_schedule(
    name: str,
    fn: ScheduleFn | None = None,
    *,
    required: tuple[str, ...] | frozenset[str] = (),
    optional: tuple[str, ...] | frozenset[str] = (),
    validate: Callable[[RopeSpec], None] | None = None,
    length_dependent: bool = False,
    keeps_longest: bool = False,
    aliases: tuple[str, ...] = (),
) -> Any:
    """Register a schedule under ``name``. Usable as a decorator or a plain call.

    Example:
        >>> @register_schedule("my_method", required=("factor",))
        ... def my_method(spec, seq_len):
        ...     return spec.default_inv_freq() / spec.params["factor"], 1.0
    """

    def deco(f: ScheduleFn) -> ScheduleFn:
        SCHEDULES[name] = Schedule(
            name, f, frozenset(required), frozenset(optional), validate, length_dependent, keeps_longest
        )
        for a in aliases:
            _ALIASES[a] = name
        return f

    return deco(fn) if fn is not None else deco


def get_schedule(name: str) -> Schedule:
    """Look up a schedule by rope_type (or alias); unknown names raise ValueError listing the known ones."""
    key = _ALIASES.get(name, name)
    if key not in SCHEDULES:
        known = sorted(set(SCHEDULES) | set(_ALIASES))
        raise ValueError(f"scaling: unknown rope_type {name!r}; expected one of {known}")
    return SCHEDULES[key]


def split_scaling(scaling: Mapping[str, Any] | None) -> tuple[Schedule, dict[str, Any]]:
    """Return the schedule a scaling dict names and its parameters, validating the keys.

    Accepts HF's vocabulary: ``rope_type`` or the legacy ``type``; None or {} means "default".
    Raises ValueError listing missing and unknown keys.
    """
    if scaling is None:
        return get_schedule("default"), {}
    if not isinstance(scaling, Mapping):
        raise ValueError(f"scaling: expected a dict like HF's rope_scaling or None, got {scaling!r}")
    name = scaling.get("rope_type", scaling.get("type", "default"))
    if not isinstance(name, str):
        raise ValueError(f"scaling['rope_type']: expected a string, got {name!r}")
    if name == "dynamic" and scaling.get("alpha") is not None:  # HunYuan: a fixed alpha is static NTK
        name = "ntk_alpha"
    sched = get_schedule(name)
    declared = sched.required | sched.optional
    params = {k: v for k, v in scaling.items() if k not in STRUCTURAL_KEYS or k in declared}
    missing = sorted(sched.required - params.keys())
    unknown = sorted(params.keys() - sched.required - sched.optional)
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"missing keys {missing}")
        if unknown:
            parts.append(f"unknown keys {unknown}")
        allowed = sorted(sched.required | sched.optional)
        raise ValueError(
            f"scaling for rope_type {sched.name!r}: {'; '.join(parts)}; allowed keys are {allowed}"
        )
    return sched, params
