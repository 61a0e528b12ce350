"""The demo's outputs: results.json, report.md's tables and sections, and the one-screen summary.

Everything here reads finished numbers; nothing trains. The sentences come from findings.py, the plots from
plots.py.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ropekit.config import RopeConfig
from ropekit.schedules import extension_scaling
from ropekit.schedules.yarn import BETA_FAST, BETA_SLOW
from ropekit.tools.demo.data import KEY_DIGITS, key_distance
from ropekit.tools.demo.findings import agree, before_L, opening, percent, span, split_by_distance
from ropekit.validation import check_int

__all__ = [
    "BASE_METHODS",
    "attention_by_distance",
    "format_distance_table",
    "format_retrieval_table",
    "format_table",
    "read_results",
    "report_sections",
    "retrieval_row",
    "wilson_interval",
    "write_report",
    "write_results",
]

BASE_METHODS = ("nope", "sinusoidal", "rope")


def attention_by_distance(maps: Sequence[torch.Tensor]) -> np.ndarray:
    """Mean attention probability a query gives the key r positions back, for r = 0 .. S-1.

    Args:
        maps: per-layer causal attention probabilities, each (B, H, S, S).

    Returns:
        (S,) float64: averaged over layers, batch, heads and every query that has a key at distance r.
    """
    mean_map = torch.stack([m.double().mean(dim=(0, 1)) for m in maps]).mean(0)  # (S, S)
    seq = mean_map.shape[0]
    return np.array([float(torch.diagonal(mean_map, offset=-r).mean()) for r in range(seq)])


def wilson_interval(successes: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """Wilson's score interval for a binomial proportion (Wilson 1927); z = 1.96 gives 95%.

    Unlike the normal approximation it stays inside [0, 1] and is not empty at 0 or n successes, which is
    where retrieval accuracies sit.

    Raises:
        ValueError: for n < 1 or successes outside [0, n].
    """
    n = check_int("n", n)
    check_int("successes", successes, minimum=0, maximum=n, expected=f"an integer in [0, {n}]")
    p = successes / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    # At 0 and n successes one end is exactly 0 or 1; rounding would leave it a hair inside.
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


def retrieval_row(
    method: str,
    length: int,
    depth: float | None,
    correct: int,
    n: int,
    *,
    correct_by_seed: Sequence[int] | None = None,
    n_by_seed: Sequence[int] | None = None,
) -> dict:
    """One ``retrieval`` entry of results.json: ``correct`` of ``n``, its Wilson interval, the key's distance
    from the query (for a depth), and each seed's count when given."""
    low, high = wilson_interval(correct, n)
    row = {
        "method": method,
        "length": int(length),
        "depth": depth,
        "accuracy": correct / n,
        "n": n,
        "ci_low": low,
        "ci_high": high,
    }
    if depth is not None:
        row["distance"] = key_distance(int(length), depth)
    if correct_by_seed is not None:
        row["correct_by_seed"] = [int(k) for k in correct_by_seed]
        row["n_by_seed"] = [int(k) for k in n_by_seed]
    return row


def with_distances(retrieval: list[dict]) -> list[dict]:
    """The rows with their key distance (results.json from before distances were stored lack it)."""
    return [
        r
        if "distance" in r or r["depth"] is None
        else {**r, "distance": key_distance(r["length"], r["depth"])}
        for r in retrieval
    ]


def seed_accuracies(row: dict) -> list[float]:
    """Each seed's accuracy in a retrieval row ([] when the row does not carry them)."""
    return [k / n for k, n in zip(row.get("correct_by_seed", []), row.get("n_by_seed", []), strict=True)]


# The spread across seeds is shown from this many seeds: with two, a range is just the two values.
SPREAD_FROM_SEEDS = 3


def pooled_row(rows: Sequence[dict], method: str, length: int | None) -> dict:
    """The cells pooled into one (depth None), each seed's counts summed."""
    k = sum(round(r["accuracy"] * r["n"]) for r in rows)
    n = sum(r["n"] for r in rows)
    seeds = [r.get("correct_by_seed") for r in rows]
    if all(seeds) and len({len(x) for x in seeds}) == 1:
        by_seed = [sum(x) for x in zip(*seeds, strict=True)]
        n_by_seed = [sum(x) for x in zip(*(r["n_by_seed"] for r in rows), strict=True)]
        return retrieval_row(method, length or 0, None, k, n, correct_by_seed=by_seed, n_by_seed=n_by_seed)
    return retrieval_row(method, length or 0, None, k, n)


