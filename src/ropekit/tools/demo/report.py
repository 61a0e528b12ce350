"""The demo's outputs: results.json, report.md, the plots, and the one-screen summary.

Everything here reads finished numbers; nothing trains. matplotlib is imported inside the plotting functions.
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
from ropekit.tools.inspect import decay_bound

__all__ = [
    "attention_by_distance",
    "format_table",
    "plot_attention",
    "plot_perplexity",
    "plot_position_loss",
    "report_sections",
    "write_report",
    "write_results",
]


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


def _lengths_and_methods(results: list[dict]) -> tuple[list[int], list[str]]:
    lengths = sorted({r["length"] for r in results})
    methods = list(dict.fromkeys(r["method"] for r in results))
    return lengths, methods


def format_table(results: list[dict], train_length: int, *, markdown: bool = False) -> str:
    """Perplexity per method (rows) and evaluation length (columns)."""
    lengths, methods = _lengths_and_methods(results)
    value = {(r["method"], r["length"]): r["perplexity"] for r in results}
    names = [f"{n} ({n // train_length}L)" for n in lengths]
    rows = [[m] + [f"{value[m, n]:.3f}" if (m, n) in value else "-" for n in lengths] for m in methods]
    header = ["method", *names]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * len(lengths)) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    width = max(len(m) for m in [*methods, "method"])
    cols = [max(len(h), 9) for h in names]
    lines = [f"{'method':<{width}}  " + "  ".join(f"{h:>{c}}" for h, c in zip(names, cols, strict=True))]
    lines.append("-" * len(lines[0]))
    for row in rows:
        lines.append(
            f"{row[0]:<{width}}  " + "  ".join(f"{v:>{c}}" for v, c in zip(row[1:], cols, strict=True))
        )
    return "\n".join(lines)


def write_results(path: Path, train_length: int, results: list[dict], extra: dict[str, Any]) -> None:
    """results.json: ``{"train_length": L, "results": [{"method", "length", "perplexity"}, ...]}`` + extra."""
    clash = set(extra) & {"train_length", "results"}
    if clash:
        raise ValueError(f"extra: expected keys other than {sorted(clash)}, got {sorted(extra)}")
    rows = [
        {"method": r["method"], "length": int(r["length"]), "perplexity": float(r["perplexity"])}
        for r in results
    ]
    path.write_text(
        json.dumps({"train_length": int(train_length), "results": rows, **extra}, indent=2) + "\n"
    )


def plot_perplexity(path: Path, results: list[dict], train_length: int) -> None:
    """Perplexity against evaluation length, one line per method (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths, methods = _lengths_and_methods(results)
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
    for method in methods:
        points = sorted((r["length"], r["perplexity"]) for r in results if r["method"] == method)
        style = "-" if method in ("nope", "sinusoidal", "rope") else "--"
        ax.plot(*zip(*points, strict=True), style, marker="o", label=method)
    ax.axvline(train_length, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(lengths, [f"{n}\n({n // train_length}L)" for n in lengths])
    ax.set_xlabel("evaluation length (bytes)")
    ax.set_ylabel("validation perplexity (per byte, log)")
    ax.set_title(f"Trained at L = {train_length}: perplexity as the context grows")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_position_loss(path: Path, extra_loss: dict[str, list[float]], train_length: int) -> None:
    """Per position of the longest windows: loss minus that of the same byte predicted within a window of L.

    Below zero the longer context helps; above zero extrapolating past L costs. Averaged over L/4 buckets.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bucket = max(1, train_length // 4)
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
    for method, losses in extra_loss.items():
        values = np.asarray(losses)
        n = len(values) // bucket * bucket
        means = values[:n].reshape(-1, bucket).mean(axis=1)  # (n / bucket,)
        centres = np.arange(len(means)) * bucket + bucket / 2
        style = "-" if method in ("nope", "sinusoidal", "rope") else "--"
        ax.plot(centres, means, style, marker=".", label=method)
    ax.axhline(0.0, color="black", lw=0.8)
    ax.axvline(train_length, color="grey", lw=0.8, ls=":", label="training length L")
    ax.set_xlabel(f"position in the window (bytes; mean over {bucket}-byte buckets)")
    ax.set_ylabel("loss - loss of the same byte within L (nats)")
    ax.set_title("Where extrapolation costs (> 0) or extra context helps (< 0)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_attention(path: Path, attention: np.ndarray, head_dim: int, base: float, max_distance: int) -> None:
    """Left: the trained rope model's mean attention per relative distance. Right: RoFormer's decay bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), dpi=110)
    left.plot(np.arange(len(attention)), attention, color="C0")
    left.set_yscale("log")
    left.set_xlabel("relative distance m - n (bytes)")
    left.set_ylabel("mean attention probability (log)")
    left.set_title("trained rope model (all layers and heads)")
    left.grid(True, which="both", alpha=0.3)
    distances = np.arange(max_distance + 1)
    bound = decay_bound(RopeConfig(head_dim, base).inv_freq().numpy(), distances)
    window = 16  # the bound oscillates from one distance to the next; a running mean shows the trend
    right.plot(distances, bound, color="C1", lw=0.6, alpha=0.5, label="bound")
    smooth = np.convolve(bound, np.ones(window) / window, mode="valid")
    right.plot(distances[window - 1 :], smooth, color="C3", label=f"running mean over {window}")
    right.axvline(len(attention) - 1, color="grey", lw=0.8, ls=":", label="training length")
    right.set_xlabel("relative distance m - n")
    right.set_ylabel("(2/d) sum_j |S_j|")
    right.set_title(f"RoFormer decay bound (d = {head_dim}, base = {base:g})")
    right.grid(True, alpha=0.3)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(path: Path, sections: dict[str, str]) -> None:
    """report.md from titled sections, in order."""
    text = "\n\n".join(
        f"## {title}\n\n{body.strip()}" if title else body.strip() for title, body in sections.items()
    )
    path.write_text(text + "\n")


