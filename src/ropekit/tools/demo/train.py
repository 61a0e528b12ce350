"""Training and evaluation for the demo, on one process or many (DistributedDataParallel).

Every rank draws the same global batch from one seeded generator and keeps its own contiguous slice of rows,
and DDP averages the gradients: the update equals one process's on the whole global batch, up to rounding.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ropekit.tools.demo.data import KEY_DIGITS, passkey_windows, sample_batch
from ropekit.tools.demo.model import ByteTransformer, ModelConfig

__all__ = [
    "DistContext",
    "TrainSettings",
    "clone",
    "fresh_model",
    "retrieval_correct",
    "setup_distributed",
    "token_losses",
    "train",
]


@dataclass(frozen=True)
class TrainSettings:
    steps: int
    batch_size: int  # global: split across ranks
    length: int
    lr: float = 3e-3  # high for a tiny model and a short run; warmup keeps the first steps stable
    warmup: int = 20
    min_lr_ratio: float = 0.1  # cosine decays to this fraction of lr
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    # Rows of each global batch that are passkey windows (the rest is the plain byte stream). Their answer
    # loss is added as its own mean, so the KEY_DIGITS answer bytes per row weigh as much as the whole
    # language-modelling loss; otherwise they are ~4% of the bytes and retrieval is learnt far later.
    passkey_rows: int = 0
    # Curriculum: passkeys start within curriculum_gap of the window before the query, where local attention
    # already looks, and spread to any depth over this fraction of the steps. Measured: with depths uniform
    # from the start, the answer loss stayed at ln 10 for 400-1500 steps (no retrieval at all).
    curriculum: float = 0.5
    curriculum_gap: float = 0.1


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_distributed(device: str) -> DistContext:
    """Join the process group torchrun describes in the environment (gloo on CPU, nccl on CUDA), if any.

    Raises:
        ValueError: for an unknown device, or "cuda" when no GPU is visible.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but torch sees no GPU")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        return DistContext(rank, world_size, torch.device("cuda", local_rank))
    return DistContext(rank, world_size, torch.device("cpu"))


