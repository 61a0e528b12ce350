"""ropekit.tools.roofline: byte counts from first principles, for hand-countable shapes."""

from __future__ import annotations

import pytest
import torch

from ropekit.tools import roofline
from ropekit.tools.bench import SHAPES


def _rows(shape: str, dtype: torch.dtype) -> dict[str, roofline.Traffic]:
    return {t.row: t for t in roofline.traffic(SHAPES[shape], dtype)}


def test_decode_1_bf16_bytes_counted_by_hand():
    # One Llama-3-8B token: q 32 x 128 = 4096 elements, k 8 x 128 = 1024; bf16, 2 bytes; an int offset.
    rows = _rows("decode-1", torch.bfloat16)
    qk = (4096 + 1024) * 2  # 10,240 bytes
    assert (rows["copy_"].read, rows["copy_"].written) == (qk, qk)
    # + one float32 cos row and one sin row of 64 each; no positions tensor.
    assert (rows["ropekit[triton]"].read, rows["ropekit[triton]"].written) == (qk + 2 * 64 * 4, qk)
    # flash-attn reads the bf16 rows once for q's launch and once for k's.
    assert rows["flash-attn"].read == qk + 2 * (2 * 64 * 2) and rows["flash-attn"].launches == 2
    assert rows["Liger"].read == qk + 2 * 64 * 2 and rows["Liger"].written == qk
    # HF, q (4096): neg reads 2048 writes 2048; cat reads 4096 writes 4096; two products read 4096 + a
    # 128-wide table row and write 4096 each; the sum reads 8192 and writes 4096. k likewise with 1024.
    q_read, q_written = 2048 + 4096 + 2 * (4096 + 128) + 8192, 2048 + 4096 + 3 * 4096
    k_read, k_written = 512 + 1024 + 2 * (1024 + 128) + 2048, 512 + 1024 + 3 * 1024
    assert rows["HF eager"].read == 2 * (q_read + k_read)
    assert rows["HF eager"].written == 2 * (q_written + k_written)
    # Meta, q: .float() reads 8192 B writes 16384; the complex64 product reads 16384 and 64 complex64 (512)
    # and writes 16384; .type_as reads 16384 and writes 8192. k: a quarter of each, the same 512.
    assert rows["Meta complex"].read == (8192 + 16384 + 512 + 16384) + (2048 + 4096 + 512 + 4096)
    assert rows["Meta complex"].written == (16384 + 16384 + 8192) + (4096 + 4096 + 2048)
    assert rows["Meta complex"].launches == 6


def test_float32_meta_form_skips_the_casts_and_decode_with_offsets_reads_positions():
    rows = _rows("decode-1", torch.float32)
    assert rows["Meta complex"].read == (16384 + 512) + (4096 + 512)
    assert rows["Meta complex"].written == 16384 + 4096 and rows["Meta complex"].launches == 2
    # decode: 64 sequences, an offsets tensor -> 64 int64 positions; 64 cos/sin row pairs.
    ours = _rows("decode", torch.bfloat16)["ropekit[triton]"]
    assert ours.read == 64 * 40 * 128 * 2 + 64 * 2 * 64 * 4 + 64 * 8


def test_predicted_time_is_bytes_over_the_published_bandwidth():
    h100 = roofline.GPUS["h100"]
    assert h100.bandwidth == 3.35e12 and "datasheet" in h100.source
    assert [roofline.GPUS[k].bandwidth for k in ("a100", "h200", "b200")] == [2.039e12, 4.8e12, 8.0e12]
    records = roofline.roofline(["prefill-4k"], torch.bfloat16, h100)
    ours = next(r for r in records if r["row"] == "ropekit[triton]")
    total = ours["read_bytes"] + ours["written_bytes"]
    assert ours["predicted_us"] == pytest.approx(total / 3.35e12 * 1e6)
    assert ours["x_ropekit"] == 1.0
    hf = next(r for r in records if r["row"] == "HF eager")
    assert 4.5 < hf["x_ropekit"] < 5.5  # ten passes over q and k where one reads and one writes


def test_unknown_shape_is_a_value_error():
    with pytest.raises(ValueError, match="shapes: expected names"):
        roofline.roofline(["nope"], torch.float32, roofline.GPUS["a100"])
