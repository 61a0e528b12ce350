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
from ropekit.schedules import extension_scaling
from ropekit.schedules.yarn import BETA_FAST, BETA_SLOW
from ropekit.tools.demo.data import KEY_DIGITS
from ropekit.tools.inspect import decay_bound
from ropekit.validation import check_int

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


def retrieval_row(method: str, length: int, depth: float | None, correct: int, n: int) -> dict:
    """One ``retrieval`` entry of results.json: ``correct`` of ``n``, with its Wilson interval."""
    low, high = wilson_interval(correct, n)
    return {"method": method, "length": int(length), "depth": depth, "accuracy": correct / n, "n": n,
            "ci_low": low, "ci_high": high}  # fmt: skip


def pool_depths(retrieval: list[dict]) -> list[dict]:
    """Per (method, length): the rows of every depth pooled into one (depth None)."""
    totals: dict[tuple[str, int], list[int]] = {}
    for r in retrieval:
        total = totals.setdefault((r["method"], r["length"]), [0, 0])
        total[0] += round(r["accuracy"] * r["n"])
        total[1] += r["n"]
    return [retrieval_row(m, n, None, k, total) for (m, n), (k, total) in totals.items()]


def _lengths_and_methods(results: list[dict]) -> tuple[list[int], list[str]]:
    lengths = sorted({r["length"] for r in results})
    methods = list(dict.fromkeys(r["method"] for r in results))
    return lengths, methods


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _plain(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(
            h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths, strict=True))
        )
    ]
    lines.append("-" * len(lines[0]))
    for row in rows:
        lines.append(
            "  ".join(
                v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    return "\n".join(lines)


def _length_names(lengths: list[int], train_length: int) -> list[str]:
    return [f"{n} ({n / train_length:g}L)" for n in lengths]


def format_table(results: list[dict], train_length: int, *, markdown: bool = False) -> str:
    """Perplexity per method (rows) and evaluation length (columns); "mean ± std" over seeds when known."""
    lengths, methods = _lengths_and_methods(results)
    cell = {}
    for r in results:
        std = r.get("perplexity_std")
        text = f"{r['perplexity']:.3f}"
        cell[r["method"], r["length"]] = text + (f" ± {std:.3f}" if std else "")
    rows = [[m] + [cell.get((m, n), "-") for n in lengths] for m in methods]
    header = ["method", *_length_names(lengths, train_length)]
    return _markdown(header, rows) if markdown else _plain(header, rows)


def _percent(x: float) -> str:
    return f"{100 * x:.0f}%"


def format_retrieval_table(retrieval: list[dict], train_length: int, *, markdown: bool = False) -> str:
    """Exact-match retrieval per method and length, pooled over depths: "accuracy [95% Wilson interval]"."""
    pooled = pool_depths(retrieval)
    lengths, methods = _lengths_and_methods(pooled)
    cell = {
        (
            r["method"],
            r["length"],
        ): f"{_percent(r['accuracy'])} [{_percent(r['ci_low'])}, {_percent(r['ci_high'])}]"
        for r in pooled
    }
    rows = [[m] + [cell.get((m, n), "-") for n in lengths] for m in methods]
    header = ["method", *_length_names(lengths, train_length)]
    return _markdown(header, rows) if markdown else _plain(header, rows)


def format_depth_table(retrieval: list[dict], train_length: int) -> str:
    """Markdown: accuracy per method (rows) and (length, depth) (columns), as in the heat map."""
    keys = sorted({(r["length"], r["depth"]) for r in retrieval})
    methods = list(dict.fromkeys(r["method"] for r in retrieval))
    value = {(r["method"], r["length"], r["depth"]): _percent(r["accuracy"]) for r in retrieval}
    header = ["method", *(f"{n / train_length:g}L @ {d:g}" for n, d in keys)]
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


BASE_METHODS = ("nope", "sinusoidal", "rope")


def _panels(methods: list[str]) -> list[tuple[str, list[str]]]:
    """Two groups drawn side by side so the rope variants do not hide each other: trained models (and the
    fine-tuned ones), and plain rope with each inference-time scaling."""
    trained = [m for m in methods if m in BASE_METHODS or m.endswith("+finetune")]
    scaled = [m for m in methods if m not in trained]
    if not scaled:
        return [("trained models", trained)]
    reference = ["rope"] if "rope" in methods else []
    return [
        ("trained models (and fine-tuned ones)", trained),
        ("rope with inference-time scaling", reference + scaled),
    ]


def _colors(methods: list[str]) -> dict[str, Any]:
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if len(methods) <= 10 else "tab20"]
    return {m: cmap(i % cmap.N) for i, m in enumerate(methods)}


def _length_axis(ax, lengths: list[int], train_length: int) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [f"{n}\n{n / train_length:g}L" for n in lengths])
    ax.minorticks_off()
    ax.set_xlim(lengths[0] / 1.25, lengths[-1] * 1.25)
    ax.set_xlabel("evaluation length (bytes)")


