"""The C loop in tests: one marker for every test that needs it, and the backend name for parametrized lists.

A test that runs the C loop (``backend="cpu"``, a C build, ``CLibrary``) carries
``@pytest.mark.c_compiler``; in a parametrized backend list only the C case does: ``["torch", CPU]``. Where
no C compiler is found (``$CC``, else ``cc``, as the library looks for it), tests/conftest.py skips them
with :data:`NO_C_COMPILER` and reports how many; with ``ROPEKIT_REQUIRE_C_COMPILER=1`` (CI) a missing
compiler is an error instead, so the C tests cannot quietly stop running there.
"""

from __future__ import annotations

import pytest

from ropekit.backends.c.build import find_compiler

__all__ = ["CPU", "NO_C_COMPILER", "find_compiler"]

NO_C_COMPILER = "no C compiler (set CC)"
CPU = pytest.param("cpu", marks=pytest.mark.c_compiler)
