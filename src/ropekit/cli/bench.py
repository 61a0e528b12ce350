"""`ropekit bench`: time every ropekit backend and installed peer against a copy of the same bytes."""

from __future__ import annotations

import argparse
import sys

DEFAULT_SHAPES = ["prefill-4k", "prefill-16k", "decode", "decode-1", "varlen"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark RoPE backends and peers against a copy of the same bytes")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where to run (default cpu)")
    p.add_argument(
        "--shapes", nargs="+", default=DEFAULT_SHAPES, metavar="SHAPE",
        help=f"shapes to run (default: {' '.join(DEFAULT_SHAPES)}; also tiny, tiny-varlen)",
    )  # fmt: skip
    p.add_argument(
        "--dtype", default=None, help="float32, float16 or bfloat16 (default: float32 on cpu, bf16 on cuda)"
    )
    p.add_argument(
        "--repeats", type=int, default=5, help="interleaved rounds; figures are medians (default 5)"
    )
    p.add_argument(
        "--min-run-time", type=float, default=None, metavar="SECONDS",
        help="seconds of calls per row per round (torch.utils.benchmark's blocked_autorange; default 0.1)",
    )  # fmt: skip
    p.add_argument(
        "--rows", nargs="+", default=None, metavar="NAME", help="keep only rows whose name contains one"
    )
    p.add_argument("--no-memory", action="store_true", help="skip the saved/peak memory pass")
    p.add_argument("--csv", default=None, metavar="FILE", help="also write the results as CSV")
    p.add_argument(
        "--plot", default=None, metavar="FILE", help="also draw forward time / copy_ as a bar chart"
    )
    p.add_argument(
        "--roofline", action="store_true",
        help="time nothing: print the bytes each row moves and its predicted time at --gpu's HBM bandwidth",
    )  # fmt: skip
    p.add_argument(
        "--gpu", choices=["a100", "h100", "h200", "b200"], default="h100",
        help="the GPU whose published bandwidth --roofline uses (default h100)",
    )  # fmt: skip
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.roofline:
        return _roofline(args)
    from ropekit.tools import bench

    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    min_run_time = bench.MIN_RUN_TIME_S if args.min_run_time is None else args.min_run_time
    records, notes = bench.run_benchmark(
        args.shapes, device=args.device, dtype=dtype, repeats=args.repeats, include=args.rows,
        memory=not args.no_memory, min_run_time=min_run_time,
        log=lambda msg: print(msg, file=sys.stderr, flush=True),
    )  # fmt: skip
    print(
        f"ropekit bench: device={args.device} dtype={dtype} repeats={args.repeats} "
        f"min_run_time={min_run_time:g}s (medians of torch.utils.benchmark blocked_autorange)"
    )
    print(bench.format_table(records))
    for note in notes:
        print(f"note: {note}")
    if args.csv:
        bench.write_csv(records, args.csv)
        print(f"wrote {args.csv}")
    if args.plot:
        bench.plot(records, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _roofline(args: argparse.Namespace) -> int:
    import torch

    from ropekit.tools import roofline

    dtype = getattr(torch, args.dtype or "bfloat16")
    gpu = roofline.GPUS[args.gpu]
    print(roofline.format_roofline(roofline.roofline(args.shapes, dtype, gpu), dtype, gpu))
    return 0
