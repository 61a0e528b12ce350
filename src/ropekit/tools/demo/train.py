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

from ropekit.tools.demo.data import sample_batch
from ropekit.tools.demo.model import ByteTransformer, ModelConfig

__all__ = [
    "DistContext",
    "TrainSettings",
    "clone",
    "fresh_model",
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
    from tqdm.auto import tqdm

    local = settings.batch_size // ctx.world_size
    rows = slice(ctx.rank * local, (ctx.rank + 1) * local)
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
        batch = sample_batch(stream, settings.batch_size, settings.length, generator)[rows].to(ctx.device)
        logits = wrapped(batch[:, :-1])  # (local, S, V)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
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


def fresh_model(config: ModelConfig, seed: int, device: torch.device) -> ByteTransformer:
    """A model initialised from ``seed``; all variants get the same initial weights (same seed and shapes)."""
    torch.manual_seed(seed)
    return ByteTransformer(config).to(device)


def clone(model: ByteTransformer) -> ByteTransformer:
    """An independent copy (used to fine-tune without touching the base model)."""
    return copy.deepcopy(model)
