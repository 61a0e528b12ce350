"""``ropekit verify`` rows for QK-RMSNorm + RoPE (:func:`ropekit.qk_norm_rotary_`), one set per backend.

Each row runs qk_norm_rotary_ on one backend, storage dtype and norm form (transformers' Qwen3, Gemma 3 and
OLMo 2 q_norm / k_norm) and compares it with the float64 composition: the norm of the stored q and k times
the stored weight, then the reference rotation. The row reports the largest error / bound, which must stay
<= 1; the bound is :func:`~ropekit.tools.verify.backend_error_bound` plus the norm's own rounding to the
storage dtype before the rotation (where the model rounds it; Qwen3 rounds twice): at most 1.5 ulps of the
dtype at the largest normalised value, as the rotation mixes two of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ropekit import reference as ref
from ropekit.config import RopeConfig
from ropekit.fused.qk_norm import qk_norm_rotary_

__all__ = ["QK_NORM_BACKENDS", "QK_NORM_FORMS", "qk_norm_checks"]

# form -> qk_norm_rotary_ keywords: transformers' Qwen3, Gemma 3 and OLMo 2 q_norm / k_norm.
QK_NORM_FORMS = {"qwen3": {}, "gemma3": {"weight_offset": 1.0}, "olmo2": {"norm": "all_heads"}}
# The backends with a QK-norm kernel of their own (another registered backend would run the torch path).
QK_NORM_BACKENDS = ("torch", "cpu", "triton")
# Storage dtypes checked (math runs in float32 for both), as for the rotation rows.
DTYPES = (torch.float32, torch.bfloat16)


def _composition(
    x: np.ndarray, weights, positions, theta, rotate, q_heads, k_heads, head_dim, kw
) -> np.ndarray:
    """The float64 truth for the q and k features of x (T, W): RMSNorm of each form, then the rotation."""
    all_heads, eps = kw.get("norm") == "all_heads", kw["eps"]
    parts, start = [], 0
    for heads, w in zip((q_heads, k_heads), weights, strict=True):
        part = x[:, start : start + heads * head_dim]
        groups = part if all_heads else part.reshape(len(x), heads, head_dim)
        normed = groups / np.sqrt(np.mean(groups**2, axis=-1, keepdims=True) + eps)
        y = (normed * (w + kw.get("weight_offset", 0.0))).reshape(len(x), heads, head_dim)
        parts.append(rotate(y, positions[:, None], theta).reshape(len(x), -1))
        start += heads * head_dim
    return np.concatenate(parts, axis=-1)


def qk_norm_checks(config: RopeConfig, backends: Sequence[str], rng: np.random.Generator, n_positions: int,
                   max_position: int, *, check, bound, device_of) -> list:  # fmt: skip
    """The QK-norm rows for each backend; ``check(name, error, tolerance)`` builds a row, ``bound`` is
    backend_error_bound and ``device_of`` backend_device (passed in: the tools import each other one way)."""
    q_heads, k_heads, eps = 2, 1, 1e-6
    head_dim, theta = config.head_dim, ref.inv_freq(config.rotary_dim, config.base)
    positions = rng.integers(0, max_position, size=n_positions)
    qkv = rng.standard_normal((n_positions, (q_heads + 2 * k_heads) * head_dim)) * 3
    cos, sin = config.cos_sin(int(positions.max()) + 1)  # float32: what production tables are
    rotate = ref.rotate_interleaved if config.interleaved else ref.rotate_half
    qk_width = (q_heads + k_heads) * head_dim
    rows = []
    for form, form_kw in QK_NORM_FORMS.items():
        kw = {**form_kw, "eps": eps}
        widths = (q_heads * head_dim, k_heads * head_dim) if form_kw.get("norm") else (head_dim, head_dim)
        weights = [1 + 0.3 * rng.standard_normal(n) for n in widths]
        for name in (b for b in backends if b in QK_NORM_BACKENDS):
            device = device_of(name)
            for dtype in DTYPES:
                stored = torch.from_numpy(qkv).to(dtype)
                stored_w = [torch.from_numpy(w).to(dtype) for w in weights]
                want = _composition(
                    stored.double().numpy(), [w.double().numpy() for w in stored_w], positions, theta, rotate,
                    q_heads, k_heads, head_dim, kw,
                )  # fmt: skip
                got = stored.to(device)
                packing = dict(num_q_heads=q_heads, num_kv_heads=k_heads, head_dim=head_dim)
                qk_norm_rotary_(
                    got, *(w.to(device) for w in stored_w), cos.to(device), sin.to(device), **packing,
                    positions=torch.from_numpy(positions).to(device), interleaved=config.interleaved,
                    backend=name, **kw,
                )  # fmt: skip
                scale = float(np.abs(want).max())
                limit = bound(want, dtype, scale) + 1.5 * torch.finfo(dtype).eps * scale
                error = np.abs(got[:, :qk_width].double().cpu().numpy() - want) / limit
                dtype_name = str(dtype).removeprefix("torch.")
                label = f"qk_norm_rotary_ {name} {dtype_name} ({form}) = float64 composition (error / bound)"
                rows.append(check(label, float(error.max()), 1.0))
    return rows
