"""`tf-lars study`: known answers (the noisy quadratic model in closed form,
the S(B) fit, the bootstrap), the shared training function, resuming,
sharing one storage between processes, Ctrl-C, and the removed `sweep`.

What the removed `sweep` tests checked is here now: its config errors
(tests/cli_test.py BAD_SWEEP) in test_bad_config_is_one_line; its end to end
run in two processes in test_nqm_study_matches_the_closed_form_at_every_batch_size
and test_two_processes_share_one_study; its Ctrl-C tests (tests/cli_safety_test.py)
in test_ctrl_c_keeps_finished_trials_and_a_rerun_resumes and
test_a_rerun_resumes_the_study; its default plan in test_default_study. Its
killed-worker test (tests/cli_sweep_hostile_test.py) has no successor: a
study's killed worker leaves its trial RUNNING until Optuna's heartbeat fails
it (2.5 minutes), then it is queued again at its point
(test_a_stopped_or_dead_trial_runs_again_at_its_point)."""

import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tf_lars.cli import config as config_module
from tf_lars.cli import study
from tf_lars.cli.config import ConfigError, load_config

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


def closed_form_steps(batches, rates, target, dimensions=100, cap=2000):
    """Per batch size, the fewest steps of constant-rate SGD to an expected
    loss <= target, over `rates`, from `E[θ_i²]_t = r^t (1 - s) + s`
    (r = (1 - αh)², s the stationary moment αc / (B h (2 - αh)) = s₁ / B),
    not from the recurrence: the loss is ½ (Σ h r^t - Σ h s₁ r^t / B + Σ h s₁ / B),
    its two sums over i computed once per rate for every batch size."""
    h = 1.0 / np.arange(1, dimensions + 1)
    t = np.arange(1, cap + 1)[:, None]
    best = dict.fromkeys(batches, np.inf)
    for rate in rates:
        powers = (1 - rate * h) ** (2 * t)  # r^t, steps x dimensions
        s1 = rate / (2 - rate * h)  # s times B
        decaying, carried = powers @ h, powers @ (h * s1)
        for batch in batches:
            loss = 0.5 * (decaying - carried / batch + (h * s1).sum() / batch)
            reached = np.flatnonzero(loss <= target)
            if reached.size:
                best[batch] = min(best[batch], reached[0] + 1)
    return best


def test_nqm_study_matches_the_closed_form_at_every_batch_size(tmp_path, run_cli):
    # A learning rate in the optimizer block trains nothing (each trial draws
    # its own), and the run says so; the momentum is not searched here.
    rate = ("--set", "optimizers.0.optimizer.config.learning_rate=3")
    code, out, err = run_cli(*_quick(tmp_path, "nqm"), *SGD_ONLY, *rate)
    assert code == 0, err
    assert err.splitlines()[0] == (
        "tf-lars study: warning: `optimizers.0.optimizer.config.learning_rate` (3) is "
        "not used: each trial draws it from `optimizers.0.learning_rate` [0.01, 1.95]"
    )
    results = _results(tmp_path / "nqm")
    rows = {row["batch_size"]: row for row in results["rows"]}
    config = load_config("study", preset="study-quick")
    batches = config["study"]["batch_sizes"]
    assert sorted(rows) == batches
    rates = np.geomspace(0.01, 1.95, 400)
    exact = closed_form_steps(batches, rates, config["study"]["target"])
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
    # Nothing searched but the rate (", ." before); the NQM's steps are exact
    # (the report spoke of evaluations every 10 steps); the curves' last
    # point once (it was doubled).
    assert "(log-uniform, per\noptimizer). A trial's steps: the first step at" in report
    assert "(200\nresamples: each one fits again)" in report
    for row in results["rows"]:
        assert row["curve"][-1] != row["curve"][-2], row["batch_size"]


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


