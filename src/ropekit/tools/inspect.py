"""The context-extension planner behind ``ropekit inspect``: what a scaling method does to each pair.

For a config (a preset or an HF config.json) and a target length it reports, per frequency pair i:
theta_i and its wavelength 2 pi / theta_i, how many rotations the pair completes within the original
(training) context, and whether each method keeps it, interpolates it (divides it by the factor), zeroes it,
or lands in between. A plain-language summary and three plots (wavelengths, RoFormer's long-term-decay bound,
and the cosine of rotated q·k against distance) complete the picture.

Shape notation: P pairs (rotary_dim // 2), N distances.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ropekit.config import RopeConfig
from ropekit.validation import check_int

__all__ = [
    "Inspection",
    "MethodReport",
    "decay_bound",
    "inspect_config",
    "inspection_figure",
    "layer_plan",
    "original_length",
    "plot_inspection",
    "qk_cosine",
]

# Assumed training context when a config names no length at all.
FALLBACK_LENGTH = 2048


@dataclass(frozen=True)
class MethodReport:
    """One method's effect on the pairs at the target length.

    Attributes:
        name: how the report names the method ("configured: yarn", "requested: linear").
        config: the RopeConfig the method was evaluated with.
        inv_freq: its frequencies at the target length, shape (P,).
        ratio: inv_freq / the unscaled frequencies (1 = kept, 1/factor = interpolated, 0 = zeroed).
        effect: per pair, "kept", "interpolated", "zeroed", "extrapolated" or "in between".
        attention_scaling: the table factor at the target length.
    """

    name: str
    config: RopeConfig
    inv_freq: np.ndarray
    ratio: np.ndarray
    effect: list[str]
    attention_scaling: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "rope_type": self.config.rope_type,
            "scaling": None if self.config.scaling is None else self.config.scaling.to_dict(),
            "attention_scaling": self.attention_scaling,
            "pairs": [
                {"pair": i, "theta": float(t), "ratio": float(r), "effect": e}
                for i, (t, r, e) in enumerate(zip(self.inv_freq, self.ratio, self.effect, strict=True))
            ],
        }


@dataclass(frozen=True)
class Inspection:
    """Everything ``ropekit inspect`` prints, plots or writes as JSON."""

    model: str
    config: RopeConfig
    original_length: int
    target_length: int
    theta: np.ndarray  # unscaled frequencies, (P,)
    methods: list[MethodReport] = field(default_factory=list)

    @property
    def wavelength(self) -> np.ndarray:
        """2 pi / theta_i in tokens (inf for a zero frequency), shape (P,)."""
        with np.errstate(divide="ignore"):
            return 2 * math.pi / self.theta

    @property
    def rotations(self) -> np.ndarray:
        """Full turns each pair completes within the original context, shape (P,)."""
        return self.original_length * self.theta / (2 * math.pi)

    def summary(self) -> list[str]:
        """Plain-language sentences about the context and each method at the target length."""
        pairs = len(self.theta)
        never = int((self.rotations < 1).sum())
        lines = [
            f"{never} of {pairs} pairs never complete a rotation within the {self.original_length}-token "
            "training context: the model saw only part of their circle, so angles past it are new to it."
        ]
        slowest = int(np.argmax(np.where(self.theta > 0, self.wavelength, 0)))
        trained_angle = self.original_length * self.theta[slowest]
        for m in self.methods:
            counts = {e: m.effect.count(e) for e in dict.fromkeys(m.effect)}
            parts = ", ".join(f"{n} {e}" for e, n in counts.items())
            reach = self.target_length * m.inv_freq[slowest] / trained_angle if trained_angle else 0.0
            where = (
                "stays within the angles seen in training"
                if reach <= 1 + 1e-9
                else f"turns {reach:.2f}x further than anything seen in training"
            )
            lines.append(
                f"{m.name} at {self.target_length} tokens: {parts} pairs; the slowest pair {where}; "
                f"attention scaling {m.attention_scaling:.4g}."
            )
        return lines

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "rope_type": self.config.rope_type,
            "base": self.config.base,
            "head_dim": self.config.head_dim,
            "rotary_dim": self.config.rotary_dim,
            "interleaved": self.config.interleaved,
            "original_length": self.original_length,
            "target_length": self.target_length,
            "pairs": [
                {
                    "pair": i,
                    "theta": float(t),
                    "wavelength": float(w) if math.isfinite(w) else None,
                    "rotations_in_context": float(r),
                }
                for i, (t, w, r) in enumerate(zip(self.theta, self.wavelength, self.rotations, strict=True))
            ],
            "methods": [m.as_dict() for m in self.methods],
            "summary": self.summary(),
        }


def original_length(config: RopeConfig) -> int:
    """The training context: original_max_position_embeddings, else max_position_embeddings, else 2048."""
    scaling = config.scaling or {}
    return (
        scaling.get("original_max_position_embeddings") or config.max_position_embeddings or FALLBACK_LENGTH
    )


def _nominal_factor(config: RopeConfig) -> float | None:
    scaling = config.scaling or {}
    factor = scaling.get("factor")
    if factor is None and config.rope_type in ("yarn", "longrope") and config.max_position_embeddings:
        factor = config.max_position_embeddings / original_length(config)
    return factor


def _effects(ratio: np.ndarray, factor: float | None) -> list[str]:
    out = []
    for r in ratio:
        if r == 0:
            out.append("zeroed")
        elif abs(r - 1) < 1e-9:
            out.append("kept")
        elif factor and abs(r * factor - 1) < 1e-6:
            out.append("interpolated")
        elif r > 1:
            out.append("extrapolated")
        else:
            out.append("in between")
    return out


def _report(name: str, config: RopeConfig, theta: np.ndarray, target: int) -> MethodReport:
    inv = config.inv_freq(target).numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(theta > 0, inv / theta, 0.0)
    return MethodReport(
        name, config, inv, ratio, _effects(ratio, _nominal_factor(config)), config.attention_scaling(target)
    )


def requested_config(
    config: RopeConfig, method: str, factor: float | None, extra: Mapping[str, Any], target: int
) -> RopeConfig:
    """The config's geometry with a different scaling method, extending its training length ``factor`` times.

    The context-extension methods (linear, ntk, dynamic, yarn, llama3, longrope) get their scaling dict and
    max_position_embeddings from :func:`ropekit.schedules.extension_scaling`, the one map that
    ``extend_context`` uses too. Any other registered schedule (e.g. proportional) gets ``factor`` when it
    takes one, ``extra``, and max_position_embeddings = max(target, training length).

    Raises:
        ValueError: for an unknown method, a missing or invalid factor, or keys the method rejects.
    """
    from ropekit.schedules import EXTEND_METHODS, extension_scaling, get_schedule

    original = original_length(config)
    if method in EXTEND_METHODS:
        if factor is None:
            raise ValueError(
                f"factor: method {method!r} extends the context by a factor, got None "
                "(pass factor, or a target_length to derive it from)"
            )
        scaling, max_positions = extension_scaling(method, factor, original, **extra)
    else:
        sched = get_schedule(method)
        scaling = {"rope_type": sched.name}
        if factor is not None and "factor" in sched.required | sched.optional:
            scaling["factor"] = factor
        scaling.update(extra)
        max_positions = max(target, original)
    return RopeConfig(
        config.head_dim,
        config.base,
        rotary_dim=config.rotary_dim,
        interleaved=config.interleaved,
        scaling=scaling,
        max_position_embeddings=max_positions,
    )


def inspect_config(
    config: RopeConfig,
    *,
    model: str = "",
    target_length: int | None = None,
    methods: Sequence[str] = (),
    factor: float | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Inspection:
    """Evaluate the configured method and any requested ones at the target length.

    Args:
        config: the model's RoPE.
        model: a name for the header.
        target_length: the context to plan for; defaults to original length x factor when a factor is
            given, else the config's max_position_embeddings (or the original length).
        methods: rope_types to compare against the configured one (e.g. ["linear", "yarn"]).
        factor: the extension factor the requested methods use; defaults to target_length / original length.
            It applies to requested methods only, so it needs ``methods``.
        extra: more scaling keys for the requested methods (beta_fast, low_freq_factor, ...).

    Raises:
        ValueError: for a bad target length, a factor or extra keys without methods, an unknown method, or
            keys a method rejects.
    """
    original = original_length(config)
    if not methods and (factor is not None or extra):
        what = "factor" if factor is not None else "extra"
        raise ValueError(
            f"{what}: applies to the requested methods, but none was given (methods=[]); name the methods "
            "to compare (e.g. methods=['yarn']), or pass only target_length to see the configured method"
        )
    if target_length is None:
        target_length = int(original * factor) if factor else (config.max_position_embeddings or original)
    target_length = check_int("target_length", target_length)
    if methods and factor is None:
        factor = target_length / original
    plain = RopeConfig(config.head_dim, config.base, rotary_dim=config.rotary_dim)
    theta = plain.inv_freq().numpy()
    reports = [_report(f"configured: {config.rope_type}", config, theta, target_length)]
    for method in methods:
        requested = requested_config(config, method, factor, extra or {}, target_length)
        reports.append(_report(f"requested: {requested.rope_type}", requested, theta, target_length))
    return Inspection(model, config, original, target_length, theta, reports)


def decay_bound(inv_freq: np.ndarray, distances: np.ndarray) -> np.ndarray:
    """RoFormer's long-term-decay bound on |q·k| at each relative distance (Su et al. 2021, section 3.4.3).

    With S_j = sum_{k<j} e^{i r theta_k}, |sum_j h_j (S_{j+1} - S_j)| <= max|h_{j+1} - h_j| * sum_j |S_j|;
    the curve is the relative bound (1 / P) sum_j |S_j|, which falls as r grows. Shape (N,).
    """
    angles = np.asarray(distances, dtype=np.float64)[:, None] * np.asarray(inv_freq)[None, :]  # (N, P)
    partial_sums = np.cumsum(np.exp(1j * angles), axis=1)  # S_1 .. S_P, (N, P)
    return np.abs(partial_sums).mean(axis=1)


def qk_cosine(inv_freq: np.ndarray, distances: np.ndarray) -> np.ndarray:
    """Cosine similarity of R_m q and R_n k for q = k = (1, ..., 1) at distance r = n - m.

    That is mean_i cos(r theta_i).

    Shape (N,). Attention scaling multiplies both vectors alike, so it leaves the cosine unchanged.
    """
    angles = np.asarray(distances, dtype=np.float64)[:, None] * np.asarray(inv_freq)[None, :]  # (N, P)
    return np.cos(angles).mean(axis=1)


_SUPERSCRIPT = str.maketrans("0123456789-", "⁰¹²³⁴⁵⁶⁷⁸⁹⁻")


def _tokens(value: float, _pos: Any = None) -> str:
    """Axis label for a token count: 512, 4k, 128k, 1M for multiples of 1024 (context lengths), 10,000
    or 10⁶ for the powers of ten of a log axis."""
    value = float(value)
    for unit, size in (("M", 1 << 20), ("k", 1 << 10)):
        if value >= size and value % (size // 4) == 0:
            return f"{value / size:g}{unit}"
    if value >= 1e5 and math.log10(value).is_integer():
        return "10" + str(int(math.log10(value))).translate(_SUPERSCRIPT)
    return f"{value:,.0f}" if value >= 1 else f"{value:g}"


def _distance_ticks(original: int, target: int) -> list[int]:
    """Powers of 4 from 1 up to the target, plus the two lengths the plan is about."""
    ticks = {4**k for k in range(32) if 4**k < target} | {original, target}
    # Drop a power of 4 that would crowd a labelled length (within a factor of 2).
    return sorted(
        t
        for t in ticks
        if t in (original, target) or all(max(t, m) / min(t, m) >= 2 for m in (original, target))
    )


def inspection_figure(inspection: Inspection) -> Any:
    """The matplotlib figure of :func:`plot_inspection` (three panels, one legend below them).

    A method whose frequencies equal the unscaled ones (the configured one of an unscaled model) is drawn
    and labelled once, as "... (no scaling)", rather than hiding a separate "no scaling" line under it.

    Raises:
        ImportError: when matplotlib is not installed (``pip install ropekit[plot]``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    curves = []
    unscaled_shown = False
    for m in inspection.methods:
        same = bool(np.array_equal(m.inv_freq, inspection.theta)) and m.attention_scaling == 1.0
        unscaled_shown |= same
        curves.append((m.name + (" (no scaling)" if same else ""), m.inv_freq, m.attention_scaling))
    if not unscaled_shown:
        curves.insert(0, ("no scaling", inspection.theta, 1.0))
    original, target = inspection.original_length, inspection.target_length

    fig, (ax_w, ax_d, ax_c) = plt.subplots(1, 3, figsize=(16, 5.4))
    pairs = np.arange(len(inspection.theta))
    for label, inv, scale in curves:
        with np.errstate(divide="ignore"):
            wavelength = np.where(inv > 0, 2 * math.pi / inv, np.nan)
        ax_w.semilogy(pairs, wavelength, marker=".", ms=3, label=f"{label} (tables ×{scale:.3g})")
    ax_w.axhline(original, color="gray", ls="--", lw=1, label=f"training context ({_tokens(original)})")
    ax_w.axhline(target, color="black", ls=":", lw=1, label=f"target length ({_tokens(target)})")
    ax_w.set(xlabel="pair i", ylabel="wavelength 2π/θ_i (tokens)", title="Wavelength per pair")
    ax_w.yaxis.set_major_formatter(FuncFormatter(_tokens))

    distances = np.unique(np.geomspace(1, target, 400).astype(np.int64))
    for _label, inv, _scale in curves:
        ax_d.semilogx(distances, decay_bound(inv, distances))
        ax_c.semilogx(distances, qk_cosine(inv, distances))
    ax_d.set(
        xlabel="relative distance (tokens)", ylabel="(1/P) Σ|S_j|", title="RoFormer long-term decay bound"
    )
    ax_c.set(
        xlabel="relative distance (tokens)", ylabel="cos(R_m q, R_n k), q = k = 1", title="Rotated q·k cosine"
    )
    for ax in (ax_d, ax_c):
        ax.axvline(original, color="gray", ls="--", lw=1)
        ax.axvline(target, color="black", ls=":", lw=1)
        ax.set_xlim(1, target)
        ax.set_xticks(_distance_ticks(original, target))
        ax.xaxis.set_major_formatter(FuncFormatter(_tokens))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.tick_params(axis="x", labelsize=8)
    ax_w.grid(True, which="major", alpha=0.3)
    ax_d.grid(True, alpha=0.3)
    ax_c.grid(True, alpha=0.3)

    handles, labels = ax_w.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=8, frameon=False)
    rows = math.ceil(len(labels) / 4)
    header = f"{inspection.model}: rope_type {inspection.config.rope_type}, base {inspection.config.base:g}"
    fig.suptitle(header)
    fig.tight_layout(rect=(0, 0.05 + 0.04 * rows, 1, 1))  # the legend's rows sit below the panels
    return fig


