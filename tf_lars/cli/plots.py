"""PNG plots of the `tf-lars` command line. Matplotlib's Agg backend only."""

import math

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend
import numpy as np  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402


def _save(figure, path):
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_curves(history, path):
    """Loss and accuracy per epoch, train and test, side by side."""
    figure, panels = plt.subplots(1, 2, figsize=(10, 4))
    epochs = np.arange(1, len(history.get("loss", [])) + 1)
    for axes, key, scale, title in zip(
        panels, ("loss", "accuracy"), (1, 100), ("Loss", "Accuracy"), strict=True
    ):
        for name, label, style in ((key, "train", "-"), (f"val_{key}", "test", "--")):
            if name in history:
                values = scale * np.asarray(history[name], dtype=np.float64)
                axes.plot(epochs, values, style, label=label)
        axes.set_xlabel("epoch")
        axes.set_title(title)
        axes.legend()
        axes.grid(alpha=0.3)
    panels[0].set_yscale("log")
    panels[0].set_ylabel("cross-entropy loss (log scale)")
    panels[1].set_ylabel("accuracy (%)")
    _save(figure, path)


def plot_learning_rate(learning_rates, steps_per_epoch, path):
    """The learning rate of every optimizer step, x-axis in epochs."""
    figure, axes = plt.subplots(figsize=(6, 4))
    steps = np.arange(len(learning_rates))
    axes.plot(steps / steps_per_epoch, learning_rates)
    axes.set_xlabel("epoch")
    axes.set_ylabel("learning rate")
    axes.set_title(
        f"Learning rate (peak {np.max(learning_rates):.4g}, "
        f"{steps_per_epoch} steps/epoch)"
    )
    axes.grid(alpha=0.3)
    _save(figure, path)


def plot_trust_ratios(paths, epochs, trust_ratios, path):
    """Heat map: one row per variable, one column per record, log colour scale.

    Variables whose trust ratio was exactly 1 at every record (excluded from
    layer adaptation) are left out, and counted in the title.
    """
    ratios = np.asarray(trust_ratios, dtype=np.float64)
    adapted = ~np.all(ratios == 1.0, axis=0)
    shown = ratios[:, adapted].T
    names = [name for name, keep in zip(paths, adapted, strict=True) if keep]
    hidden = len(paths) - len(names)
    figure, axes = plt.subplots(figsize=(9, 1.2 + 0.35 * max(len(names), 2)))
    title = "Per-layer LARS trust ratio at each epoch end"
    if hidden:
        title += f" ({hidden} excluded variable(s) at 1.0 not shown)"
    if not names:
        axes.text(
            0.5,
            0.5,
            "every variable is excluded from layer adaptation",
            ha="center",
            va="center",
        )
        axes.set_axis_off()
    else:
        positive = shown[np.isfinite(shown) & (shown > 0)]
        low = float(positive.min()) if positive.size else 1e-3
        high = float(positive.max()) if positive.size else 1.0
        if not high > low:
            low, high = low / 2, high * 2
        image = axes.imshow(
            np.where(np.isfinite(shown) & (shown > 0), shown, np.nan),
            aspect="auto",
            interpolation="nearest",
            cmap="viridis",
            norm=LogNorm(vmin=low, vmax=high),
            extent=(0.5, len(epochs) + 0.5, len(names) - 0.5, -0.5),
        )
        axes.set_yticks(range(len(names)))
        axes.set_yticklabels(names, fontsize=8)
        axes.set_xlabel("epoch")
        figure.colorbar(image, ax=axes, label="trust ratio (log scale)")
    axes.set_title(title, fontsize=10)
    _save(figure, path)


def plot_communication(rows, path):
    """Test accuracy (the reruns' mean and interval) against the bytes each
    worker communicated (log x): a colour per method, a marker per M, a line
    style per speeds profile; the points labelled with H."""
    figure, axes = plt.subplots(figsize=(8, 5))
    labels = sorted({row["label"] for row in rows})
    colours = {label: f"C{index}" for index, label in enumerate(labels)}
    counts = sorted({row["workers"] for row in rows})
    markers = {m: "os^vDP*"[i % 7] for i, m in enumerate(counts)}
    names = list(dict.fromkeys(row["speeds"] for row in rows))
    styles = {name: ("-", "--", ":", "-.")[i % 4] for i, name in enumerate(names)}
    series = {}
    for row in rows:
        series.setdefault((row["label"], row["workers"], row["speeds"]), []).append(row)
    for (label, workers, speeds), points in sorted(series.items()):
        points = sorted(points, key=lambda r: r["bytes_sent"])
        x = [r["bytes_sent"] + r["bytes_received"] for r in points]
        y = np.array([100 * r["test"] for r in points])
        axes.errorbar(
            x, y, yerr=_bars(y, [r["test_interval"] for r in points], 100),
            marker=markers[workers],
            linestyle=styles[speeds], color=colours[label], capsize=2,
            label=f"{label}, M={workers}, {speeds}",
        )  # fmt: skip
        for r, xi, yi in zip(points, x, y, strict=True):
            axes.annotate(
                f"{r['sync_every']}", (xi, yi), fontsize=6, color=colours[label],
                xytext=(3, 3), textcoords="offset points",
            )  # fmt: skip
    axes.set_xscale("log")
    axes.set_xlabel("bytes per worker, sent + received (log scale); labels: H")
    axes.set_ylabel("test accuracy (%), mean over seeds with interval")
    axes.set_title("Accuracy against communication, every method tuned")
    axes.legend(fontsize=6, ncol=2)
    axes.grid(alpha=0.3)
    _save(figure, path)


