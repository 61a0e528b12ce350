"""ropekit's C kernels as libraries: the C they share, how one is built and cached, and whether it is loaded.

Each C kernel (the rotary loop of :mod:`~ropekit.backends.c.rotary`, the fused serving loop of
:mod:`~ropekit.backends.c.fused`, the QK-norm loop of :mod:`~ropekit.backends.c.qk_norm`) is one
:class:`CLibrary`: its source and entry points, built at first use and once per process. ``.functions`` holds
the loaded entry points (empty until then), ``.reason`` why it could not be built (None until then).

The sources are plain C (no torch or Python headers, loaded with ctypes), so a build takes about a second;
the shared library is cached in ``$ROPEKIT_CACHE_DIR`` (default ``$XDG_CACHE_HOME/ropekit``, else
``~/.cache/ropekit``; mode 0700, refused if another user could write to it) under a hash of the source, the
flags, the compiler's identity and the CPU. A file lock makes concurrent processes build once. No compiler
(``$CC``, else ``cc``), a failed or timed-out build, or an unsafe cache leaves the library unloaded with a
logged reason, and the kernel's callers fall back to torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Hashable, Iterator
from pathlib import Path

from ropekit.backends.kernel_op import MAX_HALF

__all__ = [
    "C_PRELUDE",
    "FLAGS",
    "PARALLEL_THRESHOLD",
    "CLibrary",
    "build_library",
    "cache_key",
    "default_cache_dir",
    "find_compiler",
]

log = logging.getLogger("ropekit.backends")

# -ffp-contract=off: no fused multiply-adds, so the float32 math rounds after each product and sum exactly
# as the torch backend's separate ops do; with the round-to-nearest-even stores, fp16/bf16/fp32 outputs then
# equal the torch backend's bit for bit (tests/backends/c/test_c_rotary.py). The loops are memory-bound:
# FMA buys nothing.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
# The compiler gets this long; a hung or pathologically slow build then fails (and auto falls back to torch)
# instead of blocking the first call forever. A normal build takes about a second.
BUILD_TIMEOUT_S = 120.0
# Below this many elements (256 KB of float32, near PyTorch's elementwise grain) one thread does the work.
# On an idle 2-core machine two threads speed up a Llama-3-8B decode step (64 tokens, 1.3 MB): out of place
# 262 -> 127 us, in place 117 -> 95 us, mostly by sharing the page faults of the fresh outputs. On a machine
# oversubscribed by other jobs a woken OpenMP thread can wait milliseconds for a core (seen: 9-12 ms for the
# same step); there, as for PyTorch's own ops, use torch.set_num_threads(1) (docs/benchmarks.md).
PARALLEL_THRESHOLD = 1 << 16

# What every C kernel of ropekit shares: bf16 loads and round-to-nearest-even stores (the rounding contract of
# docs/safety.md), fp16 through _Float16, float32 as is, the 8-float vector type, and ROPEKIT_MAX_HALF: every
# scratch row on a C stack has a size fixed at compile time (never one sized by the input), and each loop
# checks the input's width against it before it writes anything.
C_PRELUDE = (
    f"#define ROPEKIT_MAX_HALF {MAX_HALF}\n"
    + r"""
#include <stdint.h>
#include <string.h>

static inline float bf16_load(uint16_t h) {
    uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t bf16_store(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);  /* round to nearest even */
    return (uint16_t)(u >> 16);
}
typedef float v8f __attribute__((vector_size(32)));
typedef int v8i __attribute__((vector_size(32)));
#define F32_LOAD(v) (v)
#define F32_STORE(v) (v)
#define F16_LOAD(v) ((float)(v))
#define F16_STORE(v) ((_Float16)(v))
/* -1 if every token's table row (pos[token], or offset + its index in the sequence when pos is NULL) lies
   in [0, table_len), else the first token whose row does not: each loop checks before it writes anything. */
