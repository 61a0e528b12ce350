"""The `ropekit` command: one module per subcommand, each with ``add_parser(sub)`` and ``run(args)``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# POSIX's SIGPIPE number (13); the signal module has no SIGPIPE on Windows.
SIGPIPE = 13

__all__ = ["main"]

# Subcommand name -> module under ropekit.cli. Imported lazily so `ropekit verify` never pays for matplotlib.
SUBCOMMANDS = {
    "verify": "ropekit.cli.verify",
    "demo": "ropekit.cli.demo",
    "bench": "ropekit.cli.bench",
    "inspect": "ropekit.cli.inspect",
    "presets": "ropekit.cli.presets",
}


def build_parser() -> argparse.ArgumentParser:
    from ropekit import __version__

    parser = argparse.ArgumentParser(
        prog="ropekit", description="Rotary position embeddings: verify, inspect, bench, demo."
    )
    parser.add_argument("--version", action="version", version=f"ropekit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; returns the exit code.

    Misuse (a bad flag value, an unknown model, a plot path in a missing folder) is one line on stderr and
    exit code 2, never a traceback. A closed stdout (``ropekit presets --json | head``) ends the command
    quietly with 128 + SIGPIPE, as ``cat`` or ``grep`` do.
    """
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        code = int(args.run(args) or 0)
        sys.stdout.flush()  # a reader that left early shows up here, not at interpreter exit
        return code
    except BrokenPipeError:
        # Point stdout at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + SIGPIPE
    except ValueError as err:  # bad user input: a message, not a traceback
        print(f"ropekit {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ropekit {args.command}: interrupted", file=sys.stderr)
        return 130