def pool_depths(retrieval: list[dict]) -> list[dict]:
    """Per (method, length): the rows of every depth pooled into one (depth None), with ``agree`` saying
    whether the depths' intervals overlap (only then does the pooled figure describe every depth)."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in retrieval:
        groups.setdefault((r["method"], r["length"]), []).append(r)
    return [
        {**pooled_row(rows, m, n), "agree": agree(rows), "by_depth": [r["accuracy"] for r in rows]}
        for (m, n), rows in groups.items()
    ]


def accuracy_cell(row: dict) -> str:
    """ "74% [69%, 79%]", and with SPREAD_FROM_SEEDS or more seeds ", seeds 60-85%"."""
    text = f"{percent(row['accuracy'])} [{percent(row['ci_low'])}, {percent(row['ci_high'])}]"
    seeds = seed_accuracies(row)
    if len(seeds) >= SPREAD_FROM_SEEDS:
        text += f", seeds {span(seeds)}"
    return text


def _lengths_and_methods(results: list[dict]) -> tuple[list[int], list[str]]:
    lengths = sorted({r["length"] for r in results})
    methods = list(dict.fromkeys(r["method"] for r in results))
    return lengths, methods


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _plain(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(values: list[str]) -> str:
        return "  ".join(
            v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths, strict=True))
        )

    first = line(header)
    return "\n".join([first, "-" * len(first), *(line(row) for row in rows)])


def _length_names(lengths: list[int], train_length: int) -> list[str]:
    return [f"{n} ({n / train_length:g}L)" for n in lengths]


def format_table(results: list[dict], train_length: int, *, markdown: bool = False) -> str:
    """Perplexity per method (rows) and evaluation length (columns); "mean ± std" over seeds when known."""
    lengths, methods = _lengths_and_methods(results)
    cell = {}
    for r in results:
        std = r.get("perplexity_std")
        cell[r["method"], r["length"]] = f"{r['perplexity']:.3f}" + (f" ± {std:.3f}" if std else "")
    rows = [[m] + [cell.get((m, n), "-") for n in lengths] for m in methods]
    header = ["method", *_length_names(lengths, train_length)]
    return _markdown(header, rows) if markdown else _plain(header, rows)


def format_retrieval_table(retrieval: list[dict], train_length: int, *, markdown: bool = False) -> str:
    """Exact-match retrieval per method and length: pooled over depths ("accuracy [95% Wilson interval]")
    where the depths agree, else the depths' range, marked "by depth"."""
    pooled = pool_depths(retrieval)
    lengths, methods = _lengths_and_methods(pooled)
    cell = {
        (r["method"], r["length"]): accuracy_cell(r) if r["agree"] else f"{span(r['by_depth'])} by depth"
        for r in pooled
    }
    rows = [[m] + [cell.get((m, n), "-") for n in lengths] for m in methods]
    header = ["method", *_length_names(lengths, train_length)]
    return _markdown(header, rows) if markdown else _plain(header, rows)


def format_distance_table(retrieval: list[dict], train_length: int) -> str:
    """Markdown: per method, keys within L (pooled over every such cell where they agree, else their range),
    then each cell with the key L or more back, by distance."""
    L = train_length
    far = sorted({(r["distance"], r["length"]) for r in retrieval if r["distance"] >= L})
    header = ["method", "within L (all such cells)"]
    header += [f"{d / L:.1f}L back ({d} B, {n / L:g}L window)" for d, n in far]
    rows = []
    for m in dict.fromkeys(r["method"] for r in retrieval):
        within, beyond = split_by_distance(retrieval, m, L)
        if not within:
            first = "-"
        elif agree(within):
            first = accuracy_cell(pooled_row(within, m, None)) + f" ({len(within)} cells)"
        else:
            first = f"{span([r['accuracy'] for r in within])} ({len(within)} cells disagree)"
        cells = {(r["distance"], r["length"]): accuracy_cell(r) for r in beyond}
        rows.append([m, first] + [cells.get(key, "-") for key in far])
    return _markdown(header, rows)


