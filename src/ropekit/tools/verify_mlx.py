"""The MLX rows of ``ropekit verify --framework mlx``: :mod:`ropekit.mlx` against the float64 reference and
the torch path (docs/mlx.md states what each row proves). Needs the [mlx] extra, imported only when called."""

from __future__ import annotations

import numpy as np
import torch

from ropekit.config import RopeConfig
from ropekit.tools.verify import Check
from ropekit.tools.verify_framework import (
    FAR_POSITION,
    PAIRINGS,
    bit_row,
    far_position_row,
    reference_rows,
    run_framework_checks,
    tables_row,
    torch_path,
)
from ropekit.validation import check_int

__all__ = ["FAR_POSITION", "FAST_BOUNDS", "mlx_checks", "run_mlx_checks"]

DTYPES = ("float32", "float16", "bfloat16")
# mx.fast.rope's documented bound below position 64 (docs/mlx.md, "Measured bounds"): the largest difference
# from the torch path in units of the dtype's eps times the input's largest magnitude.
FAST_BOUNDS = {"float32": 32.0, "float16": 2.0}
# The fast rows' tokens: two sequences at offsets 0 and FAST_TOKENS, so every position is below 64.
FAST_TOKENS = 32
HEADS = 3  # != any sequence length used here, so a (B, T, H, D) array read as (B, H, T, D) is caught


def run_mlx_checks(config: RopeConfig, *, seed: int = 0) -> list[Check]:
    """``ropekit verify --framework mlx``: the theorem checks of :func:`ropekit.tools.verify.run_checks`
    (float64, no torch backend rows), then :func:`mlx_checks`.

    Raises:
        ValueError: naming the framework, where mlx is not installed (or the config, where it is not a
            RopeConfig).
    """
    return run_framework_checks(config, "mlx", ("mlx",), mlx_checks, seed=seed)


