"""docs/numerics.md's contract as a property: any two paths rotate the same tokens to the same bits.

Hypothesis draws a case (a config: head_dim, partial rotary_dim, first / last, interleaved, a scaling type;
a dtype; a batch composition: sequences' lengths and first positions, padding, other sequences' lengths) and
two paths from tests/numerics_paths.py's registry (backends, entry points, layouts, batch forms, in place,
traced, compiled, fused, the peers' call conventions), then asserts ``torch.equal`` on the rotated features.

The contract spans the package (every backend and entry point), so it lives at the top of tests/, as
test_fuzz.py does, not under one module's mirror.

Tiers: ``make test`` runs FAST_EXAMPLES draws per backend, a few compiled ones, and the Triton paths under
the interpreter at a small budget; ``make proofs`` runs the ``proof`` versions at PROOF_EXAMPLES. Draws are
derandomized (no example database), so a run is reproducible and a mutation (tests/mutations.py: an FMA in
the C loop, a bfloat16 multiply in the torch backend, another table cast in compat.vllm) fails the same draw
every time.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from c_compiler import CPU
from numerics_paths import cases, draw_paths, observe
from ropekit import RopeConfig, RotaryEmbedding, apply_rotary_qk
from triton_interpreter import TIERS, run_interpreter_cases

FAST_EXAMPLES = 300  # per backend: 3-7 s of CPU (2-core AMD EPYC VM)
PROOF_EXAMPLES = 3000
FAST_COMPILED, PROOF_COMPILED = 1, 40  # each a fresh torch.compile: about 1-6 s of CPU

_SETTINGS = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
_PLAIN = ("torch", "cpu")


def check_two_paths(data, first: tuple[str, ...], other: tuple[str, ...], *, compiles: bool = False) -> None:
    case = data.draw(cases(), label="case")
    a, b = draw_paths(data, case, first, other, compiles=compiles)
    got, want = observe(a, b, case)
    for name, x, y in zip("qk", got, want, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype, (name, x.shape, y.shape, x.dtype, y.dtype)
        if not torch.equal(x, y):
            where = (x != y).nonzero()[:4].tolist()
            raise AssertionError(f"{a.name} and {b.name} differ in {name} at {where}: {case!r}")


def _other(backend: str) -> tuple[str, ...]:
    return ("torch",) if backend == "torch" else _PLAIN


@pytest.mark.parametrize("backend", ["torch", CPU])
@settings(max_examples=FAST_EXAMPLES, **_SETTINGS)
@given(data=st.data())
def test_any_two_paths_rotate_the_same_tokens_to_the_same_bits(backend, data):
    """Path a on ``backend``; path b on torch or (for cpu) either."""
    check_two_paths(data, (backend,), _other(backend))


@pytest.mark.parametrize("backend", ["torch", CPU])
@settings(max_examples=FAST_COMPILED, **_SETTINGS)
@given(data=st.data())
def test_a_compiled_call_rotates_to_the_eager_bits(backend, data):
    """torch.compile(fullgraph=True) of the packed call against any eager path."""
    check_two_paths(data, (backend,), _other(backend), compiles=True)


@pytest.mark.parametrize("tier", TIERS)
def test_triton_paths_rotate_to_the_same_bits_under_the_interpreter(tier):
    """tests/numerics_triton_cases.py with TRITON_INTERPRET=1: a Triton path against any path."""
    here = Path(__file__).parent
    run_interpreter_cases(here / "numerics_triton_cases.py", cwd=here, timeout=600, tier=tier)


@pytest.mark.proof
@pytest.mark.parametrize("backend", ["torch", CPU])
@settings(max_examples=PROOF_EXAMPLES, **_SETTINGS)
@given(data=st.data())
def test_proof_any_two_paths_rotate_the_same_tokens_to_the_same_bits(backend, data):
    check_two_paths(data, (backend,), _other(backend))


@pytest.mark.proof
@pytest.mark.parametrize("backend", ["torch", CPU])
@settings(max_examples=PROOF_COMPILED, **_SETTINGS)
@given(data=st.data())
def test_proof_a_compiled_call_rotates_to_the_eager_bits(backend, data):
    check_two_paths(data, (backend,), _other(backend), compiles=True)


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "dynamic", "factor": 4.0},
        {
            "rope_type": "longrope",
            "short_factor": [1.0] * 4,
            "long_factor": [2.0, 3.0, 4.0, 5.0],
            "original_max_position_embeddings": 16,
        },
    ],
    ids=["dynamic", "longrope"],
)
def test_an_unfrozen_module_rotates_as_the_table_for_its_calls_largest_position(scaling):
    """docs/numerics.md, batch-dependent types: unfrozen, RotaryEmbedding reads seq_len = the call's largest
    position + 1 (padding counts), and returns the functional API's bits on a table built for that seq_len."""
    config = RopeConfig(8, scaling=scaling, max_position_embeddings=32)
    for seq, first in ((4, 0), (10, 30), (3, 60)):  # below, across and past both schedules' switches
        rope = RotaryEmbedding(config, layout="bshd")  # fresh: dynamic NTK keeps the longest call it saw
        q, k = torch.randn(2, seq, 2, 8).bfloat16(), torch.randn(2, seq, 1, 8).bfloat16()
        offsets = torch.tensor([first, first // 2])
        cos, sin = config.cos_sin(first + seq, seq_len=first + seq)
        want = apply_rotary_qk(q, k, cos, sin, offsets=offsets)
        assert all(torch.equal(a, b) for a, b in zip(rope(q, k, offsets=offsets), want, strict=True))
