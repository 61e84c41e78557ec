"""`tf-lars study`: known answers (the noisy quadratic model in closed form,
the S(B) fit, the bootstrap), the shared training function, resuming,
sharing one storage between processes, Ctrl-C, and the removed `sweep`."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tf_lars.cli import study
from tf_lars.cli.config import load_config

SGD_ONLY = [
    "--set",
    "optimizers=[{label: SGD, learning_rate: [0.01, 1.95], "
    "optimizer: {class_name: SGD, config: {momentum: 0.0}}}]",
]


def _quick(tmp_path, name, *more):
    return ("study", "--quick", "--set", f"output_dir={tmp_path}",
            "--set", f"run_name={name}", *more)  # fmt: skip


def _results(folder):
    return json.loads((folder / "results.json").read_text())


def closed_form_steps(batch, rates, target, dimensions=100, cap=2000):
    """The fewest steps of constant-rate SGD to an expected loss <= target,
    over `rates`, from `E[θ_i²]_t = r^t (1 - s) + s` (r = (1 - αh)², s the
    stationary moment αc / (B h (2 - αh))), not from the recurrence."""
    h = 1.0 / np.arange(1, dimensions + 1)
    t = np.arange(1, cap + 1)[:, None]
    best = np.inf
    for rate in rates:
        r = (1 - rate * h) ** 2
        s = rate * h / (batch * h * (2 - rate * h))
        loss = 0.5 * (h * (r**t * (1 - s) + s)).sum(axis=1)
        reached = np.flatnonzero(loss <= target)
        if reached.size:
            best = min(best, reached[0] + 1)
    return best


def test_nqm_study_matches_the_closed_form_at_every_batch_size(tmp_path, run_cli):
    code, out, err = run_cli(*_quick(tmp_path, "nqm"), *SGD_ONLY)
    assert code == 0, err
    results = _results(tmp_path / "nqm")
    rows = {row["batch_size"]: row for row in results["rows"]}
    config = load_config("study", preset="study-quick")
    batches = config["study"]["batch_sizes"]
    assert sorted(rows) == batches
    rates = np.geomspace(0.01, 1.95, 400)
    exact = {b: closed_form_steps(b, rates, config["study"]["target"]) for b in batches}
    for batch in batches:
        assert rows[batch]["reached"]
        assert rows[batch]["steps"] == pytest.approx(exact[batch], rel=0.10), batch
    # Perfect scaling at the small batches, flat at the large ones.
    assert exact[2] / exact[8] == pytest.approx(4, rel=0.1)
    assert exact[512] == pytest.approx(exact[2048], rel=0.1)
    fit = results["fits"]["SGD"]
    assert 8 < fit["b_crit"] < 128  # between the two regimes
    for name in ("report.md", "results.csv", "steps.png", "curves.png"):
        assert (tmp_path / "nqm" / name).stat().st_size > 500, name
    report = (tmp_path / "nqm" / "report.md").read_text()
    assert "B_crit" in report and "16 quasi-random trials" in report


def test_fit_recovers_known_scaling_from_synthetic_data():
    batches = np.array([16, 32, 64, 128, 256, 512, 1024])
    s_min, e_min = 120.0, 30_000.0
    noise = np.random.default_rng(0).normal(1.0, 0.01, len(batches))
    fitted = study.fit_scaling(batches, (s_min + e_min / batches) * noise)
    assert fitted[0] == pytest.approx(s_min, rel=0.05)
    assert fitted[1] == pytest.approx(e_min, rel=0.05)
    exact = study.fit_scaling(batches, s_min + e_min / batches)
    assert exact == pytest.approx((s_min, e_min), rel=1e-9)
    # Within 20% of perfect scaling from the smallest batch b0 while
    # (S_min B + E_min) / (S_min b0 + E_min) <= 1.2: 1.18 at 64, 1.45 at 128.
    steps = s_min + e_min / batches
    assert study.critical_batch(batches, steps) == 64


def test_bootstrap_interval_contains_the_truth():
    rng = np.random.default_rng(1)
    covered = 0
    for _ in range(200):
        values = rng.normal(500.0, 50.0, 30)
        low, high = study.bootstrap_interval(
            values, 0.9, 1000, seed=int(rng.integers(1 << 30))
        )  # noqa: E501
        covered += low <= 500.0 <= high
    assert 0.84 <= covered / 200 <= 0.96  # nominal 90%


def test_sweep_is_gone_and_names_study(run_cli, one_line_error):
    code, _, err = run_cli("sweep", "--set", "training.epochs=1")
    assert "tf-lars study" in one_line_error(code, err, "sweep")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--set", "search.warmup_share=[0.5, 0.1]"],
            "`search.warmup_share` must be [low, high]",
        ),  # noqa: E501
        (
            ["--set", "optimizers.0.learning_rate=[0.3, 0.1]"],
            "with low <= high, low > 0",
        ),
        (
            [
                "--set",
                "workload=nqm",
                "--set",
                "optimizers.1.optimizer.class_name=Adam",
            ],
            "must be SGD with workload nqm",
        ),  # fmt: skip
        (["--set", "study.trials=0"], "`study.trials` must be an int >= 1"),
        (["--set", "study.target=1.5"], "must be at most 1"),
    ],
)
def test_bad_config_is_one_line(argv, expected, tmp_path, run_cli, one_line_error):
    code, _, err = run_cli("study", *argv, "--set", f"output_dir={tmp_path}")
    assert expected in one_line_error(code, err, "study")


def test_a_rerun_resumes_the_study(tmp_path, run_cli, monkeypatch):
    """An interrupted study keeps its finished trials; the rerun runs only
    the rest, and no trial twice."""
    argv = (*_quick(tmp_path, "r"), *SGD_ONLY, "--set", "study.batch_sizes=[8, 128]")
    calls, real = [], study.run_trial

    def interrupted(*args, **kwargs):
        if len(calls) == 20:
            raise KeyboardInterrupt
        calls.append(args[4])
        return real(*args, **kwargs)

    monkeypatch.setattr(study, "run_trial", interrupted)
    code, _, err = run_cli(*argv)
    assert code == 130 and "resumes" in err, err
    assert "after 20 of 38 trials" in (tmp_path / "r" / "INTERRUPTED").read_text()
    monkeypatch.setattr(study, "run_trial", real)
    code, _, err = run_cli(*argv)
    assert code == 0, err
    rows = _results(tmp_path / "r")["rows"]
    assert [r["batch_size"] for r in rows] == [8, 128]
    storage = study.open_storage(f"sqlite:///{tmp_path}/r/study.db")
    import optuna

    counts = []
    for summary in optuna.get_all_study_summaries(storage):
        trials = optuna.load_study(
            study_name=summary.study_name, storage=storage
        ).trials
        states = [t.state.name for t in trials]
        counts.append(states.count("COMPLETE"))
        assert states.count("FAIL") <= 1  # the one interrupted
    assert sorted(counts) == [3, 3, 16, 16]