def test_one_seed_has_no_interval_and_a_fit_needs_two_batch_sizes():
    # One seed's "95% interval" was [x, x]; one batch size's fit gave
    # B_crit = inf and B_simple / B_crit = 0, and results.json NaN.
    assert study.bootstrap_interval([0.7]) == (None, None)
    config = {"study": {"resamples": 100, "confidence": 0.95}}

    def row(batch, steps, noise=20.0):
        return {"batch_size": batch, "reached": True, "seed_steps": steps,
                "b_simple": noise}  # fmt: skip

    one = study._fit(config, [row(64, [100, 110])])
    assert math.isnan(one["b_crit"]) and math.isnan(one["critical_batch"])
    assert one["b_simple_over_b_crit"] is None and one["b_simple"] == 20.0
    perfect = study._fit(config, [row(8, [800, 800]), row(16, [400, 400])])
    assert perfect["s_min"] == 0 and perfect["b_crit"] == math.inf
    assert perfect["b_simple_over_b_crit"] is None
    assert perfect["critical_batch"] == 16
    from tf_lars.cli import preflight

    strict = preflight.strict_json({"fits": {"a": one, "b": perfect}})
    text = json.dumps(strict, allow_nan=False)
    assert json.loads(text)["fits"]["a"]["b_crit"] is None


def test_a_high_warmup_share_leaves_a_step_to_decay():
    # round(0.99 x 1 step) = 1 warm-up step of 1: refused mid-study, with
    # Optuna's traceback.
    from tf_lars.cli import preflight

    config = load_config("study", overrides=["study.max_steps=1"])
    entry = config["optimizers"][0]
    params = {"learning_rate": 0.1, "warmup_share": 0.99}
    for batch, num_train in ((1077, 1077), (16, 64)):
        train = study.trial_config(config, entry, batch, params, 1, num_train)
        per_epoch = num_train // batch
        epochs = train["training"]["epochs"]
        warmup = preflight.check_warmup(train["schedule"], per_epoch, epochs)
        assert warmup == min(round(0.99 * epochs * per_epoch), epochs * per_epoch - 1)


def test_a_resumed_study_may_change_its_workers_and_intervals(tmp_path, run_cli):
    # Refused before, with advice (--overwrite) that deleted every trial.
    argv = (*_quick(tmp_path, "w"), *SGD_ONLY, "--set", "study.batch_sizes=[8]")
    assert run_cli(*argv, "--set", "study.trials=2")[0] == 0
    code, out, err = run_cli(*argv, "--set", "study.trials=2",
                             "--set", "study.resamples=500")  # fmt: skip
    assert code == 0, err
    code, _, err = run_cli(*argv, "--set", "study.trials=3")
    assert code == 2 and "--overwrite" in err


def test_default_study():
    config = load_config("study")
    assert config["workload"] == "mnist1d"
    labels = [entry["label"] for entry in config["optimizers"]]
    assert labels == ["Nesterov", "AdamW", "LARS", "LAMB"]
    assert len(config["study"]["batch_sizes"]) >= 6
    assert (config["study"]["trials"], config["study"]["seeds"]) == (16, 3)
    assert config["study"]["storage"] is None
    assert [u[1] for u in study.units(config)][:4] == [16] * 4


def test_mnist1d_is_generated_once_and_read_back(tmp_path, monkeypatch):
    import mnist1d.data

    from tf_lars.cli import data

    monkeypatch.setenv("TF_LARS_CACHE", str(tmp_path / "cache"))
    first = data.load_mnist1d(200, 5)
    (kept,) = (tmp_path / "cache").iterdir()
    assert kept.name.startswith("mnist1d-") and kept.name.endswith("-200-5.npz")

    def refuse(arguments):
        raise AssertionError("generated again")

    monkeypatch.setattr(mnist1d.data, "make_dataset", refuse)
    again = data.load_mnist1d(200, 5)
    for name in data.REQUIRED_ARRAYS:
        np.testing.assert_array_equal(getattr(again, name), getattr(first, name))
    assert again.source == first.source
    # A damaged file is generated again and replaced; nothing partial stays.
    kept.write_bytes(b"not an npz")
    monkeypatch.undo()
    monkeypatch.setenv("TF_LARS_CACHE", str(tmp_path / "cache"))
    np.testing.assert_array_equal(data.load_mnist1d(200, 5).x_test, first.x_test)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [kept.name]
    np.load(kept).close()
    # A folder that cannot be written costs the time only.
    monkeypatch.setenv("TF_LARS_CACHE", str(kept / "not-a-folder"))
    np.testing.assert_array_equal(data.load_mnist1d(200, 5).y_train, first.y_train)


