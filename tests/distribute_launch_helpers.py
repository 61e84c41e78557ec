"""Run `python -m tf_lars.distribute.launch` from a test and watch its output.

Every launcher runs in its own process group and every task in its own
session; `LaunchedCluster.close` kills the launcher and each task's group,
so no process outlives the test, whatever happened.
"""

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

from tf_lars.distribute._process import die_with_parent

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The program the launcher runs in these tests (a script path).
EXAMPLE = os.path.join("examples", "agn_digits.py")


def exit_together(strategy):
    """In a worker script, before `os._exit`: one collective more, so that a
    worker past it knows every other has read the last one whole and its
    exit cuts none short (a peer lost in this one is ignored: `tf_lars`'s
    `_settle`)."""
    import tensorflow as tf

    from tf_lars.distribute.multi_worker import _settle

    _settle(lambda: strategy.reduce("SUM", strategy.run(tf.constant, (0,)), axis=None))


def shown_tail(label, log_path):
    """What the launcher prints of a failed task's log: its last lines, or
    that it printed nothing."""
    from tf_lars.distribute.logs import log_tail

    lines = log_tail(str(log_path))
    if not lines:
        return f"[launch] {label} printed nothing (its log: {log_path})\n"
    header = f"[launch] the last {len(lines)} lines of {log_path}:\n"
    return header + "".join(f"    {line}\n" for line in lines)


def launcher_env():
    env = dict(os.environ)
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


class LaunchedCluster:
    """A launcher process whose output lines are collected as they come; it
    runs `program` (default `EXAMPLE`) with `program_args`."""

    def __init__(self, log_dir, launcher_args, program_args, program=(EXAMPLE,)):
        self.log_dir = str(log_dir)
        command = [
            sys.executable,
            "-m",
            "tf_lars.distribute.launch",
            "--log-dir",
            self.log_dir,
            *launcher_args,
            "--",
            *program,
            *program_args,
        ]
        self.lines = []
        self._queue = queue.Queue()
        self.process = subprocess.Popen(
            command,
            cwd=REPO,
            env=launcher_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.process.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            self._queue.put(line)
        self._queue.put(None)

    @property
    def output(self):
        return "\n".join(self.lines)

    def wait_for(self, pattern, timeout):
        """Returns the regex match of the first new line matching `pattern`."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(
                    f"no line matching {pattern!r} within {timeout}s; output:\n"
                    + self.output[-6000:]
                )
            try:
                line = self._queue.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(
                    f"launcher ended before a line matched {pattern!r}; output:\n"
                    + self.output[-6000:]
                )
            match = regex.search(line)
            if match:
                return match

    def state(self):
        with open(os.path.join(self.log_dir, "cluster.json")) as handle:
            return json.load(handle)

    def task(self, task_type, index):
        for task in self.state()["tasks"]:
            if task["type"] == task_type and task["index"] == index:
                return task
        raise KeyError((task_type, index))

    def kill_task(self, task_type, index):
        pid = self.task(task_type, index)["pid"]
        os.killpg(pid, signal.SIGKILL)
        return pid

    def wait(self, timeout):
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"launcher still running after {timeout}s; output:\n"
                + self.output[-6000:]
            ) from None
        self._reader.join(10)
        return code

    def close(self):
        task_pids = []
        try:
            task_pids = [t["pid"] for t in self.state()["tasks"] if t["pid"]]
        except (OSError, ValueError, KeyError):
            pass
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        for pid in [self.process.pid, *task_pids]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def start_launcher(log_dir, launcher_args, program, stderr=subprocess.STDOUT):
    """Starts `python -m tf_lars.distribute.launch` in its own session;
    returns the `Popen` (text mode, stdout piped, stderr into it by default)."""
    command = [
        sys.executable, "-m", "tf_lars.distribute.launch",
        "--log-dir", str(log_dir), *launcher_args, "--", *program,
    ]  # fmt: skip
    return subprocess.Popen(
        command,
        cwd=REPO,
        env=launcher_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        start_new_session=True,
        preexec_fn=die_with_parent,
    )


def worker_logs(root, tail=3000, workers=2):
    """The workers' logs of a job under `root` (the last `tail` characters
    of each, or all with None), for assertion messages."""
    text = []
    for index in range(workers):
        path = os.path.join(root, "logs", f"worker-{index}.log")
        if os.path.exists(path):
            with open(path) as handle:
                log = handle.read()
            text.append(f"--- worker {index}\n" + (log[-tail:] if tail else log))
    return "\n".join(text)


def run_sync_jobs(jobs, timeout, workers=2):
    """Sync jobs of a test script (two workers each), run side by side to
    their end.

    Args:
        jobs: name -> `(root, script, program_args)`: each job runs
            `script ROOT/out ROOT/backup *program_args` through the launcher
            (`--mode sync --workers 2 --restart-job 1 --peer-grace 1`, logs
            in `ROOT/logs`),
            all started before any is waited for.
        timeout: seconds to wait for each job.
        workers: int. The workers of each job (`--workers`). Defaults to 2.

    Returns:
        name -> `{"root", "out", "backup", "output"}`. A job still running is
        killed (with its tasks' group); a job that exits non-zero fails the
        test with its last output and its workers' logs.
    """
    launched = {}
    for name, (root, script, program_args) in jobs.items():
        out, backup = os.path.join(root, "out"), os.path.join(root, "backup")
        os.makedirs(out)
        process = start_launcher(
            os.path.join(root, "logs"),
            ["--mode", "sync", "--workers", str(workers)]
            + ["--restart-job", "1", "--peer-grace", "1"],
            [script, out, backup, *program_args],
        )
        launched[name] = (process, {"root": root, "out": out, "backup": backup})
    try:
        for process, job in launched.values():
            job["output"] = process.communicate(timeout=timeout)[0]
    finally:
        for process, _ in launched.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
    for name, (process, job) in launched.items():
        assert process.returncode == 0, (
            f"{name}: {job['output'][-3000:]}\n"
            f"{worker_logs(job['root'], workers=workers)}"
        )
    return {name: job for name, (_, job) in launched.items()}


def run_launcher(log_dir, launcher_args, program, timeout):
    """Runs the launcher to its end; returns `(status, stdout, stderr)`.

    The launcher's stdout is what a user sees of the tasks (the echoed one,
    filtered) and its own `[launch]` lines; its stderr holds its usage
    errors. The launcher stops its tasks when it ends; if it does not end in
    `timeout` seconds, it and its tasks are killed.
    """
    process = start_launcher(log_dir, launcher_args, program, subprocess.PIPE)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        _kill_tasks(os.path.join(str(log_dir), "cluster.json"))
        stdout, stderr = process.communicate()
        raise AssertionError(
            f"launcher still running after {timeout}s; output:\n{stdout[-6000:]}"
        ) from None
    return process.returncode, stdout, stderr


def _kill_tasks(state_path):
    try:
        with open(state_path) as handle:
            pids = [t["pid"] for t in json.load(handle)["tasks"] if t["pid"]]
    except (OSError, ValueError, KeyError):
        return
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def read_json(path):
    with open(path) as handle:
        return json.load(handle)
