"""A roofline for RoPE: the bytes each implementation must move to and from GPU memory, and the time that
takes at a GPU's published HBM bandwidth.

RoPE does a few flops per byte, so on a GPU its time is bounded below by its memory traffic over the HBM
bandwidth. Each row here counts the DRAM traffic of one forward call of q and k from its data flow: every
tensor an op reads or writes once (a table row broadcast over heads is counted once, as L2 serves the
repeats). Launch overhead (a few microseconds a kernel) is not in the prediction; the launch count is listed
so decode shapes, where it dominates, can be read for what they are.

Rows (shape notation: N = elements of q plus k, e = bytes an element, T = tokens, D = head_dim):
    ropekit[triton]: one kernel reads q and k and writes them once (in place or not: the same bytes), plus
        each token's float32 cos and sin rows (2 * D/2 * 4 bytes) and its int64 position when positions are
        a tensor: 2 N e + 4 T D (+ 8 T).
    flash-attn: flash_attn/ops/triton/rotary.py, one launch per tensor (q, then k); each reads the cos and
        sin rows, in the input dtype, again: 2 N e + 2 * 2 * T * D/2 * e.
    Liger: liger_kernel/ops/rope.py, one launch for q and k, in place on its input; it loads the first half
        of HF's (B, S, D) cos and sin rows in the input dtype: 2 N e + 2 T D/2 e.
    HF eager: transformers' apply_rotary_pos_emb, per tensor x (n elements): rotate_half's neg (reads and
        writes n/2) and cat (reads n, writes n), x * cos and rotate_half(x) * sin (each reads n plus the
        (B, S, D) table, writes n), the sum (reads 2n, writes n): 10 N e + 2 * 2 * T D e over q and k.
    Meta complex: Meta's LLaMA apply_rotary_emb: x.float() (for fp16/bf16: reads n e, writes 4n), the
        complex64 product (reads 4n and the (S, D/2) complex64 freqs_cis, writes 4n), .type_as(x) (reads
        4n, writes n e): 2 N e + 16 N + 2 * 4 T D for fp16/bf16; 8 N + 2 * 4 T D for float32 (no casts).
    copy_: the floor, q and k read and written once: 2 N e.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ropekit.tools.bench import SHAPES, Shape

__all__ = ["GPUS", "Gpu", "Traffic", "format_roofline", "roofline", "traffic"]


@dataclass(frozen=True)
class Gpu:
    """A GPU's name, its published peak HBM bandwidth (bytes/s) and where that figure is published."""

    name: str
    bandwidth: float
    source: str


GPUS = {
    "a100": Gpu(
        "A100 80GB SXM",
        2.039e12,
        "NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), "
        "A100 80GB SXM column: 2,039 GB/s",
    ),
    "h100": Gpu("H100 SXM", 3.35e12, "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: 3.35 TB/s"),
    "h200": Gpu("H200 SXM", 4.8e12, "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: 4.8 TB/s"),
    "b200": Gpu(
        "B200 (HGX / DGX B200)", 8.0e12, "NVIDIA DGX B200 datasheet: 64 TB/s HBM3e over 8 GPUs, 8 TB/s each"
    ),
}


@dataclass(frozen=True)
class Traffic:
    """Bytes one forward call of one row reads from and writes to GPU memory, and its kernel launches."""

    row: str
    read: int
    written: int
    launches: int

    @property
    def total(self) -> int:
        return self.read + self.written

    def seconds(self, gpu: Gpu) -> float:
        """The bandwidth bound: total bytes over the GPU's peak HBM bandwidth."""
        return self.total / gpu.bandwidth


def traffic(shape: Shape, dtype: torch.dtype) -> list[Traffic]:
    """Every row's traffic for one shape in one storage dtype (see the module docstring for each formula)."""
    e = torch.empty((), dtype=dtype).element_size()
    tokens = shape.batch * shape.seq
    d = shape.head_dim
    n = tokens * (shape.q_heads + shape.k_heads) * d  # elements of q plus k
    positions = (
        0 if (shape.decode and shape.int_offset) else 8 * tokens
    )  # int64 a token, unless an int offset
    widen = 0 if e == 4 else 1  # Meta's .float() and .type_as() are no-ops on float32
    return [
        Traffic("copy_", n * e, n * e, 1),
        Traffic("ropekit[triton]", n * e + tokens * d * 4 + positions, n * e, 1),
        Traffic("flash-attn", n * e + 2 * tokens * d * e, n * e, 2),
        Traffic("Liger", n * e + tokens * d * e, n * e, 1),
        # Reads a tensor: neg n/2, cat n, products n + table each, sum 2n; writes: n/2, n, n, n, n.
        Traffic("HF eager", 11 * n * e // 2 + 4 * tokens * d * e, 9 * n * e // 2, 10),
        Traffic(
            "Meta complex",
            widen * n * e + 4 * n + 2 * 4 * tokens * d + widen * 4 * n,
            widen * 4 * n + 4 * n + widen * n * e,
            2 * (1 + 2 * widen),
        ),
    ]


def roofline(shapes: Iterable[str], dtype: torch.dtype, gpu: Gpu) -> list[dict]:
    """One record a (shape, row): bytes read and written, launches, predicted time, its ratio to ropekit."""
    records = []
    for name in shapes:
        if name not in SHAPES:
            raise ValueError(f"shapes: expected names from {sorted(SHAPES)}, got {name!r}")
        rows = traffic(SHAPES[name], dtype)
        ours = next(r for r in rows if r.row == "ropekit[triton]").total
        for r in rows:
            records.append(
                {
                    "shape": name,
                    "row": r.row,
                    "read_bytes": r.read,
                    "written_bytes": r.written,
                    "launches": r.launches,
                    "predicted_us": r.seconds(gpu) * 1e6,
                    "x_ropekit": r.total / ours,
                }
            )
    return records


def format_roofline(records: list[dict], dtype: torch.dtype, gpu: Gpu) -> str:
    """The roofline as a plain-text table, headed by the GPU, its bandwidth and the figure's source."""
    lines = [
        f"roofline: {gpu.name}, {gpu.bandwidth / 1e12:.3g} TB/s peak HBM bandwidth ({gpu.source}); {dtype}",
        "predicted = (read + written) / bandwidth: a lower bound; kernel launch overhead not included",
        f"{'shape':<12} {'row':<16} {'read MB':>10} {'written MB':>11} {'launches':>8} {'predicted us':>13} "
        f"{'x ropekit':>9}",
    ]
    for r in records:
        lines.append(
            f"{r['shape']:<12} {r['row']:<16} {r['read_bytes'] / 1e6:>10.4g} "
            f"{r['written_bytes'] / 1e6:>11.4g} "
            f"{r['launches']:>8} {r['predicted_us']:>13.4g} {r['x_ropekit']:>9.3g}"
        )
    return "\n".join(lines)