def format_depth_table(retrieval: list[dict], train_length: int) -> str:
    """Markdown: accuracy per method (rows) and (length, depth) (columns), with each key's distance."""
    keys = sorted({(r["length"], r["depth"]) for r in retrieval})
    methods = list(dict.fromkeys(r["method"] for r in retrieval))
    value = {(r["method"], r["length"], r["depth"]): percent(r["accuracy"]) for r in retrieval}
    header = ["method", *(f"{n / train_length:g}L @ {d:g} ({key_distance(n, d)} B)" for n, d in keys)]
    return _markdown(header, [[m] + [value.get((m, n, d), "-") for n, d in keys] for m in methods])


def write_results(path: Path, train_length: int, results: list[dict], extra: dict[str, Any]) -> None:
    """results.json: ``{"train_length": L, "results": [{"method", "length", "perplexity"}, ...]}`` + extra.

    Each results row keeps any spread fields it carries (perplexity_std, perplexity_by_seed).
    """
    clash = set(extra) & {"train_length", "results"}
    if clash:
        raise ValueError(f"extra: expected keys other than {sorted(clash)}, got {sorted(extra)}")
    rows = [
        {**r, "method": r["method"], "length": int(r["length"]), "perplexity": float(r["perplexity"])}
        for r in results
    ]
    path.write_text(
        json.dumps({"train_length": int(train_length), "results": rows, **extra}, indent=2) + "\n"
    )


def read_results(path: Path) -> dict[str, Any]:
    """A results.json as written by :func:`write_results` (retrieval rows given their distances).

    Raises:
        ValueError: when the file is missing or lacks train_length, results or settings.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"results: expected a results.json written by `ropekit demo`, found no file {str(path)!r}"
        )
    data = json.loads(path.read_text())
    missing = [k for k in ("train_length", "results", "settings") if k not in data]
    if missing:
        raise ValueError(f"results: {str(path)!r} lacks {missing}; expected a results.json of `ropekit demo`")
    data["retrieval"] = with_distances(data.get("retrieval", []))
    return data


def ratio(a: float, b: float) -> str:
    """'x1.23' style ratio, robust to inf."""
    return "x" + (f"{a / b:.2f}" if math.isfinite(a) and b > 0 else "inf")


def _value(results: list[dict], method: str, length: int) -> float | None:
    for r in results:
        if r["method"] == method and r["length"] == length:
            return r["perplexity"]
    return None


def rotations_by_window(settings) -> dict[str, tuple[str, str]]:
    """Per rope method: how the rotation is set in the longest windows and in windows of L (the two the
    loss-by-position comparison subtracts), as the run sets them (run.rope_config_for)."""
    longest = max(settings.eval_multiples)
    out = {f"rope+{m}": (f"factor {longest:g}", "factor 1") for m in ("linear", "ntk", "yarn", "llama3")}
    out["rope+dynamic"] = (f"NTK base for {longest * settings.train_length} positions", "unscaled")
    if settings.finetune:
        f = f"factor {settings.finetune_factor:g}"
        out.update({f"rope+{m}+finetune": (f, f) for m in ("linear", "yarn")})
    return out


def observations(results: list[dict], train_length: int) -> list[str]:
    """Plain sentences read off the perplexities (no judgement beyond the comparison each one states)."""
    L = train_length
    lengths, methods = _lengths_and_methods(results)
    longest = lengths[-1]
    n = f"{longest / L:g}"
    lines = []
    present = {m: v for m in BASE_METHODS if (v := _value(results, m, L)) is not None}
    if present:
        lines.append(
            "At the training length L: " + ", ".join(f"{m} {v:.3f}" for m, v in present.items()) + "."
        )
    for m in BASE_METHODS:
        a, b = _value(results, m, L), _value(results, m, longest)
        if a is not None and b is not None and longest != L:
            lines.append(f"{m} at {n}L: {b:.3f}, {ratio(b, a)} its perplexity at L.")
    base = _value(results, "rope", L)
    scaled = [m for m in methods if m.startswith("rope+")]
    if base is not None and scaled:
        at_long = sorted((v, m) for m in scaled if (v := _value(results, m, longest)) is not None)
        lines.append(
            f"With scaling, at {n}L (rope at L: {base:.3f}): "
            + ", ".join(f"{m} {v:.3f} ({ratio(v, base)})" for v, m in at_long)
            + "."
        )
        # Every inference-time schedule at factor 1 is the unscaled rotation: a free check of the plumbing.
        same = [m for m in scaled if "finetune" not in m and _value(results, m, L) is not None]
        if same:
            worst = max(abs(_value(results, m, L) / base - 1.0) for m in same)
            lines.append(
                f"Sanity check: at L every inference-time method uses factor 1 and should equal plain rope; "
                f"the largest relative difference is {worst:.1e}."
            )
    return lines


def caveats(settings, n_seeds: int) -> str:
    """What the run cannot show, with its own numbers."""
    if n_seeds >= SPREAD_FROM_SEEDS:
        spread = (
            f"{n_seeds} seeds: perplexities are mean ± standard deviation over seeds; accuracies pool the "
            "seeds' trials, and the tables give each seed's range beside the interval"
        )
    elif n_seeds > 1:
        spread = f"{n_seeds} seeds: too few for a spread (run with --seeds {SPREAD_FROM_SEEDS})"
    else:
        spread = (
            "one seed: there is no spread, so differences of a few percent may be noise "
            f"(run with --seeds {SPREAD_FROM_SEEDS})"
        )
    return f"""\
