"""The demo corpus: the running interpreter's own standard-library source, read as bytes.

Nothing is downloaded. Files are chosen by a hash of their path relative to the stdlib folder, so the
selection and the train/validation split (by file, never inside one) repeat on every run with the same Python.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Corpus", "load_corpus", "sample_batch", "stdlib_files", "validation_windows"]

# Folders that are not the library's code: third-party packages, the (huge, repetitive) test suites, and
# generated
# data (pydoc_data's 750 kB of help prose, encodings' byte tables) that would otherwise dominate a small
# sample.
EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "pydoc_data", "encodings"}
)
# One in VALIDATION_EVERY files (by path hash) is held out for validation.
VALIDATION_EVERY = 10
# Separates files in the byte stream; NUL never occurs in Python source, so it marks a file boundary
# unambiguously.
FILE_SEPARATOR = b"\x00"


@dataclass(frozen=True)
class Corpus:
    """Two byte streams (uint8 tensors, shape (n,)) and the files they came from."""

    train: torch.Tensor
    validation: torch.Tensor
    train_files: tuple[str, ...]
    validation_files: tuple[str, ...]
    root: str


def stdlib_root() -> Path:
    """The running interpreter's standard-library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def _path_hash(relative: str) -> int:
    return int.from_bytes(hashlib.sha256(relative.encode()).digest()[:8], "big")


def stdlib_files(root: Path | None = None) -> list[str]:
    """Relative paths of the stdlib's .py files, ordered by path hash (a fixed, well-mixed order)."""
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise ValueError(
            f"root: expected the standard-library folder, got {str(root)!r}, which is not a directory"
        )
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in EXCLUDED_DIRS)
        for name in files:
            if name.endswith(".py"):
                found.append(Path(folder, name).relative_to(root).as_posix())
    return sorted(found, key=lambda rel: (_path_hash(rel), rel))


def load_corpus(train_bytes: int, validation_bytes: int, root: Path | None = None) -> Corpus:
    """Read whole files in hash order until each split holds at least the requested number of bytes.

    Args:
        train_bytes: minimum size of the training stream.
        validation_bytes: minimum size of the validation stream.
        root: the stdlib folder (default: the running interpreter's).

    Returns:
        a :class:`Corpus`; files within a split are joined by a NUL byte.

    Raises:
        ValueError: for a non-positive size, or when the stdlib holds too little source for the request.
    """
    for name, value in (("train_bytes", train_bytes), ("validation_bytes", validation_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    root = stdlib_root() if root is None else Path(root)
    wanted = {"train": train_bytes, "validation": validation_bytes}
    chunks: dict[str, list[bytes]] = {"train": [], "validation": []}
    files: dict[str, list[str]] = {"train": [], "validation": []}
    sizes = {"train": 0, "validation": 0}
    for rel in stdlib_files(root):
        split = "validation" if _path_hash(rel) % VALIDATION_EVERY == 0 else "train"
        if sizes[split] >= wanted[split]:
            if all(sizes[s] >= wanted[s] for s in wanted):
                break
            continue
        data = (root / rel).read_bytes()
        chunks[split].append(data)
        files[split].append(rel)
        sizes[split] += len(data) + len(FILE_SEPARATOR)
    for split in wanted:
        if sizes[split] < wanted[split]:
            raise ValueError(
                f"{split}_bytes: the stdlib at {str(root)!r} holds only {sizes[split]} bytes for the {split} "
                f"split, asked for {wanted[split]}"
            )

    def stream(split: str) -> torch.Tensor:
        blob = FILE_SEPARATOR.join(chunks[split])
        return torch.frombuffer(bytearray(blob), dtype=torch.uint8)  # (n,)

    return Corpus(
        stream("train"), stream("validation"), tuple(files["train"]), tuple(files["validation"]), str(root)
    )


def sample_batch(
    stream: torch.Tensor, batch_size: int, length: int, generator: torch.Generator
) -> torch.Tensor:
    """``batch_size`` random windows of ``length + 1`` bytes (inputs plus next-byte targets), as int64.

    Every caller with the same generator state draws the same windows, which is what lets DDP ranks take
    disjoint rows of one global batch.

    Shape:
        returns (batch_size, length + 1).
    """
    if stream.numel() <= length + 1:
        raise ValueError(
            f"length: expected fewer than {stream.numel() - 1} bytes for this stream, got {length}"
        )
    starts = torch.randint(0, stream.numel() - length - 1, (batch_size,), generator=generator)
    index = starts[:, None] + torch.arange(length + 1)  # (batch, length + 1)
    return stream[index].long()


def validation_windows(stream: torch.Tensor, length: int, chunk_length: int, n_chunks: int) -> torch.Tensor:
    """``n_chunks`` evenly spaced chunks of the stream, each cut into non-overlapping windows of ``length``.

    The chunks do not depend on ``length``, so every evaluation length predicts exactly the same bytes, with
    more or less context; spacing them over the whole stream samples every validation file.

    Shape:
        returns (n_chunks * chunk_length // length, length + 1): inputs and targets overlap by one byte.

    Raises:
        ValueError: when chunk_length is not a multiple of length, or the stream is too short.
    """
    if chunk_length % length:
        raise ValueError(f"chunk_length: expected a multiple of length {length}, got {chunk_length}")
    if stream.numel() < n_chunks * (chunk_length + 1):
        raise ValueError(
            f"n_chunks: {n_chunks} chunks of {chunk_length + 1} bytes do not fit a stream of "
            f"{stream.numel()} bytes"
        )
    chunk_starts = torch.linspace(0, stream.numel() - chunk_length - 1, n_chunks).long()  # (n_chunks,)
    starts = (chunk_starts[:, None] + torch.arange(0, chunk_length, length)).flatten()  # (windows,)
    index = starts[:, None] + torch.arange(length + 1)  # (windows, length + 1)
    return stream[index].long()