def mlx_checks(
    config: RopeConfig, rng: np.random.Generator, n_positions: int = 8, max_position: int = 4096
) -> list[Check]:
    """One row per claim about :mod:`ropekit.mlx` (row names say what each compares).

    The partial-rotary rows use a plain config of the same head_dim, base and pairing, rotating the config's
    rotary_dim where that is below head_dim, else half the head (the first features, then the last).

    Raises:
        ValueError: naming the argument, for n_positions or max_position that are not positive integers, or
            n_positions equal to HEADS (the layout rows need T != H).
    """
    import mlx.core as mx

    import ropekit.mlx as rm

    check_int("n_positions", n_positions, expected=f"a positive integer other than {HEADS} (the heads)")
    if n_positions == HEADS:
        raise ValueError(
            f"n_positions: expected a positive integer other than {HEADS} (the heads: the layout rows need "
            f"T != H), got {n_positions}"
        )
    check_int("max_position", max_position)

    def host(a: mx.array) -> np.ndarray:  # NumPy has no bfloat16: float32 holds every value exactly
        return np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)

    rows = []
    positions, (cos, sin), (torch_cos, torch_sin), row = tables_row(
        "mlx", rm.cos_sin, config, rng, n_positions, max_position
    )
    rows.append(row)
    length = int(positions.max()) + 1

    x = rng.standard_normal((1, n_positions, HEADS, config.head_dim))  # (B, T, H, D)
    pos = positions.reshape(1, n_positions)  # (B, T)

    def rotate(x64, dtype_name, interleaved):
        stored = mx.array(np.asarray(x64, np.float32)).astype(getattr(mx, dtype_name))
        got = rm.apply_rotary(
            stored, cos, sin, layout="bthd", positions=mx.array(pos), interleaved=interleaved
        )
        return host(stored).astype(np.float64), host(got).astype(np.float64)

    rows += reference_rows(
        "mlx: apply_rotary {dtype} ({pairing}) = float64 reference (error / bound)",
        x, positions, config, DTYPES, rotate,
    )  # fmt: skip
    x32 = np.asarray(x, np.float32)
    for interleaved, pairing in PAIRINGS:
        got = rm.apply_rotary(
            mx.array(x32), cos, sin, layout="bthd", positions=mx.array(pos), interleaved=interleaved
        )
        want = torch_path(x32, torch_cos, torch_sin, pos, interleaved=interleaved)
        rows.append(
            bit_row(f"mlx: apply_rotary float32 ({pairing}) = torch backend, bit for bit", [got], [want])
        )

    # The module on two sequences: both layouts, then offsets, each against the torch path at the positions.
    seq = n_positions
    xb = np.asarray(rng.standard_normal((2, seq, HEADS, config.head_dim)), np.float32)  # (B, T, H, D)
    rope = rm.RotaryEmbedding(config, table_len=length + seq)
    tables = config.cos_sin(length + seq)
    at = np.broadcast_to(np.arange(seq), (2, seq)).copy()  # (B, T)
    want = _torch_rows(xb, tables, at, config)
    bthd = rope(mx.array(xb), layout="bthd")
    bhtd = mx.swapaxes(rope(mx.swapaxes(mx.array(xb), 1, 2), layout="bhtd"), 1, 2)
    rows.append(
        bit_row(f"mlx: layouts bthd and bhtd (T={seq}, H={HEADS}) = torch backend, bit for bit",
                [bthd, bhtd], [want, want])
    )  # fmt: skip
    offset = int(length // 2)
    got = [
        rope(mx.array(xb), layout="bthd", offsets=mx.array([0, offset])),
        rope(mx.array(xb), layout="bthd", offsets=offset),
    ]
    want = [
        _torch_rows(xb, tables, at + np.array([[0], [offset]]), config),
        _torch_rows(xb, tables, at + offset, config),
    ]
    rows.append(
        bit_row(
            f"mlx: offsets [0, {offset}] and {offset} = torch backend at offsets + arange(T), bit for bit",
            got,
            want,
        )
    )

    # Partial rotary, the rotated features first and last.
    width = config.rotary_dim if config.rotary_dim < config.head_dim else max(2, 2 * (config.head_dim // 4))
    partials = {
        place: RopeConfig(
            config.head_dim,
            config.base,
            rotary_dim=width,
            interleaved=config.interleaved,
            rotary_position=place,
        )
        for place in ("first", "last")
    }
    for place, partial in partials.items():
        got = rm.RotaryEmbedding(partial, table_len=length + seq)(
            mx.array(xb), layout="bthd", offsets=mx.array([0, offset])
        )
        want = _torch_rows(xb, partial.cos_sin(length + seq), at + np.array([[0], [offset]]), partial)
        rows.append(
            bit_row(
                f"mlx: partial rotary ({place} {width} of {config.head_dim}) = torch backend, bit for bit",
                [got],
                [want],
            )
        )

    # mx.fast.rope below position 64, within its documented bound of the torch path; both layouts (it reads
    # axis -2 as the sequence axis), and partial rotary with the rotated features last.
    xf = np.asarray(rng.standard_normal((2, FAST_TOKENS, HEADS, config.head_dim)), np.float32)  # (B, T, H, D)
    fast_at = np.arange(FAST_TOKENS) + np.array([[0], [FAST_TOKENS]])  # (B, T)
    cases = [
        (config, "float32", "bthd"),
        (config, "float32", "bhtd"),
        (config, "float16", "bthd"),
        (partials["last"], "float32", "bthd"),
    ]
    for case, dtype_name, layout in cases:
        fast = rm.RotaryEmbedding(case, table_len=2 * FAST_TOKENS, fast=True)
        stored = mx.array(xf).astype(getattr(mx, dtype_name))
        arg = stored if layout == "bthd" else mx.swapaxes(stored, 1, 2)
        out = fast(arg, layout=layout, offsets=mx.array([0, FAST_TOKENS]))
        out = host(out if layout == "bthd" else mx.swapaxes(out, 1, 2)).astype(np.float64)
        exact_in = host(stored)
        want = _torch_rows(exact_in.astype(dtype_name), case.cos_sin(2 * FAST_TOKENS), fast_at, case)
        bound = FAST_BOUNDS[dtype_name]
        scale = float(np.finfo(dtype_name).eps) * float(np.abs(exact_in).max())
        what = "" if case is config else f", partial (last {width} of {config.head_dim})"
        rows.append(
            Check(
                f"mlx: fast=True {dtype_name} layout {layout}{what}, positions < {2 * FAST_TOKENS}, vs torch "
                f"backend (error / {bound:g} eps max|x|)",
                float(np.abs(out - want.astype(np.float64)).max()) / (bound * scale),
                1.0,
            )
        )

    # Far out: the module's rows past its table, formed on the host at 2^24, vs the float64 reference.
    far_rope = rm.RotaryEmbedding(config, table_len=16)
    rows.append(
        far_position_row(
            "mlx: position 2^24, float32 = float64 reference (norm of the error, unit vectors)", x, config,
            lambda unit, far: np.array(far_rope(mx.array(unit), layout="bthd", positions=mx.array(far))),
        )
    )  # fmt: skip
    return rows


def _torch_rows(
    x: np.ndarray, tables: tuple[torch.Tensor, torch.Tensor], at: np.ndarray, config: RopeConfig
) -> np.ndarray:
    """x (B, T, H, D) rotated by the torch backend at positions at (B, T), with the config's pairing and
    rotated features."""
    cos, sin = tables
    return torch_path(x, cos, sin, at, interleaved=config.interleaved, rotary_position=config.rotary_position)
