"""The C kernels' build is safe and says why a kernel is not loaded: a compiler timeout, a private cache
directory (0700, refused when another user could write to it), a cache key that follows the source, the flags
and the compiler, a file lock so concurrent builders build once, and one "loaded, or why not" object
(:class:`CLibrary`) that every C kernel reports through."""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import re
import shutil
import stat
import threading
from pathlib import Path

import pytest
import torch

from ropekit import apply_rotary, apply_rotary_qk_fp8, backends, qk_norm_rotary_, shift_cache_
from ropekit.backends.c import build as c_build
from ropekit.backends.c import fused as fused_cpu
from ropekit.backends.c import qk_norm as qk_norm_cpu
from ropekit.backends.c import rotary as cpu

# A source that compiles in a fraction of the rotary loop's time, with one entry point to call.
TINY = "#include <stdint.h>\nint64_t ropekit_probe(int64_t x) { return 2 * x + 1; }\n"


def _script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def _fake_compiler(tmp_path: Path, name: str, version: str, build: str = 'exec cc "$@"') -> str:
    """A compiler wrapper whose --version banner is `version` and whose build runs `build`."""
    real = shutil.which(os.environ.get("CC") or "cc") or "cc"
    banner = f'if [ "$1" = "--version" ]; then echo "{version}"; exit 0; fi\n'
    return _script(tmp_path / name, banner + build.replace("cc ", f"{real} ") + "\n")


def _refused_before_building(tmp_path: Path) -> str:
    """A compiler that fails every build: a cache refused before the build never runs it (so no C compiler
    is needed to test the refusal)."""
    return _fake_compiler(tmp_path, "failcc", "failcc 1.0", build="echo failcc ran >&2; exit 1")


def test_a_hung_compiler_times_out_with_a_runtime_error(tmp_path):
    slow = _fake_compiler(tmp_path, "slowcc", "slowcc 1.0", build="exec sleep 30")
    with pytest.raises(RuntimeError, match=r"timed out after 0.5 s"):
        c_build.build_library(TINY, "tiny", compiler=slow, cache_dir=tmp_path / "cache", timeout=0.5)


@pytest.mark.c_compiler
def test_a_built_library_is_loaded_and_its_code_runs(tmp_path):
    lib = c_build.build_library(TINY, "tiny", cache_dir=tmp_path / "cache")
    lib.ropekit_probe.argtypes, lib.ropekit_probe.restype = [ctypes.c_int64], ctypes.c_int64
    assert lib.ropekit_probe(20) == 41


@pytest.mark.c_compiler
def test_the_cache_directory_is_created_with_mode_0700(tmp_path):
    directory = tmp_path / "fresh" / "ropekit"
    c_build.build_library(TINY, "tiny", cache_dir=directory)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    (library,) = directory.glob("tiny_*.so")
    assert stat.S_IMODE(library.stat().st_mode) & 0o022 == 0


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o722])
def test_a_cache_directory_writable_by_group_or_others_is_refused(tmp_path, mode):
    directory = tmp_path / "shared"
    directory.mkdir()
    directory.chmod(mode)
    with pytest.raises(RuntimeError, match=rf"refusing the kernel cache .*mode {mode:o}"):
        c_build.build_library(TINY, "tiny", compiler=_refused_before_building(tmp_path), cache_dir=directory)
    assert not list(directory.glob("*.so"))  # nothing built, nothing loaded


def test_a_cache_directory_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    directory = tmp_path / "theirs"
    directory.mkdir(mode=0o700)
    real_uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: real_uid + 1)
    with pytest.raises(RuntimeError, match=rf"owned by uid {real_uid}, not by this user"):
        c_build.build_library(TINY, "tiny", compiler=_refused_before_building(tmp_path), cache_dir=directory)
    assert not list(directory.glob("*.so"))


@pytest.mark.c_compiler
def test_a_planted_library_writable_by_others_is_not_loaded(tmp_path):
    directory = tmp_path / "cache"
    c_build.build_library(TINY, "tiny", cache_dir=directory)
    (library,) = directory.glob("tiny_*.so")
    library.chmod(0o666)
    with pytest.raises(RuntimeError, match=r"refusing the kernel cache .*tiny_"):
        c_build.build_library(TINY, "tiny", cache_dir=directory)


