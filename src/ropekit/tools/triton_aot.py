"""Compile every Triton kernel in ropekit ahead of time for sm_80, sm_90 and sm_100, with no GPU, and check
the machine code (:mod:`ropekit.tools.ptx_check`).

``triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", arch, 32))`` runs the
whole pipeline (ttir, ttgir, llir, PTX, and a cubin from the ptxas that ships in the Triton wheel) on any
machine. Each module that defines ``@triton.jit`` functions lists what its launcher can launch in
``aot_specializations()``: ``(kernel, signature, constexprs, num_warps)`` tuples, signatures in Triton's
ahead-of-time notation (``"*bf16:16"``: a pointer the JIT specializes as 16-byte aligned; ``"i32:16"``: an
int divisible by 16). Optional module attributes: ``COMPILE_OPTIONS`` (passed to every compile, as
the launcher passes them), ``VECTORISED_ARGS`` (pointer arguments whose loads and stores must be 128-bit;
by default every 16-byte-aligned fp16/bf16 pointer; a module's ``vectorised_args(signature)`` narrows it per
specialization) and ``OCCUPANCY_TARGET`` (default 1.0: full
occupancy).

Two stores in ``$ROPEKIT_CACHE_DIR/triton-aot``, each keyed by what it reads: ``compiled/`` holds each
compile's PTX and cubin (gzip'd, 10-30 KB), keyed by the kernel source (and every function it calls), the
argument types and hints, the constexprs, the options, the target and the Triton and ptxas versions
(:func:`compile_key`); ``checked/`` holds the checks' findings on it (registers, spills, access widths: a
few hundred bytes), keyed also by the checks' own code. A changed check re-reads the stored compiles; no
test's time depends on either store (a fresh machine has neither). Triton's own artifacts (about 190 KB a
specialization) go wherever ``TRITON_CACHE_DIR`` points (the tests: a temporary directory).

Three grids: the fast tier compiles a per-axis :func:`cover` (``strength=1``), ``make proofs`` a 3-wise one
and the whole grid of each kernel whose source or specializations changed since the last
``make proofs-full``, which compiles every specialization for every target and records each kernel in
:data:`MANIFEST` (:func:`write_manifest`, :func:`full_grid_kernels`).

Compiling needs Triton's JIT: under ``TRITON_INTERPRET=1`` ``@triton.jit`` yields functions that cannot be
compiled.
"""

from __future__ import annotations

import base64
import functools
import gzip
import hashlib
import heapq
import importlib
import itertools
import json
import os
import pkgutil
import re
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import ropekit
from ropekit.tools import ptx_check

__all__ = [
    "ARCHES",
    "FULL_GRID_FIELDS",
    "MANIFEST",
    "Result",
    "Spec",
    "StaleManifestWarning",
    "compile_and_check",
    "compile_key",
    "cover",
    "full_grid_kernels",
    "kernel_modules",
    "kernel_records",
    "module_spec",
    "read_manifest",
    "specs",
    "stale_kernels",
    "stored_result",
    "uncovered",
    "write_manifest",
]

ARCHES = (80, 90, 100)  # A100, H100 / H200, B200


@dataclass(frozen=True)
class Spec:
    """One specialization: a kernel (module and name), its signature, constexprs, warps and options."""

    module: str
    kernel: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, object], ...]
    num_warps: int
    options: tuple[tuple[str, object], ...] = ()
    vectorised: tuple[str, ...] | None = None
    occupancy: float = 1.0

    @property
    def label(self) -> str:
        consts = " ".join(f"{k}={v}" for k, v in self.constexprs)
        dtypes = sorted({v.split(":")[0] for _, v in self.signature if v.startswith("*")})
        return f"{self.kernel}[{','.join(dtypes)}] {consts} warps={self.num_warps}"


@dataclass
class Result:
    """What one compile of one spec for one arch produced and what the checks found."""

    spec: Spec
    arch: int
    registers: int = 0
    local_bytes: int = 0
    budget: int = 0
    vector_bits: dict[str, list[int]] = field(default_factory=dict)  # pointer -> widths of its accesses
    rounding: list[str] = field(default_factory=list)  # 16-bit pointers whose stores were checked
    findings: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _is_jit(obj) -> bool:
    from triton.runtime.jit import JITFunction

    return isinstance(obj, JITFunction)


