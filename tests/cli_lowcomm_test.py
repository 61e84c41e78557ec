"""`tf-lars lowcomm`: the simulated methods against each other where the
rules say they agree, the bytes counted, the table, and the command."""

import json
import os

import numpy as np
import pytest

from tf_lars.cli.data import synthetic_data
from tf_lars.cli.lowcomm import format_table, plan, run_one


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


def _settings(inner, outer, async_outer=None, steps=12):
    return {
        "seed": 3,
        "steps": steps,
        "batch_size": 16,
        "model": {"name": "mlp", "width": 8},
        "inner": inner,
        "outer": outer,
        "async_outer": async_outer or outer,
    }


def _close(a, b):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_diloco_one_step_outer_sgd_one_is_data_parallel(data):
    settings = _settings(_sgd(0.1), _sgd(1.0))
    dp_row, dp = run_one("dp", data, 2, 1, settings)
    row, diloco = run_one("diloco", data, 2, 1, settings)
    _close(dp, diloco)
    assert row["test_accuracy"] == dp_row["test_accuracy"]


def test_async_commits_of_plain_sgd_add_up_to_the_sync_outer_step(data):
    # Every worker pulls the same center at a round's start, so M commits
    # of SGD(L / M) move it as one synchronous outer SGD(L) step.
    inner = _sgd(0.05, momentum=0.9)
    settings = _settings(inner, _sgd(0.5), async_outer=_sgd(0.5))
    _, sync = run_one("diloco", data, 2, 3, settings)
    _, asynchronous = run_one("async_diloco", data, 2, 3, settings)
    _close(sync, asynchronous)


def test_agn_commit_is_the_outer_sgd_one_over_period(data):
    # AGN's commit with plain SGD(a): center -= a * sum(grads) / H; the
    # pseudo-gradient is a * sum(grads): outer SGD(1 / H) per commit, i.e.
    # the async rate M / H.
    settings = _settings(_sgd(0.1), _sgd(1.0), async_outer=_sgd(2 / 4))
    _, agn = run_one("agn", data, 2, 4, settings)
    _, asynchronous = run_one("async_diloco", data, 2, 4, settings)
    _close(agn, asynchronous)


def test_the_methods_differ_where_the_rules_do(data):
    settings = _settings(_sgd(0.1, 0.9), _sgd(0.7, 0.9))
    _, dp = run_one("dp", data, 2, 1, settings)
    _, diloco = run_one("diloco", data, 2, 4, settings)
    assert max(np.abs(a - b).max() for a, b in zip(dp, diloco, strict=True)) > 1e-3


@pytest.mark.parametrize(
    "method, workers, sync_every, exchanges, received",
    [
        ("dp", 2, 1, 12, 12),  # every step, one other worker's payload
        ("dp", 4, 1, 12, 36),
        ("diloco", 4, 5, 3, 9),  # steps 5 and 10 of 12, and the last 2 steps
        ("agn", 4, 5, 3, 3),  # three rounds: one push, one pull each
        ("async_diloco", 2, 3, 4, 4),
    ],
)
def test_bytes_are_counted_per_exchange(
    data, method, workers, sync_every, exchanges, received
):
    payload = 4 * (64 * 8 + 8 + 8 * 8 + 8 + 8 * 10 + 10)  # float32 weights
    row, _ = run_one(method, data, workers, sync_every, _settings(_sgd(0.1), _sgd(1.0)))
    assert row["exchanges"] == exchanges
    assert row["bytes_sent"] == exchanges * payload
    assert row["bytes_received"] == received * payload


@pytest.mark.parametrize("method", ["diloco", "agn", "async_diloco"])
def test_the_last_partial_round_reaches_the_evaluated_model(data, method):
    # 6 steps at H = 4: a round of 4, then one of 2, exchanged at the end.
    # Without that exchange the model after 6 steps was the one after 4.
    settings = _settings(_sgd(0.1, 0.9), _sgd(0.7, 0.9))
    _, four = run_one(method, data, 2, 4, {**settings, "steps": 4})
    row, six = run_one(method, data, 2, 4, {**settings, "steps": 6})
    assert row["exchanges"] == 2
    assert max(np.abs(a - b).max() for a, b in zip(four, six, strict=True)) > 1e-4


def test_agn_is_async_diloco_in_a_last_partial_round_too(data):
    # AGN's commit divides by H in the shorter round as well, so the rule of
    # test_agn_commit_is_the_outer_sgd_one_over_period holds for 10 steps.
    settings = _settings(_sgd(0.1), _sgd(1.0), async_outer=_sgd(2 / 4), steps=10)
    _, agn = run_one("agn", data, 2, 4, settings)
    _, asynchronous = run_one("async_diloco", data, 2, 4, settings)
    _close(agn, asynchronous)


