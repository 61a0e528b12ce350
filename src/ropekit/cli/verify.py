"""`ropekit verify`: check every claim of the seed documents numerically for one configuration."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ropekit.tools.verify import Check


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="numerically verify RoPE's properties and the textbook examples")
    p.add_argument("--head-dim", type=int, default=128, help="head width (default 128)")
    p.add_argument("--base", type=float, default=10000.0, help="RoPE base (default 10000)")
    p.add_argument("--rotary-dim", type=int, default=None, help="rotated features (default: head dim)")
    p.add_argument("--interleaved", action="store_true", help="GPT-J / Meta pairing (2i, 2i+1)")
    p.add_argument("--json", action="store_true", help='print {"checks": [...]} as JSON')
    p.set_defaults(run=run)


def format_table(checks: Sequence[Check]) -> str:
    """The checks as an aligned text table with a PASS/FAIL column and a summary line."""
    width = max(len(c.name) for c in checks)
    lines = [f"{'check':<{width}}  {'max error':>10}  {'tolerance':>9}  result", "-" * (width + 32)]
    for c in checks:
        verdict = "PASS" if c.passed else "FAIL"
        lines.append(f"{c.name:<{width}}  {c.max_error:>10.2e}  {c.tolerance:>9.0e}  {verdict}")
    failed = sum(not c.passed for c in checks)
    lines.append(f"{len(checks) - failed} passed, {failed} failed")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from ropekit.config import RopeConfig
    from ropekit.tools.verify import run_checks

    config = RopeConfig(args.head_dim, args.base, rotary_dim=args.rotary_dim, interleaved=args.interleaved)
    checks = run_checks(config)
    if args.json:
        print(json.dumps({"checks": [c.as_dict() for c in checks]}, indent=2))
    else:
        pairing = "interleaved (GPT-J / Meta)" if config.interleaved else "half (GPT-NeoX / HF)"
        print(
            f"ropekit verify: head_dim={config.head_dim} base={config.base:g} "
            f"rotary_dim={config.rotary_dim} pairing={pairing}"
        )
        print(format_table(checks))
    return 0 if all(c.passed for c in checks) else 1