static inline int64_t first_bad_row(const int64_t *pos, int64_t tokens, int64_t offset, int64_t seq,
                                    int64_t table_len) {
    if (pos) {
        for (int64_t token = 0; token < tokens; ++token)
            if (pos[token] < 0 || pos[token] >= table_len) return token;
    } else if (tokens > 0 && (offset < 0 || offset > table_len - seq)) {
        return offset < 0 ? 0 : table_len - offset > 0 ? table_len - offset : 0;
    }
    return -1;
}
"""
)


def default_cache_dir() -> Path:
    """Where built libraries are kept: ``$ROPEKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/ropekit``, else
    ``~/.cache/ropekit`` (read at each build, so a test or a process can point it elsewhere)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ropekit"
    return Path(os.environ.get("ROPEKIT_CACHE_DIR", default))


def find_compiler(compiler: str | None = None) -> str | None:
    """The C compiler's path: ``compiler``, else ``$CC``, else ``cc``, looked up on ``PATH``; None if none is
    found (the C kernels then stay unloaded and ``backend="auto"`` uses torch). The test suite's
    ``c_compiler`` marker asks the same question."""
    return shutil.which(_compiler_name(compiler))


def _compiler_name(compiler: str | None) -> str:
    return compiler or os.environ.get("CC") or "cc"


def check_private(path: Path) -> None:
    """Refuse a cache entry another user could have written: ``ctypes.CDLL`` runs the code it loads.

    The owner must be this user and neither group nor others may write to it (as for ``~/.ssh``).

    Raises:
        RuntimeError: naming the path, its owner or mode, and the fix.
    """
    info = path.stat()
    if info.st_uid != os.getuid():
        raise RuntimeError(
            f"refusing the kernel cache {str(path)!r}: it is owned by uid {info.st_uid}, not by this user "
            f"(uid {os.getuid()}); set ROPEKIT_CACHE_DIR to a directory of your own"
        )
    if info.st_mode & 0o022:
        raise RuntimeError(
            f"refusing the kernel cache {str(path)!r}: mode {info.st_mode & 0o777:o} lets group or others "
            f"write to it (chmod go-w {str(path)!r}, or set ROPEKIT_CACHE_DIR to a private directory)"
        )


def private_dir(directory: Path) -> Path:
    """Create the cache directory with mode 0700 (parents as the umask says) and check that it is private."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private(directory)
    return directory


def _cpu_signature() -> str:
    """The CPU's flags: -march=native code built on one CPU may not run on another sharing the cache."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _compiler_identity(path: str, timeout: float) -> str:
    """The compiler's resolved path and ``--version`` banner: upgrading gcc must not reuse old builds."""
    try:
        result = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=timeout)
        banner = result.stdout.strip() or result.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as err:
        banner = f"unknown ({type(err).__name__})"
    return f"{os.path.realpath(path)}\n{banner}"


