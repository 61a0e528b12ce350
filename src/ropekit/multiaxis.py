"""Multi-axis RoPE: N-D axial tables for image patches, M-RoPE position ids, and xPos.

* Axial RoPE (ViT / EVA-02 / FLUX style) splits the rotary pairs between the axes of a grid: axis a owns
  ``axes_pairs[a]`` consecutive pairs with their own frequencies base^(-2i / (2 * axes_pairs[a])) and turns
  them by the patch's coordinate along that axis. q·k then depends only on the coordinate differences.
* M-RoPE (Qwen2-VL / Qwen3-VL) is handled by :meth:`ropekit.RopeConfig.cos_sin` from ``mrope_section``;
  :func:`mrope_positions` builds the (3, seq) position ids for a text / image / text sequence.
* xPos (Sun et al. 2022, arXiv:2212.10554) multiplies pair i of the query at position m by
  zeta_i^(m / scale_base) and of the key at n by zeta_i^(-n / scale_base), with
  zeta_i = (2i/d + gamma) / (1 + gamma), so q·k decays like zeta_i^((m - n) / scale_base) and still
  depends only on m - n.

Shape notation: N grid cells (patches), R rotary_dim, ... any leading axes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ropekit.config import RopeConfig
from ropekit.rope_index import vision_position_ids
from ropekit.validation import check_base, check_even, check_int, check_positive

__all__ = ["axial_cos_sin", "llama4_vision_positions", "mrope_positions", "xpos_cos_sin"]


def _positive_ints(name: str, values: Sequence[int]) -> tuple[int, ...]:
    expected = f"{name}: expected a non-empty list of positive integers, got {values!r}"
    if not isinstance(values, Sequence) or isinstance(values, str) or not values:
        raise ValueError(expected)
    try:
        return tuple(check_int(name, v) for v in values)
    except ValueError:
        raise ValueError(expected) from None


def axial_cos_sin(
    grid: Sequence[int],
    rotary_dim: int,
    base: float = 10000.0,
    *,
    axes_pairs: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for the cells of an N-D grid, one row per cell in row-major order.

    Args:
        grid: the grid's size along each axis, e.g. (height, width) or (frames, height, width).
        rotary_dim: rotated features per head (2 x the total number of pairs).
        base: RoPE base for every axis.
        axes_pairs: pairs per axis; defaults to an even split (rotary_dim / 2 divisible by len(grid)).
        dtype: output dtype (angles are formed in float64).

    Returns:
        (cos, sin), each (N, rotary_dim // 2) with N = prod(grid); use with
        ``apply_rotary(x, cos, sin, positions=cell_index)``.

    Raises:
        ValueError: for a bad grid, an odd rotary_dim, or pairs that do not add up to rotary_dim / 2.
    """
    grid = _positive_ints("grid", grid)
    pairs = check_even("rotary_dim", rotary_dim) // 2
    if axes_pairs is None:
        if pairs % len(grid):
            raise ValueError(
                f"axes_pairs: rotary_dim / 2 = {pairs} does not split evenly over {len(grid)} axes; "
                "pass axes_pairs"
            )
        axes_pairs = [pairs // len(grid)] * len(grid)
    axes_pairs = _positive_ints("axes_pairs", axes_pairs)
    if len(axes_pairs) != len(grid) or sum(axes_pairs) != pairs:
        raise ValueError(
            f"axes_pairs: expected {len(grid)} entries summing to rotary_dim / 2 = {pairs}, "
            f"got {list(axes_pairs)}"
        )
    base = check_base(base)
    coords = torch.meshgrid(*(torch.arange(n, dtype=torch.float64) for n in grid), indexing="ij")
    angles = []
    for coord, n_pairs in zip(coords, axes_pairs, strict=True):
        theta = RopeConfig(2 * n_pairs, base).inv_freq()  # (n_pairs,)
        angles.append(coord.reshape(-1, 1) * theta)  # (N, n_pairs)
    angle = torch.cat(angles, dim=-1)  # (N, rotary_dim // 2)
    return torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)


