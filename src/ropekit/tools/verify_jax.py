"""The JAX rows of ``ropekit verify --framework jax``: :mod:`ropekit.jax` against the float64 reference and
the torch path (docs/jax.md states what each row proves). Needs the [jax] extra, imported only when called."""

from __future__ import annotations

import numpy as np
import torch

from ropekit import reference as ref
from ropekit.config import RopeConfig
from ropekit.functional import apply_rotary as torch_apply_rotary
from ropekit.tools.verify import Check, backend_error_bound, run_checks

__all__ = ["FAR_POSITION", "jax_checks", "run_jax_checks"]

# The far position the precision row rotates at (docs/jax.md's table): float32 angles are O(1) off there.
FAR_POSITION = 1 << 24
# Steps of a jitted decode loop whose offsets change each step: it must trace once.
STEPS = 4
DTYPES = ("float32", "bfloat16")


def run_jax_checks(config: RopeConfig, *, seed: int = 0) -> list[Check]:
    """``ropekit verify --framework jax``: the theorem checks of :func:`ropekit.tools.verify.run_checks`
    (float64, no torch backend rows), then :func:`jax_checks`.

    Raises:
        ValueError: naming the framework, where jax or flax is not installed.
    """
    import importlib.util

    if importlib.util.find_spec("jax") is None or importlib.util.find_spec("flax") is None:
        raise ValueError("framework: 'jax' needs jax and flax installed: pip install 'ropekit[jax]'")
    return run_checks(config, seed=seed, backends=[]) + jax_checks(config, np.random.default_rng(seed))


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
    positions = rng.integers(0, max_position, size=n_positions)
    length = int(positions.max()) + 1
    cos, sin = rj.cos_sin(config, length)
    torch_cos, torch_sin = config.cos_sin(length)
    table_error = max(
        float(np.abs(np.asarray(cos) - torch_cos.numpy()).max()),
        float(np.abs(np.asarray(sin) - torch_sin.numpy()).max()),
    )
    rows.append(check("jax: cos_sin = RopeConfig.cos_sin (torch), bit for bit", table_error, 0.0))

    x = rng.standard_normal((1, n_positions, 3, config.head_dim))  # (batch, seq, heads, head_dim)
    pos = jnp.asarray(positions.reshape(1, n_positions))  # (batch, seq)
    # a function of its own each run: jit's cache never serves a trace of another run's ropekit.jax
    rotate_jit = jax.jit(lambda *a, **kw: rj.apply_rotary(*a, **kw), static_argnames=("interleaved",))
    for dtype_name in DTYPES:
        stored = jnp.asarray(x, jnp.float32).astype(dtype_name)
        exact_in = np.asarray(stored.astype(jnp.float32), np.float64)
        scale = float(np.abs(exact_in).max())
        torch_dtype = getattr(torch, dtype_name)
        for interleaved, layout in ((False, "half"), (True, "interleaved")):
            rotate = ref.rotate_interleaved if interleaved else ref.rotate_half
            want = rotate(exact_in, positions[None, :, None], theta)
            got = rotate_jit(stored, cos, sin, positions=pos, interleaved=interleaved)
            got = np.asarray(got.astype(jnp.float32), np.float64)
            error = np.abs(got - want) / bound(want, torch_dtype, scale)
            rows.append(
                check(f"jax: apply_rotary jit {dtype_name} ({layout}) = float64 reference (error / bound)",
                      float(error.max()), 1.0)
            )  # fmt: skip
    x32 = np.asarray(x, np.float32)
    eager = np.asarray(rj.apply_rotary(jnp.asarray(x32), cos, sin, positions=pos))
    torch_out = torch_apply_rotary(
        torch.from_numpy(x32), torch_cos, torch_sin, positions=torch.from_numpy(positions.reshape(1, -1)),
        backend="torch",
    ).numpy()  # fmt: skip
    rows.append(
        check(
            "jax: apply_rotary eager float32 = torch backend, bit for bit",
            float(np.abs(eager - torch_out).max()),
            0.0,
        )
    )
    compiled = np.asarray(rotate_jit(jnp.asarray(x32), cos, sin, positions=pos))
    rows.append(
        check("jax: apply_rotary jit float32 vs torch backend (ulps of the pair's magnitude)",
              _pair_ulps(compiled, torch_out, x32, config), 1.0)
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
    unit = x32[:, :, :1] / np.linalg.norm(x32[:, :, :1], axis=-1, keepdims=True)
    far = FAR_POSITION + np.arange(n_positions)
    rotate = ref.rotate_interleaved if config.interleaved else ref.rotate_half
    exact = rotate(unit.astype(np.float64), far[None, :, None], theta)
    got = np.asarray(rope(jnp.asarray(unit), positions=jnp.asarray(far[None, :], jnp.int32)))
    rows.append(
        check("jax: position 2^24, float32 = float64 reference (norm of the error, unit vectors)",
              float(np.linalg.norm(got - exact, axis=-1).max()), 1e-6)
    )  # fmt: skip
    return rows


def _pair_ulps(got: np.ndarray, want: np.ndarray, x: np.ndarray, config: RopeConfig) -> float:
    """The largest |got - want| in float32 ulps of each pair's magnitude sqrt(a^2 + b^2) (half pairing)."""
    half = config.rotary_dim // 2
    a, b = x[..., :half].astype(np.float64), x[..., half : 2 * half].astype(np.float64)
    norm = np.sqrt(a * a + b * b).astype(np.float32)
    ulp = np.spacing(np.concatenate([norm, norm], -1))
    rot = slice(0, 2 * half)
    return float((np.abs(got[..., rot] - want[..., rot]) / ulp).max())
