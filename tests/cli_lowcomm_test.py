"""`tf-lars lowcomm`: the simulated methods against each other where the
rules say they agree, the bytes and the simulated clock counted by hand, the
table, and the command (tuning, reruns, resume, Ctrl-C)."""

import json
import os

import numpy as np
import pytest

from tf_lars.cli.data import synthetic_data
from tf_lars.cli.lowcomm import format_table, local_steps, simulate, units
from tf_lars.distribute.diloco import all_gather_bytes, all_reduce_bytes

EQUAL = {"name": "equal", "step_times": [1.0], "dynamic_local_updates": False}


@pytest.fixture(scope="module")
def data():
    full = synthetic_data(0)
    # A slice keeps the test fast; the rules do not depend on the size.
    return full._replace(
        x_train=full.x_train[:512],
        y_train=full.y_train[:512],
        x_test=full.x_test[:256],
        y_test=full.y_test[:256],
    )


def _sgd(rate, momentum=0.0):
    return {
        "class_name": "SGD",
        "config": {"learning_rate": rate, "momentum": momentum},
    }


def _config(inner, outer, async_outer=None, steps=12, speeds=(EQUAL,)):
    return {
        "model": {"name": "mlp", "width": 8},
        "training": {"steps": steps, "batch_size": 16},
        "speeds": list(speeds),
        "inner_optimizer": inner,
        "outer_optimizer": outer,
        "async_outer_optimizer": async_outer or outer,
    }


def _run(data, config, method, workers, sync_every, speeds="equal", seed=3):
    unit = (
        method,
        workers,
        sync_every,
        speeds if method in ("agn", "async_diloco") else None,
    )
    validation = (data.x_test, data.y_test)
    return simulate(config, data, validation, unit, {}, seed, test=True)


def _weights(data, config, *unit):
    # The evaluated weights: `simulate` leaves them in worker 0's model.
    from tf_lars.cli import lowcomm

    kept = {}
    real = lowcomm._accuracy

    def keep(model, weights, x, y):
        kept["weights"] = weights
        return real(model, weights, x, y)

    lowcomm._accuracy = keep
    try:
        result = _run(data, config, *unit)
    finally:
        lowcomm._accuracy = real
    return result, kept["weights"]


def _close(a, b):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


PAYLOAD = 4 * (64 * 8 + 8 + 8 * 8 + 8 + 8 * 10 + 10)  # the MLP's float32 weights


def test_diloco_one_step_outer_sgd_one_is_data_parallel(data):
    config = _config(_sgd(0.1), _sgd(1.0))
    dp_row, dp = _weights(data, config, "dp", 2, 1)
    row, diloco = _weights(data, config, "diloco", 2, 1)
    _close(dp, diloco)
    assert row["test"] == dp_row["test"]


def test_async_commits_of_plain_sgd_add_up_to_the_sync_outer_step(data):
    # One round (steps = H): every worker pulls the same center at time 0,
    # so M commits of SGD(L / M) move it as one synchronous outer SGD(L) step.
    config = _config(_sgd(0.05, momentum=0.9), _sgd(0.5), steps=3)
    _, sync = _weights(data, config, "diloco", 2, 3)
    _, asynchronous = _weights(data, config, "async_diloco", 2, 3)
    _close(sync, asynchronous)


@pytest.mark.parametrize("steps", [12, 10])  # 10: a last, shorter segment
def test_agn_commit_is_the_outer_sgd_one_over_period(data, steps):
    # AGN's commit with plain SGD(a): center -= a * sum(grads) / H; the
    # pseudo-gradient is a * sum(grads): outer SGD(1 / H) per commit, i.e.
    # the async rate M / H. AGN divides by H in a shorter segment too.
    config = _config(_sgd(0.1), _sgd(1.0), async_outer=_sgd(2 / 4), steps=steps)
    _, agn = _weights(data, config, "agn", 2, 4)
    _, asynchronous = _weights(data, config, "async_diloco", 2, 4)
    _close(agn, asynchronous)


def test_the_methods_differ_where_the_rules_do(data):
    config = _config(_sgd(0.1, 0.9), _sgd(0.7, 0.9))
    _, dp = _weights(data, config, "dp", 2, 1)
    _, diloco = _weights(data, config, "diloco", 2, 4)
    assert max(np.abs(a - b).max() for a, b in zip(dp, diloco, strict=True)) > 1e-3