def nice_log_ticks(low: float, high: float) -> list[float]:
    """Round values (1, 1.5, 2, 3, 5, 7 times a power of ten) spanning [low, high], at least three of them."""
    if not (0 < low <= high and math.isfinite(high)):
        return []
    for mantissas in ((1, 2, 5), (1, 1.5, 2, 3, 5, 7), (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 9)):
        ticks = [m * 10.0**e for e in range(math.floor(math.log10(low)) - 1, math.ceil(math.log10(high)) + 1)
                 for m in mantissas if low <= m * 10.0**e <= high]  # fmt: skip
        if len(ticks) >= 3:
            return ticks
    return ticks


def plot_perplexity(path: Path, results: list[dict], train_length: int) -> None:
    """Perplexity against evaluation length (log-log), in two panels; bars are ± one std over seeds and the
    faint dots each seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    lengths, methods = _lengths_and_methods(results)
    colors = _colors(methods)
    panels = _panels(methods)
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 5.2), dpi=110, sharey=True,
                             layout="constrained", squeeze=False)  # fmt: skip
    values = [v for r in results for v in r.get("perplexity_by_seed", [r["perplexity"]]) if math.isfinite(v)]
    for ax, (title, group) in zip(axes[0], panels, strict=True):
        for method in group:
            rows = sorted((r for r in results if r["method"] == method), key=lambda r: r["length"])
            x = [r["length"] for r in rows]
            y = [r["perplexity"] for r in rows]
            err = [r.get("perplexity_std", 0.0) for r in rows]
            style = "-" if method in BASE_METHODS else "--"
            ax.errorbar(x, y, yerr=err, fmt=style, marker="o", ms=4, capsize=3, color=colors[method],
                        label=method)  # fmt: skip
            for r in rows:
                seeds = r.get("perplexity_by_seed", [])
                if len(seeds) > 1:
                    ax.plot([r["length"]] * len(seeds), seeds, ".", color=colors[method], alpha=0.35, ms=3)
        ax.axvline(train_length, color="grey", lw=0.8, ls=":")
        _length_axis(ax, lengths, train_length)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False)
    if values:
        ax = axes[0][0]
        ax.set_ylim(min(values) / 1.05, max(values) * 1.05)
        ax.yaxis.set_major_locator(FixedLocator(nice_log_ticks(min(values) / 1.05, max(values) * 1.05)))
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_locator(NullLocator())
    axes[0][0].set_ylabel("validation perplexity per byte (log scale)")
    fig.suptitle(f"Trained at L = {train_length}: perplexity as the context grows", fontsize=11)
    fig.savefig(path)
    plt.close(fig)


def plot_retrieval_heatmap(path: Path, retrieval: list[dict], train_length: int) -> None:
    """Exact-match accuracy per method (rows) and (length, depth) (columns), written in each cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths, methods = _lengths_and_methods(retrieval)
    depths = sorted({r["depth"] for r in retrieval})
    acc = np.full((len(methods), len(lengths) * len(depths)), np.nan)
    for r in retrieval:
        col = lengths.index(r["length"]) * len(depths) + depths.index(r["depth"])
        acc[methods.index(r["method"]), col] = r["accuracy"]
    width = 2.0 + 0.55 * acc.shape[1]
    fig, ax = plt.subplots(figsize=(width, 1.2 + 0.4 * len(methods)), dpi=110, layout="constrained")
    image = ax.imshow(acc, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    for (i, j), value in np.ndenumerate(acc):
        if np.isfinite(value):
            ax.text(j, i, f"{100 * value:.0f}", ha="center", va="center", fontsize=7,
                    color="black" if value > 0.6 else "white")  # fmt: skip
    ax.set_yticks(range(len(methods)), methods, fontsize=8)
    ax.set_xticks(range(acc.shape[1]), [f"{d:g}" for _ in lengths for d in depths], fontsize=7)
    ax.set_xlabel("depth of the key (0 = start of the window, 1 = just before the query)")
    for k in range(1, len(lengths)):
        ax.axvline(k * len(depths) - 0.5, color="white", lw=2)
    top = ax.secondary_xaxis("top")
    top.set_xticks([k * len(depths) + (len(depths) - 1) / 2 for k in range(len(lengths))],
                   [f"{n} ({n / train_length:g}L)" for n in lengths], fontsize=8)  # fmt: skip
    top.tick_params(length=0)
    fig.colorbar(image, ax=ax, label="exact-match accuracy", shrink=0.9)
    fig.suptitle(f"Passkey retrieval, trained at L = {train_length}", fontsize=11)
    fig.savefig(path)
    plt.close(fig)


def plot_retrieval(path: Path, retrieval: list[dict], train_length: int) -> None:
    """Accuracy (pooled over depths and seeds) against evaluation length; bands are 95% Wilson intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pooled = pool_depths(retrieval)
    lengths, methods = _lengths_and_methods(pooled)
    colors = _colors(methods)
    panels = _panels(methods)
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 5.2), dpi=110, sharey=True,
                             layout="constrained", squeeze=False)  # fmt: skip
    for ax, (title, group) in zip(axes[0], panels, strict=True):
        for method in group:
            rows = sorted((r for r in pooled if r["method"] == method), key=lambda r: r["length"])
            x = [r["length"] for r in rows]
            style = "-" if method in BASE_METHODS else "--"
            ax.plot(
                x, [r["accuracy"] for r in rows], style, marker="o", ms=4, color=colors[method], label=method
            )
            low, high = [r["ci_low"] for r in rows], [r["ci_high"] for r in rows]
            ax.fill_between(x, low, high, color=colors[method], alpha=0.15, lw=0)
        ax.axvline(train_length, color="grey", lw=0.8, ls=":")
        _length_axis(ax, lengths, train_length)
        ax.set_ylim(-0.03, 1.03)
        ax.set_yticks([0, 0.25, 0.5, 0.75, 1.0], ["0%", "25%", "50%", "75%", "100%"])
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False)
    axes[0][0].set_ylabel("exact-match passkey accuracy")
    fig.suptitle(f"Trained at L = {train_length}: passkey retrieval as the context grows", fontsize=11)
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
    methods = list(extra_loss)
    colors = _colors(methods)
    fig, ax = plt.subplots(figsize=(8, 5.4), dpi=110, layout="constrained")
    for method, losses in extra_loss.items():
        values = np.asarray(losses)
        n = len(values) // bucket * bucket
        means = values[:n].reshape(-1, bucket).mean(axis=1)  # (n / bucket,)
        centres = np.arange(len(means)) * bucket + bucket / 2
        style = "-" if method in BASE_METHODS else "--"
        ax.plot(centres, means, style, marker=".", color=colors[method], label=method)
    ax.axhline(0.0, color="black", lw=0.8)
    ax.axvline(train_length, color="grey", lw=0.8, ls=":", label="training length L")
    ax.set_xlabel(f"position in the window (bytes; mean over {bucket}-byte buckets)")
    ax.set_ylabel("loss - loss of the same byte within L (nats)")
    ax.set_title("Where extrapolation costs (> 0) or extra context helps (< 0)", fontsize=11)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=4, frameon=False)
    fig.savefig(path)
    plt.close(fig)


def plot_attention(path: Path, attention: np.ndarray, head_dim: int, base: float, max_distance: int) -> None:
    """Left: the trained rope model's mean attention per relative distance. Right: RoFormer's decay bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), dpi=110, layout="constrained")
    left.plot(np.arange(len(attention)), attention, color="C0")
    left.set_yscale("log")
    left.set_xlabel("relative distance m - n (bytes)")
    left.set_ylabel("mean attention probability (log)")
    left.set_title("trained rope model (all layers and heads)", fontsize=10)
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
    right.set_title(f"RoFormer decay bound (d = {head_dim}, base = {base:g})", fontsize=10)
    right.grid(True, alpha=0.3)
    right.legend(fontsize=8)
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


