"""Faults for `tf_lars.distribute`: step-count bounds of AGN, the launcher's
`--timeout`, process groups and parent-death signal, and `BackupAndRestore`
refusing a backup of another training (bad `TF_CONFIG` and launcher
arguments: distribute_tf_config_test.py)."""

import os
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lars
from tests.distribute_launch_helpers import REPO, launcher_env, run_launcher
from tf_lars.distribute import BackupAndRestore
from tf_lars.distribute._process import die_with_parent

INT64_MAX = 2**63 - 1


# ------------------------------------------------------- AGN's step counter
def test_agn_period_beyond_the_int64_step_counter_is_refused():
    with pytest.raises(ValueError) as info:
        tf_lars.AGN(keras.optimizers.SGD(0.1), communication_period=2**63)
    assert str(info.value) == (
        "`communication_period` must be at most 9223372036854775807 (2**63 - 1, "
        "the largest value of the int64 step counter). Received: "
        "communication_period=9223372036854775808"
    )


def test_agn_largest_period_takes_a_step_without_committing():
    variable = keras.Variable([1.0])
    optimizer = tf_lars.AGN(keras.optimizers.SGD(0.1), communication_period=INT64_MAX)
    optimizer.apply([tf.constant([1.0])], [variable])
    np.testing.assert_allclose(variable.numpy(), [0.9])
    assert int(optimizer.commits.numpy()) == 0


# ------------------------------------------------------------------- launcher
PROGRAM = """\
import json, os, subprocess, sys, time
from tf_lars.distribute._process import die_with_parent
out, mode = sys.argv[1], sys.argv[2]
if mode == "parent":  # a test run that starts a launcher, then is killed
    launcher = subprocess.Popen(
        [sys.executable, "-m", "tf_lars.distribute.launch", *sys.argv[3:]],
        start_new_session=True, preexec_fn=die_with_parent,
    )
    with open(os.path.join(out, "launcher"), "w") as handle:
        handle.write(str(launcher.pid))
    time.sleep(300)
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
if mode in ("child", "sleep"):
    pid = subprocess.Popen(["sleep", "300"]).pid if mode == "child" else os.getpid()
    with open(os.path.join(out, f"{mode}-{index}"), "w") as handle:
        handle.write(str(pid))
    if mode == "sleep":
        time.sleep(300)
elif index == 1:
    with open(os.path.join(out, "hung"), "w") as handle:
        handle.write(str(os.getpid()))
    time.sleep(300)
print(f"worker {index} done", flush=True)
"""


def _launch(args, tmp_path, *program_args, timeout=120):
    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    return subprocess.run(
        [sys.executable, "-m", "tf_lars.distribute.launch", *args, "--"]
        + [str(program), str(tmp_path), *program_args],
        cwd=REPO,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=True,
        preexec_fn=die_with_parent,
    )


