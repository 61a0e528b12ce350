"""ropekit.jax against ropekit's torch path and the float64 reference (docs/jax.md states the figures).

Skipped where the jax extra is not installed (``pip install 'ropekit[jax]'``).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax", reason="ropekit.jax needs the jax extra: pip install 'ropekit[jax]'")
pytest.importorskip("flax.nnx", reason="ropekit.jax needs the jax extra (flax): pip install 'ropekit[jax]'")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import ropekit  # noqa: E402
import ropekit.jax as rj  # noqa: E402
from ropekit import RopeConfig, reference  # noqa: E402
from ropekit.presets import PRESETS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# Every scaling type: the presets cover most; these three no preset uses.
EXTRA_SCALINGS = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "ntk", "factor": 2.0},
]
CONFIGS = [pytest.param(RopeConfig.preset(name), id=name) for name in sorted(PRESETS)] + [
    pytest.param(RopeConfig(64, scaling=s, max_position_embeddings=128), id=s["rope_type"])
    for s in EXTRA_SCALINGS
]
# And a config read the way a Hugging Face config.json is (RopeConfig.from_hf, a dict here).
HF_CONFIG = {
    "hidden_size": 256,
    "num_attention_heads": 4,
    "max_position_embeddings": 4096,
    "rope_theta": 1e6,
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
}
CONFIGS.append(pytest.param(RopeConfig.from_hf(HF_CONFIG), id="from_hf-yarn"))
# Where each layout keeps batch and sequence (axes of x), for building the torch reference.
TO_BSHD = {"bshd": (0, 1, 2, 3), "bhsd": (0, 2, 1, 3), "sbhd": (1, 0, 2, 3)}


def _torch_rotary(x: np.ndarray, cos, sin, layout: str, **kwargs) -> np.ndarray:
    """ropekit.apply_rotary(backend="torch") on x laid out as layout, back in that layout."""
    x = np.array(x)  # writable: torch shares its memory
    t = torch.from_numpy(x).permute(TO_BSHD[layout]) if layout != "thd" else torch.from_numpy(x)
    out = ropekit.apply_rotary(t, cos, sin, backend="torch", **kwargs)
    return (out.permute(TO_BSHD[layout]) if layout != "thd" else out).numpy()


def _random(shape, seed=0, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _shape(layout: str, batch=2, seq=12, heads=3, head_dim=64) -> tuple[int, ...]:
    return {
        "bshd": (batch, seq, heads, head_dim),
        "bhsd": (batch, heads, seq, head_dim),
        "sbhd": (seq, batch, heads, head_dim),
        "thd": (batch * seq, heads, head_dim),
    }[layout]


# -- tables ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", CONFIGS)
def test_tables_are_bit_identical_to_the_torch_path_for_every_preset_and_scaling_type(config):
    cos, sin = rj.cos_sin(config, 96)
    torch_cos, torch_sin = config.cos_sin(96)
    assert cos.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(cos), torch_cos.numpy())
    np.testing.assert_array_equal(np.asarray(sin), torch_sin.numpy())


@pytest.mark.cover(every=4)  # fast tier: every 4th config; the others: make proofs
@pytest.mark.parametrize("config", CONFIGS)
def test_module_rows_past_the_direct_table_are_within_a_few_ulp_of_float64(config):
    rope = rj.RotaryEmbedding(config, max_len=8)
    positions = np.array([0, 7, 8, 2049, 70000, 2**24 + 3], dtype=np.int32)
    c, s = rope.rows(jnp.asarray(positions))
    exact_c, exact_s = config.cos_sin(torch.from_numpy(positions), dtype=torch.float64)
    scale = config.attention_scaling()
    assert np.abs(np.asarray(c, np.float64) - exact_c.numpy()).max() <= 4e-7 * scale
    assert np.abs(np.asarray(s, np.float64) - exact_s.numpy()).max() <= 4e-7 * scale
    np.testing.assert_array_equal(np.asarray(c)[:2], exact_c.numpy()[:2].astype(np.float32))  # direct rows


# -- the rotation against the torch path -----------------------------------------------------------------
@pytest.mark.cover  # fast tier: a per-axis cover; the other cases: make proofs
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sbhd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary", [(64, "first"), (48, "first"), (32, "last")])
@pytest.mark.parametrize("where", ["zero", "int", "per_sequence", "positions"])
def test_eager_rotation_equals_the_torch_path_bit_for_bit(layout, interleaved, rotary, where):
    rotary_dim, rotary_position = rotary
    config = RopeConfig(64, rotary_dim=rotary_dim, rotary_position=rotary_position)
    cos, sin = rj.cos_sin(config, 64)
    torch_cos, torch_sin = config.cos_sin(64)
    x = _random(_shape(layout))
    positions = np.random.default_rng(1).integers(0, 64, (2, 12))
    kwargs = {
        "zero": {},
        "int": {"offsets": 9},
        "per_sequence": {"offsets": np.array([3, 40])},
        "positions": {"positions": positions},
    }[where]
    flags = dict(interleaved=interleaved, rotary_position=rotary_position)
    out = rj.apply_rotary(
        jnp.asarray(x), cos, sin, layout=layout, **flags, **{k: jnp.asarray(v) for k, v in kwargs.items()}
    )
    torch_kwargs = {k: torch.as_tensor(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    ref = _torch_rotary(x, torch_cos, torch_sin, layout, **flags, **torch_kwargs)
    np.testing.assert_array_equal(np.asarray(out), ref)


def _pair_ulps(x: np.ndarray, config: RopeConfig) -> np.ndarray:
    """Per element of x: a float32 ulp of its pair's magnitude sqrt(a^2 + b^2) times the tables' scaling
    (the tiniest ulp for features that pass through: those must be equal)."""
    rot, head_dim = config.rotary_dim, config.head_dim
    start = head_dim - rot if config.rotary_position == "last" else 0
    part = x[..., start : start + rot].astype(np.float64)
    if config.interleaved:
        norm = np.repeat(np.hypot(part[..., 0::2], part[..., 1::2]), 2, axis=-1)
    else:
        norm = np.tile(np.hypot(part[..., : rot // 2], part[..., rot // 2 :]), 2)
    magnitude = np.zeros(x.shape)
    magnitude[..., start : start + rot] = norm * max(1.0, config.attention_scaling())
    return np.spacing(magnitude.astype(np.float32))


@pytest.mark.cover(every=4)  # fast tier: every 4th config; the others: make proofs
@pytest.mark.parametrize("config", CONFIGS)
def test_every_preset_and_scaling_type_rotates_like_the_torch_path(config):
    """Eager: bit for bit. The nnx module under nnx.jit: within one ulp of each pair's magnitude."""
    cos, sin = rj.cos_sin(config, 64)
    x = _random((2, 12, 2, config.head_dim))
    flags = dict(interleaved=config.interleaved, rotary_position=config.rotary_position)
    offsets = np.array([0, 40])
    eager = rj.apply_rotary(jnp.asarray(x), cos, sin, offsets=jnp.asarray(offsets), **flags)
    ref = _torch_rotary(x, *config.cos_sin(64), "bshd", offsets=torch.from_numpy(offsets), **flags)
    np.testing.assert_array_equal(np.asarray(eager), ref)
    rope = rj.RotaryEmbedding(config, max_len=64)
    jitted = np.asarray(nnx.jit(lambda rope, x, off: rope(x, offsets=off))(rope, jnp.asarray(x), offsets))
    assert (np.abs(jitted - ref) <= _pair_ulps(x, config)).all()


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_jitted_rotation_is_torchs_rounding_with_fused_multiply_adds_within_one_ulp(dtype):
    """Under jax.jit XLA fuses a*c - b*s into fma(a, c, -(b*s)) (CPU): bit for bit that operation order, and
    within one ulp of the pair's magnitude sqrt(a^2 + b^2) of the torch path's two roundings."""
    config = RopeConfig(128, 500000.0)
    cos, sin = rj.cos_sin(config, 4096)
    x32 = _random((4, 256, 8, 128), seed=3)
    x = jnp.asarray(x32).astype(dtype)
    rotate = jax.jit(lambda x, off: rj.apply_rotary(x, cos, sin, offsets=off))
    out = np.asarray(rotate(x, jnp.int32(3000)).astype(jnp.float32))
    xf = np.array(x.astype(jnp.float32))  # writable: torch shares its memory
    ref = _torch_rotary(xf, *config.cos_sin(4096), "bshd", offsets=3000)
    if dtype is np.float32:
        # fma(a, c, -(b s)) emulated exactly: a*c is exact in float64, b*s rounded to float32 first
        c = np.asarray(cos)[3000:3256][None, :, None, :].astype(np.float64)
        s = np.asarray(sin)[3000:3256][None, :, None, :].astype(np.float64)
        a, b = xf[..., :64].astype(np.float64), xf[..., 64:].astype(np.float64)
        fma_a = (a * c - (b * s).astype(np.float32)).astype(np.float32)
        fma_b = (b * c + (a * s).astype(np.float32)).astype(np.float32)
        np.testing.assert_array_equal(out, np.concatenate([fma_a, fma_b], -1))
        norm = np.sqrt(xf[..., :64].astype(np.float64) ** 2 + xf[..., 64:].astype(np.float64) ** 2)
        ulp = np.spacing(np.concatenate([norm, norm], -1).astype(np.float32))
        assert np.abs(out - ref).max(initial=0) > 0  # the fusion happened: this is the "within" case
        assert (np.abs(out - ref) / ulp).max() <= 1.0
    else:  # bfloat16 in and out: float32 math, one rounding to bfloat16, within one bfloat16 ulp
        ref16 = (
            ropekit.apply_rotary(
                torch.from_numpy(xf).to(torch.bfloat16), *config.cos_sin(4096), offsets=3000, backend="torch"
            )
            .float()
            .numpy()
        )
        norm = np.sqrt(xf[..., :64].astype(np.float64) ** 2 + xf[..., 64:].astype(np.float64) ** 2)
        ulp = np.concatenate([norm, norm], -1) * 2.0**-7  # a bfloat16 ulp is at most 2^-7 of the value
        assert (np.abs(out - ref16) <= ulp).all()


