"""RopeConfig: one description of a model's RoPE, from which frequencies and cos/sin tables follow.

Angles are always formed in float64 and only then cast, so tables stay accurate at million-token positions
(see docs/math.md). Scaling methods come from :mod:`ropekit.schedules`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ropekit.schedules import RopeSpec, Schedule, mrope_axis_of_pair, mrope_layout, split_scaling
from ropekit.schedules.dual_chunk import DualChunkTables, dual_chunk_positions
from ropekit.schedules.softmax import attention_temperature, check_temperature, softmax_scale
from ropekit.validation import (
    check_base,
    check_bool,
    check_fraction,
    check_head_dim,
    check_int,
    check_movable,
    check_rotary_dim,
    describe,
    is_compiling,
)

__all__ = ["FrozenScaling", "RopeConfig", "config_from"]

# cos_sin forms at most this many float64 angles at once (2 MB): tables are built in chunks of rows.
COS_SIN_CHUNK_ELEMENTS = 1 << 18
# Where the rotary features sit in a head under partial rotary: its leading or its trailing rotary_dim.
ROTARY_POSITIONS = ("first", "last")


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
            "factor": 4.0}``), or None. It is copied: the config keeps a read-only :class:`FrozenScaling`
            (lists become tuples), so changing the dict passed in afterwards changes nothing.
        max_position_embeddings: the model's context length; some schedules need it.
        hf_float32_inv_freq: compute inv_freq in float32 with Hugging Face's order of operations, reproducing
            its rounding bit for bit (for comparison with models trained that way). Angles are still formed in
            float64 from those frequencies. Default False: float64 frequencies.
        rotary_position: which features rotate under partial rotary (rotary_dim < head_dim): "first" (the
            leading rotary_dim features: GPT-NeoX, Phi, HF) or "last" (the trailing ones: a rope part
            appended after the position-free part, as in DeepSeek's MLA heads). Default "first".

    The scaling dict may also carry the keys HF keeps inside ``rope_parameters``: ``rope_theta`` (must equal
    base), ``partial_rotary_factor`` (sets rotary_dim = int(head_dim * factor) when rotary_dim is None), and
    M-RoPE's ``mrope_section`` / ``mrope_interleaved`` (see :meth:`cos_sin`).

    A config is immutable and hashable: equal configs compare equal and hash equal, so a config can key a
    cache of tables.

    Raises:
        ValueError: for a non-positive head_dim, an odd / too large rotary_dim, a base that is not finite
            and > 1, or a scaling dict with an unknown rope_type, missing or unknown keys, or bad values.
    """

    head_dim: int
    base: float = 10000.0
    rotary_dim: int | None = None
    interleaved: bool = False
    scaling: Mapping[str, Any] | None = None
    max_position_embeddings: int | None = None
    hf_float32_inv_freq: bool = False
    rotary_position: str = "first"  # the common case: the leading rotary_dim features rotate
    _schedule: Schedule = field(init=False, repr=False, compare=False)
    _mrope: tuple[tuple[int, ...], str] | None = field(init=False, repr=False, compare=False)
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
        hf_float32_inv_freq: bool = False,
        rotary_position: str = "first",
    ) -> None:
        head_dim = check_head_dim(head_dim)
        base = check_base(base)
        rotary_dim = _rotary_dim_from_scaling(scaling, head_dim, rotary_dim, base)
        rotary_dim = head_dim if rotary_dim is None else check_rotary_dim(rotary_dim, head_dim)
        if rotary_dim == head_dim and head_dim % 2:
            raise ValueError(
                f"rotary_dim: expected a positive even integer <= head_dim ({head_dim}), got {rotary_dim!r} "
                "(head_dim is odd, so pass an even rotary_dim)"
            )
        if max_position_embeddings is not None:
            max_position_embeddings = check_int(
                "max_position_embeddings", max_position_embeddings, expected="a positive integer or None"
            )
        check_bool("interleaved", interleaved)
        check_bool("hf_float32_inv_freq", hf_float32_inv_freq)
        if rotary_position not in ROTARY_POSITIONS:
            raise ValueError(
                f"rotary_position: expected one of {ROTARY_POSITIONS}, got {describe(rotary_position)}"
            )
        if scaling is not None and not isinstance(scaling, Mapping):
            raise ValueError(
                f"scaling: expected a dict like HF's rope_scaling or None, got {describe(scaling)}"
            )
        scaling = None if scaling is None else FrozenScaling(scaling)
        object.__setattr__(self, "head_dim", head_dim)
        object.__setattr__(self, "base", base)
        object.__setattr__(self, "rotary_dim", rotary_dim)
        object.__setattr__(self, "interleaved", interleaved)
        object.__setattr__(self, "scaling", scaling)
        object.__setattr__(self, "max_position_embeddings", max_position_embeddings)
        object.__setattr__(self, "hf_float32_inv_freq", hf_float32_inv_freq)
        object.__setattr__(self, "rotary_position", rotary_position)
        sched, params = split_scaling(scaling)
        dtype = torch.float32 if hf_float32_inv_freq else torch.float64
        spec = RopeSpec(base, rotary_dim, head_dim, max_position_embeddings, params, dtype)
        if sched.validate is not None:
            sched.validate(spec)
        object.__setattr__(self, "_schedule", sched)
        object.__setattr__(self, "_spec", spec)
        object.__setattr__(self, "_mrope", mrope_layout(scaling, rotary_dim // 2))
        check_temperature(scaling)

    # -- construction from published configs -----------------------------------------------------------
    @classmethod
    def from_hf(cls, config: Any, *, layer_type: str | None = None, **overrides: Any) -> RopeConfig:
        """Build from a Hugging Face config: a ``PretrainedConfig``, a dict, a config.json path or its folder.

        Reads both config forms (legacy ``rope_theta`` + ``rope_scaling``, and v5 ``rope_parameters``); see
        :func:`ropekit.hf_config.rope_kwargs`. For models whose ``rope_parameters`` differ per layer type
        (sliding vs full attention: Gemma 3, ModernBERT), pass ``layer_type``; the list of types is
        :func:`ropekit.hf_config.rope_layer_types`.

        Args:
            config: the HF config in any of the forms above.
            layer_type: which per-layer-type entry to read ("full_attention", "sliding_attention", ...).
            overrides: RopeConfig keywords that replace what the config says
                (e.g. ``hf_float32_inv_freq=True``).

        Keys are checked as transformers checks them, and stricter where transformers only warns: a key the
        method requires (linear's ``factor``, llama3's ``low_freq_factor``, ...) must be present; a default
        transformers fills is filled the same way (``original_max_position_embeddings`` from
        ``max_position_embeddings`` for yarn, llama3 and longrope); a key the method does not use is logged
        (logger ``ropekit.hf_config``) and ignored, so Hub configs with stray keys still load.

        Raises:
            ValueError: naming the key, for an unreadable config, a ``rope_scaling`` / ``rope_parameters``
                that is not a dict, an unknown rope_type, a missing required key, a scaling factor below 1
                (linear, dynamic, yarn, llama3, longrope: transformers only warns, then shrinks the context),
                a schedule that needs the pre-training context length (yarn, longrope) in a config that
                names no length at all, or any other bad value.
        """
        from ropekit.hf_config import rope_kwargs

        return cls._from_hf_kwargs({**rope_kwargs(config, layer_type=layer_type), **overrides})

    @classmethod
    def _from_hf_kwargs(cls, kwargs: dict[str, Any]) -> RopeConfig:
        """A config from :func:`ropekit.hf_config.rope_kwargs`' output, refused where transformers would take
        a default that a dict does not carry."""
        from ropekit.hf_config import USES_ORIGINAL_LENGTH

        rope = cls(**kwargs)
        if (
            rope.rope_type in USES_ORIGINAL_LENGTH
            and rope._spec.get("original_max_position_embeddings", rope.max_position_embeddings) is None
        ):  # transformers fills it from its config class's default max_position_embeddings
            raise ValueError(
                f"config['max_position_embeddings']: rope_type {rope.rope_type!r} needs the pre-training "
                "context length, and the config names neither max_position_embeddings nor rope_scaling's "
                "original_max_position_embeddings (transformers would take its model class's default "
                "max_position_embeddings, which a plain dict does not carry); add one of them, or pass "
                "max_position_embeddings=..."
            )
        return rope

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> RopeConfig:
        """A well-known model's RoPE, from the facts in :mod:`ropekit.presets`.

        ``ropekit presets`` lists the names.

        Raises:
            ValueError: for an unknown name, listing the known ones.
        """
        from ropekit.presets import preset_kwargs

        return cls(**{**preset_kwargs(name), **overrides})

    # -- schedule ------------------------------------------------------------------------------------------
    @property
    def rope_type(self) -> str:
        """The registered schedule name ("default", "linear", "yarn", ...)."""
        return self._schedule.name

    @property
    def mrope_section(self) -> tuple[int, ...] | None:
        """M-RoPE pairs per position axis (temporal, height, width), or None for 1-D RoPE."""
        return None if self._mrope is None else self._mrope[0]

    @property
    def mrope_interleaved(self) -> bool:
        """True for Qwen3-VL's interleaved M-RoPE layout, False for any other layout (or no M-RoPE)."""
        return self.mrope_layout == "interleaved"

    @property
    def mrope_layout(self) -> str | None:
        """The M-RoPE layout ("chunked", "interleaved", "ernie"; see ropekit.schedules.mrope), or None."""
        return None if self._mrope is None else self._mrope[1]

    @property
    def schedule(self) -> Schedule:
        """The registered schedule this config uses (name, keys, length behaviour)."""
        return self._schedule

    @property
    def length_dependent(self) -> bool:
        """True when frequencies depend on seq_len (dynamic NTK, LongRoPE)."""
        return self._schedule.length_dependent

    def _compute(self, seq_len: int | None) -> tuple[torch.Tensor, float]:
        if seq_len is not None:
            # 0 is an empty sequence, as transformers' init functions take it: no longer than any length
            seq_len = check_int("seq_len", seq_len, minimum=0, expected="an integer >= 0 or None")
        inv_freq, scaling = self._schedule.fn(self._spec, seq_len)
        return inv_freq.to(torch.float64), float(scaling)

    def inv_freq(self, seq_len: int | None = None) -> torch.Tensor:
        """Angular frequencies theta_i, float64, shape (rotary_dim // 2,)."""
        return self._compute(seq_len)[0]

    def attention_scaling(self, seq_len: int | None = None) -> float:
        """Factor the cos/sin tables are multiplied by (1.0 unless a schedule such as YaRN sets it)."""
        return self._compute(seq_len)[1]

    def is_mrope_positions(self, positions: torch.Tensor) -> bool:
        """True when positions is (axes, batch, seq) for this config's M-RoPE sections."""
        return (
            self._mrope is not None
            and isinstance(positions, torch.Tensor)
            and positions.dim() == 3
            and positions.shape[0] == len(self._mrope[0])
        )

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
            positions: an int n (meaning arange(n)) or an integer/float tensor of any shape. With M-RoPE
                (``mrope_section`` in the scaling dict), a 3-D tensor (axes, batch, seq) whose first axis has
                one entry per section (temporal, height, width) gives each frequency pair the position of its
                own axis; any other shape is read as text positions (t = h = w), which is plain 1-D RoPE.
            dtype: output dtype; angles are always computed in float64 first.
            seq_len: the sequence length length-dependent schedules should assume.
            device: output device; defaults to positions' device (or CPU).

        Returns:
            (cos, sin), each of shape ``positions.shape + (rotary_dim // 2,)``; for M-RoPE positions
            (axes, batch, seq), shape (batch, seq, rotary_dim // 2).
        """
        if isinstance(positions, bool) or not isinstance(positions, (int, torch.Tensor)):
            raise ValueError(f"positions: expected an int or a tensor, got {positions!r:.80}")
        if isinstance(positions, int):
            if positions < 0:
                raise ValueError(
                    f"positions: expected a non-negative int n (meaning arange(n)), got {positions}"
                )
            positions = torch.arange(positions, dtype=torch.float64, device=device)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype: expected a floating-point dtype, got {dtype}")
        inv_freq, scale = self._compute(seq_len)
        device = positions.device if device is None else torch.device(device)
        check_movable("positions", positions, device, where="the requested device")
        positions = positions.to(device=device, dtype=torch.float64)
        if self.is_mrope_positions(positions):
            axis = mrope_axis_of_pair(*self._mrope).to(device)  # (rotary_dim // 2,)
            per_axis = positions[..., None] * inv_freq.to(device)  # (axes, batch, seq, rotary_dim // 2)
            # Pair j takes the angle of its own axis: gather along the axes dimension.
            index = axis.expand(1, *per_axis.shape[1:])  # (1, batch, seq, rotary_dim // 2)
            angles = per_axis.gather(0, index)[0]  # (batch, seq, rotary_dim // 2)
            cos, sin = torch.cos(angles), torch.sin(angles)
            if scale != 1.0:
                cos, sin = cos * scale, sin * scale
            return cos.to(dtype), sin.to(dtype)
        inv_freq = inv_freq.to(device)
        half = inv_freq.shape[0]
        cos = torch.empty(*positions.shape, half, dtype=dtype, device=device)  # (..., rotary_dim // 2)
        sin = torch.empty_like(cos)
        flat_pos, flat_cos, flat_sin = positions.reshape(-1), cos.view(-1, half), sin.view(-1, half)
        # Float64 angles a chunk of rows at a time: a big table never holds a float64 copy of itself, so
        # building it peaks near its own size (a float32 table would otherwise cost 4x its bytes on top).
        # (Compiled code fuses the whole computation, so it takes the rows in one piece, and never loops over
        # a symbolic length: that would specialize a dynamic sequence length to the traced one.)
        compiling = is_compiling()
        rows = flat_pos.shape[0] if compiling else max(1, COS_SIN_CHUNK_ELEMENTS // half)
        for start in (0,) if compiling else range(0, flat_pos.shape[0], rows):
            angles = flat_pos[start : start + rows, None] * inv_freq  # (rows, rotary_dim // 2) float64
            chunk_sin, chunk_cos = angles.sin(), angles.cos_()
            if scale != 1.0:
                chunk_sin, chunk_cos = chunk_sin * scale, chunk_cos * scale
            flat_sin[start : start + rows] = chunk_sin
            flat_cos[start : start + rows] = chunk_cos
        return cos, sin

    # -- attention scale and per-role tables (docs/scaling.md, "Attention scale") ------------------------
    def softmax_scale(self, head_dim: int) -> float:
        """The factor attention scores q.k are multiplied by before the softmax, as this RoPE implies it.

        1 / sqrt(head_dim) for every schedule, times DeepSeek's mscale(factor, mscale_all_dim)^2 when the
        scaling dict sets ``mscale_all_dim`` (YaRN in MLA models; the tables then carry only
        mscale / mscale_all_dim). Plain YaRN's temperature lives in the tables instead
        (:meth:`attention_scaling`), and Llama 4's per-position tuning in :meth:`attention_temperature`.

        Args:
            head_dim: the width q.k runs over. For MLA (DeepSeek) that is qk_nope_head_dim +
                qk_rope_head_dim, not the rotated slice this config describes.

        Raises:
            ValueError: for a head_dim that is not a positive integer.
        """
        factor = self._spec.factor_or_length_ratio() if self._spec.get("mscale_all_dim") else None
        return softmax_scale(self.scaling, factor, head_dim)

    def attention_temperature(
        self, positions: torch.Tensor, *, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """The per-position query multiplier a model applies beside this RoPE (all ones without one).

        With ``floor_scale`` and ``attn_scale`` in the scaling dict (``from_hf`` copies them from a Llama 4
        config whose ``attn_temperature_tuning`` is set), the query at position p is multiplied by
        1 + attn_scale * ln(1 + floor((p + 1) / floor_scale)) in layers that apply no RoPE. With
        ``llama_4_scaling_beta`` (Ministral 3, Mistral 4), every layer multiplies it by
        1 + beta * ln(1 + floor(p / original_max_position_embeddings)). Multiply :meth:`softmax_scale` by it
        for the equivalent per-query softmax scale; :func:`ropekit.model_rope` says which layers apply it.

        Args:
            positions: integer tensor of query positions (any shape).
            dtype: output dtype.

        Returns:
            a tensor shaped like positions.
        """
        return attention_temperature(self.scaling, positions, dtype)

    def dual_chunk_cos_sin(
        self,
        positions: torch.Tensor,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> DualChunkTables:
        """Dual chunk attention's tables (rope_type "dual_chunk", Qwen2.5-1M): one (cos, sin) per role.

        Keys are rotated with ``.key``; the query once per attention it takes part in: ``.intra`` (its own
        chunk), ``.succ`` (the previous chunk), ``.inter`` (older chunks), and vLLM's ``.succ_critical`` /
        ``.inter_critical``. The positions behind them are :func:`ropekit.schedules.dual_chunk_positions`.

        Args:
            positions: integer tensor of token positions (any shape).
            dtype: output dtype (angles in float64).
            device: output device; defaults to positions' device.

        Returns:
            :class:`ropekit.schedules.DualChunkTables`; each cos / sin has shape positions.shape +
            (rotary_dim // 2,).

        Raises:
            ValueError: when this config's rope_type is not "dual_chunk", or for bad positions.
        """
        if self.rope_type != "dual_chunk":
            raise ValueError(
                f"rope_type: dual_chunk_cos_sin needs rope_type 'dual_chunk' (chunk_size, local_size), "
                f"got {self.rope_type!r}"
            )
        roles = dual_chunk_positions(
            positions, self._spec.params["chunk_size"], self._spec.params["local_size"]
        )
        return DualChunkTables(*(self.cos_sin(p, dtype=dtype, device=device) for p in roles))


def config_from(config: RopeConfig | None, config_kwargs: Mapping[str, Any]) -> RopeConfig:
    """A module's config: the RopeConfig it was given, or one built from its keyword arguments (not both).

    Raises:
        ValueError: for both, or for a config that is not a RopeConfig.
    """
    if config is None:
        return RopeConfig(**config_kwargs)
    if config_kwargs:
        raise ValueError(
            f"config_kwargs: pass either a RopeConfig or its keyword arguments, not both; got config and "
            f"{sorted(config_kwargs)}"
        )
    if not isinstance(config, RopeConfig):
        raise ValueError(f"config: expected a RopeConfig or None, got {type(config).__name__}")
    return config


def _frozen(value: Any) -> Any:
    """A read-only deep copy: mappings become FrozenScaling, lists and tuples become tuples."""
    if isinstance(value, Mapping):
        return FrozenScaling(value)
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return copy.deepcopy(value)


class FrozenScaling(Mapping):
    """A read-only, hashable copy of a scaling dict (nested lists stored as tuples).

    It compares equal to a dict with the same items, reads like one (``scaling["factor"]``, ``dict(scaling)``,
    ``{**scaling}``), pickles and deep-copies, but has no way to change an item.
    """

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_items", {key: _frozen(value) for key, value in items.items()})

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("FrozenScaling is read-only; build a new RopeConfig with the changed dict")

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return repr(self._items)

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenScaling, (self._items,))

    def to_dict(self) -> dict[str, Any]:
        """A plain, mutable deep copy (nested tuples become lists again), e.g. for JSON."""
        return {key: _thawed(value) for key, value in self._items.items()}


def _thawed(value: Any) -> Any:
    if isinstance(value, FrozenScaling):
        return value.to_dict()
    if isinstance(value, tuple):
        return [_thawed(v) for v in value]
    return value


def _rotary_dim_from_scaling(scaling: Any, head_dim: int, rotary_dim: int | None, base: float) -> int | None:
    """Reconcile the geometry keys HF keeps inside rope_parameters with the explicit arguments."""
    if not isinstance(scaling, Mapping):
        return rotary_dim
    theta = scaling.get("rope_theta")
    if theta is not None and check_base(theta) != base:
        raise ValueError(
            f"scaling['rope_theta']: {theta!r} disagrees with base={base!r}; "
            f"pass base={theta!r} (or drop the key)"
        )
    factor = scaling.get("partial_rotary_factor")
    kind = scaling.get("rope_type", scaling.get("type"))
    if factor is None or kind == "proportional":  # proportional reads the factor itself, over the full width
        return rotary_dim
    check_fraction("scaling['partial_rotary_factor']", factor)
    implied = int(head_dim * factor)
    if rotary_dim is not None and rotary_dim != implied:
        raise ValueError(
            f"rotary_dim: {rotary_dim} disagrees with scaling['partial_rotary_factor'] = {factor} "
            f"(int(head_dim * factor) = {implied})"
        )
    return implied
