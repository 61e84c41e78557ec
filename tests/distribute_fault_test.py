"""Faults on a real multi-process cluster started by the launcher.

Each test kills a task with SIGKILL in the middle of training. The workers'
input pipeline sleeps a little per batch (`--input-delay-ms`) so that the
run lasts long enough to fail and recover in, without burning the CPU.
"""

import re
import socket

import pytest

from tests.distribute_launch_helpers import LaunchedCluster, read_json

PERIOD = 5
STEPS_PER_WORKER = 500
TARGET = 2 * STEPS_PER_WORKER // PERIOD  # K * N / P commits in a failure-free run


def _program(result_path, delay_ms, *extra):
    return [
        "--period",
        str(PERIOD),
        "--steps-per-worker",
        str(STEPS_PER_WORKER),
        "--input-delay-ms",
        str(delay_ms),
        "--checkpoint-every",
        "20",
        "--result-json",
        str(result_path),
        *extra,
    ]


def _check_finished(result, output):
    # A worker killed mid-round may have pushed its commit before dying, and
    # the coordinator then runs the round again: at most one extra round.
    assert TARGET <= result["commits"] <= TARGET + 1, output[-6000:]
    assert result["local_steps"] == result["commits"] * PERIOD
    assert result["test_accuracy"] >= 0.9, result


def _repeated_records(text):
    """TensorFlow log records printed twice in a row (by two handlers)."""
    records = [
        # A record ends where the program's own lines (`[agn] ...`) start.
        re.split(r"\n(?=\[\w|error:)", record)[0]
        for record in re.split(r"\n(?=(?:ERROR|WARNING):tensorflow:)", text)
    ]
    return [a for a, b in zip(records, records[1:], strict=False) if a == b]


def _check_terminal(output, log_dir):
    # The chief's TensorFlow logging (stderr) stays in its log, each record
    # once; the terminal shows its stdout, and the log's last lines only if
    # it fails.
    log = (log_dir / "chief-0.log").read_text()
    assert "ERROR:tensorflow:" in log
    assert _repeated_records(log) == []
    echoed = output.partition("[launch] the last ")[0]
    assert "ERROR:tensorflow:" not in echoed, output[-6000:]
    assert "Traceback" not in echoed


def _worker_lines(lines, address, what):
    """The chief's status lines about worker 1 (at `address`) saying `what`."""
    start = f"[agn] worker 1 ({address}) {what}"
    return [line for line in lines if line.startswith(start)]


# AGN's own commit, and asynchronous DiLoCo (an outer Nesterov SGD on the
# parameter servers: 0.2 per commit is AGN's 1 / period, with momentum).
OUTER = {
    "agn": (),
    "outer": ("--outer-learning-rate", "0.2", "--outer-momentum", "0.5"),
}


@pytest.mark.slow
@pytest.mark.parametrize("commit", sorted(OUTER))
def test_worker_killed_and_restarted_training_finishes(tmp_path, commit):
    result_path = tmp_path / "result.json"
    with LaunchedCluster(
        tmp_path / "logs",
        ["--workers", "2", "--ps", "1", "--restart-workers", "--restart-delay", "0.5"],
        _program(result_path, 25, *OUTER[commit]),
    ) as run:
        run.wait_for(r"\[agn\] commits 20/", 180)
        killed = run.kill_task("worker", 1)
        run.wait_for(r"\[launch\] worker 1 exited with signal SIGKILL; restarting", 30)
        run.wait_for(r"\[launch\] worker 1 restarted: pid \d+", 30)
        code = run.wait(240)
        output = run.output
        assert run.task("worker", 1)["pid"] != killed
        assert run.task("worker", 1)["restarts"] == 1
        address = run.task("worker", 1)["address"]

    assert code == 0, output[-6000:]
    # The chief names the lost worker and its return, each in a line of its
    # own on the terminal (from the coordinator's failure and recovery).
    lost = _worker_lines(run.lines, address, "lost (")
    assert len(lost) == 1 and lost[0].endswith(
        "); the other workers take its rounds"
    ), output[-6000:]
    rejoined = _worker_lines(run.lines, address, "rejoined")
    assert rejoined == [
        f"[agn] worker 1 ({address}) rejoined, with new worker-local state"
    ], output[-6000:]
    assert run.lines.index(lost[0]) < run.lines.index(rejoined[0])
    # The coordinator's own records of the lost worker are in the chief's log.
    assert (
        "/job:worker/replica:0/task:1"
        in (tmp_path / "logs" / "chief-0.log").read_text()
    )
    _check_terminal(output, tmp_path / "logs")
    result = read_json(result_path)
    _check_finished(result, output)
    # The restarted worker's local state is new; it trained after it rejoined.
    steps = re.search(
        r"local steps per worker since its \(re\)start: \[(\d+), (\d+)\]", output
    )
    assert steps, output[-3000:]
    assert int(steps.group(2)) > 0
    assert int(steps.group(1)) + int(steps.group(2)) < result["local_steps"]