def test_the_cache_key_changes_with_the_compiler_version(tmp_path):
    old = _fake_compiler(tmp_path, "cc-old", "gcc (GCC) 12.2.0")
    new = _fake_compiler(tmp_path, "cc-new", "gcc (GCC) 13.1.0")
    same_as_old = _fake_compiler(tmp_path, "cc-old-copy", "gcc (GCC) 12.2.0")
    assert c_build.cache_key(old, TINY) != c_build.cache_key(new, TINY)
    assert c_build.cache_key(old, TINY) == c_build.cache_key(old, TINY)
    assert c_build.cache_key(old, TINY) != c_build.cache_key(same_as_old, TINY)  # another binary: another key


def test_the_cache_key_changes_with_the_source_and_the_flags(tmp_path):
    compiler = _fake_compiler(tmp_path, "cc-fixed", "gcc (GCC) 12.2.0")
    key = c_build.cache_key(compiler, TINY)
    assert c_build.cache_key(compiler, TINY + "/* one more comment */\n") != key
    assert c_build.cache_key(compiler, TINY, flags=c_build.FLAGS[:-1]) != key
    assert c_build.cache_key(compiler, TINY, flags=(*c_build.FLAGS, "-ffast-math")) != key
    assert c_build.cache_key(compiler, TINY, flags=c_build.FLAGS) == key


@pytest.mark.c_compiler
def test_another_source_is_another_cached_library(tmp_path):
    directory = tmp_path / "cache"
    c_build.build_library(TINY, "tiny", cache_dir=directory)
    c_build.build_library(TINY.replace("2 * x", "3 * x"), "tiny", cache_dir=directory)
    assert len(list(directory.glob("tiny_*.so"))) == 2


