"""The float64 reference proves the theorems of docs/math.md over random dims, bases and positions.

The textbook's worked examples are pinned to the values it prints.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ropekit import reference as ref

half_dims = st.integers(1, 16)  # d = 2 * half_dim
bases = st.floats(1.5, 1e6)
positions = st.integers(0, 10_000)
seeds = st.integers(0, 2**32 - 1)

# Angles reach 1e4 rad; float64 evaluates cos/sin of such angles to ~1e4 * 1e-16, far below this.
ATOL = 1e-10


def _theta(half_dim: int, base: float) -> np.ndarray:
    return ref.inv_freq(2 * half_dim, base)


@given(half_dims, bases, positions)
def test_rotation_matrix_is_orthogonal_with_determinant_one(half_dim, base, m):
    r = ref.rotation_matrix(m, _theta(half_dim, base))
    np.testing.assert_allclose(r.T @ r, np.eye(2 * half_dim), atol=ATOL)
    assert np.linalg.det(r) == pytest.approx(1.0, abs=ATOL)


@given(half_dims, bases, positions, positions)
def test_rm_transpose_rn_equals_r_of_n_minus_m(half_dim, base, m, n):
    theta = _theta(half_dim, base)
    lhs = ref.rotation_matrix(m, theta).T @ ref.rotation_matrix(n, theta)
    np.testing.assert_allclose(lhs, ref.rotation_matrix(n - m, theta), atol=ATOL)


@given(half_dims, bases, positions, positions, st.integers(0, 5_000), seeds)
def test_inner_product_depends_only_on_offset(half_dim, base, m, n, shift, seed):
    theta = _theta(half_dim, base)
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, 2 * half_dim))
    dot = ref.rotate_interleaved(q, m, theta) @ ref.rotate_interleaved(k, n, theta)
    shifted = ref.rotate_interleaved(q, m + shift, theta) @ ref.rotate_interleaved(k, n + shift, theta)
    relative = q @ ref.rotation_matrix(n - m, theta) @ k  # q^T R_{n-m} k
    scale = np.linalg.norm(q) * np.linalg.norm(k)
    assert dot == pytest.approx(shifted, abs=ATOL * scale)
    assert dot == pytest.approx(relative, abs=ATOL * scale)


@given(half_dims, bases, st.lists(positions, min_size=1, max_size=6), seeds)
def test_rotation_preserves_norm(half_dim, base, ms, seed):
    x = np.random.default_rng(seed).standard_normal((len(ms), 2 * half_dim))
    rotated = ref.rotate_interleaved(x, np.array(ms), _theta(half_dim, base))
    np.testing.assert_allclose(np.linalg.norm(rotated, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-13)


@given(half_dims, st.integers(0, 6), bases, positions, seeds)
def test_matrix_complex_and_interleaved_forms_agree(half_dim, tail, base, m, seed):
    theta = _theta(half_dim, base)
    x = np.random.default_rng(seed).standard_normal(2 * half_dim + tail)  # partial rotary: a tail too
    by_matrix = ref.rotate_matrix(x, m, theta)
    np.testing.assert_allclose(ref.rotate_complex(x, m, theta), by_matrix, atol=ATOL)
    np.testing.assert_allclose(ref.rotate_interleaved(x, m, theta), by_matrix, atol=ATOL)
    np.testing.assert_array_equal(by_matrix[2 * half_dim :], x[2 * half_dim :])


@given(half_dims, st.integers(0, 6), bases, positions, seeds)
def test_half_form_is_the_interleaved_form_permuted(half_dim, tail, base, m, seed):
    d = 2 * half_dim
    theta = _theta(half_dim, base)
    x = np.random.default_rng(seed).standard_normal(d + tail)
    to_half = np.concatenate([ref.interleaved_to_half_permutation(d), np.arange(d, d + tail)])
    np.testing.assert_allclose(
        ref.rotate_half(x[to_half], m, theta), ref.rotate_interleaved(x, m, theta)[to_half], atol=ATOL
    )


@given(st.integers(1, 64))
def test_pair_permutations_are_inverse_and_pair_i_with_i_plus_half(half_dim):
    d = 2 * half_dim
    to_inter = ref.half_to_interleaved_permutation(d)
    to_half = ref.interleaved_to_half_permutation(d)
    np.testing.assert_array_equal(to_inter[to_half], np.arange(d))
    np.testing.assert_array_equal(to_half[to_inter], np.arange(d))
    # Interleaved slots (2i, 2i+1) hold half-layout features (i, i + d/2).
    np.testing.assert_array_equal(to_inter[0::2], np.arange(half_dim))
    np.testing.assert_array_equal(to_inter[1::2], np.arange(half_dim) + half_dim)


@given(st.integers(1, 64).map(lambda h: 2 * h), bases)
def test_inv_freq_is_base_to_the_minus_2i_over_d(d, base):
    theta = ref.inv_freq(d, base)
    assert theta.shape == (d // 2,)
    for i in (0, d // 4, d // 2 - 1):
        assert theta[i] == pytest.approx(base ** (-2 * i / d), rel=1e-14)
    assert np.all(np.diff(theta) < 0)  # frequencies fall from 1 rad/token


def test_rotation_matrix_blocks_rotate_each_pair_by_m_theta_i():
    theta = np.array([0.5, 0.25])
    r = ref.rotation_matrix(3, theta)
    for i, t in enumerate(theta):
        c, s = math.cos(3 * t), math.sin(3 * t)
        np.testing.assert_allclose(r[2 * i : 2 * i + 2, 2 * i : 2 * i + 2], [[c, -s], [s, c]], atol=1e-15)
    assert r[0, 2] == r[2, 0] == 0.0  # pairs do not mix


def test_half_and_interleaved_pair_different_features():
    """The two layouts are different functions of the same vector; mixing them up is a real bug."""
    theta = ref.inv_freq(4)
    x = np.array([1.0, 2.0, 3.0, 4.0])
    assert not np.allclose(ref.rotate_half(x, 1, theta), ref.rotate_interleaved(x, 1, theta))


def _textbook_dot(angle_deg: float, m: int, n: int) -> float:
    theta = np.array([math.radians(angle_deg)])
    e1 = np.array([1.0, 0.0])
    return float(ref.rotate_interleaved(e1, m, theta) @ ref.rotate_interleaved(e1, n, theta))


def test_textbook_2d_theta_30_degrees_positions_1_and_3_gives_one_half():
    assert _textbook_dot(30.0, 1, 3) == pytest.approx(0.5, abs=1e-15)  # cos 60 degrees


def test_textbook_2d_theta_45_degrees_positions_0_and_2_gives_zero():
    assert _textbook_dot(45.0, 0, 2) == pytest.approx(0.0, abs=1e-15)  # cos 90 degrees


def test_textbook_sinusoidal_d4_at_positions_1_and_2():
    pe = ref.sinusoidal(np.array([1, 2]), 4)
    # Exact values: columns (sin m, cos m, sin m/100, cos m/100).
    np.testing.assert_allclose(pe[0], [math.sin(1), math.cos(1), math.sin(0.01), math.cos(0.01)], rtol=1e-15)
    np.testing.assert_allclose(pe[1], [math.sin(2), math.cos(2), math.sin(0.02), math.cos(0.02)], rtol=1e-15)
    # The digits the textbook prints.
    assert round(pe[0, 0], 3) == 0.841
    assert round(pe[1, 0], 3) == 0.909
    assert round(pe[0, 3], 5) == 0.99995
    assert round(pe[1, 3], 4) == 0.9998


@given(st.integers(1, 32).map(lambda h: 2 * h), positions, st.integers(0, 100))
def test_sinusoidal_shift_is_a_rotation_independent_of_position(dim, m, k):
    """PE(m + k) is PE(m) with each (sin, cos) pair rotated by k * omega_i, whatever m is."""
    pe_m, pe_mk = ref.sinusoidal(np.array([m, m + k]), dim)
    omega = ref.inv_freq(dim)
    s, c = pe_m[0::2], pe_m[1::2]
    shifted_sin = s * np.cos(k * omega) + c * np.sin(k * omega)
    shifted_cos = c * np.cos(k * omega) - s * np.sin(k * omega)
    np.testing.assert_allclose(pe_mk[0::2], shifted_sin, atol=1e-10)
    np.testing.assert_allclose(pe_mk[1::2], shifted_cos, atol=1e-10)


def test_reference_functions_do_not_modify_their_input():
    theta = ref.inv_freq(4)
    x = np.arange(6, dtype=np.float64)
    before = x.copy()
    for f in (ref.rotate_interleaved, ref.rotate_half, ref.rotate_complex, ref.rotate_matrix):
        f(x, 7, theta)
    np.testing.assert_array_equal(x, before)


def test_rotate_multiaxis_with_equal_axes_is_the_1d_rotation():
    rng = np.random.default_rng(0)
    x, theta = rng.standard_normal((5, 3, 16)), ref.inv_freq(16, 100.0)
    pos = np.arange(5.0)[:, None]
    axis_of_pair = np.array([0, 1, 2, 0, 1, 2, 0, 1])
    for interleaved, plain in ((False, ref.rotate_half), (True, ref.rotate_interleaved)):
        got = ref.rotate_multiaxis(x, np.stack([pos] * 3), theta, axis_of_pair, interleaved)
        np.testing.assert_allclose(got, plain(x, pos, theta), rtol=0, atol=1e-15)
    # Different axes: pair j turns by the position of its own axis only.
    got = ref.rotate_multiaxis(x, np.stack([pos, pos + 7, pos * 0]), theta, axis_of_pair)
    want = ref.rotate_half(x, pos, theta * np.array([1, 0, 0, 1, 0, 0, 1, 0]))  # axis 0 pairs only
    np.testing.assert_allclose(got[..., [0, 3, 6, 8, 11, 14]], want[..., [0, 3, 6, 8, 11, 14]], atol=1e-15)


def test_fope_with_identity_coefficients_and_every_frequency_is_the_half_rotation():
    rng = np.random.default_rng(1)
    x, theta = rng.standard_normal((4, 6, 8)), ref.inv_freq(8, 500.0)
    eye = np.stack([np.eye(4)] * 2)  # 2 key-value heads, F = D/2 = 4: no padding
    got = ref.rotate_fope(x, np.arange(4), theta, eye, eye)
    np.testing.assert_allclose(got, ref.rotate_half(x, np.arange(4.0)[:, None], theta), rtol=0, atol=1e-15)
    cos, sin = ref.fope_tables(np.arange(3), theta[:2], eye[:, :2, :2], eye[:, :2, :2], 8)
    assert np.array_equal(cos[..., 2:], np.ones((3, 2, 2))) and np.array_equal(
        sin[..., 2:], np.ones((3, 2, 2))
    )
