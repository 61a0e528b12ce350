"""ropekit on JAX / Flax: ropekit's float64 tables handed to JAX, the rotation on ``jax.Array``.

Install with ``pip install ropekit[jax]``. Tables come from :class:`ropekit.RopeConfig` (every scaling type,
presets, ``from_hf``): angles are formed in float64 on the host, then cast, so a row is as exact at position
2^24 as at position 3. Nothing here re-derives a schedule.

Shape notation:
    B batch, S sequence, T total tokens of a packed batch, H heads, D head_dim, R rotary_dim, L table rows.

Pair layout (the model families disagree; pick the one your checkpoint was trained with):
    interleaved=False: "half" / GPT-NeoX / Hugging Face / MaxText pairing, features (i, i + R/2).
    interleaved=True: GPT-J / Meta pairing, features (2i, 2i+1).

Everything a call receives may be a traced array: positions, offsets, segment ids and cu_seqlens are read as
arrays, never as Python numbers, so ``jax.jit`` traces a function once per shape, whatever the step.
Value checks (a position past the table, malformed cu_seqlens) raise ``ValueError`` where the values are
concrete (eager calls); under ``jax.jit`` they cannot, and a row outside the table reads as NaN instead of a
silently clamped row. docs/jax.md states the precision and how results compare with the torch path.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

try:
    import jax
    import jax.numpy as jnp
    from flax import nnx
except ImportError as error:  # pragma: no cover - the extra is not installed
    raise ImportError("ropekit.jax needs jax and flax: pip install 'ropekit[jax]'") from error

from ropekit.config import RopeConfig, config_from
from ropekit.module import LAYOUT_SHAPES, LAYOUTS
from ropekit.schedules import mrope_axis_of_pair
from ropekit.validation import check_bool, check_even, check_int, check_positive, check_rotary_position

__all__ = [
    "MaxTextRotaryEmbedding",
    "RotaryEmbedding",
    "apply_rotary",
    "cos_sin",
    "far_tables",
]

# Far rows: a position p = sum_j p_j K^j (K = 2^FAR_BITS) turns by the sum of its digits' angles, each digit's
# cos / sin read from a float64-exact table of K rows; FAR_LEVELS digits cover every position below 2^33.
FAR_BITS = 11
FAR_LEVELS = 3
FAR_LIMIT = 1 << (FAR_BITS * FAR_LEVELS)
# A module's default direct table (bit-identical to the torch path's rows): the config's context length,
# at most this many rows (rows past it are composed from the far tables).
DEFAULT_MAX_LEN = 32768


def _describe(value: Any) -> str:
    """A received value for a message: arrays by dtype and shape, anything else by a short repr."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"a {value.dtype} array of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _concrete(value: Any) -> np.ndarray | None:
    """The values of an array known now (an eager call), or None for a traced one."""
    try:
        return np.asarray(value)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return None


# -- tables ----------------------------------------------------------------------------------------------
def _host_cos_sin(config: RopeConfig, positions: np.ndarray, seq_len: int | None) -> tuple[np.ndarray, ...]:
    cos, sin = config.cos_sin(torch.from_numpy(positions), dtype=torch.float64, seq_len=seq_len)
    return cos.numpy(), sin.numpy()


def cos_sin(
    config: RopeConfig, length: int, *, seq_len: int | None = None, dtype: Any = jnp.float32
) -> tuple[jax.Array, jax.Array]:
    """The (L, R/2) cos / sin table of positions 0 .. length - 1, for :func:`apply_rotary`.

    The rows are :meth:`ropekit.RopeConfig.cos_sin`'s (float64 angles, attention scaling included), cast to
    dtype: bit for bit the table ropekit's torch path rotates with.

    Args:
        config: the model's RoPE (``RopeConfig.preset(...)``, ``RopeConfig.from_hf(...)``, ...).
        length: rows in the table: one more than the largest position it serves.
        seq_len: the sequence length a length-dependent schedule (dynamic NTK, LongRoPE) assumes.
        dtype: the table's dtype (float32; float64 needs ``jax_enable_x64``).

    Raises:
        ValueError: for a config that is not a RopeConfig or a negative length.
    """
    if not isinstance(config, RopeConfig):
        raise ValueError(f"config: expected a ropekit.RopeConfig, got {_describe(config)}")
    length = check_int("length", length, minimum=0, expected="an integer >= 0 (the table's rows)")
    cos, sin = _host_cos_sin(config, np.arange(length, dtype=np.float64), seq_len)
    return jnp.asarray(cos, dtype=dtype), jnp.asarray(sin, dtype=dtype)