def kernel_modules() -> list[str]:
    """Names of the ropekit modules whose source defines a ``@triton.jit`` function (found by reading the
    files, so a module nobody imports is found too)."""
    root = Path(ropekit.__file__).parent
    names = []
    for info in pkgutil.walk_packages([str(root)], prefix="ropekit."):
        path = root.joinpath(*info.name.split(".")[1:])
        file = path / "__init__.py" if info.ispkg else path.with_suffix(".py")
        if file.is_file() and re.search(r"^\s*@triton\.jit\b", file.read_text(), re.MULTILINE):
            names.append(info.name)
    return sorted(names)


def _jit_functions(module) -> dict[str, object]:
    return {
        name: obj for name, obj in vars(module).items() if _is_jit(obj) and obj.__module__ == module.__name__
    }


def module_spec(module, kernel, signature: dict, constexprs: dict, num_warps: int) -> Spec:
    """A :class:`Spec` for one specialization of a kernel of ``module``, with the module's options."""
    pick = getattr(module, "vectorised_args", None)  # per specialization, when a module defines it
    vectorised = pick(signature) if pick is not None else getattr(module, "VECTORISED_ARGS", None)
    return Spec(
        module.__name__,
        kernel.__name__,
        tuple(signature.items()),
        tuple(constexprs.items()),
        num_warps,
        tuple(sorted(getattr(module, "COMPILE_OPTIONS", {}).items())),
        None if vectorised is None else tuple(vectorised),
        getattr(module, "OCCUPANCY_TARGET", 1.0),
    )


def specs(module_name: str) -> list[Spec]:
    """The module's ``aot_specializations()`` as :class:`Spec` s (an empty list if it has none)."""
    module = importlib.import_module(module_name)
    listing = getattr(module, "aot_specializations", None)
    if listing is None:
        return []
    return [module_spec(module, *spec) for spec in listing()]


def _axes(spec: Spec) -> set[tuple]:
    """The values a specialization fixes, each an axis value of its kernel: every pointer's and scalar's
    type in the signature, every constexpr and the warp count."""
    axes = {("signature", spec.kernel, name, kind) for name, kind in spec.signature}
    axes |= {("constexpr", spec.kernel, name, repr(value)) for name, value in spec.constexprs}
    return axes | {("num_warps", spec.kernel, spec.num_warps)}


def cover(
    module_specs: Iterable[Spec], arches: Iterable[int] = ARCHES, *, strength: int = 2
) -> list[tuple[Spec, int]]:
    """A small set of (spec, arch) compiles that covers, for each kernel, every combination of ``strength``
    axis values that the full grid (every spec for every target) contains, the target being one more axis:
    ``strength=1`` is a per-axis cover (every target, every constexpr value, every signature type, every warp
    count at least once), ``strength=2`` (the default) a pairwise one (every constexpr value on every
    target, every pair of flags together, every dtype with every flag), ``strength=3`` a 3-wise one (every
    triple: each pair of flags on every target, each dtype with each pair of flags). The fast tier compiles
    the per-axis cover, ``make proofs`` the 3-wise one and ``make proofs-full`` the full product.

    Greedy: each step takes the compile that covers the most uncovered combinations, its count recounted
    only when it reaches the top (a count only shrinks, so a stale one bounds it); among equal counts the
    earliest spec and target in the module's own order comes first. No step depends on the order of a set,
    so the cover is the same in every process."""
    if strength not in (1, 2, 3):
        raise ValueError(f"strength must be 1 (per axis), 2 (pairwise) or 3 (3-wise), got {strength!r}")
    import numpy as np

    module_specs = list(dict.fromkeys(module_specs))
    # An axis value every specialization of a kernel shares is covered by any compile of that kernel: leaving
    # it out keeps the combinations few (the fused kernel has ~50 parameters, most of one type throughout).
    per_kernel: dict[str, list[set]] = {}
    for spec in module_specs:
        per_kernel.setdefault(spec.kernel, []).append(_axes(spec))
    shared = {kernel: set.intersection(*axes) for kernel, axes in per_kernel.items()}
    # Each axis value gets a number within its kernel (no combination spans two kernels); a combination of
    # ``strength`` of them, in increasing order, is one integer in base ``len(numbers)``, offset by its
    # kernel's block, and ``wanted`` holds one flag per possible integer. The fused kernel's 3-wise grid has
    # about 27 million (compile, combination) memberships: arrays of integers, not sets of tuples.
    numbers: dict[str, dict[tuple, int]] = {kernel: {} for kernel in per_kernel}
    candidates, rows = [], []
    for spec in module_specs:
        varying = _axes(spec) - shared[spec.kernel]
        for arch in arches:
            axes = sorted(varying | {("kernel", spec.kernel), ("target", spec.kernel, arch)}, key=repr)
            own = numbers[spec.kernel]
            candidates.append((spec, arch))
            rows.append((spec.kernel, sorted(own.setdefault(axis, len(own)) for axis in axes)))
    if not candidates:
        return []
    offsets, total = {}, 0
    for kernel, own in numbers.items():
        offsets[kernel] = total
        total += len(own) ** strength
    picks: dict[int, np.ndarray] = {}  # row length -> every choice of ``strength`` of its positions
    members = []
    for kernel, row in rows:
        if len(row) not in picks:
            picks[len(row)] = np.array(list(itertools.combinations(range(len(row)), strength)), np.int64)
        places = len(numbers[kernel]) ** np.arange(strength - 1, -1, -1, dtype=np.int64)
        codes = np.array(row, np.int64)[picks[len(row)]] @ places + offsets[kernel]
        members.append(codes.astype(np.int32 if total < 2**31 else np.int64))
    wanted = np.zeros(total, bool)
    for codes in members:
        wanted[codes] = True
    left = int(np.count_nonzero(wanted))
    chosen: list[tuple[Spec, int]] = []
    heap = [(-len(m), order) for order, m in enumerate(members)]
    heapq.heapify(heap)
    while left:
        _, order = heapq.heappop(heap)
        gain = int(np.count_nonzero(wanted[members[order]]))
        if heap and gain < -heap[0][0]:
            heapq.heappush(heap, (-gain, order))
            continue
        chosen.append(candidates[order])
        wanted[members[order]] = False
        left -= gain
    return chosen


