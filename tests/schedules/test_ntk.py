"""Static NTK-aware scaling: the fastest pair is kept and the slowest is divided by exactly `factor`."""

from __future__ import annotations

import pytest
import torch

from ropekit import RopeConfig
from ropekit.reference import inv_freq


@pytest.mark.parametrize(("dim", "base", "factor"), [(64, 1e4, 4.0), (128, 5e5, 8.0), (16, 1e3, 2.5)])
def test_ntk_keeps_the_fastest_pair_and_interpolates_the_slowest(dim, base, factor):
    got = RopeConfig(dim, base, scaling={"rope_type": "ntk", "factor": factor}).inv_freq()
    plain = torch.from_numpy(inv_freq(dim, base))
    assert got[0] == plain[0] == 1.0
    torch.testing.assert_close(got[-1], plain[-1] / factor, rtol=1e-12, atol=0)
    torch.testing.assert_close(got, torch.from_numpy(inv_freq(dim, base * factor ** (dim / (dim - 2)))))
