"""run_checks: every claim of the seeds passes for valid configurations, and a broken implementation fails."""

from __future__ import annotations

import pytest
import torch

import ropekit.tools.verify
from ropekit import RopeConfig
from ropekit.tools.verify import Check, run_checks

CLAIMS = [
    "R^T R = I",
    "det R = 1",
    "R_m^T R_n = R_(n-m)",
    "(R_m q).(R_n k) depends only on n - m",
    "norms preserved",
    "matrix form = complex form",
    "half form = interleaved form, permuted",
    "apply_rotary (half) = reference",
    "apply_rotary (interleaved) = reference",
    "apply_rotary backward = inverse rotation",
    "textbook: theta=30deg, m=1, n=3 gives 0.5",
    "textbook: theta=45deg, m=0, n=2 gives 0",
    "textbook: sinusoidal d=4 at 1, 2 (to printed digits)",
]


@pytest.mark.parametrize(
    "config",
    [
        RopeConfig(16),
        RopeConfig(12, 500000.0, rotary_dim=8, interleaved=True),
        RopeConfig(5, 1e6, rotary_dim=2),
    ],
    ids=repr,
)
def test_every_check_passes_for_valid_configs(config):
    checks = run_checks(config)
    names = [c.name for c in checks]
    assert set(CLAIMS) <= set(names) and len(names) == len(set(names))
    failed = [c for c in checks if not c.passed]
    assert not failed, failed


def test_checks_ignore_scaling_because_the_claims_are_about_plain_rope():
    scaled = RopeConfig(16, scaling={"rope_type": "linear", "factor": 4.0})
    assert all(c.passed for c in run_checks(scaled))


def test_a_wrong_pair_layout_in_apply_rotary_is_caught(monkeypatch):
    real = ropekit.tools.verify.apply_rotary

    def swapped(x, cos, sin, *, interleaved=False, **kw):
        return real(x, cos, sin, interleaved=not interleaved, **kw)

    monkeypatch.setattr(ropekit.tools.verify, "apply_rotary", swapped)
    failed = {c.name for c in run_checks(RopeConfig(8)) if not c.passed}
    assert {"apply_rotary (half) = reference", "apply_rotary (interleaved) = reference"} <= failed


def test_a_backward_that_is_not_the_inverse_rotation_is_caught(monkeypatch):
    real = ropekit.tools.verify.apply_rotary

    class ForwardRuleBackward(torch.autograd.Function):  # wrong: rotates gradients by +theta
        @staticmethod
        def forward(ctx, x, cos, sin, kw):
            ctx.args = (cos, sin, kw)
            return real(x, cos, sin, **kw)

        @staticmethod
        def backward(ctx, g):
            cos, sin, kw = ctx.args
            return real(g, cos, sin, **kw), None, None, None

    monkeypatch.setattr(
        ropekit.tools.verify, "apply_rotary", lambda x, c, s, **kw: ForwardRuleBackward.apply(x, c, s, kw)
    )
    failed = {c.name for c in run_checks(RopeConfig(8)) if not c.passed}
    assert failed == {"apply_rotary backward = inverse rotation"}


def test_check_reports_pass_against_its_tolerance():
    assert Check("a", 1e-12, 1e-9).passed and not Check("b", 1e-3, 1e-9).passed
    assert Check("a", 0.5, 1.0).as_dict() == {"name": "a", "max_error": 0.5, "tolerance": 1.0, "passed": True}
