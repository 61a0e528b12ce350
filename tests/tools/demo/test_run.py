import json

import pytest
import torch

from ropekit.config import RopeConfig
from ropekit.schedules import SCHEDULES
from ropekit.tools.demo import QUICK
from ropekit.tools.demo.run import EVAL_MULTIPLES, SCALING_METHODS, rope_config_for

REGISTERED = [m for m in SCALING_METHODS if m in SCHEDULES]


@pytest.mark.parametrize("method", REGISTERED)
def test_every_scaling_is_the_plain_rotation_at_the_training_length(method):
    L = QUICK.train_length
    plain = RopeConfig(QUICK.dim // QUICK.n_heads, 10000.0)
    config = rope_config_for(method, L, QUICK)
    torch.testing.assert_close(config.inv_freq(L), plain.inv_freq(L), rtol=1e-12, atol=0)
    assert config.attention_scaling(L) == pytest.approx(1.0)


@pytest.mark.parametrize("method", [m for m in REGISTERED if m != "dynamic"])
def test_scaled_methods_change_the_frequencies_beyond_the_training_length(method):
    L = QUICK.train_length
    plain = RopeConfig(QUICK.dim // QUICK.n_heads, 10000.0).inv_freq()
    assert not torch.allclose(rope_config_for(method, 4 * L, QUICK).inv_freq(4 * L), plain)


def test_unknown_method_raises():
    with pytest.raises(ValueError, match="method"):
        rope_config_for("alibi", 64, QUICK)


def test_quick_run_writes_every_method_at_every_length(quick_report):
    data = json.loads((quick_report / "results.json").read_text())
    L = data["train_length"]
    assert L == QUICK.train_length
    for row in data["results"]:
        assert set(row) == {"method", "length", "perplexity"}
        assert 1.0 < row["perplexity"] < 256.0
    methods = {r["method"] for r in data["results"]}
    expected = {"nope", "sinusoidal", "rope"} | {
        f"rope+{m}" for m in SCALING_METHODS if m not in data["skipped"]
    }
    assert methods == expected
    assert sorted({r["length"] for r in data["results"]}) == [n * L for n in EVAL_MULTIPLES]
    assert len(data["results"]) == len(methods) * len(EVAL_MULTIPLES)
    # Trained models are better than uniform guessing at the training length.
    assert all(r["perplexity"] < 64 for r in data["results"] if r["length"] == L)


def test_quick_run_reports_table_verify_and_plots(quick_report):
    text = (quick_report / "report.md").read_text()
    assert "| method |" in text and "ropekit verify" in text and " 0 failed" in text
    assert "Machine and settings" in text
    for name in ("perplexity_vs_length.png", "attention_vs_distance.png"):
        png = (quick_report / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    summary = (quick_report / "stdout.txt").read_text()
    assert "validation perplexity per byte" in summary and "wrote" in summary
