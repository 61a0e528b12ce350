"""tests/engines/ runs in the engines environment only (``make proofs``: ``ROPEKIT_ENGINES=1``, .venv-engines;
tests/conftest.py leaves the folder out everywhere else). There a missing engine is an error, never a skip:
a proof that silently ran nothing would pass."""

import importlib.util

import pytest

# The engines the files here import at module level (requirements/engines*.txt installs them).
ENGINES = ("vllm", "torchtitan")

missing = [engine for engine in ENGINES if importlib.util.find_spec(engine) is None]
if missing:
    raise pytest.UsageError(f"tests/engines/ needs {missing} installed: run it through `make proofs`")