# A method "retrieves" at a length when more than half of the keys come back exactly (pooled over depths and
# seeds); it "keeps perplexity" when its perplexity at the longest length is within 10% of its own at L.
RETRIEVES = 0.5
KEEPS = 1.10


def retrieval_reach(retrieval: list[dict], train_length: int) -> dict[str, int]:
    """Per method: the longest evaluated length up to which every length retrieves (0 when L does not)."""
    pooled = pool_depths(retrieval)
    lengths, methods = _lengths_and_methods(pooled)
    acc = {(r["method"], r["length"]): r["accuracy"] for r in pooled}
    reach = {}
    for m in methods:
        reach[m] = 0
        for n in lengths:
            if acc.get((m, n), 0.0) <= RETRIEVES:
                break
            reach[m] = n
    return reach


def far_key_accuracy(retrieval: list[dict], method: str, train_length: int) -> float | None:
    """Exact-match accuracy of ``method`` pooled over the rows whose key sits more than L before the query.

    A key at depth d of a window of n bytes is about (1 - d) * n bytes before the query (depth 0 is the
    window's start). None when no evaluated row puts a key that far.
    """
    far = [
        r
        for r in retrieval
        if r["method"] == method and r["depth"] is not None and (1 - r["depth"]) * r["length"] > train_length
    ]
    total = sum(r["n"] for r in far)
    return sum(round(r["accuracy"] * r["n"]) for r in far) / total if total else None


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def answer(results: list[dict], retrieval: list[dict], train_length: int) -> str:
    """The report's opening: three sentences read off the numbers (retrieval, perplexity, literature)."""
    L = train_length
    pooled = {(r["method"], r["length"]): r for r in pool_depths(retrieval)}
    reach = retrieval_reach(retrieval, L)
    lengths = sorted({n for _, n in pooled})
    longest = lengths[-1]

    def acc(m: str, n: int) -> str:
        return _percent(pooled[m, n]["accuracy"]) if (m, n) in pooled else "-"

    past = [m for m, n in reach.items() if n > L]
    within = [m for m, n in reach.items() if n == L]
    never = [m for m, n in reach.items() if n == 0]
    if past:
        first = "Past the training length L = {}, {} retrieve the key (more than half exact)".format(
            L, _join([f"{m} (to {reach[m] / L:g}L; {acc(m, reach[m])} there)" for m in past])
        )
    else:
        first = f"No method retrieves the key past the training length L = {L} (more than half exact)"
    if within:
        longer = lengths[1] if len(lengths) > 1 else L
        first += "; {} retrieve at L only ({} at {}L)".format(
            _join(within),
            _join([f"{m} {acc(m, L)} at L, {acc(m, longer)}" for m in within]),
            f"{longer / L:g}",
        )
    if never:
        first += f"; {_join(never)} do not retrieve even at L"
    first += "."
    kept, lost = [], []
    for m in dict.fromkeys(r["method"] for r in results):
        a, b = _value(results, m, L), _value(results, m, longest)
        if a is None or b is None:
            continue
        (kept if math.isfinite(b) and b <= KEEPS * a else lost).append((m, b / a if a > 0 else math.inf))
    second = (
        f"Perplexity at {longest / L:g}L stays within {100 * (KEEPS - 1):.0f}% of the same model's at L for "
    )
    second += _join([m for m, _ in kept]) if kept else "no method"
    if lost:
        best, worst = min(lost, key=lambda item: item[1]), max(lost, key=lambda item: item[1])
        second += f"; among the others it grows least for {best[0]} (x{best[1]:.2f})"
        second += f" and most for {worst[0]} (x{worst[1]:.2f})" if worst != best else ""
    second += "."
    checks = []
    if reach.get("rope", 0) >= L:  # the comparison means something only if rope retrieves at L at all
        # The papers' claim is about distance: plain RoPE loses a key stated more than L bytes before the
        # query. Pooling every depth at 2L would mix in keys that are still within L of the query.
        far = far_key_accuracy(retrieval, "rope", L)
        if far is not None:
            checks.append((f"plain RoPE fails for keys more than L back ({_percent(far)})", far <= RETRIEVES))
        for m, name in (("rope+linear+finetune", "PI"), ("rope+yarn+finetune", "YaRN")):
            if m in reach:
                checks.append((f"{name} retrieves past L after a short fine-tune", reach[m] > L))
    if checks:
        agree = [c for c, ok in checks if ok]
        disagree = [c for c, ok in checks if not ok]
        third = "Against the passkey results of the PI and YaRN papers: "
        third += f"reproduced: {'; '.join(agree)}" if agree else ""
        third += ("; " if agree and disagree else "") + (
            f"not reproduced: {'; '.join(disagree)}" if disagree else ""
        )
        third += " (docs/demo.md records what was checked)."
    else:
        third = (
            "The comparison with the passkey results of the PI and YaRN papers needs a rope model that "
            "retrieves at L, which this run does not have."
        )
    return " ".join([first, second, third])


