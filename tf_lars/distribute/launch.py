"""Start a TensorFlow cluster as local processes and run a program on every task.

    python -m tf_lars.distribute.launch --workers 2 --ps 1 -- \\
        examples/agn_digits.py --steps-per-worker 300
    python -m tf_lars.distribute.launch --mode sync --workers 2 \\
        --restart-job 1 --log-dir logs -- my_train.py --epochs 10

After `--` come the training program (a script path, `-m module` or a module
name) and its arguments. Each task is a process with its own `TF_CONFIG` and
`TF_LARS_RESTART=<whole-job restarts so far>`.

- `--mode ps` (default): ParameterServerStrategy, 1 chief, `--workers`
  workers, `--ps` parameter servers. The chief's output is shown; the
  launcher exits with the chief's status.
- `--mode sync`: MultiWorkerMirroredStrategy, `--workers` workers (worker 0,
  the chief, is shown). The job succeeds when every worker exits with 0; when
  one fails, the others are stopped (after `--peer-grace` seconds, default
  20, to exit by themselves) and, with `--restart-job N`, every worker
  starts again (up to N times; statuses 2 and 3 are never restarted); else
  the launcher exits with its status (128 + signal number for a signal).

Each task's output is in `<log-dir>/<type>-<index>.log`, the cluster's state
in `<log-dir>/cluster.json`; the terminal shows the shown task's stdout and
the last lines of a failed task's log. Ctrl-C or SIGTERM is passed on to
every task as SIGTERM, for its own handling (SIGKILL 10 s later), and the
launcher exits with 130 or 143; `--timeout` stops every task too, with
status 124. One launcher starts at most 4 tasks per
CPU. Usage errors print one line and exit with status 2 before anything
starts.

Security: TensorFlow's gRPC servers have no authentication and listen on
every interface whatever the cluster's host names; local clusters run in a
loopback-only network namespace where Linux allows it (`--network`). For
clusters of machines use their engine (Kubeflow's TFJob:
`examples/kubeflow_tfjob.yaml`). The guides (docs/guides/parameter-servers.md,
multi-worker.md) say more.
"""

import argparse
import contextlib
import ctypes
import fcntl
import json
import math
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

from tf_lars.distribute import _process, logs
from tf_lars.distribute import tf_config as tf_config_lib
from tf_lars.distribute.cluster import bind_host, local_cluster
from tf_lars.distribute.run import EXIT_CLUSTER, EXIT_CONFIG

#: Environment variable each task gets: whole-job restarts so far (sync mode).
RESTART_ENV = "TF_LARS_RESTART"
#: Exit status when `--timeout` ends the job (the status of coreutils' timeout).
EXIT_TIMEOUT = 124
#: Seconds the tasks have, after the SIGTERM a Ctrl-C or SIGTERM of the
#: launcher passes on, for their own handling (`tf-lars train` stops every
#: worker at the next step end and leaves its INTERRUPTED note) before
#: SIGKILL. A failed job's other tasks get `stop_all`'s default 5 s.
SIGNAL_GRACE = 10.0
#: Seconds a sync job's other workers have, once one failed, to notice the
#: lost peer and exit by themselves (`tf-lars train` leaves its INTERRUPTED
#: note) before they are stopped; a loaded machine needs more than 5 s. The
#: default of `--peer-grace`.
PEER_GRACE = 20.0
#: Local tasks the launcher starts per CPU at most (`max_local_tasks`).
TASKS_PER_CPU = 4
#: The largest `--cluster @file` read: a cluster of thousands of tasks is far
#: smaller, and `@/dev/zero` must not read until memory runs out.
MAX_CLUSTER_FILE_BYTES = 1 << 20

_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP, _IFREQ = 0x8913, 0x8914, 0x1, "16sh22x"


class NamespaceSetupError(OSError):
    """The namespace was entered but could not be set up; no way back."""


class _UsageError(Exception):
    """A usage error: one line on stderr, exit status 2, nothing started."""


def _log(message):
    logs.write_lines([f"[launch] {message}"])