def uncovered(module_name: str, module_specs: Iterable[Spec]) -> list[str]:
    """``@triton.jit`` functions of the module that no specialization launches and no launched function
    calls (directly or through others): kernels nobody compiles ahead of time."""
    functions = _jit_functions(importlib.import_module(module_name))
    reached = {s.kernel for s in module_specs}
    todo = list(reached)
    while todo:
        fn = functions.get(todo.pop())
        if fn is None:
            continue
        for name in functions:
            if name not in reached and re.search(rf"\b{re.escape(name)}\s*\(", fn.src):
                reached.add(name)
                todo.append(name)
    return sorted(set(functions) - reached)


# The last full run (make proofs-full) of each kernel: what make proofs compiles in full instead of its cover.
MANIFEST = Path(__file__).with_name("triton_aot_manifest.json")
# A kernel whose record differs from the manifest's in one of these gets its whole grid compiled by make
# proofs; in another (the checks' code, the Triton version), only its 3-wise cover, and make proofs says so.
FULL_GRID_FIELDS = ("source", "specializations")


class StaleManifestWarning(UserWarning):
    """The manifest of the last make proofs-full does not hold a kernel as it is now (make proofs warns it;
    defined here, not in the test, so that pytest-xdist's controller can import the category it is sent)."""


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _kernel_sources(fn) -> list[str]:
    """A kernel's source as the manifest reads it: its own, that of every ``@triton.jit`` function it
    reaches, and the values of the constants they read. Unlike Triton's cache key, not the line it starts
    on: an edit above a kernel does not make its last full run stale."""
    import triton.language as tl

    parts, seen, todo = [], set(), [fn]
    while todo:
        f = todo.pop(0)
        if (f.__module__, f.__name__) in seen:
            continue
        seen.add((f.__module__, f.__name__))
        parts.append(f.src)
        for name in sorted(set(re.findall(r"\b[A-Za-z_]\w*\b", f.src))):
            value = f.__globals__.get(name)
            if _is_jit(value):
                todo.append(value)
            elif isinstance(value, (tl.constexpr, bool, int, float, str)):
                parts.append(f"{f.__name__}: {name} = {value!r}")
    return parts


