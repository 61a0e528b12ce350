"""``ropekit verify`` rows for the serving fusions (:mod:`ropekit.fused`), one set per backend.

Each row compares a fused op with what the mathematics or the rounding contract says it must produce:

* the cache write: q and the key cache equal the float64 reference rotation, within
  :func:`~ropekit.tools.verify.backend_error_bound` (the row reports the largest error / bound, <= 1), and the
  value cache holds v exactly;
* FP8: the number of output bytes that differ from ``(r / scale).clamp(-fmax, fmax).to(fp8)`` (must be 0);
* the shift: a cache written at p and shifted by delta against one written at p + delta (error / bound, with
  the bound doubled: two roundings).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ropekit import reference as ref
from ropekit.backends import BACKENDS, FUSED_BACKENDS
from ropekit.config import RopeConfig
from ropekit.fused import apply_rotary_qk_and_cache, apply_rotary_qk_fp8, shift_cache_

__all__ = ["fused_checks"]

PAGE_SIZE = 4
# Small enough that the largest q / Q_SCALE passes float8_e4m3fn's 448: the saturation is checked too.
Q_SCALE = 0.005


def _pos_tensor(positions: np.ndarray, device) -> torch.Tensor:
    return torch.from_numpy(positions).to(device)


def fused_checks(config: RopeConfig, backends: Sequence[str], rng: np.random.Generator, n_positions: int,
                 max_position: int, *, check, bound, device_of) -> list:  # fmt: skip
    """The fused rows for each backend; ``check(name, error, tolerance)`` builds a row, ``bound`` is
    backend_error_bound and ``device_of`` backend_device (passed in: the tools import each other one way)."""
    theta = ref.inv_freq(config.rotary_dim, config.base)
    positions = rng.integers(1, max_position, size=n_positions)
    delta = -int(rng.integers(1, positions.min() + 1))  # back towards 0, staying >= 0
    cos, sin = config.cos_sin(int(positions.max()) + 1)  # float32: what production tables are
    rotate = ref.rotate_interleaved if config.interleaved else ref.rotate_half
    heads, dim = 2, config.head_dim
    q = rng.standard_normal((n_positions, 2 * heads, dim))  # (T, Hq, D)
    k, v = rng.standard_normal((2, n_positions, heads, dim))  # (T, Hk, D)
    pages = -(-2 * n_positions // PAGE_SIZE)
    slots = rng.permutation(pages * PAGE_SIZE)[:n_positions]
    rows = []
    for name in (b for b in backends if b in FUSED_BACKENDS):
        device = device_of(name)
        tables = cos.to(device), sin.to(device)
        pos = _pos_tensor(positions, device)
        qt, kt, vt = (torch.from_numpy(a).float().to(device) for a in (q, k, v))
        slot_t = torch.from_numpy(slots).to(device)
        for layout in ("nhd", "hnd"):
            shape = (pages, PAGE_SIZE, heads, dim) if layout == "nhd" else (pages, heads, PAGE_SIZE, dim)
            k_cache, v_cache = torch.zeros(shape, device=device), torch.zeros(shape, device=device)
            q_out = apply_rotary_qk_and_cache(
                qt, kt, vt, *tables, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_t,
                cache_layout=layout, positions=pos, interleaved=config.interleaved, backend=name,
            )  # fmt: skip
            flat = k_cache if layout == "nhd" else k_cache.transpose(1, 2)
            got_k = flat.flatten(0, 1)[slot_t].double().cpu().numpy()  # (T, Hk, D)
            v_flat = (v_cache if layout == "nhd" else v_cache.transpose(1, 2)).flatten(0, 1)[slot_t]
            error = 0.0
            for got, x in ((q_out.double().cpu().numpy(), q), (got_k, k)):
                want = rotate(x, positions[:, None], theta)
                scale = float(np.abs(x).max())
                error = max(error, float((np.abs(got - want) / bound(want, torch.float32, scale)).max()))
            exact = torch.equal(v_flat.cpu(), vt.cpu())
            label = f"fused rope+cache {name} float32 ({layout}) = float64 reference (error / bound)"
            rows.append(check(label, error if exact else float("inf"), 1.0))
        for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
            q8, k8 = _fp8(qt, kt, tables, pos, fp8, config.interleaved, name)
            differ = 0
            r_q, r_k = (_float32_rotation(t.cpu(), cos, sin, positions, config.interleaved) for t in (qt, kt))
            fmax = torch.finfo(fp8).max
            for got, r, s in ((q8, r_q, torch.tensor([Q_SCALE])), (k8, r_k, torch.tensor([0.5, 2.0]))):
                want = (r / s[:, None]).clamp(-fmax, fmax).to(fp8).view(torch.uint8)
                differ += int((got.cpu().view(torch.uint8) != want).sum())
            fp8_name = str(fp8).removeprefix("torch.")
            rows.append(check(f"fused rope+fp8 {name} {fp8_name}: bytes differing from the rounding contract",
                              float(differ), 0.0))  # fmt: skip
        # The shift: written at p then shifted by delta = written at p + delta.
        caches = []
        for at in (positions, positions + delta):
            k_cache = torch.zeros(pages, PAGE_SIZE, heads, dim, device=device)
            v_cache = torch.zeros_like(k_cache)
            apply_rotary_qk_and_cache(
                None, kt, vt, *tables, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_t,
                positions=_pos_tensor(at, device), interleaved=config.interleaved, backend=name,
            )  # fmt: skip
            caches.append(k_cache)
        shift_cache_(caches[0], *tables, delta, slots=slot_t, interleaved=config.interleaved, backend=name)
        got = caches[0].flatten(0, 1)[slot_t].double().cpu().numpy()
        want = rotate(k, (positions + delta)[:, None], theta)
        error = float((np.abs(got - want) / (2 * bound(want, torch.float32, float(np.abs(k).max())))).max())
        rows.append(check(f"shift_cache_ {name}: written at p, shifted by {delta} = written at p + delta "
                          "(error / 2 bound)", error, 1.0))  # fmt: skip
    return rows


def _fp8(qt, kt, tables, pos, fp8, interleaved, name):
    """q with one scale, k with one per head (0.5, 2.0)."""
    return apply_rotary_qk_fp8(
        qt, kt, *tables, q_scale=Q_SCALE, k_scale=torch.tensor([0.5, 2.0], device=qt.device), fp8_dtype=fp8,
        positions=pos, interleaved=interleaved, backend=name,
    )  # fmt: skip


def _float32_rotation(x: torch.Tensor, cos, sin, positions: np.ndarray, interleaved: bool) -> torch.Tensor:
    """The contract's r: the torch backend's float32 rotation."""
    rows = torch.from_numpy(positions).long()
    out, _ = BACKENDS["torch"].rotate_qk(x, None, cos, sin, rows, interleaved=interleaved, conjugate=False,
                                         inplace=False)  # fmt: skip
    return out
