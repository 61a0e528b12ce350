"""Old import paths of modules that moved, kept working for one release with a DeprecationWarning.

0.2 split the package into the library core and a tools wing (ARCHITECTURE.md). ``import ropekit.models``
still works: this finder answers for the old name with the module at its new home, so both names are the
same module object (isinstance checks and monkeypatching agree).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

__all__ = ["MOVED", "install"]

# old module path -> new module path (submodules follow their package).
MOVED = {
    "ropekit.models": "ropekit.nn",
    "ropekit.distributed": "ropekit.integrations.distributed",
    "ropekit.verify": "ropekit.tools.verify",
    "ropekit.inspect": "ropekit.tools.inspect",
    "ropekit.bench": "ropekit.tools.bench",
    "ropekit.demo": "ropekit.tools.demo",
}


def new_name(fullname: str) -> str | None:
    """The new home of an old module path, or None if the path never moved."""
    for old, new in MOVED.items():
        if fullname == old or fullname.startswith(old + "."):
            return new + fullname[len(old) :]
    return None


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        target_name = new_name(fullname)
        if target_name is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, origin=target_name)

    def create_module(self, spec):
        warnings.warn(
            f"{spec.name} moved to {spec.origin}; the old path will be removed in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(spec.origin)

    def exec_module(self, module) -> None:
        pass  # the module at its new home is already executed


_FINDER = _MovedFinder()


def install() -> None:
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)  # before PathFinder, which would load a second copy of a submodule
