"""The numerics contract's Triton paths (tests/test_numerics.py), on CPU tensors through Triton's interpreter.

Run only by test_numerics.py, in a process started with TRITON_INTERPRET=1 (Triton reads it when its kernels
are imported). Path a is a Triton path, path b any other path (Triton, torch or the C loop). The interpreter
is slow: the fast tier draws FAST_EXAMPLES, the full one (make proofs) PROOF_EXAMPLES.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from c_compiler import find_compiler
from ropekit.backends.triton.rotary import interpreter_enabled
from test_numerics import _SETTINGS, check_two_paths
from triton_interpreter import TIER_ENV

pytestmark = pytest.mark.skipif(
    not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (test_numerics.py)"
)

FAST_EXAMPLES, PROOF_EXAMPLES = 4, 300  # 4: about 3 CPU-s past the process start
EXAMPLES = FAST_EXAMPLES if os.environ.get(TIER_ENV) == "fast" else PROOF_EXAMPLES
# The C loop joins where a compiler is found (ROPEKIT_REQUIRE_C_COMPILER=1 makes its absence an error there).
OTHER = ("triton", "torch", "cpu") if find_compiler() is not None else ("triton", "torch")


@settings(max_examples=EXAMPLES, **_SETTINGS)
@given(data=st.data())
def test_a_triton_path_rotates_the_same_tokens_to_the_same_bits(data):
    check_two_paths(data, ("triton",), OTHER)
