"""`ropekit demo` end to end: train three small byte-level models, evaluate them at 1-8x the training length,
with and without RoPE scaling, and write the report.

Each phase reports through tqdm; rank 0 alone evaluates and writes. docs/demo.md explains the choices.
"""

from __future__ import annotations

import math
import os
import platform
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ropekit.config import RopeConfig
from ropekit.schedules import extension_scaling
from ropekit.tools.demo import report
from ropekit.tools.demo.data import load_corpus, passkey_windows, validation_windows
from ropekit.tools.demo.model import VARIANTS, ModelConfig
from ropekit.tools.demo.train import (
    DistContext,
    TrainSettings,
    clone,
    fresh_model,
    retrieval_correct,
    setup_distributed,
    token_losses,
    train,
)
from ropekit.validation import check_int

__all__ = [
    "EVAL_MULTIPLES",
    "SCALING_METHODS",
    "DemoSettings",
    "rewrite_report",
    "rope_config_for",
    "run_demo",
]

# Inference-time scaling applied to the trained rope model, in the order the report lists them.
SCALING_METHODS = ("linear", "ntk", "dynamic", "yarn", "llama3")
# Fine-tuned at finetune_factor * L: PI (linear) and YaRN, the two the passkey papers fine-tune.
FINETUNED_METHODS = ("linear", "yarn")
EVAL_MULTIPLES = (1, 2, 4, 8)
RETRIEVAL_DEPTHS = (0.1, 0.5, 0.9)  # near the start, the middle, near the query


@dataclass(frozen=True)
class DemoSettings:
    train_length: int = 128  # L: short enough to train in a minute on a CPU, long enough for 16 rotary pairs
    dim: int = 128
    n_layers: int = 2  # one layer copies the key (previous-token keys), one more for the byte statistics
    n_heads: int = 4
    steps: int = 600  # per variant; retrieval is learnt after ~300 (docs/demo.md); ~50 s each on one core
    batch_size: int = 16  # global windows per step
    passkey_fraction: float = 0.5  # of each batch's windows; docs/demo.md says why this much
    lr: float = 3e-3
    eval_chunks: int = 16  # validation chunks of (longest multiple) * L bytes; every length predicts these
    eval_multiples: tuple[int, ...] = EVAL_MULTIPLES  # evaluation lengths, in units of L
    retrieval_depths: tuple[float, ...] = RETRIEVAL_DEPTHS
    retrieval_examples: int = 32  # per (method, length, depth) and seed
    finetune: bool = True
    finetune_steps: int = 60
    finetune_factor: int = 2  # tuned at this many L with this scaling factor, and evaluated with it
    dynamic_factor: float = 2.0  # dynamic NTK adapts to the length itself: HF's usual fixed factor
    rope_base: float = 10000.0  # RoFormer's (Su et al. 2021)
    variants: tuple[str, ...] = VARIANTS
    evaluate: bool = True
    seed: int = 0
    seeds: int = 1  # seeds seed, seed + 1, ...: each trains and evaluates every model afresh
    jobs: int | None = None  # seeds run at once in separate processes; None: one per core (threads each)
    device: str = "cpu"
    threads: int | None = None  # None: see default_threads
    train_bytes: int = 2_000_000
    validation_bytes: int = 300_000

    def model_config(self, variant: str) -> ModelConfig:
        return ModelConfig(variant=variant, dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads,
                           rope_base=self.rope_base)  # fmt: skip


# --quick: half the length, a quarter of the width-depth, fewer trials. One thread: matmuls this small gain
# nothing from a second, and spinning threads waste a shared machine's cores.
QUICK = DemoSettings(train_length=64, dim=64, n_layers=2, n_heads=2, steps=200, eval_chunks=8,
                     retrieval_examples=8, finetune_steps=30, threads=1, train_bytes=600_000,
                     validation_bytes=100_000)  # fmt: skip


