"""The launcher's synchronous mode (`--mode sync`): MultiWorkerMirroredStrategy
jobs of two worker processes on loopback addresses, whole-job restarts, exit
statuses, usage errors and what the terminal shows of a failing worker."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.distribute_launch_helpers import (
    REPO,
    launcher_env,
    read_json,
    run_launcher,
    shown_tail,
)
from tf_lars.distribute import launch

SCRIPT = os.path.join("tests", "distribute_launch_sync_script.py")
TIMEOUT = 240


def _launch(tmp_path, launcher_args, *script_args):
    out = tmp_path / "out"
    out.mkdir()
    log_dir = tmp_path / "logs"
    code, stdout, stderr = run_launcher(
        log_dir,
        # A worker left waiting for a lost peer in an all-reduce is stopped
        # 1 s after the failure, not the default 20 s (the script has no
        # note to leave).
        ["--mode", "sync", "--workers", "2", "--peer-grace", "1", *launcher_args],
        [SCRIPT, str(out), *script_args],
        TIMEOUT,
    )
    return code, stdout, stderr, out, log_dir


def _record(out, index, run):
    return read_json(out / f"worker-{index}-run-{run}.json")


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_two_workers_run_with_their_tf_config_and_agree(tmp_path):
    code, stdout, stderr, out, log_dir = _launch(tmp_path, [])
    assert code == 0, stdout[-6000:] + stderr[-3000:]

    state = read_json(log_dir / "cluster.json")
    addresses = state["cluster"]["worker"]
    assert state["mode"] == "sync" and state["job_restarts"] == 0
    assert state["cluster"] == {"worker": addresses} and len(addresses) == 2
    assert [(t["type"], t["index"]) for t in state["tasks"]] == [
        ("worker", 0),
        ("worker", 1),
    ]
    records = [_record(out, index, 0) for index in (0, 1)]
    for index, record in enumerate(records):
        # MWMS's convention: no chief, worker 0 is the chief.
        assert json.loads(record["tf_config"]) == {
            "cluster": {"worker": addresses},
            "task": {"type": "worker", "index": index},
            "rpc_layer": "grpc",
        }
        assert record["restart"] == 0 and record["stage"] == "done"
        # The all-reduced sum of index + 1 over both workers.
        assert record["total"] == 3.0
    # Both workers apply the same all-reduced updates: identical weights,
    # moved from their start.
    assert records[0]["weights"] == records[1]["weights"]
    assert records[0]["initial"] == records[1]["initial"]
    assert records[0]["weights"] != records[0]["initial"]

    # Worker 0 is echoed, filtered; worker 1 only has its log.
    assert "[script] worker 0 done (run 0)" in stdout
    assert "[script] worker 1 done" not in stdout
    assert "[launch] all 2 workers exited with status 0" in stdout
    worker_1_log = (log_dir / "worker-1.log").read_text()
    assert "[script] worker 1 done (run 0)" in worker_1_log
    worker_0_log = (log_dir / "worker-0.log").read_text()
    absl = "WARNING: All log messages before absl::InitializeLog() is called"
    assert absl in worker_0_log
    assert absl not in stdout
    assert not re.search(r"^[IWEF]\d{4} ", stdout, re.MULTILINE), stdout


@pytest.mark.slow
def test_killed_worker_restarts_the_whole_job_on_the_same_addresses(tmp_path):
    code, stdout, stderr, out, log_dir = _launch(
        tmp_path,
        ["--restart-job", "1", "--restart-delay", "0.5"],
        "--kill-worker",
        "1",
    )
    assert code == 0, stdout[-6000:] + stderr[-3000:]
    assert (
        "[launch] worker 1 exited with signal SIGKILL; restarting the whole job "
        "(restart 1 of 1)"
    ) in stdout
    assert (
        "[launch] restart 1 of 1: starting every worker again (TF_LARS_RESTART=1)"
    ) in stdout
    assert "[launch] all 2 workers exited with status 0" in stdout

    # The first run: both started, worker 1 died, worker 0 never finished.
    first = [_record(out, index, 0) for index in (0, 1)]
    assert [r["stage"] for r in first] == ["started", "started"]
    second = [_record(out, index, 1) for index in (0, 1)]
    for index in (0, 1):
        assert second[index]["restart"] == 1 and second[index]["stage"] == "done"
        # Restarted on the same addresses (the ports are bound again).
        assert second[index]["tf_config"] == first[index]["tf_config"]
    assert second[0]["total"] == second[1]["total"] == 3.0
    assert second[0]["weights"] == second[1]["weights"]

    state = read_json(log_dir / "cluster.json")
    assert state["job_restarts"] == 1
    assert [t["restarts"] for t in state["tasks"]] == [1, 1]
    log = (log_dir / "worker-1.log").read_text()
    assert "[launch] ---- worker 1 started again: restart 1, TF_LARS_RESTART=1" in log
    assert "[script] worker 1 done (run 1)" in log


@pytest.mark.slow
def test_killed_worker_without_restarts_stops_the_job_with_its_status(tmp_path):
    code, stdout, stderr, out, log_dir = _launch(tmp_path, [], "--kill-worker", "1")
    assert code == 137, stdout[-6000:] + stderr[-3000:]
    assert (
        "[launch] worker 1 exited with signal SIGKILL; stopping the job "
        "(no --restart-job)"
    ) in stdout
    # The failed worker's last lines (or that it printed nothing).
    assert shown_tail("worker 1", log_dir / "worker-1.log") in stdout
    assert "[launch] exiting with status 137" in stdout
    assert "restarting" not in stdout
    # Worker 0 waited for worker 1 in an all-reduce; it was stopped.
    assert _record(out, 0, 0)["stage"] == "started"
    assert not (out / "worker-0-run-1.json").exists()
    state = read_json(log_dir / "cluster.json")
    assert state["job_restarts"] == 0
    assert not any(_alive(t["pid"]) for t in state["tasks"])


@pytest.mark.slow
def test_status_2_is_never_restarted(tmp_path):
    code, stdout, stderr, out, log_dir = _launch(
        tmp_path,
        ["--restart-job", "2"],
        "--exit-worker",
        "1",
        "--exit-status",
        "2",
    )
    assert code == 2, stdout[-6000:] + stderr[-3000:]
    assert (
        "[launch] worker 1 exited with status 2; stopping the job (status 2 means "
        "a bad configuration or TF_CONFIG: never restarted)"
    ) in stdout
    # Worker 1 exited before importing TensorFlow; worker 0, still starting
    # (seconds), was stopped once `--peer-grace 1` ran out.
    assert (
        "[launch] the other workers still run 1s later (--peer-grace); stopping them"
    ) in stdout
    # The failed worker's last lines, its error line among them.
    shown = shown_tail("worker 1", log_dir / "worker-1.log")
    assert shown in stdout
    assert "    error: simulated bad configuration\n" in shown
    assert "restarting" not in stdout
    assert read_json(log_dir / "cluster.json")["job_restarts"] == 0
    assert not (out / "worker-0-run-1.json").exists()


@pytest.mark.slow
def test_failing_worker_s_logging_stays_in_its_log_until_it_fails(tmp_path):
    code, stdout, stderr, out, log_dir = _launch(tmp_path, [], "--fail-noisily")
    assert code == 1, stdout[-6000:] + stderr[-3000:]
    log_path = log_dir / "worker-0.log"
    log = log_path.read_text()
    # Worker 0 is echoed: its stdout is on the terminal, its stderr
    # (TensorFlow's logging, the traceback, the error line) in its log only...
    echoed, exit_line, report = stdout.partition(
        "[launch] worker 0 exited with status 1; stopping the job (no --restart-job)\n"
    )
    assert exit_line, stdout
    dumps = (
        "ERROR:tensorflow:step 3 failed",
        "Traceback (most recent call last):",
        "InvalidArgumentError: Graph execution error:",
        "Detected at node CheckNumerics",
        "loss : Tensor had NaN values",
        "WARNING: All log messages before absl::InitializeLog() is called",
        "error: the loss is NaN at step 3",
    )
    for text in dumps:
        assert text in log, text
        assert text not in echoed, text
    # ...until it fails: then the last 15 lines of its log, the error last.
    shown = shown_tail("worker 0", log_path)
    assert report.startswith(shown), report
    assert shown.endswith("    error: the loss is NaN at step 3\n")
    assert shown.count("\n") == 16
    assert stdout.count("error: the loss is NaN at step 3") == 1


def _launcher(args, tmp_path, program=("examples/agn_digits.py",)):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tf_lars.distribute.launch",
            "--log-dir",
            str(tmp_path),
            *args,
            "--",
            *program,
        ],
        cwd=REPO,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_task_cap_counts_every_task_started_here():
    # TASKS_PER_CPU per CPU this process may use (the launcher's refusals of
    # one task more: distribute_tf_config_test.py's USAGE_ERRORS).
    limit = launch.max_local_tasks()
    assert limit == launch.TASKS_PER_CPU * len(os.sched_getaffinity(0))
    assert launch._task_count_error(limit, "x") is None
    assert "Received: x" in launch._task_count_error(limit + 1, "x")
    cluster = json.dumps(
        {"worker": [f"localhost:{2000 + i}" for i in range(limit + 1)]}
    )
    assert launch._check_args(
        launch.build_parser().parse_args(
            ["--mode", "sync", "--cluster", cluster, "--tasks", "worker:0,worker:1"]
        ),
        ["x.py"],
    )[1] == json.loads(cluster)
    with pytest.raises(launch._UsageError, match=f"has {limit + 1} tasks to start"):
        launch._check_args(
            launch.build_parser().parse_args(["--mode", "sync", "--cluster", cluster]),
            ["x.py"],
        )


def test_tasks_starts_only_the_named_worker(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    cluster = {"worker": ["localhost:2001", "localhost:2002"]}
    result = _launcher(
        [
            "--mode",
            "sync",
            "--network",
            "host",
            "--cluster",
            json.dumps(cluster),
            "--tasks",
            "worker:1",
        ],
        tmp_path / "logs",
        program=(SCRIPT, str(out), "--exit-worker", "1", "--exit-status", "4"),
    )
    # The only task started here exits at once with status 4, not restarted.
    assert result.returncode == 4, result.stdout + result.stderr
    assert sorted(os.listdir(tmp_path / "logs")) == ["cluster.json", "worker-1.log"]
    state = read_json(tmp_path / "logs" / "cluster.json")
    assert state["cluster"] == cluster
    assert [(t["type"], t["index"], t["address"]) for t in state["tasks"]] == [
        ("worker", 1, "localhost:2002")
    ]
    assert "    error: simulated bad configuration\n" in result.stdout
    assert shown_tail("worker 1", tmp_path / "logs" / "worker-1.log") in result.stdout