@pytest.mark.slow
def test_worker_that_never_returns_training_finishes_on_the_rest(tmp_path):
    result_path = tmp_path / "result.json"
    with LaunchedCluster(
        tmp_path / "logs", ["--workers", "2", "--ps", "1"], _program(result_path, 5)
    ) as run:
        run.wait_for(r"\[agn\] commits 20/", 180)
        run.kill_task("worker", 1)
        run.wait_for(
            r"\[launch\] worker 1 exited with signal SIGKILL; not restarted", 30
        )
        code = run.wait(240)
        output = run.output
        address = run.task("worker", 1)["address"]

    assert code == 0, output[-6000:]
    assert len(_worker_lines(run.lines, address, "lost (")) == 1, output[-6000:]
    assert _worker_lines(run.lines, address, "rejoined") == []
    assert (
        "/job:worker/replica:0/task:1"
        in (tmp_path / "logs" / "chief-0.log").read_text()
    )
    result = read_json(result_path)
    _check_finished(result, output)
    assert re.search(
        r"local steps per worker since its \(re\)start: \[\d+, None\]", output
    )


@pytest.mark.slow
def test_parameter_server_killed_then_rerun_resumes_from_checkpoint(tmp_path):
    checkpoints = tmp_path / "ckpt"
    first = tmp_path / "first.json"
    with LaunchedCluster(
        tmp_path / "logs1",
        ["--workers", "2", "--ps", "1"],
        _program(first, 10, "--checkpoint-dir", str(checkpoints)),
    ) as run:
        saved = int(
            run.wait_for(r"\[agn\] checkpoint saved: \S+ \(commit (\d+)\)", 180).group(
                1
            )
        )
        ps_address = run.task("ps", 0)["address"]
        run.kill_task("ps", 0)
        code = run.wait(120)
        output = run.output

    # The chief stops with a message that names the task; the launcher stops
    # the rest and passes the chief's status on.
    assert code == 3, output[-6000:]
    message = re.search(
        r"error: parameter server /job:ps/replica:0/task:0 \((\S+)\) is unavailable; "
        r"training stopped\. Restart the parameter servers and rerun: training "
        r"resumes from (\S+) \(commit (\d+)\)\.",
        output,
    )
    assert message, output[-6000:]
    assert message.group(1) == ps_address
    # That line reaches the terminal on its own, from the chief's stdout
    # (its `error:` line on stderr is in the log's last lines too).
    status = "[agn] error: " + message.group(0).removeprefix("error: ")
    assert status in run.lines, output[-6000:]
    assert run.lines.index(status) < run.lines.index(
        "[launch] chief exited with status 3; stopping the other tasks"
    )
    _check_terminal(output, tmp_path / "logs1")
    last_checkpoint_commit = int(message.group(3))
    saves = [
        int(c) for c in re.findall(r"checkpoint saved: \S+ \(commit (\d+)\)", output)
    ]
    assert saves[0] == saved and last_checkpoint_commit == saves[-1]
    reached = max(int(c) for c in re.findall(r"\[agn\] commits (\d+)/", output))
    assert not first.exists()

    second = tmp_path / "second.json"
    with LaunchedCluster(
        tmp_path / "logs2",
        ["--workers", "2", "--ps", "1"],
        _program(second, 0, "--checkpoint-dir", str(checkpoints)),
    ) as run:
        code = run.wait(240)
        output = run.output

    assert code == 0, output[-6000:]
    assert re.search(
        rf"\[agn\] restored \S+ \(commit {last_checkpoint_commit}\)", output
    )
    assert f"starting at commit {last_checkpoint_commit}" in output
    result = read_json(second)
    assert result["restored_commits"] == last_checkpoint_commit
    # Lost to the failure: at most the rounds since that checkpoint (20
    # commits between checkpoints, plus the rounds in flight).
    assert 0 <= reached - last_checkpoint_commit <= 20 + 2
    assert result["commits"] == TARGET
    assert result["local_steps"] == TARGET * PERIOD
    assert result["test_accuracy"] >= 0.9


def test_unreachable_parameter_server_is_found_by_its_port():
    from tf_lars.distribute.trainer import _unreachable_ps_task

    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, not listening: refused
        up = f"localhost:{listening.getsockname()[1]}"
        down = f"127.0.0.1:{closed.getsockname()[1]}"
        assert _unreachable_ps_task({"ps": [up]}) is None
        assert _unreachable_ps_task({"ps": [up, down]}) == (
            "/job:ps/replica:0/task:1",
            down,
        )
