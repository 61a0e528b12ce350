"""The fused serving kernels at their wall (ropekit.backends.fused_launch / fused_cpu / fused_eager): FP8
stores against torch's own cast, and value checks that refuse before writing."""

from __future__ import annotations

import pytest
import torch

from c_compiler import CPU
from ropekit.backends.c import fused as fused_cpu
from ropekit.backends.eager import fused as fused_eager
from ropekit.backends.fused_launch import FP8_KINDS, Channel, FusedLaunch, check_launch

LAUNCHERS = {"cpu": fused_cpu.launch, "torch": fused_eager.launch}


def _copy_launch(x: torch.Tensor, dst: torch.Tensor, kind: int, slots=None) -> FusedLaunch:
    """A launch that only scales (by 1) and stores x (1, n, 1, 1) into dst: the FP8 store on its own."""
    n = x.shape[1]
    table = torch.zeros(1, 1).expand(n, 1)  # one (unused) table row per token
    by_slot = slots is not None
    channel = Channel(x, dst, rotate=False, by_slot=by_slot, fp8=kind, scale=torch.ones(1) if kind else None)
    return FusedLaunch(1, n, table, table, None, 0, slots, False, False, (None, None, channel))


@pytest.mark.parametrize("launcher", [CPU, "torch"])
@pytest.mark.parametrize("fp8_dtype", list(FP8_KINDS))
def test_fp8_store_equals_torchs_clamped_cast_over_every_magnitude(launcher, fp8_dtype):
    """Subnormals to overflow, both signs, zeros, infinities and NaN: the contract's bytes exactly."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, generator=g) * torch.exp2(torch.randint(-30, 20, (20000,), generator=g).float())
    special = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 448, 464, 480, 57344, 61440, 2.0**-10]
    x = torch.cat([x, torch.tensor(special)]).reshape(1, -1, 1, 1)  # (1, n, 1, 1)
    dst = torch.empty(x.shape, dtype=torch.uint8)
    LAUNCHERS[launcher](_copy_launch(x, dst, FP8_KINDS[fp8_dtype]))
    fmax = torch.finfo(fp8_dtype).max
    assert torch.equal(dst, x.clamp(-fmax, fmax).to(fp8_dtype).view(torch.uint8))


@pytest.mark.parametrize("launcher", [CPU, "torch"])
def test_a_slot_past_the_cache_is_refused_before_any_write(launcher):
    x = torch.arange(4.0).reshape(1, 4, 1, 1)
    dst = torch.zeros(2, 2, 1, 1)  # 4 slots
    slots = torch.tensor([0, 1, 2, 4])  # the last is past the end
    with pytest.raises(ValueError, match=r"slot_mapping: slot 4 .*\(4 slots\)"):
        LAUNCHERS[launcher](_copy_launch(x, dst, 0, slots))
    assert not dst.any()


def test_the_wall_refuses_a_destination_of_the_wrong_dtype_or_a_missing_scale():
    x = torch.zeros(1, 3, 1, 2)
    with pytest.raises(ValueError, match="v destination"):
        check_launch(_copy_launch(x, torch.zeros(1, 3, 1, 2, dtype=torch.float16), 0))
    launch = _copy_launch(x, torch.zeros(1, 3, 1, 2, dtype=torch.uint8), 1)
    bad = launch._replace(channels=(None, None, launch.channels[2]._replace(scale=None)))
    with pytest.raises(ValueError, match="v scale"):
        check_launch(bad)
    with pytest.raises(ValueError, match="slot_mapping"):
        check_launch(
            _copy_launch(x, torch.zeros(3, 1, 1, 2), 0, slots=None)._replace(
                channels=(None, None, Channel(x, torch.zeros(3, 1, 1, 2), rotate=False, by_slot=True))
            )
        )
