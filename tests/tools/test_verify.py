"""run_checks: every property docs/math.md derives passes for valid configurations; a broken one fails."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ropekit.backends.eager.rotary
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


@pytest.mark.c_compiler
def test_production_backends_are_checked_in_float32_and_bfloat16_as_named_rows():
    checks = {c.name: c for c in run_checks(RopeConfig(16, rotary_dim=12), backends=["cpu", "torch"])}
    for backend in ("cpu", "torch"):
        for dtype in ("float32", "bfloat16"):
            for layout in ("half", "interleaved"):
                check = checks[f"backend {backend} {dtype} ({layout}) = float64 reference (error / bound)"]
                assert check.passed, check


def test_backend_error_bound_is_half_an_ulp_of_each_element_plus_float32_arithmetic():
    from ropekit.tools.verify import backend_error_bound

    arithmetic = 8 * torch.finfo(torch.float32).eps * 2.0
    got = backend_error_bound(np.array([1.0, -3.0, 0.25]), torch.bfloat16, scale=2.0)
    np.testing.assert_allclose(got, np.array([2.0**-8, 2.0**-7, 2.0**-10]) + arithmetic, rtol=1e-12)


def test_default_backends_are_those_the_dispatch_accepts_here():
    from ropekit.tools.verify import available_backends

    names = available_backends()
    assert "torch" in names and "triton" not in names  # no GPU, no interpreter: triton is not available
    rows = [c.name for c in run_checks(RopeConfig(8)) if c.name.startswith("backend ")]
    assert {row.split()[1] for row in rows} == set(names)


class _TruncatingBackend:
    """Right math, but stores bfloat16 by truncating the float32 result instead of rounding to nearest."""

    name = "truncating"

    def unavailable_reason(self, q, cos):
        return None

    def rotate_qk(self, q, k, cos, sin, positions, **kw):
        from ropekit.backends.eager.backend import EagerBackend

        exact, _ = EagerBackend().rotate_qk(q.float(), None, cos, sin, positions, **kw)
        if q.dtype == torch.bfloat16:
            exact = (exact.view(torch.int32) & ~0xFFFF).view(torch.float32)  # drop the low 16 bits
        return exact.to(q.dtype), None


def test_a_backend_that_truncates_bfloat16_stores_fails_only_its_bfloat16_rows(monkeypatch):
    from ropekit.backends import BACKENDS

    monkeypatch.setitem(BACKENDS, "truncating", _TruncatingBackend())
    checks = [c for c in run_checks(RopeConfig(64), backends=["truncating"]) if "truncating" in c.name]
    failed = {c.name for c in checks if not c.passed}
    assert failed == {
        "backend truncating bfloat16 (half) = float64 reference (error / bound)",
        "backend truncating bfloat16 (interleaved) = float64 reference (error / bound)",
    }


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"config": RopeConfig(100000)}, r"head_dim: expected at most 1024 for verify .* got 100000"),
        ({"config": RopeConfig(8), "backends": ["nope"]}, "backend: expected 'auto' or one of"),
    ],
)
def test_bad_arguments_are_value_errors(kwargs, match):
    config = kwargs.pop("config")
    with pytest.raises(ValueError, match=match):
        run_checks(config, **kwargs)


@pytest.mark.parametrize("numerics", ["hf", "vllm"])
def test_numerics_rows_hold_each_backend_to_the_peers_bits_in_three_dtypes(numerics):
    checks = run_checks(RopeConfig(32, rotary_dim=24), backends=["torch"], numerics=numerics)
    rows = [c for c in checks if f"numerics={numerics}" in c.name]
    assert len(rows) == 6 and all(c.passed and c.tolerance == 0.0 for c in rows), rows
    assert not any("= float64 reference" in c.name and c.name.startswith("backend ") for c in checks)


def test_a_backend_that_rounds_once_fails_the_hf_rows_of_16_bit_dtypes_only(monkeypatch):
    rotate = ropekit.backends.eager.rotary.rotate

    def rounds_once(*args, numerics="exact", **kwargs):
        return rotate(*args, **kwargs)  # ignores numerics: "exact" arithmetic

    monkeypatch.setattr(ropekit.backends.eager.rotary, "rotate", rounds_once)
    checks = run_checks(RopeConfig(32), backends=["torch"], numerics="hf")
    failed = {c.name for c in checks if not c.passed}
    assert failed and all("bfloat16" in n or "float16" in n for n in failed), failed
    assert not any("float32" in n for n in failed)


def test_the_default_backends_for_a_numerics_mode_are_those_that_serve_it():
    checks = run_checks(RopeConfig(16), numerics="vllm")
    names = {c.name.split()[1] for c in checks if "numerics=vllm" in c.name}
    assert names and "triton" not in names and names <= {"torch", "cpu"}
