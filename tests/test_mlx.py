"""ropekit.mlx: MLX arrays rotated by ropekit's float64 tables equal the torch path, in both layouts.

The torch path is ``ropekit.apply_rotary(..., backend="torch")`` on the same config's ``cos_sin`` tables. The
table path is held to 0 ulps (bit for bit: same float32 rows, same order of operations); ``mx.fast.rope``
(fast=True) to the bound docs/mlx.md states, which grows with the position because it forms angles in float32.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'ropekit[mlx]')")

import ropekit  # noqa: E402
from ropekit import RopeConfig, mrope_positions, reference  # noqa: E402
from ropekit.mlx import RotaryEmbedding, apply_rotary, cos_sin  # noqa: E402
from ropekit.presets import PRESETS  # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "docs" / "mlx.md"
DTYPES = {"float32": (mx.float32, torch.float32), "float16": (mx.float16, torch.float16)}
# One config per registered scaling type (with a length-dependent one's seq_len), small enough to run fast.
SCALINGS = {
    "default": (dict(head_dim=64), None),
    "linear": (dict(head_dim=64, scaling={"rope_type": "linear", "factor": 4.0}), None),
    "dynamic": (
        dict(head_dim=64, scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=256),
        1024,
    ),
    "yarn": (
        dict(
            head_dim=64,
            scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
        ),
        None,
    ),
    "llama3": (
        dict(
            head_dim=64,
            base=500000.0,
            scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        ),
        None,
    ),
    "longrope (long factors)": (
        dict(
            head_dim=32,
            scaling={
                "rope_type": "longrope",
                "short_factor": [1.0 + i / 16 for i in range(16)],
                "long_factor": [2.0 + i / 4 for i in range(16)],
                "original_max_position_embeddings": 128,
            },
            max_position_embeddings=1024,
        ),
        512,
    ),
    "ntk": (dict(head_dim=64, scaling={"rope_type": "ntk", "factor": 4.0}), None),
    "ntk_alpha": (dict(head_dim=64, scaling={"rope_type": "ntk_alpha", "alpha": 1000.0}), None),
    "proportional": (
        dict(head_dim=64, scaling={"rope_type": "proportional", "partial_rotary_factor": 0.25}),
        None,
    ),
    "axial": (dict(head_dim=64, scaling={"rope_type": "axial", "mrope_section": [16, 16]}), None),
    "dual_chunk": (
        dict(head_dim=64, scaling={"rope_type": "dual_chunk", "chunk_size": 64, "local_size": 16}),
        None,
    ),
    "partial, last (NoPE first)": (dict(head_dim=96, rotary_dim=32, rotary_position="last"), None),
    "partial, interleaved": (dict(head_dim=96, rotary_dim=32, interleaved=True), None),
}


def _host(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)) if a.dtype == mx.bfloat16 else np.array(a)


def max_ulps(got: np.ndarray, want: np.ndarray) -> int:
    """The largest distance in units in the last place between same-dtype float arrays (float32 / float16)."""
    ints = {np.dtype(np.float32): np.int32, np.dtype(np.float16): np.int16}[got.dtype]

    def ordered(v: np.ndarray) -> np.ndarray:  # IEEE bits as integers that count up with the value
        i = v.view(ints).astype(np.int64)
        return np.where(i < 0, np.iinfo(ints).min - i, i)

    return int(np.abs(ordered(got) - ordered(want)).max()) if got.size else 0


def eps_error(got: np.ndarray, want: np.ndarray, x: np.ndarray) -> float:
    """The largest absolute difference in units of eps (the dtype's ulp at 1.0) times x's largest |value|."""
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64)).max()
    return float(diff / (np.finfo(got.dtype).eps * np.abs(x.astype(np.float64)).max()))


def torch_path(config, x, *, positions=None, offsets=0, table_len, seq_len=None):
    """ropekit.apply_rotary on the torch backend, x (B, T, H, D) as NumPy, on config's own tables."""
    t = torch.from_numpy(x)
    kw = dict(interleaved=config.interleaved, rotary_position=config.rotary_position, backend="torch")
    if positions is not None and positions.ndim == 3:  # M-RoPE: the per-token rows cos_sin gives
        cos, sin = config.cos_sin(torch.from_numpy(positions), seq_len=seq_len)
        return ropekit.apply_rotary(t, cos, sin, per_token=True, **kw).numpy()
    cos, sin = config.cos_sin(table_len, seq_len=seq_len)
    if positions is not None:
        kw["positions"] = torch.from_numpy(positions)
    elif isinstance(offsets, np.ndarray):
        kw["offsets"] = torch.from_numpy(offsets)
    else:
        kw["offsets"] = offsets
    return ropekit.apply_rotary(t, cos, sin, **kw).numpy()


def _x(batch, seq, heads, head_dim, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal((batch, seq, heads, head_dim)).astype(dtype)


def _mlx(rope, x, layout, **kw):
    """rope applied to x (B, T, H, D) NumPy given in ``layout``; the answer back as (B, T, H, D) NumPy."""
    a = mx.array(x)
    if layout == "bhtd":
        a = mx.array(np.ascontiguousarray(x.transpose(0, 2, 1, 3)))  # a contiguous (B, H, T, D) array
    out = rope(a, layout=layout, **kw)
    out = out if layout == "bthd" else mx.swapaxes(out, 1, 2)
    return _host(out)


# -- the layout pitfall ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fast", [False, True], ids=["table", "fast"])
def test_a_contiguous_bthd_array_rotates_by_sequence_position_not_by_head(fast):
    config = RopeConfig(64)
    rope = RotaryEmbedding(config, table_len=64, fast=fast)
    assert rope.fast is fast
    x = _x(2, 7, 3, 64)  # T = 7 tokens, H = 3 heads: per-head positions would rotate head h by h
    got = _mlx(rope, x, "bthd")
    want = torch_path(config, x, table_len=64)
    if fast:  # float32 angles: within docs/mlx.md's bound below position 64, not bit for bit
        assert eps_error(got, want, x) <= 32
    else:
        assert max_ulps(got, want) == 0
    # The pitfall this guards: mx.fast.rope reads axis -2 of a (B, T, H, D) array as the sequence axis.
    naive = np.array(
        mx.fast.rope(mx.array(x), 64, traditional=False, base=None, scale=1.0, offset=0, freqs=rope.freqs)
    )
    assert np.abs(naive - want).max() > 0.1


@pytest.mark.parametrize("fast", [False, True], ids=["table", "fast"])
def test_bhtd_and_bthd_give_the_same_rotation(fast):
    rope = RotaryEmbedding(RopeConfig(32, interleaved=True), table_len=32, fast=fast)
    x = _x(2, 5, 4, 32)
    offsets = mx.array([3, 11])
    np.testing.assert_array_equal(
        _mlx(rope, x, "bthd", offsets=offsets), _mlx(rope, x, "bhtd", offsets=offsets)
    )


def test_the_layout_has_no_default_because_shape_cannot_tell_them_apart():
    rope = RotaryEmbedding(RopeConfig(16), table_len=8)
    with pytest.raises(TypeError, match="layout"):
        rope(mx.zeros((1, 2, 2, 16)))
    with pytest.raises(ValueError, match=r"layout: expected 'bthd' \(B, T, H, D\) or 'bhtd'.*got 'BTHD'"):
        rope(mx.zeros((1, 2, 2, 16)), layout="BTHD")


# -- equal to the torch path -------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["bthd", "bhtd"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_equals_the_torch_path_bit_for_bit(name, dtype, layout):
    config = RopeConfig.preset(name)
    table_len = 48
    rope = RotaryEmbedding(config, table_len=table_len)
    x = _x(2, 6, 2, config.head_dim, np.float16 if dtype == "float16" else np.float32)
    offsets = np.array([0, 40])
    got = _mlx(rope, x, layout, offsets=mx.array(offsets))
    assert got.dtype == x.dtype
    assert max_ulps(got, torch_path(config, x, offsets=offsets, table_len=table_len)) == 0


@pytest.mark.parametrize("table_len", [64, 8], ids=["table rows", "rows past the table"])
@pytest.mark.parametrize("name", [n for n in PRESETS if RopeConfig.preset(n).mrope_section is not None])
def test_mrope_presets_take_each_pairs_own_axis_like_the_torch_path(name, table_len):
    config = RopeConfig.preset(name)
    axes = len(config.mrope_section)
    ids = mrope_positions([3, (1, 4, 6), 2], spatial_merge=2).numpy()  # (3, T): text, image, text
    positions = np.stack([ids[i % 3] + 2 * i for i in range(axes)])[:, None].repeat(2, axis=1)  # (A, 2, T)
    positions[:, 1] += 5
    x = _x(2, positions.shape[-1], 2, config.head_dim)
    rope = RotaryEmbedding(config, table_len=table_len, fast=True)  # M-RoPE positions take the table path
    got = _mlx(rope, x, "bhtd", positions=mx.array(positions))
    assert max_ulps(got, torch_path(config, x, positions=positions, table_len=64)) == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SCALINGS)
def test_every_scaling_type_equals_the_torch_path(case, dtype):
    kwargs, seq_len = SCALINGS[case]
    config = RopeConfig(**kwargs)
    rope = RotaryEmbedding(config, table_len=64, seq_len=seq_len)
    x = _x(3, 8, 2, config.head_dim, np.float16 if dtype == "float16" else np.float32)
    positions = np.array([[5, 1, 63, 0, 7, 7, 30, 2], list(range(8)), list(range(50, 58))])
    offsets = np.array([0, 9, 56])
    for kw in (dict(positions=positions), dict(offsets=offsets), dict(offsets=17)):
        given = {k: mx.array(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
        got = _mlx(rope, x, "bthd", **given)
        want = torch_path(config, x, table_len=64, seq_len=seq_len, **kw)
        assert max_ulps(got, want) == 0, kw


@pytest.mark.parametrize("case", SCALINGS)
def test_fast_path_takes_frequency_lists_and_stays_within_its_stated_bound(case):
    """fast=True goes to mx.fast.rope exactly when the table is a frequency list (no factor on cos / sin);
    there it stays within docs/mlx.md's bound for positions below 64: 32 float32 eps times max |x|, 2 for
    float16."""
    kwargs, seq_len = SCALINGS[case]
    config = RopeConfig(**kwargs)
    rope = RotaryEmbedding(config, table_len=64, seq_len=seq_len, fast=True)
    assert rope.fast is (config.attention_scaling(seq_len) == 1.0)
    offsets = np.array([0, 32])
    for dtype, bound in ((np.float32, 32), (np.float16, 2)):
        x = _x(2, 32, 3, config.head_dim, dtype)
        got = _mlx(rope, x, "bthd", offsets=mx.array(offsets))
        want = torch_path(config, x, offsets=offsets, table_len=64, seq_len=seq_len)
        assert eps_error(got, want, x) <= bound, (dtype, eps_error(got, want, x))


def test_a_scaled_table_never_reaches_mx_fast_rope_which_cannot_multiply_cos_and_sin(monkeypatch):
    config = RopeConfig.preset("qwen2.5-7b")  # YaRN: cos and sin carry an attention factor of 1.1386
    assert config.attention_scaling() != 1.0
    monkeypatch.setattr(mx.fast, "rope", lambda *a, **k: pytest.fail("mx.fast.rope called"))
    rope = RotaryEmbedding(config, table_len=16, fast=True)
    x = _x(1, 4, 2, 128)
    assert max_ulps(_mlx(rope, x, "bthd", offsets=3), torch_path(config, x, offsets=3, table_len=16)) == 0


def test_per_token_positions_take_the_table_path_even_when_fast_is_asked(monkeypatch):
    config = RopeConfig(32)
    rope = RotaryEmbedding(config, table_len=16, fast=True)
    monkeypatch.setattr(mx.fast, "rope", lambda *a, **k: pytest.fail("mx.fast.rope called"))
    x = _x(2, 3, 2, 32)
    positions = np.array([[4, 0, 9], [15, 15, 1]])
    got = _mlx(rope, x, "bthd", positions=mx.array(positions))
    assert max_ulps(got, torch_path(config, x, positions=positions, table_len=16)) == 0


def test_bfloat16_equals_the_torch_path_bit_for_bit():
    config = RopeConfig.preset("llama-3.1-8b")
    rope = RotaryEmbedding(config, table_len=32)
    x = _x(1, 5, 2, 128)
    got = rope(mx.array(x).astype(mx.bfloat16), layout="bthd", offsets=20)
    assert got.dtype == mx.bfloat16
    cos, sin = config.cos_sin(32)
    want = ropekit.apply_rotary(torch.from_numpy(x).bfloat16(), cos, sin, offsets=20, backend="torch")
    np.testing.assert_array_equal(_host(got), want.float().numpy())


def test_from_hf_config_and_its_length_dependent_switch_match_the_torch_path():
    hf = {
        "hidden_size": 256,
        "num_attention_heads": 8,
        "max_position_embeddings": 1024,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0] * 16,
            "long_factor": [4.0] * 16,
            "original_max_position_embeddings": 128,
        },
    }
    config = RopeConfig.from_hf(hf)
    x = _x(1, 4, 2, 32)
    short, long = RotaryEmbedding(config, table_len=32), RotaryEmbedding(config, table_len=32, seq_len=512)
    for rope, seq_len in ((short, None), (long, 512)):
        want = torch_path(config, x, offsets=10, table_len=32, seq_len=seq_len)
        assert max_ulps(_mlx(rope, x, "bthd", offsets=10), want) == 0
    assert not np.array_equal(_mlx(short, x, "bthd", offsets=10), _mlx(long, x, "bthd", offsets=10))


# -- precision far out -------------------------------------------------------------------------------------


def test_position_2_to_the_24_keeps_float64_table_precision():
    """Rows past the table are formed on the host in float64: at 2^24 the float32 result is within 1e-6 of the
    exact rotation, as the torch path's is; mx.fast.rope's float32 angles are off by order 1 there."""
    config = RopeConfig(128, 500000.0)
    far = 1 << 24
    x = _x(2, 4, 2, 128)
    offsets = np.array([far, far + 1000])
    theta = reference.inv_freq(128, 500000.0)
    exact = np.stack(
        [reference.rotate_half(x[b], (offsets[b] + np.arange(4))[:, None], theta) for b in range(2)]
    )
    got = _mlx(RotaryEmbedding(config), x, "bhtd", offsets=mx.array(offsets))
    assert np.abs(got - exact).max() <= 1e-6
    rows = torch.from_numpy(offsets[:, None] + np.arange(4))  # the torch path on the same rows
    cos, sin = config.cos_sin(rows)
    torch_out = ropekit.apply_rotary(torch.from_numpy(x), cos, sin, per_token=True, backend="torch")
    assert max_ulps(got, torch_out.numpy()) == 0
    fast = _mlx(RotaryEmbedding(config, fast=True), x, "bhtd", offsets=mx.array(offsets))
    assert np.abs(fast - exact).max() > 1e-2  # docs/mlx.md: why fast is not the default


# -- the functional form -----------------------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rotary_with_tables_equals_ropekit_apply_rotary(interleaved):
    config = RopeConfig(48, rotary_dim=32, interleaved=interleaved)
    cos, sin = cos_sin(config, 20)
    assert cos.shape == (20, 16) and cos.dtype == mx.float32
    x = _x(2, 3, 2, 48)
    positions = np.array([[19, 0, 3], [2, 2, 2]])
    got = apply_rotary(
        mx.array(x), cos, sin, layout="bthd", positions=mx.array(positions), interleaved=interleaved
    )
    assert max_ulps(np.array(got), torch_path(config, x, positions=positions, table_len=20)) == 0


def test_cos_sin_in_half_precision_rounds_float64_angles_once_as_the_torch_tables_do():
    config = RopeConfig.preset("llama-3.1-8b")
    for mx_dtype, torch_dtype in ((mx.float16, torch.float16), (mx.bfloat16, torch.bfloat16)):
        cos, sin = cos_sin(config, 300, dtype=mx_dtype)
        want_cos, want_sin = config.cos_sin(300, dtype=torch_dtype)
        np.testing.assert_array_equal(_host(cos), want_cos.float().numpy())
        np.testing.assert_array_equal(_host(sin), want_sin.float().numpy())


# -- bad input: a ValueError naming the argument, the value and what was expected --------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(x=np.zeros((1, 2, 2, 16), np.float32)), r"x: expected an mx.array, got array\("),
        (dict(x=mx.zeros((2, 2, 16))), r"x: expected a 4-D array in layout 'bthd', got shape \(2, 2, 16\)"),
        (dict(x=mx.zeros((1, 2, 2, 16), dtype=mx.int32)), r"x: expected a floating-point array, got .*int32"),
        (dict(x=mx.zeros((1, 2, 2, 8))), r"x: expected head_dim 16 .* got shape \(1, 2, 2, 8\)"),
        (dict(offsets=mx.array([1, 2, 3])), r"offsets: expected an int or shape \(1,\) .* got \(3,\)"),
        (dict(offsets=-1), r"offsets: expected offsets >= 0, got -1"),
        (dict(offsets=1.5), r"offsets: expected an integer mx.array or NumPy array, got 1.5"),
        (dict(offsets=mx.array([0.5])), r"offsets: expected an integer array, got .*float32"),
        (
            dict(positions=mx.array([[0, 1]]), offsets=2),
            r"offsets: expected 0 when positions are given, got 2",
        ),
        (dict(positions=mx.array([0, 1])), r"positions: expected shape \(1, 2\) \(batch, seq\), got \(2,\)"),
        (dict(positions=mx.array([[0, -1]])), r"positions: expected positions >= 0, got -1"),
        (
            dict(positions=[[0, 1]]),
            r"positions: expected an integer mx.array or NumPy array, got \[\[0, 1\]\]",
        ),
    ],
)
def test_bad_input_is_a_value_error_naming_the_argument_and_the_value(kwargs, match):
    rope = RotaryEmbedding(RopeConfig(16), table_len=8)
    call = dict(x=mx.zeros((1, 2, 2, 16)), layout="bthd") | kwargs
    x = call.pop("x")
    with pytest.raises(ValueError, match=match):
        rope(x, **call)


