"""The sweep plot: its zoom panel is chosen from the data, its legend shown."""

import pytest

from tf_lars.cli import plots


def _series(accuracies, bad):
    return [("LARS, linear LR", accuracies, bad, "--")]


def test_zoom_range_follows_the_trained_runs():
    # Best 95%; runs within 10 points of it (90, 95) set the range; the
    # collapsed 10% and the 60% run are left out of the zoom.
    series = _series([0.95, 0.90, 0.60, 0.10], [False, False, False, True])
    assert plots.sweep_zoom_range(series) == (89.0, 96.0)
    assert plots.sweep_zoom_range(_series([0.996, 0.99], [False] * 2)) == (98.0, 100.0)
    # Nothing trained: no zoom (the old code drew an empty 99-100% panel).
    assert plots.sweep_zoom_range(_series([0.1, 0.1], [True, True])) is None
    assert plots.sweep_zoom_range(_series([0.05, 0.04], [False, False])) == (3.0, 6.0)


@pytest.mark.parametrize(
    "accuracies, bad, panels",
    [
        ([0.95, 0.90, 0.60, 0.10], [False, False, False, True], 2),
        ([0.10, 0.09], [True, True], 1),
    ],
)
def test_sweep_plot_panels_and_legend(accuracies, bad, panels, tmp_path):
    figure = plots.plot_sweep(
        [32, 64, 128, 256][: len(accuracies)],
        _series(accuracies, bad),
        tmp_path / "sweep.png",
        title="t",
    )
    assert len(figure.axes) == panels
    assert figure.axes[0].get_ylim() == (0.0, 100.0)
    legends = [axes.get_legend() for axes in figure.axes]
    assert [legend is not None for legend in legends] == [False] * (panels - 1) + [True]
    assert [text.get_text() for text in legends[-1].get_texts()] == ["LARS, linear LR"]
    if panels == 2:
        low, high = figure.axes[1].get_ylim()
        assert (low, high) == (89.0, 96.0)
        assert figure.axes[1].get_title() == "Zoom: 89-96%"
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