def enter_private_network():
    """Moves this process (and the tasks it starts) to a loopback-only network.

    TensorFlow's unauthenticated gRPC servers listen on every interface
    whatever the address says; in this namespace nothing outside can reach
    them. Non-root users get a user namespace mapping their own uid.

    Raises:
        OSError: the kernel (or platform) refuses; this process is unchanged.
        NamespaceSetupError: entered but not set up (uid map, loopback).
    """
    libc = _process._LIBC
    if libc is None:
        raise OSError("network namespaces exist only on Linux")
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(_CLONE_NEWNET | (_CLONE_NEWUSER if uid else 0)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"unshare failed: {os.strerror(errno)}")
    maps = {"setgroups": "deny", "uid_map": f"{uid} {uid} 1"}
    maps["gid_map"] = f"{gid} {gid} 1"
    try:
        for name, text in maps.items() if uid else ():
            with open(f"/proc/self/{name}", "w") as handle:
                handle.write(text)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            reply = fcntl.ioctl(sock, _SIOCGIFFLAGS, struct.pack(_IFREQ, b"lo", 0))
            up = struct.unpack(_IFREQ, reply)[1] | _IFF_UP
            fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", up))
    except OSError as error:
        raise NamespaceSetupError(
            error.errno, f"setting up the private network failed: {error}"
        ) from error


class Task:
    """One task process, run in a session (process group) of its own."""

    def __init__(self, config, command, log_path, environ):
        self.config, self.command, self.log_path = config, command, log_path
        self.environ, self.process, self._tee = environ, None, None
        self._group = None  # the latest run's group id while it may have members
        self.restarts = self.log_offset = 0
        self.reported_exit, self.restart_at = False, None

    label = property(lambda self: "{} {}".format(*self.key))
    key = property(lambda self: (self.config.task_type, self.config.task_index))

    def start(self, echo=False, job_restarts=0):
        self.signal(signal.SIGKILL)  # what the previous run left in its group
        self.restarts += self.process is not None
        env = dict(self.environ, TF_CONFIG=self.config.to_json())
        env[RESTART_ENV] = str(job_restarts)
        log = open(self.log_path, "ab", buffering=0)  # noqa: SIM115 - closed below/by tee
        self.log_offset = log.seek(0, os.SEEK_END)
        if self.log_offset:
            log.write(
                f"[launch] ---- {self.label} started again: restart {self.restarts}, "
                f"{RESTART_ENV}={job_restarts} ----\n".encode()
            )
        # The echoed task's stdout is copied to the terminal; stderr
        # (TensorFlow's and absl's logging) goes to the log only.
        self.process = subprocess.Popen(
            self.command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if echo else log,
            stderr=log if echo else subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_process.die_with_parent,  # killed with the launcher
        )
        self._group, self.reported_exit = self.process.pid, False
        if echo:
            self._tee = threading.Thread(
                target=logs.tee_stdout, args=(self.process.stdout, log), daemon=True
            )
            self._tee.start()
        else:
            log.close()

    def poll(self):
        return None if self.process is None else self.process.poll()

    def signal(self, signum):
        """Signals the task's group, also after its main process exited (its
        children must not outlive the launcher); whether it may have members."""
        if self._group is not None:
            try:
                os.killpg(self._group, signum)
            except ProcessLookupError:
                self._group = None  # empty: forget it before the id is reused
            except PermissionError:
                pass
        return self._group is not None

    def finish_echo(self, timeout=5.0):
        if self._tee is not None:
            self._tee.join(timeout)


def stop_all(tasks, grace=5.0):
    """SIGTERM every task's process group, SIGKILL what is left, end the echo."""
    for signum, seconds in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        deadline = time.monotonic() + seconds
        for task in tasks:
            task.signal(signum)
        for task in tasks:
            if task.process is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    task.process.wait(max(0.0, deadline - time.monotonic()))
    # Signal 0 finds each emptied group gone, so its id is forgotten.
    deadline = time.monotonic() + 1.0
    while any(task.signal(0) for task in tasks) and time.monotonic() < deadline:
        time.sleep(0.02)
    for task in tasks:
        task.finish_echo()