def _check_settings(s: DemoSettings) -> None:
    for name in ("train_length", "steps", "batch_size", "eval_chunks", "finetune_steps", "seeds",
                 "retrieval_examples", "finetune_factor"):  # fmt: skip
        check_int(name, getattr(s, name), minimum=1, expected="a positive integer")
    if isinstance(s.passkey_fraction, bool) or not 0.0 <= s.passkey_fraction <= 1.0:
        raise ValueError(f"passkey_fraction: expected a number in [0, 1], got {s.passkey_fraction!r}")
    if not s.eval_multiples or any(isinstance(m, bool) or not isinstance(m, int) or m < 1
                                   for m in s.eval_multiples):  # fmt: skip
        raise ValueError(f"eval_multiples: expected positive integers, got {s.eval_multiples!r}")
    if not s.retrieval_depths or any(not 0.0 <= d <= 1.0 for d in s.retrieval_depths):
        raise ValueError(f"retrieval_depths: expected numbers in [0, 1], got {s.retrieval_depths!r}")
    if not s.variants or any(v not in VARIANTS for v in s.variants):
        raise ValueError(f"variants: expected a non-empty subset of {VARIANTS}, got {s.variants!r}")
    if s.finetune and "rope" not in s.variants:
        raise ValueError(
            f"finetune: fine-tuning starts from the rope model, so variants must include 'rope', "
            f"got {s.variants}"
        )
    for name in ("threads", "jobs"):
        if getattr(s, name) is not None:
            check_int(name, getattr(s, name), minimum=1, expected="a positive integer or None")


def default_threads(world_size: int) -> int:
    """Torch threads per rank: the rank's share of the cores when it is 4 or more, else 1.

    With a share of 2 or 3 cores, anything else running on the machine stalls intra-op threads at their
    barriers: measured here, --quick took 237 s with 2 threads on a busy 2-core machine and 16 s with 1.
    """
    share = (os.cpu_count() or 1) // world_size
    return share if share >= 4 else 1


def rope_config_for(
    method: str, eval_length: int, s: DemoSettings, *, factor: float | None = None
) -> RopeConfig:
    """The RopeConfig the trained rope model is evaluated with for ``method`` at ``eval_length``.

    ``factor`` defaults to eval_length / L (PI's choice: stretch the training range over the window);
    dynamic NTK always gets ``s.dynamic_factor``.

    Raises:
        ValueError: for an unknown method.
    """
    head_dim, L = s.dim // s.n_heads, s.train_length
    factor = float(eval_length / L if factor is None else factor)
    if method == "rope":
        return RopeConfig(head_dim, s.rope_base, max_position_embeddings=L)
    if method not in SCALING_METHODS:
        raise ValueError(f"method: expected one of {['rope', *SCALING_METHODS]}, got {method!r}")
    scaling, max_positions = extension_scaling(method, s.dynamic_factor if method == "dynamic" else factor, L)
    return RopeConfig(head_dim, s.rope_base, scaling=scaling, max_position_embeddings=max_positions)