def test_values_the_search_replaces_are_named_where_the_user_gives_them():
    sets = [
        "optimizers.0.optimizer.config={nesterov: true, momentum: 0.9}",
        "optimizers.1.optimizer.config.beta_1=0.8",
        "optimizers.1.optimizer.config.weight_decay=0.1",
        "search.warmup_share=[0.0, 0.1]",
    ]
    config = load_config("study", overrides=sets)
    lines = config_module.unused_settings("study", config, None, sets)
    assert lines == [
        "`optimizers.0.optimizer.config.momentum` (0.9) is not used: each trial draws "
        "1 - it from `search.one_minus_momentum` [0.01, 0.5] (set "
        "`search.one_minus_momentum` to null to use it)",
        "`optimizers.1.optimizer.config.beta_1` (0.8) is not used: each trial draws "
        "1 - it from `search.one_minus_momentum` [0.01, 0.5] (set "
        "`search.one_minus_momentum` to null to use it)",
        "`optimizers.1.optimizer.config.weight_decay` (0.1) is not used: each trial "
        "draws it from `search.weight_decay` [1e-05, 0.01] (set `search.weight_decay` "
        "to null to use it)",
    ]
    # Not searched: used, so not named.
    sets += ["search.one_minus_momentum=null", "search.weight_decay=null"]
    config = load_config("study", overrides=sets)
    assert config_module.unused_settings("study", config, None, sets) == []
    # lowcomm: the default file's value is not named, another is.
    for rate, named in ((0.7, []), (0.5, ["outer_optimizer.config.learning_rate"])):
        sets = [f"outer_optimizer.config.learning_rate={rate}"]
        config = load_config("lowcomm", overrides=sets)
        lines = config_module.unused_settings("lowcomm", config, None, sets)
        assert [line.split("`")[1] for line in lines] == named


