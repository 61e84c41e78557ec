"""The study's plots: steps against batch size (log-log, fit, perfect
scaling, B_crit) and the selected trials' curves."""

import math

from tf_lars.cli import plots


def _row(label, batch, steps, reached=True):
    return {"optimizer": label, "batch_size": batch, "steps": steps,
            "steps_interval": [0.9 * steps, 1.1 * steps], "reached": reached,
            "curve": [[1, 0.1], [steps, 0.7]]}  # fmt: skip


def test_steps_plot_is_log_log_with_the_fit_and_b_crit(tmp_path):
    rows = [_row("LARS", b, 100 + 6400 / b) for b in (16, 64, 256)]
    rows.append(_row("LARS", 1024, 300, reached=False))
    nan = {"s_min": math.nan, "e_min": math.nan, "b_crit": math.nan}
    fits = {"LARS": {"s_min": 100.0, "e_min": 6400.0, "b_crit": 64.0}, "AdamW": nan}
    figure = plots.plot_steps_to_result(rows, fits, tmp_path / "steps.png")
    axes = figure.axes[0]
    assert (axes.get_xscale(), axes.get_yscale()) == ("log", "log")
    assert [t.get_text() for t in axes.get_legend().get_texts()] == ["LARS"]
    assert any(list(line.get_xdata()) == [64.0, 64.0] for line in axes.get_lines())
    assert (tmp_path / "steps.png").stat().st_size > 10_000


def test_perfect_scaling_starts_at_the_smallest_reached_batch(tmp_path):
    # As the critical batch does (the fit leaves out a batch not reached):
    # the dotted line started at batch 8's cap before.
    rows = [
        _row("SGD", 8, 300, reached=False),
        _row("SGD", 32, 120),
        _row("SGD", 128, 40),
    ]
    fits = {"SGD": {"s_min": 20.0, "e_min": 3200.0, "b_crit": 160.0}}
    figure = plots.plot_steps_to_result(rows, fits, tmp_path / "steps.png")
    dotted = [
        line for line in figure.axes[0].get_lines() if line.get_linestyle() == ":"
    ]
    assert len(dotted) == 1
    assert list(dotted[0].get_ydata()) == [480.0, 120.0, 30.0]  # 120 x 32 / B


def test_curves_plot_has_a_panel_per_optimizer(tmp_path):
    rows = [_row("LARS", 16, 50), _row("LAMB", 16, 40), _row("LAMB", 64, 20)]
    figure = plots.plot_selected_curves(
        rows, 0.6, "validation accuracy", tmp_path / "c.png"
    )  # noqa: E501
    assert [axes.get_title() for axes in figure.axes] == ["LARS", "LAMB"]
    assert len(figure.axes[1].get_legend().get_texts()) == 2