def _describe_exit(code):
    with contextlib.suppress(ValueError):
        return f"status {code}" if code >= 0 else f"signal {signal.Signals(-code).name}"
    return f"signal {-code}"


def _exit_status(code):
    return code if code >= 0 else 128 - code  # 128 + signal number


def max_local_tasks():
    """`TASKS_PER_CPU` times the CPUs this process may run on: the most tasks
    one launcher starts (MultiWorkerMirroredStrategy's collectives time out
    when far more TensorFlow processes than cores share a machine)."""
    if hasattr(os, "sched_getaffinity"):
        return TASKS_PER_CPU * len(os.sched_getaffinity(0))
    return TASKS_PER_CPU * (os.cpu_count() or 1)


def _task_count_error(count, received):
    """The one-line usage error for too many local tasks, or None."""
    limit = max_local_tasks()
    if count > limit:
        return (
            f"the launcher starts at most {TASKS_PER_CPU} tasks per CPU here "
            f"({limit}); this cluster has {count} tasks to start. Received: {received}"
        )
    return None


# ------------------------------------------------------------ command line
def _checked(rule, ok, convert=str):
    """An argparse type: `convert(text)` if `ok` of it, else an error naming `rule`."""

    def parse(text):
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}. Received: {text!r}")
        return value

    return parse


def _is_host(text):
    with contextlib.suppress(tf_config_lib.TFConfigError):
        return bool(tf_config_lib.split_address(f"{text}:1"))
    return False