def test_sweep_is_gone_and_names_study(run_cli, one_line_error):
    code, _, err = run_cli("sweep", "--set", "training.epochs=1")
    assert "tf-lars study" in one_line_error(code, err, "sweep")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--set", "search.warmup_share=[0.5, 0.1]"],
            "`search.warmup_share` must be [low, high] with 0 <= low <= high and the "
            "high end <= 0.99. Received: search.warmup_share=[0.5, 0.1]",
        ),
        (
            ["--set", "optimizers.0.learning_rate=[0.3, 0.1]"],
            "`optimizers.0.learning_rate` must be [low, high] with 0 < low <= high. "
            "Received: optimizers.0.learning_rate=[0.3, 0.1]",
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
        (["--set", "optimizers.0.label=AdamW"], "`optimizers.*.label` must be unique"),
        (["--set", "study.batch_size=32"], "Unknown config key `study.batch_size`"),
        # Deduplicated silently before (and the study's hash changed).
        (
            ["--set", "study.batch_sizes=[16, 64, 16]"],
            "`study.batch_sizes` must be unique. Received: batch_sizes=16 twice",
        ),
        # A traceback after the tuning trials had run.
        (
            ["--set", "seed=4294967294", "--set", "study.seeds=3"],
            "`seed` + `study.seeds` must be at most 4294967295",
        ),
        # Tracebacks (SQLAlchemy's), or a run folder claimed first.
        (
            ["--set", "study.storage=foo://x"],
            "`study.storage` must be a database URL (e.g. sqlite:///trials.db): "
            "Can't load plugin: sqlalchemy.dialects:foo. Received: "
            "study.storage='foo://x'",
        ),
        (["--set", "study.storage=notaurl"], "`study.storage` must be a database URL"),
        (
            ["--set", "study.storage=sqlite:////no-such-folder/trials.db"],
            "`study.storage`: the folder /no-such-folder does not exist.",
        ),
        # 'full' was offered, which `study.batch_sizes` refuses.
        (
            ["--set", "workload=data", "--set", "study.batch_sizes=[16, 5000]"],
            "`study.batch_sizes.1` must be at most the training set size (1077). "
            "Received: study.batch_sizes.1=5000",
        ),
        (
            ["--set", "optimizers.4.label=x"],
            "`optimizers.4` is not an index into a list of 4",
        ),
    ],
)
def test_bad_config_is_one_line(argv, expected, tmp_path, run_cli, one_line_error):
    code, _, err = run_cli("study", *argv, "--set", f"output_dir={tmp_path}")
    assert expected in one_line_error(code, err, "study")
    assert os.listdir(tmp_path) == []


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
    records, handler = [], logging.Handler()
    handler.emit = records.append
    logging.getLogger("optuna").addHandler(handler)
    try:
        code, _, err = run_cli(*argv)
    finally:
        logging.getLogger("optuna").removeHandler(handler)
    assert code == 130, err
    # A stop is no failed trial: Optuna logged none (its traceback, on
    # stderr, before).
    assert [r.getMessage() for r in records if r.levelno >= logging.WARNING] == []
    assert "and the 1 finished rows in results.csv; the same command resumes" in err
    assert "after 20 of 38 trials" in (tmp_path / "r" / "INTERRUPTED").read_text()
    kept = _results(tmp_path / "r")["rows"]  # the finished unit's, kept
    assert [r["batch_size"] for r in kept] == [8]
    assert (tmp_path / "r" / "results.csv").read_text().count("\n") == 2
    monkeypatch.setattr(study, "run_trial", real)
    code, _, err = run_cli(*argv)
    assert code == 0, err
    rows = _results(tmp_path / "r")["rows"]
    assert [r["batch_size"] for r in rows] == [8, 128] and rows[0] == kept[0]
    # study.db alone holds every trial (its write-ahead log was left behind,
    # holding some, before): the counts below read a copy of it alone.
    (tmp_path / "copy").mkdir()
    shutil.copy(tmp_path / "r" / "study.db", tmp_path / "copy" / "study.db")
    storage = study.open_storage(f"sqlite:///{tmp_path}/copy/study.db")
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


def test_a_second_ctrl_c_while_results_are_written_keeps_the_note(
    tmp_path, run_cli, monkeypatch
):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(study, "run_trial", interrupted)
    monkeypatch.setattr(study, "_write_results", interrupted)  # the second
    code, _, err = run_cli(*_quick(tmp_path, "r"), *SGD_ONLY)
    assert code == 130, err
    note = (tmp_path / "r" / "INTERRUPTED").read_text()
    assert note.startswith("Interrupted (Ctrl-C) after 0 of 114 trials")


@pytest.mark.parametrize("direction", ["minimize", "maximize"])
def test_a_unit_selects_its_best_trial_and_reruns_it(direction, monkeypatch):
    """The runner `study` and `lowcomm` share: a unit runs its budget of
    tuning trials, selects the best value in the plan's direction (the first
    of equals), reruns its parameters on seeds seed+1, seed+2, and
    `finished` returns them by seed."""
    import types

    import optuna

    plan = types.ModuleType("shared_runner_plan")
    plan.BLOCK, plan.DIRECTION = "tuning", direction
    plan.unit_name = lambda config, unit, part: f"{unit} {part}"

    def evaluate(config, unit, trial, seed, rerun):
        x = trial.suggest_float("x", 0.0, 1.0)
        return {"x": x, "seed": seed, "rerun": rerun}, float(x >= 0.5)  # ties

    plan.evaluate = evaluate
    monkeypatch.setitem(sys.modules, plan.__name__, plan)
    config = {"seed": 7, "tuning": {"trials": 6, "seeds": 2}}
    storage = optuna.storages.InMemoryStorage()
    assert study.advance(plan, storage, config, "u", lambda *_: None)
    trials, best, runs = study.finished(storage, config, "u", plan.__name__)
    values = [t.value for t in trials]
    assert len(trials) == 6 and set(values) == {0.0, 1.0}
    wanted = (min if direction == "minimize" else max)(values)
    assert best.number == min(t.number for t in trials if t.value == wanted)
    assert [(r["seed"], r["rerun"], r["x"]) for r in runs] == [
        (8, True, best.params["x"]),
        (9, True, best.params["x"]),
    ]
    assert study.advance(plan, storage, config, "u", lambda *_: None)  # no more
    assert len(optuna.load_study(study_name="u reruns", storage=storage).trials) == 2


