import json
from dataclasses import replace

import pytest
import torch

from ropekit.config import RopeConfig
from ropekit.tools.demo import QUICK, rewrite_report, run_demo
from ropekit.tools.demo.data import key_distance
from ropekit.tools.demo.report import wilson_interval
from ropekit.tools.demo.run import EVAL_MULTIPLES, SCALING_METHODS, passkey_rows, rope_config_for

REGISTERED = list(SCALING_METHODS)


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


def test_rope_config_for_uses_the_settings_base_and_dynamic_factor():
    s = replace(QUICK, rope_base=500.0, dynamic_factor=3.0)
    assert rope_config_for("rope", 64, s).base == 500.0
    assert rope_config_for("dynamic", 4 * s.train_length, s).scaling["factor"] == 3.0


def test_passkey_rows_split_evenly_over_ranks():
    assert passkey_rows(0.5, 16, 1) == 8 and passkey_rows(0.5, 16, 3) == 6
    assert passkey_rows(0.1, 4, 2) == 2 and passkey_rows(0.0, 16, 2) == 0


@pytest.mark.parametrize(
    ("change", "name"),
    [({"seeds": 0}, "seeds"), ({"passkey_fraction": 1.5}, "passkey_fraction"),
     ({"retrieval_depths": (0.5, 2.0)}, "retrieval_depths"), ({"eval_multiples": ()}, "eval_multiples")],
)  # fmt: skip
def test_bad_settings_raise_before_any_work(change, name, tmp_path):
    with pytest.raises(ValueError, match=name):
        run_demo(replace(QUICK, **change), tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_quick_run_writes_every_method_at_every_length(quick_report):
    data = json.loads((quick_report / "results.json").read_text())
    L = data["train_length"]
    assert L == QUICK.train_length
    for row in data["results"]:
        assert {"method", "length", "perplexity"} <= set(row)
        assert 1.0 < row["perplexity"] < 256.0
    methods = {r["method"] for r in data["results"]}
    expected = {"nope", "sinusoidal", "rope", "rope+linear+finetune", "rope+yarn+finetune"}
    expected |= {f"rope+{m}" for m in SCALING_METHODS}
    assert methods == expected
    assert sorted({r["length"] for r in data["results"]}) == [n * L for n in EVAL_MULTIPLES]
    assert len(data["results"]) == len(methods) * len(EVAL_MULTIPLES)
    # Trained models are better than uniform guessing at the training length.
    assert all(r["perplexity"] < 64 for r in data["results"] if r["length"] == L)
    assert data["seeds"] == [QUICK.seed]


def test_quick_run_writes_retrieval_for_every_method_length_and_depth(quick_report):
    data = json.loads((quick_report / "results.json").read_text())
    L = data["train_length"]
    retrieval = data["retrieval"]
    methods = {r["method"] for r in data["results"]}
    keys = {(r["method"], r["length"], r["depth"]) for r in retrieval}
    assert keys == {(m, n * L, d) for m in methods for n in EVAL_MULTIPLES for d in QUICK.retrieval_depths}
    assert len(retrieval) == len(keys)
    for row in retrieval:
        assert set(row) == {"method", "length", "depth", "accuracy", "n", "ci_low", "ci_high", "distance",
                            "correct_by_seed", "n_by_seed"}  # fmt: skip
        assert row["n"] == QUICK.retrieval_examples
        assert row["n_by_seed"] == [QUICK.retrieval_examples] and row["correct_by_seed"] == [
            round(row["accuracy"] * row["n"])
        ]
        assert row["distance"] == key_distance(row["length"], row["depth"])
        correct = round(row["accuracy"] * row["n"])
        assert row["accuracy"] == pytest.approx(correct / row["n"])
        assert (row["ci_low"], row["ci_high"]) == pytest.approx(wilson_interval(correct, row["n"]))


def test_quick_run_reports_answer_tables_verify_and_plots(quick_report):
    text = (quick_report / "report.md").read_text()
    opening = text.split("\n\n")[1]
    assert opening.startswith(("Keys fewer than L", "No cell puts a key"))
    assert "| method |" in text and "ropekit verify" in text and " 0 failed" in text
    assert "Machine and settings" in text and "1 process," in text and "- none" not in text
    for name in ("perplexity_vs_length.png", "attention_vs_distance.png", "retrieval_heatmap.png",
                 "retrieval_vs_length.png", "loss_vs_position.png"):  # fmt: skip
        png = (quick_report / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
        assert f"]({name})" in text
    summary = (quick_report / "stdout.txt").read_text()
    assert (
        "passkey retrieval" in summary and "validation perplexity per byte" in summary and "wrote" in summary
    )
    assert "process(es)" not in summary


def test_quick_run_stores_every_seeds_perplexity(quick_report):
    data = json.loads((quick_report / "results.json").read_text())
    for row in data["results"]:
        assert row["perplexity_by_seed"] == [row["perplexity"]]
    assert len(data["attention_by_distance"]) == QUICK.train_length
    assert len(data["attention_by_distance_long"]) == max(EVAL_MULTIPLES) * QUICK.train_length


def test_report_only_rewrites_the_same_report_and_the_plots_from_results_json(quick_report, tmp_path):
    out = tmp_path / "copy"
    out.mkdir()
    (out / "results.json").write_bytes((quick_report / "results.json").read_bytes())
    assert rewrite_report(out) == 0
    assert (out / "report.md").read_text() == (quick_report / "report.md").read_text()
    for name in ("perplexity_vs_length.png", "attention_vs_distance.png", "retrieval_heatmap.png",
                 "retrieval_vs_length.png", "loss_vs_position.png"):  # fmt: skip
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_only_refuses_a_folder_without_results(tmp_path):
    with pytest.raises(ValueError, match="results"):
        rewrite_report(tmp_path)
