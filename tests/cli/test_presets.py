"""`ropekit presets`: the list, one preset in full, and JSON."""

from __future__ import annotations

import json

from ropekit.cli import main
from ropekit.presets import PRESETS


def test_list_names_every_preset(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in PRESETS)
    assert "gpt-j-6b              256     64     10000 default   interleaved    2048" in out


def test_one_preset_in_json_carries_its_source(capsys):
    assert main(["presets", "deepseek-v3", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["source"] == "https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json"
    assert row["scaling"]["mscale_all_dim"] == 1.0 and row["interleaved"] is True


def test_unknown_preset_is_a_clean_error(capsys):
    assert main(["presets", "gpt-5"]) == 2
    assert "unknown preset 'gpt-5'" in capsys.readouterr().err
