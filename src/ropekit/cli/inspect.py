"""`ropekit inspect`: plan a context extension for one model, pair by pair, with optional plots."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from ropekit.cli.args import extension_factor, positive_int
from ropekit.schedules import EXTEND_METHODS, SCHEDULES


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="show what a RoPE scaling method does to each frequency pair of a model",
        description="MODEL is a preset name (see `ropekit presets`) or a Hugging Face config.json "
        "or its folder.",
    )
    p.add_argument("model", help="preset name, or path to config.json or the folder holding it")
    p.add_argument(
        "--target-length",
        type=positive_int,
        default=None,
        help="context length to plan for (default: training length x --factor, else the config's length)",
    )
    p.add_argument(
        "--method",
        action="append",
        default=[],
        help=f"scaling method to compare with the configured one (repeatable): {', '.join(EXTEND_METHODS)}, "
        "or another registered rope_type such as proportional",
    )
    p.add_argument(
        "--factor",
        type=extension_factor,
        default=None,
        help="extension factor for the --method methods (needs --method; default: target length / training "
        "length). The configured method keeps its own factor.",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra scaling key for the --method methods, value as JSON (beta_fast=16)",
    )
    p.add_argument("--layer-type", default=None, help="per-layer-type configs: which layer type to read")
    p.add_argument(
        "--layers",
        action="store_true",
        help="print every decoder layer's RoPE, window and temperature (ropekit.model_rope) instead",
    )
    p.add_argument("--plot", metavar="FILE.png", default=None, help="write wavelength / decay / q·k plots")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=run)


def _extra_keys(pairs: list[str]) -> dict:
    out = {}
    for item in pairs:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set: expected KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _load(model: str, layer_type: str | None):
    from ropekit.config import RopeConfig
    from ropekit.presets import PRESETS

    if model.lower() in PRESETS:
        if layer_type is not None:
            raise ValueError(
                f"--layer-type: {layer_type!r} selects a per-layer-type RoPE of a config.json, but "
                f"{model!r} is a preset with one RoPE for every layer"
            )
        return RopeConfig.preset(model), model.lower()
    if Path(model).exists():
        return RopeConfig.from_hf(model, layer_type=layer_type), model
    raise ValueError(
        f"model: {model!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a config.json path"
    )


PAIRING = {True: "interleaved (GPT-J)", False: "half (GPT-NeoX / HF)"}


def format_report(inspection) -> str:
    from ropekit.schedules import mrope_axis_of_pair

    c = inspection.config
    lines = [
        f"model: {inspection.model}   rope_type: {c.rope_type}   base: {c.base:g}   head_dim: {c.head_dim}   "
        f"rotary_dim: {c.rotary_dim}   pairing: {PAIRING[c.interleaved]}",
        f"training context: {inspection.original_length}   target length: {inspection.target_length}",
    ]
    if c.mrope_section is not None:  # M-RoPE, Bailing, XD-RoPE, axial: which position axis each pair follows
        axis = mrope_axis_of_pair(c.mrope_section, c.mrope_layout).tolist()
        lines.append(
            f"position axes: {len(c.mrope_section)}   sections (pairs): {list(c.mrope_section)}   layout: "
            f"{c.mrope_layout}   axis of each pair: {''.join(str(a) for a in axis)}"
        )
    lines.append("")
    names = [m.name for m in inspection.methods]
    width = max(14, *(len(n) for n in names))
    head = f"{'pair':>4}  {'theta':>10}  {'wavelength':>11}  {'rotations':>10}  " + "  ".join(
        f"{n:<{width}}" for n in names
    )
    lines += [head, "-" * len(head)]
    for i, (t, w, r) in enumerate(
        zip(inspection.theta, inspection.wavelength, inspection.rotations, strict=True)
    ):
        wl = f"{w:11.4g}" if math.isfinite(w) else f"{'inf':>11}"
        cells = []
        for m in inspection.methods:
            effect = m.effect[i]
            if effect == "in between" or effect == "extrapolated":
                effect += f" (x{m.ratio[i]:.3g})"
            cells.append(f"{effect:<{width}}")
        lines.append(f"{i:>4}  {t:10.4g}  {wl}  {r:10.4g}  " + "  ".join(cells))
    lines.append("")
    lines += [f"{m.name}: attention scaling {m.attention_scaling:.6g}" for m in inspection.methods]
    lines.append("")
    lines += [f"* {s}" for s in inspection.summary()]
    return "\n".join(lines)


def format_layers(runs: list[dict]) -> str:
    lines = []
    for run in runs:
        where = (
            f"layer {run['first']}" if run["first"] == run["last"] else f"layers {run['first']}-{run['last']}"
        )
        rope = run["rope"]
        text = (
            "no RoPE"
            if rope is None
            else (
                f"{rope['rope_type']} base {rope['base']:g}, {rope['rotary_dim']} of {rope['head_dim']} "
                f"features ({rope['rotary_position']}), {PAIRING[rope['interleaved']]}"
            )
        )
        extra = [f"window {run['sliding_window']}"] if run["sliding_window"] else []
        extra += [f"chunk {run['attention_chunk_size']}"] if run["attention_chunk_size"] else []
        extra += ["query temperature"] if run["temperature"] else []
        kind = f" [{run['layer_type']}]" if run["layer_type"] else ""
        lines.append(f"{where}{kind}: {text}" + (f"; {', '.join(extra)}" if extra else ""))
    return "\n".join(lines)


def _layers(args: argparse.Namespace) -> int:
    from ropekit.presets import PRESETS
    from ropekit.tools.inspect import layer_plan

    if args.method or args.factor is not None or args.set or args.plot or args.layer_type:
        raise ValueError(
            "--layers: shows the model as published; it takes no --method, --factor, --set, "
            "--plot or --layer-type"
        )
    source = PRESETS[args.model.lower()].config if args.model.lower() in PRESETS else args.model
    if source is args.model and not Path(args.model).exists():
        raise ValueError(f"model: {args.model!r} is neither a preset nor a config.json path")
    runs = layer_plan(source)
    print(json.dumps(runs, indent=2) if args.json else format_layers(runs))
    return 0


def run(args: argparse.Namespace) -> int:
    from ropekit.tools.inspect import inspect_config, plot_inspection

    if args.layers:
        return _layers(args)
    if not args.method and (args.factor is not None or args.set):
        flag, value = ("--factor", args.factor) if args.factor is not None else ("--set", args.set[0])
        raise ValueError(
            f"{flag}: {value!r} applies to the --method methods, but no --method was given; add one "
            "(e.g. --method yarn), or use --target-length alone to see the configured method there"
        )
    for method in args.method:
        if method not in SCHEDULES and method not in EXTEND_METHODS:
            known = sorted(set(SCHEDULES) | set(EXTEND_METHODS))
            raise ValueError(f"--method: unknown method {method!r}; expected one of {known}")
    if args.plot is not None and not Path(args.plot).resolve().parent.is_dir():
        raise ValueError(
            f"--plot: {args.plot!r}: folder {str(Path(args.plot).resolve().parent)!r} does not exist"
        )
    config, name = _load(args.model, args.layer_type)
    inspection = inspect_config(
        config,
        model=name,
        target_length=args.target_length,
        methods=args.method,
        factor=args.factor,
        extra=_extra_keys(args.set),
    )
    if args.plot:
        try:
            plot_inspection(inspection, args.plot)
        except ValueError as err:
            raise ValueError(f"--plot: {args.plot!r}: " + str(err).removeprefix("path: ")) from None
        except ImportError:
            print(
                "ropekit inspect: --plot needs matplotlib, an optional extra: pip install 'ropekit[plot]'",
                file=sys.stderr,
            )
            return 3
    if args.json:
        report = inspection.as_dict()
        if args.plot:
            report["plot"] = args.plot
        print(json.dumps(report, indent=2))
    else:
        print(format_report(inspection))
        if args.plot:
            print(f"\nplots written to {args.plot}")
    return 0
