"""The demo's plots, drawn from finished numbers (the rows of results.json). matplotlib is imported inside.

Many methods share few lengths, so the retrieval and loss plots are small multiples, one panel per method on
shared axes, rather than one crowded axis; the raw values stay visible beside any summary.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from ropekit.config import RopeConfig
from ropekit.tools.demo.report import BASE_METHODS, seed_accuracies
from ropekit.tools.inspect import decay_bound

__all__ = [
    "nice_log_ticks",
    "plot_attention",
    "plot_perplexity",
    "plot_position_loss",
    "plot_retrieval",
    "plot_retrieval_heatmap",
]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _methods(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["method"] for r in rows))


def _grid(plt, n: int, width: float = 3.0, height: float = 2.6, **kwargs):
    """A grid of n panels, at most 5 across; the unused ones hidden. Returns (figure, flat list of n axes)."""
    cols = min(5, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(
        rows,
        cols,
        figsize=(width * cols, height * rows + 1.0),
        dpi=110,
        layout="constrained",
        squeeze=False,
        **kwargs,
    )
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def _length_axis(ax, lengths: list[int], train_length: int, *, label: bool = True) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [f"{n / train_length:g}L" for n in lengths])
    ax.minorticks_off()
    ax.set_xlim(lengths[0] / 1.3, lengths[-1] * 1.3)
    if label:
        ax.set_xlabel(f"window length (L = {train_length} bytes)")


def nice_log_ticks(low: float, high: float) -> list[float]:
    """Round values (1, 1.5, 2, 3, 5, 7 times a power of ten) spanning [low, high], at least three of them."""
    if not (0 < low <= high and math.isfinite(high)):
        return []
    ticks: list[float] = []
    for mantissas in ((1, 2, 5), (1, 1.5, 2, 3, 5, 7), (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 9)):
        ticks = [
            m * 10.0**e
            for e in range(math.floor(math.log10(low)) - 1, math.ceil(math.log10(high)) + 1)
            for m in mantissas
            if low <= m * 10.0**e <= high
        ]
        if len(ticks) >= 3:
            return ticks
    return ticks


def plot_retrieval(path: Path, retrieval: list[dict], train_length: int) -> None:
    """One panel per method: accuracy against window length, one line per key depth, with 95% Wilson bars.

    A filled marker is a key L or more before the query (a distance never seen in training), a hollow one a
    key within L; with several seeds, small dots are each seed's accuracy.
    """
    plt = _pyplot()
    L = train_length
    methods = _methods(retrieval)
    depths = sorted({r["depth"] for r in retrieval})
    lengths = sorted({r["length"] for r in retrieval})
    colors = {d: plt.get_cmap("viridis")(0.85 * i / max(1, len(depths) - 1)) for i, d in enumerate(depths)}
    fig, axes = _grid(plt, len(methods), sharex=True, sharey=True)
    for ax, method in zip(axes, methods, strict=True):
        for d in depths:
            rows = sorted(
                (r for r in retrieval if r["method"] == method and r["depth"] == d), key=lambda r: r["length"]
            )
            x = np.array([r["length"] for r in rows], dtype=float) * 2 ** (0.06 * (depths.index(d) - 1))
            y = np.array([r["accuracy"] for r in rows])
            err = [y - [r["ci_low"] for r in rows], [r["ci_high"] for r in rows] - y]
            ax.errorbar(x, y, yerr=err, color=colors[d], lw=1.2, capsize=2, elinewidth=0.8, zorder=2)
            for xi, r in zip(x, rows, strict=True):
                far = r["distance"] >= L
                ax.plot(
                    xi, r["accuracy"], "o", ms=5, mec=colors[d], mfc=colors[d] if far else "white", zorder=3
                )
                seeds = seed_accuracies(r)
                if len(seeds) > 1:
                    ax.plot([xi] * len(seeds), seeds, ".", color=colors[d], ms=2.5, alpha=0.5, zorder=1)
        ax.axhline(0.5, color="grey", lw=0.6, ls=":")
        _length_axis(ax, lengths, L, label=False)
        ax.set_ylim(-0.05, 1.05)
        ax.set_yticks([0, 0.5, 1.0], ["0%", "50%", "100%"])
        ax.set_title(method, fontsize=9)
        ax.grid(True, alpha=0.25)
    handles = [plt.Line2D([], [], color=colors[d], marker="o", label=f"key at depth {d:g}") for d in depths]
    handles += [
        plt.Line2D([], [], ls="", marker="o", color="k", mfc="k", label="key L or more back"),
        plt.Line2D([], [], ls="", marker="o", color="k", mfc="white", label="key within L"),
    ]
    fig.legend(handles=handles, loc="outside upper center", ncol=len(handles), fontsize=8, frameon=False)
    fig.supxlabel(
        f"window length (L = {L} bytes); depth 0 = start of the window, 1 = just before the query", fontsize=9
    )
    fig.supylabel("exact-match passkey accuracy (95% Wilson bars)", fontsize=9)
    fig.savefig(path)
    plt.close(fig)


def plot_position_loss(
    path: Path,
    extra_loss: dict[str, list[float]],
    train_length: int,
    rotations: dict[str, tuple[str, str]] | None = None,
) -> None:
    """One panel per method: each byte's loss in the longest windows minus its loss within windows of L.

    Thin grey: every position; coloured: means over L/4-byte buckets. Below zero the longer context helps,
    above zero the long window costs. ``rotations`` labels the methods whose two windows rotate differently.
    """
    plt = _pyplot()
    L = train_length
    rotations = rotations or {}
    bucket = max(1, L // 4)
    methods = list(extra_loss)
    raw_all = np.concatenate([np.asarray(v) for v in extra_loss.values()])
    low, high = np.percentile(raw_all, [0.5, 99.5])
    pad = 0.1 * (high - low)
    fig, axes = _grid(plt, len(methods), sharex=True, sharey=True)
    for ax, method in zip(axes, methods, strict=True):
        values = np.asarray(extra_loss[method])
        positions = np.arange(len(values))
        ax.plot(positions, values, color="0.6", lw=0.4, zorder=1)
        n = len(values) // bucket * bucket
        means = values[:n].reshape(-1, bucket).mean(axis=1)  # (n / bucket,)
        color = (
            "C0"
            if method in BASE_METHODS
            else "C3"
            if method in rotations and rotations[method][0] != rotations[method][1]
            else "C2"
        )
        ax.step(
            np.arange(len(means) + 1) * bucket,
            np.append(means, means[-1]),
            where="post",
            color=color,
            lw=1.6,
            zorder=3,
        )
        ax.axhline(0.0, color="black", lw=0.7, zorder=2)
        ax.axvline(L, color="black", lw=0.7, ls=":", zorder=2)
        title = method
        if method in rotations and rotations[method][0] != rotations[method][1]:
            title += f"\n{rotations[method][0]} vs {rotations[method][1]}"
        ax.set_title(title, fontsize=8.5)
        ax.set_ylim(low - pad, high + pad)
        ax.set_xlim(0, len(values))
        ax.grid(True, alpha=0.25)
        ax.text(L, high + pad, " L", va="top", fontsize=7)
    fig.supxlabel(
        f"position in the window (bytes). Grey: each position; line: mean over {bucket}-byte buckets, red "
        "where the long window rotates differently from the window of L (title), so that before L it shows "
        "the change of rotation alone",
        fontsize=9,
    )
    fig.supylabel("loss minus loss of the same byte within L (nats)", fontsize=9)
    fig.suptitle("Where the long window costs (> 0) or its extra context helps (< 0)", fontsize=11)
    fig.savefig(path)
    plt.close(fig)


def plot_attention(
    path: Path,
    attention: list[float],
    head_dim: int,
    base: float,
    max_distance: int,
    long_attention: list[float] | None = None,
) -> None:
    """Top: the trained rope model's mean attention per relative distance (windows of L, and the longest
    windows when given). Bottom, on the same distances: RoFormer's decay bound."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.4), dpi=110, sharex=True, layout="constrained")
    L = len(attention)
    if long_attention is not None:
        top.plot(
            np.arange(len(long_attention)),
            long_attention,
            color="C1",
            lw=0.8,
            label=f"windows of {len(long_attention)} bytes (plain rope, no scaling)",
        )
    top.plot(np.arange(L), attention, color="C0", lw=1.2, label=f"windows of L = {L} bytes")
    top.set_yscale("log")
    top.set_ylabel("mean attention probability")
    top.set_title("trained rope model, first seed (all layers and heads)", fontsize=10)
    top.legend(fontsize=8)
    distances = np.arange(max_distance + 1)
    bound = decay_bound(RopeConfig(head_dim, base).inv_freq().numpy(), distances)
    window = 16  # the bound oscillates from one distance to the next; a running mean shows the trend
    bottom.plot(distances, bound, color="0.6", lw=0.5, label="bound at each distance")
    smooth = np.convolve(bound, np.ones(window) / window, mode="valid")
    bottom.plot(distances[window - 1 :], smooth, color="C3", label=f"running mean over {window}")
    bottom.set_ylabel("(2/d) sum_j |S_j|")
    bottom.set_title(f"RoFormer long-term-decay bound (d = {head_dim}, base = {base:g})", fontsize=10)
    bottom.legend(fontsize=8)
    bottom.set_xlabel("relative distance m - n (bytes)")
    bottom.set_xlim(0, max_distance)
    for ax in (top, bottom):
        ax.axvline(L, color="black", lw=0.7, ls=":")
        ax.grid(True, which="major", alpha=0.3)
    top.text(L, top.get_ylim()[1], " L", va="top", fontsize=8)
    fig.savefig(path)
    plt.close(fig)