def test_only_a_studys_first_rerun_sees_the_test_set(monkeypatch):
    """A study's tuning trials and reruns train on the validation split; the
    first rerun (seed + 1) alone also scores the test set."""
    import optuna

    calls = []

    def run_trial(config, data, validation, entry, batch, params, seed, test, *rest):
        calls.append((seed, test))
        return {"steps": 5, "cap": 10, "curve": [(5, 1.0)], "test": None}

    monkeypatch.setattr(study, "run_trial", run_trial)
    monkeypatch.setattr(study, "_CONTEXT", {"data": None, "validation": None})
    config = load_config("study", preset="study-quick")
    config["study"].update(trials=2, seeds=3)
    unit = study.units(config)[0]
    storage = optuna.storages.InMemoryStorage()
    assert study.advance(study, storage, config, unit, lambda *_: None)
    seed = config["seed"]
    assert calls == [(seed, False)] * 2 + [
        (seed + 1, True),
        (seed + 2, False),
        (seed + 3, False),
    ]


def _data_study(*overrides):
    """A study of digits (`workload=data`) with an 8-wide MLP and
    `overrides`: its config, training data and validation split."""
    from tf_lars.cli import preflight

    config = load_config(
        "study", overrides=["workload=data", "model.width=8", *overrides]
    )
    return (config, *preflight.study_data(config))


def test_a_study_trial_trains_as_tf_lars_train_does(tmp_path, run_cli):
    """One training function: a trial's config given to `tf-lars train`
    gives the same losses, epoch by epoch."""
    import yaml

    config, data, validation = _data_study("study.max_steps=40", "study.target=1.0")
    entry = config["optimizers"][2]  # LARS
    params = {"learning_rate": 2.0, "one_minus_momentum": 0.1, "warmup_share": 0.1,
              "weight_decay": 1e-4}  # fmt: skip
    result = study.run_trial(config, data, validation, entry, 64, params, seed=3)
    assert result["steps"] is None and len(result["curve"]) >= 2
    npz = tmp_path / "split.npz"
    np.savez(npz, x_train=data.x_train, y_train=data.y_train,
             x_test=validation[0], y_test=validation[1])  # fmt: skip
    train = study.trial_config(config, entry, 64, params, 3, len(data.x_train))
    train.update(output_dir=str(tmp_path), run_name="t")
    train["data"] = {**train["data"], "path": str(npz)}
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(train))
    code, _, err = run_cli("train", "--config", str(tmp_path / "train.yaml"))
    assert code == 0, err
    history = json.loads((tmp_path / "t" / "history.json").read_text())
    assert history["loss"] == result["train_loss"]


