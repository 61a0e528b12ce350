import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from ropekit.tools.demo import DemoSettings
from ropekit.tools.demo.data import key_distance
from ropekit.tools.demo.report import (
    accuracy_cell,
    attention_by_distance,
    format_distance_table,
    format_retrieval_table,
    format_table,
    pool_depths,
    read_results,
    report_sections,
    retrieval_row,
    verify_section,
    wilson_interval,
    with_distances,
    write_results,
)

RESULTS = [
    {"method": "rope", "length": 64, "perplexity": 5.0},
    {"method": "rope", "length": 128, "perplexity": 7.5},
    {"method": "nope", "length": 64, "perplexity": 6.0},
]


def test_attention_by_distance_of_uniform_causal_attention():
    # Query i spreads 1/(i+1) over its keys, so distance r averages 1/(i+1) over the queries i >= r.
    seq = 6
    probs = torch.ones(seq, seq, dtype=torch.float64).tril() / torch.arange(1, seq + 1)[:, None]
    maps = [probs.expand(2, 3, seq, seq), probs.expand(2, 3, seq, seq)]
    expected = [np.mean([1 / (i + 1) for i in range(r, seq)]) for r in range(seq)]
    np.testing.assert_allclose(attention_by_distance(maps), expected, rtol=1e-12)


def test_table_has_one_row_per_method_and_a_dash_where_missing():
    text = format_table(RESULTS, 64)
    assert "64 (1L)" in text and "128 (2L)" in text
    nope_row = next(line for line in text.splitlines() if line.startswith("nope"))
    assert nope_row.split()[1:] == ["6.000", "-"]
    assert format_table(RESULTS, 64, markdown=True).startswith("| method | 64 (1L) | 128 (2L) |")


def test_table_shows_the_spread_over_seeds():
    rows = [{"method": "rope", "length": 64, "perplexity": 5.0, "perplexity_std": 0.25}]
    assert "5.000 ± 0.250" in format_table(rows, 64)


def test_results_json_has_exactly_the_required_shape(tmp_path):
    path = tmp_path / "results.json"
    write_results(path, 64, RESULTS, {"note": "x"})
    data = json.loads(path.read_text())
    assert data["train_length"] == 64 and data["note"] == "x"
    assert data["results"] == RESULTS
    with pytest.raises(ValueError, match="extra"):
        write_results(path, 64, RESULTS, {"results": []})


@pytest.mark.parametrize(("k", "n"), [(0, 10), (3, 10), (10, 10), (47, 96), (1, 1)])
def test_wilson_interval_matches_the_closed_form(k, n):
    # Wilson (1927): the p with |p_hat - p| = z sqrt(p (1 - p) / n), i.e. the roots of a quadratic in p.
    z = 1.959963984540054
    p_hat = k / n
    a = 1 + z * z / n
    b = -(2 * p_hat + z * z / n)
    c = p_hat * p_hat
    roots = sorted(np.roots([a, b, c]).real)
    low, high = wilson_interval(k, n)
    # np.roots finds a double root (k = 0 or n) only to ~sqrt(machine epsilon).
    assert low == pytest.approx(max(0.0, roots[0]), abs=1e-7)
    assert high == pytest.approx(min(1.0, roots[1]), abs=1e-7)
    assert 0.0 <= low <= p_hat <= high <= 1.0


def test_wilson_interval_of_a_known_case_and_bad_input():
    # 95% Wilson interval of 8/10, as tabulated by Newcombe (1998): 0.490 to 0.943.
    low, high = wilson_interval(8, 10)
    assert (round(low, 3), round(high, 3)) == (0.490, 0.943)
    assert wilson_interval(0, 20)[0] == 0.0 and wilson_interval(20, 20)[1] == 1.0
    for k, n, name in ((1, 0, "n"), (5, 4, "successes"), (-1, 4, "successes"), (True, 4, "successes")):
        with pytest.raises(ValueError, match=name):
            wilson_interval(k, n)


RETRIEVAL = [
    retrieval_row(method, n, d, k, 10)
    for method, ks in {
        "rope": [10, 1, 1, 0],
        "rope+linear+finetune": [10, 9, 8, 2],
        "nope": [2, 1, 0, 0],
    }.items()
    for n, kk in zip((64, 128, 256, 512), ks, strict=True)
    for d, k in ((0.1, kk), (0.9, kk))
]


def test_retrieval_rows_pool_over_depths_with_their_interval():
    pooled = {(r["method"], r["length"]): r for r in pool_depths(RETRIEVAL)}
    row = pooled["rope+linear+finetune", 256]
    assert row["n"] == 20 and row["accuracy"] == pytest.approx(0.8)
    assert (row["ci_low"], row["ci_high"]) == pytest.approx(wilson_interval(16, 20))
    assert set(RETRIEVAL[0]) == {
        "method",
        "length",
        "depth",
        "accuracy",
        "n",
        "ci_low",
        "ci_high",
        "distance",
    }
    assert RETRIEVAL[0]["distance"] == key_distance(64, 0.1)
    assert "80% [58%, 92%]" in format_retrieval_table(RETRIEVAL, 64)


def test_depths_are_pooled_only_where_their_intervals_agree():
    rows = [retrieval_row("rope", 128, 0.1, 0, 20), retrieval_row("rope", 128, 0.9, 20, 20)]
    rows += [retrieval_row("rope", 64, 0.1, 19, 20), retrieval_row("rope", 64, 0.9, 20, 20)]
    pooled = {r["length"]: r for r in pool_depths(rows)}
    assert not pooled[128]["agree"] and pooled[64]["agree"]
    table = format_retrieval_table(rows, 64)
    assert "0-100% by depth" in table and "50%" not in table
    assert "98% [87%, 100%]" in table