def mrope_positions(
    segments: Sequence[int | tuple[int, int, int]], *, spatial_merge: int = 1
) -> torch.Tensor:
    """(3, seq) M-RoPE position ids for a sequence of text runs and image / video grids, Qwen2-VL style.

    A text run of n tokens takes t = h = w = next, next + 1, ...; a grid (t, h, w) (already divided by the
    vision encoder's patch size) takes t, h and w offsets from the current start, and the next segment starts
    one past the largest id used so far (the original Qwen2-VL rule; for a batch of tokenized prompts with
    image and video grids, :func:`ropekit.get_rope_index` follows transformers 5).

    Args:
        segments: ints (text runs) and (t, h, w) tuples (visual grids), in sequence order.
        spatial_merge: Qwen2-VL merges 2 x 2 patches into one token; h and w are divided by this.

    Returns:
        int64 tensor (3, seq); add a batch axis (``[:, None]``) for :meth:`RopeConfig.cos_sin`.
    """
    spatial_merge = check_int("spatial_merge", spatial_merge)
    parts, start = [], 0
    for seg in segments:
        if isinstance(seg, int) and not isinstance(seg, bool) and seg > 0:
            parts.append((torch.arange(seg) + start).expand(3, seg))
            start += seg
        elif isinstance(seg, tuple) and len(seg) == 3:
            t, h, w = _positive_ints("segments grid", seg)
            if h % spatial_merge or w % spatial_merge:
                raise ValueError(f"segments: grid {seg} is not divisible by spatial_merge={spatial_merge}")
            ids = vision_position_ids(start, t, h // spatial_merge, w // spatial_merge)  # (3, t * h * w)
            parts.append(ids)
            start = int(ids.max()) + 1
        else:
            raise ValueError(
                f"segments: expected positive ints (text) or (t, h, w) tuples (grids), got {seg!r}"
            )
    if not parts:
        raise ValueError("segments: expected at least one segment, got none")
    return torch.cat(parts, dim=1)


def llama4_vision_positions(image_size: int, patch_size: int) -> torch.Tensor:
    """(2, N + 1) positions of Llama 4's vision encoder: (column + 1, row + 1) per patch, then (0, 0).

    The N = (image_size // patch_size)^2 patches come in row-major order and the class token last; it gets
    angle 0 (HF masks its frequencies to 0, which position 0 gives as well). Rotate with the config of
    ``RopeConfig.from_hf(vision_config)`` (rope_type "axial", two sections, interleaved pairs), e.g.
    ``config.cos_sin(llama4_vision_positions(336, 14)[:, None])``.

    Raises:
        ValueError: for sizes that are not positive integers or a patch larger than the image.
    """
    side = check_int("image_size", image_size) // check_int("patch_size", patch_size)
    if side < 1:
        raise ValueError(f"patch_size: expected at most image_size ({image_size}), got {patch_size}")
    patch = torch.arange(side * side)  # (N,) row-major
    xy = torch.stack([patch % side + 1, patch // side + 1])  # (2, N): column, row
    return torch.cat([xy, torch.zeros(2, 1, dtype=torch.int64)], dim=1)  # (2, N + 1), class token last


def xpos_cos_sin(
    config: RopeConfig,
    positions: int | torch.Tensor,
    *,
    scale_base: float = 512.0,
    gamma: float = 0.4,
    center: int = 0,
    dtype: torch.dtype = torch.float32,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """xPos tables: ``((cos_q, sin_q), (cos_k, sin_k))`` to rotate queries and keys with separately.

    The query tables carry zeta^((m - center) / scale_base), the key tables its inverse. ``center`` (e.g. half
    the sequence length) keeps both factors near 1: zeta_0^(L / scale_base) underflows float32 once
    L / scale_base passes ~90, so xPos is a tool for moderate lengths.

    Raises:
        ValueError: for scale_base <= 0 or gamma <= 0.
    """
    check_positive("scale_base", scale_base)
    check_positive("gamma", gamma)
    cos, sin = config.cos_sin(positions, dtype=torch.float64)  # (..., R/2)
    if isinstance(positions, int):
        positions = torch.arange(positions)
    i = torch.arange(config.rotary_dim // 2, dtype=torch.float64, device=cos.device)
    zeta = (2 * i / config.rotary_dim + gamma) / (1 + gamma)  # (R/2,)
    power = (positions.to(cos.device, torch.float64) - center)[..., None] / scale_base  # (..., 1)
    q_scale, k_scale = zeta**power, zeta ** (-power)  # (..., R/2)
    return (
        ((cos * q_scale).to(dtype), (sin * q_scale).to(dtype)),
        ((cos * k_scale).to(dtype), (sin * k_scale).to(dtype)),
    )