def test_a_trial_that_diverges_before_its_first_evaluation_scores_ten_caps(
    tmp_path, run_cli
):
    """A non-finite loss stops a neural trial (as `tf-lars train`); one that
    stops before its first evaluation has no curve. It scores 10 caps, as a
    diverged NQM trial does, and the study finishes with its files. Before,
    `evaluate` failed with an IndexError (and the curves' plot after it)."""
    overrides = ["workload=data", "model.width=8", "study.max_steps=40",
                 "study.target=0.9"]  # fmt: skip
    config, data, validation = _data_study(*overrides[2:])
    entry = config["optimizers"][0]  # Nesterov
    params = {"learning_rate": 1e30, "one_minus_momentum": 0.1, "warmup_share": 0.0,
              "weight_decay": 1e-4}  # fmt: skip
    result = study.run_trial(config, data, validation, entry, 64, params, seed=3)
    assert result["diverged"] and result["curve"] == [] and result["steps"] is None
    assert study._value(config, result) == 10 * result["cap"]
    huge = ("optimizers=[{label: Huge, learning_rate: [1.0e+29, 1.0e+30], "
            "optimizer: {class_name: SGD, config: {}}}]")  # fmt: skip
    code, out, err = run_cli(
        "study", *[f"--set={o}" for o in overrides], "--set", huge,
        "--set", "study.batch_sizes=[64]", "--set", "study.trials=2",
        "--set", "study.seeds=1", "--set", "study.workers=1",
        "--set", f"output_dir={tmp_path}", "--set", "run_name=huge",
    )  # fmt: skip
    assert code == 0, err
    (row,) = _results(tmp_path / "huge")["rows"]
    assert not row["reached"] and row["steps"] == row["cap"] and row["curve"] == []
    assert (tmp_path / "huge" / "curves.png").stat().st_size > 0


def test_a_tuning_trial_stops_once_it_passes_the_incumbent():
    """A trial that has not reached the target by the unit's fewest steps so
    far can no longer be selected: it stops there, not reached; one that
    reaches first is unchanged."""
    config, data, validation = _data_study(
        "study.max_steps=200", "study.target=0.5", "study.eval_every=10"
    )
    entry = config["optimizers"][0]  # Nesterov
    params = {"learning_rate": 0.3, "one_minus_momentum": 0.1, "warmup_share": 0.0,
              "weight_decay": 1e-4}  # fmt: skip
    alone = study.run_trial(config, data, validation, entry, 64, params, seed=3)
    assert alone["steps"] is not None and not alone["overtaken"]
    late = study.run_trial(config, data, validation, entry, 64, params, seed=3,
                           incumbent=alone["steps"] - 10)  # fmt: skip
    assert late["steps"] is None and late["overtaken"]
    assert late["curve"] == alone["curve"][:-1]  # stopped at steps - 10
    same = study.run_trial(config, data, validation, entry, 64, params, seed=3,
                           incumbent=alone["steps"])  # fmt: skip
    assert same["steps"] == alone["steps"] and not same["overtaken"]


def test_reruns_measure_the_gradient_noise_scale(tmp_path, run_cli):
    """A tiny digits study: every unit's reruns measure B_simple (two
    micro-batches of half the batch), reported per unit and beside B_crit."""
    sgd = ("optimizers=[{label: SGD, learning_rate: [0.05, 0.5], "
           "optimizer: {class_name: SGD, config: {}}}]")  # fmt: skip
    sets = ["workload=data", "model.width=8", "study.batch_sizes=[16, 64]",
            "study.trials=2", "study.seeds=2", "study.max_steps=120",
            "study.target=0.5", "study.eval_every=5", "study.workers=1", sgd,
            f"output_dir={tmp_path}", "run_name=gns"]  # fmt: skip
    code, _, err = run_cli("study", *[a for s in sets for a in ("--set", s)])
    assert code == 0, err
    results = _results(tmp_path / "gns")
    noise = [row["b_simple"] for row in results["rows"]]
    assert len(noise) == 2 and all(0 < b < 1e6 for b in noise), noise
    fit = results["fits"]["SGD"]
    assert fit["b_simple"] == pytest.approx(np.median(noise))
    ratio = fit["b_simple"] / fit["b_crit"]  # both batch sizes reach 0.5 here
    assert fit["b_simple_over_b_crit"] == pytest.approx(ratio) and ratio > 0
    report = (tmp_path / "gns" / "report.md").read_text()
    assert "B_simple / B_crit" in report and f"| {ratio:.3g} |" in report


def _command(tmp_path, name, *more):
    return [sys.executable, "-m", "tf_lars.cli", *_quick(tmp_path, name), *SGD_ONLY,
            "--set", "study.batch_sizes=[8, 32, 128]", *more]  # fmt: skip


def _environment():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {**os.environ, "PYTHONPATH": root}