def _panels(methods: list[str]) -> list[tuple[str, list[str]]]:
    """Trained models (and the fine-tuned ones), and plain rope with each inference-time scaling."""
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


def plot_perplexity(path: Path, results: list[dict], train_length: int) -> None:
    """Perplexity against evaluation length (log-log), in two panels with each line labelled at its end;
    bars are ± one std over seeds and the faint dots each seed."""
    plt = _pyplot()
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    lengths = sorted({r["length"] for r in results})
    methods = _methods(results)
    colors = _colors(methods)
    panels = _panels(methods)
    fig, axes = plt.subplots(
        1,
        len(panels),
        figsize=(6.5 * len(panels), 5.0),
        dpi=110,
        sharey=True,
        layout="constrained",
        squeeze=False,
    )
    values = [v for r in results for v in r.get("perplexity_by_seed", [r["perplexity"]]) if math.isfinite(v)]
    for ax, (title, group) in zip(axes[0], panels, strict=True):
        ends = []
        for method in group:
            rows = sorted((r for r in results if r["method"] == method), key=lambda r: r["length"])
            x = [r["length"] for r in rows]
            y = [r["perplexity"] for r in rows]
            err = [r.get("perplexity_std", 0.0) for r in rows]
            style = "-" if method in BASE_METHODS else "--"
            ax.errorbar(x, y, yerr=err, fmt=style, marker="o", ms=4, capsize=3, color=colors[method])
            for r in rows:
                seeds = r.get("perplexity_by_seed", [])
                if len(seeds) > 1:
                    ax.plot([r["length"]] * len(seeds), seeds, ".", color=colors[method], alpha=0.35, ms=3)
            ends.append((y[-1], method))
        _label_line_ends(ax, ends, lengths[-1], colors)
        ax.axvline(train_length, color="grey", lw=0.8, ls=":")
        _length_axis(ax, lengths, train_length)
        ax.set_xlim(lengths[0] / 1.3, lengths[-1] * 2.6)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
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


