"""The CPU kernel's runtime build is safe: a compiler timeout, a private cache directory (0700, refused
when another user could write to it, with a logged fallback to torch), the compiler's identity in the cache
key, and a file lock so concurrent processes build once."""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from ropekit.backends import cpu

HAVE_CC = shutil.which(os.environ.get("CC") or "cc") is not None
needs_cc = pytest.mark.skipif(not HAVE_CC, reason="no C compiler here")


def _script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def _fake_compiler(tmp_path: Path, name: str, version: str, build: str = 'exec cc "$@"') -> str:
    """A compiler wrapper whose --version banner is `version` and whose build runs `build`."""
    real = shutil.which(os.environ.get("CC") or "cc") or "cc"
    banner = f'if [ "$1" = "--version" ]; then echo "{version}"; exit 0; fi\n'
    return _script(tmp_path / name, banner + build.replace("cc ", f"{real} ") + "\n")


def test_a_hung_compiler_times_out_with_a_runtime_error(tmp_path):
    slow = _fake_compiler(tmp_path, "slowcc", "slowcc 1.0", build="exec sleep 30")
    with pytest.raises(RuntimeError, match=r"timed out after 0.5 s"):
        cpu.build_library(compiler=slow, cache_dir=tmp_path / "cache", timeout=0.5)


@needs_cc
def test_the_cache_directory_is_created_with_mode_0700(tmp_path):
    directory = tmp_path / "fresh" / "ropekit"
    cpu.build_library(cache_dir=directory)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    (library,) = directory.glob("rotary_cpu_*.so")
    assert stat.S_IMODE(library.stat().st_mode) & 0o022 == 0


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o722])
def test_a_cache_directory_writable_by_group_or_others_is_refused(tmp_path, mode):
    directory = tmp_path / "shared"
    directory.mkdir()
    directory.chmod(mode)
    with pytest.raises(RuntimeError, match=rf"refusing the kernel cache .*mode {mode:o}"):
        cpu.build_library(cache_dir=directory)
    assert not list(directory.glob("*.so"))  # nothing built, nothing loaded


def test_a_cache_directory_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    directory = tmp_path / "theirs"
    directory.mkdir(mode=0o700)
    real_uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: real_uid + 1)
    with pytest.raises(RuntimeError, match=rf"owned by uid {real_uid}, not by this user"):
        cpu.build_library(cache_dir=directory)


@needs_cc
def test_a_planted_library_writable_by_others_is_not_loaded(tmp_path):
    directory = tmp_path / "cache"
    cpu.build_library(cache_dir=directory)
    (library,) = directory.glob("rotary_cpu_*.so")
    library.chmod(0o666)
    with pytest.raises(RuntimeError, match=r"refusing the kernel cache .*rotary_cpu_"):
        cpu.build_library(cache_dir=directory)


def test_an_unsafe_cache_is_logged_and_auto_falls_back_to_torch(tmp_path, monkeypatch, caplog):
    from ropekit.backends import select_backend

    directory = tmp_path / "shared"
    directory.mkdir()
    directory.chmod(0o777)
    monkeypatch.setenv("ROPEKIT_CACHE_DIR", str(directory))
    monkeypatch.setattr(cpu, "_library", None)
    monkeypatch.setattr(cpu, "_build_error", None)
    x, cos = torch.randn(1, 3, 2, 4), torch.randn(3, 2)
    with caplog.at_level(logging.WARNING, logger="ropekit.backends"):
        assert select_backend("auto", x, cos).name == "torch"
    assert "refusing the kernel cache" in caplog.text


def test_the_cache_key_changes_with_the_compiler_version(tmp_path):
    old = _fake_compiler(tmp_path, "cc-old", "gcc (GCC) 12.2.0")
    new = _fake_compiler(tmp_path, "cc-new", "gcc (GCC) 13.1.0")
    same_as_old = _fake_compiler(tmp_path, "cc-old-copy", "gcc (GCC) 12.2.0")
    assert cpu._cache_key(old) != cpu._cache_key(new)
    assert cpu._cache_key(old) == cpu._cache_key(old)
    assert cpu._cache_key(old) != cpu._cache_key(same_as_old)  # another binary (path) is another identity


def _build_in_child(compiler: str, directory: str) -> None:
    cpu.build_library(compiler=compiler, cache_dir=Path(directory))


@needs_cc
def test_concurrent_processes_build_once(tmp_path):
    log = tmp_path / "builds.log"
    # Each real build appends a line and takes at least a second, so two unlocked builders would overlap.
    build = f'echo build >> {log}\nsleep 1\ncc "$@"'
    counting = _fake_compiler(tmp_path, "countcc", "countcc 1.0", build=build)
    directory = tmp_path / "cache"
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_build_in_child, args=(counting, str(directory))) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert [w.exitcode for w in workers] == [0, 0, 0]
    assert log.read_text().splitlines() == ["build"]
    assert len(list(directory.glob("rotary_cpu_*.so"))) == 1


@needs_cc
def test_a_file_system_without_locks_still_builds(tmp_path, monkeypatch):
    import fcntl

    def no_locks(fd, op):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    lib = cpu.build_library(cache_dir=tmp_path / "nfs")
    assert hasattr(lib, "rotary_f32")
