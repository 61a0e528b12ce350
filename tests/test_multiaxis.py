"""Axial N-D RoPE, M-RoPE position ids and xPos keep RoPE's relative property on their own terms."""

from __future__ import annotations

import pytest
import torch

from ropekit import RopeConfig, apply_rotary
from ropekit.multiaxis import axial_cos_sin, mrope_positions, xpos_cos_sin


def _dot_at(cos, sin, q, k, m, n):
    """q rotated at table row m, dotted with k rotated at row n."""
    qr = apply_rotary(q, cos, sin, positions=torch.tensor([[m]]))
    kr = apply_rotary(k, cos, sin, positions=torch.tensor([[n]]))
    return (qr * kr).sum()


def test_axial_2d_inner_product_depends_only_on_the_coordinate_offsets():
    h, w = 6, 8
    cos, sin = axial_cos_sin((h, w), 32, dtype=torch.float64)
    assert cos.shape == (h * w, 16)
    q, k = torch.randn(1, 1, 1, 32, dtype=torch.float64), torch.randn(1, 1, 1, 32, dtype=torch.float64)
    cell = lambda r, c: r * w + c  # noqa: E731  (row-major cell index)
    a = _dot_at(cos, sin, q, k, cell(1, 2), cell(3, 5))
    b = _dot_at(cos, sin, q, k, cell(2, 0), cell(4, 3))  # same (dr, dc) = (2, 3)
    c = _dot_at(cos, sin, q, k, cell(2, 0), cell(3, 4))  # a different offset
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(a, c)


def test_axial_pairs_follow_their_own_axis():
    cos, _ = axial_cos_sin((2, 3, 4), 24, base=100.0, axes_pairs=(2, 4, 6), dtype=torch.float64)
    cell = 1 * 12 + 2 * 4 + 3  # (t, h, w) = (1, 2, 3)
    want = torch.cat([1 * RopeConfig(4, 100.0).inv_freq(), 2 * RopeConfig(8, 100.0).inv_freq()])
    want = torch.cat([want, 3 * RopeConfig(12, 100.0).inv_freq()])
    torch.testing.assert_close(cos[cell], torch.cos(want), rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="axes_pairs: expected 3 entries summing to"):
        axial_cos_sin((2, 3, 4), 24, axes_pairs=(2, 2, 2))


def test_mrope_positions_for_text_image_text():
    pos = mrope_positions([3, (1, 4, 4), 2], spatial_merge=2)
    assert pos.shape == (3, 3 + 4 + 2)
    assert pos[:, :3].tolist() == [[0, 1, 2]] * 3
    assert pos[:, 3:7].tolist() == [[3, 3, 3, 3], [3, 3, 4, 4], [3, 4, 3, 4]]
    assert pos[:, 7:].tolist() == [[5, 6]] * 3  # the next text starts one past the largest id


def test_xpos_inner_product_depends_only_on_the_offset_and_decays():
    config = RopeConfig(32, 1e4)
    (cq, sq), (ck, sk) = xpos_cos_sin(config, 256, scale_base=64, center=128, dtype=torch.float64)
    q = torch.ones(1, 1, 1, 32, dtype=torch.float64)

    def dot(m, n):
        qr = apply_rotary(q, cq, sq, positions=torch.tensor([[m]]))
        kr = apply_rotary(q, ck, sk, positions=torch.tensor([[n]]))
        return (qr * kr).sum()

    torch.testing.assert_close(dot(40, 30), dot(200, 190), rtol=1e-12, atol=1e-12)
    plain_cos, plain_sin = config.cos_sin(256, dtype=torch.float64)
    plain = _dot_at(plain_cos, plain_sin, q, q, 40, 30)
    assert abs(dot(40, 30)) != pytest.approx(abs(plain))  # the zeta^(10/64) factors are applied
    with pytest.raises(ValueError, match="scale_base: expected a finite number > 0"):
        xpos_cos_sin(config, 4, scale_base=0)


def test_rotary_embedding_takes_mrope_positions_in_every_layout():
    from ropekit import RotaryEmbedding

    config = RopeConfig.preset("qwen2-vl-7b")
    pos = mrope_positions([3, (1, 4, 4), 2], spatial_merge=2)  # (3, T)
    t = pos.shape[1]
    q, k = torch.randn(1, t, 4, 128), torch.randn(1, t, 2, 128)  # (B, S, H, D)
    bshd = RotaryEmbedding(config)(q, k, positions=pos[:, None])
    thd = RotaryEmbedding(config, layout="thd")(q[0], k[0], positions=pos, cu_seqlens=torch.tensor([0, t]))
    bhsd = RotaryEmbedding(config, layout="bhsd")(
        q.transpose(1, 2), k.transpose(1, 2), positions=pos[:, None]
    )
    cos, sin = config.cos_sin(pos[:, None])  # (1, T, 64)
    want = apply_rotary(q, cos[0], sin[0])
    torch.testing.assert_close(bshd[0], want)
    torch.testing.assert_close(thd[0], want[0])
    torch.testing.assert_close(bhsd[0].transpose(1, 2), want)