def test_packed_layout_with_cu_seqlens_equals_the_torch_path():
    config = RopeConfig(64)
    cos, sin = rj.cos_sin(config, 64)
    x = _random((20, 3, 64))
    cu = np.array([0, 5, 5, 13, 20], np.int32)
    out = rj.apply_rotary(
        jnp.asarray(x), cos, sin, layout="thd", cu_seqlens=jnp.asarray(cu), offsets=jnp.asarray([0, 1, 2, 30])
    )
    ref = ropekit.apply_rotary(
        torch.from_numpy(x),
        *config.cos_sin(64),
        cu_seqlens=torch.from_numpy(cu),
        offsets=torch.tensor([0, 1, 2, 30]),
        backend="torch",
    ).numpy()
    np.testing.assert_array_equal(np.asarray(out), ref)


@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_segment_ids_restart_positions_at_each_packed_sequence(layout):
    config = RopeConfig(64)
    cos, sin = rj.cos_sin(config, 64)
    segments = np.array(
        [[1, 1, 1, 2, 2, 3, 3, 3, 3, 0, 0, 0], [4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5]], np.int32
    )
    expected = np.array([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]])
    x = _random(_shape(layout))
    seg = segments if layout == "bshd" else segments.reshape(-1)
    pos = expected if layout == "bshd" else expected.reshape(-1)
    out = rj.apply_rotary(jnp.asarray(x), cos, sin, layout=layout, segment_ids=jnp.asarray(seg))
    by_positions = rj.apply_rotary(jnp.asarray(x), cos, sin, layout=layout, positions=jnp.asarray(pos))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(by_positions))
    if layout == "bshd":
        ref = _torch_rotary(x, *config.cos_sin(64), "bshd", positions=torch.from_numpy(expected))
        np.testing.assert_array_equal(np.asarray(out), ref)