def _by_kernel(module_specs: Iterable[Spec]) -> dict[str, list[Spec]]:
    """Each kernel's distinct specializations (a listing may name one twice: the fused kernel's does)."""
    kernels: dict[str, list[Spec]] = {}
    for spec in dict.fromkeys(module_specs):
        kernels.setdefault(spec.kernel, []).append(spec)
    return kernels


def kernel_records(module_name: str, arches: Iterable[int] = ARCHES) -> dict[str, dict]:
    """What the manifest records of each kernel of the module, by ``module.kernel``: hashes of its source
    (:func:`_kernel_sources`) and of its specializations, its compiles, the checks' code and Triton's
    version."""
    import triton

    module = importlib.import_module(module_name)
    arches = list(arches)
    return {
        f"{module_name}.{kernel}": {
            "source": _digest("\n".join(_kernel_sources(getattr(module, kernel)))),
            "specializations": _digest("\n".join(sorted(map(repr, kernel_specs)))),
            "targets": arches,
            "compiles": len(kernel_specs) * len(arches),
            "checks": _checks_source()[:16],
            "triton": triton.__version__,
        }
        for kernel, kernel_specs in _by_kernel(specs(module_name)).items()
    }


def read_manifest(path: Path = MANIFEST) -> dict[str, dict]:
    """The manifest's record of each kernel (none when the file is missing)."""
    return json.loads(path.read_text())["kernels"] if path.is_file() else {}


def stale_kernels(module_name: str, manifest: dict[str, dict] | None = None) -> dict[str, list[str]]:
    """The kernels of the module whose record (:func:`kernel_records`) differs from the manifest's, by
    kernel name, each with the fields that differ (``"no full run"`` when the manifest has no record)."""
    manifest = read_manifest() if manifest is None else manifest
    stale = {}
    for name, record in kernel_records(module_name).items():
        kept = manifest.get(name)
        differ = ["no full run"] if kept is None else [k for k, v in record.items() if kept.get(k) != v]
        if differ:
            stale[name.rsplit(".", 1)[1]] = differ
    return stale


def full_grid_kernels(module_name: str, manifest: dict[str, dict] | None = None) -> list[str]:
    """The kernels of the module that ``make proofs`` compiles in full: those the manifest holds no full run
    of, or whose source or specializations changed since (:data:`FULL_GRID_FIELDS`)."""
    return sorted(
        kernel
        for kernel, differ in stale_kernels(module_name, manifest).items()
        if "no full run" in differ or set(differ) & set(FULL_GRID_FIELDS)
    )


def write_manifest(
    modules: Iterable[str] | None = None, arches: Iterable[int] = ARCHES, path: Path = MANIFEST
) -> list[str]:
    """Record in the manifest each kernel whose every compile (every specialization for every target) has
    stored findings (:func:`stored_result`) from this source and these checks, all empty: what ``make
    proofs-full`` runs after its full grid passed. A kernel with a compile missing or failed keeps its old
    record, and this raises after writing the others.

    Returns:
        One line a kernel recorded.

    Raises:
        RuntimeError: naming each kernel not recorded and how many of its compiles are missing or failed.
    """
    arches = list(arches)
    kept = read_manifest(path)
    manifest, lines, refused = {}, [], []
    for module_name in kernel_modules() if modules is None else modules:
        records = kernel_records(module_name, arches)
        for kernel, kernel_specs in _by_kernel(specs(module_name)).items():
            name = f"{module_name}.{kernel}"
            results = [stored_result(spec, arch) for spec in kernel_specs for arch in arches]
            absent = sum(r is None for r in results)
            failed = sum(bool(r is not None and r.findings) for r in results)
            if absent or failed:
                refused.append(
                    f"{name}: {absent} of {len(results)} compiles not stored, {failed} with findings"
                )
                if name in kept:
                    manifest[name] = kept[name]
                continue
            manifest[name] = records[name]
            lines.append(f"{name}: {len(results)} compiles passed; recorded in {path.name}")
    about = (
        "written by make proofs-full once the full Triton grid passed; make proofs reads it (CONTRIBUTING.md)"
    )
    path.write_text(json.dumps({"about": about, "kernels": manifest}, indent=1, sort_keys=True) + "\n")
    if refused:
        raise RuntimeError("not recorded (run make proofs-full):\n" + "\n".join(refused))
    return lines


