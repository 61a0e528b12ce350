"""argparse value types shared by the subcommands: a bad value becomes argparse's one-line usage error
(exit code 2) naming the flag and the value."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    """A positive integer (a length, a count)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def extension_factor(text: str) -> float:
    """A finite number >= 1 (a context-extension factor)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {text!r}") from None
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 1 (an extension), got {text!r}")
    return value
