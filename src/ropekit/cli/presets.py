"""`ropekit presets`: list the embedded model RoPE facts and where they come from."""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("presets", help="list the built-in model presets (RopeConfig.preset(name))")
    p.add_argument("name", nargs="?", default=None, help="show one preset in full")
    p.add_argument("--json", action="store_true", help="print as JSON")
    p.set_defaults(run=run)


def _row(name: str) -> dict:
    from ropekit.config import RopeConfig
    from ropekit.presets import get_preset

    preset, config = get_preset(name), RopeConfig.preset(name)
    return {
        "name": preset.name,
        "model": preset.model,
        "head_dim": config.head_dim,
        "rotary_dim": config.rotary_dim,
        "base": config.base,
        "rope_type": config.rope_type,
        "interleaved": config.interleaved,
        "max_position_embeddings": config.max_position_embeddings,
        "scaling": None if config.scaling is None else config.scaling.to_dict(),
        "source": preset.source,
        "note": preset.note,
    }


def run(args: argparse.Namespace) -> int:
    from ropekit.presets import PRESETS

    rows = [_row(args.name)] if args.name else [_row(n) for n in PRESETS]
    if args.json:
        print(json.dumps(rows if args.name is None else rows[0], indent=2))
        return 0
    if args.name:
        for key, value in rows[0].items():
            print(f"{key:>24}: {value}")
        return 0
    width = max(16, *(len(r["name"]) for r in rows))  # the longest preset name sets the first column
    kind = max(9, *(len(r["rope_type"]) for r in rows))
    head = (
        f"{'name':<{width}} {'head_dim':>8} {'rotary':>6} {'base':>9} {'rope_type':<{kind}} {'pairing':<11} "
        f"{'max_pos':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        pairing = "interleaved" if r["interleaved"] else "half"
        print(
            f"{r['name']:<{width}} {r['head_dim']:>8} {r['rotary_dim']:>6} {r['base']:>9g} "
            f"{r['rope_type']:<{kind}} "
            f"{pairing:<11} {r['max_position_embeddings'] or '-':>7}"
        )
    print("\nsources: `ropekit presets NAME` shows each model's config.json citation")
    return 0
