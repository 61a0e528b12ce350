"""`ropekit demo`: train nope / sinusoidal / rope byte-level models and report how they extrapolate.

Runs on one process, or under ``torchrun --nproc-per-node N -m ropekit demo`` with DistributedDataParallel.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from ropekit.cli.args import positive_int


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="train small models and report how RoPE extrapolates, with and without scaling"
    )
    p.add_argument(
        "--out", type=Path, default=Path("ropekit-report"), help="output folder (default ./ropekit-report)"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smaller, faster run (well under a minute of CPU; for tests and CI)",
    )
    p.add_argument(
        "--finetune",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fine-tune PI and YaRN briefly at 2L (default on; --no-finetune skips it)",
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=None,
        help="train and evaluate this many seeds (seed, seed + 1, ...) and report the spread (default 1)",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to train (default cpu)")
    p.add_argument("--train-length", type=positive_int, default=None, help="training length L in bytes")
    p.add_argument("--steps", type=positive_int, default=None, help="training steps per variant")
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        help="global batch (windows per step, split over ranks)",
    )
    p.add_argument("--variants", default=None, help="comma-separated subset of nope,sinusoidal,rope")
    p.add_argument(
        "--seed", type=int, default=None, help="seed for initialisation and batch order (default 0)"
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="seeds trained at once, each in its own process (default: one per core)",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch threads per process (default 1; a 4+ core share if any)",
    )
    p.add_argument(
        "--train-only", action="store_true", help="skip evaluation and plots; write the training losses"
    )
    p.add_argument(
        "--report-only",
        type=Path,
        default=None,
        metavar="DIR",
        help="train nothing: rewrite DIR/report.md and the plots from DIR/results.json",
    )
    p.set_defaults(run=run)


def settings_from_args(args: argparse.Namespace):
    """DemoSettings for the parsed flags: the preset (default or --quick), then each flag given."""
    from ropekit.tools.demo import QUICK, DemoSettings

    settings = QUICK if args.quick else DemoSettings()
    overrides = {"device": args.device, "evaluate": not args.train_only}
    for name in ("train_length", "steps", "batch_size", "seed", "seeds", "jobs", "threads", "finetune"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    if args.variants is not None:
        overrides["variants"] = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    return replace(settings, **overrides)


def run(args: argparse.Namespace) -> int:
    from ropekit.tools.demo import rewrite_report, run_demo

    if args.report_only is not None:
        return rewrite_report(args.report_only)
    return run_demo(settings_from_args(args), args.out)
