"""`tf-lars sweep` under hostile inputs and faults: nothing trained for nothing.

A grid point whose learning rate is out of range refuses the sweep before
the first training; a worker process killed with SIGKILL (as by the
out-of-memory killer) ends the sweep in bounded time, the finished trainings
kept. Both are one line on stderr and exit status 2.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from tf_lars.cli.main import main

REPO = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT = 300
# A sweep with a lost worker ends within this (the old pool waited for ever).
ENDS_WITHIN = 120
SGD_ONLY = (
    "optimizers=[{label: SGD, base_learning_rate: %s, "
    "optimizer: {class_name: SGD, config: {}}}]"
)


# ------------------------------------------ every grid point, before any
@pytest.mark.parametrize(
    "overrides, expected",
    [
        # Factor 1 trains (and ran first), x64 is beyond float32.
        (
            [SGD_ONLY % "1.0e+36", "sweep.grid_factors=[64]"],
            [
                "the grid point SGD batch 1347 lr 2.694e+39 (x64) is refused, so "
                "no training started: schedule: `peak_learning_rate` must be at "
                "most 3.4028235e+38 in magnitude",
                "Received: peak_learning_rate=2.694",
            ],
        ),
        # x0.001 decays to below the end learning rate; x1 and x2 do not.
        (
            [SGD_ONLY % "0.1", "sweep.grid_factors=[0.001, 2]",
             "schedule.end_learning_rate=0.01"],
            [
                "the grid point SGD batch 1347 lr 0.004209 (x0.001) is refused, so "
                "no training started: schedule: `end_learning_rate` must be a "
                "finite number in [0, peak_learning_rate=0.0042093",
                "Received: end_learning_rate=0.01",
            ],
        ),
    ],
)  # fmt: skip
def test_a_grid_point_out_of_range_refuses_the_sweep_before_any_training(
    overrides, expected, tmp_path, capsys, one_line_error
):
    argv = ["sweep"]
    for override in [
        *overrides,
        "training.epochs=1",
        "schedule.warmup_epochs=0",
        "sweep.batch_sizes=[full]",
        "sweep.workers=1",
        "model.width=2",
        f"output_dir={tmp_path}",
        "run_name=r",
    ]:
        argv += ["--set", override]
    code = main(argv)
    captured = capsys.readouterr()
    line = one_line_error(code, captured.err, "sweep")
    for fragment in expected:
        assert fragment in line
    # Nothing trained, no run folder: the same config with a fixed grid can
    # take the name.
    assert "Running" not in captured.out
    assert not (tmp_path / "r").exists()


# -------------------------------------------------------- a lost worker
def _workers_of(parent_pid):
    """The pids of `parent_pid`'s spawned multiprocessing workers (/proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as handle:
                stat = handle.read()
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                command = handle.read()
        except OSError:  # ended meanwhile
            continue
        parent = int(stat.rpartition(")")[2].split()[1])
        if parent == parent_pid and b"spawn_main" in command:
            pids.append(int(entry))
    return pids


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
            state = handle.read().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_a_killed_worker_ends_the_sweep_with_the_finished_trainings_kept(
    tmp_path, one_line_error
):
    # Without TF_CPP_MIN_LOG_LEVEL (the suite's conftest sets one), so that
    # tf-lars quiets TensorFlow itself and stderr holds its line only.
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO), env.get("PYTHONPATH")])
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "tf_lars.cli", "sweep", "--set", "run_name=k",
         "--set", "training.epochs=3", "--set", "schedule.warmup_epochs=1",
         "--set", "sweep.batch_sizes=[512]", "--set", "sweep.grid_factors=[0.5]",
         "--set", "sweep.workers=2", "--set", "model.width=4"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=env,
        start_new_session=True,  # its workers too are ended if this test fails
    )  # fmt: skip
    try:
        deadline = time.monotonic() + TIMEOUT
        for line in process.stdout:
            if " 2/10]" in line or time.monotonic() > deadline:
                break
        workers = _workers_of(process.pid)
        assert len(workers) == 2, workers
        os.kill(workers[0], signal.SIGKILL)
        _, err = process.communicate(timeout=ENDS_WITHIN)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    folder = tmp_path / "runs" / "k"
    line = one_line_error(process.returncode, err, "sweep")
    results = json.loads((folder / "results.json").read_text())
    done = len(results["runs"])
    assert 2 <= done < 10
    assert results["interrupted"] is True and results["runs_planned"] == 10
    assert line == (
        "tf-lars sweep: error: a worker process was killed by SIGKILL; the run "
        "folder runs/k keeps config.yaml, results.json and table.md of the "
        f"{done} of 10 trainings that finished, and INTERRUPTED"
    )
    assert sorted(os.listdir(folder)) == [
        "INTERRUPTED", "config.yaml", "results.json", "table.md",
    ]  # fmt: skip
    assert (folder / "INTERRUPTED").read_text() == (
        f"Stopped: a worker process was killed by SIGKILL after {done} of 10 "
        "trainings. results.json and table.md hold the finished ones; sweep.png "
        "was not drawn.\n"
    )
    for run in results["runs"]:
        assert run["batch_size"] == 512 and run["epochs_run"] == 3
        assert 0.0 <= run["test_accuracy"] <= 1.0
    # The other worker was stopped with the sweep.
    assert not any(_running(pid) for pid in workers)


def test_the_interrupted_note_names_sigterm(tmp_path):
    """A SIGTERM (tf_lars.cli.main.Terminated) is named in the sweep's note,
    as in `train`'s; Ctrl-C keeps its wording."""
    from tf_lars.cli import sweep
    from tf_lars.cli.config import default_config
    from tf_lars.cli.main import Terminated

    config = default_config("sweep")
    plan = ([8], [1.0], ["LARS"])
    for interrupt, word in ((Terminated(), "SIGTERM"), (KeyboardInterrupt(), "Ctrl-C")):
        folder = tmp_path / word
        folder.mkdir()
        stopped = sweep._interrupted(
            str(folder), config, plan, 1, [None, None], 2.0, interrupt=interrupt
        )
        note = (folder / "INTERRUPTED").read_text()
        assert note.startswith(f"Interrupted ({word}) after 0 of 2 trainings.")
        assert isinstance(stopped, KeyboardInterrupt)