def run_demo(s: DemoSettings, out: Path) -> int:
    """Train, evaluate and report; returns an exit code. Only rank 0 evaluates and writes under ``out``."""
    _check_settings(s)
    started = time.perf_counter()
    ctx = setup_distributed(s.device)
    torch.set_num_threads(s.threads or default_threads(ctx.world_size))
    timings: dict[str, float] = {}
    load = _load_average()

    tick = time.perf_counter()
    corpus = load_corpus(s.train_bytes, s.validation_bytes)
    timings["data"] = time.perf_counter() - tick
    seeds = [s.seed + k for k in range(s.seeds)]
    if ctx.is_main:
        print(f"ropekit demo: {len(corpus.train_files)} train files ({corpus.train.numel():,} bytes), "
              f"{len(corpus.validation_files)} validation files from {corpus.root}; "
              f"{_processes(ctx.world_size)} on {ctx.device}; seeds {seeds}", flush=True)  # fmt: skip

    tick = time.perf_counter()
    jobs = s.jobs or min(len(seeds), max(1, (os.cpu_count() or 1) // torch.get_num_threads()))
    parallel = ctx.world_size == 1 and jobs > 1
    if parallel:
        per_seed = _seeds_in_parallel(s, seeds, jobs)
    else:
        per_seed = [_one_seed(s, seed, corpus, ctx) for seed in seeds]
    timings["train and evaluate"] = time.perf_counter() - tick
    for key in ("train", "evaluate"):
        timings[key] = sum(p["timings"][key] for p in per_seed)
    if ctx.world_size > 1:
        dist.barrier()
        dist.destroy_process_group()
    if not ctx.is_main:
        return 0

    out.mkdir(parents=True, exist_ok=True)
    results = _pool_perplexity([p["results"] for p in per_seed])
    retrieval = _pool_retrieval([p["counts"] for p in per_seed])
    train_loss = per_seed[0]["train_loss"]
    extra = {"settings": asdict(s), "seeds": seeds, "world_size": ctx.world_size, "train_loss": train_loss,
             "final_train_loss": {k: v[-1] for k, v in train_loss.items()},
             "final_train_loss_by_seed": {k: [p["train_loss"][k][-1] for p in per_seed] for k in train_loss},
             "retrieval": retrieval, "machine": machine_description(ctx, load),
             "seed_processes": jobs if parallel else 1,
             "skipped": {},  # kept for readers of older results: every scaling schedule is registered
             "corpus": {"root": corpus.root, "train_files": len(corpus.train_files),
                        "validation_files": list(corpus.validation_files)}}  # fmt: skip
    if s.evaluate:
        names = per_seed[0]["extra_loss"].keys()
        extra["extra_loss_by_position"] = {
            name: [round(float(x), 4) for x in np.mean([p["extra_loss"][name] for p in per_seed], axis=0)]
            for name in names
        }
    if per_seed[0]["attention"] is not None:
        extra["attention_by_distance"] = per_seed[0]["attention"]
        extra["attention_by_distance_long"] = per_seed[0]["attention_long"]
    timings["total"] = time.perf_counter() - started
    extra["timings_s"] = {k: round(v, 2) for k, v in timings.items()}
    report.write_results(out / "results.json", s.train_length, results, extra)
    if s.evaluate:
        _write_report(out, s, results, retrieval, extra)
    print(_summary(out, s, results, retrieval, extra), flush=True)
    return 0


def _one_seed(s: DemoSettings, seed: int, corpus, ctx: DistContext) -> dict:
    """Train every model for one seed and (rank 0) evaluate them."""
    tick = time.perf_counter()
    models, train_loss = _train_all(s, seed, corpus, ctx)
    out = {"train_loss": train_loss, "results": [], "counts": {}, "extra_loss": {}, "attention": None,
           "attention_long": None,
           "timings": {"train": time.perf_counter() - tick, "evaluate": 0.0}}  # fmt: skip
    if ctx.is_main and s.evaluate:
        tick = time.perf_counter()
        out["results"], out["counts"], out["extra_loss"] = _evaluate_all(
            models, corpus.validation, s, seed, ctx
        )
        if "rope" in models:
            out["attention"] = _attention_profile(models["rope"], corpus.validation, s.train_length, 8, ctx)
            longest = max(s.eval_multiples) * s.train_length
            out["attention_long"] = _attention_profile(models["rope"], corpus.validation, longest, 2, ctx)
        out["timings"]["evaluate"] = time.perf_counter() - tick
    return out


def _seed_worker(s: DemoSettings, seed: int, threads: int) -> dict:
    # A worker process of _seeds_in_parallel: its own thread budget, and no progress bars (several processes
    # would overwrite each other's line); the parent prints a line per finished model.
    import sys

    torch.set_num_threads(threads)
    sys.stderr = open(os.devnull, "w")
    corpus = load_corpus(s.train_bytes, s.validation_bytes)
    return _one_seed(s, seed, corpus, DistContext())


def _seeds_in_parallel(s: DemoSettings, seeds: list[int], jobs: int) -> list[dict]:
    """Each seed in its own process (spawned; ``jobs`` at a time), for a single-process run with cores to
    spare: seeds are independent, and one thread per model is what these small matmuls use well."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    threads = torch.get_num_threads()
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_seed_worker, s, seed, threads) for seed in seeds]
        return [f.result() for f in futures]


def _train_all(s: DemoSettings, seed: int, corpus, ctx: DistContext) -> tuple[dict, dict[str, list[float]]]:
    """Every variant from the same initial weights, then the fine-tuned copies of the rope model."""
    models, train_loss = {}, {}
    keys = passkey_rows(s.passkey_fraction, s.batch_size, ctx.world_size)
    settings = TrainSettings(steps=s.steps, batch_size=s.batch_size, length=s.train_length, lr=s.lr,
                             seed=seed, passkey_rows=keys)  # fmt: skip
    for variant in s.variants:
        models[variant] = fresh_model(s.model_config(variant), seed, ctx.device)
        train_loss[variant] = train(
            models[variant],
            corpus.train,
            settings,
            ctx,
            desc=f"seed {seed}: train {variant} @{s.train_length}",
        )
        if ctx.is_main:
            print(
                f"  seed {seed}: trained {variant:<10} final loss {train_loss[variant][-1]:.3f}", flush=True
            )
    if s.finetune:
        # The same bytes per step as pre-training, in windows finetune_factor times longer (the passkey rows
        # keep their share), without the curriculum: the copy circuit exists by now.
        rows = max(ctx.world_size, s.batch_size // s.finetune_factor)
        keys = passkey_rows(s.passkey_fraction, rows, ctx.world_size)
        length = s.finetune_factor * s.train_length
        tuned = replace(settings, steps=s.finetune_steps, length=length, lr=s.lr / 3,
                        warmup=5, batch_size=rows, passkey_rows=keys, curriculum=0.0)  # fmt: skip
        for method in FINETUNED_METHODS:
            model = clone(models["rope"])
            model.set_rope(rope_config_for(method, tuned.length, s, factor=s.finetune_factor))
            name = f"rope+{method}+finetune"
            train_loss[name] = train(model, corpus.train, tuned, ctx,
                                     desc=f"seed {seed}: finetune {method} @{tuned.length}")  # fmt: skip
            models[name] = model
    return models, train_loss


def passkey_rows(fraction: float, batch_size: int, world_size: int) -> int:
    """Passkey windows in a global batch: the fraction, rounded down to a multiple of the world size (every
    rank holds as many), and at least one per rank when the fraction is positive."""
    rows = int(fraction * batch_size) // world_size * world_size
    return max(rows, world_size) if fraction > 0 else 0


def _jobs(models: dict, s: DemoSettings):
    """(method name, model, multiple of L, rope config or None) for every evaluation."""
    L = s.train_length
    jobs = []
    for name, model in models.items():
        for n in s.eval_multiples:
            config = None
            if name.endswith("+finetune"):
                config = rope_config_for(name.split("+")[1], n * L, s, factor=s.finetune_factor)
            jobs.append((name, model, n, config))
    if "rope" in models:
        for method in SCALING_METHODS:
            jobs += [(f"rope+{method}", models["rope"], n, rope_config_for(method, n * L, s))
                     for n in s.eval_multiples]  # fmt: skip
    return jobs


def _evaluate_all(models, stream, s: DemoSettings, seed: int, ctx: DistContext):
    """One seed's numbers: perplexity rows; retrieval counts {(method, length, depth): (correct, n)}; and,
    per method, how much the loss of each byte of the longest windows differs from that of the same byte
    predicted within a window of L (the extrapolation cost)."""
    from tqdm.auto import tqdm

    L = s.train_length
    longest = max(s.eval_multiples)
    chunk = longest * L
    windows = {n: validation_windows(stream, n * L, chunk, s.eval_chunks) for n in s.eval_multiples}
    # Fresh trials per seed (pooled over seeds they stay independent); the same ones for every method.
    trials = {
        (n, d): passkey_windows(stream, s.retrieval_examples, n * L,
                                torch.Generator().manual_seed(1_000_003 * (seed + 1) + 1009 * n + k), d)[0]
        for n in s.eval_multiples for k, d in enumerate(s.retrieval_depths)
    }  # fmt: skip
    results, counts, by_chunk = [], {}, {}
    for name, model, n, config in tqdm(_jobs(models, s), desc=f"seed {seed}: evaluate", dynamic_ncols=True,
                                       leave=False):  # fmt: skip
        if config is not None:
            model = clone(model)
            model.set_rope(config)
        batch = max(1, 64 // n)  # same bytes per forward pass at every length
        losses = token_losses(model, windows[n], batch, ctx.device)  # (windows, n * L)
        results.append({"method": name, "length": n * L, "perplexity": math.exp(float(losses.mean()))})
        by_chunk[name, n] = losses.reshape(s.eval_chunks, chunk)  # byte-aligned across lengths
        for d in s.retrieval_depths:
            correct = retrieval_correct(model, trials[n, d], batch, ctx.device)
            counts[name, n * L, d] = (int(correct.sum()), correct.numel())
    extra_loss = {}
    if 1 in s.eval_multiples:
        extra_loss = {
            name: (by_chunk[name, longest] - by_chunk[name, 1]).mean(0).tolist()
            for name in dict.fromkeys(name for name, _ in by_chunk)
        }
    return results, counts, extra_loss


def _pool_perplexity(per_seed: list[list[dict]]) -> list[dict]:
    """Mean, every seed's value and (from two seeds) the sample standard deviation of each (method, length)
    perplexity."""
    if not per_seed or not per_seed[0]:
        return []
    rows = []
    for k, first in enumerate(per_seed[0]):
        values = [float(seed_rows[k]["perplexity"]) for seed_rows in per_seed]
        row = {"method": first["method"], "length": first["length"], "perplexity": float(np.mean(values)),
               "perplexity_by_seed": values}  # fmt: skip
        if len(values) > 1:
            row["perplexity_std"] = float(np.std(values, ddof=1))
        rows.append(row)
    return rows


def _pool_retrieval(per_seed: list[dict]) -> list[dict]:
    """Trials of every seed pooled per (method, length, depth), with the Wilson interval, the key's distance
    from the query and each seed's count."""
    if not per_seed or not per_seed[0]:
        return []
    return [
        report.retrieval_row(method, length, depth, sum(c[key][0] for c in per_seed),
                             sum(c[key][1] for c in per_seed),
                             correct_by_seed=[c[key][0] for c in per_seed],
                             n_by_seed=[c[key][1] for c in per_seed])
        for key in per_seed[0]
        for method, length, depth in [key]
    ]  # fmt: skip


@torch.no_grad()
def _attention_profile(model, stream, length: int, n_windows: int, ctx: DistContext) -> list[float]:
    """The model's mean attention per relative distance, over ``n_windows`` validation windows of
    ``length``."""
    windows = validation_windows(stream, length, length, n_windows)
    _, maps = model(windows[:, :-1].to(ctx.device), need_weights=True)
    return report.attention_by_distance(maps).tolist()


def _processes(world_size: int) -> str:
    return f"{world_size} process" + ("" if world_size == 1 else "es")


def _load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def machine_description(ctx: DistContext, load: str = "n/a") -> dict:
    device = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else cpu_name()
    return {"device": str(ctx.device), "device_name": device, "cpu_count": os.cpu_count(),
            "threads": torch.get_num_threads(), "platform": platform.platform(), "load": load,
            "python": platform.python_version(), "torch": torch.__version__}  # fmt: skip


def _write_report(out: Path, s: DemoSettings, results, retrieval, extra) -> None:
    """report.md and the plots under ``out``, from finished numbers only."""
    from ropekit.tools.demo import plots
    from ropekit.tools.verify import run_checks

    head_dim = s.dim // s.n_heads
    plots.plot_perplexity(out / "perplexity_vs_length.png", results, s.train_length)
    if retrieval:
        plots.plot_retrieval_heatmap(out / "retrieval_heatmap.png", retrieval, s.train_length)
        plots.plot_retrieval(out / "retrieval_vs_length.png", retrieval, s.train_length)
    if extra.get("extra_loss_by_position"):
        plots.plot_position_loss(
            out / "loss_vs_position.png",
            extra["extra_loss_by_position"],
            s.train_length,
            report.rotations_by_window(s),
        )
    if "attention_by_distance" in extra:
        plots.plot_attention(out / "attention_vs_distance.png", extra["attention_by_distance"], head_dim,
                             s.rope_base, max(s.eval_multiples) * s.train_length,
                             extra.get("attention_by_distance_long"))  # fmt: skip
    config = RopeConfig(head_dim, s.rope_base)
    checks = run_checks(config)
    sections = report.report_sections(
        s, results, retrieval, extra, checks, report.bfloat16_ulp_errors(config)
    )
    report.write_report(out / "report.md", sections)


def settings_from_results(data: dict) -> DemoSettings:
    """The DemoSettings a results.json was written with (JSON lists back to tuples; keys this version does not
    know are dropped, keys it added since take their defaults).

    Raises:
        ValueError: when the stored settings fail the demo's checks.
    """
    known = {f.name for f in fields(DemoSettings)}
    stored = {k: tuple(v) if isinstance(v, list) else v for k, v in data["settings"].items() if k in known}
    settings = DemoSettings(**stored)
    _check_settings(settings)
    return settings


def rewrite_report(out: Path) -> int:
    """``ropekit demo --report-only``: report.md and the plots again from ``out``/results.json, no training.

    Raises:
        ValueError: when ``out`` holds no results.json of the demo, or one written without evaluation.
    """
    data = report.read_results(Path(out) / "results.json")
    s = settings_from_results(data)
    if not data["results"]:
        raise ValueError(
            f"out: {str(out)!r} holds the results of a --train-only run; there is nothing to report"
        )
    extra = {k: v for k, v in data.items() if k not in ("train_length", "results", "retrieval")}
    _write_report(Path(out), s, data["results"], data["retrieval"], extra)
    print(_summary(Path(out), s, data["results"], data["retrieval"], extra), flush=True)
    return 0


def _summary(out: Path, s: DemoSettings, results, retrieval, extra) -> str:
    machine = extra["machine"]
    lines = ["", f"ropekit demo: trained at L = {s.train_length} ({', '.join(s.variants)}), "
             f"seeds {extra['seeds']}, {extra['timings_s']['total']:.0f} s on {machine['device_name']}, "
             f"{_processes(extra['world_size'])}"]  # fmt: skip
    if retrieval:
        lines += ["passkey retrieval (exact match, pooled over seeds, and over depths where they agree; "
                  "95% Wilson interval; report.md reads it by the key's distance):",
                  report.format_retrieval_table(retrieval, s.train_length)]  # fmt: skip
    if results:
        lines += ["validation perplexity per byte:", report.format_table(results, s.train_length)]
    files = sorted(p.name for p in out.iterdir())
    lines.append(f"wrote {out}/: {', '.join(files)}")
    return "\n".join(lines)