def test_bad_construction_and_tables_are_value_errors_naming_the_argument():
    with pytest.raises(ValueError, match=r"config: expected a ropekit.RopeConfig, got \{'head_dim': 64\}"):
        RotaryEmbedding({"head_dim": 64})
    with pytest.raises(ValueError, match=r"table_len: expected a positive integer, got 0"):
        RotaryEmbedding(RopeConfig(16), table_len=0)
    with pytest.raises(ValueError, match=r"fast: expected a bool, got 1"):
        RotaryEmbedding(RopeConfig(16), fast=1)
    with pytest.raises(
        ValueError, match=r"dtype: expected mx.float32, mx.float16 or mx.bfloat16, got .*int32"
    ):
        cos_sin(RopeConfig(16), 4, dtype=mx.int32)
    cos, sin = cos_sin(RopeConfig(16), 4)
    x = mx.zeros((1, 2, 1, 16))
    with pytest.raises(
        ValueError, match=r"positions: position 5 is outside the cos/sin table \(table_len 4\)"
    ):
        apply_rotary(x, cos, sin, layout="bthd", offsets=4)
    with pytest.raises(ValueError, match=r"sin: expected cos's shape \(4, 8\), got \(4, 4\)"):
        apply_rotary(x, cos, sin[:, :4], layout="bthd")
    with pytest.raises(
        ValueError, match=r"cos: expected rotary_dim / 2 columns .* head_dim \(8\), got shape"
    ):
        apply_rotary(mx.zeros((1, 2, 1, 8)), cos, sin, layout="bthd")
    with pytest.raises(ValueError, match=r"interleaved: expected a bool, got 'yes'"):
        apply_rotary(x, cos, sin, layout="bthd", interleaved="yes")


# -- the page ----------------------------------------------------------------------------------------------


def test_the_docs_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    assert blocks, "docs/mlx.md has no python example"
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), {})