def build_parser():
    """The launcher's options (the program after `--` is not parsed here)."""
    parser = argparse.ArgumentParser(
        prog="python -m tf_lars.distribute.launch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # Usage errors as one line (`error: ...`) and exit status 2.
    parser.error = lambda message: parser.exit(2, f"error: {message}\n")
    count = _checked("an int >= 1", lambda n: n >= 1, int)
    seconds = _checked("a finite number >= 0", lambda x: 0 <= x < math.inf, float)
    add = parser.add_argument
    # fmt: off
    add("--mode", choices=("ps", "sync"), default="ps",
        help="ps: parameter servers (default); sync: MultiWorkerMirroredStrategy")
    add("--workers", type=count, default=2, help="worker tasks (default 2); at "
        f"most {TASKS_PER_CPU} tasks per CPU in all (chief and ps included)")
    add("--ps", type=count, help="parameter-server tasks (ps mode only; default 1)")
    add("--host", default="localhost",
        type=_checked("a host name or IP address", _is_host),
        help="host name in the cluster addresses (default localhost)")
    add("--cluster", help="a cluster as JSON (or @file.json) instead of "
        "--workers/--ps/--host")
    add("--tasks", help="the tasks to start here, e.g. 'worker:0,ps:0' (default all)")
    add("--log-dir", help="directory for task logs (default: a new temp dir)",
        type=_checked("a directory (it is created if missing)",
                      lambda p: os.path.isdir(p) or not os.path.exists(p)))
    add("--network", choices=("auto", "private", "host"), default="auto",
        help="private: a loopback-only network namespace; host: the machine's "
        "network; auto (default): private where every address is local and "
        "the kernel allows it")
    add("--restart-workers", action="store_true",
        help="ps mode: restart a worker process that dies while the chief runs")
    add("--restart-job", metavar="N",
        type=_checked("an int >= 0", lambda n: n >= 0, int),
        help="sync mode: when a worker fails, restart every worker, at most N "
        "times (default 0)")
    add("--peer-grace", metavar="SECONDS", default=None,
        type=seconds,
        help="sync mode: seconds the other workers get to exit by themselves "
        f"once one failed, before they are stopped (default {PEER_GRACE:g})")
    add("--restart-delay", default=1.0,
        type=seconds,
        help="seconds before a restart (default 1)")
    add("--timeout", metavar="SECONDS",
        type=_checked("a finite number > 0", lambda x: 0 < x < math.inf, float),
        help="stop every task and exit with status 124 when the job, restarts "
        "included, runs longer than this (default: no limit)")
    add("--python", default=sys.executable, help="Python interpreter",
        type=_checked("an executable Python interpreter", shutil.which))
    # fmt: on
    return parser


_PROGRAM_HELP = (
    "give the training program after `--`: a script path or `-m module`, "
    "then its arguments, e.g. `-- examples/agn_digits.py --steps-per-worker 300`"
)


def _program_command(program, python):
    """`[python, script, *args]` or `[python, "-m", module, *args]`; None when
    `program` names no program (a usage error)."""
    if not program or program == ["-m"]:
        return None
    head = program[0]
    if head == "-m" or head.endswith(".py") or os.sep in head or os.path.isfile(head):
        return [python, *program]
    return [python, "-m", *program]


def _option_error(args):
    """The one-line usage error for flags of the other mode or a bad path."""
    sync = args.mode == "sync"
    if sync and args.ps is not None:
        return (
            "`--ps` starts parameter servers, which --mode sync does not use "
            "(MultiWorkerMirroredStrategy runs workers only). Received: "
            f"--mode sync --ps {args.ps}"
        )
    if sync and args.restart_workers:
        return (
            "`--restart-workers` restarts one parameter-server worker; --mode sync "
            "restarts the whole job: use --restart-job N. Received: --mode sync "
            "--restart-workers"
        )
    if not sync and args.restart_job is not None:
        return (
            "`--restart-job` restarts a synchronous job (--mode sync); in ps mode "
            "use --restart-workers. Received: --mode ps --restart-job "
            f"{args.restart_job}"
        )
    if not sync and args.peer_grace is not None:
        return (
            "`--peer-grace` is how long a synchronous job's other workers get once "
            "one failed (--mode sync); in ps mode the chief carries on. Received: "
            f"--mode ps --peer-grace {args.peer_grace:g}"
        )
    return None


def _read_cluster(text, mode):
    """The validated cluster of `--cluster` (JSON, or `@file` of JSON)."""
    if text.startswith("@"):
        with open(text[1:], "rb") as handle:
            data = handle.read(MAX_CLUSTER_FILE_BYTES + 1)
        if len(data) > MAX_CLUSTER_FILE_BYTES:
            raise tf_config_lib.TFConfigError(
                f"`--cluster {text}` is larger than {MAX_CLUSTER_FILE_BYTES} "
                "bytes; a cluster file is a small JSON object."
            )
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise tf_config_lib.TFConfigError(
                f"`--cluster {text}` is not UTF-8 text (a JSON file was expected)."
            ) from None
    try:
        cluster = tf_config_lib.load_json(text)
    except tf_config_lib.TFConfigError as error:
        raise tf_config_lib.TFConfigError(f"`--cluster` is {error}.") from None
    return tf_config_lib.validate_cluster(cluster, mode=mode)


def _parse_task_list(text, cluster):
    """The `(type, index)` tasks `--tasks` names (default: all, ps first)."""
    every = [(t, i) for t in ("ps", "worker", "chief") for i in
             range(len(cluster.get(t, ())))]  # fmt: skip
    tasks = []
    for item in [] if text is None else map(str.strip, text.split(",")):
        task_type, _, index = item.partition(":")
        if index and not (index.isascii() and index.isdigit()):
            raise tf_config_lib.TFConfigError(
                f"`--tasks` names {item!r}: the index after ':' must be a "
                "non-negative int, e.g. 'worker:0'."
            )
        # No cluster has 10**18 tasks, and int() refuses over 4,300 digits.
        tasks.append((task_type, int(index.lstrip("0")[:19] or 0)))
        if tasks[-1] not in every:
            raise tf_config_lib.TFConfigError(
                f"`--tasks` names {item!r}, which is not a task of the cluster."
            )
    return every if text is None else tasks


def _check_args(args, program):
    """The task command and the `--cluster` (None: the launcher makes one).

    Raises:
        _UsageError: before any port is picked or anything started.
    """
    command = _program_command(program, args.python)
    message = _option_error(args) if command else _PROGRAM_HELP
    if message:
        raise _UsageError(message)
    try:
        cluster = args.cluster and _read_cluster(args.cluster, args.mode)
        count = cluster and len(_parse_task_list(args.tasks, cluster))
    except (tf_config_lib.TFConfigError, OSError) as error:
        raise _UsageError(str(error)) from None
    if cluster:
        received = f"--cluster with {count} tasks to start here"
    else:
        count = args.workers + (0 if args.mode == "sync" else 1 + (args.ps or 1))
        received = f"--mode {args.mode} --workers {args.workers}"
        received += f" --ps {args.ps}" if args.ps else ""
    message = _task_count_error(count, received)
    if message:
        raise _UsageError(message)
    return command, cluster or None


def _enter_network(args, cluster):
    """Enters the private network when asked and possible: "private" or "host"."""
    addresses = [a for v in cluster.values() for a in v] if cluster else [
        f"{args.host}:1"]  # fmt: skip
    local = all(map(tf_config_lib.is_local_address, addresses))
    if args.network == "private" and not local:
        raise _UsageError("--network private needs every cluster address to be local")
    if args.network != "host" and local:
        try:
            enter_private_network()
            return "private"
        except OSError as error:
            if args.network == "private" or isinstance(error, NamespaceSetupError):
                raise _UsageError(
                    f"--network {args.network}: {error} (pass --network "
                    "host to use the machine's network)"
                ) from None
            _log(
                f"WARNING: no private network namespace ({error}); TensorFlow's "
                "unauthenticated gRPC servers listen on all interfaces of this "
                "machine."
            )
    _log(
        "WARNING: TensorFlow's gRPC servers have no authentication and listen "
        "on all interfaces; keep these ports unreachable from untrusted hosts."
    )
    return "host"


def main(argv=None):
    """Runs the launcher on `argv` (default `sys.argv[1:]`); the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = build_parser().parse_args(argv[:split])
    try:
        command, cluster = _check_args(args, argv[split + 1 :])
        network = _enter_network(args, cluster)
        num_ps = 0 if args.mode == "sync" else args.ps or 1
        cluster = cluster or local_cluster(args.workers, num_ps, args.host, args.mode)
        wanted = _parse_task_list(args.tasks, cluster)
        try:
            log_dir = args.log_dir or tempfile.mkdtemp(prefix="tf_lars_launch_")
            os.makedirs(log_dir, exist_ok=True)
            launch = _Launch(args, cluster, network, command, log_dir, wanted)
        except OSError as error:
            raise _UsageError(f"`--log-dir`: {error}") from None
    except (_UsageError, tf_config_lib.TFConfigError, OSError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda got, _: setattr(launch, "stop_signal", got))
    return launch.run()


# ----------------------------------------------------------------- the run
class _Launch:
    """The launcher's state: the cluster, its tasks, and the run loop."""

    def __init__(self, args, cluster, network, command, log_dir, wanted):
        self.args, self.cluster, self.network = args, cluster, network
        self.command, self.job_restarts = command, 0
        self.stop_signal, self.deadline = None, math.inf
        self.state_path = os.path.join(log_dir, "cluster.json")
        environ, base = logs.task_environment(), self._base()
        log_paths = [logs.task_log_path(log_dir, *key) for key in wanted]
        for log_path in log_paths:  # emptied (a usage error here leaves nothing)
            open(log_path, "wb").close()  # noqa: SIM115 - not kept open
        # The tasks' temporary files, deleted when the job ends: TensorFlow's
        # autograph deletes its modules only at a normal exit, which a task
        # stopped by a signal or ended by `os._exit` never reaches.
        environ["TMPDIR"] = self.scratch = tempfile.mkdtemp(prefix="tf_lars_tasks_")
        self.tasks = [
            Task(base.for_task(*key), command, log_path, environ)
            for key, log_path in zip(wanted, log_paths, strict=True)
        ]
        # The task whose output is shown: the chief, else worker 0 (sync).
        shown = ("chief", 0) if "chief" in cluster else ("worker", 0)
        self.echoed = next((t for t in self.tasks if t.key == shown), None)

    def _base(self):
        task_type = "worker" if self.args.mode == "sync" else "chief"
        return tf_config_lib.TFConfig(self.cluster, task_type, 0, mode=self.args.mode)

    def write_state(self):
        tasks = [dict(type=t.key[0], index=t.key[1], address=t.config.address,
                      pid=t.process and t.process.pid, log=t.log_path,
                      restarts=t.restarts) for t in self.tasks]  # fmt: skip
        state = dict(mode=self.args.mode, cluster=self.cluster, network=self.network,
                     command=self.command, launcher_pid=os.getpid(),
                     job_restarts=self.job_restarts, tasks=tasks)  # fmt: skip
        with open(self.state_path + ".tmp", "w") as handle:
            json.dump(state, handle, indent=2)
        os.replace(self.state_path + ".tmp", self.state_path)

    def _start_all(self):
        for task in self.tasks:
            task.start(task is self.echoed, self.job_restarts)
            _log(
                f"{task.label:<9} {task.config.address:<22} pid "
                f"{task.process.pid:<7} log {task.log_path}"
            )
        self.write_state()

    def _wait(self, seconds):
        """Sleeps `seconds`; returns the exit status (never 0) if a signal or
        `--timeout` ends the job meanwhile, else None."""
        end = min(time.monotonic() + seconds, self.deadline)
        while self.stop_signal is None and time.monotonic() < end:
            time.sleep(0.05)
        if self.stop_signal is not None:
            _log(
                f"got {signal.Signals(self.stop_signal).name}; passing SIGTERM on "
                f"to every task (SIGKILL {SIGNAL_GRACE:g}s later)"
            )
            return 128 + self.stop_signal
        if time.monotonic() < self.deadline:
            return None
        running = ", ".join(t.label for t in self.tasks if t.poll() is None)
        _log(
            f"--timeout {self.args.timeout:g}s reached with {running or 'no task'} "
            f"still running; stopping all tasks, exit status {EXIT_TIMEOUT}"
        )
        return EXIT_TIMEOUT

    def _report_error(self, task, always):
        """The last lines of a failed task's latest run in its log."""
        lines = logs.log_tail(task.log_path, task.log_offset)
        if lines:
            logs.write_lines(
                [f"[launch] the last {len(lines)} lines of {task.log_path}:"]
                + [f"    {line}" for line in lines]
            )
        elif always:
            _log(f"{task.label} printed nothing (its log: {task.log_path})")

    def run(self):
        """Starts every task and watches them; returns the exit status."""
        _log(f"network: {self.network}; cluster: {json.dumps(self.cluster)}")
        self.deadline = time.monotonic() + (self.args.timeout or math.inf)
        step = self._sync_step if self.args.mode == "sync" else self._ps_step
        try:
            self._start_all()
            while True:
                code = self._wait(0.1) or step()
                if code is not None:
                    return code
        finally:
            stop_all(self.tasks, SIGNAL_GRACE if self.stop_signal else 5.0)
            self.write_state()
            shutil.rmtree(self.scratch, ignore_errors=True)

    def _ps_step(self):
        """ps mode: the chief's exit ends the job; workers may be restarted."""
        chief, now = self.echoed, time.monotonic()
        if chief is not None and chief.poll() is not None:
            code = chief.poll()
            chief.finish_echo()
            _log(f"chief exited with {_describe_exit(code)}; stopping the other tasks")
            if code != 0:
                self._report_error(chief, always=True)
            return _exit_status(code)
        if chief is None and all(t.poll() is not None for t in self.tasks):
            return 0
        for task in self.tasks:
            code = task.poll()
            if task is chief or code is None or task.reported_exit:
                continue
            task.reported_exit = True
            if task.key[0] != "worker":
                what = "a parameter server holds the model, the chief will stop"
            elif self.args.restart_workers:
                what = f"restarting in {self.args.restart_delay:g}s"
                task.restart_at = now + self.args.restart_delay
            else:
                what = "not restarted"
            _log(f"{task.label} exited with {_describe_exit(code)}; {what}")
            if code != 0:
                self._report_error(task, always=False)
        for task in self.tasks:
            if task.restart_at is not None and now >= task.restart_at:
                task.restart_at = None
                task.start()
                _log(f"{task.label} restarted: pid {task.process.pid}")
                self.write_state()
        return None

    def _sync_step(self):
        """sync mode: every worker must succeed; a failure stops or restarts all."""
        failed = [t for t in self.tasks if t.poll() not in (None, 0)]
        if not failed:
            return self._all_done()
        # A death by signal is the likelier cause when several failed at once
        # (the others lost their peer).
        failed = min(failed, key=lambda t: (t.poll() >= 0, self.tasks.index(t)))
        code, allowed = failed.poll(), self.args.restart_job or 0
        meaning = {EXIT_CONFIG: "a bad configuration or TF_CONFIG",
                   EXIT_CLUSTER: "a lost cluster"}.get(code)  # fmt: skip
        if meaning:
            why = f"status {code} means {meaning}: never restarted"
        elif self.job_restarts < allowed:
            why = None
        else:
            why = f"all {allowed} restarts of --restart-job used" if allowed else (
                "no --restart-job")  # fmt: skip
        how = f"{failed.label} exited with {_describe_exit(code)}"
        if why:
            _log(f"{how}; stopping the job ({why})")
        else:
            restart = f"restart {self.job_restarts + 1} of {allowed}"
            _log(f"{how}; restarting the whole job ({restart})")
        failed.finish_echo()  # its last lines in the log before they are read
        self._report_error(failed, always=True)
        grace = PEER_GRACE if self.args.peer_grace is None else self.args.peer_grace
        exited = self._wait_for_exit(grace)
        if not exited and self.stop_signal is None and time.monotonic() < self.deadline:
            _log(f"the other workers still run {grace:g}s later (--peer-grace); "
                 "stopping them")  # fmt: skip
        stop_all(self.tasks)
        if why:
            _log(f"exiting with status {_exit_status(code)}")
            return _exit_status(code)
        return self._wait(self.args.restart_delay) or self._restart_job()

    def _all_done(self):
        """0 when every worker succeeded; else one line per worker done while
        others still run (they may hang), and None."""
        if all(t.poll() == 0 for t in self.tasks):
            for task in self.tasks:
                task.finish_echo()
            _log(f"all {len(self.tasks)} workers exited with status 0")
            return 0
        limit = self.args.timeout
        until = f"--timeout {limit:g}s" if limit else "no --timeout"
        for task in self.tasks:
            if task.poll() == 0 and not task.reported_exit:
                task.reported_exit = True
                _log(f"{task.label} exited with status 0; waiting for the other "
                     f"workers ({until})")  # fmt: skip
        return None

    def _wait_for_exit(self, seconds):
        """Waits up to `seconds` for every task to exit (a signal or `--timeout`
        cuts it short, as in `_wait`); whether every task has exited."""
        end = min(time.monotonic() + seconds, self.deadline)
        while self.stop_signal is None and time.monotonic() < end:
            if all(task.poll() is not None for task in self.tasks):
                return True
            time.sleep(0.05)
        return all(task.poll() is not None for task in self.tasks)

    def _restart_job(self):
        """Starts every task again (a launcher-made cluster on new ports if one
        of its ports was taken meanwhile)."""
        self.job_restarts += 1
        taken = [t.config.address for t in self.tasks if _address_in_use(t.config)]
        if taken and not self.args.cluster:
            self.cluster = local_cluster(
                len(self.cluster["worker"]), 0, self.args.host, "sync"
            )
            for task in self.tasks:
                task.config = self._base().for_task(*task.key)
            _log(f"{', '.join(taken)} in use; new cluster: {json.dumps(self.cluster)}")
        _log(
            f"restart {self.job_restarts} of {self.args.restart_job}: starting "
            f"every worker again ({RESTART_ENV}={self.job_restarts})"
        )
        self._start_all()


def _address_in_use(config):
    """Whether a task's local port cannot be bound now (as gRPC binds it)."""
    if not tf_config_lib.is_local_address(config.address):
        return False
    host, port = tf_config_lib.split_address(config.address)
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with contextlib.suppress(OSError):
            sock.bind((bind_host(host), port))
            return False
    return True


if __name__ == "__main__":
    sys.exit(main())
