"""The package: version, typing marker, console script, a wheel that builds, and the public API of issue 2."""

from __future__ import annotations

import importlib.metadata
import inspect
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib
import torch

import ropekit
from ropekit import RopeConfig, RotaryEmbedding

ROOT = Path(__file__).resolve().parents[1]
EMPTY = inspect.Parameter.empty
POS, KW = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY


def test_version_is_one_string_everywhere():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert ropekit.__version__ == pyproject["project"]["version"] == importlib.metadata.version("ropekit")


def test_package_is_marked_typed_and_licensed():
    assert (Path(ropekit.__file__).parent / "py.typed").is_file()
    assert (ROOT / "LICENSE").is_file()


def test_console_script_points_at_the_cli():
    scripts = importlib.metadata.entry_points(group="console_scripts")
    assert [ep.value for ep in scripts if ep.name == "ropekit"] == ["ropekit.cli:main"]


def test_runtime_dependencies_are_torch_and_numpy_only():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    names = {
        dep.split(">")[0].split("=")[0].split("<")[0].strip() for dep in pyproject["project"]["dependencies"]
    }
    assert names == {"torch", "numpy"}


@pytest.mark.slow
def test_wheel_builds_with_sources_and_typing_marker(tmp_path):
    """Build from a copy of the sources so the working tree gets no build/ or egg-info litter."""
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(
        ROOT / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", "dist", "."],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = (tmp_path / "dist").glob("ropekit-*.whl")
    assert wheel.name.startswith(f"ropekit-{ropekit.__version__}-py3-none-any")
    names = zipfile.ZipFile(wheel).namelist()
    for required in (
        "ropekit/__init__.py",
        "ropekit/py.typed",
        "ropekit/reference.py",
        "ropekit/cli/verify.py",
    ):
        assert required in names
    assert any(n.endswith("licenses/LICENSE") or n.endswith("/LICENSE") for n in names)


def _assert_parameters(func, expected):
    """The issue's parameters, in order, with their kinds and defaults. Later issues may only append
    keyword-only parameters with defaults, so every call written against issue 2 keeps working."""
    params = list(inspect.signature(func).parameters.values())
    got = [(p.name, p.kind, p.default) for p in params[: len(expected)]]
    assert got == expected, f"{func.__qualname__}{inspect.signature(func)}"
    for extra in params[len(expected) :]:
        assert extra.kind in (KW, inspect.Parameter.VAR_KEYWORD) and (
            extra.default is not EMPTY or extra.kind != KW
        )


def test_rope_config_signature():
    _assert_parameters(
        RopeConfig.__init__,
        [
            ("self", POS, EMPTY),
            ("head_dim", POS, EMPTY),
            ("base", POS, 10000.0),
            ("rotary_dim", KW, None),
            ("interleaved", KW, False),
            ("scaling", KW, None),
            ("max_position_embeddings", KW, None),
        ],
    )
    _assert_parameters(RopeConfig.inv_freq, [("self", POS, EMPTY), ("seq_len", POS, None)])
    _assert_parameters(RopeConfig.attention_scaling, [("self", POS, EMPTY), ("seq_len", POS, None)])
    _assert_parameters(
        RopeConfig.cos_sin,
        [
            ("self", POS, EMPTY),
            ("positions", POS, EMPTY),
            ("dtype", KW, torch.float32),
            ("seq_len", KW, None),
        ],
    )


FUNCTIONAL_KEYWORDS = [
    ("positions", KW, None),
    ("offsets", KW, 0),
    ("cu_seqlens", KW, None),
    ("interleaved", KW, False),
    ("inplace", KW, False),
    ("per_token", KW, False),
    ("full_width", KW, False),
    ("backend", KW, "auto"),
    ("inverse", KW, False),
    ("rotary_position", KW, "first"),
    ("numerics", KW, "exact"),
]


def test_apply_rotary_signatures_are_exact():
    tables = [("cos", POS, EMPTY), ("sin", POS, EMPTY)]
    for func, leading in (
        (ropekit.apply_rotary, [("x", POS, EMPTY)]),
        (ropekit.apply_rotary_qk, [("q", POS, EMPTY), ("k", POS, EMPTY)]),
    ):
        params = inspect.signature(func).parameters.values()
        assert [(p.name, p.kind, p.default) for p in params] == leading + tables + FUNCTIONAL_KEYWORDS


def test_rotary_embedding_signatures():
    _assert_parameters(
        RotaryEmbedding.__init__,
        [("self", POS, EMPTY), ("config", POS, None), ("layout", KW, "bshd")],
    )
    assert "config_kwargs" in inspect.signature(RotaryEmbedding.__init__).parameters
    _assert_parameters(
        RotaryEmbedding.forward,
        [
            ("self", POS, EMPTY),
            ("q", POS, EMPTY),
            ("k", POS, None),
            ("positions", KW, None),
            ("offsets", KW, 0),
            ("cu_seqlens", KW, None),
            ("inplace", KW, False),
        ],
    )


def test_sinusoidal_signature():
    _assert_parameters(
        ropekit.sinusoidal_embedding, [("positions", POS, EMPTY), ("dim", POS, EMPTY), ("base", POS, 10000.0)]
    )


@pytest.mark.parametrize(
    "func",
    [
        ropekit.apply_rotary,
        ropekit.apply_rotary_qk,
        ropekit.sinusoidal_embedding,
        RopeConfig.__init__,
        RopeConfig.cos_sin,
        RopeConfig.inv_freq,
        RopeConfig.attention_scaling,
        RotaryEmbedding.__init__,
        RotaryEmbedding.forward,
    ],
    ids=lambda f: f.__qualname__,
)
def test_public_api_is_fully_type_hinted(func):
    hints = inspect.get_annotations(func)
    params = [p for p in inspect.signature(func).parameters if p != "self"]
    assert set(params) <= set(hints) and "return" in hints


def test_public_names_are_exported():
    for name in (
        "RopeConfig",
        "RotaryEmbedding",
        "SinusoidalPositionalEmbedding",
        "apply_rotary",
        "apply_rotary_qk",
        "sinusoidal_embedding",
        "__version__",
    ):
        assert name in ropekit.__all__ and hasattr(ropekit, name)


def _readme_python_blocks() -> list[tuple[str, str]]:
    """(section title, code) for every ```python block of the README, in order."""
    readme = (ROOT / "README.md").read_text()
    found = []
    for section in readme.split("\n## ")[1:]:
        title = section.split("\n", 1)[0]
        found += [(title, block) for block in re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)]
    return found


README_BLOCKS = _readme_python_blocks()


def test_readme_has_runnable_examples_in_the_sections_users_copy_from():
    assert {"Usage", "Scaling", "Coming from another library"} <= {title for title, _ in README_BLOCKS}


@pytest.mark.parametrize(
    ("section", "block"), README_BLOCKS, ids=[f"{t}-{i}" for i, (t, _) in enumerate(README_BLOCKS)]
)
def test_readme_examples_run(section, block):
    """Every Python block of the README runs as written, in a fresh namespace."""
    exec(compile(block, f"README.md ({section})", "exec"), {})
