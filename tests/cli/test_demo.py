from pathlib import Path

import pytest

from ropekit.cli import build_parser, main
from ropekit.cli.demo import settings_from_args
from ropekit.tools.demo import QUICK, DemoSettings


def parse(*argv):
    return build_parser().parse_args(["demo", *argv])


def test_defaults_are_the_full_demo_into_ropekit_report():
    args = parse()
    assert args.out == Path("ropekit-report")
    assert settings_from_args(args) == DemoSettings()


def test_quick_and_flags_override_the_preset():
    s = settings_from_args(
        parse("--quick", "--steps", "7", "--variants", "rope, nope", "--no-finetune", "--train-only",
              "--seeds", "3")
    )  # fmt: skip
    assert s.dim == QUICK.dim and s.train_length == QUICK.train_length
    assert s.steps == 7 and s.variants == ("rope", "nope") and not s.finetune and not s.evaluate
    assert s.seeds == 3


def test_report_only_takes_a_folder():
    assert parse("--report-only", "some/dir").report_only == Path("some/dir")
    assert parse().report_only is None


def test_finetune_is_part_of_the_default_run():
    assert settings_from_args(parse()).finetune and settings_from_args(parse("--finetune")).finetune


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--variants", "alibi"], "variants"),
        (["--steps", "0"], "steps"),
        (["--variants", "nope"], "finetune"),
        (["--seeds", "0"], "seeds"),
        (["--threads", "0"], "threads"),
        (["--report-only", "no-such-folder"], "results"),
    ],
)
def test_bad_settings_exit_2_with_a_message_before_any_work(argv, message, tmp_path, capsys):
    try:
        code = main(["demo", "--out", str(tmp_path / "never"), *argv])
    except SystemExit as exit_info:  # argparse rejects a malformed flag value itself, with its usage line
        code = exit_info.code
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "never").exists()
