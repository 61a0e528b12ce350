"""The inspect planner: per-pair facts, method effects, the summary, the curves, and the plot file."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ropekit import RopeConfig
from ropekit.tools.inspect import decay_bound, inspect_config, plot_inspection, qk_cosine


def test_pair_facts_follow_the_formulas():
    report = inspect_config(RopeConfig.preset("llama-2-7b"))
    i = np.arange(64)
    theta = 10000.0 ** (-2 * i / 128)
    np.testing.assert_allclose(report.theta, theta, rtol=1e-12)
    np.testing.assert_allclose(report.wavelength, 2 * math.pi / theta, rtol=1e-12)
    np.testing.assert_allclose(report.rotations, 4096 * theta / (2 * math.pi), rtol=1e-12)
    assert report.methods[0].effect == ["kept"] * 64
    never = int((2 * math.pi / theta > 4096).sum())
    assert report.summary()[0].startswith(
        f"{never} of 64 pairs never complete a rotation within the 4096-token"
    )


def test_requested_methods_classify_pairs():
    report = inspect_config(RopeConfig.preset("llama-2-7b"), methods=["linear", "yarn"], factor=4.0)
    assert report.target_length == 4 * 4096
    linear, yarn = report.methods[1:]
    assert linear.effect == ["interpolated"] * 64
    np.testing.assert_allclose(linear.ratio, 0.25)
    # YaRN: kept while a pair turns > 32 times in 4096 tokens, interpolated below 1 turn.
    assert {e for e, r in zip(yarn.effect, report.rotations, strict=True) if r > 32} == {"kept"}
    assert {e for e, r in zip(yarn.effect, report.rotations, strict=True) if r < 1} == {"interpolated"}
    assert "in between" in yarn.effect
    assert yarn.attention_scaling == pytest.approx(0.1 * math.log(4) + 1)
    kept, slow = int((report.rotations > 32).sum()), int((report.rotations < 1).sum())
    want = f"requested: yarn at 16384 tokens: {kept} kept, {64 - kept - slow} in between, {slow} interpolated"
    assert report.summary()[3].startswith(want)


def test_proportional_pairs_past_the_share_are_zeroed():
    report = inspect_config(
        RopeConfig.preset("llama-2-7b"), methods=["proportional"], extra={"partial_rotary_factor": 0.5}
    )
    assert report.methods[1].effect == ["kept"] * 32 + ["zeroed"] * 32


def test_summary_says_when_the_target_outruns_the_trained_angles():
    report = inspect_config(RopeConfig.preset("llama-2-7b"), target_length=16384)
    assert "turns 4.00x further than anything seen in training" in report.summary()[1]
    report = inspect_config(RopeConfig.preset("llama-2-7b"), methods=["linear"], factor=4.0)
    assert "stays within the angles seen in training" in report.summary()[2]


def test_decay_bound_and_qk_cosine_at_distance_zero_and_decay():
    theta = RopeConfig(64).inv_freq().numpy()
    r = np.array([0, 10, 1000])
    bound = decay_bound(theta, r)
    assert bound[0] == pytest.approx((32 + 1) / 2)  # |S_j| = j at r = 0
    assert bound[0] > bound[1] > bound[2]
    cosine = qk_cosine(theta, r)
    assert cosine[0] == pytest.approx(1.0) and cosine[2] < cosine[1] < 1


def test_plot_is_a_nontrivial_png(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    path = tmp_path / "inspect.png"
    report = inspect_config(RopeConfig.preset("qwen2.5-7b"), methods=["linear"], factor=4.0)
    plot_inspection(report, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 30_000
    pixels = imread(str(path))
    assert pixels.shape[0] >= 400 and pixels.shape[1] >= 1200
    assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 100  # curves, text, colours


def test_bad_target_length_and_unknown_method():
    with pytest.raises(ValueError, match="target_length: expected a positive integer"):
        inspect_config(RopeConfig(64), target_length=0)
    with pytest.raises(ValueError, match="unknown rope_type 'warp'"):
        inspect_config(RopeConfig(64), methods=["warp"], factor=2.0)


def test_factor_or_extra_keys_without_methods_are_errors():
    with pytest.raises(ValueError, match=r"factor: applies to the requested methods, but none was given"):
        inspect_config(RopeConfig.preset("llama-3.1-8b"), factor=4.0)
    with pytest.raises(ValueError, match=r"extra: applies to the requested methods"):
        inspect_config(RopeConfig.preset("llama-3.1-8b"), extra={"beta_fast": 16})


@pytest.mark.parametrize("method", ["linear", "ntk", "dynamic", "yarn", "llama3"])
def test_requested_methods_use_the_one_extension_map(method):
    from ropekit.schedules import extension_scaling

    config = RopeConfig.preset("llama-2-7b")
    report = inspect_config(config, methods=[method], factor=4.0)
    scaling, max_positions = extension_scaling(method, 4.0, 4096)
    requested = report.methods[1].config
    assert requested.scaling == scaling
    assert requested.max_position_embeddings == max_positions


def test_a_method_without_a_factor_extends_to_the_target_length():
    report = inspect_config(RopeConfig.preset("llama-2-7b"), methods=["yarn"], target_length=8192)
    assert report.methods[1].config.scaling["factor"] == 2.0
    with pytest.raises(ValueError, match=r"factor: expected a number >= 1"):
        inspect_config(RopeConfig.preset("llama-2-7b"), methods=["yarn"], target_length=1024)


def _figure(report):
    pytest.importorskip("matplotlib")
    from ropekit.tools.inspect import inspection_figure

    fig = inspection_figure(report)
    fig.canvas.draw()
    return fig


def test_plot_legend_is_outside_every_panel_and_names_each_curve_once():
    import matplotlib.pyplot as plt

    report = inspect_config(RopeConfig.preset("llama-2-7b"), methods=["linear", "yarn"], factor=4.0)
    fig = _figure(report)
    (legend,) = fig.legends
    labels = [t.get_text() for t in legend.get_texts()]
    # llama-2 is unscaled: its configured curve is the no-scaling curve, drawn and listed once.
    assert labels[0] == "configured: default (no scaling) (tables ×1)"
    assert not any(label.startswith("no scaling") for label in labels)
    assert len(labels) == len(set(labels)) == 5  # configured, linear, yarn, training context, target
    box = legend.get_window_extent()
    for ax in fig.axes:
        assert not box.overlaps(ax.get_window_extent()), "the legend covers a panel"
    plt.close(fig)


def test_plot_keeps_the_no_scaling_curve_when_the_model_is_scaled():
    import matplotlib.pyplot as plt

    fig = _figure(inspect_config(RopeConfig.preset("llama-3.1-8b")))
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels[:2] == ["no scaling (tables ×1)", "configured: llama3 (tables ×1)"]
    plt.close(fig)


def test_plot_distance_axes_tick_the_training_and_target_lengths_in_tokens():
    import matplotlib.pyplot as plt

    report = inspect_config(RopeConfig.preset("llama-2-7b"), methods=["linear"], factor=4.0)
    fig = _figure(report)
    for ax in fig.axes[1:]:
        ticks = list(ax.get_xticks())
        assert 4096 in ticks and 16384 in ticks and ticks == sorted(ticks)
        labels = [t.get_text() for t in ax.get_xticklabels()]
        assert "4k" in labels and "16k" in labels and all("10^" not in x and "$" not in x for x in labels)
        assert ax.get_xscale() == "log" and ax.get_xlim() == (1, 16384)
    plt.close(fig)


def test_plot_into_a_missing_folder_is_a_value_error(tmp_path):
    pytest.importorskip("matplotlib")
    report = inspect_config(RopeConfig.preset("llama-2-7b"))
    with pytest.raises(ValueError, match=r"path: folder .*does not exist"):
        plot_inspection(report, str(tmp_path / "missing" / "x.png"))
