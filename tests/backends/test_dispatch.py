"""backend="auto": never an incorrect or unavailable backend, the fastest usable one, and a logged reason."""

from __future__ import annotations

import logging

import pytest
import torch
from rotary_cases import tables

from ropekit import apply_rotary
from ropekit.backends import AUTO_ORDER, BACKENDS, select_backend


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


@pytest.mark.parametrize("name", ["cpu", "triton"])
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
