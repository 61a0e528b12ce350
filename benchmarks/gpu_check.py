"""The one prepared GPU run: correctness of the Triton kernel on the device, no host syncs and CUDA-graph
capture of a decode step, then the bf16 benchmark.

Usage (on a machine with a CUDA GPU and Triton):

    python benchmarks/gpu_check.py [--out DIR] [--repeats N] [--shapes ...] [--no-bench]

Step 1 compares backend="triton" with backend="torch" (float64 math on upcast inputs) for every dtype, pair
layout, in-place mode, partial rotary and position mode, checks the gradients, and runs the kernel inside
torch.compile(fullgraph=True) with inductor. Any failure stops the run before timing.
Step 2 (issue 10, item 2) runs one steady-state decode step (one Llama-3-8B token) through apply_rotary,
apply_rotary_qk and RotaryEmbedding.forward, with an int offset, an offsets tensor and a positions tensor,
under ``torch.cuda.set_sync_debug_mode("error")``: any device-to-host copy or synchronization in the call
is an error. Each step runs once first (warm-up: kernel compilation, table growth). Then it captures a decode
step of apply_rotary_qk and of RotaryEmbedding in a ``torch.cuda.CUDAGraph``, replays it with new q, k and
offsets written into the captured buffers, and compares each replay with the eager result.
Step 3 runs the benchmark in bfloat16 and writes gpu_bench.csv and gpu_bench.png to --out, then checks the
targets of issue 4: forward at >= 85% of the measured copy bandwidth (x_copy <= 1/0.85) and fwd+bwd faster
than flash-attn and Liger where they are installed, and compares each row's forward time with the roofline
(``ropekit bench --roofline``): the % of the GPU's published HBM bandwidth it reached.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

import ropekit
from ropekit.tools import bench

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _inputs(mode: str, dtype: torch.dtype, partial: bool, device: str):
    head_dim, heads_q, heads_k = 128, 8, 2
    rotary_dim = 64 if partial else head_dim
    cos, sin = ropekit.RopeConfig(head_dim, rotary_dim=rotary_dim).cos_sin(4096, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    lead = (37, 6) if mode != "cu_seqlens" else (61,)
    q = torch.randn(*lead, heads_q, head_dim, generator=g, device=device).to(dtype)
    k = torch.randn(*lead, heads_k, head_dim, generator=g, device=device).to(dtype)
    kw: dict = {}
    if mode == "positions":
        kw["positions"] = torch.randint(0, 4096, lead, generator=g, device=device)
    elif mode == "offsets":
        kw["offsets"] = torch.randint(0, 4000, (lead[0],), generator=g, device=device)
    elif mode == "cu_seqlens":
        kw["cu_seqlens"] = torch.tensor([0, 7, 30, 61], device=device, dtype=torch.int32)
    elif mode == "bhsd":
        q = q.transpose(1, 2).contiguous().transpose(1, 2)  # a transposed view, as HF's layout arrives
    return q, k, cos, sin, kw


def check_correctness(device: str = "cuda") -> int:
    """Every feature of the Triton kernel against the torch backend in float64; returns the failure count."""
    failures = 0
    modes = ["default", "positions", "offsets", "cu_seqlens", "bhsd"]
    grid = itertools.product(TOL, [False, True], [False, True], [False, True], modes)
    for dtype, interleaved, inplace, partial, mode in grid:
        q, k, cos, sin, kw = _inputs(mode, dtype, partial, device)
        want = ropekit.apply_rotary_qk(
            q.double(), k.double(), cos, sin, interleaved=interleaved, backend="torch", **kw
        )
        q_before = q.clone()
        got = ropekit.apply_rotary_qk(
            q, k, cos, sin, interleaved=interleaved, inplace=inplace, backend="triton", **kw
        )
        err = max(float((g.double() - w).abs().max()) for g, w in zip(got, want, strict=True))
        untouched = inplace or torch.equal(q, q_before)
        ok = err <= TOL[dtype] * 8 and untouched
        failures += not ok
        if not ok:
            case = f"{dtype} interleaved={interleaved} inplace={inplace} partial={partial} {mode}"
            print(f"FAIL {case}: err {err:.2e}")
    for interleaved, mode in itertools.product([False, True], modes):
        q, k, cos, sin, kw = _inputs(mode, torch.float32, True, device)
        grads = []
        for backend in ("torch", "triton"):
            ql, kl = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
            out = ropekit.apply_rotary_qk(ql, kl, cos, sin, interleaved=interleaved, backend=backend, **kw)
            (out[0].square().sum() + out[1].sum()).backward()
            grads.append((ql.grad, kl.grad))
        err = max(float((a - b).abs().max()) for a, b in zip(*grads, strict=True))
        if err > 1e-4:
            failures += 1
            print(f"FAIL gradient interleaved={interleaved} {mode}: err {err:.2e}")
    q, k, cos, sin, kw = _inputs("offsets", torch.bfloat16, False, device)
    step = torch.compile(
        lambda q, k: ropekit.apply_rotary_qk(q, k, cos, sin, backend="triton", **kw), fullgraph=True
    )
    eager = ropekit.apply_rotary_qk(q, k, cos, sin, backend="triton", **kw)
    if not all(torch.equal(a, b) for a, b in zip(step(q, k), eager, strict=True)):
        failures += 1
        print("FAIL torch.compile(fullgraph=True) output differs from eager")
    return failures


# A decode step of one Llama-3-8B token: q (1, 1, 32, 128), k (1, 1, 8, 128); tables for an 8k context.
DECODE_HEADS, DECODE_HEAD_DIM, DECODE_CONTEXT = (32, 8), 128, 8192


def decode_steps(device: str) -> dict[str, object]:
    """name -> a zero-argument decode step on `device`, each a call a serving loop makes every token.

    Built on any device, so the CPU tests can check that every step is a valid call.
    """
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, 1, DECODE_HEADS[0], DECODE_HEAD_DIM, generator=g, device=device).bfloat16()
    k = torch.randn(1, 1, DECODE_HEADS[1], DECODE_HEAD_DIM, generator=g, device=device).bfloat16()
    config = ropekit.RopeConfig(DECODE_HEAD_DIM, 500000.0, max_position_embeddings=DECODE_CONTEXT)
    cos, sin = config.cos_sin(DECODE_CONTEXT, device=device)
    rope = ropekit.RotaryEmbedding(config)
    offsets = torch.tensor([4000], device=device)  # (batch,)
    positions = torch.tensor([[4000]], device=device)  # (batch, seq)
    return {
        "apply_rotary, int offset": lambda: ropekit.apply_rotary(q, cos, sin, offsets=4000),
        "apply_rotary_qk, int offset": lambda: ropekit.apply_rotary_qk(q, k, cos, sin, offsets=4000),
        "apply_rotary_qk, offsets tensor": lambda: ropekit.apply_rotary_qk(q, k, cos, sin, offsets=offsets),
        "apply_rotary_qk, positions tensor": lambda: ropekit.apply_rotary_qk(
            q, k, cos, sin, positions=positions
        ),
        "apply_rotary_qk, in place": lambda: ropekit.apply_rotary_qk(
            q, k, cos, sin, offsets=4000, inplace=True
        ),
        "RotaryEmbedding, int offset": lambda: rope(q, k, offsets=4000),
        "RotaryEmbedding, offsets tensor": lambda: rope(q, k, offsets=offsets),
        "RotaryEmbedding, positions tensor": lambda: rope(q, k, positions=positions),
    }


def packed_decode_steps(device: str) -> dict[str, object]:
    """name -> the decode step of :func:`decode_steps` as a packed (varlen) call: q (1, 32, 128) with
    cu_seqlens [0, 1], an int offset or an offsets tensor (planned: the kernel reads cu_seqlens itself)."""
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, 1, DECODE_HEADS[0], DECODE_HEAD_DIM, generator=g, device=device).bfloat16()[0]
    k = torch.randn(1, 1, DECODE_HEADS[1], DECODE_HEAD_DIM, generator=g, device=device).bfloat16()[0]
    config = ropekit.RopeConfig(DECODE_HEAD_DIM, 500000.0, max_position_embeddings=DECODE_CONTEXT)
    cos, sin = config.cos_sin(DECODE_CONTEXT, device=device)
    offsets = torch.tensor([4000], device=device)  # (num_seqs,)
    cu_seqlens = torch.tensor([0, 1], dtype=torch.int32, device=device)  # (num_seqs + 1,)
    return {
        "apply_rotary_qk, packed, int offset": lambda: ropekit.apply_rotary_qk(
            q, k, cos, sin, offsets=4000, cu_seqlens=cu_seqlens
        ),
        "apply_rotary_qk, packed, offsets tensor": lambda: ropekit.apply_rotary_qk(
            q, k, cos, sin, offsets=offsets, cu_seqlens=cu_seqlens
        ),
    }


def check_no_sync(device: str = "cuda") -> int:
    """Each decode step (4-D and packed), after one warm-up call, under set_sync_debug_mode("error");
    returns the failures."""
    failures = 0
    steps = decode_steps(device) | packed_decode_steps(device)
    for name, step in steps.items():
        step()  # warm-up: Triton compilation, table growth, first-call caches
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        except RuntimeError as err:
            failures += 1
            print(f"FAIL no-sync {name}: {str(err).splitlines()[0][:200]}")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    print(f"no-sync: {failures} of {len(steps)} decode steps synchronized")
    return failures


def check_cuda_graph(device: str = "cuda") -> int:
    """Capture a decode step (functional and module) in a CUDA graph, replay it on new inputs written into the
    captured buffers, and compare with eager calls; returns the failures."""
    config = ropekit.RopeConfig(DECODE_HEAD_DIM, 500000.0, max_position_embeddings=DECODE_CONTEXT)
    cos, sin = config.cos_sin(DECODE_CONTEXT, device=device)
    rope = ropekit.RotaryEmbedding(config)
    q = torch.zeros(1, 1, DECODE_HEADS[0], DECODE_HEAD_DIM, device=device, dtype=torch.bfloat16)
    k = torch.zeros(1, 1, DECODE_HEADS[1], DECODE_HEAD_DIM, device=device, dtype=torch.bfloat16)
    offsets = torch.zeros(1, dtype=torch.int64, device=device)  # (batch,): rewritten before each replay
    steps = {
        "apply_rotary_qk, offsets tensor": lambda: ropekit.apply_rotary_qk(q, k, cos, sin, offsets=offsets),
        "RotaryEmbedding, offsets tensor": lambda: rope(q, k, offsets=offsets),
    }
    failures = 0
    for name, step in steps.items():
        side = torch.cuda.Stream()  # warm up on a side stream, as torch.cuda.graphs asks
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                out_q, out_k = step()
        except RuntimeError as err:
            failures += 1
            print(f"FAIL cuda-graph capture {name}: {str(err).splitlines()[0][:200]}")
            continue
        g = torch.Generator(device=device).manual_seed(1)
        for offset in (0, 17, 4000, DECODE_CONTEXT - 1):
            q.copy_(torch.randn(q.shape, generator=g, device=device))
            k.copy_(torch.randn(k.shape, generator=g, device=device))
            offsets.fill_(offset)
            graph.replay()
            want_q, want_k = ropekit.apply_rotary_qk(q, k, cos, sin, offsets=offset)
            torch.cuda.synchronize()
            if not (torch.equal(out_q, want_q) and torch.equal(out_k, want_k)):
                failures += 1
                err = max(
                    float((a.float() - b.float()).abs().max()) for a, b in ((out_q, want_q), (out_k, want_k))
                )
                print(f"FAIL cuda-graph replay {name} at offset {offset}: differs from eager by {err:.2e}")
    print(f"cuda-graph: {failures} failures")
    return failures


def check_targets(records: list[dict]) -> list[str]:
    """Issue 4's GPU targets, one line each."""
    lines = []
    for shape in dict.fromkeys(r["shape"] for r in records):
        rows = {r["row"]: r for r in records if r["shape"] == shape}
        ours = rows.get("ropekit[triton]")
        if ours is None:
            lines.append(f"{shape}: no ropekit[triton] row")
            continue
        share = 1 / ours["x_copy"]
        lines.append(
            f"{shape}: forward at {share:.0%} of copy bandwidth ({'PASS' if share >= 0.85 else 'MISS'})"
        )
        for peer in ("flash-attn", "Liger"):
            if peer in rows:
                mine, theirs = ours["fwd_bwd_ms"], rows[peer]["fwd_bwd_ms"]
                verdict = "PASS" if mine < theirs else "MISS"
                lines.append(f"{shape}: fwd+bwd {mine:.3f} ms vs {peer} {theirs:.3f} ms ({verdict})")
    return lines