def plot_inspection(inspection: Inspection, path: str) -> None:
    """Write a PNG with three panels: wavelengths per pair, the decay bound, and q·k cosine vs distance.

    Raises:
        ImportError: when matplotlib is not installed (``pip install ropekit[plot]``).
        ValueError: when the folder of ``path`` does not exist, or matplotlib cannot write that format.
    """
    folder = Path(path).resolve().parent
    if not folder.is_dir():
        raise ValueError(f"path: folder {str(folder)!r} does not exist (got {str(path)!r})")
    fig = inspection_figure(inspection)
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=100)
    except OSError as err:
        raise ValueError(f"path: cannot write {str(path)!r} ({err.strerror or err})") from None
    finally:
        plt.close(fig)


def layer_plan(config: Any) -> list[dict[str, Any]]:
    """A whole model's RoPE as runs of consecutive layers that share it (:func:`ropekit.model_rope`).

    Returns:
        one dict per run: first / last layer, layer_type, the RoPE (head_dim, rotary_dim, base, rope_type,
        pairing, which features rotate; None for NoPE), sliding_window, attention_chunk_size and whether
        the layers scale queries by position.
    """
    import torch

    from ropekit.layer_rope import model_rope

    runs: list[dict[str, Any]] = []
    probe = torch.tensor([0, 1 << 20])
    for layer in model_rope(config):
        rope = layer.rope
        entry = {
            "layer_type": layer.layer_type,
            "rope": None
            if rope is None
            else {
                "head_dim": rope.head_dim,
                "rotary_dim": rope.rotary_dim,
                "base": rope.base,
                "rope_type": rope.rope_type,
                "interleaved": rope.interleaved,
                "rotary_position": rope.rotary_position,
            },
            "sliding_window": layer.sliding_window,
            "attention_chunk_size": layer.attention_chunk_size,
            "temperature": bool((layer.attention_temperature(probe) != 1).any()),
        }
        if runs and {k: v for k, v in runs[-1].items() if k not in ("first", "last")} == entry:
            runs[-1]["last"] = layer.index
        else:
            runs.append({"first": layer.index, "last": layer.index, **entry})
    return runs
