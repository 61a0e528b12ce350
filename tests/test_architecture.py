"""The import rules of ARCHITECTURE.md, checked on the source with ast (and once at run time):

* nothing outside tools/ and cli/ imports tools/ or cli/ (at any level, lazy imports included);
* the core (everything but tools/ and cli/) never imports matplotlib, tqdm or transformers at module level
  (inside a function is fine: a model that imports ropekit never pays for them);
* imports point down the layer order below, never up (lazy imports included; a layer may import itself).
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "ropekit"

# Bottom to top, as drawn in ARCHITECTURE.md. A module belongs to the layer with its longest matching prefix.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("validation", ("ropekit.validation", "ropekit.dtensor_inputs")),
    ("reference", ("ropekit.reference",)),
    ("schedules", ("ropekit.schedules",)),
    ("config", ("ropekit.config", "ropekit.presets", "ropekit.hf_config", "ropekit.layer_rope")),
    ("positions", ("ropekit.positions", "ropekit.tables")),
    ("backends", ("ropekit.backends",)),
    ("autograd", ("ropekit.autograd",)),
    ("functional", ("ropekit.functional",)),
    ("fused", ("ropekit.fused",)),
    (
        "module",
        (
            "ropekit.table_cache",
            "ropekit.module",
            "ropekit.multiaxis",
            "ropekit.rope_index",
            "ropekit.rope_index_omni",
            "ropekit.shared_kv",
            "ropekit.sinusoidal",
            "ropekit.convert",
        ),
    ),
    ("public API", ("ropekit",)),  # the package root: only the exact name "ropekit"
    # ropekit.jax, ropekit.mlx: JAX / Flax and MLX adapters on the config layer's tables (extras).
    ("peers", ("ropekit.compat", "ropekit.nn", "ropekit.integrations", "ropekit.jax", "ropekit.mlx")),
    # Plugins an engine loads (docs/engines.md): on the peers (compat.vllm serves vLLM's cache contract).
    ("engine plugins", ("ropekit.integrations.vllm", "ropekit.integrations.sglang")),
    ("tools", ("ropekit.tools",)),
    ("cli", ("ropekit.cli", "ropekit.__main__")),
]
TOOLS_WING = ("ropekit.tools", "ropekit.cli", "ropekit.__main__")
# The engines too: their plugins import them only when the engine calls them.
HEAVY = ("matplotlib", "tqdm", "transformers", "vllm", "sglang")
# Modules that import an engine at module level: only the engine imports them (torchtitan's
# --override.imports), and only the engines environment has the engine.
ENGINE_MODULES = ("ropekit.integrations.torchtitan",)
# Modules of an optional extra: importable only where the extra is installed (module -> the package it needs).
EXTRA_MODULES = {"ropekit.jax": "jax", "ropekit.mlx": "mlx"}


def _matches(name: str, prefix: str) -> bool:
    if prefix == "ropekit":
        return name == "ropekit"
    return name == prefix or name.startswith(prefix + ".")


def layer_of(name: str) -> int:
    found = [
        (len(p), rank) for rank, (_, prefixes) in enumerate(LAYERS) for p in prefixes if _matches(name, p)
    ]
    if not found:
        raise LookupError(name)
    return max(found)[1]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str) -> list[tuple[str, bool, int]]:
    """(imported module, at module level?, line) for every import in the module's source."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, bool, int]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False)
                continue
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue  # never runs
            if isinstance(child, ast.Import):
                found.extend((alias.name, top, child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(anchor + ([child.module] if child.module else []))
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    found.append((sub if sub in MODULES else base, top, child.lineno))
            visit(child, top)

    visit(ast.parse(path.read_text(), str(path)), True)
    return found


def _in_tools_wing(name: str) -> bool:
    return any(_matches(name, p) for p in TOOLS_WING)


def test_every_module_has_a_layer():
    unplaced = []
    for name in MODULES:
        try:
            layer_of(name)
        except LookupError:
            unplaced.append(name)
    assert not unplaced, f"add these to LAYERS here and to ARCHITECTURE.md: {unplaced}"


def core_imports() -> list[tuple[str, str, bool, int]]:
    """(core module, imported module, at module level?, line) for every import made outside the tools wing."""
    return [
        (name, target, top, line)
        for name in MODULES
        if not _in_tools_wing(name)
        for target, top, line in imports(name)
    ]


def test_nothing_outside_the_tools_wing_imports_it():
    bad = [
        f"{name}:{line} imports {target}"
        for name, target, _, line in core_imports()
        if _in_tools_wing(target)
    ]
    assert not bad, "\n".join(bad)


def test_the_core_never_imports_matplotlib_tqdm_or_transformers_at_module_level():
    bad = [
        f"{name}:{line} imports {target} at module level (import it inside the function that needs it)"
        for name, target, top, line in core_imports()
        if top and target.split(".")[0] in HEAVY
    ]
    assert not bad, "\n".join(bad)


def test_imports_point_down_the_layers():
    bad = []
    for name in MODULES:
        rank = layer_of(name)
        for target, _, line in imports(name):
            if target.startswith("ropekit") and target in MODULES and layer_of(target) > rank:
                bad.append(
                    f"{name}:{line} ({LAYERS[rank][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
                )
    assert not bad, "\n".join(bad)


# Import cycles among ropekit's modules (lazy imports included), each a strongly connected set of the import
# map. compat/vllm + compat/vllm_variants is one module in two files (the variant classes need the cache
# functions and vllm.get_rope constructs the variants). It is the only one; a new cycle fails.
KNOWN_CYCLES = {
    frozenset({"ropekit.compat.vllm", "ropekit.compat.vllm_variants"}),
}


def import_cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected sets of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.add(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.add(frozenset(members))
    return found


def import_map() -> dict[str, set[str]]:
    return {
        name: {target for target, _, _ in imports(name) if target in MODULES and target != name}
        for name in MODULES
    }


def test_no_import_cycle_but_the_known_ones():
    cycles = import_cycles(import_map())
    new = [sorted(c) for c in cycles - KNOWN_CYCLES]
    gone = [sorted(c) for c in KNOWN_CYCLES - cycles]
    assert not new, f"import cycles (lazy imports included): {new}"
    assert not gone, f"these cycles are gone: remove them from KNOWN_CYCLES: {gone}"


def test_the_cycle_finder_finds_a_cycle_through_a_lazy_import_and_nothing_in_a_chain():
    chain = {"a": {"b"}, "b": {"c"}, "c": set()}
    assert import_cycles(chain) == set()
    assert import_cycles({**chain, "c": {"a"}, "d": {"d"}}) == {frozenset("abc")}


def test_the_checker_sees_lazy_relative_and_type_checking_imports(tmp_path, monkeypatch):
    """The walker itself: a test that cannot fail proves nothing."""
    fake = {
        "ropekit.module": PACKAGE / "module.py",
        "ropekit.tools": PACKAGE / "tools" / "__init__.py",
        "ropekit.tools.inspect": PACKAGE / "tools" / "inspect.py",
    }
    source = tmp_path / "module.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import matplotlib\n"
        "from .tools import inspect\n"
        "if TYPE_CHECKING:\n    import tqdm\n"
        "def f():\n    import transformers\n"
    )
    monkeypatch.setitem(MODULES, "ropekit.module", source)
    monkeypatch.setitem(MODULES, "ropekit.tools.inspect", fake["ropekit.tools.inspect"])
    found = {(target, top) for target, top, _ in imports("ropekit.module")}
    assert ("matplotlib", True) in found
    assert ("ropekit.tools.inspect", True) in found
    assert ("transformers", False) in found
    assert not any(target == "tqdm" for target, _ in found)


@pytest.mark.slow
def test_importing_the_whole_core_loads_no_tool_and_no_heavy_dependency():
    missing = {n for n, package in EXTRA_MODULES.items() if importlib.util.find_spec(package) is None}
    core = sorted(
        n for n in MODULES if not _in_tools_wing(n) and n not in ENGINE_MODULES and n not in missing
    )
    script = (
        "import importlib, sys\n"
        "import numpy, torch\n"  # whatever these load themselves (torch pulls in parts of tqdm) is not ours
        "before = set(sys.modules)\n"
        f"for name in {core!r}:\n"
        "    importlib.import_module(name)\n"
        f"loaded = sorted(m for m in set(sys.modules) - before if m.split('.')[0] in {HEAVY!r} "
        "or m.startswith(('ropekit.tools', 'ropekit.cli')))\n"
        "print(loaded)\n"
    )
    run = [sys.executable, "-c", script]
    out = subprocess.run(run, capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip() == "[]", out.stdout


def test_architecture_md_is_short_and_says_where_every_public_name_lives():
    import ropekit

    text = (PACKAGE.parents[1] / "ARCHITECTURE.md").read_text()
    assert len(text.splitlines()) <= 120, "ARCHITECTURE.md should stay under two pages"
    missing = [name for name in ropekit.__all__ if name != "__version__" and name not in text]
    packages = sorted(
        {n.split(".")[1] for n in MODULES if n.count(".") >= 1 and not n.split(".")[1][0] == "_"}
    )
    missing += [p for p in packages if p not in text]
    assert not missing, f"ARCHITECTURE.md does not mention {missing}"