def ratio(a: float, b: float) -> str:
    """'x1.23' style ratio, robust to inf."""
    return "x" + (f"{a / b:.2f}" if math.isfinite(a) and b > 0 else "inf")


def _value(results: list[dict], method: str, length: int) -> float | None:
    for r in results:
        if r["method"] == method and r["length"] == length:
            return r["perplexity"]
    return None


def observations(results: list[dict], train_length: int, extra_loss: dict[str, list[float]]) -> list[str]:
    """Plain sentences read off the numbers (no judgement beyond the comparison each one states)."""
    L = train_length
    lengths, methods = _lengths_and_methods(results)
    longest = lengths[-1]
    n = longest // L
    lines = []
    at_L = {m: _value(results, m, L) for m in ("nope", "sinusoidal", "rope")}
    present = {m: v for m, v in at_L.items() if v is not None}
    if present:
        lines.append(
            "At the training length L: " + ", ".join(f"{m} {v:.3f}" for m, v in present.items()) + "."
        )
    for m in ("nope", "sinusoidal", "rope"):
        a, b = _value(results, m, L), _value(results, m, longest)
        if a is not None and b is not None:
            lines.append(f"{m} at {n}L: {b:.3f}, {ratio(b, a)} its perplexity at L.")
    if extra_loss:
        tail = {m: float(np.mean(v[-L:])) for m, v in extra_loss.items()}
        lines.append(
            f"Over the last L bytes of the {n}L windows, each byte's loss minus its loss within L "
            "(same method): "
            + ", ".join(f"{m} {v:+.2f}" for m, v in tail.items())
            + " nats. The whole-window "
            "perplexity averages this cost with the cheaper early positions."
        )
    base = _value(results, "rope", L)
    scaled = [m for m in methods if m.startswith("rope+")]
    if base is not None and scaled:
        at_long = sorted(
            (_value(results, m, longest), m) for m in scaled if _value(results, m, longest) is not None
        )
        lines.append(
            f"With scaling, at {n}L (rope at L: {base:.3f}): "
            + ", ".join(f"{m} {v:.3f} ({ratio(v, base)})" for v, m in at_long)
            + "."
        )
        # Every inference-time schedule at factor 1 is the unscaled rotation: a free check of the plumbing.
        same = [m for m in scaled if "finetune" not in m and _value(results, m, L) is not None]
        worst = max((abs(_value(results, m, L) / base - 1.0) for m in same), default=0.0)
        if same:
            lines.append(
                f"Sanity check: at L every inference-time method uses factor 1 and should equal plain rope; "
                f"the largest relative difference is {worst:.1e}."
            )
    return lines


CAVEATS = """\
- Each model is tiny and trained for about a minute on one seed, so differences of a few percent are within
  the noise of a rerun with another seed; there are no error bars.
- Perplexity is per byte over every position of every window. A window of nL bytes holds the same bytes as n
  windows of L, so a model that used the extra context perfectly would score *lower* at longer lengths.
- Nothing here measures long-range retrieval or downstream quality; a method can keep perplexity flat while
  ignoring most of the extra context.
- The literature (PI, NTK-aware, YaRN papers, on LLaMA) expects rope ~ sinusoidal at L, plain rope and
  sinusoidal degrading sharply past 2-4L, and PI / NTK / dynamic / YaRN staying closer to the in-distribution
  perplexity.
  Where this table disagrees, docs/demo.md records what was checked."""


