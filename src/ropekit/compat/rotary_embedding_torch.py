"""lucidrains' rotary-embedding-torch (``rotary_embedding_torch``, 0.9) on the core.

Migration: ``from rotary_embedding_torch import RotaryEmbedding, apply_rotary_emb`` becomes
``from ropekit.compat.rotary_embedding_torch import RotaryEmbedding, apply_rotary_emb``; construction and
calls stay as they are. Every method and function also takes ropekit's ``backend=`` (keyword only; the
module's constructor sets the default for its methods).

Shape notation: n sequence, d head_dim, R the rotated width (2 x the number of frequencies: ``dim`` for
``freqs_for="lang"`` / ``"pixel"``, 2 x ``num_freqs`` for ``"constant"``), ... any leading axes.

Pairing: (2i, 2i+1) (GPT-J / Meta style), as the peer's ``rotate_half`` on ``'... (d r)'`` does; features
past R pass through. ``freqs`` as the peer returns them are angles (..., R) with each pair's angle written
twice (``repeat(..., '... n -> ... (n r)', r=2)``).

Same semantics as the peer: queries and keys are (..., n, d) (``seq_before_head_dim=False``, e.g.
(b, h, n, d)) or (..., n, h, d) (True); positions are (arange(n) + offset) / interpolate_factor;
``theta_rescale_factor`` is the NTK-aware base theta x factor^(dim / (dim - 2)) (:func:`ropekit.schedules.
ntk_base`); xPos scales queries by zeta_i^((p - n // 2) / xpos_scale_base) and keys by its inverse,
zeta_i = (2i/dim + 0.4) / 1.4 (Sun et al. 2022); ``rotate_queries_with_cached_keys`` places the queries at
the end of the keys (positions k_len - q_len + offset onward); ``learned_freq=True`` makes ``freqs`` an
``nn.Parameter`` that trains; ``get_axial_freqs`` builds N-D frequencies for pixels (positions
``linspace(-1, 1, size)`` for ``freqs_for="pixel"``, ``arange(size)`` otherwise) to apply with
:func:`apply_rotary_emb`. Outputs have the input's dtype; nothing passed in is modified.

Differences:

- Positions are exact (the peer forms them in the input's dtype, which rounds bfloat16 positions past 256),
  and angles of fixed frequencies are formed in float64.
- Nothing is cached, so ``"constant"`` and custom frequencies narrower than dim work with the default
  ``cache_if_possible=True`` (the peer's dim-wide cache raises for them).
- xPos scales are centred on the length of the call that uses them. The peer caches the scales of its first
  call and reuses them for shorter later calls, which centres those on the first call's length.
- Invalid arguments are ValueErrors naming them (the peer asserts, or fails on an unbound variable for an
  unknown ``freqs_for``); so is an odd ``dim`` with ``freqs_for="lang"`` (the peer then divides the
  exponents by the odd dim).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ropekit.compat._common import check_backend_name
from ropekit.config import RopeConfig
from ropekit.functional import apply_rotary
from ropekit.schedules import ntk_base
from ropekit.validation import check_bool, check_int, check_number, check_positive, describe

__all__ = ["RotaryEmbedding", "apply_rotary_emb"]

_FREQS_FOR = ("lang", "pixel", "constant")


def _to_core_layout(t: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """(..., n, d) with seq_dim -2, or (..., n, h, d) with seq_dim -3, as a (B, n, H, D) view or copy."""
    if seq_dim == -2:
        return t.reshape(-1, t.shape[-2], t.shape[-1]).transpose(0, 1).unsqueeze(0)  # (1, n, L, d)
    return t.reshape(-1, *t.shape[-3:])  # (L, n, h, d)


def _from_core_layout(out: torch.Tensor, like: torch.Tensor, seq_dim: int) -> torch.Tensor:
    if seq_dim == -2:
        out = out.squeeze(0).transpose(0, 1)  # (L, n, d)
    return out.reshape(like.shape)


def _seq_dim(t: object, seq_dim: object) -> int:
    if not isinstance(t, torch.Tensor) or t.dim() < 2:
        raise ValueError(f"t: expected a tensor (..., seq, head_dim) of at least 2 axes, got {describe(t)}")
    dim = check_int("seq_dim", seq_dim, minimum=-t.dim(), maximum=t.dim() - 1, expected="-2 or -3")
    dim = dim - t.dim() if dim >= 0 else dim
    if dim not in (-2, -3) or (dim == -3 and t.dim() < 3):
        raise ValueError(
            f"seq_dim: expected -2 (..., seq, head_dim) or -3 (..., seq, heads, head_dim) for a "
            f"{t.dim()}-D tensor, got {seq_dim!r}"
        )
    return dim


def apply_rotary_emb(
    freqs: torch.Tensor,
    t: torch.Tensor,
    start_index: int = 0,
    scale: float | torch.Tensor = 1.0,
    seq_dim: int = -2,
    freqs_seq_dim: int | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Mirrors ``rotary_embedding_torch.apply_rotary_emb``: rotate features [start_index, start_index + R)
    of t by the angles ``freqs`` (..., R), each pair's angle written twice, broadcast over t's leading axes.

    Args:
        freqs: angles (..., R) as :meth:`RotaryEmbedding.forward` or :meth:`RotaryEmbedding.get_axial_freqs`
            return them; a 2-D freqs (or a 3-D t) is read along freqs_seq_dim (default 0), keeping its last
            seq rows, as the peer does.
        t: the tensor to rotate; not modified.
        start_index: the first rotated feature.
        scale: a number, or per-feature factors broadcasting like freqs (xPos), multiplied into the rotation.
        seq_dim, freqs_seq_dim: as in the peer.
        backend: ropekit's backend.

    Returns:
        The rotated tensor, shaped like t, in t's dtype.

    Raises:
        ValueError: freqs wider than t past start_index, an odd width, shapes that do not broadcast to t.
    """
    for name, x in (("freqs", freqs), ("t", t)):
        if not isinstance(x, torch.Tensor) or x.dim() < 1:
            raise ValueError(f"{name}: expected a tensor, got {describe(x)}")
    if freqs_seq_dim is None and (freqs.dim() == 2 or t.dim() == 3):
        freqs_seq_dim = 0
    if t.dim() == 3 or freqs_seq_dim is not None:
        seq_len = t.shape[seq_dim]
        length = freqs.shape[freqs_seq_dim]
        freqs = freqs.narrow(freqs_seq_dim, max(length - seq_len, 0), min(seq_len, length))  # last seq_len
    rot = freqs.shape[-1]
    start = check_int("start_index", start_index, minimum=0, expected="a non-negative int")
    if rot % 2 or start + rot > t.shape[-1]:
        raise ValueError(
            f"freqs: expected an even width R with start_index + R <= t's last axis ({t.shape[-1]}), "
            f"got width {rot} and start_index {start}"
        )
    tokens = t.shape[:-1]
    try:
        if torch.broadcast_shapes(freqs.shape[:-1], tokens) != tokens:
            raise RuntimeError
    except RuntimeError:
        raise ValueError(
            f"freqs: expected leading axes that broadcast to t's {tuple(tokens)}, got {tuple(freqs.shape)}"
        ) from None
    angle = freqs[..., 0::2]  # (..., R/2): one angle per pair
    cos, sin = angle.cos(), angle.sin()
    if isinstance(scale, torch.Tensor):
        scale = scale[..., 0::2] if scale.dim() and scale.shape[-1] == rot else scale
        cos, sin = cos * scale, sin * scale
    elif scale != 1:
        scale = check_number("scale", scale, minimum=-math.inf)
        cos, sin = cos * scale, sin * scale
    count = math.prod(tokens)
    cos = cos.expand(*tokens, rot // 2).reshape(count, rot // 2)  # one row per token of t
    sin = sin.expand(*tokens, rot // 2).reshape(count, rot // 2)
    x = t[..., start:].reshape(1, count, 1, t.shape[-1] - start)  # (1, tokens, 1, d - start)
    out = apply_rotary(x, cos.float(), sin.float(), per_token=True, interleaved=True, backend=backend)
    out = out.reshape(*tokens, t.shape[-1] - start)
    return out if start == 0 else torch.cat([t[..., :start], out], dim=-1)


class RotaryEmbedding(nn.Module):
    """Mirrors ``rotary_embedding_torch.RotaryEmbedding`` (module docstring for the semantics).

    Args:
        dim: the rotated width for ``"lang"`` and ``"pixel"`` (features past it pass through).
        custom_freqs: a tensor of frequencies to use instead of a schedule.
        freqs_for: "lang" (theta^(-2i/dim)), "pixel" (linspace(1, max_freq / 2, dim // 2) x pi) or
            "constant" (num_freqs ones).
        theta, max_freq, num_freqs: the schedules' parameters.
        learned_freq: train ``freqs`` (an ``nn.Parameter`` either way, as in the peer).
        use_xpos, xpos_scale_base: xPos; then rotate with :meth:`rotate_queries_and_keys`.
        interpolate_factor: positions are divided by it (>= 1).
        theta_rescale_factor: NTK-aware rescaling of theta.
        seq_before_head_dim: inputs are (..., n, h, d) rather than (..., n, d).
        cache_if_possible, cache_max_seq_len: accepted for the peer's signature; ropekit builds each call's
            tables from ``freqs`` directly.
        backend: ropekit's backend for every method.

    Raises:
        ValueError: an unknown freqs_for, a dim that is not a positive int, an interpolate_factor below 1,
            non-positive theta / scale base, an unknown backend.
    """

    def __init__(
        self,
        dim: int,
        custom_freqs: torch.Tensor | None = None,
        freqs_for: str = "lang",
        theta: float = 10000,
        max_freq: float = 10,
        num_freqs: int = 1,
        learned_freq: bool = False,
        use_xpos: bool = False,
        xpos_scale_base: float = 512,
        interpolate_factor: float = 1.0,
        theta_rescale_factor: float = 1.0,
        seq_before_head_dim: bool = False,
        cache_if_possible: bool = True,
        cache_max_seq_len: int = 8192,
        *,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        dim = check_int("dim", dim, minimum=1, expected="a positive int")
        if freqs_for not in _FREQS_FOR:
            raise ValueError(f"freqs_for: expected one of {_FREQS_FOR}, got {freqs_for!r}")
        theta = check_positive("theta", theta)
        theta_rescale_factor = check_positive("theta_rescale_factor", theta_rescale_factor)
        if theta_rescale_factor != 1:
            theta = ntk_base(theta, theta_rescale_factor, dim)
        if custom_freqs is not None:
            if not isinstance(custom_freqs, torch.Tensor) or custom_freqs.dim() != 1:
                raise ValueError(f"custom_freqs: expected a 1-D tensor or None, got {describe(custom_freqs)}")
            freqs = custom_freqs
        elif freqs_for == "lang":
            if dim % 2:
                raise ValueError(f"dim: expected an even int for freqs_for='lang', got {dim}")
            freqs = RopeConfig(dim, theta, hf_float32_inv_freq=True).inv_freq().float()  # (dim / 2,) float32
        elif freqs_for == "pixel":
            freqs = torch.linspace(1.0, max_freq / 2, dim // 2) * math.pi
        else:
            freqs = torch.ones(check_int("num_freqs", num_freqs, minimum=1, expected="a positive int"))
        self.dim, self.freqs_for = dim, freqs_for
        self.learned_freq = check_bool("learned_freq", learned_freq)
        self.freqs = nn.Parameter(freqs, requires_grad=self.learned_freq)
        self.cache_if_possible, self.cache_max_seq_len = cache_if_possible, cache_max_seq_len
        self.register_buffer("dummy", torch.tensor(0), persistent=False)  # the peer's device marker
        self.seq_before_head_dim = check_bool("seq_before_head_dim", seq_before_head_dim)
        self.default_seq_dim = -3 if seq_before_head_dim else -2
        self.interpolate_factor = check_number("interpolate_factor", interpolate_factor, minimum=1)
        self.use_xpos = check_bool("use_xpos", use_xpos)
        self.backend = check_backend_name(backend)
        if use_xpos:
            self.scale_base = check_positive("xpos_scale_base", xpos_scale_base)
            scale = (torch.arange(0, dim, 2) + 0.4 * dim) / (1.4 * dim)  # xPos's zeta_i, the peer's buffer
            self.register_buffer("scale", scale, persistent=False)

    @property
    def device(self) -> torch.device:
        return self.dummy.device

    def get_seq_pos(self, seq_len: int, device=None, dtype=None, offset: float = 0) -> torch.Tensor:
        """Positions (arange(seq_len) + offset) / interpolate_factor, in float64 unless dtype says
        otherwise (the peer uses the input's dtype)."""
        device = self.device if device is None else device
        dtype = torch.float64 if dtype is None else dtype
        return (torch.arange(seq_len, device=device, dtype=dtype) + offset) / self.interpolate_factor

    def forward(self, t: torch.Tensor, seq_len: int | None = None, offset: float = 0) -> torch.Tensor:
        """Angles (..., R) for positions t (...), each pair's angle written twice, in freqs' dtype.

        seq_len and offset are the peer's cache keys; the angles depend on t alone.
        """
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"t: expected a tensor of positions, got {describe(t)}")
        freqs = self.freqs
        angles = t.to(freqs.dtype)[..., None] * freqs  # (..., R/2)
        return angles.repeat_interleave(2, dim=-1)  # (..., R)

    def _tables(self, positions: torch.Tensor, scale: torch.Tensor | None = None):
        """cos, sin (n, R/2) for float64 positions (n,), times scale (n, R/2) if given; float32."""
        freqs = self.freqs
        if freqs.requires_grad and torch.is_grad_enabled():
            angles = positions.to(freqs.dtype)[:, None] * freqs  # differentiable in freqs
        else:
            angles = positions.double()[:, None] * freqs.detach().double()
        cos, sin = angles.cos(), angles.sin()
        if scale is not None:
            cos, sin = cos * scale, sin * scale
        return cos.float(), sin.float()

    def get_scale(self, t: torch.Tensor, seq_len: int | None = None, offset: float = 0) -> torch.Tensor:
        """xPos factors (n, R) for positions t (n,): zeta_i^((t - n // 2) / xpos_scale_base), each twice."""
        if not self.use_xpos:
            raise ValueError("use_xpos: get_scale needs a module built with use_xpos=True")
        return self._xpos(t).repeat_interleave(2, dim=-1)

    def _xpos(self, positions: torch.Tensor) -> torch.Tensor:
        power = (positions.double() - positions.shape[0] // 2) / self.scale_base  # (n,)
        return self.scale.double() ** power[:, None]  # (n, R/2)

    def _rotate(self, t, cos, sin, seq_dim, backend):
        x = _to_core_layout(t, seq_dim)
        out = apply_rotary(
            x, cos, sin, interleaved=True, backend=self.backend if backend is None else backend
        )
        return _from_core_layout(out, t, seq_dim)

    def rotate_queries_or_keys(
        self,
        t: torch.Tensor,
        seq_dim: int | None = None,
        offset: float = 0,
        scale: torch.Tensor | float | None = None,
        *,
        backend: str | None = None,
    ) -> torch.Tensor:
        """t (..., n, d) (or (..., n, h, d)) rotated at positions (arange(n) + offset) / interpolate_factor.

        Raises:
            ValueError: with use_xpos and no scale (use :meth:`rotate_queries_and_keys`), a bad seq_dim.
        """
        seq_dim = _seq_dim(t, self.default_seq_dim if seq_dim is None else seq_dim)
        if self.use_xpos and scale is None:
            raise ValueError(
                "scale: use_xpos=True scales queries and keys oppositely; call rotate_queries_and_keys (or "
                "rotate_queries_with_cached_keys) with both, or pass scale"
            )
        positions = self.get_seq_pos(t.shape[seq_dim], device=t.device, offset=offset)
        if isinstance(scale, torch.Tensor) and scale.dim():
            scale = scale[..., 0::2].double()  # (n, R) with each pair's factor twice -> (n, R/2)
        elif scale is not None and scale != 1:
            scale = torch.full((1, 1), float(scale), dtype=torch.float64, device=t.device)
        else:
            scale = None
        cos, sin = self._tables(positions, scale)
        return self._rotate(t, cos, sin, seq_dim, backend)

    def rotate_queries_and_keys(
        self, q: torch.Tensor, k: torch.Tensor, seq_dim: int | None = None, *, backend: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """xPos: q scaled by zeta^((p - n // 2) / xpos_scale_base), k by its inverse, both rotated.

        Raises:
            ValueError: without use_xpos, or q / k of another sequence length.
        """
        if not self.use_xpos:
            raise ValueError("use_xpos: rotate_queries_and_keys is xPos's call; build with use_xpos=True")
        seq_dim = _seq_dim(q, self.default_seq_dim if seq_dim is None else seq_dim)
        if not isinstance(k, torch.Tensor) or k.dim() != q.dim() or k.shape[seq_dim] != q.shape[seq_dim]:
            raise ValueError(f"k: expected q's rank and sequence length {tuple(q.shape)}, got {describe(k)}")
        positions = self.get_seq_pos(q.shape[seq_dim], device=q.device)
        scale = self._xpos(positions)
        q_out = self._rotate(q, *self._tables(positions, scale), seq_dim, backend)
        return q_out, self._rotate(k, *self._tables(positions, 1 / scale), seq_dim, backend)

    def rotate_queries_with_cached_keys(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        seq_dim: int | None = None,
        offset: float = 0,
        *,
        backend: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q (the last q_len tokens) and k (all k_len tokens): q at positions k_len - q_len + offset onward, k
        from 0. With xPos, q's scales are those of the last q_len key positions (centred on q_len // 2) and
        k's their inverse over k_len (centred on k_len // 2), as the peer computes them.

        Raises:
            ValueError: q longer than k, or a bad seq_dim.
        """
        seq_dim = _seq_dim(q, self.default_seq_dim if seq_dim is None else seq_dim)
        _seq_dim(k, seq_dim)
        q_len, k_len = q.shape[seq_dim], k.shape[seq_dim]
        if q_len > k_len:
            raise ValueError(f"q: expected at most k's {k_len} tokens along seq_dim, got {q_len}")
        q_scale = k_scale = None
        if self.use_xpos:
            seq = self.get_seq_pos(k_len, device=q.device)
            q_scale, k_scale = self._xpos(seq[k_len - q_len :]), 1 / self._xpos(seq)
        q_pos = self.get_seq_pos(q_len, device=q.device, offset=k_len - q_len + offset)
        q_out = self._rotate(q, *self._tables(q_pos, q_scale), seq_dim, backend)
        k_out = self._rotate(
            k, *self._tables(self.get_seq_pos(k_len, device=k.device), k_scale), seq_dim, backend
        )
        return q_out, k_out

    def get_axial_freqs(
        self, *dims: int, offsets: tuple[float, ...] | torch.Tensor | None = None
    ) -> torch.Tensor:
        """Angles (*dims, len(dims) * R) for an N-D grid: axis a's block holds that axis's position times the
        frequencies; positions linspace(-1, 1, size) for pixels, arange(size) otherwise, plus offsets[a].

        Raises:
            ValueError: sizes that are not positive ints, offsets not one per axis.
        """
        sizes = [check_int("dims", d, minimum=1, expected="positive ints") for d in dims]
        if offsets is not None:
            offsets = torch.as_tensor(offsets)
            if offsets.shape != (len(sizes),):
                raise ValueError(f"offsets: expected one per axis ({len(sizes)}), got {describe(offsets)}")
        blocks = []
        for axis, size in enumerate(sizes):
            if self.freqs_for == "pixel":
                pos = torch.linspace(-1, 1, steps=size, device=self.device)
            else:
                pos = torch.arange(size, device=self.device)
            if offsets is not None:
                pos = pos + offsets[axis]
            angles = self.forward(pos, seq_len=size)  # (size, R)
            shape = [1] * len(sizes) + [angles.shape[-1]]
            shape[axis] = size
            blocks.append(angles.reshape(shape))
        return torch.cat(torch.broadcast_tensors(*blocks), dim=-1)