def _bars(means, intervals, unit=1.0):
    """`errorbar`'s `yerr` of `means` and their `(low, high)` intervals (in
    `means`' units / `unit`); no bar where an interval is None (one seed)."""
    bounds = np.array(
        [[m, m] if low is None else [unit * low, unit * high]
         for m, (low, high) in zip(means, intervals, strict=True)], float,
    )  # fmt: skip
    return [means - bounds[:, 0], bounds[:, 1] - means]


def plot_steps_to_result(rows, fits, path):
    """Steps to the target against batch size, log-log, per optimizer: the
    reruns' mean with its interval, the fit S_min + E_min/B, perfect scaling
    from the smallest batch the fit holds, one reached (dotted), and B_crit
    (a vertical line)."""
    figure, axes = plt.subplots(figsize=(7, 5))
    for index, (label, fit) in enumerate(fits.items()):
        color = f"C{index}"
        mine = [r for r in rows if r["optimizer"] == label]
        if not mine:
            continue
        batches = np.array([r["batch_size"] for r in mine], float)
        steps = np.array([r["steps"] for r in mine])
        reached = np.array([r["reached"] for r in mine])
        axes.errorbar(
            batches, steps, yerr=_bars(steps, [r["steps_interval"] for r in mine]),
            fmt="o", color=color,
            label=label, capsize=3,
        )  # fmt: skip
        if (~reached).any():
            axes.plot(batches[~reached], steps[~reached], "x", color="red", ms=10)
        if reached.any():  # as the critical batch: from the smallest reached
            first = np.flatnonzero(reached)[0]
            axes.plot(
                batches, steps[first] * batches[first] / batches, ":", color=color
            )
        if math.isfinite(fit["s_min"]):
            grid = np.geomspace(batches.min(), batches.max(), 100)
            axes.plot(grid, fit["s_min"] + fit["e_min"] / grid, "-", color=color)
            if math.isfinite(fit["b_crit"]) and fit["b_crit"] > 0:
                axes.axvline(fit["b_crit"], color=color, ls="--", alpha=0.5)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("batch size")
    axes.set_ylabel("steps to the target")
    axes.set_title(
        "Steps to result: mean of reruns (bars: interval; red x: not reached);\n"
        "line: S_min + E_min/B, dotted: perfect scaling, dashed: B_crit",
        fontsize=9,
    )
    if rows:  # none after a Ctrl-C before the first unit finished
        axes.legend(fontsize=8)
    axes.grid(alpha=0.3, which="both")
    _save(figure, path)
    return figure


def plot_selected_curves(rows, target, metric, path):
    """The selected trial's validation curve of every unit: one panel per
    optimizer, one line per batch size, the target dashed."""
    labels = list(dict.fromkeys(r["optimizer"] for r in rows)) or ["(none)"]
    figure, panels = plt.subplots(
        1, len(labels), figsize=(4 * len(labels), 3.6), squeeze=False, sharey=True
    )
    for axes, label in zip(panels[0], labels, strict=True):
        drawn = 0  # a trial that diverged before its first evaluation has none
        for row in (r for r in rows if r["optimizer"] == label):
            curve = np.asarray(row["curve"], float).reshape(-1, 2)
            axes.plot(curve[:, 0], curve[:, 1], label=f"B={row['batch_size']}")
            drawn += len(curve)
        axes.axhline(target, color="black", ls="--", lw=1)
        if drawn:
            axes.set_xscale("log")
        axes.set_xlabel("step")
        axes.set_title(label)
        axes.grid(alpha=0.3)
        if rows:
            axes.legend(fontsize=7)
    panels[0][0].set_ylabel(metric)
    if metric == "expected loss":
        panels[0][0].set_yscale("log")
    _save(figure, path)
    return figure
