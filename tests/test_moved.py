"""Modules that moved in the core/tools split still import from their old path, with a DeprecationWarning."""

import importlib
import sys
import warnings

import pytest

from ropekit._moved import MOVED, new_name


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_imports_the_moved_module_with_a_deprecation_warning(old):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=MOVED[old].replace(".", r"\.")):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])


def test_old_submodule_path_is_the_same_module_object():
    sys.modules.pop("ropekit.models.attention", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from ropekit.models.attention import Attention as Old
    from ropekit.nn.attention import Attention

    assert Old is Attention


def test_paths_that_never_moved_are_not_redirected():
    assert new_name("ropekit.module") is None
    assert new_name("ropekit.modelsx") is None
    assert new_name("ropekit.models.kv_cache") == "ropekit.nn.kv_cache"