- Each model is tiny and trained for {settings.steps} steps; {spread}.
- Accuracy intervals are 95% Wilson intervals on the pooled trials; the trials of one seed share a model, so
  the intervals understate the seed-to-seed spread (results.json stores each seed's counts).
- Perplexity is per byte over every position of every window. A window of nL bytes holds the same bytes as n
  windows of L, so a model that used the extra context perfectly would score *lower* at longer lengths.
- The literature (PI, NTK-aware, YaRN papers, on LLaMA) expects plain rope to fail past L on passkey retrieval
  and to degrade in perplexity past 2-4L, and PI / YaRN to retrieve after a short fine-tune. Where this run
  disagrees, the opening says so and docs/demo.md records what was checked."""


def verify_section(checks, head_dim: int, base: float, ulps: list[dict]) -> str:
    """The ``ropekit verify`` table, then each backend's largest bfloat16 error in ulps of the output beside
    the bound there, so a row near its bound reads as what it is (correct rounding)."""
    failed = sum(not c.passed for c in checks)
    rows = "\n".join(
        f"| {c.name} | {c.max_error:.3g} | {c.tolerance:.0e} | {'PASS' if c.passed else 'FAIL'} |"
        for c in checks
    )
    text = (
        f"{len(checks) - failed} passed, {failed} failed (head_dim {head_dim}, base {base:g}).\n\n"
        "| check | max error | tolerance | result |\n|---|---:|---:|---|\n" + rows
    )
    if ulps:
        text += (
            "\n\nThe backend rows divide each element's error by its bound: half an ulp of the "
            "output dtype at "
            "the exact value (what rounding to nearest may cost) plus 8 float32 ulps of the largest "
            "input (the "
            "float32 arithmetic). In bfloat16 the first term is nearly all of the bound, so a "
            "correctly rounded "
            "output sits just under 1 and a store that truncates (up to a whole ulp) near 2. The same "
            "measurement in ulps of the bfloat16 output:\n\n"
            "| backend | layout | largest error (ulp) | bound there (ulp) | margin (ulp) "
            "|\n|---|---|---:|---:|---:|\n"
            + "\n".join(
                f"| {u['backend']} | {u['layout']} | {u['max_ulps']:.5f} | {u['bound_ulps']:.5f} | "
                f"{u['bound_ulps'] - u['max_ulps']:.5f} |"
                for u in ulps
            )
            + "\n\nAn error of at most 0.5 ulp is correct rounding, the best a bfloat16 output can hold; "
            "a hair over it comes from the float32 tables and arithmetic, which the second term of the "
            "bound covers."
        )
    return text


def bfloat16_ulp_errors(
    config: RopeConfig, *, seed: int = 0, n_positions: int = 64, max_position: int = 4096
) -> list[dict]:
    """Each available backend's largest bfloat16 error in ulps of the output, beside verify's bound there.

    The same measurement as ``ropekit verify``'s backend rows (random inputs rounded to bfloat16, rotated by
    the backend and by the float64 reference), read in ulps instead of as error / bound.
    """
    from ropekit import reference as ref
    from ropekit.functional import apply_rotary
    from ropekit.tools.verify import available_backends, backend_device, backend_error_bound

    rng = np.random.default_rng(seed)
    theta = ref.inv_freq(config.rotary_dim, config.base)
    positions = rng.integers(0, max_position, size=n_positions)
    x = torch.from_numpy(rng.standard_normal((1, n_positions, 3, config.head_dim))).to(torch.bfloat16)
    scale = float(x.double().abs().max())
    cos, sin = config.cos_sin(int(positions.max()) + 1)  # float32, as in production
    info = torch.finfo(torch.bfloat16)
    rows = []
    for name in available_backends():
        device = backend_device(name)
        pos = torch.from_numpy(positions).reshape(1, n_positions).to(device)  # (batch, seq)
        for interleaved, layout in ((False, "half"), (True, "interleaved")):
            rotate = ref.rotate_interleaved if interleaved else ref.rotate_half
            want = rotate(x.double().numpy(), positions[None, :, None], theta)
            got = (
                apply_rotary(
                    x.to(device),
                    cos.to(device),
                    sin.to(device),
                    positions=pos,
                    interleaved=interleaved,
                    backend=name,
                )
                .double()
                .cpu()
                .numpy()
            )
            ulp = info.eps * 2.0 ** np.floor(np.log2(np.maximum(np.abs(want), info.tiny)))
            error = np.abs(got - want) / ulp
            worst = int(np.argmax(error))
            bound = backend_error_bound(want, torch.bfloat16, scale).flat[worst] / ulp.flat[worst]
            rows.append(
                {
                    "backend": name,
                    "layout": layout,
                    "max_ulps": float(error.flat[worst]),
                    "bound_ulps": float(bound),
                }
            )
    return rows


def write_report(path: Path, sections: dict[str, str]) -> None:
    """report.md from titled sections, in order."""
    text = "\n\n".join(
        f"## {title}\n\n{body.strip()}" if title else body.strip() for title, body in sections.items()
    )
    path.write_text(text + "\n")


def report_sections(
    settings, results: list[dict], retrieval: list[dict], extra: dict, checks, ulps: list[dict] | None = None
) -> dict[str, str]:
    """The titled sections of report.md, in order; every number comes from the run's settings and results."""
    L = settings.train_length
    head_dim = settings.dim // settings.n_heads
    multiples = ", ".join(f"{m:g}" for m in settings.eval_multiples)
    longest = max(settings.eval_multiples)
    machine = extra["machine"]
    processes = f"{extra['world_size']} process" + ("es" if extra["world_size"] != 1 else "")
    threads = f"{machine['threads']} thread" + ("s" if machine["threads"] != 1 else "")
    if extra.get("seed_processes", 1) > 1:
        processes += (
            f" (its {len(extra['seeds'])} seeds in {extra['seed_processes']} parallel worker processes)"
        )
    finals = ", ".join(f"{k} {v:.3f}" for k, v in extra["final_train_loss"].items())
    seeds = ", ".join(str(x) for x in extra["seeds"])
    n_seeds = len(extra["seeds"])
    lengths = sorted({r["length"] for r in results})
    sections = {"": "# ropekit demo report\n\n" + opening(results, retrieval, L)}
    sections["The run"] = (
        f"Byte-level decoders trained at L = {L} on the Python standard library, "
        f"{100 * settings.passkey_fraction:.0f}% of the training windows passkey examples; seeds {seeds}; "
        f"evaluated at {', '.join(str(n) for n in lengths)} bytes."
    )
    if retrieval:
        depths = ", ".join(f"{d:g}" for d in settings.retrieval_depths)
        seed_note = (
            f"; after the interval, the range of the {n_seeds} seeds' own accuracies"
            if n_seeds >= SPREAD_FROM_SEEDS
            else ""
        )
        sections["Passkey retrieval by distance"] = (
            f"A {KEY_DIGITS}-digit key, stated once among real source text at depth {depths} of the window "
            "(0 = start, 1 = just before the query), asked for at the end; exact match of the greedy answer, "
            f"{settings.retrieval_examples} trials per cell and seed. What matters for a position "
            "encoding is "
            "the key's *distance* from the query: a model trained on windows of L has seen distances 0 to "
            f"L - 1 = {L - 1} only. Within L, cells are pooled where their intervals agree; L or more back, "
            f"each cell is shown by distance. Accuracy with its 95% Wilson interval{seed_note}:\n\n"
            + format_distance_table(retrieval, L)
            + "\n\n![retrieval vs length](retrieval_vs_length.png)"
            + "\n\nBy window length, pooled over depths where the depths' intervals agree (else their "
            "range):\n\n"
            + format_retrieval_table(retrieval, L, markdown=True)
            + "\n\nBy depth (pooled over seeds), with the key's distance in bytes:\n\n"
            + format_depth_table(retrieval, L)
            + "\n\n![retrieval heat map](retrieval_heatmap.png)"
        )
    spread = " (mean ± std over seeds)" if n_seeds > 1 else ""
    sections[f"Validation perplexity per byte{spread}"] = (
        format_table(results, L, markdown=True) + "\n\n![perplexity vs length](perplexity_vs_length.png)"
    )
    sections["What the perplexities show"] = "\n".join(f"- {line}" for line in observations(results, L))
    extra_loss = extra.get("extra_loss_by_position", {})
    if extra_loss:
        tail = ", ".join(f"{m} {float(np.mean(v[-L:])):+.2f}" for m, v in extra_loss.items())
        sections["Loss by position"] = (
            "![loss vs position](loss_vs_position.png)\n\n"
            f"For each byte of the {longest * L}-byte windows: its loss minus the loss of the same "
            "byte predicted "
            "within a window of L by the same method (for a scaled method: the same schedule at the "
            "length L, "
            "i.e. factor 1), averaged over the chunks (and seeds). After L, below 0 means the longer context "
            "helped and above 0 that positions past L cost more than the context gave.\n\n"
            + "\n".join(f"- {line}" for line in before_L(extra_loss, L, rotations_by_window(settings)))
            + f"\n- Over the last L bytes: {tail} nats."
        )
    sections["What it does not show"] = caveats(settings, n_seeds)
    tuned = ""
    if settings.finetune:
        tuned = (
            f"\n- `+finetune`: the rope model tuned for {settings.finetune_steps} steps at "
            f"{settings.finetune_factor:g}L with factor {settings.finetune_factor:g} (same data mix), then "
            f"evaluated with factor {settings.finetune_factor:g} at every length."
        )
    llama3 = extension_scaling("llama3", longest, L)[0]  # as rope_config_for gives it
    sections["Scaling choices"] = f"""\
- linear (PI), ntk, yarn, llama3: factor = evaluation length / L ({multiples}), original context L = {L}.
- dynamic: HF's dynamic NTK with a fixed factor {settings.dynamic_factor:g}; it rescales by itself once the \
sequence exceeds L.
- yarn: beta_fast {BETA_FAST:g}, beta_slow {BETA_SLOW:g}, attention factor 0.1 ln(factor) + 1 (the \
schedule's defaults).
- llama3: low_freq_factor {llama3["low_freq_factor"]:g}, \
high_freq_factor {llama3["high_freq_factor"]:g}.{tuned}"""
    if "attention_by_distance" in extra:  # only when a rope model was trained
        long_note = ""
        if "attention_by_distance_long" in extra:
            long_note = f" and of length {longest:g}L (so the distances past L are the model extrapolating)"
        sections["Attention against relative distance"] = (
            "![attention vs distance](attention_vs_distance.png)\n\n"
            "Top: the trained rope model's (first seed) attention probability to the key r bytes back, "
            f"averaged over layers, heads and queries of validation windows of length L{long_note}. "
            "Bottom, on "
            "the same distances: RoFormer's long-term-decay bound (2/d) sum_j |S_j| for d = "
            f"{head_dim}, base "
            f"{settings.rope_base:g}. The bound is on the score's magnitude for constant q, k; learned "
            "attention need not follow it."
        )
    sections["ropekit verify"] = verify_section(checks, head_dim, settings.rope_base, ulps or [])
    sections["Machine and settings"] = f"""\
- {machine["device_name"]} ({machine["device"]}), {processes}, {threads} per process; \
{machine["cpu_count"]} CPUs visible; load average {machine.get("load", "n/a")} at the start
- {machine["platform"]}, Python {machine["python"]}, torch {machine["torch"]}
- model: dim {settings.dim}, {settings.n_layers} layers, {settings.n_heads} heads (head_dim {head_dim}), \
byte vocabulary, tied embeddings, rope base {settings.rope_base:g}
- training: {settings.steps} steps x {settings.batch_size} windows of {L} bytes \
({100 * settings.passkey_fraction:.0f}% passkey, the curriculum in docs/demo.md), \
AdamW lr {settings.lr:g}, seeds {seeds}; final training loss (first seed) {finals}
- corpus: {extra["corpus"]["train_files"]} train / {len(extra["corpus"]["validation_files"])} validation \
files from {extra["corpus"]["root"]} (split by file)
- evaluation: the same {settings.eval_chunks * longest * L} validation bytes at every length
- time: {", ".join(f"{k} {v:.0f} s" for k, v in extra["timings_s"].items())}"""
    return sections