def _cache_dir(kind: str) -> Path:
    """``$ROPEKIT_CACHE_DIR/triton-aot/<kind>``: ``compiled`` (what each compile produced) or ``checked``
    (what the checks found in it)."""
    from ropekit.backends.c.build import default_cache_dir, private_dir

    return private_dir(default_cache_dir() / "triton-aot" / kind)


def _cuobjdump() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def _kernel(spec: Spec, fn=None):
    return fn if fn is not None else getattr(importlib.import_module(spec.module), spec.kernel)


def _compile_arguments(spec: Spec, fn) -> tuple[dict, dict, dict, dict]:
    """What ``triton.compile`` reads besides the kernel and the target: the argument types, the constexprs,
    the divisibility hints and the options (warps, fp fusion)."""
    names = fn.arg_names
    signature = {name: kind.split(":")[0] for name, kind in spec.signature}
    attrs = {
        (names.index(n),): [["tt.divisibility", 16]] for n, kind in spec.signature if kind.endswith(":16")
    }
    return signature, dict(spec.constexprs), attrs, {"num_warps": spec.num_warps, **dict(spec.options)}


def _compile(spec: Spec, arch: int, fn=None):
    """triton.compile of one spec for sm_<arch>; ``fn`` overrides the kernel (a test's planted copy)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _kernel(spec, fn)
    signature, constexprs, attrs, options = _compile_arguments(spec, fn)
    source = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


@functools.cache
def _toolchain(arch: int) -> tuple:
    """The Triton version, the version of the ptxas it runs for sm_<arch> (its wheel's own unless
    ``TRITON_PTXAS_PATH`` names another) and the environment variables Triton's own cache key reads."""
    import triton
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.backends.nvidia.compiler import get_ptxas

    return triton.__version__, get_ptxas(arch).version, sorted(get_cache_invalidating_env_vars().items())


def compile_key(spec: Spec, arch: int) -> str:
    """The key of one compile's artifacts: what the compile reads, and nothing else. The kernel's source as
    Triton keys it (``JITFunction.cache_key``: its source and first line, every ``@triton.jit`` function it
    calls, the constexpr globals it reads), the argument types and their divisibility hints, the
    constexprs, the options, the target and :func:`_toolchain`. Not the source of this module nor of
    :mod:`ptx_check`: a changed check re-reads what was compiled (:func:`compile_and_check`)."""
    fn = _kernel(spec)
    signature, constexprs, attrs, options = _compile_arguments(spec, fn)
    read = (fn.cache_key, spec.kernel, *(sorted(d.items()) for d in (signature, constexprs, attrs, options)))
    return hashlib.sha256(repr((*read, arch, _toolchain(arch))).encode()).hexdigest()


@functools.cache
def _checks_source() -> str:
    """A hash of the checks' code: :mod:`ptx_check` and this module (which reads the compile for them)."""
    return hashlib.sha256(Path(ptx_check.__file__).read_bytes() + Path(__file__).read_bytes()).hexdigest()


def _checked_path(spec: Spec, arch: int) -> Path:
    """Where the checks' findings on (spec, arch) are kept: keyed on the compile (:func:`compile_key`), the
    spec (its pointers held to 128 bits, its occupancy) and the checks' code."""
    key = hashlib.sha256(f"{compile_key(spec, arch)}|{spec!r}|{_checks_source()}".encode()).hexdigest()
    return _cache_dir("checked") / f"{spec.kernel}-sm{arch}-{key[:32]}.json"


@dataclass(frozen=True)
class Compiled:
    """What the checks read of one compile: its PTX, its cubin and whether fp fusion was on."""

    ptx: str
    cubin: bytes
    enable_fp_fusion: bool


def _compiled_now(spec: Spec, arch: int, fn=None) -> Compiled:
    compiled = _compile(spec, arch, fn)
    return Compiled(compiled.asm["ptx"], compiled.asm["cubin"], compiled.metadata.enable_fp_fusion)


def _store(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)  # atomic: concurrent test workers never read half a file