def _trial_states(url):
    import optuna

    storage = study.open_storage(url)
    states = {}
    for summary in optuna.get_all_study_summaries(storage):
        trials = optuna.load_study(
            study_name=summary.study_name, storage=storage
        ).trials
        states[summary.study_name] = [t.state.name for t in trials]
    return states


def _take_queued(url):
    """Asks the study "queue" for trials until one is not a queued one."""
    import optuna

    queue = optuna.load_study(study_name="queue", storage=study.open_storage(url))
    taken = []
    while "i" in (trial := queue.ask()).user_attrs:
        taken.append(trial.user_attrs["i"])
    return taken


def test_processes_sharing_a_storage_never_take_one_queued_trial_twice(tmp_path):
    """Reruns are queued trials. SQLite ignores SELECT ... FOR UPDATE, so
    without `open_storage`'s BEGIN IMMEDIATE processes asking at once took
    one queued trial twice (3 processes, 60 trials: in each of 5 runs)."""
    import concurrent.futures
    import multiprocessing

    import optuna

    url = f"sqlite:///{tmp_path}/queue.db"
    queue = optuna.create_study(study_name="queue", storage=study.open_storage(url))
    for i in range(60):
        queue.enqueue_trial({}, user_attrs={"i": i})
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(3, context) as pool:
        taken = [i for part in pool.map(_take_queued, [url] * 3) for i in part]
    assert sorted(taken) == list(range(60))