def _label_line_ends(ax, ends: list[tuple[float, str]], x: float, colors: dict) -> None:
    """Name each line at its right end, nudged apart (in log space) so the labels do not overlap."""
    if not ends:
        return
    ends = sorted(ends)
    logs = [math.log(y) for y, _ in ends]
    gap = 0.045 * max(0.5, logs[-1] - logs[0])
    for i in range(1, len(logs)):
        logs[i] = max(logs[i], logs[i - 1] + gap)
    for (_, method), ly in zip(ends, logs, strict=True):
        ax.text(x * 1.12, math.exp(ly), method, color=colors[method], fontsize=7.5, va="center")


def plot_retrieval_heatmap(path: Path, retrieval: list[dict], train_length: int) -> None:
    """Exact-match accuracy per method (rows) and (length, depth) (columns), written in each cell, with the
    key's distance under each depth."""
    plt = _pyplot()
    L = train_length
    lengths = sorted({r["length"] for r in retrieval})
    methods = _methods(retrieval)
    depths = sorted({r["depth"] for r in retrieval})
    acc = np.full((len(methods), len(lengths) * len(depths)), np.nan)
    distance = {}
    for r in retrieval:
        col = lengths.index(r["length"]) * len(depths) + depths.index(r["depth"])
        acc[methods.index(r["method"]), col] = r["accuracy"]
        distance[col] = r["distance"]
    width = 2.5 + 0.6 * acc.shape[1]
    fig, ax = plt.subplots(figsize=(width, 1.5 + 0.4 * len(methods)), dpi=110, layout="constrained")
    image = ax.imshow(acc, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    for (i, j), value in np.ndenumerate(acc):
        if np.isfinite(value):
            ax.text(
                j,
                i,
                f"{100 * value:.0f}",
                ha="center",
                va="center",
                fontsize=7,
                color="black" if value > 0.6 else "white",
            )
    ax.set_yticks(range(len(methods)), methods, fontsize=8)
    ax.set_xticks(
        range(acc.shape[1]),
        [f"{d:g}\n{distance.get(j, 0) / L:.1f}L" for j, d in enumerate(d for _ in lengths for d in depths)],
        fontsize=7,
    )
    ax.set_xlabel("depth of the key (0 = start, 1 = just before the query) and its distance from the query")
    for k in range(1, len(lengths)):
        ax.axvline(k * len(depths) - 0.5, color="white", lw=2)
    top = ax.secondary_xaxis("top")
    top.set_xticks(
        [k * len(depths) + (len(depths) - 1) / 2 for k in range(len(lengths))],
        [f"window {n} ({n / L:g}L)" for n in lengths],
        fontsize=8,
    )
    top.tick_params(length=0)
    fig.colorbar(image, ax=ax, label="exact-match accuracy", shrink=0.9)
    fig.suptitle(f"Passkey retrieval, trained at L = {L}", fontsize=11)
    fig.savefig(path)
    plt.close(fig)
