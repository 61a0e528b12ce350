"""benchmarks/cpu_time.py: one short round prints every row of a shape and the targets it can judge."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_time.py"


def test_one_round_on_tiny_prints_each_row_and_its_targets(capsys):
    spec = importlib.util.spec_from_file_location("cpu_time", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--shapes", "tiny", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    for row in (
        "out of place",
        "in place",
        "Meta complex",
        "clone",
        "RotaryEmbedding",
        "RotaryEmbedding bhsd",
    ):
        assert f"  {row} " in out
    assert "tiny       out of place     / Meta complex" in out