def _compiled(spec: Spec, arch: int) -> Compiled:
    """One compile's artifacts, read back when a compile with the same inputs (:func:`compile_key`) ran
    before, else compiled and kept: the PTX and the cubin, gzip'd (10-30 KB a compile)."""
    path = _cache_dir("compiled") / f"{spec.kernel}-sm{arch}-{compile_key(spec, arch)[:32]}.json.gz"
    if path.is_file():
        stored = json.loads(gzip.decompress(path.read_bytes()))
        return Compiled(stored["ptx"], base64.b64decode(stored["cubin"]), stored["enable_fp_fusion"])
    compiled = _compiled_now(spec, arch)
    stored = {
        "ptx": compiled.ptx,
        "cubin": base64.b64encode(compiled.cubin).decode(),
        "enable_fp_fusion": compiled.enable_fp_fusion,
    }
    _store(path, gzip.compress(json.dumps(stored).encode(), mtime=0))
    return compiled


def _pointer_params(spec: Spec) -> dict[str, tuple[int, str]]:
    """Pointer argument name -> (its PTX parameter index, its signature type); constexprs are not params."""
    params, index = {}, 0
    for name, kind in spec.signature:
        if kind == "constexpr":
            continue
        if kind.startswith("*"):
            params[name] = (index, kind)
        index += 1
    return params


_FIELDS = ("registers", "local_bytes", "budget", "vector_bits", "rounding", "findings")


def compile_and_check(spec: Spec, arch: int, fn=None) -> Result:
    """Compile one spec for sm_<arch> and run every check of :mod:`ropekit.tools.ptx_check` on it.

    Two stores under ``$ROPEKIT_CACHE_DIR/triton-aot``, so a second run compiles nothing: the compile's
    artifacts (:func:`compile_key`) and the checks' findings on them (:func:`_checked_path`). A change to
    the checks finds the artifacts and checks them again; a change to the kernel compiles again. ``fn`` (a
    test's planted copy of a kernel) is always compiled, and nothing of it is kept."""
    start = time.perf_counter()
    if fn is not None:
        return _check(spec, arch, _compiled_now(spec, arch, fn), start)
    stored = stored_result(spec, arch)
    if stored is not None:
        return stored
    result = _check(spec, arch, _compiled(spec, arch), start)
    findings = {name: getattr(result, name) for name in _FIELDS}
    _store(_checked_path(spec, arch), json.dumps(findings).encode())
    return result


def stored_result(spec: Spec, arch: int) -> Result | None:
    """The checks' findings on (spec, arch) from an earlier :func:`compile_and_check` of this kernel source
    with these checks, or None."""
    path = _checked_path(spec, arch)
    return Result(spec, arch, **json.loads(path.read_text())) if path.is_file() else None


def _check(spec: Spec, arch: int, compiled: Compiled, start: float) -> Result:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.cubin)
        cubin.flush()
        usage = ptx_check.resource_usage(cubin.name, _cuobjdump())
    ptx = compiled.ptx
    instructions = ptx_check.parse_ptx(ptx)
    options = dict(spec.options)
    budget = ptx_check.register_budget(spec.num_warps, spec.occupancy)
    result = Result(spec, arch, usage["REG"], usage.get("LOCAL", 0) + usage.get("STACK", 0), budget)
    findings = ptx_check.check_spills(usage, ptx)
    findings += ptx_check.check_registers(usage, spec.num_warps, spec.occupancy)
    params = _pointer_params(spec)
    if spec.vectorised is not None:
        vector = {params[n][0]: n for n in spec.vectorised if params[n][1].endswith(":16")}
    else:
        vector = {i: n for n, (i, kind) in params.items() if re.match(r"\*(bf16|fp16):16$", kind)}
    findings += ptx_check.check_vectorised(instructions, vector)
    for index, name in vector.items():
        accesses = ptx_check.pointer_accesses(instructions, {index})
        result.vector_bits[name] = sorted({ptx_check.access_bits(a.opcode) for a in accesses})
    half = {i: n for n, (i, kind) in params.items() if re.match(r"\*(bf16|fp16)\b", kind)}
    findings += ptx_check.check_rounding(instructions, half)
    result.rounding = sorted(half.values())
    if options.get("enable_fp_fusion") is False:
        findings += ptx_check.check_no_fma(instructions)
    elif "enable_fp_fusion" not in options:
        findings.append(ptx_check.Finding("fp fusion", "COMPILE_OPTIONS does not set enable_fp_fusion"))
    if compiled.enable_fp_fusion != options.get("enable_fp_fusion"):
        findings.append(ptx_check.Finding("fp fusion", f"compiled with {compiled.enable_fp_fusion}"))
    result.findings = [str(f) for f in findings]
    result.seconds = time.perf_counter() - start
    return result
