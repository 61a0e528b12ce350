"""Issues 17's and 25's CPU targets measured in thread CPU time, for a machine shared with other jobs.

Usage:

    python benchmarks/cpu_time.py [--shapes decode-1 tiny decode prefill-4k] [--rounds 7]

Wall-clock ratios move with the load on a shared 2-core machine (``ropekit bench`` reports them, and is the
figure of record on an idle machine). This script times each pair of a target with ``time.thread_time()``:
the CPU time of the calling thread, which does not count the time the thread waits for a core. With one
thread (``torch.set_num_threads(1)``: OpenMP and PyTorch then run every call on this thread) it is stable to a
few percent under a load average of 25. Rows are timed in interleaved rounds; each figure is the minimum over
rounds of the mean per call. It does not see what two threads would gain, nor the memory bandwidth other jobs
take; the page faults of a fresh output are counted (they run on the thread).

Shapes and rows are ``ropekit bench``'s (``ropekit.tools.bench``): Llama-3-8B heads (32 q, 8 k, head_dim 128)
in float32; "Meta complex" is Meta's LLaMA form, "HF eager" transformers' ``apply_rotary_pos_emb``; the
fused rows and their unfused sequences are ``ropekit.tools.bench_fused``'s (rope+cache: an "nhd" cache,
in place; decode-1 has an int offset, decode 64 sequences with one offset each). At prefill-4k each fusion
is timed against the floor of its own bytes (``floor <name>``: a ``copy_`` of filled buffers).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

import ropekit
from ropekit.tools.bench import SHAPES, _hf_tables, make_case, meta_complex_rotary
from ropekit.tools.bench_fused import FUSED_ROWS, copy_floor, random_bytes

# (shape, row, baseline row, at most): issue 17's targets, each a ratio of two rows of one run.
TARGETS = [
    ("decode-1", "out of place", "Meta complex", 0.8),
    ("decode-1", "in place", "Meta complex", 0.7),
    ("decode", "out of place", "Meta complex", 1.0),
    ("decode", "in place", "Meta complex", 0.75),
    ("tiny", "out of place", "Meta complex", 1.0),
    ("decode-1", "compat.hf", "HF eager", 0.8),
    ("tiny", "compat.hf", "HF eager", 0.8),
    ("prefill-4k", "out of place", "clone", 1.1),
    ("prefill-4k", "in place", "copy_", 0.7),
    ("decode-1", "RotaryEmbedding", "out of place", 1.15),
    ("decode", "RotaryEmbedding", "out of place", 1.15),  # issue 25: per-sequence offsets too
    # issue 25: the module of Hugging Face's layout against the functional call on the same bhsd views
    ("decode-1", "RotaryEmbedding bhsd", "out of place bhsd", 1.15),
    ("decode", "RotaryEmbedding bhsd", "out of place bhsd", 1.15),
    ("decode-1", "compat.vllm", "in place", 1.1),
    # issue 25: each serving fusion against the unfused sequence it replaces (ropekit.tools.bench_fused)
    ("decode-1", "fused rope+cache", "unfused rope+cache", 0.6),
    ("decode", "fused rope+cache", "unfused rope+cache", 0.6),
    ("decode-1", "fused qknorm+rope", "unfused qknorm+rope", 0.6),
    ("decode", "fused qknorm+rope", "unfused qknorm+rope", 0.6),
    # issue 25 at prefill: each fusion against a copy of its own bytes (bench_fused's floor, buffers filled)
    ("prefill-4k", "fused rope+cache", "floor rope+cache", 1.15),
    ("prefill-4k", "fused rope+fp8", "floor rope+fp8", 1.15),
    ("prefill-4k", "fused qknorm+rope", "floor qknorm+rope", 1.15),
]
FUSED = ("rope+cache", "qknorm+rope", "rope+fp8")  # the fusions timed at decode (rope+fp8: no target)


def rows(shape: str) -> dict[str, Callable[[], object]]:
    """The calls to time on one shape: ropekit's (apply_rotary_qk, backend "auto"), the module, the peers."""
    case = make_case(SHAPES[shape], torch.float32, torch.device("cpu"))
    q, k, cos, sin, kw = case.q, case.k, case.cos, case.sin, case.ropekit_kwargs
    q_in, k_in = q.clone(), k.clone()
    calls: dict[str, Callable[[], object]] = {
        "out of place": lambda: ropekit.apply_rotary_qk(q, k, cos, sin, **kw),
        "in place": lambda: ropekit.apply_rotary_qk(q_in, k_in, cos, sin, inplace=True, **kw),
        "copy_": copy_floor((q, k)),
        "clone": lambda: (q.clone(), k.clone()),
    }
    if shape.startswith("prefill"):
        for row in FUSED_ROWS:  # each fusion and the floor of its own bytes
            pair = row.setup(case)
            floor = pair.floor_tensors or (random_bytes(pair.fused_bytes // 2, q.device),)
            calls[f"fused {row.name}"], calls[f"floor {row.name}"] = pair.fused, copy_floor(floor)
        return calls
    rope = ropekit.RotaryEmbedding(head_dim=case.shape.head_dim, base=500000.0)
    angle = case.angle[case.positions].unsqueeze(2)  # (B, S, 1, D/2)
    freqs_cis = torch.polar(torch.ones_like(angle), angle)
    calls["RotaryEmbedding"] = lambda: rope(q, k, **kw)
    # Hugging Face's layout: (B, H, S, D) tensors; the functional call takes their (B, S, H, D) views
    q_bhsd, k_bhsd = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    q_view, k_view = q_bhsd.transpose(1, 2), k_bhsd.transpose(1, 2)
    rope_bhsd = ropekit.RotaryEmbedding(head_dim=case.shape.head_dim, base=500000.0, layout="bhsd")
    calls["RotaryEmbedding bhsd"] = lambda: rope_bhsd(q_bhsd, k_bhsd, **kw)
    calls["out of place bhsd"] = lambda: ropekit.apply_rotary_qk(q_view, k_view, cos, sin, **kw)
    calls["Meta complex"] = lambda: (meta_complex_rotary(q, freqs_cis), meta_complex_rotary(k, freqs_cis))
    from ropekit.compat.vllm import rotary_embedding

    tokens = q.shape[0] * q.shape[1]
    cache = torch.cat([cos, sin], dim=-1)  # vLLM's (P, R) [cos | sin] cache
    flat = case.positions.reshape(-1)  # (T,)
    q_flat, k_flat = q_in.view(tokens, -1), k_in.view(tokens, -1)  # vLLM's (T, H * D), the in-place tensors
    head = q.shape[-1]
    calls["compat.vllm"] = lambda: rotary_embedding(flat, q_flat, k_flat, head, cache, True)
    for row in FUSED_ROWS:
        if row.name in FUSED:
            pair = row.setup(case)
            calls[f"fused {row.name}"], calls[f"unfused {row.name}"] = pair.fused, pair.unfused
    try:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    except ImportError:
        return calls
    from ropekit.compat.hf import apply_rotary_pos_emb as compat_hf

    hf_cos, hf_sin = _hf_tables(case, q.dtype)  # (B, S, D) per-token rows, as HF's rotary module returns
    calls["HF eager"] = lambda: apply_rotary_pos_emb(q, k, hf_cos, hf_sin, unsqueeze_dim=2)
    calls["compat.hf"] = lambda: compat_hf(q, k, hf_cos, hf_sin, unsqueeze_dim=2)
    return calls


def measure(calls: dict[str, Callable[[], object]], rounds: int, seconds: float = 0.02) -> dict[str, float]:
    """Microseconds of thread CPU time per call: the minimum over interleaved rounds."""
    for fn in calls.values():  # warm up: plans, tables, first-touch of outputs
        fn()
        fn()
    per_block = {}
    for name, fn in calls.items():  # calls per block: about `seconds` of CPU each
        start, n = time.thread_time(), 0
        while time.thread_time() - start < seconds:
            fn()
            n += 1
        per_block[name] = max(n, 1)
    best = {name: float("inf") for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            n = per_block[name]
            start = time.thread_time()
            for _ in range(n):
                fn()
            best[name] = min(best[name], (time.thread_time() - start) / n * 1e6)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["decode-1", "tiny", "decode", "prefill-4k"])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = {shape: measure(rows(shape), args.rounds) for shape in args.shapes}
    finally:
        torch.set_num_threads(threads)
    for shape, times in results.items():
        print(f"== {shape} (us of thread CPU time per call)")
        for name, us in times.items():
            print(f"  {name:16s} {us:10.2f}")
    print("== targets")
    for shape, row, base, limit in TARGETS:
        times = results.get(shape, {})
        if row in times and base in times:
            ratio = times[row] / times[base]
            verdict = "met" if ratio <= limit else "NOT met"
            print(f"  {shape:10s} {row:16s} / {base:14s} = {ratio:5.2f}  (target <= {limit}: {verdict})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
