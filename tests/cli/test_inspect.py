"""`ropekit inspect`: the table, the JSON report, the plot file and the missing-matplotlib message."""

from __future__ import annotations

import json
import sys

import pytest

from ropekit.cli import main
from ropekit.presets import get_preset


def test_table_has_header_pairs_and_summary(capsys):
    assert main(["inspect", "llama-3.1-8b"]) == 0
    out = capsys.readouterr().out
    assert "model: llama-3.1-8b   rope_type: llama3   base: 500000" in out
    assert "training context: 8192   target length: 131072" in out
    assert out.count("\n  6") >= 1 and "configured: llama3" in out
    assert "29 of 64 pairs never complete a rotation" in out


def test_json_report_from_a_config_json_path(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(get_preset("mistral-7b").config))
    assert (
        main(["inspect", str(path), "--method", "yarn", "--factor", "4", "--set", "beta_fast=16", "--json"])
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert (report["rope_type"], report["base"], report["original_length"]) == ("default", 10000.0, 32768)
    assert report["target_length"] == 131072 and len(report["pairs"]) == 64
    requested = report["methods"][1]
    assert requested["name"] == "requested: yarn" and requested["scaling"]["beta_fast"] == 16
    assert {p["effect"] for p in requested["pairs"]} == {"kept", "in between", "interpolated"}


def test_plot_flag_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plan.png"
    assert main(["inspect", "gpt-neox-20b", "--method", "ntk", "--factor", "2", "--plot", str(path)]) == 0
    assert path.stat().st_size > 20_000
    assert f"plots written to {path}" in capsys.readouterr().out


def test_missing_matplotlib_explains_how_to_get_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    assert main(["inspect", "llama-2-7b", "--plot", str(tmp_path / "x.png")]) == 3
    assert "pip install 'ropekit[plot]'" in capsys.readouterr().err


def test_unknown_model_is_a_clean_error(capsys):
    assert main(["inspect", "no-such-model"]) == 2
    assert "neither a preset" in capsys.readouterr().err


def _exit_code(argv):
    try:
        return main(argv)
    except SystemExit as exit_info:  # argparse's own usage errors
        return exit_info.code


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["llama-3.1-8b", "--plot", "/no/such/dir/x.png"], "--plot: '/no/such/dir/x.png'"),
        (["llama-3.1-8b", "--factor", "4"], "--factor: 4.0 applies to the --method methods"),
        (["llama-3.1-8b", "--set", "beta_fast=16"], "--set: 'beta_fast=16' applies to the --method methods"),
        (["llama-3.1-8b", "--method", "warp", "--factor", "2"], "--method: unknown method 'warp'"),
        (["llama-3.1-8b", "--method", "yarn", "--factor", "0.5"], "argument --factor: expected a finite"),
        (["llama-3.1-8b", "--method", "yarn", "--factor", "nan"], "argument --factor: expected a finite"),
        (["llama-3.1-8b", "--target-length", "0"], "argument --target-length: expected a positive integer"),
        (["llama-3.1-8b", "--layer-type", "sliding_attention"], "--layer-type: 'sliding_attention' selects"),
    ],
)
def test_misuse_is_one_line_naming_the_flag_and_exit_2(argv, flag, capsys, tmp_path):
    assert _exit_code(["inspect", *argv]) == 2
    err = capsys.readouterr().err
    assert flag in err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("ropekit inspect: error: ")


def test_factor_without_method_does_not_change_the_target_length(capsys):
    """The help says --factor is for the --method methods; alone it is an error, never a new target."""
    assert main(["inspect", "llama-3.1-8b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["target_length"] == 131072
    assert _exit_code(["inspect", "llama-3.1-8b", "--factor", "4"]) == 2


def test_method_without_factor_extends_to_the_target_length(capsys):
    assert main(["inspect", "llama-2-7b", "--method", "linear", "--target-length", "16384", "--json"]) == 0
    requested = json.loads(capsys.readouterr().out)["methods"][1]
    assert requested["scaling"] == {"rope_type": "linear", "factor": 4.0}


def test_a_config_json_with_a_string_rope_scaling_is_a_one_line_error(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**get_preset("mistral-7b").config, "rope_scaling": "linear"}))
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ropekit inspect: error: config['rope_scaling']: expected a dict")
    assert "dictionary update sequence" not in err and len(err.strip().splitlines()) == 1


def test_layers_prints_every_layer_run_of_a_whole_model(capsys):
    assert main(["inspect", "gemma-4-e2b-full", "--layers"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        "layers 0-4 [sliding_attention]: default base 10000, 256 of 256 features (first), "
        "half (GPT-NeoX / HF); window 512"
    )
    assert out[1].startswith("layer 5 [full_attention]: proportional base 1e+06, 512 of 512 features")
    assert len(out) == 10


def test_layers_json_from_a_config_json_with_nope_and_temperature(tmp_path, capsys):
    from transformers import AutoConfig

    path = tmp_path / "config.json"
    path.write_text(json.dumps(AutoConfig.for_model("llama4_text", num_hidden_layers=4).to_dict()))
    assert main(["inspect", str(path), "--layers", "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)
    assert [(r["first"], r["last"], r["rope"] is None, r["temperature"]) for r in runs] == [
        (0, 2, False, False),
        (3, 3, True, True),
    ]
    assert runs[0]["attention_chunk_size"] == 8192


def test_layers_takes_no_extension_flags(capsys):
    assert main(["inspect", "gemma-4-e2b-full", "--layers", "--method", "yarn"]) == 2
    assert "--layers" in capsys.readouterr().err


def test_variant_configs_show_their_axes_temperature_and_indexer(tmp_path, capsys):
    hunyuan = tmp_path / "hunyuan" / "config.json"
    hunyuan.parent.mkdir()
    scaling = {"type": "xdrope", "alpha": 1000.0, "xdrope_section": [16, 16, 16, 16]}
    hunyuan.write_text(json.dumps({"model_type": "hunyuan_vl", "hidden_size": 256, "num_attention_heads": 2,
                                   "max_position_embeddings": 32768, "rope_scaling": scaling}))  # fmt: skip
    assert main(["inspect", str(hunyuan)]) == 0
    out = capsys.readouterr().out
    assert "rope_type: ntk_alpha" in out
    assert "position axes: 4   sections (pairs): [16, 16, 16, 16]   layout: chunked" in out
    assert "axis of each pair: " + "0" * 16 + "1" * 16 + "2" * 16 + "3" * 16 in out
    telechat = tmp_path / "telechat.json"
    scaling = {"type": "telechat3-yarn", "factor": 8.0, "original_max_position_embeddings": 4096}
    telechat.write_text(
        json.dumps({"head_dim": 64, "max_position_embeddings": 32768, "rope_scaling": scaling})
    )
    assert main(["inspect", str(telechat)]) == 0
    assert "configured: yarn: attention scaling 1.14556" in capsys.readouterr().out  # 0.07 ln 8 + 1
    deepseek = tmp_path / "deepseek.json"
    deepseek.write_text(json.dumps(get_preset("deepseek-v3.2").config))
    assert main(["inspect", str(deepseek), "--layer-type", "indexer"]) == 0
    assert "head_dim: 128   rotary_dim: 64   pairing: half" in capsys.readouterr().out