def test_collective_bytes_by_hand():
    # Ring all-reduce: 2 (M - 1) / M of the payload each way; all-gather:
    # the payload out, the other M - 1 in.
    assert all_reduce_bytes(1000, 2) == (1000.0, 1000.0)
    assert all_reduce_bytes(1000, 4) == (1500.0, 1500.0)
    assert all_reduce_bytes(800, 8) == (1400.0, 1400.0)
    assert all_reduce_bytes(1000, 1) == (0.0, 0.0)
    assert all_gather_bytes(1000, 4) == (1000, 3000)
    assert all_gather_bytes(1000, 1) == (0, 0)


@pytest.mark.parametrize(
    "method, workers, sync_every, exchanges, each",
    [
        ("dp", 2, 1, 12, 12 * 1.0),  # 12 all-reduces of 2 (M - 1) / M = 1 payload
        ("dp", 4, 1, 12, 12 * 1.5),
        ("diloco", 4, 5, 3, 3 * 1.5),  # steps 5 and 10 of 12, and the last 2
        ("agn", 4, 5, 10, 10 / 4),  # 48 steps in 10 commits (9 of 5, one of 3)
        ("async_diloco", 2, 3, 8, 8 / 2),  # a push and a pull per commit
    ],
)
def test_bytes_are_counted_per_exchange(
    data, method, workers, sync_every, exchanges, each
):
    row = _run(data, _config(_sgd(0.1), _sgd(1.0)), method, workers, sync_every)
    assert row["payload"] == PAYLOAD
    assert row["exchanges"] == exchanges
    assert row["bytes_sent"] == pytest.approx(each * PAYLOAD)
    assert row["bytes_received"] == pytest.approx(each * PAYLOAD)


def test_equal_speeds_staleness_by_hand(data):
    # M = 3, H = 2, 6 steps each: the first round's commits are 0, 1 and 2
    # commits stale; after it every worker pulled right after its own commit,
    # before the other two's: 2 stale each.
    row = _run(data, _config(_sgd(0.1), _sgd(1.0), steps=6), "async_diloco", 3, 2)
    assert row["exchanges"] == 9
    assert row["staleness_mean"] == pytest.approx((0 + 1 + 2 + 6 * 2) / 9)
    assert row["staleness_max"] == 2
    assert row["simulated_seconds"] == 6.0


def test_a_slow_worker_commits_late_and_stale(data):
    # Step times 1 and 3, H = 2, 8 steps in all: worker 0 commits at t = 2, 4
    # and 6 (6 steps), worker 1 once, at t = 6 (2 steps), after worker 0's
    # three commits (ties go to the lower worker).
    speeds = {"name": "two", "step_times": [1.0, 3.0], "dynamic_local_updates": False}
    config = _config(_sgd(0.1), _sgd(1.0), steps=4, speeds=[speeds])
    row = _run(data, config, "agn", 2, 2, speeds="two")
    assert row["exchanges"] == 4
    assert (row["staleness_mean"], row["staleness_max"]) == (0.75, 3)
    assert row["simulated_seconds"] == 6.0
    assert row["local_steps"] == [2, 2]


def test_dynamic_local_updates_scale_h_by_speed():
    # Liu et al. 2024: H_w = floor(v_w / max v * H), v = 1 / step time.
    assert local_steps(50, [0.58, 0.75, 1.51, 3.33], dynamic=True) == [50, 38, 19, 8]
    assert local_steps(50, [0.58, 0.75, 1.51, 3.33], dynamic=False) == [50] * 4
    assert local_steps(2, [1.0, 5.0], dynamic=True) == [2, 1]  # at least 1


def test_units_and_table():
    config = {
        "workers": [2], "sync_every": [10], "methods": ["dp", "diloco", "agn"],
        "speeds": [EQUAL, {**EQUAL, "name": "slow"}],
    }  # fmt: skip
    assert units(config) == [
        ("dp", 2, 1, None), ("diloco", 2, 10, None),
        ("agn", 2, 10, "equal"), ("agn", 2, 10, "slow"),
    ]  # fmt: skip
    dp = {"method": "dp", "label": "sync data parallel", "workers": 2, "sync_every": 1,
          "speeds": "equal", "dynamic_local_updates": False, "test": 0.9,
          "test_interval": (0.89, 0.91), "versus_dp": None, "bytes_ratio": 1.0,
          "bytes_sent": 5e6, "bytes_received": 5e6, "simulated_seconds": 20.0,
          "staleness_mean": 0.0, "staleness_max": 0}  # fmt: skip
    agn = {**dp, "method": "agn", "label": "AGN", "sync_every": 10, "test": 0.8975,
           "test_interval": (0.89, 0.9), "versus_dp": -0.0025,
           "versus_dp_interval": (-0.01, 0.005), "bytes_ratio": 50.0,
           "bytes_sent": 1e5, "bytes_received": 1e5, "staleness_mean": 1.5,
           "staleness_max": 3, "dynamic_local_updates": True}  # fmt: skip
    one_seed = {**agn, "test_interval": (None, None),
                "versus_dp_interval": (None, None)}  # fmt: skip
    assert "| 89.75 | -0.25 |" in format_table([one_seed])
    assert format_table([dp, agn]).splitlines()[2:] == [
        "| sync data parallel | 2 | 1 | equal | 90.00 [89.00, 91.00] | - | 5.00 | 5.00 "
        "| 1.0x | 20 | - |",
        "| AGN | 2 | 10 | equal + DyLU | 89.75 [89.00, 90.00] | -0.25 [-1.00, +0.50] "
        "| 0.10 | 0.10 | 50.0x | 20 | 1.5 / 3 |",
    ]