def _running(pid):
    """Whether `pid` is a live process (a zombie is not)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            state = handle.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def _gone_soon(pid, seconds=10.0):
    deadline = time.monotonic() + seconds
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _running(pid)


@pytest.mark.slow
def test_timeout_ends_a_job_whose_worker_hangs_after_another_finished(tmp_path):
    log_dir = tmp_path / "logs"
    result = _launch(
        ["--mode", "sync", "--workers", "2", "--network", "host"]
        + ["--log-dir", str(log_dir), "--timeout", "8"],
        tmp_path,
        "hang",
    )
    assert result.returncode == 124, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "worker 0 done" in lines
    assert (
        "[launch] worker 0 exited with status 0; waiting for the other workers "
        "(--timeout 8s)"
    ) in lines
    assert lines[-1] == (
        "[launch] --timeout 8s reached with worker 1 still running; stopping all "
        "tasks, exit status 124"
    )
    hung = int((tmp_path / "hung").read_text())
    assert _gone_soon(hung)


@pytest.mark.slow
def test_children_of_a_finished_task_do_not_outlive_the_launcher(tmp_path):
    result = _launch(
        ["--mode", "sync", "--workers", "2", "--network", "host"]
        + ["--log-dir", str(tmp_path / "logs")],
        tmp_path,
        "child",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[launch] all 2 workers exited with status 0" in result.stdout
    for index in (0, 1):
        child = int((tmp_path / f"child-{index}").read_text())
        assert _gone_soon(child), f"worker {index}'s child {child} still runs"


def test_a_killed_test_run_leaves_no_launcher_or_task_behind(tmp_path):
    """kill -9 of the process that started a launcher (as of a pytest run):
    the launcher, then its tasks (each in a session of its own, so no group
    signal reaches them), die with it."""
    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    launcher_args = ["--mode", "sync", "--workers", "2", "--network", "host"]
    launcher_args += ["--log-dir", str(tmp_path / "logs"), "--"]
    parent = subprocess.Popen(
        [sys.executable, str(program), str(tmp_path), "parent", *launcher_args]
        + [str(program), str(tmp_path), "sleep"],
        cwd=REPO,
        env=launcher_env(),
        start_new_session=True,
        preexec_fn=die_with_parent,
    )
    try:
        started = [tmp_path / name for name in ("launcher", "sleep-0", "sleep-1")]
        deadline = time.monotonic() + 60
        while not all(p.exists() and p.read_text() for p in started):
            assert time.monotonic() < deadline and parent.poll() is None
            time.sleep(0.1)
        pids = [int(p.read_text()) for p in started]
        assert all(map(_running, pids))
    finally:
        parent.kill()
        parent.wait(10)
    for pid in pids:
        assert _gone_soon(pid), f"{pid} outlived the killed test run"


# ----------------------------------------------------------- BackupAndRestore
class _StopAfter(keras.callbacks.Callback):
    def __init__(self, epochs):
        super().__init__()
        self.epochs = epochs

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 == self.epochs:
            raise RuntimeError("preempted")


def _fit(backup_dir, optimizer, epochs, stop=None, layers=1):
    keras.utils.set_random_seed(1)
    x = np.random.RandomState(0).randn(32, 4).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    model = keras.Sequential(
        [keras.Input((4,))]
        + [keras.layers.Dense(4) for _ in range(layers - 1)]
        + [keras.layers.Dense(1)]
    )
    model.compile(optimizer, "mse")
    backup = BackupAndRestore(str(backup_dir))
    callbacks = [backup] + ([_StopAfter(stop)] if stop else [])
    history = model.fit(
        x, y, batch_size=8, epochs=epochs, verbose=0, callbacks=callbacks
    )
    return model, backup, history


def _preempted(backup_dir, optimizer, epochs, stop, layers=1):
    with pytest.raises(RuntimeError, match="preempted"):
        _fit(backup_dir, optimizer, epochs, stop, layers)
    assert os.listdir(backup_dir) == [f"epoch-{stop}.weights.h5"]


def _assert_refused(backup_dir, optimizer, epochs, stop, what, layers=1):
    path = os.path.join(str(backup_dir), f"epoch-{stop}.weights.h5")
    with open(path, "rb") as handle:
        before = handle.read()
    with pytest.raises(ValueError) as info:
        _fit(backup_dir, optimizer, epochs, layers=layers)
    assert str(info.value) == (
        f"BackupAndRestore: the backup {path} does not match this training: "
        f"{what}. It was not loaded and is kept; delete it (or pass another "
        "`backup_dir`) to start from the beginning."
    )
    # Kept as it was, and the callback did not resume.
    with open(path, "rb") as handle:
        assert handle.read() == before


def test_backup_of_a_later_epoch_than_fit_runs_is_refused_and_kept(tmp_path):
    _preempted(tmp_path, keras.optimizers.SGD(0.1), 8, stop=6)
    _assert_refused(
        tmp_path,
        keras.optimizers.SGD(0.1),
        4,
        6,
        "it is of epoch 6, after this fit's last (epochs=4)",
    )


def test_backup_of_another_learning_rate_is_refused(tmp_path):
    _preempted(tmp_path, keras.optimizers.SGD(0.5), 4, stop=2)
    _assert_refused(
        tmp_path,
        keras.optimizers.SGD(0.25),
        4,
        2,
        "the optimizer config differs: learning_rate=0.5 in the backup, 0.25 here",
    )


def test_backup_of_another_optimizer_class_is_refused(tmp_path):
    _preempted(tmp_path, tf_lars.LARS(0.5), 4, stop=2)
    _assert_refused(
        tmp_path,
        keras.optimizers.SGD(0.5),
        4,
        2,
        "the optimizer class is tf_lars>LARS in the backup and SGD here",
    )


def test_backup_with_another_optimizer_variable_count_is_refused(tmp_path):
    _preempted(tmp_path, keras.optimizers.SGD(0.5, momentum=0.5), 4, stop=2)
    _assert_refused(
        tmp_path,
        keras.optimizers.SGD(0.5, momentum=0.5),
        4,
        2,
        "the optimizer has 4 variables in the backup and 6 here",
        layers=2,
    )


def test_matching_backup_resumes_with_its_step_count_and_learning_rate(tmp_path):
    _preempted(tmp_path, keras.optimizers.SGD(0.5, momentum=0.5), 4, stop=2)
    model, backup, history = _fit(tmp_path, keras.optimizers.SGD(0.5, momentum=0.5), 4)
    assert backup.restored_epoch == 2
    assert history.epoch == [2, 3]
    assert int(model.optimizer.iterations.numpy()) == 4 * 4
    assert float(model.optimizer.learning_rate.numpy()) == 0.5
    assert not os.path.exists(tmp_path) or os.listdir(tmp_path) == []
    assert isinstance(backup, keras.callbacks.BackupAndRestore)


def test_end_of_fit_deletes_the_backups_and_keeps_other_files(tmp_path):
    # Keras's own callback deletes all of `backup_dir` at the end of `fit`.
    _preempted(tmp_path, keras.optimizers.SGD(0.1), 4, stop=2)
    (tmp_path / "notes.txt").write_text("the user's")
    _fit(tmp_path, keras.optimizers.SGD(0.1), 4)
    assert os.listdir(tmp_path) == ["notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "the user's"


@pytest.mark.slow
def test_every_worker_stops_when_the_chief_refuses_a_backup(tmp_path):
    # A stale backup of epoch 9 for a 4-epoch job: refused by its number,
    # before a byte of it is read.
    backup_dir = tmp_path / "backup"
    backup_dir.mkdir()
    stale = backup_dir / "epoch-9.weights.h5"
    stale.write_bytes(b"a backup of another run")
    out = tmp_path / "out"
    out.mkdir()
    log_dir = tmp_path / "logs"
    code, stdout, _ = run_launcher(
        log_dir,
        ["--mode", "sync", "--workers", "2", "--timeout", "240"],
        [os.path.join("tests", "distribute_preempt_script.py"), str(out)]
        + [str(backup_dir)],
        300,
    )
    assert code == 1, stdout
    logs = {i: (log_dir / f"worker-{i}.log").read_text() for i in (0, 1)}
    assert (
        f"ValueError: BackupAndRestore: the backup {stale} does not match this "
        "training: it is of epoch 9, after this fit's last (epochs=4). It was not "
        "loaded and is kept;"
    ) in logs[0]
    assert (
        f"ValueError: BackupAndRestore: the chief refused the backup in {backup_dir} "
        "(its error says what differs); this worker stops too."
    ) in logs[1]
    assert stale.read_bytes() == b"a backup of another run"
    assert os.listdir(out) == []  # no worker started training
