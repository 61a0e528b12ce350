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

from ropekit.validation import check_int

__all__ = [
    "KEY_CLOSE",
    "KEY_DIGITS",
    "KEY_OPEN",
    "Corpus",
    "key_distance",
    "load_corpus",
    "passkey_windows",
    "sample_batch",
    "stdlib_files",
    "validation_windows",
]

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
# The passkey: KEY_DIGITS distinct random digits between STX and ETX, stated once in the filler; the query
# is STX again and the answer the digits. Neither control byte occurs in Python source (and filler is
# scrubbed of them), so the key is stated exactly once and the query can only be matched against it.
KEY_OPEN, KEY_CLOSE = 0x02, 0x03
KEY_DIGITS = 5
# Bytes of a passkey window that are not filler: statement (STX, digits, ETX), query (STX) and answer.
_PASSKEY_OVERHEAD = (KEY_DIGITS + 2) + 1 + KEY_DIGITS


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
        check_int(name, value)
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


def key_distance(length: int, depth: float) -> int:
    """How far before the query the key sits in a :func:`passkey_windows` window of ``length`` input bytes at
    ``depth``: the query's position minus the key's first digit's, the relative distance the first answer
    byte must attend across. A model trained on windows of L has seen distances 0 .. L - 1 only.

    Raises:
        ValueError: for a length too short for a passkey window or a depth outside [0, 1].
    """
    filler_len = (
        check_int("length", length, minimum=_PASSKEY_OVERHEAD, expected=f"an integer >= {_PASSKEY_OVERHEAD}")
        + 1
        - _PASSKEY_OVERHEAD
    )
    if isinstance(depth, bool) or not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth: expected a number in [0, 1], got {depth!r}")
    # The window is filler[:p] STX key ETX filler[p:] STX key: the first digit at p + 1, the query STX at
    # length - KEY_DIGITS (the inputs drop the last answer byte).
    return length - KEY_DIGITS - (round(float(depth) * filler_len) + 1)


def passkey_windows(
    stream: torch.Tensor,
    n: int,
    length: int,
    generator: torch.Generator,
    depth: float | None = None,
    *,
    min_depth: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` passkey-retrieval windows of ``length + 1`` bytes (inputs plus next-byte targets, as
    :func:`sample_batch`'s).

    Each is ``filler[:p] + STX + key + ETX + filler[p:] + STX + key``: the filler is a random run of real
    source text from ``stream``, the key :data:`KEY_DIGITS` distinct random ASCII digits, stated once; the
    final STX is the query and the last KEY_DIGITS bytes the answer. ``p`` is the depth times the filler's
    length: depth 0 puts the key at the start of the window, 1 right before the query.

    Args:
        stream: (m,) uint8 filler bytes.
        n: number of windows.
        length: input length.
        generator: draws the filler, keys and (when depth is None) depths.
        depth: where the key goes, in [0, 1]; None draws one per window, uniformly in [min_depth, 1].
        min_depth: the lower end of the drawn depths (the training curriculum starts keys near the query).

    Returns:
        tokens (n, length + 1) int64, and answers (n, length + 1) bool marking the answer bytes.

    Raises:
        ValueError: for a depth outside [0, 1], a length too short for filler, or a stream too short.
    """
    filler_len = length + 1 - _PASSKEY_OVERHEAD
    if filler_len < 1:
        raise ValueError(f"length: expected at least {_PASSKEY_OVERHEAD} for a passkey window, got {length}")
    for name, value in (("depth", 0.0 if depth is None else depth), ("min_depth", min_depth)):
        if isinstance(value, bool) or not 0.0 <= value <= 1.0:
            raise ValueError(f"{name}: expected a number in [0, 1], got {value!r}")
    if stream.numel() <= filler_len:
        raise ValueError(f"stream: expected more than {filler_len} bytes of filler, got {stream.numel()}")
    starts = torch.randint(0, stream.numel() - filler_len, (n,), generator=generator)
    filler = stream[starts[:, None] + torch.arange(filler_len)].long()  # (n, filler_len)
    # Scrub the key's delimiters from the filler (the stdlib has none; another corpus might).
    filler = filler.masked_fill((filler == KEY_OPEN) | (filler == KEY_CLOSE), ord(" "))
    # Distinct digits: "the digit after d" is then unambiguous within the key (docs/demo.md: with repeats
    # allowed, the keys with a repeated digit, about half of them, were the ones the models missed).
    keys = torch.rand(n, 10, generator=generator).argsort(1)[:, :KEY_DIGITS] + ord("0")  # (n, KEY_DIGITS)
    if depth is None:
        depths = min_depth + (1.0 - min_depth) * torch.rand(n, generator=generator, dtype=torch.float64)
    else:
        depths = torch.full((n,), float(depth), dtype=torch.float64)
    tokens = torch.empty(n, length + 1, dtype=torch.long)
    open_, close = torch.tensor([KEY_OPEN]), torch.tensor([KEY_CLOSE])
    for i in range(n):
        p = round(float(depths[i]) * filler_len)
        tokens[i] = torch.cat([filler[i, :p], open_, keys[i], close, filler[i, p:], open_, keys[i]])
    answers = torch.zeros(n, length + 1, dtype=torch.bool)
    answers[:, -KEY_DIGITS:] = True
    return tokens, answers