def test_plan_and_table():
    config = {"workers": [2], "sync_every": [10, 50]}
    assert plan(config) == [
        ("dp", 2, 1),
        ("agn", 2, 10),
        ("async_diloco", 2, 10),
        ("diloco", 2, 10),
        ("agn", 2, 50),
        ("async_diloco", 2, 50),
        ("diloco", 2, 50),
    ]
    rows = [
        {"method": "dp", "label": "sync data parallel", "workers": 2, "sync_every": 1,
         "test_accuracy": 0.9, "bytes_sent": 5000, "bytes_received": 5000,
         "wall_seconds": 1.25},
        {"method": "diloco", "label": "sync DiLoCo", "workers": 2, "sync_every": 50,
         "test_accuracy": 0.8975, "bytes_sent": 100, "bytes_received": 100,
         "wall_seconds": 2.0},
    ]  # fmt: skip
    assert format_table(rows).splitlines()[2:] == [
        "| sync data parallel | 2 | 1 | 90.00 | +0.00 | 10,000 | 1x | 1.2 |",
        "| sync DiLoCo | 2 | 50 | 89.75 | -0.25 | 200 | 50x | 2.0 |",
    ]
    # No ratio where either side sent nothing, or without a DP run.
    nothing = {**rows[1], "bytes_sent": 0, "bytes_received": 0}
    alone = {**rows[1], "workers": 4}
    assert format_table([rows[0], nothing, alone]).splitlines()[3:] == [
        "| sync DiLoCo | 2 | 50 | 89.75 | -0.25 | 0 | - | 2.0 |",
        "| sync DiLoCo | 4 | 50 | 89.75 | - | 200 | - | 2.0 |",
    ]


TINY = [
    "--set", "training.steps=20",
    "--set", "training.batch_size=16",
    "--set", "model.width=8",
    "--set", "workers=[2]",
    "--set", "sync_every=[5, 10]",
]  # fmt: skip


def test_the_command_writes_the_table_results_and_plot(tmp_path, run_cli):
    code, out, err = run_cli(
        "lowcomm", "--set", f"output_dir={tmp_path}", "--set", "run_name=lc", *TINY
    )
    assert code == 0, err
    folder = tmp_path / "lc"
    assert sorted(os.listdir(folder)) == [
        "config.yaml", "lowcomm.png", "results.json", "table.md"
    ]  # fmt: skip
    assert os.path.getsize(folder / "lowcomm.png") > 10_000
    runs = json.loads((folder / "results.json").read_text())["runs"]
    assert [(r["method"], r["sync_every"]) for r in runs] == [
        ("dp", 1),
        ("agn", 5), ("async_diloco", 5), ("diloco", 5),
        ("agn", 10), ("async_diloco", 10), ("diloco", 10),
    ]  # fmt: skip
    payload = 4 * (64 * 8 + 8 + 8 * 8 + 8 + 8 * 10 + 10)
    assert [r["bytes_sent"] for r in runs] == [20 * payload] + [4 * payload] * 3 + [
        2 * payload
    ] * 3
    assert all(0.0 <= r["test_accuracy"] <= 1.0 for r in runs)
    table = (folder / "table.md").read_text()
    assert table.count("\n") == 2 + len(runs)
    assert "| sync DiLoCo | 2 | 10 |" in table and "| 10x |" in table
    assert out.count("\n[") == 6 and out.startswith("[1/7] sync data parallel, M=2")
    assert "synthetic: scikit-learn make_classification" in out


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
        (
            ["--set", "training.batch_size=20000"],
            "`training.batch_size` must be at most the smallest worker's shard "
            "(30000 training examples / 8 workers = 3750). Received: "
            "training.batch_size=20000",
        ),
        (
            ["--set", "outer_optimizer.class_name=NoSuch"],
            "outer_optimizer",
        ),
    ],
)
def test_bad_configs_are_one_line_and_status_2(
    tmp_path, run_cli, one_line_error, overrides, message
):
    code, _, err = run_cli("lowcomm", "--set", f"output_dir={tmp_path}", *overrides)
    assert message in one_line_error(code, err, command="lowcomm")
    assert os.listdir(tmp_path) == []


