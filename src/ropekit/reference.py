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
    "fope_tables",
    "half_to_interleaved_permutation",
    "interleaved_to_half_permutation",
    "inv_freq",
    "rotate_complex",
    "rotate_fope",
    "rotate_half",
    "rotate_interleaved",
    "rotate_matrix",
    "rotate_multiaxis",
    "rotation_matrix",
    "shared_kv_attention",
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


def rotate_multiaxis(
    x: np.ndarray,
    positions: np.ndarray,
    theta: np.ndarray,
    axis_of_pair: np.ndarray,
    interleaved: bool = False,
) -> np.ndarray:
    """Multi-axis RoPE (M-RoPE, Bailing, XD-RoPE): pair j turns by positions[axis_of_pair[j]] * theta_j.

    ``positions`` is (axes, ...), the trailing axes broadcasting against ``x.shape[:-1]``; ``axis_of_pair``
    (d/2,) names the axis each pair follows. With every axis equal this is :func:`rotate_half` (or
    :func:`rotate_interleaved`).
    """
    pos = np.asarray(positions, dtype=np.float64)
    angle = np.moveaxis(pos[np.asarray(axis_of_pair)], 0, -1) * theta  # (..., d/2)
    return _rotate_pairs(x, np.cos(angle), np.sin(angle), interleaved)


def fope_tables(
    positions: np.ndarray, theta: np.ndarray, cos_coef: np.ndarray, sin_coef: np.ndarray, head_dim: int
) -> tuple[np.ndarray, np.ndarray]:
    """FoPE's (Fourier position embedding) per-head tables, as vLLM's ``FourierRotaryEmbedding`` forms them.

    Each of the F frequencies theta (F,) is a Fourier basis function; key-value head h mixes them with its
    learned (F, F) coefficients: cos'[m, h, d] = sum_f cos(m theta_f) cos_coef[h, f, d], and sin' likewise
    with sin_coef. The D/2 - F entries past F are 1 in both tables (vLLM pads with 1).

    Returns:
        (cos, sin), each (len(positions), H, D/2), read with the half pairing over the whole head.
    """
    angle = np.asarray(positions, dtype=np.float64)[:, None] * theta  # (T, F)
    cos = np.einsum("tf,hfd->thd", np.cos(angle), np.asarray(cos_coef, dtype=np.float64))
    sin = np.einsum("tf,hfd->thd", np.sin(angle), np.asarray(sin_coef, dtype=np.float64))
    pad = ((0, 0), (0, 0), (0, head_dim // 2 - theta.shape[0]))
    return np.pad(cos, pad, constant_values=1.0), np.pad(sin, pad, constant_values=1.0)


def rotate_fope(
    x: np.ndarray, positions: np.ndarray, theta: np.ndarray, cos_coef: np.ndarray, sin_coef: np.ndarray
) -> np.ndarray:
    """FoPE on x (T, H, D): head i uses key-value head i // (H / H_kv) of the coefficients (H_kv, F, F).

    Each pair (i, i + D/2) becomes (a cos' - b sin', b cos' + a sin'): a rotation only where cos'^2 + sin'^2
    is 1, which learned coefficients do not promise.
    """
    x = np.asarray(x, dtype=np.float64)
    heads, kv_heads = x.shape[1], cos_coef.shape[0]
    cos, sin = fope_tables(positions, theta, cos_coef, sin_coef, x.shape[-1])  # (T, H_kv, D/2)
    group = np.arange(heads) // (heads // kv_heads)  # (H,): the key-value head of each head
    return _rotate_pairs(x, cos[:, group], sin[:, group], interleaved=False)


def shared_kv_attention(
    q: np.ndarray, kv: np.ndarray, positions: np.ndarray, theta: np.ndarray, scale: float
) -> np.ndarray:
    """Causal attention whose keys are also its values, rotated, as in DeepSeek-V4.

    q (S, H, D), kv (S, D) (one shared key-value head); the trailing d = 2 len(theta) features rotate with
    interleaved pairs (the leading D - d pass through). q and kv are rotated at their positions, kv is used as
    key and value, and the output's trailing d features are rotated back by -theta at the query's position,
    so each value's rope part reaches query i turned by (p_j - p_i) theta: relative, like the scores.
    Returns (S, H, D).
    """
    q, kv = np.asarray(q, dtype=np.float64), np.asarray(kv, dtype=np.float64)
    d, dim = 2 * len(theta), q.shape[-1]
    lead = dim - d

    def turn(t: np.ndarray, pos: np.ndarray) -> np.ndarray:
        out = t.copy()
        out[..., lead:] = rotate_interleaved(t[..., lead:], pos, theta)
        return out

    pos = np.asarray(positions, dtype=np.float64)
    qr, kvr = turn(q, pos[:, None]), turn(kv, pos)  # (S, H, D), (S, D)
    scores = np.einsum("ihd,jd->hij", qr, kvr) * scale  # (H, S, S)
    scores = np.where(np.tril(np.ones((len(pos), len(pos)), dtype=bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out = np.einsum("hij,jd->ihd", weights, kvr)  # (S, H, D)
    return turn(out, -pos[:, None])
