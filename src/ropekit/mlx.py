"""RoPE for MLX arrays (``pip install ropekit[mlx]``): ropekit's tables, rotated with ``mx`` ops.

Tables come from :class:`ropekit.RopeConfig` on the host, angles in float64 (every scaling type, preset and
``from_hf`` config), and only then become ``mx.array`` rows; nothing here re-derives a schedule. Two paths
rotate them (docs/mlx.md):

* the table path (the default): rows gathered from the table by position, the pair rotation in float32 in
  the torch backend's order of operations, so it equals ``ropekit.apply_rotary(..., backend="torch")`` bit
  for bit, at any position (rows past the table are formed on the host, in float64, for the positions
  asked);
* ``mx.fast.rope`` (``RotaryEmbedding(..., fast=True)``), handed the config's frequencies through
  ``freqs=``. It forms each angle in float32, so its error grows with the position (about position x 2^-23
  radians: 1e-4 at position 4096, 1.5 at 2^24); variants it cannot express (an attention factor multiplying
  cos and sin, M-RoPE, per-token positions) take the table path.

Layouts: ``mx.fast.rope`` reads axis -2 as the sequence axis, so a (B, T, H, D) tensor passed straight to it
is rotated by head index instead of position. Every call here names its layout ("bthd" or "bhtd"); both
rotate by sequence position.

Shape notation: B batch, T sequence, H heads, D head_dim, R rotary_dim, P = R / 2 pairs, L table rows,
A position axes (M-RoPE).
Pair layout: interleaved=False is the "half" / GPT-NeoX / Hugging Face pairing (i, i + R/2); interleaved=True
is GPT-J / Meta's (2i, 2i+1), ``mx.fast.rope``'s ``traditional=True``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import torch

from ropekit.config import RopeConfig
from ropekit.schedules import mrope_axis_of_pair
from ropekit.validation import check_bool, check_int, check_rotary_position, describe

__all__ = ["LAYOUTS", "RotaryEmbedding", "apply_rotary", "cos_sin"]

LAYOUTS = ("bthd", "bhtd")
# Rows a RotaryEmbedding keeps by default: two (8192, 64) float32 tables are 4 MB; rows past them are formed
# on the host per call, with the same float64 angles, so the table length changes speed, never results.
DEFAULT_TABLE_LEN = 8192
_MX_DTYPES = {torch.float32: mx.float32, torch.float16: mx.float16, torch.bfloat16: mx.bfloat16}


def cos_sin(
    config: RopeConfig,
    positions: int | np.ndarray | mx.array,
    *,
    dtype: mx.Dtype = mx.float32,
    seq_len: int | None = None,
) -> tuple[mx.array, mx.array]:
    """``config.cos_sin`` as mx arrays: angles formed on the host in float64, then cast to ``dtype``.

    Args:
        config: the model's RoPE.
        positions: an int n (arange(n)) or an integer array of any shape; for an M-RoPE config, (A, B, T)
            gives each pair the position of its own axis (as :meth:`ropekit.RopeConfig.cos_sin`).
        dtype: mx.float32, mx.float16 or mx.bfloat16.
        seq_len: the sequence length a length-dependent schedule (dynamic NTK, LongRoPE) assumes.

    Returns:
        (cos, sin), each ``positions.shape + (P,)`` ((B, T, P) for M-RoPE positions), times the config's
        attention scaling.

    Raises:
        ValueError: for a config that is not a RopeConfig, bad positions or an unsupported dtype.
    """
    if not isinstance(config, RopeConfig):
        raise ValueError(f"config: expected a ropekit.RopeConfig, got {describe(config)}")
    torch_dtype = {v: k for k, v in _MX_DTYPES.items()}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype: expected mx.float32, mx.float16 or mx.bfloat16, got {dtype!r}")
    if not isinstance(positions, int) or isinstance(positions, bool):
        positions = torch.from_numpy(_host_ints("positions", positions))
    cos, sin = config.cos_sin(positions, dtype=torch_dtype, seq_len=seq_len)  # float64 angles, one rounding
    # NumPy has no bfloat16: the rows cross as float32, which holds every float16 / bfloat16 value exactly
    return mx.array(cos.float().numpy()).astype(dtype), mx.array(sin.float().numpy()).astype(dtype)


def apply_rotary(
    x: mx.array,
    cos: mx.array,
    sin: mx.array,
    *,
    layout: str,
    positions: mx.array | np.ndarray | None = None,
    offsets: int | mx.array | np.ndarray = 0,
    interleaved: bool = False,
    rotary_position: str = "first",
) -> mx.array:
    """Rotate x with cos/sin tables in plain mx ops, as :func:`ropekit.apply_rotary` does on torch tensors.

    Args:
        x: (B, T, H, D) for layout="bthd", (B, H, T, D) for layout="bhtd". Any float dtype; the rotation
            runs in float32 (float64 stays float64) and the output has x's dtype and layout.
        cos, sin: tables (L, P) with row p serving position p (:func:`cos_sin`); features past R = 2P pass
            through (partial rotary).
        layout: "bthd" or "bhtd"; there is no default, because the two cannot be told apart by shape.
        positions: optional integer (B, T): the table row of each token. Mutually exclusive with non-zero
            offsets.
        offsets: int or integer (B,) array added to arange(T): KV-cache decoding, left padding.
        interleaved: pair layout (module docstring).
        rotary_position: "first" (features [0, R) rotate) or "last" (features [D - R, D): DeepSeek's
            NoPE-first heads).

    Returns:
        the rotated array, shaped like x.

    Raises:
        ValueError: naming the argument, for a wrong rank or layout, tables that do not fit x, positions or
            offsets of the wrong shape or dtype, or rows outside the table.
    """
    x_bthd = _as_bthd(x, layout)
    batch, seq = x_bthd.shape[:2]
    _check_tables(cos, sin, x.shape[-1])
    rows = _rows(positions, offsets, batch, seq)  # (B, T) host ints, >= 0
    if rows.size and rows.max() >= cos.shape[0]:
        raise ValueError(
            f"positions: position {int(rows.max())} is outside the cos/sin table (table_len "
            f"{cos.shape[0]}); expected 0 <= position < table_len"
        )
    index = mx.array(rows)
    out = _rotate_rows(
        x_bthd, mx.take(cos, index, axis=0), mx.take(sin, index, axis=0), interleaved, rotary_position
    )
    return _from_bthd(out, layout)


class RotaryEmbedding:
    """A RopeConfig's tables and frequencies for mx arrays, built once on the host in float64.

    Args:
        config: the model's RoPE (:class:`ropekit.RopeConfig`: presets, ``from_hf``, any scaling type).
        table_len: rows kept as mx arrays; positions past them are formed on the host per call.
        seq_len: the length a length-dependent schedule (dynamic NTK, LongRoPE's short / long switch)
            assumes; build one embedding per length. None: the schedule's own default.
        fast: rotate with ``mx.fast.rope`` where it expresses the config (a plain frequency list: no
            attention factor on cos and sin, no M-RoPE positions, no per-token positions). Faster, but its
            float32 angles drift from the float64 tables as positions grow (docs/mlx.md: the measured error).

    Attributes:
        cos, sin: (table_len, P) float32 tables.
        freqs: what ``mx.fast.rope`` takes as ``freqs=`` (the period 1 / theta_i of each pair), float32 (P,).
        fast: whether offsets-only calls use ``mx.fast.rope`` (asked for, and the config allows it).
    """

    def __init__(
        self,
        config: RopeConfig,
        *,
        table_len: int = DEFAULT_TABLE_LEN,
        seq_len: int | None = None,
        fast: bool = False,
    ) -> None:
        if not isinstance(config, RopeConfig):
            raise ValueError(f"config: expected a ropekit.RopeConfig, got {describe(config)}")
        self.config = config
        self.table_len = check_int("table_len", table_len)
        self.seq_len = seq_len
        self.cos, self.sin = cos_sin(config, self.table_len, seq_len=seq_len)
        inv_freq = config.inv_freq(seq_len)  # float64 (P,)
        self.freqs = mx.array((1.0 / inv_freq).numpy().astype(np.float32))  # (P,)
        self.fast = check_bool("fast", fast) and config.attention_scaling(seq_len) == 1.0
        self._axis_of_pair = None
        if config.mrope_section is not None:
            axis = mrope_axis_of_pair(config.mrope_section, config.mrope_layout)  # (P,)
            self._axis_of_pair = mx.array(axis.numpy().astype(np.int32))

    def __call__(
        self,
        x: mx.array,
        *,
        layout: str,
        offsets: int | mx.array | np.ndarray = 0,
        positions: mx.array | np.ndarray | None = None,
    ) -> mx.array:
        """Rotate x by its tokens' positions.

        Args:
            x: (B, T, H, D) for layout="bthd", (B, H, T, D) for layout="bhtd"; D = config.head_dim.
            layout: "bthd" or "bhtd" (no default: the two cannot be told apart by shape).
            offsets: int or integer (B,) array added to arange(T).
            positions: optional integer (B, T) position of each token; for an M-RoPE config also (A, B, T),
                one row of positions per axis (temporal, height, width). Mutually exclusive with non-zero
                offsets.

        Returns:
            the rotated array, x's shape, dtype and layout.

        Raises:
            ValueError: naming the argument, for a wrong rank, layout or head_dim, or bad positions or
                offsets.
        """
        config = self.config
        x_bthd = _as_bthd(x, layout)
        if x.shape[-1] != config.head_dim:
            raise ValueError(
                f"x: expected head_dim {config.head_dim} (the config's) in the last axis, got shape {x.shape}"
            )
        batch, seq = x_bthd.shape[:2]
        axes = None if self._axis_of_pair is None else len(config.mrope_section)
        if positions is not None and axes is not None and np.ndim(positions) == 3:
            rows = _mrope_rows(positions, offsets, axes, batch, seq)  # (A, B, T)
            cos, sin = self._gather_mrope(rows)
        elif self.fast and positions is None:
            return _from_bthd(self._fast(x_bthd, offsets), layout)
        else:
            rows = _rows(positions, offsets, batch, seq)  # (B, T)
            cos, sin = self._gather(rows)
        out = _rotate_rows(x_bthd, cos, sin, config.interleaved, config.rotary_position)
        return _from_bthd(out, layout)

    def _gather(self, rows: np.ndarray) -> tuple[mx.array, mx.array]:
        """(B, T, P) rows: from the table, or, past it, formed on the host for exactly these positions."""
        if rows.size == 0 or rows.max() < self.table_len:
            index = mx.array(rows)
            return mx.take(self.cos, index, axis=0), mx.take(self.sin, index, axis=0)
        return cos_sin(self.config, rows, seq_len=self.seq_len)

    def _gather_mrope(self, rows: np.ndarray) -> tuple[mx.array, mx.array]:
        """(B, T, P) rows where pair j reads the position of its own axis a_j:
        cos[b, t, j] = table[rows[a_j, b, t], j]."""
        if rows.size and rows.max() >= self.table_len:
            return cos_sin(self.config, rows, seq_len=self.seq_len)
        pairs = self.cos.shape[-1]
        per_pair = mx.take(mx.array(rows), self._axis_of_pair, axis=0)  # (P, B, T)
        flat = mx.transpose(per_pair, (1, 2, 0)) * pairs + mx.arange(pairs, dtype=mx.int32)  # (B, T, P)
        return mx.take(self.cos.reshape(-1), flat), mx.take(self.sin.reshape(-1), flat)

    def _fast(self, x_bthd: mx.array, offsets: int | mx.array | np.ndarray) -> mx.array:
        """mx.fast.rope, which reads axis -2 as the sequence axis: it gets (B, H, T, R) views."""
        batch = x_bthd.shape[0]
        offset = _offsets(offsets, batch)
        if isinstance(offset, np.ndarray):
            offset = mx.array(offset.astype(np.int32))
        config = self.config
        width = config.rotary_dim
        start = config.head_dim - width if config.rotary_position == "last" else 0
        x_bhtd = mx.swapaxes(x_bthd, 1, 2)  # (B, H, T, D)
        part = x_bhtd[..., start:] if start else x_bhtd  # mx.fast.rope rotates the leading features
        out = mx.fast.rope(
            part, width, traditional=config.interleaved, base=None, scale=1.0, offset=offset, freqs=self.freqs
        )  # (B, H, T, D - start)
        if start:
            out = mx.concatenate([x_bhtd[..., :start], out], axis=-1)  # (B, H, T, D)
        return mx.swapaxes(out, 1, 2)  # (B, T, H, D)


# -- shared helpers -------------------------------------------------------------------------------------


def _as_bthd(x: mx.array, layout: str) -> mx.array:
    """x as a (B, T, H, D) view, after the checks every entry point shares."""
    if not isinstance(x, mx.array):
        raise ValueError(f"x: expected an mx.array, got {describe(x)}")
    if layout not in LAYOUTS:
        raise ValueError(
            f"layout: expected 'bthd' (B, T, H, D) or 'bhtd' (B, H, T, D), got {describe(layout)}"
        )
    if x.ndim != 4:
        raise ValueError(f"x: expected a 4-D array in layout {layout!r}, got shape {x.shape}")
    if not mx.issubdtype(x.dtype, mx.floating):
        raise ValueError(f"x: expected a floating-point array, got {x.dtype}")
    return x if layout == "bthd" else mx.swapaxes(x, 1, 2)


def _from_bthd(out: mx.array, layout: str) -> mx.array:
    return out if layout == "bthd" else mx.swapaxes(out, 1, 2)


def _check_tables(cos: mx.array, sin: mx.array, head_dim: int) -> None:
    for name, table in (("cos", cos), ("sin", sin)):
        if not isinstance(table, mx.array) or table.ndim != 2:
            raise ValueError(
                f"{name}: expected a 2-D mx.array (table_len, rotary_dim / 2), got {describe(table)}"
            )
    if cos.shape != sin.shape:
        raise ValueError(f"sin: expected cos's shape {cos.shape}, got {sin.shape}")
    if not 0 < 2 * cos.shape[1] <= head_dim:
        raise ValueError(
            f"cos: expected rotary_dim / 2 columns with 0 < rotary_dim <= head_dim ({head_dim}), "
            f"got shape {cos.shape}"
        )


def _host_ints(name: str, value: object) -> np.ndarray:
    """An integer mx / NumPy array as int64 NumPy (one evaluation of the positions, never of x)."""
    if isinstance(value, mx.array):
        if not mx.issubdtype(value.dtype, mx.integer):
            raise ValueError(f"{name}: expected an integer array, got {value.dtype} of shape {value.shape}")
        return np.array(value).astype(np.int64)
    if isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.integer):
        return value.astype(np.int64)
    raise ValueError(f"{name}: expected an integer mx.array or NumPy array, got {describe(value)}")


def _offsets(offsets: object, batch: int) -> int | np.ndarray:
    """An int >= 0, or a (B,) int64 array of offsets >= 0."""
    if isinstance(offsets, int) and not isinstance(offsets, bool):
        value = offsets
    else:
        value = _host_ints("offsets", offsets)
        if value.ndim == 0:
            value = int(value)
        elif value.shape != (batch,):
            raise ValueError(
                f"offsets: expected an int or shape ({batch},) (one per sequence), got {value.shape}"
            )
    if np.any(np.asarray(value) < 0):
        raise ValueError(f"offsets: expected offsets >= 0, got {np.asarray(value).min()}")
    return value


def _rows(positions: object, offsets: object, batch: int, seq: int) -> np.ndarray:
    """(B, T) int64 table rows: positions as given, or offsets + arange(T)."""
    if positions is None:
        offset = _offsets(offsets, batch)
        rows = np.asarray(offset, dtype=np.int64).reshape(-1, 1) + np.arange(seq)  # (1 or B, T)
        return np.broadcast_to(rows, (batch, seq))
    if not (isinstance(offsets, int) and offsets == 0):
        raise ValueError(f"offsets: expected 0 when positions are given, got {describe(offsets)}")
    rows = _host_ints("positions", positions)
    if rows.shape != (batch, seq):
        raise ValueError(f"positions: expected shape ({batch}, {seq}) (batch, seq), got {rows.shape}")
    return _non_negative(rows)


def _mrope_rows(positions: object, offsets: object, axes: int, batch: int, seq: int) -> np.ndarray:
    """(A, B, T) int64 M-RoPE positions, one row of positions per axis."""
    if not (isinstance(offsets, int) and offsets == 0):
        raise ValueError(f"offsets: expected 0 when positions are given, got {describe(offsets)}")
    rows = _host_ints("positions", positions)
    if rows.shape != (axes, batch, seq):
        raise ValueError(
            f"positions: expected shape (batch, seq) = ({batch}, {seq}) or, per M-RoPE axis, "
            f"({axes}, {batch}, {seq}), got {rows.shape}"
        )
    return _non_negative(rows)


def _non_negative(rows: np.ndarray) -> np.ndarray:
    if rows.size and rows.min() < 0:
        raise ValueError(f"positions: expected positions >= 0, got {int(rows.min())}")
    return rows


def _rotate_rows(
    x: mx.array, cos: mx.array, sin: mx.array, interleaved: bool, rotary_position: str
) -> mx.array:
    """x (B, T, H, D) rotated by per-token rows cos, sin (B, T, P), in the torch backend's operation order
    (ropekit.backends.eager.rotary.rotate): float32 a*c - b*s and b*c + a*s, then cast to x's dtype."""
    check_bool("interleaved", interleaved)
    check_rotary_position(rotary_position)
    pairs = cos.shape[-1]
    width = 2 * pairs
    start = x.shape[-1] - width if rotary_position == "last" else 0
    compute = mx.float64 if x.dtype == mx.float64 else mx.float32
    c = cos.astype(compute)[:, :, None, :]  # (B, T, 1, P): one row serves every head
    s = sin.astype(compute)[:, :, None, :]
    part = x[..., start : start + width]  # (B, T, H, R)
    if interleaved:
        a, b = part[..., 0::2], part[..., 1::2]  # (B, T, H, P) each
    else:
        a, b = part[..., :pairs], part[..., pairs:]
    a, b = a.astype(compute), b.astype(compute)
    ra = a * c - b * s
    rb = b * c + a * s
    if interleaved:
        rotated = mx.stack([ra, rb], axis=-1).reshape(part.shape)  # (B, T, H, R): (2i, 2i+1) again
    else:
        rotated = mx.concatenate([ra, rb], axis=-1)  # (B, T, H, R)
    rotated = rotated.astype(x.dtype)
    pieces = [x[..., :start], rotated, x[..., start + width :]]
    return mx.concatenate([p for p in pieces if p.shape[-1]], axis=-1)  # (B, T, H, D)