def observations(results: list[dict], train_length: int, extra_loss: dict[str, list[float]]) -> list[str]:
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


def caveats(settings) -> str:
    """What the run cannot show, with its own numbers."""
    seeds = settings.seeds
    spread = (
        f"{seeds} seeds: perplexities are mean ± standard deviation over seeds and accuracies pool the "
        "seeds' "
        "trials, so a difference smaller than the spread is noise"
        if seeds > 1
        else "one seed: there is no spread, so differences of a few percent may be noise (run with --seeds 3)"
    )
    return f"""\
- Each model is tiny and trained for {settings.steps} steps; {spread}.
- Accuracy intervals are 95% Wilson intervals on the pooled trials; the trials of one seed share a model, so
  the intervals understate the seed-to-seed spread.
- Perplexity is per byte over every position of every window. A window of nL bytes holds the same bytes as n
  windows of L, so a model that used the extra context perfectly would score *lower* at longer lengths.
- The literature (PI, NTK-aware, YaRN papers, on LLaMA) expects plain rope to fail past L on passkey retrieval
  and to degrade in perplexity past 2-4L, and PI / YaRN to retrieve after a short fine-tune. Where this run
  disagrees, the opening says so and docs/demo.md records what was checked."""


def report_sections(
    settings, results: list[dict], retrieval: list[dict], extra: dict, checks
) -> dict[str, str]:
    """The titled sections of report.md, in order; every number comes from the run's settings and results."""
    L = settings.train_length
    head_dim = settings.dim // settings.n_heads
    multiples = ", ".join(f"{m:g}" for m in settings.eval_multiples)
    longest = max(settings.eval_multiples)
    failed = sum(not c.passed for c in checks)
    verify_rows = "\n".join(
        f"| {c.name} | {c.max_error:.1e} | {c.tolerance:.0e} | {'PASS' if c.passed else 'FAIL'} |"
        for c in checks
    )
    machine = extra["machine"]
    processes = f"{extra['world_size']} process" + ("es" if extra["world_size"] != 1 else "")
    threads = f"{machine['threads']} thread" + ("s" if machine["threads"] != 1 else "")
    if extra.get("seed_processes", 1) > 1:
        processes += (
            f" (its {len(extra['seeds'])} seeds in {extra['seed_processes']} parallel worker processes)"
        )
    finals = ", ".join(f"{k} {v:.3f}" for k, v in extra["final_train_loss"].items())
    seeds = ", ".join(str(x) for x in extra["seeds"])
    lengths = sorted({r["length"] for r in results})
    sections = {
        "": f"# ropekit demo report\n\n{answer(results, retrieval, L)}"
        if retrieval
        else "# ropekit demo report",
    }
    sections["The run"] = (
        f"Byte-level decoders trained at L = {L} on the Python standard library, "
        f"{100 * settings.passkey_fraction:.0f}% of the training windows passkey examples; seeds {seeds}; "
        f"evaluated at {', '.join(str(n) for n in lengths)} bytes."
    )
    if retrieval:
        depths = ", ".join(f"{d:g}" for d in settings.retrieval_depths)
        sections["Passkey retrieval"] = (
            f"A {KEY_DIGITS}-digit key, stated once among real source text at depth {depths} of the window "
            "(0 = start, 1 = just before the query), asked for at the end; exact match of the greedy answer. "
            f"{settings.retrieval_examples} trials per cell and seed. Accuracy pooled over depths and seeds, "
            "with its 95% Wilson interval:\n\n"
            + format_retrieval_table(retrieval, L, markdown=True)
            + "\n\n![retrieval heat map](retrieval_heatmap.png)"
            + "\n\n![retrieval vs length](retrieval_vs_length.png)"
            + "\n\nBy depth (pooled over seeds):\n\n"
            + format_depth_table(retrieval, L)
        )
    spread = " (mean ± std over seeds)" if len(extra["seeds"]) > 1 else ""
    sections[f"Validation perplexity per byte{spread}"] = (
        format_table(results, L, markdown=True) + "\n\n![perplexity vs length](perplexity_vs_length.png)"
    )
    sections["What the perplexities show"] = "\n".join(
        f"- {line}" for line in observations(results, L, extra.get("extra_loss_by_position", {}))
    )
    sections["What it does not show"] = caveats(settings)
    tuned = ""
    if settings.finetune:
        tuned = (
            f"\n- `+finetune`: the rope model tuned for {settings.finetune_steps} steps at "
            f"{settings.finetune_factor:g}L with factor {settings.finetune_factor:g} (same data mix), then "
            f"evaluated with factor {settings.finetune_factor:g} at every length."
        )
    llama3 = extension_scaling("llama3", max(settings.eval_multiples), L)[0]  # as rope_config_for gives it
    sections["Scaling choices"] = f"""\
- linear (PI), ntk, yarn, llama3: factor = evaluation length / L ({multiples}), original context L = {L}.
- dynamic: HF's dynamic NTK with a fixed factor {settings.dynamic_factor:g}; it rescales by itself once the \
sequence exceeds L.
- yarn: beta_fast {BETA_FAST:g}, beta_slow {BETA_SLOW:g}, attention factor 0.1 ln(factor) + 1 (the \
schedule's defaults).
- llama3: low_freq_factor {llama3["low_freq_factor"]:g}, \
high_freq_factor {llama3["high_freq_factor"]:g}.{tuned}"""
    sections["Loss by position"] = (
        "![loss vs position](loss_vs_position.png)\n\n"
        f"For each byte of the {longest * L}-byte windows: its loss minus the loss of the same byte "
        "predicted within a window of L by the same method, averaged over the chunks (and seeds). Before L "
        "the "
        "two contexts are identical (0); after it, below 0 means the longer context helped and above 0 that "
        "positions past L cost more than the context gave."
    )
    if "attention_by_distance" in extra:  # only when a rope model was trained
        sections["Attention against relative distance"] = (
            "![attention vs distance](attention_vs_distance.png)\n\n"
            "Left: the trained rope model's (first seed) attention probability to the key r bytes back, "
            "averaged over layers, heads and queries of validation windows of length L. Right: RoFormer's "
            f"long-term-decay bound (2/d) sum_j |S_j| for d = {head_dim}, base {settings.rope_base:g}, up to "
            f"{longest:g}L. The bound is on the score's magnitude for constant q, k; learned attention need "
            "not "
            "follow it."
        )
    sections["ropekit verify"] = (
        f"{len(checks) - failed} passed, {failed} failed "
        f"(head_dim {head_dim}, base {settings.rope_base:g}).\n\n"
        "| check | max error | tolerance | result |\n|---|---:|---:|---|\n" + verify_rows
    )
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
- wall time: {", ".join(f"{k} {v:.0f} s" for k, v in extra["timings_s"].items())}"""
    return sections
