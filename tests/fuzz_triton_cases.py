"""The serving fuzz families (tests/serving_fuzz.py) with the Triton backend, under its interpreter.

Run only by tests/test_fuzz.py's proof, in a subprocess with TRITON_INTERPRET=1 and
ROPEKIT_FUZZ_BACKENDS=triton (see tests/triton_interpreter.py). The interpreter is slow: a few draws per
family (ROPEKIT_FUZZ_TRITON_EXAMPLES, default 15).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ropekit.backends.triton.rotary import interpreter_enabled
from serving_fuzz import FAMILIES, fused_calls, run_call, shift_calls

pytestmark = pytest.mark.skipif(
    not interpreter_enabled() or os.environ.get("ROPEKIT_FUZZ_BACKENDS") != "triton",
    reason="needs TRITON_INTERPRET=1 and ROPEKIT_FUZZ_BACKENDS=triton (tests/test_fuzz.py)",
)
EXAMPLES = int(os.environ.get("ROPEKIT_FUZZ_TRITON_EXAMPLES", "15"))
_SETTINGS = dict(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TRITON_FAMILIES = {
    **FAMILIES,
    "fused_alias": fused_calls(alias=True),
    "shift_duplicates": shift_calls(duplicates=True),
}


# Under the interpreter these families found issue 24's defects 2 and 3 in the Triton path too (now refused).
@pytest.mark.parametrize("family", sorted(TRITON_FAMILIES))
@settings(**_SETTINGS)
@given(data=st.data())
def test_triton_serving_call_is_right_or_a_value_error_and_writes_only_its_outputs(family, data):
    run_call(data.draw(TRITON_FAMILIES[family], label=family))
