"""The `ropekit` command: one module per subcommand, each with ``add_parser(sub)`` and ``run(args)``."""

from __future__ import annotations

import argparse
import importlib
import sys

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
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return int(args.run(args) or 0)
    except ValueError as err:  # bad user input: a message, not a traceback
        print(f"ropekit {args.command}: error: {err}", file=sys.stderr)
        return 2