TINY = [
    "--set", "problem=synthetic",
    "--set", "training.steps=10",
    "--set", "training.batch_size=16",
    "--set", "model.width=8",
    "--set", "workers=[2]",
    "--set", "sync_every=[5]",
    "--set", "tuning.trials=2",
    "--set", "tuning.seeds=2",
    "--set", "tuning.workers=1",
    "--set", "tuning.resamples=100",
    "--set", "speeds=[{name: equal, step_times: [1.0], dynamic_local_updates: false}]",
]  # fmt: skip


def test_the_command_tunes_reruns_and_writes_the_report(tmp_path, run_cli):
    code, out, err = run_cli(
        "lowcomm", "--set", f"output_dir={tmp_path}", "--set", "run_name=lc", *TINY
    )
    assert code == 0, err
    folder = tmp_path / "lc"
    files = [f for f in os.listdir(folder) if not f.endswith(("-shm", "-wal"))]
    assert sorted(files) == [
        "config.yaml",
        "lowcomm.png",
        "report.md",
        "results.json",
        "study.db",
        "table.md",
    ]  # fmt: skip  (SQLite's write-ahead files while a connection is open)
    assert os.path.getsize(folder / "lowcomm.png") > 10_000
    rows = json.loads((folder / "results.json").read_text())["rows"]
    assert [(r["method"], r["sync_every"]) for r in rows] == [
        ("dp", 1), ("diloco", 5), ("agn", 5), ("async_diloco", 5)
    ]  # fmt: skip
    for r in rows:
        assert r["trials"] == 2 and len(r["seed_test"]) == 2
        low, high = r["test_interval"]
        assert low <= r["test"] <= high and 0.0 <= r["test"] <= 1.0
        assert r["test"] == pytest.approx(np.mean(r["seed_test"]))
    diloco = rows[1]
    # 20 steps of 2 workers' all-reduce (1 payload each way), 2 for DiLoCo.
    assert rows[0]["bytes_sent"] == 10 * PAYLOAD and diloco["bytes_sent"] == 2 * PAYLOAD
    assert diloco["bytes_ratio"] == 5.0
    assert set(rows[0]["params"]) == {"inner_learning_rate"}
    assert set(diloco["params"]) == {
        "inner_learning_rate", "outer_learning_rate", "outer_one_minus_momentum"
    }  # fmt: skip
    report = (folder / "report.md").read_text()
    assert "2 quasi-random trials" in report and "rerun on 2 new seeds" in report
    assert "| sync DiLoCo | 2 | 5 | equal |" in report
    assert out.startswith("lowcomm ") and "Results in" in out
    # The same command again resumes: every trial is kept, none is rerun.
    code, again, err = run_cli(
        "lowcomm", "--set", f"output_dir={tmp_path}", "--set", "run_name=lc", *TINY
    )
    assert code == 0, err
    assert json.loads((folder / "results.json").read_text())["rows"] == rows


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["--set", "workers=[0]"],
            "`workers.0` must be an int in [2, 64]. Received: workers.0=0",
        ),
        # One worker exchanges nothing (data parallel's bytes were "0x").
        (
            ["--set", "workers=[2, 1]"],
            "`workers.1` must be an int in [2, 64]. Received: workers.1=1",
        ),
        (["--set", "sync_every=[]"], "`sync_every` must be a list of at least 1"),
        (["--set", "problem=cifar"], "`problem` must be one of"),
        (["--set", "methods=[dp, sgd]"], "`methods.1` must be one of"),
        (
            ["--set", "search.outer_one_minus_momentum=[0.1, 2.0]"],
            "`search.outer_one_minus_momentum` must be [low, high] with 0 < low <= "
            "high and the high end <= 1. Received: "
            "search.outer_one_minus_momentum=[0.1, 2.0]",
        ),
        (
            ["--set", "speeds.0.step_times=[0.0]"],
            "`speeds.0.step_times.0` must be",
        ),
        (
            ["--set", "training.batch_size=20000"],
            "`training.batch_size` must be at most the smallest worker's shard "
            "(10240 training examples / 4 workers = 2560). Received: "
            "training.batch_size=20000",
        ),
        (["--set", "outer_optimizer.class_name=NoSuch"], "outer_optimizer"),
        (
            ["--set", "workers=[2, 4, 2]"],
            "`workers` must be unique. Received: workers=2 twice",
        ),
        (
            ["--set", "methods=[dp, dp]"],
            "`methods` must be unique. Received: methods='dp' twice",
        ),
        # The reruns' seeds passed NumPy's after the tuning had run.
        (
            ["--set", "seed=4294967295", "--set", "tuning.seeds=1"],
            "`seed` + `tuning.seeds` must be at most 4294967295 (NumPy's largest "
            "seed: the reruns take seeds seed + 1 to seed + tuning.seeds). "
            "Received: seed=4294967295, tuning.seeds=1",
        ),
        (["--set", "tuning.storage=foo://x"], "`tuning.storage` must be a database"),
        (
            ["--set", "sync_every=[10, 601]"],
            "`sync_every` must hold at most "
            "`training.steps` (600) inner steps per exchange, or no exchange runs. "
            "Received: sync_every=[10, 601]",
        ),
    ],
)
def test_bad_configs_are_one_line_and_status_2(
    tmp_path, run_cli, one_line_error, overrides, message
):
    code, _, err = run_cli("lowcomm", "--set", f"output_dir={tmp_path}", *overrides)
    assert message in one_line_error(code, err, command="lowcomm")
    assert os.listdir(tmp_path) == []


