"""`ropekit verify`: the table, --json, exit codes, bad arguments, and `python -m ropekit`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import ropekit.cli.verify
from ropekit.cli import main
from ropekit.tools.verify import Check


def test_prints_a_pass_table_and_exits_zero(capsys):
    assert main(["verify", "--head-dim", "16"]) == 0
    out = capsys.readouterr().out
    assert "head_dim=16 base=10000 rotary_dim=16 pairing=half (GPT-NeoX / HF)" in out
    assert "check" in out and "max error" in out and "tolerance" in out
    assert "R_m^T R_n = R_(n-m)" in out and "textbook: theta=30deg, m=1, n=3 gives 0.5" in out
    assert "FAIL" not in out and out.count("PASS") >= 13
    assert out.rstrip().endswith("passed, 0 failed")


def test_json_output_follows_the_schema(capsys):
    assert (
        main(
            ["verify", "--head-dim", "12", "--rotary-dim", "8", "--base", "500000", "--interleaved", "--json"]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert list(doc) == ["checks"] and len(doc["checks"]) >= 13
    for check in doc["checks"]:
        assert list(check) == ["name", "max_error", "tolerance", "passed"]
        assert isinstance(check["name"], str) and isinstance(check["passed"], bool)
        assert isinstance(check["max_error"], float) and isinstance(check["tolerance"], float)
        assert check["passed"] and check["max_error"] <= check["tolerance"]


def test_a_failing_check_gives_a_non_zero_exit_and_a_fail_row(monkeypatch, capsys):
    monkeypatch.setattr("ropekit.tools.verify.run_checks", lambda config: [Check("broken claim", 1.0, 1e-9)])
    assert main(["verify"]) == 1
    out = capsys.readouterr().out
    assert "broken claim" in out and "FAIL" in out and "0 passed, 1 failed" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["verify", "--rotary-dim", "7"],
            "rotary_dim: expected a positive even integer <= head_dim (128), got 7",
        ),
        (["verify", "--head-dim", "0"], "head_dim: expected a positive integer, got 0"),
        (["verify", "--base", "1"], "base: expected a finite number > 1, got 1.0"),
    ],
)
def test_bad_values_exit_2_with_the_message(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ropekit verify: error: ") and message in err


@pytest.mark.parametrize("argv", [["verify", "--head-dim", "abc"], ["verify", "--nope"], []])
def test_malformed_arguments_exit_2_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "usage: ropekit" in capsys.readouterr().err


def test_format_table_aligns_columns():
    table = ropekit.cli.verify.format_table([Check("short", 0.0, 1e-9), Check("a longer name", 2e-3, 1e-9)])
    rows = table.splitlines()
    assert rows[2].index("PASS") == rows[3].index("FAIL")
    assert rows[-1] == "1 passed, 1 failed"


def test_python_dash_m_ropekit_verify_runs_the_same_command():
    done = subprocess.run(
        [sys.executable, "-m", "ropekit", "verify", "--head-dim", "8", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert all(c["passed"] for c in json.loads(done.stdout)["checks"])