def test_two_processes_share_one_study(tmp_path):
    """Two `tf-lars study` processes on one SQLite storage: every budget is
    met exactly, no trial is lost or run twice, and both report it whole."""
    url = f"sqlite:///{tmp_path}/shared.db"
    processes = [
        subprocess.Popen(_command(tmp_path, name, "--set", f"study.storage={url}"),
                         env=_environment(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
        for name in ("a", "b")
    ]  # fmt: skip
    for process in processes:
        _, err = process.communicate(timeout=300)
        assert process.returncode == 0, err
    states = _trial_states(url)
    assert len(states) == 6
    for name, seen in states.items():
        assert seen.count("COMPLETE") == (16 if "tuning" in name else 3), name
        assert "FAIL" not in seen and "RUNNING" not in seen, name
    seeds = {}
    import optuna

    for name in states:
        if "reruns" in name:
            done = optuna.load_study(study_name=name, storage=study.open_storage(url))
            complete = [
                t.user_attrs["seed"] for t in done.trials if t.state.name == "COMPLETE"
            ]  # noqa: E501
            seeds[name] = sorted(complete)
    assert all(found == [1, 2, 3] for found in seeds.values()), seeds
    rows = [_results(tmp_path / name)["rows"] for name in ("a", "b")]
    assert rows[0] == rows[1] and len(rows[0]) == 3


def test_ctrl_c_keeps_finished_trials_and_a_rerun_resumes(tmp_path):
    command = _command(tmp_path, "c", "--set", "study.workers=2")
    process = subprocess.Popen(command, env=_environment(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,
                               start_new_session=True)  # fmt: skip
    url = f"sqlite:///{tmp_path}/c/study.db"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.5)
        if os.path.exists(tmp_path / "c" / "study.db"):
            done = sum(s.count("COMPLETE") for s in _trial_states(url).values())
            if done >= 10:
                break
    os.killpg(process.pid, signal.SIGINT)  # the terminal's Ctrl-C: the group
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    # One line: no trial's traceback (Optuna logged each stopped one before).
    assert len(err.splitlines()) == 1 and "resumes" in err, err
    kept = _trial_states(url)
    finished = sum(s.count("COMPLETE") for s in kept.values())
    assert finished >= 10
    assert not any("RUNNING" in s for s in kept.values()), kept
    result = subprocess.run(command, env=_environment(), capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    after = _trial_states(url)
    import optuna

    for name, seen in after.items():
        assert seen.count("COMPLETE") == (16 if "tuning" in name else 3), name
        # The finished trials were kept, not run again. (A trial still
        # WAITING when Ctrl-C came, a rerun's seed enqueued, runs now; the
        # one the Ctrl-C stopped stays FAIL and its seed runs again.)
        for before, now in zip(kept.get(name, []), seen, strict=False):
            assert now == before or before in ("WAITING", "FAIL"), (name, seen)
            assert before != "COMPLETE" or now == "COMPLETE", (name, seen)
        if "reruns" in name:  # each seed exactly once
            done = optuna.load_study(study_name=name, storage=study.open_storage(url))
            seeds = [
                t.user_attrs["seed"] for t in done.trials if t.state.name == "COMPLETE"
            ]
            assert sorted(seeds) == [1, 2, 3], (name, seeds)


def test_the_report_is_printed_before_the_results_are_written(
    tmp_path, run_cli, monkeypatch, one_line_error
):
    # A full disk at the end lost the report with the files (0.2.x).
    def full_disk(folder, *args):
        raise ConfigError(f"cannot write {folder}/results.csv: No space left on device")

    monkeypatch.setattr(study, "_write_results", full_disk)
    argv = (*_quick(tmp_path, "r"), *SGD_ONLY, "--set", "study.batch_sizes=[8]")
    code, out, err = run_cli(*argv, "--set", "study.trials=1", "--set", "study.seeds=1")
    assert one_line_error(code, err, "study").endswith(
        f"{tmp_path}/r/results.csv: No space left on device"
    )
    assert "# Steps to result against batch size" in out
    assert "Results in" not in out


class _Plan:
    """A unit's plan whose trial value is its learning rate; `stop` makes the
    next trial stop (Ctrl-C) once its hyperparameters are drawn."""

    DIRECTION = "minimize"
    stop = False

    @classmethod
    def evaluate(cls, config, unit, trial, seed, rerun):
        params = study._suggest(trial, config, unit[0])
        if cls.stop:
            cls.stop = False
            raise KeyboardInterrupt
        return {"steps": 1}, params["learning_rate"]


def _sampled(storage, name, config, trials, stop_at=None):
    """The learning rates of a tuning study's complete trials, run one at a
    time, each by a new sampler (a new process); with `stop_at`, that trial
    is stopped first."""
    import optuna

    unit = study.units(config)[0]
    objective = study._objective(_Plan, config, unit, trials, rerun=False)
    done = 0
    while done < trials:
        sampler = optuna.samplers.QMCSampler(
            scramble=True, seed=0, warn_independent_sampling=False
        )
        tuning = optuna.create_study(
            study_name=name, storage=storage, sampler=sampler, load_if_exists=True
        )
        _Plan.stop = stop_at is not None and done == stop_at
        try:
            tuning.optimize(objective, n_trials=1)
        except KeyboardInterrupt:
            stop_at = None
        done = len(study._complete(tuning))
    return [t.params["learning_rate"] for t in study._complete(tuning)]


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_a_stopped_or_dead_trial_runs_again_at_its_point(tmp_path):
    # A stopped trial had spent its point of the Sobol sequence: a resumed
    # study measured other points than an unstopped one (LARS at B = 16:
    # 80 steps reached became 164, not reached).
    import optuna

    config = load_config("study", preset="study-quick")
    storage = study.open_storage(f"sqlite:///{tmp_path}/trials.db")
    whole = _sampled(storage, "whole", config, 4)
    assert _sampled(storage, "stopped", config, 4, stop_at=2) == whole
    # A trial whose process died: failed once its heartbeat is stale, and
    # queued again with its point (Optuna's RetryFailedTrialCallback).
    dead = optuna.create_study(study_name="dead", storage=storage)
    trial = dead.ask()
    rate = trial.suggest_float("learning_rate", 0.1, 1.0)
    storage.record_heartbeat(trial._trial_id)
    storage.grace_period = 0
    time.sleep(1.1)
    study._fail_stale_trials(dead)
    states = [(t.state.name, t.params) for t in dead.trials]
    assert states == [
        ("FAIL", {"learning_rate": rate}),
        ("WAITING", {"learning_rate": rate}),
    ]