def roofline_lines(records: list[dict], device_name: str) -> list[str]:
    """Each measured forward time against the roofline (ropekit.tools.roofline) at the GPU's published HBM
    bandwidth: the share of that bandwidth the row reached (its bytes over its time, over the peak)."""
    from ropekit.tools import roofline

    key = next((k for k in roofline.GPUS if k in device_name.lower()), None)
    if key is None:
        return [f"roofline: no published bandwidth for {device_name!r} (known: {', '.join(roofline.GPUS)})"]
    gpu = roofline.GPUS[key]
    lines = [f"roofline: {gpu.name}, {gpu.bandwidth / 1e12:.3g} TB/s ({gpu.source})"]
    for r in records:
        if not r.get("fwd_us") or r["fwd_us"] != r["fwd_us"]:  # skipped rows carry NaN
            continue
        rows = {t.row: t for t in roofline.traffic(bench.SHAPES[r["shape"]], getattr(torch, r["dtype"]))}
        t = rows.get(r["row"].removesuffix(" in-place"))
        if t is None:
            continue
        predicted = t.seconds(gpu) * 1e6
        share = t.total / (r["fwd_us"] * 1e-6) / gpu.bandwidth
        lines.append(
            f"{r['shape']} {r['row']}: {r['fwd_us']:.2f} us measured, {predicted:.2f} us predicted "
            f"({t.total / 1e6:.3g} MB): {share:.0%} of peak bandwidth"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results", help="folder for the CSV and the plot")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--shapes", nargs="+", default=["prefill-4k", "prefill-16k", "decode", "decode-1", "varlen"]
    )
    parser.add_argument("--no-bench", action="store_true", help="run the checks only (steps 1 and 2)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to do")
        return 2
    print(f"device: {torch.cuda.get_device_name()} | torch {torch.__version__}")
    start = time.time()
    failures = check_correctness()
    print(f"correctness: {failures} failures ({time.time() - start:.0f} s)")
    if failures:
        return 1
    serving_failures = check_no_sync() + check_cuda_graph()
    if args.no_bench:
        print(f"total {time.time() - start:.0f} s")
        return 1 if serving_failures else 0
    records, notes = bench.run_benchmark(
        args.shapes, device="cuda", dtype="bfloat16", repeats=args.repeats, log=lambda m: print(m, flush=True)
    )
    print(bench.format_table(records))
    for note in notes:
        print(f"note: {note}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bench.write_csv(records, str(out / "gpu_bench.csv"))
    bench.plot(records, str(out / "gpu_bench.png"))
    print("\n".join(check_targets(records)))
    print("\n".join(roofline_lines(records, torch.cuda.get_device_name())))
    print(f"total {time.time() - start:.0f} s")
    return 1 if serving_failures else 0


if __name__ == "__main__":
    sys.exit(main())