@pytest.mark.c_compiler
def test_concurrent_builders_build_once_under_the_lock(tmp_path):
    """Four threads build the same library at once: flock locks open files, not processes, so the threads
    contend exactly as processes would. Each real build appends a line and takes a second, so two builders
    not serialised by the lock would both find the library missing and both build it."""
    log = tmp_path / "builds.log"
    counting = _fake_compiler(
        tmp_path, "countcc", "countcc 1.0", build=f'echo build >> {log}\nsleep 1\ncc "$@"'
    )
    directory = tmp_path / "cache"
    results: list[int] = []
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def build() -> None:
        try:
            start.wait()
            lib = c_build.build_library(TINY, "tiny", compiler=counting, cache_dir=directory)
            lib.ropekit_probe.argtypes, lib.ropekit_probe.restype = [ctypes.c_int64], ctypes.c_int64
            results.append(lib.ropekit_probe(3))
        except BaseException as err:  # reported below, in the test's thread
            errors.append(err)

    workers = [threading.Thread(target=build) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert errors == []
    assert results == [7, 7, 7, 7]
    assert log.read_text().splitlines() == ["build"]
    assert len(list(directory.glob("tiny_*.so"))) == 1


@pytest.mark.c_compiler
def test_a_file_system_without_locks_still_builds(tmp_path, monkeypatch):
    import fcntl

    def no_locks(fd, op):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    lib = c_build.build_library(TINY, "tiny", cache_dir=tmp_path / "nfs")
    assert hasattr(lib, "ropekit_probe")


def _tiny_library() -> c_build.CLibrary:
    return c_build.CLibrary(
        stem="tiny",
        source=TINY,
        entries={"probe": "ropekit_probe"},
        argtypes=(ctypes.c_int64,),
        refusal="backend: 'cpu' cannot serve the probe",
        description="the probe",
    )


@pytest.mark.c_compiler
def test_a_library_is_loaded_at_first_use_and_once(tmp_path, monkeypatch):
    monkeypatch.setenv("ROPEKIT_CACHE_DIR", str(tmp_path / "cache"))
    library = _tiny_library()
    assert library.functions == {} and library.reason is None  # nothing built at construction
    assert library.load() is None
    assert library.functions["probe"](5) == 11
    (built,) = (tmp_path / "cache").glob("tiny_*.so")
    built.unlink()  # loaded: a second load neither rebuilds nor reloads
    assert library.load() is None and library.require()["probe"](1) == 3
    assert not list((tmp_path / "cache").glob("tiny_*.so"))


def test_a_missing_compiler_is_the_reason_the_library_is_not_loaded(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("ROPEKIT_CACHE_DIR", str(tmp_path / "cache"))
    library = _tiny_library()
    with caplog.at_level(logging.WARNING, logger="ropekit.backends"):
        reason = library.load()
        assert library.load() == reason  # tried once: the reason is kept, and logged once
    assert reason == library.reason
    assert reason.startswith("the C kernel could not be built: no C compiler found (looked for ")
    assert "no-such-compiler" in reason
    assert library.functions == {}
    assert caplog.text.count("no C compiler found") == 1 and "the probe is unavailable" in caplog.text
    with pytest.raises(
        ValueError, match=r"^backend: 'cpu' cannot serve the probe: the C kernel could not be"
    ):
        library.require()


@pytest.mark.parametrize("unsafe", ["group-writable", "world-writable", "another owner"])
def test_an_unsafe_cache_is_the_reason_the_library_is_not_loaded(tmp_path, monkeypatch, unsafe):
    directory = tmp_path / "cache"
    directory.mkdir(mode=0o700)
    if unsafe == "another owner":
        real_uid = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: real_uid + 1)
        expected = rf"owned by uid {real_uid}, not by this user"
    else:
        mode = 0o770 if unsafe == "group-writable" else 0o707
        directory.chmod(mode)
        expected = rf"mode {mode:o} lets group or others write to it"
    monkeypatch.setenv("ROPEKIT_CACHE_DIR", str(directory))
    monkeypatch.setenv("CC", _refused_before_building(tmp_path))
    library = _tiny_library()
    reason = library.load()
    assert reason.startswith(f"the C kernel could not be built: refusing the kernel cache {str(directory)!r}")
    assert re.search(expected, reason)
    assert library.functions == {} and not list(directory.glob("*.so"))


def test_replace_gives_the_same_library_unloaded(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    library = _tiny_library()
    library.reason = "the C kernel could not be built: a test said so"
    fresh = dataclasses.replace(library)
    assert (fresh.stem, fresh.source, fresh.entries) == (library.stem, library.source, library.entries)
    assert fresh.reason is None and fresh.functions == {}


@pytest.fixture
def no_compiler(tmp_path, monkeypatch):
    """Every C kernel of ropekit unloaded, with no compiler to build it and a fresh cache."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("ROPEKIT_CACHE_DIR", str(tmp_path / "cache"))
    for module in (cpu, fused_cpu, qk_norm_cpu):
        monkeypatch.setattr(module, "_LIBRARY", dataclasses.replace(module._LIBRARY))
    backends.clear_backend_cache()  # forget choices and launch plans made while the kernels were loaded
    yield
    backends.clear_backend_cache()


def test_every_c_kernel_reports_a_missing_compiler_the_same_way(no_compiler):
    spec = qk_norm_cpu.NormSpec(1, 1, 8, 1e-6, 0.0, False, True, False)
    reasons = {
        "rotary": backends.BACKENDS["cpu"].unavailable_reason(torch.zeros(1, 1, 1, 8), torch.zeros(1, 4)),
        "fused": fused_cpu.unavailable_reason(),
        "qk_norm": qk_norm_cpu.unavailable_reason(spec),
    }
    assert len(set(reasons.values())) == 1, reasons
    (reason,) = set(reasons.values())
    assert reason.startswith("the C kernel could not be built: no C compiler found")
    for module in (cpu, fused_cpu, qk_norm_cpu):
        assert module._LIBRARY.reason == reason and module._LIBRARY.functions == {}


def _tables(half: int, rows: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.arange(rows, dtype=torch.float32)[:, None] * torch.linspace(0.1, 1.0, half)  # (rows, half)
    return angles.cos(), angles.sin()


def test_without_a_compiler_each_public_call_names_the_reason_and_auto_uses_torch(no_compiler):
    cos, sin = _tables(4)
    x = torch.randn(1, 3, 2, 8)  # (batch, seq, heads, head_dim)
    with pytest.raises(
        ValueError, match=r"^backend: 'cpu' cannot serve these inputs: the C kernel could not"
    ):
        apply_rotary(x, cos, sin, backend="cpu")
    torch.testing.assert_close(apply_rotary(x, cos, sin), apply_rotary(x, cos, sin, backend="torch"))

    q, k = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 1, 8)
    fp8 = {"q_scale": 1.0, "k_scale": 1.0}
    with pytest.raises(
        ValueError, match=r"^backend: 'cpu' cannot serve these inputs: the C kernel could not"
    ):
        apply_rotary_qk_fp8(q, k, cos, sin, **fp8, backend="cpu")  # the rotary backend is asked first
    for got, want in zip(
        apply_rotary_qk_fp8(q, k, cos, sin, **fp8),
        apply_rotary_qk_fp8(q, k, cos, sin, **fp8, backend="torch"),
        strict=True,
    ):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))

    qkv = torch.randn(1, 3, 4 * 8)  # (batch, seq, (2 q + 1 k + 1 v heads) * head_dim)
    norm = {"num_q_heads": 2, "num_kv_heads": 1, "head_dim": 8, "eps": 1e-6}
    weights = torch.ones(8), torch.ones(8)
    with pytest.raises(
        ValueError, match=r"^backend: 'cpu' cannot serve these inputs: the C kernel could not"
    ):
        qk_norm_rotary_(qkv.clone(), *weights, cos, sin, **norm, backend="cpu")
    torch.testing.assert_close(
        qk_norm_rotary_(qkv.clone(), *weights, cos, sin, **norm),
        qk_norm_rotary_(qkv.clone(), *weights, cos, sin, **norm, backend="torch"),
    )


def test_without_a_compiler_one_warning_says_why_whatever_is_called(no_compiler, caplog):
    """README: without a C compiler "the CPU path says so once". Every op, under auto and naming "cpu", and
    the registered ops, which reach the fused and QK-norm kernels without the rotary one: one warning line in
    all, naming the missing compiler (the other kernels' same reason goes to DEBUG)."""
    cos, sin = _tables(4)
    x = torch.randn(1, 3, 2, 8)  # (batch, seq, heads, head_dim)
    cache = torch.randn(4, 2, 8)  # (slots, heads, head_dim): the flat layout
    qkv = torch.randn(1, 3, 4 * 8)  # (batch, seq, (2 q + 1 k + 1 v heads) * head_dim)
    # the op's schema: positions, offset, q and kv heads, head_dim, eps, weight offset, and three flags
    norm = (None, 0, 2, 1, 8, 1e-6, 0.0, False, True, False)
    with caplog.at_level(logging.DEBUG, logger="ropekit.backends"):
        for _ in range(2):
            apply_rotary(x, cos, sin)
            shift_cache_(cache, cos, sin, 3, cache_layout="flat")
            for call in (
                lambda: apply_rotary(x, cos, sin, backend="cpu"),
                lambda: shift_cache_(cache, cos, sin, 3, cache_layout="flat", backend="cpu"),
                lambda: torch.ops.ropekit.shift_cache_(cache, cos, sin, 3, "flat", None, False, "cpu"),
                lambda: torch.ops.ropekit.qk_norm_rotary_(qkv, *torch.ones(2, 8), cos, sin, *norm, "cpu"),
            ):
                with pytest.raises(ValueError, match=r"the C kernel could not be built: no C compiler found"):
                    call()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("ropekit: the CPU fast path is unavailable, using torch: no C compiler")
    for module in (cpu, fused_cpu, qk_norm_cpu):  # each kernel was asked, and each knows why it is not loaded
        assert module._LIBRARY.reason is not None


@pytest.mark.c_compiler
def test_a_fused_loop_that_cannot_be_built_is_named_once_in_the_error(tmp_path, monkeypatch):
    """The rotary loop loads, the fused one does not: the fused op's error says so once (it used to repeat
    "backend: 'cpu' cannot serve the fused op: " when its reason already held it)."""
    assert backends.BACKENDS["cpu"].unavailable_reason(torch.zeros(1, 1, 1, 8), torch.zeros(1, 4)) is None
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(fused_cpu, "_LIBRARY", dataclasses.replace(fused_cpu._LIBRARY))
    backends.clear_backend_cache()
    cos, sin = _tables(4)
    q, k = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 1, 8)
    with pytest.raises(ValueError) as caught:
        apply_rotary_qk_fp8(q, k, cos, sin, q_scale=1.0, k_scale=1.0, backend="cpu")
    message = str(caught.value)
    assert message.startswith(
        "backend: 'cpu' cannot serve the fused op: the C kernel could not be built: no C"
    )
    assert message.count("cannot serve") == 1
    backends.clear_backend_cache()