# -- jit and grad ----------------------------------------------------------------------------------------
def test_jit_traces_once_however_positions_offsets_and_segments_change():
    config = RopeConfig(64)
    rope = rj.RotaryEmbedding(config, max_len=64)
    traces = []

    @nnx.jit
    def step(rope, q, k, offsets, positions, segment_ids):
        traces.append(1)
        q1, k1 = rope(q, k, offsets=offsets)
        q2 = rope(q, positions=positions)
        q3 = rope(q, segment_ids=segment_ids)
        return q1, k1, q2, q3

    q, k = jnp.asarray(_random((2, 1, 4, 64))), jnp.asarray(_random((2, 1, 1, 64), seed=1))
    for t in range(6):
        offsets = jnp.asarray([t, 2 * t + 100], jnp.int32)  # the second sequence runs past the table
        positions = jnp.asarray([[t], [t + 5]], jnp.int32)
        out = step(rope, q, k, offsets, positions, jnp.zeros((2, 1), jnp.int32))
        eager = rope(q, k, offsets=np.asarray(offsets))
        np.testing.assert_allclose(np.asarray(out[0]), np.asarray(eager[0]), atol=1e-6)
    assert len(traces) == 1

    plain = []
    rotate = jax.jit(lambda x, cos, sin, off: (plain.append(1), rj.apply_rotary(x, cos, sin, offsets=off))[1])
    cos, sin = rj.cos_sin(config, 64)
    for t in range(5):
        rotate(q, cos, sin, jnp.int32(t))
    assert len(plain) == 1


