"""Float64 NumPy reference for rotary position embeddings: the ground truth.

Everything here is written to be read, not to be fast. The derivation these functions follow lives in
``docs/math.md``; the names match it:

* ``d`` is ``rotary_dim`` (an even number of features that rotate), ``theta`` the vector of ``d/2`` angular
  frequencies, ``theta_i = base ** (-2 i / d)``.
* The *interleaved* pairing (GPT-J / Meta LLaMA) rotates features ``(2i, 2i+1)`` by angle ``m * theta_i``.
* The *half* pairing (GPT-NeoX / Hugging Face) rotates features ``(i, i + d/2)`` by the same angle.
* Features past ``d`` (partial rotary) pass through unchanged.

Shape notation: ``...`` is any number of leading axes; ``D`` is head_dim; ``d`` is rotary_dim.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "apply_tables",
    "half_to_interleaved_permutation",
    "interleaved_to_half_permutation",
    "inv_freq",
    "rotate_complex",
    "rotate_half",
    "rotate_interleaved",
    "rotate_matrix",
    "rotation_matrix",
    "sinusoidal",
]


def inv_freq(rotary_dim: int, base: float = 10000.0) -> np.ndarray:
    """theta_i = base^(-2i/d) for i = 0 .. d/2 - 1, shape (d/2,)."""
    i = np.arange(rotary_dim // 2, dtype=np.float64)
    return base ** (-2.0 * i / rotary_dim)


def rotation_matrix(position: float, theta: np.ndarray) -> np.ndarray:
    """The block-diagonal matrix R_{Theta,m}: one 2x2 rotation by m*theta_i per pair (2i, 2i+1).

    Returns shape (d, d) with d = 2 * len(theta).
    """
    d = 2 * len(theta)
    r = np.zeros((d, d), dtype=np.float64)
    for i, t in enumerate(theta):
        c, s = np.cos(position * t), np.sin(position * t)
        r[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = [[c, -s], [s, c]]
    return r


def rotate_matrix(x: np.ndarray, position: float, theta: np.ndarray) -> np.ndarray:
    """R_{Theta,m} x for one position; x has shape (..., D) and is paired interleaved."""
    x = np.asarray(x, dtype=np.float64)
    d = 2 * len(theta)
    out = x.copy()
    out[..., :d] = x[..., :d] @ rotation_matrix(position, theta).T
    return out


def rotate_complex(x: np.ndarray, positions: np.ndarray | float, theta: np.ndarray) -> np.ndarray:
    """LLaMA's form: view pairs (2i, 2i+1) as x_{2i} + i x_{2i+1} and multiply by e^{i m theta}.

    ``positions`` broadcasts against ``x.shape[:-1]``.
    """
    x = np.asarray(x, dtype=np.float64)
    d = 2 * len(theta)
    z = x[..., 0:d:2] + 1j * x[..., 1:d:2]  # (..., d/2)
    angle = np.asarray(positions, dtype=np.float64)[..., None] * theta
    z = z * np.exp(1j * angle)
    out = x.copy()
    out[..., 0:d:2] = z.real
    out[..., 1:d:2] = z.imag
    return out


def _rotate_pairs(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """Rotate each pair (a, b) to (a cos - b sin, b cos + a sin); cos/sin broadcast to (..., d/2)."""
    x = np.asarray(x, dtype=np.float64)
    d = 2 * cos.shape[-1]
    if interleaved:
        a, b = x[..., 0:d:2], x[..., 1:d:2]
    else:
        a, b = x[..., : d // 2], x[..., d // 2 : d]
    ra, rb = a * cos - b * sin, b * cos + a * sin
    out = x.copy()
    if interleaved:
        out[..., 0:d:2], out[..., 1:d:2] = ra, rb
    else:
        out[..., : d // 2], out[..., d // 2 : d] = ra, rb
    return out


def rotate_interleaved(x: np.ndarray, positions: np.ndarray | float, theta: np.ndarray) -> np.ndarray:
    """GPT-J / Meta pairing (2i, 2i+1). ``positions`` broadcasts against ``x.shape[:-1]``."""
    angle = np.asarray(positions, dtype=np.float64)[..., None] * theta
    return _rotate_pairs(x, np.cos(angle), np.sin(angle), interleaved=True)


def rotate_half(x: np.ndarray, positions: np.ndarray | float, theta: np.ndarray) -> np.ndarray:
    """GPT-NeoX / Hugging Face pairing (i, i + d/2). ``positions`` broadcasts against ``x.shape[:-1]``."""
    angle = np.asarray(positions, dtype=np.float64)[..., None] * theta
    return _rotate_pairs(x, np.cos(angle), np.sin(angle), interleaved=False)


def apply_tables(
    x: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    positions: np.ndarray,
    interleaved: bool = False,
) -> np.ndarray:
    """Rotate with precomputed tables, the contract of ``ropekit.apply_rotary``.

    x: (..., heads, D); cos, sin: (table_len, d/2); positions: integer array of shape x.shape[:-2].
    Row ``positions[...]`` of the tables serves every head of that token. Tables may carry an attention
    scaling, so this is a rotation only when cos^2 + sin^2 = 1.
    """
    cos = np.asarray(cos, dtype=np.float64)[np.asarray(positions)][..., None, :]  # (..., 1, d/2)
    sin = np.asarray(sin, dtype=np.float64)[np.asarray(positions)][..., None, :]
    return _rotate_pairs(x, cos, sin, interleaved)


def half_to_interleaved_permutation(d: int) -> np.ndarray:
    """Index array p such that ``x_half[..., p]`` is the same vector laid out interleaved.

    Half layout stores pair i at (i, i + d/2); interleaved stores it at (2i, 2i+1).
    """
    p = np.empty(d, dtype=np.int64)
    p[0::2] = np.arange(d // 2)
    p[1::2] = np.arange(d // 2) + d // 2
    return p


def interleaved_to_half_permutation(d: int) -> np.ndarray:
    """Inverse of :func:`half_to_interleaved_permutation`: ``x_inter[..., p]`` is the half layout."""
    return np.argsort(half_to_interleaved_permutation(d))


def sinusoidal(positions: np.ndarray, dim: int, base: float = 10000.0) -> np.ndarray:
    """Vaswani et al. (2017): PE(m, 2i) = sin(m / base^(2i/dim)), PE(m, 2i+1) = cos(m / base^(2i/dim)).

    Returns shape (len(positions), dim).
    """
    m = np.asarray(positions, dtype=np.float64)[:, None]
    angle = m * inv_freq(dim, base)[None, :]
    pe = np.zeros((len(m), dim), dtype=np.float64)
    pe[:, 0::2] = np.sin(angle)
    pe[:, 1::2] = np.cos(angle)
    return pe
