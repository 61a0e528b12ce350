"""`ropekit demo` end to end: train three small byte-level models, evaluate them at 1-8x the training length,
with and without RoPE scaling, and write the report.

Each phase reports through tqdm; rank 0 alone evaluates and writes. docs/demo.md explains the choices.
"""

from __future__ import annotations

import math
import os
import platform
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from ropekit.config import RopeConfig
from ropekit.schedules import SCHEDULES, extension_scaling
from ropekit.tools.demo import report
from ropekit.tools.demo.data import load_corpus, validation_windows
from ropekit.tools.demo.model import VARIANTS, ModelConfig
from ropekit.tools.demo.train import (
    DistContext,
    TrainSettings,
    clone,
    fresh_model,
    setup_distributed,
    token_losses,
    train,
)

__all__ = ["SCALING_METHODS", "DemoSettings", "rope_config_for", "run_demo"]

# Inference-time scaling applied to the trained rope model, in the order the report lists them.
SCALING_METHODS = ("linear", "ntk", "dynamic", "yarn", "llama3")
FINETUNED_METHODS = ("linear", "yarn")
EVAL_MULTIPLES = (1, 2, 4, 8)
# Dynamic NTK adapts to the length by itself; it gets HF's usual fixed factor rather than one per length.
DYNAMIC_FACTOR = 2.0
# The fine-tuned models are tuned at 2L with factor 2 and keep that factor at every evaluation length.
FINETUNE_FACTOR = 2


@dataclass(frozen=True)
class DemoSettings:
    train_length: int = (
        128  # L: short enough to train in a minute on a CPU, long enough for 16 rotary pairs to matter
    )
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    steps: int = 250  # per variant; ~1 minute each on one CPU core
    batch_size: int = 16  # global windows per step
    lr: float = 3e-3
    eval_chunks: int = 16  # validation chunks of 8L bytes; every evaluation length predicts these bytes
    finetune: bool = False
    finetune_steps: int = 60
    variants: tuple[str, ...] = VARIANTS
    evaluate: bool = True
    seed: int = 0
    device: str = "cpu"
    threads: int | None = None  # None: see default_threads
    train_bytes: int = 2_000_000
    validation_bytes: int = 300_000

    def model_config(self, variant: str) -> ModelConfig:
        return ModelConfig(variant=variant, dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads)


# --quick: half the length, a quarter of the width-depth; about 15 s of CPU time in all. One thread: matmuls
# this small gain nothing from a second, and spinning threads waste a shared machine's cores.
QUICK = DemoSettings(train_length=64, dim=64, n_layers=2, n_heads=2, steps=200, eval_chunks=16,
                     finetune_steps=30, threads=1, train_bytes=600_000, validation_bytes=100_000)  # fmt: skip


