"""Running every compat call on a chosen backend, and the tolerances the peers' own tests use.

The compat functions keep their peers' signatures, which have no ``backend`` argument, so the ``backend``
fixture makes ``backend="auto"`` resolve to the backend under test for the duration of one test, and counts
the calls it served, so a test can prove the backend it names really ran.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ropekit.backends.plan
import ropekit.functional
from c_compiler import CPU
from ropekit.backends import BACKENDS

BACKEND_NAMES = ["torch", CPU]


class ForcedBackend:
    """The backend every ``backend="auto"`` call uses in this test, and how many calls it served."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = 0


def force_backend(monkeypatch, name: str) -> ForcedBackend:
    """Make ``backend="auto"`` resolve to ``name`` until the test ends (float64 input stays on torch)."""
    forced = ForcedBackend(name)
    impl = BACKENDS[name]  # "cpu": the test is marked c_compiler (skipped where no C compiler is found)
    original = ropekit.functional.select_backend

    def select(requested, q, cos, **needs):
        if requested != "auto":
            return original(requested, q, cos, **needs)
        if q.dtype == torch.float64 and name == "cpu":
            return original("torch", q, cos, **needs)  # the C loop serves 16/32-bit storage only
        forced.calls += 1
        return impl

    monkeypatch.setattr(ropekit.functional, "select_backend", select)
    monkeypatch.setattr(ropekit.backends.plan, "_plans", {})  # launch plans would skip select_backend
    return forced


@pytest.fixture(params=BACKEND_NAMES)
def backend(request, monkeypatch) -> ForcedBackend:
    """Each test that takes this fixture runs once per backend in BACKEND_NAMES (the C case marked
    c_compiler)."""
    return force_backend(monkeypatch, request.param)


def arithmetic_atol(reference: torch.Tensor) -> float:
    """flash-attn's tolerance: twice the error of one round trip ``x + 0.3 - 0.3`` in the output dtype."""
    return 2 * ((reference + 0.3 - 0.3) - reference).abs().max().item()


def as_table(cos: torch.Tensor, sin: torch.Tensor, tokens: tuple[int, ...]):
    """Per-token rows (..., R/2) shaped like ``tokens`` (or broadcast over its batch axis) as a (rows, R/2)
    table plus the int positions that read it, for the ``assert_matches_reference`` fixture."""
    cos = cos.expand(*tokens, cos.shape[-1]).reshape(-1, cos.shape[-1])
    sin = sin.expand(*tokens, sin.shape[-1]).reshape(-1, sin.shape[-1])
    return cos, sin, np.arange(cos.shape[0]).reshape(tokens)


def llama_tables(head_dim, bsz, seq_len, expand, dtype, rope_parameters=None):
    """cos, sin as transformers' ``LlamaRotaryEmbedding`` returns them: (1, S, D), or (B, S, D) when the
    position ids are expanded over the batch; full width (duplicated halves), in ``dtype``."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(
        head_dim=head_dim, hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=4
    )
    if rope_parameters is not None:
        config.rope_parameters = rope_parameters
    pos = torch.arange(seq_len).unsqueeze(0)  # (1, S) position ids
    if expand:
        pos = pos.expand(bsz, -1)  # (B, S)
    return LlamaRotaryEmbedding(config)(torch.empty(0, dtype=dtype), pos)


def signature_of(func) -> list[tuple[str, object]]:
    """(name, default) for each parameter, the form the peers' signatures are written in below."""
    import inspect

    return [(p.name, p.default) for p in inspect.signature(func).parameters.values() if p.name != "self"]


NO_DEFAULT = __import__("inspect").Parameter.empty


def spy_cpu_kernel(monkeypatch) -> dict[str, int]:
    """Record the data pointers the C loop is called with (q, k, cos, sin): what it reads, where it lies."""
    import ropekit.backends.c.rotary as cpu

    seen: dict[str, int] = {}

    def spy(entry):
        def call(*args):
            seen.update(q=args[0], q_out=args[1], k=args[2], cos=args[4], sin=args[5])
            return entry(*args)

        return call

    functions = cpu._LIBRARY.require()
    monkeypatch.setattr(cpu._LIBRARY, "functions", {dtype: spy(entry) for dtype, entry in functions.items()})
    return seen
