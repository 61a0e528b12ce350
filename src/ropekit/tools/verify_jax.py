"""The JAX rows of ``ropekit verify --framework jax``: :mod:`ropekit.jax` against the float64 reference and
the torch path (docs/jax.md states what each row proves). Needs the [jax] extra, imported only when called."""

from __future__ import annotations

import numpy as np
import torch

from ropekit import reference as ref
from ropekit.config import RopeConfig
from ropekit.tools.verify import Check, backend_error_bound
from ropekit.tools.verify_framework import (
    FAR_POSITION,
    bit_row,
    far_position_row,
    pair_ulps,
    reference_rows,
    run_framework_checks,
    tables_row,
    torch_path,
)

__all__ = ["FAR_POSITION", "jax_checks", "run_jax_checks"]

# Steps of a jitted decode loop whose offsets change each step: it must trace once.
STEPS = 4
DTYPES = ("float32", "bfloat16")


def run_jax_checks(config: RopeConfig, *, seed: int = 0) -> list[Check]:
    """``ropekit verify --framework jax``: the theorem checks of :func:`ropekit.tools.verify.run_checks`
    (float64, no torch backend rows), then :func:`jax_checks`.

    Raises:
        ValueError: naming the framework, where jax or flax is not installed (or the config, where it is not
            a RopeConfig).
    """
    return run_framework_checks(config, "jax", ("jax", "flax"), jax_checks, seed=seed)


def jax_checks(
    config: RopeConfig, rng: np.random.Generator, n_positions: int = 8, max_position: int = 4096
) -> list[Check]:
    """One row per claim about :mod:`ropekit.jax` (row names say what each compares)."""
    import jax
    import jax.numpy as jnp

    import ropekit.jax as rj

    check, bound = Check, backend_error_bound

    rows = []
    theta = ref.inv_freq(config.rotary_dim, config.base)
    positions, (cos, sin), (torch_cos, torch_sin), row = tables_row(
        "jax", rj.cos_sin, config, rng, n_positions, max_position
    )
    rows.append(row)

    x = rng.standard_normal((1, n_positions, 3, config.head_dim))  # (batch, seq, heads, head_dim)
    pos = jnp.asarray(positions.reshape(1, n_positions))  # (batch, seq)
    # a function of its own each run: jit's cache never serves a trace of another run's ropekit.jax
    rotate_jit = jax.jit(lambda *a, **kw: rj.apply_rotary(*a, **kw), static_argnames=("interleaved",))

    def rotate(x64, dtype_name, interleaved):
        stored = jnp.asarray(x64, jnp.float32).astype(dtype_name)
        got = rotate_jit(stored, cos, sin, positions=pos, interleaved=interleaved)
        stored, got = stored.astype(jnp.float32), got.astype(jnp.float32)
        return np.asarray(stored, np.float64), np.asarray(got, np.float64)

    rows += reference_rows(
        "jax: apply_rotary jit {dtype} ({pairing}) = float64 reference (error / bound)",
        x, positions, config, DTYPES, rotate,
    )  # fmt: skip
    x32 = np.asarray(x, np.float32)
    eager = np.asarray(rj.apply_rotary(jnp.asarray(x32), cos, sin, positions=pos))
    torch_out = torch_path(x32, torch_cos, torch_sin, positions.reshape(1, -1))
    rows.append(bit_row("jax: apply_rotary eager float32 = torch backend, bit for bit", [eager], [torch_out]))
    compiled = np.asarray(rotate_jit(jnp.asarray(x32), cos, sin, positions=pos))
    rows.append(
        check("jax: apply_rotary jit float32 vs torch backend (ulps of the pair's magnitude)",
              pair_ulps(compiled, torch_out, x32, config), 1.0)
    )  # fmt: skip

    # Backward is the inverse rotation.
    g = rng.standard_normal(x.shape)
    grad = jax.grad(
        lambda t: jnp.sum(rj.apply_rotary(t, cos, sin, positions=pos) * jnp.asarray(g, jnp.float32))
    )
    got = np.asarray(grad(jnp.asarray(x32)), np.float64)
    want = ref.rotate_half(np.asarray(np.float32(g), np.float64), -positions[None, :, None], theta)
    error = np.abs(got - want) / bound(want, torch.float32, float(np.abs(g).max()))
    rows.append(check("jax: grad = inverse rotation (error / bound)", float(error.max()), 1.0))

    # One trace for a decode loop whose offsets change every step.
    traces = []

    def step(t, offsets):
        traces.append(1)
        return rj.apply_rotary(t, cos, sin, offsets=offsets)

    step_jit = jax.jit(step)
    for t in range(STEPS):
        step_jit(jnp.asarray(x32[:, :1]), jnp.asarray([t], jnp.int32))
    rows.append(check(f"jax: jit traces of {STEPS} decode steps - 1", float(len(traces) - 1), 0.0))

    # Far out: the module's composed rows at 2^24, unit vectors, vs the float64 reference.
    rope = rj.RotaryEmbedding(config, max_len=16)
    rows.append(
        far_position_row(
            "jax: position 2^24, float32 = float64 reference (norm of the error, unit vectors)", x, config,
            lambda unit, far: rope(jnp.asarray(unit), positions=jnp.asarray(far, jnp.int32)),
        )
    )  # fmt: skip
    return rows