def _check_settings(s: DemoSettings) -> None:
    for name in ("train_length", "steps", "batch_size", "eval_chunks", "finetune_steps"):
        value = getattr(s, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    if not s.variants or any(v not in VARIANTS for v in s.variants):
        raise ValueError(f"variants: expected a non-empty subset of {VARIANTS}, got {s.variants!r}")
    if s.finetune and "rope" not in s.variants:
        raise ValueError(
            f"finetune: fine-tuning starts from the rope model, so variants must include 'rope', "
            f"got {s.variants}"
        )
    if s.threads is not None and (
        isinstance(s.threads, bool) or not isinstance(s.threads, int) or s.threads <= 0
    ):
        raise ValueError(f"threads: expected a positive integer or None, got {s.threads!r}")


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

    ``factor`` defaults to eval_length / L (PI's choice: stretch the training range over the window).

    Raises:
        ValueError: for an unknown method, or one whose schedule is not registered.
    """
    head_dim, L = s.dim // s.n_heads, s.train_length
    factor = float(eval_length / L if factor is None else factor)
    if method == "rope":
        return RopeConfig(head_dim, 10000.0, max_position_embeddings=L)
    if method not in SCALING_METHODS:
        raise ValueError(f"method: expected one of {['rope', *SCALING_METHODS]}, got {method!r}")
    scaling, max_positions = extension_scaling(method, DYNAMIC_FACTOR if method == "dynamic" else factor, L)
    return RopeConfig(head_dim, 10000.0, scaling=scaling, max_position_embeddings=max_positions)


def _missing_schedules(methods) -> dict[str, str]:
    return {
        m: f"schedule {m!r} is not registered in ropekit.schedules" for m in methods if m not in SCHEDULES
    }


def run_demo(s: DemoSettings, out: Path) -> int:
    """Train, evaluate and report; returns an exit code. Only rank 0 evaluates and writes under ``out``."""
    _check_settings(s)
    started = time.perf_counter()
    ctx = setup_distributed(s.device)
    torch.set_num_threads(s.threads or default_threads(ctx.world_size))
    timings: dict[str, float] = {}

    tick = time.perf_counter()
    corpus = load_corpus(s.train_bytes, s.validation_bytes)
    timings["data"] = time.perf_counter() - tick
    if ctx.is_main:
        print(f"ropekit demo: {len(corpus.train_files)} train files ({corpus.train.numel():,} bytes), "
              f"{len(corpus.validation_files)} validation files from {corpus.root}; "
              f"{ctx.world_size} process(es) on {ctx.device}", flush=True)  # fmt: skip

    models, train_loss = {}, {}
    train_settings = TrainSettings(
        steps=s.steps, batch_size=s.batch_size, length=s.train_length, lr=s.lr, seed=s.seed
    )
    tick = time.perf_counter()
    for variant in s.variants:
        models[variant] = fresh_model(s.model_config(variant), s.seed, ctx.device)
        train_loss[variant] = train(
            models[variant], corpus.train, train_settings, ctx, desc=f"train {variant} @{s.train_length}"
        )
        if ctx.is_main:
            print(f"  trained {variant:<10} final loss {train_loss[variant][-1]:.3f}", flush=True)
    skipped = _missing_schedules(SCALING_METHODS) if "rope" in s.variants else {}
    if s.finetune:
        # Half the windows at twice the length: the same bytes per step as pre-training.
        tuned = replace(train_settings, steps=s.finetune_steps, length=2 * s.train_length, lr=s.lr / 3,
                        warmup=5, batch_size=max(ctx.world_size, s.batch_size // 2))  # fmt: skip
        for method in FINETUNED_METHODS:
            if method in skipped:
                continue
            model = clone(models["rope"])
            model.set_rope(rope_config_for(method, 2 * s.train_length, s, factor=FINETUNE_FACTOR))
            name = f"rope+{method}+finetune"
            train_loss[name] = train(
                model, corpus.train, tuned, ctx, desc=f"finetune {method} @{2 * s.train_length}"
            )
            models[name] = model
    timings["train"] = time.perf_counter() - tick
    if ctx.world_size > 1:
        dist.barrier()
        dist.destroy_process_group()
    if not ctx.is_main:
        return 0

    out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    extra = {"settings": asdict(s), "world_size": ctx.world_size,
             "train_loss": train_loss, "skipped": skipped, "machine": machine_description(ctx),
             "corpus": {"root": corpus.root, "train_files": len(corpus.train_files),
                        "validation_files": list(corpus.validation_files)}}  # fmt: skip
    if s.evaluate:
        tick = time.perf_counter()
        results, extra["extra_loss_by_position"] = _evaluate_all(models, corpus.validation, s, skipped, ctx)
        timings["evaluate"] = time.perf_counter() - tick
    timings["total"] = time.perf_counter() - started
    extra["timings_s"] = {k: round(v, 2) for k, v in timings.items()}
    if s.evaluate and "rope" in models:
        extra["attention_by_distance"] = _attention_profile(
            models["rope"], corpus.validation, s, ctx
        ).tolist()
    report.write_results(out / "results.json", s.train_length, results, extra)
    if s.evaluate:
        _write_report(out, s, results, extra, ctx)
    print(_summary(out, s, results, extra), flush=True)
    return 0


def _evaluate_all(models, stream, s, skipped, ctx: DistContext) -> tuple[list[dict], dict[str, list[float]]]:
    """Perplexity of every (method, length) job; and, per method, how much the loss of each byte of the 8L
    windows differs from that of the same byte predicted within a window of L (the extrapolation cost)."""
    from tqdm.auto import tqdm

    L = s.train_length
    chunk = max(EVAL_MULTIPLES) * L
    windows = {n: validation_windows(stream, n * L, chunk, s.eval_chunks) for n in EVAL_MULTIPLES}
    jobs = []  # (method name, model, eval length, rope config or None)
    for name, model in models.items():
        for n in EVAL_MULTIPLES:
            config = None
            if name.endswith("+finetune"):
                config = rope_config_for(name.split("+")[1], n * L, s, factor=FINETUNE_FACTOR)
            jobs.append((name, model, n, config))
    if "rope" in models:
        for method in SCALING_METHODS:
            if method not in skipped:
                jobs += [
                    (f"rope+{method}", models["rope"], n, rope_config_for(method, n * L, s))
                    for n in EVAL_MULTIPLES
                ]
    results, by_chunk = [], {}
    for name, model, n, config in tqdm(jobs, desc="evaluate", dynamic_ncols=True, leave=False):
        if config is not None:
            model = clone(model)
            model.set_rope(config)
        batch = max(1, 64 // n)  # same bytes per forward pass at every length
        losses = token_losses(model, windows[n], batch, ctx.device)  # (windows, n * L)
        results.append({"method": name, "length": n * L, "perplexity": math.exp(float(losses.mean()))})
        by_chunk[name, n] = losses.reshape(s.eval_chunks, chunk)  # byte-aligned across lengths
    longest = max(EVAL_MULTIPLES)
    extra_loss = {
        name: [round(x, 4) for x in (by_chunk[name, longest] - by_chunk[name, 1]).mean(0).tolist()]
        for name in dict.fromkeys(name for name, _ in by_chunk)
    }
    return results, extra_loss


@torch.no_grad()
def _attention_profile(model, stream, s: DemoSettings, ctx: DistContext):
    windows = validation_windows(stream, s.train_length, s.train_length, 8)
    _, maps = model(windows[:, :-1].to(ctx.device), need_weights=True)
    return report.attention_by_distance(maps)


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def machine_description(ctx: DistContext) -> dict:
    device = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else cpu_name()
    return {"device": str(ctx.device), "device_name": device, "cpu_count": os.cpu_count(),
            "threads": torch.get_num_threads(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__}  # fmt: skip


def _write_report(out: Path, s: DemoSettings, results, extra, ctx) -> None:
    from ropekit.tools.verify import run_checks

    head_dim = s.dim // s.n_heads
    report.plot_perplexity(out / "perplexity_vs_length.png", results, s.train_length)
    report.plot_position_loss(out / "loss_vs_position.png", extra["extra_loss_by_position"], s.train_length)
    if "attention_by_distance" in extra:
        report.plot_attention(out / "attention_vs_distance.png", extra["attention_by_distance"], head_dim,
                              10000.0, max(EVAL_MULTIPLES) * s.train_length)  # fmt: skip
    checks = run_checks(RopeConfig(head_dim, 10000.0))
    report.write_report(out / "report.md", report.report_sections(s, results, extra, checks))


def _summary(out: Path, s: DemoSettings, results, extra) -> str:
    lines = ["", f"ropekit demo: trained at L = {s.train_length} ({', '.join(s.variants)}), "
             f"{extra['timings_s']['total']:.0f} s on {extra['machine']['device_name']} "
             f"x{extra['world_size']} process(es)"]  # fmt: skip
    if results:
        lines += ["validation perplexity per byte:", report.format_table(results, s.train_length)]
    for method, why in extra["skipped"].items():
        lines.append(f"skipped rope+{method}: {why}")
    files = sorted(p.name for p in out.iterdir())
    lines.append(f"wrote {out}/: {', '.join(files)}")
    return "\n".join(lines)