def test_per_seed_counts_are_stored_and_their_spread_shown_from_three_seeds():
    row = retrieval_row("rope", 128, 0.5, 12, 30, correct_by_seed=[2, 4, 6], n_by_seed=[10, 10, 10])
    assert row["correct_by_seed"] == [2, 4, 6] and row["n_by_seed"] == [10, 10, 10]
    assert accuracy_cell(row) == "40% [25%, 58%], seeds 20-60%"
    two = retrieval_row("rope", 128, 0.5, 6, 20, correct_by_seed=[2, 4], n_by_seed=[10, 10])
    assert "seeds" not in accuracy_cell(two)
    # Pooling cells sums each seed's counts.
    other = retrieval_row("rope", 128, 0.9, 30, 30, correct_by_seed=[10, 10, 10], n_by_seed=[10, 10, 10])
    pooled = pool_depths([row, other])[0]
    assert pooled["correct_by_seed"] == [12, 14, 16] and pooled["n_by_seed"] == [20, 20, 20]


def test_distance_table_pools_keys_within_L_and_lists_farther_keys_by_distance():
    rows = [retrieval_row("rope", 64, d, 20, 20) for d in (0.1, 0.9)]
    rows += [retrieval_row("rope", 128, 0.1, 0, 20), retrieval_row("rope", 128, 0.9, 19, 20)]
    table = format_distance_table(rows, 64)
    far = key_distance(128, 0.1)
    assert f"| {far / 64:.1f}L back ({far} B, 2L window) |" in table
    rope = next(line for line in table.splitlines() if line.startswith("| rope"))
    assert rope.startswith("| rope | 98% [91%, 100%] (3 cells) | 0% [0%, 16%] |")
    rows.append(retrieval_row("rope", 64, 0.5, 0, 20))
    assert "0-100% (4 cells disagree)" in format_distance_table(rows, 64)


def test_results_json_from_before_distances_were_stored_gets_them(tmp_path):
    old = [{k: v for k, v in r.items() if k != "distance"} for r in RETRIEVAL]
    assert with_distances(old) == RETRIEVAL
    path = tmp_path / "results.json"
    write_results(path, 64, RESULTS, {"retrieval": old, "settings": {}})
    assert read_results(path)["retrieval"] == RETRIEVAL
    with pytest.raises(ValueError, match=r"results: .* lacks \['settings'\]"):
        write_results(path, 64, RESULTS, {"retrieval": old})
        read_results(path)
    with pytest.raises(ValueError, match="no file"):
        read_results(tmp_path / "missing.json")


def test_verify_section_reads_bfloat16_rows_in_ulps():
    ulps = [{"backend": "torch", "layout": "half", "max_ulps": 0.4995, "bound_ulps": 0.5005}]
    text = verify_section([_Check("c")], 32, 10000.0, ulps)
    assert "| torch | half | 0.49950 | 0.50050 | 0.00100 |" in text
    assert "at most 0.5 ulp is correct rounding" in text
    assert "ulp" not in verify_section([_Check("c")], 32, 10000.0, [])


class _Check:
    def __init__(self, name):
        self.name, self.max_error, self.tolerance, self.passed = name, 0.0, 1e-6, True


def _extra(world_size=1, threads=1):
    return {
        "machine": {"device_name": "Test CPU", "device": "cpu", "threads": threads, "cpu_count": 2,
                    "platform": "Linux", "python": "3.12", "torch": "2", "load": "0.00 0.00 0.00"},
        "world_size": world_size, "seeds": [4, 5, 6], "final_train_loss": {"rope": 1.5},
        "corpus": {"train_files": 3, "validation_files": ["a"], "root": "/x"},
        "timings_s": {"train": 1.0, "total": 2.0}, "attention_by_distance": [0.5, 0.5],
    }  # fmt: skip


def test_report_numbers_come_from_the_settings():
    s = replace(DemoSettings(), train_length=32, eval_multiples=(1, 3), rope_base=500.0, finetune_factor=3,
                dynamic_factor=1.5, finetune_steps=7, dim=48, n_heads=2, seeds=3)  # fmt: skip
    results = [{"method": "rope", "length": n, "perplexity": p} for n, p in ((32, 4.0), (96, 5.0))]
    retrieval = [retrieval_row("rope", n, 0.5, 5, 10) for n in (32, 96)]
    text = "\n".join(report_sections(s, results, retrieval, _extra(), [_Check("c")]).values())
    assert "factor = evaluation length / L (1, 3)" in text
    assert "fixed factor 1.5" in text and "7 steps at 3L with factor 3" in text
    assert "base 500" in text and "base 10000" not in text
    assert "8L" not in text and "2.0" not in text
    assert "- none" not in text
    assert "96 (3L)" in text and "seeds 4, 5, 6" in text


@pytest.mark.parametrize(
    ("world_size", "threads", "expected"),
    [(1, 1, "1 process, 1 thread per"), (2, 4, "2 processes, 4 threads per")],
)
def test_report_names_processes_and_threads_in_words(world_size, threads, expected):
    results = [{"method": "rope", "length": 128, "perplexity": 4.0}]
    sections = report_sections(DemoSettings(), results, [], _extra(world_size, threads), [_Check("c")])
    text = sections["Machine and settings"]
    assert expected in text and "Test CPU" in text and "(es)" not in text and "(s)" not in text


def test_report_says_when_seeds_ran_in_parallel_processes():
    results = [{"method": "rope", "length": 128, "perplexity": 4.0}]
    extra = {**_extra(), "seed_processes": 3}
    text = report_sections(DemoSettings(), results, [], extra, [_Check("c")])["Machine and settings"]
    assert "1 process (its 3 seeds in 3 parallel worker processes)" in text
