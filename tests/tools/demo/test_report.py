import json

import numpy as np
import pytest
import torch

from ropekit.tools.demo.report import attention_by_distance, format_table, write_results

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


def test_results_json_has_exactly_the_required_shape(tmp_path):
    path = tmp_path / "results.json"
    write_results(path, 64, RESULTS, {"note": "x"})
    data = json.loads(path.read_text())
    assert data["train_length"] == 64 and data["note"] == "x"
    assert data["results"] == RESULTS
    with pytest.raises(ValueError, match="extra"):
        write_results(path, 64, RESULTS, {"results": []})
