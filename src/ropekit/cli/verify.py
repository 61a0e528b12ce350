"""`ropekit verify`: check numerically, for one configuration, every property of RoPE that docs/math.md
derives (RoFormer, Su et al. 2021), and the production backends in float32 and bfloat16 against the float64
reference."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ropekit.tools.verify import Check


# --framework NAME: the module and function that give its rows (the theorem checks, then the framework's)
FRAMEWORKS = {
    "jax": ("ropekit.tools.verify_jax", "run_jax_checks"),
    "mlx": ("ropekit.tools.verify_mlx", "run_mlx_checks"),
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="numerically verify RoPE's properties and the textbook examples")
    p.add_argument("--head-dim", type=int, default=128, help="head width (default 128)")
    p.add_argument("--base", type=float, default=10000.0, help="RoPE base (default 10000)")
    p.add_argument("--rotary-dim", type=int, default=None, help="rotated features (default: head dim)")
    p.add_argument("--interleaved", action="store_true", help="GPT-J / Meta pairing (2i, 2i+1)")
    p.add_argument(
        "--backends", nargs="+", default=None, metavar="NAME",
        help="backends to check in float32 and bfloat16 against the float64 reference (default: those "
        "available here; 'triton' without a GPU runs in Triton's CPU interpreter)",
    )  # fmt: skip
    p.add_argument(
        "--compile-only", action="store_true",
        help="with --backends triton: compile the kernels for sm_80/90/100 and check their machine code "
        "instead of running them (no GPU needed)",
    )  # fmt: skip
    p.add_argument(
        "--framework", choices=("torch", *FRAMEWORKS), default="torch",
        help="where the backend rows run: torch (the backends above, default), jax (ropekit.jax, needs the "
        "[jax] extra) or mlx (ropekit.mlx, needs the [mlx] extra); jax's or mlx's rows replace the torch "
        "backends",
    )  # fmt: skip
    p.add_argument(
        "--numerics", choices=("exact", "hf", "vllm"), default="exact",
        help="the backends' arithmetic: exact (default: against the float64 reference), or hf / vllm: each "
        "backend that serves it against the peer's own torch expression, bit for bit, in float32, "
        "bfloat16 and float16",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help='print {"checks": [...]} as JSON')
    p.set_defaults(run=run)


def format_table(checks: Sequence[Check]) -> str:
    """The checks as an aligned text table with a PASS/FAIL column and a summary line."""
    width = max(len(c.name) for c in checks)
    lines = [f"{'check':<{width}}  {'max error':>10}  {'tolerance':>9}  result", "-" * (width + 32)]
    for c in checks:
        verdict = "PASS" if c.passed else "FAIL"
        lines.append(f"{c.name:<{width}}  {c.max_error:>10.2e}  {c.tolerance:>9.1e}  {verdict}")
    failed = sum(not c.passed for c in checks)
    lines.append(f"{len(checks) - failed} passed, {failed} failed")
    return "\n".join(lines)


def _use_triton_interpreter_without_a_gpu(backends: list[str] | None, compile_only: bool = False) -> None:
    """`--backends triton` on a machine without CUDA: run the kernel in Triton's CPU interpreter, which Triton
    reads from TRITON_INTERPRET when it is first imported."""
    import torch

    if not backends or "triton" not in backends or torch.cuda.is_available():
        return
    if compile_only:  # compiling needs Triton's JIT: the interpreter must stay off
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            raise ValueError("compile_only: expected TRITON_INTERPRET unset (compiling needs Triton's JIT)")
        return
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise ValueError(
            "backends: 'triton' without a GPU needs Triton's interpreter, and Triton was already imported "
            "without it; run with TRITON_INTERPRET=1 set"
        )
    os.environ["TRITON_INTERPRET"] = "1"


def run(args: argparse.Namespace) -> int:
    from ropekit.config import RopeConfig
    from ropekit.tools.verify import run_checks, triton_compile_checks, triton_mode

    config = RopeConfig(args.head_dim, args.base, rotary_dim=args.rotary_dim, interleaved=args.interleaved)
    if args.framework in FRAMEWORKS:
        if args.backends or args.compile_only:
            raise ValueError(
                "framework: --backends and --compile-only pick torch backends; drop them for "
                f"{args.framework!r}"
            )
        import importlib

        module, function = FRAMEWORKS[args.framework]
        return _print(getattr(importlib.import_module(module), function)(config), args.json, config, None)
    triton = bool(args.backends) and "triton" in args.backends
    if args.compile_only and not triton:
        raise ValueError("compile_only: expected --backends to include 'triton', the kernel it compiles")
    compile_only = args.compile_only
    _use_triton_interpreter_without_a_gpu(args.backends, compile_only)
    backends = [b for b in args.backends if b != "triton"] if compile_only else args.backends
    checks = run_checks(config, backends=backends, numerics=args.numerics)
    if compile_only:
        checks += triton_compile_checks(config)
    mode = triton_mode(compile_only) if triton else None
    return _print(checks, args.json, config, mode)


def _print(checks: list[Check], as_json: bool, config, mode: str | None) -> int:
    from ropekit.tools.verify import TRITON_MODES

    if as_json:
        out = {"checks": [c.as_dict() for c in checks]}
        if mode:
            out["triton_mode"] = {"mode": mode, "proves": TRITON_MODES[mode]}
        print(json.dumps(out, indent=2))
    else:
        if mode:
            print(f"triton: {mode}: {TRITON_MODES[mode]}")
        pairing = "interleaved (GPT-J / Meta)" if config.interleaved else "half (GPT-NeoX / HF)"
        print(
            f"ropekit verify: head_dim={config.head_dim} base={config.base:g} "
            f"rotary_dim={config.rotary_dim} pairing={pairing}"
        )
        print(format_table(checks))
    return 0 if all(c.passed for c in checks) else 1