def report_sections(settings, results: list[dict], extra: dict, checks) -> dict[str, str]:
    """The titled sections of report.md, in order."""
    L = settings.train_length
    head_dim = settings.dim // settings.n_heads
    failed = sum(not c.passed for c in checks)
    verify_rows = "\n".join(
        f"| {c.name} | {c.max_error:.1e} | {c.tolerance:.0e} | {'PASS' if c.passed else 'FAIL'} |"
        for c in checks
    )
    machine = extra["machine"]
    skipped = "\n".join(f"- rope+{m} skipped: {why}" for m, why in extra["skipped"].items()) or "- none"
    finals = ", ".join(f"{k} {v[-1]:.3f}" for k, v in extra["train_loss"].items())
    sections = {
        "": f"# ropekit demo report\n\nByte-level decoders trained at L = {L} on the Python standard "
        f"library, evaluated at {', '.join(str(n) for n in sorted({r['length'] for r in results}))} bytes.",
        "Validation perplexity (per byte)": format_table(results, L, markdown=True)
        + "\n\n![perplexity vs length](perplexity_vs_length.png)",
        "What it shows": "\n".join(
            f"- {line}" for line in observations(results, L, extra.get("extra_loss_by_position", {}))
        ),
        "What it does not show": CAVEATS,
        "Scaling choices": f"""\
- linear (PI), ntk, yarn, llama3: factor = evaluation length / L (1, 2, 4, 8), original context L = {L}.
- dynamic: HF's dynamic NTK with a fixed factor {2.0:g}; it rescales by itself once the sequence exceeds L.
- yarn: beta_fast 32, beta_slow 1, attention factor 0.1 ln(factor) + 1 (the schedule's defaults).
- llama3: low_freq_factor 1, high_freq_factor 4.
- `+finetune` (with --finetune): the rope model tuned for {settings.finetune_steps} steps at 2L with factor 2,
  then evaluated with factor 2 at every length.
{skipped}""",
        "Loss by position": "![loss vs position](loss_vs_position.png)\n\n"
        f"For each byte of the {max(r['length'] for r in results)}-byte windows: its loss minus the loss of "
        "the same byte predicted within a window of L by the same method, averaged over the chunks. "
        "Before L the two contexts are identical (0); after it, below 0 means the longer context helped and "
        "above 0 that positions past L cost more than the context gave.",
        "ropekit verify": f"{len(checks) - failed} passed, {failed} failed "
        f"(head_dim {head_dim}, base 10000).\n\n"
        "| check | max error | tolerance | result |\n|---|---:|---:|---|\n" + verify_rows,
        "Machine and settings": f"""\
- device: {machine["device_name"]} ({machine["device"]}), {machine["threads"]} thread(s) per process, \
{extra["world_size"]} process(es); {machine["cpu_count"]} CPUs visible
- {machine["platform"]}, Python {machine["python"]}, torch {machine["torch"]}
- model: dim {settings.dim}, {settings.n_layers} layers, {settings.n_heads} heads (head_dim {head_dim}), \
byte vocabulary, tied embeddings
- training: {settings.steps} steps x {settings.batch_size} windows of {L} bytes, AdamW lr {settings.lr:g}, \
seed {settings.seed}; final training loss {finals}
- corpus: {extra["corpus"]["train_files"]} train / {len(extra["corpus"]["validation_files"])} validation \
files from {extra["corpus"]["root"]} (split by file)
- evaluation: the same {settings.eval_chunks * 8 * L} validation bytes at every length
- wall time: {", ".join(f"{k} {v:.0f} s" for k, v in extra["timings_s"].items())}""",
    }
    if "attention_by_distance" in extra:  # only when a rope model was trained
        tail = {key: sections.pop(key) for key in ("ropekit verify", "Machine and settings")}
        sections["Attention against relative distance"] = (
            "![attention vs distance](attention_vs_distance.png)\n\n"
            "Left: the trained rope model's attention probability to the key r bytes back, averaged over "
            "layers, heads and queries of validation windows of length L. Right: RoFormer's long-term-decay "
            f"bound (2/d) sum_j |S_j| for d = {head_dim}, base 10000, up to 8L. The bound is on the score's "
            "magnitude for constant q, k; learned attention need not follow it."
        )
        sections.update(tail)
    return sections