def cache_key(
    compiler: str, source: str, flags: tuple[str, ...] = FLAGS, timeout: float = BUILD_TIMEOUT_S
) -> str:
    """Hash of everything a built library depends on: its source, the flags, the compiler's identity (path and
    version) and the CPU. The C has no torch or Python headers, so neither version enters it."""
    parts = [source, *flags, _compiler_identity(compiler, timeout), _cpu_signature()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """An exclusive ``flock`` on the cache directory, so concurrent first calls build once.

    Without fcntl (Windows) or on a file system without locks there is no lock; the atomic rename still keeps
    every reader safe, and the worst case is a build per process.
    """
    try:
        import fcntl
    except ImportError:
        yield
        return
    fd = os.open(directory / "build.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:  # a file system without locks (some NFS mounts): build unlocked
            log.debug("ropekit: no lock on %s (%s); concurrent processes may each build", directory, err)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def build_library(
    source: str,
    stem: str,
    *,
    compiler: str | None = None,
    cache_dir: Path | None = None,
    timeout: float = BUILD_TIMEOUT_S,
    flags: tuple[str, ...] = FLAGS,
) -> ctypes.CDLL:
    """Compile a C source (or load it from the cache) and return the loaded library.

    The cache directory is created with mode 0700 and must belong to this user and be writable by no one else,
    as must a cached library, because loading a library runs its code. Concurrent processes take a file lock,
    so the first one builds and the rest load its result.

    Args:
        source: the C source; stem: the file-name stem of its cached library.
        compiler: the C compiler; defaults to ``$CC``, else ``cc``.
        cache_dir: where built libraries are kept; defaults to :func:`default_cache_dir`.
        timeout: seconds the compiler may run before the build counts as failed.
        flags: the compiler's flags (OpenMP, no FMA contraction, a shared object).

    Raises:
        RuntimeError: if no compiler is found, the build fails or times out, or the cache directory or a
            cached library is not private to this user; the message says which and why.
    """
    compiler = _compiler_name(compiler)
    path = find_compiler(compiler)
    if path is None:
        raise RuntimeError(f"no C compiler found (looked for {compiler!r}; install gcc or set CC)")
    directory = private_dir(Path(cache_dir) if cache_dir is not None else default_cache_dir())
    target = directory / f"{stem}_{cache_key(path, source, flags, timeout)}.so"
    with _build_lock(directory):
        if not target.exists():
            _compile(path, target, timeout, source, flags)
    check_private(target)
    return ctypes.CDLL(str(target))


def _compile(path: str, target: Path, timeout: float, source: str, flags: tuple[str, ...]) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "kernel.c"
        src.write_text(source)
        built = Path(tmp) / target.name
        cmd = [path, *flags, str(src), "-o", str(built)]
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"building the CPU kernel with {path} timed out after {timeout:g} s") from None
        if result.returncode != 0:
            err = result.stderr.strip()[-500:]
            raise RuntimeError(f"building the CPU kernel with {path} failed: {err}")
        os.chmod(built, 0o700)
        os.replace(built, target)  # atomic: a reader never sees half a file


# Why a C kernel could not be built, each reason as warned: a second kernel failing alike is logged at DEBUG.
_REASONS_LOGGED: set[str] = set()


@dataclasses.dataclass(eq=False)
class CLibrary:
    """One C kernel library: loaded at first use, once per process, or the reason it could not be.

    A kernel's per-call code reads ``functions`` (one attribute) and calls :meth:`require` (to launch) or
    :meth:`load` (to ask whether it can) only while it is empty. ``dataclasses.replace(library)`` is the same
    library, unloaded.

    Attributes:
        stem: the cached library's file-name stem; source: its C source.
        entries: key (a storage dtype) -> the name of its entry point in the source.
        argtypes: the entry points' ctypes argument types (they all return an int64 code).
        refusal: how a call that needs the library starts its ValueError when it cannot be built
            ("backend: 'cpu' cannot serve these inputs").
        description: what the log's warning calls it ("the CPU fast path").
        functions: key -> the loaded entry point; empty until loaded.
        reason: why it could not be built ("the C kernel could not be built: ..."); None until then.
    """

    stem: str
    source: str
    entries: dict[Hashable, str]
    argtypes: tuple[type, ...]
    refusal: str
    description: str
    functions: dict[Hashable, ctypes._CFuncPtr] = dataclasses.field(default_factory=dict, init=False)
    reason: str | None = dataclasses.field(default=None, init=False)

    def load(self) -> str | None:
        """None once the library is loaded, else why it could not be built (tried once; logged once)."""
        if not self.functions and self.reason is None:
            try:
                lib = build_library(self.source, self.stem)
            except (RuntimeError, OSError) as err:
                self.reason = f"the C kernel could not be built: {err}"
                # Said once a process: with no compiler every C kernel fails alike, and one line says why.
                level = logging.DEBUG if self.reason in _REASONS_LOGGED else logging.WARNING
                _REASONS_LOGGED.add(self.reason)
                log.log(level, "ropekit: %s is unavailable, using torch: %s", self.description, err)
                return self.reason
            for key, name in self.entries.items():
                function = getattr(lib, name)
                function.argtypes, function.restype = list(self.argtypes), ctypes.c_int64
                self.functions[key] = function
        return self.reason

    def require(self) -> dict[Hashable, ctypes._CFuncPtr]:
        """The loaded entry points (built now if need be).

        Raises:
            ValueError: ``refusal`` and the reason, if the library cannot be built.
        """
        reason = self.load()
        if reason is not None:
            raise ValueError(f"{self.refusal}: {reason}")
        return self.functions