def test_h_beyond_the_steps_makes_one_exchange_and_a_table(tmp_path, run_cli):
    # Every run finished, then the table divided by 0 bytes: a traceback,
    # exit 1, only config.yaml left.
    code, out, err = run_cli(
        "lowcomm", "--set", f"output_dir={tmp_path}", "--set", "run_name=lc",
        *TINY, "--set", "training.steps=5", "--set", "sync_every=[10]",
    )  # fmt: skip
    assert code == 0, err
    runs = json.loads((tmp_path / "lc" / "results.json").read_text())["runs"]
    assert [(r["method"], r["exchanges"]) for r in runs] == [
        ("dp", 5), ("agn", 1), ("async_diloco", 1), ("diloco", 1)
    ]  # fmt: skip
    # Data parallel: 5 x (1 + 1) payloads; each other: one round's 1 + 1.
    table = (tmp_path / "lc" / "table.md").read_text()
    assert [line.split(" | ")[-2] for line in table.splitlines()[2:]] == ["1x"] + [
        "5x"
    ] * 3


def test_a_run_that_a_block_refuses_is_one_line_before_any_run(
    tmp_path, run_cli, one_line_error
):
    # DiLoCo refuses an outer learning rate of 0: three runs finished before
    # it was built, then a traceback.
    code, out, err = run_cli(
        "lowcomm", "--set", f"output_dir={tmp_path}", *TINY,
        "--set", "outer_optimizer={class_name: SGD, config: {learning_rate: 0.0}}",
    )  # fmt: skip
    assert one_line_error(code, err, command="lowcomm") == (
        "tf-lars lowcomm: error: the run sync DiLoCo, M=2, H=5 is refused, so no "
        "run started: `outer_optimizer.learning_rate` must be a finite number > 0. "
        "Received: outer_optimizer=SGD with learning_rate=0.0"
    )
    assert out == "" and os.listdir(tmp_path) == []
    # Async DiLoCo's rate is divided by M: a schedule cannot be.
    code, _, err = run_cli(
        "lowcomm", "--set", f"output_dir={tmp_path}", *TINY, "--set",
        "async_outer_optimizer.config.learning_rate={class_name: ExponentialDecay, "
        "config: {initial_learning_rate: 0.5, decay_steps: 10, decay_rate: 0.5}}",
    )  # fmt: skip
    line = one_line_error(code, err, command="lowcomm")
    assert line.startswith(
        "tf-lars lowcomm: error: `async_outer_optimizer.config.learning_rate` must "
        "be a number: it is divided by M. Received: "
    )
    assert os.listdir(tmp_path) == []


def test_each_finished_run_is_kept_as_it_finishes(tmp_path, run_cli, monkeypatch):
    # A failure after two runs (a bug: a traceback) leaves their results.
    from tf_lars.cli import lowcomm

    real, calls = lowcomm.run_one, []

    def failing_third(*args):
        calls.append(args[0])
        if len(calls) == 3:
            raise RuntimeError("a late failure")
        return real(*args)

    monkeypatch.setattr(lowcomm, "run_one", failing_third)
    with pytest.raises(RuntimeError, match="a late failure"):
        run_cli(
            "lowcomm", "--set", f"output_dir={tmp_path}", "--set", "run_name=lc", *TINY
        )
    record = json.loads((tmp_path / "lc" / "results.json").read_text())
    assert [r["method"] for r in record["runs"]] == ["dp", "agn"]
    assert record["runs_planned"] == 7
    assert (tmp_path / "lc" / "table.md").read_text().count("\n") == 4


def test_ctrl_c_keeps_the_finished_runs(tmp_path, run_cli, monkeypatch):
    # The third run is interrupted as a Ctrl-C would: the two before it are
    # in results.json and table.md, with a note; exit status 130.
    from tf_lars.cli import lowcomm

    real, calls = lowcomm.run_one, []

    def interrupted_third(*args):
        calls.append(args[0])
        if len(calls) == 3:
            raise KeyboardInterrupt()
        return real(*args)

    monkeypatch.setattr(lowcomm, "run_one", interrupted_third)
    code, _, err = run_cli(
        "lowcomm", "--set", f"output_dir={tmp_path}", "--set", "run_name=lc", *TINY
    )
    assert code == 130
    folder = tmp_path / "lc"
    assert "keeps config.yaml, results.json and table.md of the 2 of 7 runs" in err
    record = json.loads((folder / "results.json").read_text())
    assert [r["method"] for r in record["runs"]] == ["dp", "agn"]
    assert (record["interrupted"], record["runs_planned"]) == (True, 7)
    assert (folder / "table.md").read_text().count("\n") == 4
    assert (folder / "INTERRUPTED").read_text() == (
        "Interrupted (Ctrl-C) after 2 of 7 runs. results.json and table.md hold "
        "the finished ones; lowcomm.png was not drawn.\n"
    )
    assert not (folder / "lowcomm.png").exists()