def test_a_unit_that_a_block_refuses_is_one_line_before_any_trial(
    tmp_path, run_cli, one_line_error
):
    # Not searched, the outer rate is the block's: DiLoCo refuses 0.
    code, out, err = run_cli(
        "lowcomm", "--set", f"output_dir={tmp_path}", *TINY,
        "--set", "search.outer_learning_rate=null",
        "--set", "outer_optimizer={class_name: SGD, config: {learning_rate: 0.0}}",
    )  # fmt: skip
    assert one_line_error(code, err, command="lowcomm") == (
        "tf-lars lowcomm: error: the run sync DiLoCo, M=2, H=5 is refused, so no "
        "run started: `outer_optimizer.learning_rate` must be a finite number > 0. "
        "Received: outer_optimizer=SGD with learning_rate=0.0"
    )
    assert out == "" and os.listdir(tmp_path) == []


def test_ctrl_c_keeps_the_finished_trials_and_the_run_resumes(
    tmp_path, run_cli, monkeypatch
):
    # The fifth run is interrupted as a Ctrl-C would be: data parallel's unit
    # (2 trials, 2 reruns) is finished and in table.md; the same command
    # resumes and runs only what is missing.
    from tf_lars.cli import lowcomm

    real, calls = lowcomm.simulate, []

    def interrupted_fifth(*args, **kwargs):
        calls.append(args[3])
        if len(calls) == 5:
            raise KeyboardInterrupt()
        return real(*args, **kwargs)

    monkeypatch.setattr(lowcomm, "simulate", interrupted_fifth)
    arguments = ("lowcomm", "--set", f"output_dir={tmp_path}", "--set", "run_name=lc")
    code, _, err = run_cli(*arguments, *TINY)
    assert code == 130
    folder = tmp_path / "lc"
    assert "keeps 4 of 16 finished trials" in err
    assert "and the 1 finished rows in table.md; the same command resumes" in err
    assert (
        (folder / "INTERRUPTED")
        .read_text()
        .startswith("Interrupted (Ctrl-C) after 4 of 16 trials")
    )
    rows = json.loads((folder / "results.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["dp"]
    code, _, err = run_cli(*arguments, *TINY)
    assert code == 0, err
    assert len(calls) == 5 + 12  # the 12 runs still missing, no more
    assert not (folder / "INTERRUPTED").exists()
    rows_after = json.loads((folder / "results.json").read_text())["rows"]
    assert rows_after[0] == rows[0] and len(rows_after) == 4
