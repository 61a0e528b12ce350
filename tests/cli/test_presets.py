"""`ropekit presets`: the list, one preset in full, and JSON."""

from __future__ import annotations

import json

from ropekit.cli import main
from ropekit.presets import PRESETS


def test_list_names_every_preset(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in PRESETS)
    # the name column is as wide as the longest name, then head_dim right-aligned in its 9 columns; rope_type
    # as wide as proportional
    width = max(len(name) for name in PRESETS)
    assert "gpt-j-6b".ljust(width) + "      256     64     10000 default      interleaved    2048" in out


def test_one_preset_in_json_carries_its_source(capsys):
    assert main(["presets", "deepseek-v3", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["source"] == "https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json"
    assert row["scaling"]["mscale_all_dim"] == 1.0 and row["interleaved"] is True


def test_unknown_preset_is_a_clean_error(capsys):
    assert main(["presets", "gpt-5"]) == 2
    assert "unknown preset 'gpt-5'" in capsys.readouterr().err


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly():
    """`ropekit presets --json | head -1`: no BrokenPipeError traceback, exit status 128 + SIGPIPE."""
    import os
    import subprocess
    import sys

    script = (
        "import os, sys\n"
        "from ropekit.cli import main\n"
        "read, write = os.pipe()\n"
        "os.close(read)\n"  # the reader is gone before the first byte
        "os.dup2(write, sys.stdout.fileno())\n"
        "sys.exit(main(['presets', '--json']))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=os.environ, timeout=120
    )
    assert result.returncode == 141, result.stderr
    assert result.stderr == ""


def test_json_rows_are_plain_json_with_lists():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "ropekit", "presets", "phi-3-mini-128k", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    row = json.loads(out)
    assert isinstance(row["scaling"]["short_factor"], list) and len(row["scaling"]["short_factor"]) == 48