def far_tables(config: RopeConfig, *, seq_len: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Tables that serve any position below 2^33 in 3 x 2048 rows: (cos, sin) of (FAR_LEVELS, K, R/2).

    Level j, row m holds the unscaled cos / sin of the angle at position m * K^j (K = 2^11), each exact in
    float64 before its cast; a row is composed from one row of each level by the angle-addition formula
    (:func:`_far_rows`), then multiplied by the attention scaling (the third array, a scalar).
    """
    K = 1 << FAR_BITS
    digits = np.arange(K, dtype=np.float64)
    scale = config.attention_scaling(seq_len)
    levels = [_host_cos_sin(config, digits * float(K**j), seq_len) for j in range(FAR_LEVELS)]
    cos = np.stack([c for c, _ in levels]) / scale  # (levels, K, R/2): the tables carry no scaling
    sin = np.stack([s for _, s in levels]) / scale
    return jnp.asarray(cos, jnp.float32), jnp.asarray(sin, jnp.float32), jnp.asarray(scale, jnp.float32)


def _far_rows(far: tuple[jax.Array, ...], positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos / sin rows (..., R/2) of positions (...,) composed from :func:`far_tables`, in float32."""
    cos_levels, sin_levels, scale = far
    mask = (1 << FAR_BITS) - 1
    p = positions if positions.dtype == jnp.int64 else positions.astype(jnp.int32)
    c, s = cos_levels[0][p & mask], sin_levels[0][p & mask]  # (..., R/2)
    for j in range(1, FAR_LEVELS):
        digit = (p >> (FAR_BITS * j)) & mask
        cj, sj = cos_levels[j][digit], sin_levels[j][digit]
        c, s = c * cj - s * sj, s * cj + c * sj  # cos / sin of the sum of the two angles
    return c * scale, s * scale


def _table_rows(cos: jax.Array, sin: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rows of positions (...,), (..., R/2); a position outside [0, L) reads NaN (only a traced call gets
    one: an eager call was refused before)."""
    length = cos.shape[0]
    inside = (positions >= 0) & (positions < length)
    index = jnp.where(inside, positions, length)  # length: out of bounds, filled
    take = dict(axis=0, mode="fill", fill_value=jnp.nan)
    return jnp.take(cos, index, **take), jnp.take(sin, index, **take)


# -- positions -------------------------------------------------------------------------------------------
def _check_layout(layout: Any) -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {_describe(layout)}")
    return layout


def _check_x(name: str, x: Any, layout: str) -> None:
    rank = 3 if layout == "thd" else 4
    if not isinstance(x, (jax.Array, np.ndarray)) or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name}: expected a floating-point jax.Array, got {_describe(x)}")
    if x.ndim != rank:
        raise ValueError(
            f"{name}: expected a {rank}-D array {LAYOUT_SHAPES[layout]} for layout {layout!r}, "
            f"got {_describe(x)}"
        )


def _integer_array(name: str, value: Any, shape: tuple[int, ...], expected: str) -> jax.Array:
    if not isinstance(value, (jax.Array, np.ndarray)) or not jnp.issubdtype(value.dtype, jnp.integer):
        raise ValueError(f"{name}: expected an integer array {expected}, got {_describe(value)}")
    if tuple(value.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape} {expected}, got {_describe(value)}")
    return jnp.asarray(value)


def _segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Positions restarting at 0 where the segment id changes along the last axis (packed sequences)."""
    index = jnp.arange(segment_ids.shape[-1], dtype=jnp.int32)
    first = jnp.concatenate(
        [jnp.ones_like(segment_ids[..., :1], bool), segment_ids[..., 1:] != segment_ids[..., :-1]], axis=-1
    )
    start = jax.lax.cummax(jnp.where(first, index, 0), axis=segment_ids.ndim - 1)  # each token's first
    return index - start


def _tokens(x_shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """x's token axes: (B, S) for the 4-D layouts, (T,) for "thd"."""
    if layout == "thd":
        return (x_shape[0],)
    batch, seq = {"bshd": (0, 1), "bhsd": (0, 2), "sbhd": (1, 0)}[layout]
    return (x_shape[batch], x_shape[seq])


def _positions(
    x_shape: tuple[int, ...], layout: str, positions: Any, offsets: Any, segment_ids: Any, cu_seqlens: Any
) -> jax.Array:
    """Each token's position: (B, S) for the 4-D layouts, (T,) for "thd"."""
    tokens = _tokens(x_shape, layout)
    given = [n for n, v in (("positions", positions), ("segment_ids", segment_ids)) if v is not None]
    if cu_seqlens is not None:
        given.append("cu_seqlens")
        if layout != "thd":
            raise ValueError(f"cu_seqlens: only layout 'thd' takes cu_seqlens, got layout {layout!r}")
    if len(given) > 1:
        raise ValueError(
            f"{given[1]}: expected at most one of positions, segment_ids, cu_seqlens, got {given}"
        )
    plain_offsets = isinstance(offsets, int) and not isinstance(offsets, bool) and offsets == 0
    if given and given[0] != "cu_seqlens" and not plain_offsets:
        raise ValueError(
            f"offsets: {given[0]} name every position already; expected 0, got {_describe(offsets)}"
        )
    shape_text = "(total_tokens,)" if layout == "thd" else "(batch, seq)"
    if positions is not None:
        pos = _integer_array("positions", positions, tokens, shape_text)
        _check_nonnegative("positions", pos)
        return pos
    if segment_ids is not None:
        return _segment_positions(_integer_array("segment_ids", segment_ids, tokens, shape_text))
    if layout == "thd":
        if cu_seqlens is None:
            raise ValueError("cu_seqlens: layout 'thd' needs cu_seqlens, segment_ids or positions, got None")
        return _packed_positions(cu_seqlens, offsets, tokens[0])
    index = jnp.arange(tokens[1], dtype=jnp.int32)[None, :]  # (1, S)
    return index + _offsets(offsets, tokens[0], "(batch,)")[:, None]  # (B, S)


def _offsets(offsets: Any, count: int, expected: str) -> jax.Array:
    """offsets as a (count,) integer array: an int for every sequence, or one each."""
    if isinstance(offsets, (int, np.integer)) and not isinstance(offsets, bool):
        offsets = check_int("offsets", offsets, minimum=0, expected="an integer >= 0 or an integer array")
        return jnp.full((count,), offsets, jnp.int32)
    if isinstance(offsets, (jax.Array, np.ndarray)) and offsets.ndim == 0:
        offsets = jnp.broadcast_to(offsets, (count,))
    off = _integer_array("offsets", offsets, (count,), f"{expected} (one per sequence) or a scalar")
    _check_nonnegative("offsets", off)
    return off


def _packed_positions(cu_seqlens: Any, offsets: Any, tokens: int) -> jax.Array:
    """(T,) positions of a packed batch: each sequence counts from its own 0 (plus its offset)."""
    if (
        not isinstance(cu_seqlens, (jax.Array, np.ndarray))
        or not jnp.issubdtype(cu_seqlens.dtype, jnp.integer)
        or cu_seqlens.ndim != 1
        or cu_seqlens.shape[0] < 2
    ):
        raise ValueError(
            "cu_seqlens: expected a 1-D integer array (N+1,) of cumulative lengths, "
            f"got {_describe(cu_seqlens)}"
        )
    values = _concrete(cu_seqlens)
    if values is not None and (values[0] != 0 or values[-1] != tokens or (np.diff(values) < 0).any()):
        raise ValueError(
            f"cu_seqlens: expected non-decreasing values from 0 to total_tokens ({tokens}), "
            f"got {values.tolist()!r:.80}"
        )
    index = jnp.arange(tokens, dtype=jnp.int32)
    sequence = jnp.searchsorted(cu_seqlens, index, side="right") - 1  # (T,): each token's sequence
    off = _offsets(offsets, cu_seqlens.shape[0] - 1, "(N,)")
    return index - cu_seqlens[sequence].astype(jnp.int32) + off[sequence]


def _check_nonnegative(name: str, values: jax.Array) -> None:
    found = _concrete(values)
    if found is not None and found.size and found.min() < 0:
        raise ValueError(f"{name}: expected values >= 0, got {int(found.min())}")


def _check_in_table(positions: jax.Array, length: int) -> None:
    found = _concrete(positions)
    if found is not None and found.size and found.max() >= length:
        raise ValueError(
            f"positions: position {int(found.max())} is outside the cos/sin table (table_len {length}); "
            "expected 0 <= position < table_len"
        )


# -- the rotation ----------------------------------------------------------------------------------------
def _rotate(
    x: jax.Array,
    c: jax.Array,
    s: jax.Array,
    layout: str,
    *,
    interleaved: bool,
    inverse: bool,
    rotary_position: str,
) -> jax.Array:
    """Rotate x by per-token rows c, s ((B, S, R/2), or (T, R/2) for "thd"), torch backend's order:
    (a, b) -> (a c - b s, b c + a s) in float32 (float64 stays float64), cast back to x's dtype."""
    compute = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    if layout == "sbhd":
        c, s = jnp.swapaxes(c, 0, 1), jnp.swapaxes(s, 0, 1)  # (S, B, R/2)
    axis = -3 if layout == "bhsd" else -2  # where the heads axis sits relative to the rows
    c, s = jnp.expand_dims(c, axis).astype(compute), jnp.expand_dims(s, axis).astype(compute)
    if inverse:
        s = -s
    half = c.shape[-1]
    rot = 2 * half
    start = x.shape[-1] - rot if rotary_position == "last" else 0
    part = x[..., start : start + rot]  # (..., R)
    if interleaved:
        a, b = part[..., 0::2], part[..., 1::2]  # (..., R/2) each
    else:
        a, b = part[..., :half], part[..., half:]
    a, b = a.astype(compute), b.astype(compute)
    ra = a * c - b * s
    rb = b * c + a * s
    if interleaved:
        rotated = jnp.stack((ra, rb), axis=-1).reshape(part.shape)  # (..., R), pairs (2i, 2i+1)
    else:
        rotated = jnp.concatenate((ra, rb), axis=-1)
    rotated = rotated.astype(x.dtype)
    return jnp.concatenate((x[..., :start], rotated, x[..., start + rot :]), axis=-1)


def _check_flags(interleaved: Any, inverse: Any, rotary_position: Any) -> None:
    check_bool("interleaved", interleaved)
    check_bool("inverse", inverse)
    check_rotary_position(rotary_position, _describe)


def apply_rotary(
    x: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    *,
    positions: jax.Array | None = None,
    offsets: int | jax.Array = 0,
    segment_ids: jax.Array | None = None,
    cu_seqlens: jax.Array | None = None,
    layout: str = "bshd",
    interleaved: bool = False,
    inverse: bool = False,
    rotary_position: str = "first",
) -> jax.Array:
    """Apply rotary position embeddings to a jax.Array: :func:`ropekit.apply_rotary` for JAX.

    Args:
        x: laid out as ``layout`` says: "bshd" (B, S, H, D) (default), "bhsd" (B, H, S, D), "sbhd"
            (S, B, H, D), "thd" (T, H, D) packed. Any float dtype; math runs in float32 (float64 stays
            float64) and the output has x's dtype.
        cos, sin: tables (L, R/2) from :func:`cos_sin`; row p serves position p. Features of x past R pass
            through unchanged (partial rotary).
        positions: integer (B, S), or (T,) for "thd": each token's table row.
        offsets: an int, a scalar or a (B,) integer array ((N,) with cu_seqlens) added to arange(S): a
            KV-cache decode step, left padding. Pass a traced array under jit: no retrace per step.
        segment_ids: integer (B, S), or (T,) for "thd": packed sequences; positions restart at 0 wherever
            the id changes.
        cu_seqlens: "thd" only: integer (N+1,) cumulative sequence lengths, from 0 to T.
        layout: one of LAYOUTS.
        interleaved: pair layout; False = half / GPT-NeoX, True = GPT-J (module docstring).
        inverse: rotate by -theta (undo the rotation).
        rotary_position: "first" (features [0, R) rotate) or "last" ([D - R, D) rotate, NoPE first).

    Returns:
        The rotated array, shaped like x.

    Raises:
        ValueError: naming the argument, the value and what was expected: a wrong rank or dtype, tables of
            different shapes or wider than D, more than one of positions / segment_ids / cu_seqlens, offsets
            beside positions or segment ids, positions of the wrong shape, negative or (eager calls) past the
            table, malformed cu_seqlens.
    """
    layout = _check_layout(layout)
    _check_x("x", x, layout)
    _check_tables(cos, sin, x.shape[-1])
    _check_flags(interleaved, inverse, rotary_position)
    pos = _positions(x.shape, layout, positions, offsets, segment_ids, cu_seqlens)
    _check_in_table(pos, cos.shape[0])
    c, s = _table_rows(cos, sin, pos)
    return _rotate(x, c, s, layout, interleaved=interleaved, inverse=inverse, rotary_position=rotary_position)


def _check_tables(cos: Any, sin: Any, head_dim: int) -> None:
    for name, t in (("cos", cos), ("sin", sin)):
        if (
            not isinstance(t, (jax.Array, np.ndarray))
            or not jnp.issubdtype(t.dtype, jnp.floating)
            or t.ndim != 2
        ):
            raise ValueError(
                f"{name}: expected a 2-D floating-point table (table_len, rotary_dim // 2), "
                f"got {_describe(t)}"
            )
    if cos.shape != sin.shape:
        raise ValueError(f"sin: expected cos's shape {tuple(cos.shape)}, got {_describe(sin)}")
    if 2 * cos.shape[1] > head_dim or cos.shape[1] == 0:
        raise ValueError(
            f"cos: expected (table_len, rotary_dim // 2) with 0 < rotary_dim <= head_dim ({head_dim}), "
            f"got {_describe(cos)}"
        )


# -- modules ---------------------------------------------------------------------------------------------
class RotaryEmbedding(nnx.Module):
    """A Flax nnx module that owns ropekit's tables and rotates q and k.

    Args:
        config: a :class:`ropekit.RopeConfig`; or None, and pass its arguments as keywords (``head_dim=64``).
        max_len: rows of the direct table (default: the config's max_position_embeddings, at most 32768).
            Positions below it read exactly the rows the torch path reads; positions at or past it (up to
            2^33) are composed from :func:`far_tables` (float64-exact digits, a few float32 ulps).
        layout: as in :func:`apply_rotary`.
        seq_len: the sequence length a length-dependent schedule (dynamic NTK, LongRoPE) is built for: the
            tables are fixed at construction (as ``CosSinCache.freeze`` fixes the torch module's).

    M-RoPE configs (``mrope_section``) take positions (axes, B, S) (temporal, height, width), or (axes, T)
    for "thd", as the torch module does; (B, S) positions are text positions (plain RoPE).

    The tables are plain arrays on the module (nnx data, not ``nnx.Param``): an optimizer over ``nnx.Param``
    never touches them.

    Example:
        >>> rope = RotaryEmbedding(RopeConfig.preset("llama-3.1-8b"), max_len=8192)
        >>> q, k = rope(q, k, offsets=step)  # q (B, S, H, D); step a traced int under jit
    """

    def __init__(
        self,
        config: RopeConfig | None = None,
        *,
        max_len: int | None = None,
        layout: str = "bshd",
        seq_len: int | None = None,
        **config_kwargs: Any,
    ) -> None:
        config = config_from(config, config_kwargs)
        if max_len is None:
            max_len = min(config.max_position_embeddings or DEFAULT_MAX_LEN, DEFAULT_MAX_LEN)
        max_len = check_int("max_len", max_len, minimum=1, expected="a positive integer (table rows)")
        self.config, self.layout, self.seq_len = config, _check_layout(layout), seq_len
        self.cos, self.sin = cos_sin(config, max_len, seq_len=seq_len)  # (L, R/2) each
        self.far_cos, self.far_sin, self.far_scale = far_tables(config, seq_len=seq_len)
        mrope = config.mrope_section is not None
        axis = mrope_axis_of_pair(config.mrope_section, config.mrope_layout).numpy() if mrope else None
        # M-RoPE: which position axis turns each frequency pair, (R/2,); None for 1-D RoPE
        self.axis_of_pair = jnp.asarray(axis, jnp.int32) if mrope else None

    def rows(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """cos / sin rows (..., R/2) of integer positions (...,): the direct table's below max_len, composed
        far rows past it."""
        shape = tuple(getattr(positions, "shape", ()))
        positions = _integer_array("positions", positions, shape, "of any shape")
        _check_nonnegative("positions", positions)
        near_cos, near_sin = _table_rows(self.cos, self.sin, positions)
        far_cos, far_sin = _far_rows((self.far_cos, self.far_sin, self.far_scale), positions)
        near = (positions < self.cos.shape[0])[..., None]
        bad = positions < 0  # NaN, as a traced row past any table reads
        if jnp.iinfo(positions.dtype).max >= FAR_LIMIT:
            _check_in_table(positions, FAR_LIMIT)
            bad = bad | (positions >= FAR_LIMIT)
        bad = bad[..., None]
        return (
            jnp.where(bad, jnp.nan, jnp.where(near, near_cos, far_cos)),
            jnp.where(bad, jnp.nan, jnp.where(near, near_sin, far_sin)),
        )

    def __call__(
        self,
        q: jax.Array,
        k: jax.Array | None = None,
        *,
        positions: jax.Array | None = None,
        offsets: int | jax.Array = 0,
        segment_ids: jax.Array | None = None,
        cu_seqlens: jax.Array | None = None,
        inverse: bool = False,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """Rotate q (and k) laid out as ``self.layout``; positions, offsets, segment_ids, cu_seqlens and
        inverse as in :func:`apply_rotary`. Returns q rotated, or (q, k) rotated when k is given.

        Raises:
            ValueError: as :func:`apply_rotary`, and for a q / k whose head_dim is not the config's.
        """
        config = self.config
        check_bool("inverse", inverse)
        for name, t in (("q", q), ("k", k)):
            if t is None:
                continue
            _check_x(name, t, self.layout)
            if t.shape[-1] != config.head_dim:
                raise ValueError(
                    f"{name}: expected head_dim {config.head_dim} (the config's), got {_describe(t)}"
                )
        if k is not None and _tokens(k.shape, self.layout) != _tokens(q.shape, self.layout):
            raise ValueError(
                f"k: expected q's token axes {_tokens(q.shape, self.layout)} ({LAYOUT_SHAPES[self.layout]}), "
                f"got {_describe(k)}"
            )
        if (
            self.axis_of_pair is not None
            and getattr(positions, "ndim", 0) == len(_tokens(q.shape, self.layout)) + 1
        ):
            c, s = self._mrope_rows(q.shape, positions, offsets)
        else:
            c, s = self.rows(_positions(q.shape, self.layout, positions, offsets, segment_ids, cu_seqlens))
        flags = dict(interleaved=config.interleaved, inverse=inverse, rotary_position=config.rotary_position)
        out_q = _rotate(q, c, s, self.layout, **flags)
        return out_q if k is None else (out_q, _rotate(k, c, s, self.layout, **flags))

    def _mrope_rows(self, q_shape, positions, offsets) -> tuple[jax.Array, jax.Array]:
        """M-RoPE rows from positions (axes, B, S), or (axes, T) for "thd": pair j takes the row of its own
        axis's position, as :meth:`ropekit.RopeConfig.cos_sin` builds it."""
        tokens, axes = _tokens(q_shape, self.layout), len(self.config.mrope_section)
        shape_text = f"(axes={axes}, {'total_tokens' if self.layout == 'thd' else 'batch, seq'}) for M-RoPE"
        if not (isinstance(offsets, int) and not isinstance(offsets, bool) and offsets == 0):
            raise ValueError(
                f"offsets: M-RoPE positions name every position already; expected 0, got {offsets!r}"
            )
        c, s = self.rows(
            _integer_array("positions", positions, (axes, *tokens), shape_text)
        )  # (axes, ..., R/2)
        index = jnp.broadcast_to(self.axis_of_pair, c.shape[1:])[None]  # (1, ..., R/2)
        return jnp.take_along_axis(c, index, axis=0)[0], jnp.take_along_axis(s, index, axis=0)[0]


class MaxTextRotaryEmbedding(RotaryEmbedding):
    """A drop-in for MaxText's ``RotaryEmbedding(min_timescale, max_timescale, embedding_dims)(inputs,
    position)``: the same call, with ropekit's float64-exact rows in place of float32 angles.

    MaxText turns feature pair i (half pairing) by position / timescale_i with timescale_i = min_timescale *
    (max_timescale / min_timescale)^(2i / embedding_dims) * rope_linear_scaling_factor; that is RoPE with
    base max_timescale / min_timescale and linear scaling by min_timescale * rope_linear_scaling_factor.

    Args:
        min_timescale, max_timescale: MaxText's geometric range (1 and the RoPE base in its configs).
        embedding_dims: the head width the inputs must have (even).
        mesh, shard_mode, rngs: accepted for MaxText's signature, unused.
        cast_as_fprop_dtype, fprop_dtype: cast the output to fprop_dtype (MaxText's defaults: True, bfloat16).
        rope_linear_scaling_factor: MaxText's linear scaling (1.0: none).
        max_len: as in :class:`RotaryEmbedding`.

    Differences from MaxText's: angles are exact (float64) rather than float32 (docs/jax.md measures both),
    and the rotation runs in float32 whatever the input dtype (MaxText casts sin / cos to the input's dtype
    first).

    Raises:
        ValueError: an odd or non-integer embedding_dims, timescales that do not give a base > 1, or a
            min_timescale * rope_linear_scaling_factor below 1 (it would shrink positions).
    """

    def __init__(
        self,
        min_timescale: float,
        max_timescale: float,
        embedding_dims: int = 0,
        *,
        mesh: Any = None,
        cast_as_fprop_dtype: bool = True,
        fprop_dtype: Any = jnp.bfloat16,
        shard_mode: Any = None,
        rope_linear_scaling_factor: float = 1.0,
        rngs: Any = None,
        max_len: int | None = None,
    ) -> None:
        embedding_dims = check_even("embedding_dims", embedding_dims)
        min_timescale = check_positive("min_timescale", min_timescale)
        max_timescale = check_positive("max_timescale", max_timescale)
        factor = min_timescale * check_positive("rope_linear_scaling_factor", rope_linear_scaling_factor)
        if not factor >= 1.0:
            raise ValueError(
                "rope_linear_scaling_factor: min_timescale * rope_linear_scaling_factor must be >= 1 "
                f"(ropekit's linear scaling), got {min_timescale} * {rope_linear_scaling_factor!r}"
            )
        scaling = None if factor == 1.0 else {"rope_type": "linear", "factor": factor}
        config = RopeConfig(embedding_dims, max_timescale / min_timescale, scaling=scaling)
        super().__init__(config, max_len=max_len, layout="bshd")
        self.min_timescale, self.max_timescale, self.embedding_dims = (
            min_timescale,
            max_timescale,
            embedding_dims,
        )
        self.cast_as_fprop_dtype = check_bool("cast_as_fprop_dtype", cast_as_fprop_dtype)
        self.fprop_dtype = fprop_dtype

    def __call__(self, inputs: jax.Array, position: jax.Array | None = None) -> jax.Array:  # type: ignore[override]
        """inputs (B, S, N, H) rotated at position (B, S) (required, as in MaxText)."""
        if position is None:
            raise ValueError(
                "position: expected an integer array (batch, seq), got None (MaxText requires it)"
            )
        if isinstance(position, (jax.Array, np.ndarray)) and jnp.issubdtype(position.dtype, jnp.floating):
            position = position.astype(jnp.int32)  # MaxText's positions may come as floats of whole numbers
        out = super().__call__(inputs, positions=position)
        return out.astype(self.fprop_dtype) if self.cast_as_fprop_dtype else out