def learning_rate(step: int, settings: TrainSettings) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr."""
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    progress = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return settings.lr * (settings.min_lr_ratio + (1.0 - settings.min_lr_ratio) * cosine)


def min_depth(step: int, settings: TrainSettings) -> float:
    """The curriculum: passkey depths at ``step`` are drawn from [min_depth, 1]. The gap between key and
    query starts at ``curriculum_gap`` of the window and widens geometrically to all of it over the first
    ``curriculum`` of the steps."""
    ramp = settings.curriculum * settings.steps
    if step >= ramp or settings.curriculum_gap >= 1.0:
        return 0.0
    return 1.0 - settings.curriculum_gap ** (1.0 - step / ramp)


def train(
    model: ByteTransformer,
    stream: torch.Tensor,
    settings: TrainSettings,
    ctx: DistContext,
    *,
    desc: str = "train",
) -> list[float]:
    """Train ``model`` in place on random windows of ``stream``; returns the global mean loss of every step.

    Raises:
        ValueError: when the global batch does not split evenly across ranks.
    """
    if settings.batch_size % ctx.world_size:
        raise ValueError(
            f"batch_size: expected a multiple of the world size {ctx.world_size}, got {settings.batch_size}"
        )
    if not 0 <= settings.passkey_rows <= settings.batch_size or settings.passkey_rows % ctx.world_size:
        raise ValueError(
            f"passkey_rows: expected a multiple of the world size {ctx.world_size} between 0 and batch_size "
            f"{settings.batch_size}, got {settings.passkey_rows}"
        )
    from tqdm.auto import tqdm

    local = settings.batch_size // ctx.world_size
    local_keys = settings.passkey_rows // ctx.world_size
    # Every rank holds the same number of passkey rows, so the mean over ranks of each rank's two means is
    # the global batch's: the update does not depend on the world size.
    key_rows = slice(ctx.rank * local_keys, (ctx.rank + 1) * local_keys)
    text_rows = slice(ctx.rank * (local - local_keys), (ctx.rank + 1) * (local - local_keys))
    model.to(ctx.device).train()
    wrapped: nn.Module = model
    if ctx.world_size > 1:
        # Rotary and sinusoidal tables are recomputed identically on every rank, so there is nothing to
        # broadcast.
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        wrapped = nn.parallel.DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, betas=(0.9, 0.95),
                                  weight_decay=settings.weight_decay)  # fmt: skip
    generator = torch.Generator().manual_seed(settings.seed)
    losses = []
    bar = tqdm(range(settings.steps), desc=desc, disable=not ctx.is_main, leave=False, dynamic_ncols=True)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, settings)
        text = sample_batch(stream, settings.batch_size - settings.passkey_rows, settings.length, generator)
        batch = text[text_rows]  # (local - local_keys, S + 1)
        if settings.passkey_rows:
            keys, answers = passkey_windows(stream, settings.passkey_rows, settings.length, generator,
                                            min_depth=min_depth(step, settings))  # fmt: skip
            batch = torch.cat([keys[key_rows], batch])  # (local, S + 1)
            answers = answers[key_rows, 1:].to(ctx.device)  # (local_keys, S): answer targets
        batch = batch.to(ctx.device)
        logits = wrapped(batch[:, :-1])  # (local, S, V)
        nll = nn.functional.cross_entropy(
            logits.transpose(1, 2), batch[:, 1:], reduction="none"
        )  # (local, S)
        loss = nll.mean()
        if local_keys:
            loss = loss + nll[:local_keys][answers].mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        reported = loss.detach()
        if ctx.world_size > 1:
            dist.all_reduce(
                reported, op=dist.ReduceOp.AVG if ctx.device.type == "cuda" else dist.ReduceOp.SUM
            )
            if ctx.device.type != "cuda":  # gloo has no AVG
                reported = reported / ctx.world_size
        losses.append(float(reported))
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    bar.close()
    model.eval()
    return losses


@torch.no_grad()
def token_losses(
    model: ByteTransformer, windows: torch.Tensor, batch_size: int, device: torch.device
) -> torch.Tensor:
    """Next-byte cross-entropy (nats) of every target byte of every window.

    Args:
        windows: (N, S + 1) int64 inputs-plus-targets, e.g. from
            :func:`ropekit.tools.demo.data.validation_windows`.
        batch_size: windows per forward pass.

    Shape:
        returns (N, S), float64, on the CPU; ``exp(mean)`` is the perplexity.
    """
    model.eval()
    rows = []
    for start in range(0, windows.shape[0], batch_size):
        batch = windows[start : start + batch_size].to(device)
        logits = model(batch[:, :-1]).float()  # (b, S, V)
        nll = nn.functional.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none")  # (b, S)
        rows.append(nll.double().cpu())
    return torch.cat(rows)


@torch.no_grad()
def retrieval_correct(
    model: ByteTransformer, windows: torch.Tensor, batch_size: int, device: torch.device
) -> torch.Tensor:
    """Whether the model's greedy answer to each passkey window is exactly the key.

    Teacher forcing with argmax at each answer byte equals greedy decoding whenever every earlier byte was
    right, and a wrong byte fails the row either way, so one forward pass decides exact match.

    Args:
        windows: (N, S + 1) from :func:`ropekit.tools.demo.data.passkey_windows`.

    Shape:
        returns (N,) bool, on the CPU.
    """
    model.eval()
    rows = []
    for start in range(0, windows.shape[0], batch_size):
        batch = windows[start : start + batch_size].to(device)
        logits = model(batch[:, :-1])[:, -KEY_DIGITS:]  # (b, KEY_DIGITS, V)
        rows.append((logits.argmax(-1) == batch[:, -KEY_DIGITS:]).all(-1).cpu())
    return torch.cat(rows)


def fresh_model(config: ModelConfig, seed: int, device: torch.device) -> ByteTransformer:
    """A model initialised from ``seed``; all variants get the same initial weights (same seed and shapes)."""
    torch.manual_seed(seed)
    return ByteTransformer(config).to(device)


def clone(model: ByteTransformer) -> ByteTransformer:
    """An independent copy (used to fine-tune without touching the base model)."""
    return copy.deepcopy(model)