@pytest.mark.parametrize("interleaved", [False, True])
def test_grad_is_the_inverse_rotation(interleaved):
    config = RopeConfig(64, rotary_dim=48, interleaved=interleaved)
    rope = rj.RotaryEmbedding(config, max_len=64)
    x, g = jnp.asarray(_random((2, 12, 3, 64))), jnp.asarray(_random((2, 12, 3, 64), seed=5))
    grad = jax.grad(lambda x: jnp.sum(rope(x, offsets=7) * g))(x)
    np.testing.assert_allclose(
        np.asarray(grad), np.asarray(rope(g, offsets=7, inverse=True)), rtol=0, atol=1e-6
    )
    # and the inverse undoes the rotation
    back = rope(rope(x, offsets=7), offsets=7, inverse=True)
    np.testing.assert_allclose(np.asarray(back), np.asarray(x), atol=1e-5)


# -- precision far out: float64 tables vs float32 angles ------------------------------------------------
def _maxtext_style(x: jax.Array, position: jax.Array, head_dim: int, base: float) -> jax.Array:
    """MaxText's float32 recipe, written here from its description: timescale = base^(2i/d) in float32,
    angle = position / timescale in float32, then sin / cos."""
    fraction = 2 * jnp.arange(head_dim // 2, dtype=jnp.float32) / head_dim
    angle = position[:, :, None, None].astype(jnp.float32) / (jnp.float32(base) ** fraction)
    a, b = jnp.split(x, 2, axis=-1)
    return jnp.concatenate(
        [a * jnp.cos(angle) - b * jnp.sin(angle), b * jnp.cos(angle) + a * jnp.sin(angle)], -1
    )


@pytest.mark.parametrize("far", [2**20, 2**24])
def test_far_positions_are_float64_exact_where_float32_angles_are_far_off(far):
    head_dim, base = 128, 500000.0
    rope = rj.MaxTextRotaryEmbedding(1, base, head_dim, cast_as_fprop_dtype=False)
    x = _random((1, 64, 2, head_dim), seed=7)
    x /= np.linalg.norm(x, axis=-1, keepdims=True)  # unit vectors: an error's norm is relative
    position = (far + np.arange(64, dtype=np.int64))[None, :]  # (1, 64)
    exact = reference.rotate_half(x, position[..., None], reference.inv_freq(head_dim, base))
    ours = np.asarray(rope(jnp.asarray(x), jnp.asarray(position, jnp.int32)))
    float32_angles = np.asarray(
        _maxtext_style(jnp.asarray(x), jnp.asarray(position, jnp.int32), head_dim, base)
    )
    ours_err = np.linalg.norm(ours - exact, axis=-1).max()
    float32_err = np.linalg.norm(float32_angles - exact, axis=-1).max()
    print(f"position {far}: ropekit.jax {ours_err:.2e}, float32 angles {float32_err:.2e}")
    assert ours_err <= 1e-6
    assert float32_err > (0.01 if far == 2**20 else 0.1)


def test_maxtext_drop_in_rotates_like_maxtexts_formula_at_short_positions():
    rope = rj.MaxTextRotaryEmbedding(1, 10000, 64, cast_as_fprop_dtype=False)
    x = jnp.asarray(_random((2, 16, 4, 64)))
    position = jnp.broadcast_to(jnp.arange(16), (2, 16))
    np.testing.assert_allclose(
        np.asarray(rope(x, position)), np.asarray(_maxtext_style(x, position, 64, 10000.0)), atol=2e-6
    )
    assert rj.MaxTextRotaryEmbedding(1, 10000, 64)(x, position).dtype == jnp.bfloat16  # MaxText's default


def test_maxtext_min_timescale_and_linear_factor_are_linear_scaling():
    rope = rj.MaxTextRotaryEmbedding(2, 20000, 32, rope_linear_scaling_factor=2.0)
    assert rope.config == RopeConfig(32, 10000.0, scaling={"rope_type": "linear", "factor": 4.0})


# -- the nnx module ---------------------------------------------------------------------------------------
def test_module_equals_the_torch_module_and_keeps_its_tables_out_of_params():
    config = RopeConfig.preset("llama-3.1-8b")
    rope = rj.RotaryEmbedding(config, max_len=256, layout="bhsd")
    q, k = _random((1, 8, 20, 128)), _random((1, 2, 20, 128), seed=2)
    out_q, out_k = rope(jnp.asarray(q), jnp.asarray(k), offsets=100)
    torch_rope = ropekit.RotaryEmbedding(config, layout="bhsd", backend="torch")
    ref_q, ref_k = torch_rope(torch.from_numpy(q), torch.from_numpy(k), offsets=100)
    np.testing.assert_array_equal(np.asarray(out_q), ref_q.numpy())
    np.testing.assert_array_equal(np.asarray(out_k), ref_k.numpy())
    assert not jax.tree.leaves(nnx.state(rope, nnx.Param))


MROPE_PRESETS = [name for name in sorted(PRESETS) if RopeConfig.preset(name).mrope_section is not None]


@pytest.mark.cover  # fast tier: a per-axis cover; the other cases: make proofs
@pytest.mark.parametrize("name", MROPE_PRESETS)
@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_mrope_positions_rotate_like_the_torch_module(name, layout):
    config = RopeConfig.preset(name)
    axes, head_dim = len(config.mrope_section), config.head_dim
    positions = np.random.default_rng(4).integers(0, 300, (axes, 2, 10))  # (axes, batch, seq)
    positions[:, :, -1] = 100_000  # past the direct table: composed rows, per axis
    x = _random((2, 10, 3, head_dim))
    if layout == "thd":
        x, positions = x.reshape(20, 3, head_dim), positions.reshape(axes, 20)
    rope = rj.RotaryEmbedding(config, max_len=512, layout=layout)
    out = np.asarray(rope(jnp.asarray(x), positions=jnp.asarray(positions)))
    cu = {"cu_seqlens": torch.tensor([0, 20])} if layout == "thd" else {}  # unused beside positions
    ref = ropekit.RotaryEmbedding(config, layout=layout, backend="torch")(
        torch.from_numpy(x), positions=torch.from_numpy(positions), **cu
    ).numpy()
    near = positions[0] < 100_000  # tokens whose every axis reads the direct table
    np.testing.assert_array_equal(out[near], ref[near])
    assert (np.abs(out - ref) <= 8 * np.spacing(np.float32(np.abs(x).max()))).all()
    expected = re.escape(f"positions: expected shape {(axes, *x.shape[:-2])}")
    with pytest.raises(ValueError, match=expected):
        rope(jnp.asarray(x), positions=jnp.asarray(positions[1:]))  # one axis short


# -- bad input --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x, c, s: rj.apply_rotary(x[0], c, s), r"x: expected a 4-D array .*bshd"),
        (lambda x, c, s: rj.apply_rotary(x.astype(jnp.int32), c, s), r"x: expected a floating-point"),
        (lambda x, c, s: rj.apply_rotary(x, c, s, layout="bsd"), r"layout: expected one of .*'bsd'"),
        (lambda x, c, s: rj.apply_rotary(x, c, s[:, :4]), r"sin: expected cos's shape"),
        (
            lambda x, c, s: rj.apply_rotary(x, c, s, offsets=60),
            r"positions: position 71 is outside .*table_len 64",
        ),
        (lambda x, c, s: rj.apply_rotary(x, c, s, offsets=-1), r"offsets: expected an integer >= 0.*-1"),
        (
            lambda x, c, s: rj.apply_rotary(x, c, s, offsets=jnp.ones(3, jnp.int32)),
            r"offsets: expected shape \(2,\)",
        ),
        (
            lambda x, c, s: rj.apply_rotary(x, c, s, positions=jnp.zeros((2, 12))),
            r"positions: expected an integer array",
        ),
        (
            lambda x, c, s: rj.apply_rotary(x, c, s, positions=-jnp.ones((2, 12), jnp.int32)),
            r"positions: expected values >= 0, got -1",
        ),
        (
            lambda x, c, s: rj.apply_rotary(x, c, s, positions=jnp.zeros((2, 12), jnp.int32), offsets=3),
            r"offsets: positions name every",
        ),
        (lambda x, c, s: rj.apply_rotary(x, c, s, interleaved=1), r"interleaved: expected a bool, got 1"),
        (
            lambda x, c, s: rj.apply_rotary(x, c, s, rotary_position="mid"),
            r"rotary_position: expected 'first'.*'mid'",
        ),
        (
            lambda x, c, s: rj.apply_rotary(x.reshape(24, 3, 64), c, s, layout="thd"),
            r"cu_seqlens: layout 'thd' needs",
        ),
        (
            lambda x, c, s: rj.apply_rotary(
                x.reshape(24, 3, 64), c, s, layout="thd", cu_seqlens=jnp.asarray([0, 30])
            ),
            r"cu_seqlens: expected non-decreasing values from 0 to total_tokens \(24\)",
        ),
        (lambda x, c, s: rj.cos_sin({"head_dim": 64}, 8), r"config: expected a ropekit.RopeConfig"),
        (
            lambda x, c, s: rj.RotaryEmbedding(RopeConfig(64), max_len=0),
            r"max_len: expected a positive integer.*0",
        ),
        (lambda x, c, s: rj.RotaryEmbedding(RopeConfig(64))(x[..., :32]), r"q: expected head_dim 64"),
        (lambda x, c, s: rj.RotaryEmbedding(RopeConfig(64))(x, x[:1]), r"k: expected q's token axes"),
        (lambda x, c, s: rj.RotaryEmbedding(RopeConfig(64)).rows(x[0, 0]), r"positions: expected an integer"),
        (
            lambda x, c, s: rj.MaxTextRotaryEmbedding(1, 10000, object()),
            r"embedding_dims: expected a positive even",
        ),
        (
            lambda x, c, s: rj.MaxTextRotaryEmbedding(1, 10000, 63),
            r"embedding_dims: expected a positive even integer, got 63",
        ),
        (lambda x, c, s: rj.MaxTextRotaryEmbedding(0.5, 10000, 64), r"rope_linear_scaling_factor: .*>= 1"),
        (lambda x, c, s: rj.MaxTextRotaryEmbedding(1, 10000, 64)(x), r"position: expected an integer array"),
    ],
)
def test_bad_input_is_a_value_error_naming_the_argument_and_value(call, match):
    config = RopeConfig(64)
    cos, sin = rj.cos_sin(config, 64)
    with pytest.raises(ValueError, match=match):
        call(jnp.asarray(_random((2, 12, 3, 64))), cos, sin)


def test_a_traced_position_past_the_table_reads_nan_not_a_clamped_row():
    cos, sin = rj.cos_sin(RopeConfig(64), 16)
    x = jnp.asarray(_random((1, 4, 1, 64)))
    out = jax.jit(lambda off: rj.apply_rotary(x, cos, sin, offsets=off))(jnp.int32(14))
    assert np.isfinite(np.asarray(out[0, :2])).all() and np.isnan(np.asarray(out[0, 2:])).all()


# -- the page --------------------------------------------------------------------------------------------
def test_the_docs_example_runs():
    text = (ROOT / "docs" / "jax.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    assert blocks, "docs/jax.md has no python example"
    exec(compile(blocks[0], "docs/jax.md", "exec"), {})
