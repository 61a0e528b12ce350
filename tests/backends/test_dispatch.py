"""backend="auto": never an incorrect or unavailable backend, the fastest usable one, and a logged reason."""

from __future__ import annotations

import logging

import pytest
import torch

import ropekit
from c_compiler import CPU
from ropekit import apply_rotary
from ropekit.backends import AUTO_ORDER, BACKENDS, clear_backend_cache, register_backend, select_backend
from rotary_cases import tables


def test_auto_order_is_triton_then_cpu_then_torch():
    assert AUTO_ORDER == ["triton", "cpu", "torch"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("interpret", ["0", "1"])
def test_auto_picks_a_backend_that_can_serve_the_inputs(dtype, interpret, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    x, (cos, _) = torch.zeros(1, 2, 1, 4, dtype=dtype), tables(4)
    chosen = select_backend("auto", x, cos)
    assert chosen.unavailable_reason(x, cos) is None
    assert chosen.name != "triton"  # CPU tensors: never the GPU kernel, never the slow interpreter
    if dtype == torch.float64:
        assert chosen.name == "torch"  # float64 math is only on the torch backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("interleaved", [False, True])
def test_auto_gives_the_torch_backend_result(dtype, interleaved):
    cos, sin = tables(6)
    x = torch.randn(2, 3, 2, 8).to(dtype)
    pos = torch.tensor([[0, 9, 4], [63, 1, 2]])
    got = apply_rotary(x, cos, sin, positions=pos, interleaved=interleaved)
    want = apply_rotary(x, cos, sin, positions=pos, interleaved=interleaved, backend="torch")
    tol = {torch.float64: 1e-12, torch.float32: 1e-6}.get(dtype, 1e-2)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_auto_logs_why_each_skipped_backend_was_skipped(caplog):
    x, (cos, _) = torch.zeros(1, 2, 1, 4, dtype=torch.float64), tables(4)
    with caplog.at_level(logging.DEBUG, logger="ropekit.backends"):
        assert select_backend("auto", x, cos).name == "torch"
    assert "'triton' skipped" in caplog.text
    assert "'cpu' skipped: dtype torch.float64" in caplog.text


@pytest.mark.parametrize("name", [CPU, "triton"])
def test_naming_a_backend_that_cannot_serve_is_a_value_error_with_the_reason(name):
    cos, sin = tables(4)
    x = torch.zeros(1, 2, 1, 4, dtype=torch.float64)
    reason = BACKENDS[name].unavailable_reason(x, cos)
    assert reason
    with pytest.raises(ValueError, match=f"backend: '{name}' cannot serve these inputs"):
        apply_rotary(x, cos, sin, backend=name)


def test_unknown_backend_name_lists_the_choices():
    cos, sin = tables(4)
    with pytest.raises(ValueError, match=r"backend: expected 'auto' or one of \['cpu', 'torch', 'triton'\]"):
        apply_rotary(torch.zeros(1, 2, 1, 4), cos, sin, backend="cuda")


class RotationOnly:
    """A registered third-party backend: it rotates (the torch backend's math) and has no fused kernels."""

    name = "mine"

    def unavailable_reason(self, q, cos):
        return None

    def rotate_qk(self, *args, **kwargs):
        return BACKENDS["torch"].rotate_qk(*args, **kwargs)


@pytest.fixture
def rotation_only(monkeypatch):
    monkeypatch.setattr("ropekit.backends.BACKENDS", dict(BACKENDS))
    monkeypatch.setattr("ropekit.backends.AUTO_ORDER", list(AUTO_ORDER))
    register_backend(RotationOnly(), auto_priority=0)
    yield
    clear_backend_cache()


@pytest.mark.parametrize("op", ["fused", "qk_norm"])
def test_a_registered_backend_without_fused_kernels_is_refused_by_name_and_skipped_by_auto(op, rotation_only):
    x, (cos, _) = torch.zeros(1, 1, 1, 2), tables(2)
    assert select_backend("mine", x, cos).name == "mine"  # it rotates
    with pytest.raises(ValueError, match="backend: 'mine' has no fused serving kernel"):
        select_backend("mine", x, cos, op=op)
    assert select_backend("auto", x, cos).name == "mine"
    assert select_backend("auto", x, cos, op=op).name == "torch"


def test_a_fused_op_under_auto_runs_on_torch_when_auto_picks_a_backend_without_fused_kernels(rotation_only):
    cos, sin = ropekit.RopeConfig(head_dim=8).cos_sin(16)
    q, k = torch.randn(2, 3, 2, 8), torch.randn(2, 3, 1, 8)
    got = ropekit.apply_rotary_qk_fp8(q, k, cos, sin, q_scale=1.0, k_scale=1.0)
    want = ropekit.apply_rotary_qk_fp8(q, k, cos, sin, q_scale=1.0, k_scale=1.0, backend="torch")
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want, strict=True))
    with pytest.raises(ValueError, match="backend: 'mine' has no fused serving kernel"):
        ropekit.apply_rotary_qk_fp8(q, k, cos, sin, q_scale=1.0, k_scale=1.0, backend="mine")


@pytest.mark.c_compiler
def test_a_kernel_backend_names_why_it_cannot_serve_a_fused_op():
    x, (cos, _) = torch.zeros(1, 1, 1, 2), tables(2)
    with pytest.raises(
        ValueError, match="backend: 'cpu' serves heads of up to 16384 features, got a head of"
    ):
        select_backend("cpu", x, cos, op="fused", widest=16385)
    assert select_backend("auto", x, cos, op="fused", widest=16385).name == "torch"
    with pytest.raises(ValueError, match="backend: expected a string, got 3"):
        select_backend(3, x, cos, op="fused")


@pytest.mark.parametrize("numerics", ["hf", "vllm"])
def test_a_backend_listing_no_numerics_is_exact_only_skipped_by_auto_and_refused_by_name(
    numerics, rotation_only
):
    x, (cos, sin) = torch.zeros(1, 1, 1, 2), tables(2)
    assert select_backend("auto", x, cos).name == "mine"
    assert select_backend("auto", x, cos, numerics=numerics).name in ("cpu", "torch")
    refusal = rf"backend: 'mine' cannot serve numerics='{numerics}': .*\['exact'\] only"
    with pytest.raises(ValueError, match=refusal):
        apply_rotary(x, cos, sin, backend="mine", numerics=numerics)
    assert "triton" not in [n for n, b in BACKENDS.items() if numerics in getattr(b, "numerics", ())]
