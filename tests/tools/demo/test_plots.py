import math

import matplotlib.pyplot as plt
import numpy as np
import pytest

from ropekit.tools.demo.plots import (
    nice_log_ticks,
    plot_attention,
    plot_position_loss,
    plot_retrieval,
    plot_retrieval_heatmap,
)
from ropekit.tools.demo.report import retrieval_row

L = 64
METHODS = ("nope", "rope", "rope+linear", "rope+yarn", "rope+llama3", "rope+linear+finetune")


@pytest.fixture
def figures(monkeypatch):
    """The figures the plot functions close, kept open for inspection."""
    kept = []
    monkeypatch.setattr(plt, "close", kept.append)
    yield kept
    monkeypatch.undo()
    plt.close("all")


def _visible_axes(fig):
    return [ax for ax in fig.axes if ax.get_visible() and ax.get_title()]


def test_log_ticks_are_round_values_spanning_the_range():
    ticks = nice_log_ticks(6.5, 21.0)
    assert ticks[0] >= 6.5 and ticks[-1] <= 21.0 and len(ticks) >= 3
    assert all(round(t / 10 ** math.floor(math.log10(t)), 6) in {1, 1.5, 2, 3, 5, 7} for t in ticks)


def test_retrieval_plot_gives_each_method_its_own_panel_on_shared_axes(tmp_path, figures):
    rows = [retrieval_row(m, n, d, 10, 20, correct_by_seed=[3, 3, 4], n_by_seed=[7, 7, 6])
            for m in METHODS for n in (L, 2 * L, 4 * L) for d in (0.1, 0.5, 0.9)]  # fmt: skip
    plot_retrieval(tmp_path / "r.png", rows, L)
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    (fig,) = figures
    axes = _visible_axes(fig)
    assert [ax.get_title() for ax in axes] == list(METHODS)
    assert len({ax.get_ylim() for ax in axes}) == 1 and len({ax.get_xlim() for ax in axes}) == 1
    # One line per depth in every panel, not every method on one axis.
    assert all(len(ax.containers) == 3 for ax in axes)


def test_position_loss_plot_is_one_panel_per_method_with_the_rotation_named(tmp_path, figures):
    losses = {m: list(np.linspace(0, 1, 4 * L)) for m in METHODS}
    rotations = {"rope+linear": ("factor 4", "factor 1"), "rope+linear+finetune": ("factor 2", "factor 2")}
    plot_position_loss(tmp_path / "p.png", losses, L, rotations)
    (fig,) = figures
    titles = [ax.get_title() for ax in _visible_axes(fig)]
    assert titles[METHODS.index("rope+linear")] == "rope+linear\nfactor 4 vs factor 1"
    assert titles[METHODS.index("rope+linear+finetune")] == "rope+linear+finetune"
    assert len(titles) == len(METHODS)


def test_attention_panels_share_one_distance_range(tmp_path, figures):
    plot_attention(tmp_path / "a.png", [1 / (1 + r) for r in range(L)], 16, 10000.0, 4 * L,
                   [1 / (1 + r) for r in range(4 * L)])  # fmt: skip
    (fig,) = figures
    top, bottom = fig.axes
    assert top.get_xlim() == bottom.get_xlim() == (0, 4 * L)


def test_heatmap_labels_each_depth_with_its_distance(tmp_path, figures):
    rows = [retrieval_row("rope", n, d, 10, 20) for n in (L, 2 * L) for d in (0.1, 0.9)]
    plot_retrieval_heatmap(tmp_path / "h.png", rows, L)
    (fig,) = figures
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert labels[0] == f"0.1\n{rows[0]['distance'] / L:.1f}L"
