"""examples/llama_block.py: the block compiles without graph breaks, and decoding equals the full pass."""

import importlib.util
from pathlib import Path

import pytest
import torch

from ropekit.nn import padding_positions

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llama_block.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("llama_block", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_block_has_no_graph_breaks_in_prefill_or_decode(example):
    block = example.build_block()
    x = torch.randn(2, 8, example.DIM)
    mask = torch.ones(2, 8, dtype=torch.bool)
    cache = block.new_kv_cache(2, 16)
    torch._dynamo.reset()
    with torch.no_grad():
        for args, kwargs in [
            ((x,), {}),
            ((x,), dict(positions=padding_positions(mask), attn_mask=mask)),
            ((x[:, :1],), dict(kv_cache=cache, attn_mask=torch.ones(2, 16, dtype=torch.bool))),
        ]:
            report = torch._dynamo.explain(block)(*args, **kwargs)
            assert report.graph_break_count == 0, report.break_reasons


def test_compiled_incremental_decoding_equals_full_forward(example):
    torch._dynamo.reset()
    assert example.run(backend="aot_eager") < 1e-5
