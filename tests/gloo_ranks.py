"""The multi-process tests' harness: run a function on N forked gloo processes and collect what each returned.

Forked, the children inherit the imported torch and ropekit instead of importing them again (seconds each on a
loaded machine). Each test file spawns once, in a module fixture, and its tests check what the ranks found.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_ranks"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out: str, worker: Callable[[int], dict]) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        torch.save(worker(rank), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def run_ranks(worker: Callable[[int], dict], out_dir: Path, world: int = 2) -> list[dict]:
    """worker(rank) -> results, run in each of `world` processes of one gloo group; the results by rank."""
    out = str(Path(out_dir) / "result")
    args = (world, _free_port(), out, worker)
    mp.start_processes(_entry, args=args, nprocs=world, join=True, start_method="fork")
    return [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(world)]
