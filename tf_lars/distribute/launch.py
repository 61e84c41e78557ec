"""Start a cluster of local processes: parameter servers or synchronous workers.

Usage (`--help` says what each option does):

    python -m tf_lars.distribute.launch --workers 2 --ps 1 -- \\
        examples/agn_digits.py --steps-per-worker 300
    python -m tf_lars.distribute.launch --mode sync --workers 2 \\
        --restart-job 3 -- my_train.py --epochs 10

One process per task, each with its own `TF_CONFIG` and `TF_LARS_RESTART`
(whole-job restarts so far); each task's output goes to its log file
(`tf_lars.distribute.logs`), one task's stdout is echoed here, the last
lines of a failed task's log are shown, and the state of the
cluster is kept in `<log-dir>/cluster.json`. Ctrl-C (or SIGTERM) stops every
task. The guides say more: docs/guides/parameter-servers.md (`--mode ps`)
and docs/guides/multi-worker.md (`--mode sync`, exit statuses, security).

Security: TensorFlow's gRPC servers have no authentication and listen on
every interface whatever host the cluster spec names; local clusters run in
a loopback-only network namespace where Linux allows it (`--network`).
"""

import argparse
import contextlib
import ctypes
import ctypes.util
import fcntl
import json
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

from tf_lars.distribute import logs
from tf_lars.distribute import tf_config as tf_config_lib
from tf_lars.distribute.cluster import bind_host, local_cluster
from tf_lars.distribute.run import EXIT_CLUSTER, EXIT_CONFIG

#: Environment variable each task gets: whole-job restarts so far (sync mode).
RESTART_ENV = "TF_LARS_RESTART"

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_IFREQ = "16sh22x"


class NamespaceSetupError(OSError):
    """The namespace was entered but could not be set up; no way back."""


def _log(message):
    logs.write_lines([f"[launch] {message}"])


# ------------------------------------------------------------------- network
def enter_private_network():
    """Moves this process into a new network namespace with loopback only.

    Children inherit it: they can talk to each other on 127.0.0.1 and nothing
    outside can connect to them. Unprivileged users get a user namespace
    mapping their own uid (Linux with unprivileged user namespaces).

    Raises:
        OSError: when the kernel (or the platform) does not allow it; this
            process is unchanged.
        NamespaceSetupError: the namespaces exist but could not be set up
            (uid map, loopback); this process cannot use the network.
    """
    if not sys.platform.startswith("linux"):
        raise OSError("network namespaces exist only on Linux")
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    flags = _CLONE_NEWNET if uid == 0 else _CLONE_NEWNET | _CLONE_NEWUSER
    if libc.unshare(flags) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"unshare failed: {os.strerror(errno)}")
    try:
        if flags & _CLONE_NEWUSER:
            for path, text in (
                ("/proc/self/setgroups", "deny"),
                ("/proc/self/uid_map", f"{uid} {uid} 1"),
                ("/proc/self/gid_map", f"{gid} {gid} 1"),
            ):
                with open(path, "w") as handle:
                    handle.write(text)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            request = struct.pack(_IFREQ, b"lo", 0)
            reply = fcntl.ioctl(sock, _SIOCGIFFLAGS, request)
            flags_now = struct.unpack(_IFREQ, reply)[1]
            up = struct.pack(_IFREQ, b"lo", flags_now | _IFF_UP)
            fcntl.ioctl(sock, _SIOCSIFFLAGS, up)
    except OSError as error:
        raise NamespaceSetupError(
            error.errno, f"setting up the private network failed: {error}"
        ) from error


# --------------------------------------------------------------------- tasks
class Task:
    """One task process."""

    def __init__(self, config, command, log_path, environ):
        self.config = config
        self.command = command
        self.log_path = log_path
        self.environ = environ
        self.process = None
        self.restarts = 0
        self.reported_exit = False
        self.echo = False
        self._log_offset = 0
        self._tee = None
        # The process group (= session) id of the latest run, while it may
        # have members; each task runs in a session of its own.
        self._group = None

    @property
    def label(self):
        return f"{self.config.task_type} {self.config.task_index}"

    @property
    def key(self):
        return (self.config.task_type, self.config.task_index)

    def start(self, echo=False, job_restarts=0):
        # What the previous run left behind in its group goes first.
        self.signal(signal.SIGKILL)
        env = dict(self.environ)
        env["TF_CONFIG"] = self.config.to_json()
        env[RESTART_ENV] = str(job_restarts)
        with contextlib.suppress(OSError):
            self._log_offset = os.path.getsize(self.log_path)
        log = open(self.log_path, "ab", buffering=0)  # noqa: SIM115 - closed by tee/exit
        if self._log_offset:
            log.write(
                f"[launch] ---- {self.label} started again: restart {self.restarts}, "
                f"{RESTART_ENV}={job_restarts} ----\n".encode()
            )
        self.echo = echo
        self.process = subprocess.Popen(
            self.command,
            env=env,
            stdin=subprocess.DEVNULL,
            # The echoed task's stdout is copied to the terminal; stderr
            # (TensorFlow's and absl's logging) goes to the log only.
            stdout=subprocess.PIPE if echo else log,
            stderr=log if echo else subprocess.STDOUT,
            start_new_session=True,
        )
        self._group = self.process.pid
        if echo:
            self._tee = threading.Thread(
                target=logs.tee_stdout,
                args=(self.process.stdout, log),
                daemon=True,
            )
            self._tee.start()
        else:
            log.close()
        self.reported_exit = False
        return self.process

    def poll(self):
        return None if self.process is None else self.process.poll()

    def signal(self, signum):
        """Signals the task's whole process group (its session).

        Also after the task's main process exited: the children it started
        are still in the group and must not outlive the launcher.

        Returns:
            Whether the group may still have members.
        """
        if self._group is None:
            return False
        try:
            os.killpg(self._group, signum)
        except ProcessLookupError:
            # The group is empty: forget its id before the kernel reuses it.
            self._group = None
        except PermissionError:
            pass
        return self._group is not None

    def finish_echo(self, timeout=5.0):
        if self._tee is not None:
            self._tee.join(timeout)

    def log_tail(self):
        """The last lines of this task's latest run in its log (a list)."""
        return logs.log_tail(self.log_path, self._log_offset)


def _describe_exit(code):
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


def _exit_status(code):
    """The launcher's exit status for a task's return code (128 + signal)."""
    return code if code >= 0 else 128 - code


_PROGRAM_HELP = (
    "give the training program after `--`: a script path or `-m module`, "
    "then its arguments, e.g. `-- examples/agn_digits.py --steps-per-worker 300`"
)


def _program_command(program, python):
    """The command of each task: `python script args` or `python -m module args`.

    Returns None when `program` names no program (a usage error).
    """
    if not program or program == ["-m"]:
        return None
    head, *rest = program
    if head == "-m":
        return [python, "-m", *rest]
    if head.endswith(".py") or os.sep in head or os.path.isfile(head):
        return [python, head, *rest]
    return [python, "-m", head, *rest]


def _address_in_use(address):
    """Whether a local address's port cannot be bound now (as gRPC binds it)."""
    host, port = tf_config_lib.split_address(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((bind_host(host), port))
        except OSError:
            return True
    return False


def _parse_task_list(text, cluster):
    if text is None:
        return [
            (t, i)
            for t in ("ps", "worker", "chief")
            if t in cluster
            for i in range(len(cluster[t]))
        ]
    tasks = []
    for item in text.split(","):
        item = item.strip()
        task_type, _, index = item.partition(":")
        if index and not (index.isascii() and index.isdigit()):
            raise tf_config_lib.TFConfigError(
                f"`--tasks` names {item!r}: the index after ':' must be a "
                "non-negative int, e.g. 'worker:0'."
            )
        digits = index.lstrip("0") or "0"
        # No cluster has 10**18 tasks, and int() refuses over 4,300 digits.
        index = int(digits) if len(digits) <= 18 else -1
        if task_type not in cluster or not 0 <= index < len(cluster[task_type]):
            raise tf_config_lib.TFConfigError(
                f"`--tasks` names {item!r}, which is not a task of the cluster."
            )
        tasks.append((task_type, index))
    return tasks


def _int_at_least(lowest):
    """An argparse type: an int >= `lowest`, with a one-line error otherwise."""

    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < lowest:
            raise argparse.ArgumentTypeError(
                f"must be an int >= {lowest}. Received: {text!r}"
            )
        return value

    return parse


def _non_negative_float(text):
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(
            f"must be a finite number >= 0. Received: {text!r}"
        )
    return value


def _positive_float(text):
    value = _non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(
            f"must be a finite number > 0. Received: {text!r}"
        )
    return value


#: Exit status when `--timeout` ends the job (the status of coreutils' timeout).
EXIT_TIMEOUT = 124

#: Local tasks the launcher starts per CPU at most (`max_local_tasks`).
TASKS_PER_CPU = 4


def max_local_tasks():
    """The most tasks one launcher starts: `TASKS_PER_CPU` per usable CPU.

    Each task is a TensorFlow process (hundreds of MB, dozens of threads),
    and MultiWorkerMirroredStrategy's collectives time out when far more
    workers than cores share a machine, so a larger count is refused up
    front instead of starting processes that cannot make progress.

    Returns:
        int, `TASKS_PER_CPU` times the CPUs this process may run on
        (`os.sched_getaffinity`, else `os.cpu_count()`).
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return TASKS_PER_CPU * max(1, cpus)


def _task_count_error(count, received):
    """The one-line usage error for too many local tasks, or None."""
    limit = max_local_tasks()
    if count <= limit:
        return None
    return (
        f"the launcher starts at most {TASKS_PER_CPU} tasks per CPU here "
        f"({limit}); this cluster has {count} tasks to start. Received: {received}"
    )


class _ArgumentParser(argparse.ArgumentParser):
    """Usage errors as one line (`error: ...`) and exit status 2."""

    def error(self, message):
        self.exit(2, f"error: {message}\n")


_DESCRIPTION = """\
Start a TensorFlow cluster as local processes, each with its own TF_CONFIG,
and run the training program on every task.

  --mode ps (default)  ParameterServerStrategy: 1 chief, --workers workers,
                       --ps parameter servers. The chief's output is shown;
                       the launcher exits with the chief's status.
  --mode sync          MultiWorkerMirroredStrategy: --workers workers only
                       (worker 0 is the chief). Worker 0's output is shown.
                       The job succeeds when every worker exits with status
                       0; when one fails, the others are stopped and, with
                       --restart-job N, every worker starts again (up to N
                       times; statuses 2 and 3 are never restarted).
                       Otherwise the launcher exits with the failed worker's
                       status (128 + signal number for a signal).

Each task's full output is in <log-dir>/<type>-<index>.log; the terminal
shows the program's own lines, with TensorFlow's logging reduced to a note.
Each task gets TF_LARS_RESTART=<whole-job restarts so far> (0 at first).
With --timeout SECONDS, a job still running after that long (restarts
included) has every task stopped and exits with status 124.

One launcher starts at most 4 tasks per CPU it may use (chief and ps
included; with --cluster, the tasks --tasks names). Usage errors (bad flags,
no program, too many tasks, a bad --cluster) print one line and exit with
status 2 before anything starts."""

_EPILOG = """\
Everything after `--` is the training program and its arguments: a script
path, `-m module`, or a module name. Examples:

  python -m tf_lars.distribute.launch --workers 2 --ps 1 -- \\
      examples/agn_digits.py --steps-per-worker 300
  python -m tf_lars.distribute.launch --mode sync --workers 2 \\
      --restart-job 1 --log-dir logs -- my_train.py"""


# (flags, add_argument keywords): the launcher's options, in --help order.
_OPTIONS = (
    (
        ("--mode",),
        dict(
            choices=("ps", "sync"),
            default="ps",
            help="ps: parameter-server training (default); sync: synchronous "
            "MultiWorkerMirroredStrategy training",
        ),
    ),
    (
        ("--workers",),
        dict(
            type=_int_at_least(1),
            default=2,
            help=f"worker tasks (default 2); at most {TASKS_PER_CPU} tasks per "
            "CPU in all (chief and ps included)",
        ),
    ),
    (
        ("--ps",),
        dict(
            type=_int_at_least(1),
            help="parameter-server tasks (ps mode only; default 1)",
        ),
    ),
    (
        ("--host",),
        dict(
            default="localhost",
            help="host name used in the cluster addresses (default localhost)",
        ),
    ),
    (
        ("--cluster",),
        dict(help="a cluster as JSON (or @file.json) instead of --workers/--ps/--host"),
    ),
    (
        ("--tasks",),
        dict(
            help="comma-separated tasks to start here, e.g. 'worker:0,ps:0' "
            "(default all)"
        ),
    ),
    (("--log-dir",), dict(help="directory for task logs (default: a new temp dir)")),
    (
        ("--network",),
        dict(
            choices=("auto", "private", "host"),
            default="auto",
            help="private: run in a loopback-only network namespace; host: the "
            "machine's network; auto (default): private when every address is "
            "local and the kernel allows it",
        ),
    ),
    (
        ("--restart-workers",),
        dict(
            action="store_true",
            help="ps mode: restart a worker process that dies while the chief runs",
        ),
    ),
    (
        ("--restart-job",),
        dict(
            type=_int_at_least(0),
            metavar="N",
            help="sync mode: when a worker fails, restart every worker, at most N "
            "times (default 0)",
        ),
    ),
    (
        ("--restart-delay",),
        dict(
            type=_non_negative_float,
            default=1.0,
            help="seconds before a restart (default 1)",
        ),
    ),
    (
        ("--timeout",),
        dict(
            type=_positive_float,
            metavar="SECONDS",
            help="stop every task and exit with status 124 when the job, "
            "restarts included, runs longer than this (default: no limit)",
        ),
    ),
    (("--python",), dict(default=sys.executable, help="Python interpreter")),
)


def build_parser():
    parser = _ArgumentParser(
        prog="python -m tf_lars.distribute.launch",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for flags, keywords in _OPTIONS:
        parser.add_argument(*flags, **keywords)
    return parser


def _split_argv(argv):
    if "--" in argv:
        index = argv.index("--")
        return argv[:index], argv[index + 1 :]
    return argv, []


def _mode_error(args):
    """The one-line usage error for flags of the other mode, or None."""
    if args.mode == "sync":
        if args.ps is not None:
            return (
                "`--ps` starts parameter servers, which --mode sync does not use "
                "(MultiWorkerMirroredStrategy runs workers only). Received: "
                f"--mode sync --ps {args.ps}"
            )
        if args.restart_workers:
            return (
                "`--restart-workers` restarts one parameter-server worker; "
                "--mode sync restarts the whole job: use --restart-job N. "
                "Received: --mode sync --restart-workers"
            )
    elif args.restart_job is not None:
        return (
            "`--restart-job` restarts a synchronous job (--mode sync); in ps "
            "mode use --restart-workers. Received: "
            f"--mode ps --restart-job {args.restart_job}"
        )
    return None


def _usage_error(message):
    print(f"error: {message}", file=sys.stderr, flush=True)
    return 2


#: The largest `--cluster @file` read: a cluster of thousands of tasks is far
#: smaller, and `@/dev/zero` must not read until memory runs out.
MAX_CLUSTER_FILE_BYTES = 1 << 20


def _read_cluster(text, mode):
    if text.startswith("@"):
        path = text[1:]
        with open(path, "rb") as handle:
            data = handle.read(MAX_CLUSTER_FILE_BYTES + 1)
        if len(data) > MAX_CLUSTER_FILE_BYTES:
            raise tf_config_lib.TFConfigError(
                f"`--cluster @{path}` is larger than {MAX_CLUSTER_FILE_BYTES} "
                "bytes; a cluster file is a small JSON object."
            )
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise tf_config_lib.TFConfigError(
                f"`--cluster @{path}` is not UTF-8 text (a JSON file was expected)."
            ) from None
    try:
        cluster = tf_config_lib.load_json(text)
    except tf_config_lib.TFConfigError as error:
        raise tf_config_lib.TFConfigError(f"`--cluster` is {error}.") from None
    return tf_config_lib.validate_cluster(cluster, mode=mode)


def _path_error(args):
    """The one-line usage error for `--python` or `--log-dir`, or None."""
    if not args.python or shutil.which(args.python) is None:
        return (
            "`--python` must be an executable Python interpreter. "
            f"Received: --python {args.python!r}"
        )
    if (
        args.log_dir
        and os.path.exists(args.log_dir)
        and not os.path.isdir(args.log_dir)
    ):
        return (
            "`--log-dir` must be a directory (it is created if missing). "
            f"Received: --log-dir {args.log_dir!r}"
        )
    return None


def _check_host(host):
    try:
        tf_config_lib.split_address(f"{host}:1")
    except tf_config_lib.TFConfigError:
        raise tf_config_lib.TFConfigError(
            f"`--host` must be a host name or IP address. Received: --host {host!r}"
        ) from None


class _UsageError(Exception):
    """A usage error: one line on stderr, exit status 2, nothing started."""


def _check_args(args, program):
    """The task command and the `--cluster` (or None), or a `_UsageError`."""
    command = _program_command(program, args.python)
    if command is None:
        raise _UsageError(_PROGRAM_HELP)
    message = _mode_error(args) or _path_error(args)
    if message:
        raise _UsageError(message)
    try:
        if not args.cluster:
            _check_host(args.host)
        cluster = _read_cluster(args.cluster, args.mode) if args.cluster else None
        if cluster is None:
            count = args.workers + (0 if args.mode == "sync" else 1 + (args.ps or 1))
            received = f"--mode {args.mode} --workers {args.workers}"
            received += f" --ps {args.ps}" if args.ps else ""
        else:
            count = len(_parse_task_list(args.tasks, cluster))
            received = f"--cluster with {count} tasks to start here"
    except (tf_config_lib.TFConfigError, OSError) as error:
        raise _UsageError(str(error)) from None
    message = _task_count_error(count, received)
    if message:
        raise _UsageError(message)
    return command, cluster


def _enter_network(args, cluster):
    """Enters the private network when asked and possible: "private" or "host"."""
    local = (
        all(tf_config_lib.is_local_address(a) for v in cluster.values() for a in v)
        if cluster
        else tf_config_lib.is_local_address(f"{args.host}:1")
    )
    network = "host"
    if args.network in ("auto", "private") and local:
        try:
            enter_private_network()
            network = "private"
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
    elif args.network == "private":
        raise _UsageError("--network private needs every cluster address to be local")
    if network == "host":
        _log(
            "WARNING: TensorFlow's gRPC servers have no authentication and listen "
            "on all interfaces; keep these ports unreachable from untrusted hosts."
        )
    return network


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    own, program = _split_argv(argv)
    args = build_parser().parse_args(own)
    try:
        command, cluster = _check_args(args, program)
        network = _enter_network(args, cluster)
    except _UsageError as error:
        return _usage_error(error)

    generated = cluster is None
    try:
        if generated:
            num_ps = 0 if args.mode == "sync" else (args.ps or 1)
            cluster = local_cluster(args.workers, num_ps, args.host, args.mode)
        wanted = _parse_task_list(args.tasks, cluster)
    except (tf_config_lib.TFConfigError, OSError) as error:
        return _usage_error(error)

    environ = logs.task_environment()
    try:
        log_dir = args.log_dir or tempfile.mkdtemp(prefix="tf_lars_launch_")
        os.makedirs(log_dir, exist_ok=True)
        launch = _Launch(args, cluster, generated, network, command, log_dir, environ)
        launch.add_tasks(wanted)
    except OSError as error:
        return _usage_error(f"`--log-dir`: {error}")

    def on_signal(signum, frame):
        del frame
        launch.stop_signal = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        return launch.run()
    finally:
        stop_all(launch.tasks)
        for task in launch.tasks:
            task.finish_echo()
        launch.write_state()


class _Launch:
    """The launcher's state: the cluster, its tasks, and the run loops."""

    def __init__(self, args, cluster, generated, network, command, log_dir, environ):
        self.args = args
        self.mode = args.mode
        self.cluster = cluster
        self.generated = generated
        self.network = network
        self.command = command
        self.log_dir = log_dir
        self.environ = environ
        self.tasks = []
        self.job_restarts = 0
        self.stop_signal = None
        self.deadline = None
        self.echoed = None
        self.state_path = os.path.join(log_dir, "cluster.json")

    def _base(self):
        if self.mode == "sync":
            return tf_config_lib.TFConfig(self.cluster, "worker", 0, mode="sync")
        return tf_config_lib.TFConfig(self.cluster, "chief", 0)

    def add_tasks(self, wanted):
        base = self._base()
        for task_type, index in wanted:
            log_path = logs.task_log_path(self.log_dir, task_type, index)
            open(log_path, "wb").close()  # noqa: SIM115 - emptied, not kept open
            config = base.for_task(task_type, index)
            self.tasks.append(Task(config, self.command, log_path, self.environ))
        # The task whose output is shown: the chief, else worker 0 (sync).
        shown = ("chief", 0) if "chief" in self.cluster else ("worker", 0)
        self.echoed = next((t for t in self.tasks if t.key == shown), None)

    def write_state(self):
        state = {
            "mode": self.mode,
            "cluster": self.cluster,
            "network": self.network,
            "command": self.command,
            "launcher_pid": os.getpid(),
            "job_restarts": self.job_restarts,
            "tasks": [
                {
                    "type": t.config.task_type,
                    "index": t.config.task_index,
                    "address": t.config.address,
                    "pid": t.process.pid if t.process else None,
                    "log": t.log_path,
                    "restarts": t.restarts,
                }
                for t in self.tasks
            ],
        }
        tmp = self.state_path + ".tmp"
        with open(tmp, "w") as handle:
            json.dump(state, handle, indent=2)
        os.replace(tmp, self.state_path)

    def _start_all(self):
        echoed = self.echoed
        for task in self.tasks:
            task.start(echo=task is echoed, job_restarts=self.job_restarts)
            _log(
                f"{task.label:<9} {task.config.address:<22} pid "
                f"{task.process.pid:<7} log {task.log_path}"
            )
        self.write_state()

    def _stop_status(self):
        """The exit status when a signal or `--timeout` ends the job, or None."""
        if self.stop_signal is not None:
            _log(f"got {signal.Signals(self.stop_signal).name}; stopping all tasks")
            return 128 + self.stop_signal
        if self.deadline is None or time.monotonic() < self.deadline:
            return None
        running = [t.label for t in self.tasks if t.poll() is None]
        _log(
            f"--timeout {self.args.timeout:g}s reached with "
            f"{', '.join(running) or 'no task'} still running; stopping all "
            f"tasks, exit status {EXIT_TIMEOUT}"
        )
        return EXIT_TIMEOUT

    def _report_error(self, task, always):
        """The last lines of a failed task's log (its stderr included)."""
        lines = task.log_tail()
        if lines:
            _log(f"the last {len(lines)} lines of {task.log_path}:")
            logs.write_lines([f"    {line}" for line in lines])
        elif always:
            _log(f"{task.label} printed nothing (its log: {task.log_path})")

    def run(self):
        _log(f"network: {self.network}; cluster: {json.dumps(self.cluster)}")
        if self.args.timeout is not None:
            self.deadline = time.monotonic() + self.args.timeout
        self._start_all()
        if self.mode == "sync":
            return self._run_sync()
        return self._run_ps()

    # ---------------------------------------------------------------- ps mode
    def _run_ps(self):
        args = self.args
        chief = self.echoed
        pending_restarts = {}
        while True:
            code = self._stop_status()
            if code is not None:
                return code
            if chief is not None and chief.poll() is not None:
                code = chief.poll()
                chief.finish_echo()
                how = _describe_exit(code)
                _log(f"chief exited with {how}; stopping the other tasks")
                if code != 0:
                    self._report_error(chief, always=True)
                return _exit_status(code)
            if chief is None and all(t.poll() is not None for t in self.tasks):
                return 0
            now = time.monotonic()
            for task in self.tasks:
                if task is chief or task.poll() is None or task.reported_exit:
                    continue
                task.reported_exit = True
                how = _describe_exit(task.poll())
                if task.config.task_type == "worker" and args.restart_workers:
                    delay = args.restart_delay
                    _log(f"{task.label} exited with {how}; restarting in {delay:g}s")
                    pending_restarts[task] = now + args.restart_delay
                elif task.config.task_type == "worker":
                    _log(f"{task.label} exited with {how}; not restarted")
                else:
                    _log(
                        f"{task.label} exited with {how}; a parameter server holds "
                        "the model, the chief will stop"
                    )
                if task.poll() != 0:
                    self._report_error(task, always=False)
            for task, due in list(pending_restarts.items()):
                if now >= due:
                    del pending_restarts[task]
                    task.restarts += 1
                    task.start()
                    _log(f"{task.label} restarted: pid {task.process.pid}")
                    self.write_state()
            time.sleep(0.1)

    # -------------------------------------------------------------- sync mode
    def _failed_task(self):
        """The task that failed, or None; a death by signal is the likelier
        cause when several are found at once (the others lost their peer)."""
        failed = [t for t in self.tasks if t.poll() not in (None, 0)]
        if not failed:
            return None
        return min(failed, key=lambda t: (t.poll() >= 0, self.tasks.index(t)))

    def _run_sync(self):
        allowed = self.args.restart_job or 0
        while True:
            code = self._stop_status()
            if code is not None:
                return code
            failed = self._failed_task()
            if failed is None:
                if all(t.poll() == 0 for t in self.tasks):
                    for task in self.tasks:
                        task.finish_echo()
                    _log(f"all {len(self.tasks)} workers exited with status 0")
                    return 0
                self._report_early_exits()
                time.sleep(0.1)
                continue
            code = failed.poll()
            how = _describe_exit(code)
            if code in (EXIT_CONFIG, EXIT_CLUSTER):
                meaning = {
                    EXIT_CONFIG: "a bad configuration or TF_CONFIG",
                    EXIT_CLUSTER: "a lost cluster",
                }[code]
                why = f"status {code} means {meaning}: never restarted"
            elif self.job_restarts >= allowed:
                why = (
                    f"all {allowed} restarts of --restart-job used"
                    if allowed
                    else "no --restart-job"
                )
            else:
                why = None
            if why is None:
                _log(
                    f"{failed.label} exited with {how}; restarting the whole job "
                    f"(restart {self.job_restarts + 1} of {allowed})"
                )
            else:
                _log(f"{failed.label} exited with {how}; stopping the job ({why})")
            failed.finish_echo()  # its last lines in the log before they are read
            self._report_error(failed, always=True)
            stop_all(self.tasks)
            for task in self.tasks:
                task.finish_echo()
            if why is not None:
                status = _exit_status(code)
                _log(f"exiting with status {status}")
                return status
            code = self._restart_job()
            if code is not None:
                return code

    def _report_early_exits(self):
        """One line per worker done while others still run (they may hang)."""
        for task in self.tasks:
            if task.poll() == 0 and not task.reported_exit:
                task.reported_exit = True
                limit = self.args.timeout
                until = f"--timeout {limit:g}s" if limit else "no --timeout"
                _log(
                    f"{task.label} exited with status 0; waiting for the other "
                    f"workers ({until})"
                )

    def _restart_job(self):
        """Waits `--restart-delay`, then starts every task again.

        Returns:
            None, or the exit status when a signal came meanwhile.
        """
        deadline = time.monotonic() + self.args.restart_delay
        while time.monotonic() < deadline:
            code = self._stop_status()
            if code is not None:
                return code
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        self.job_restarts += 1
        taken = [
            t.config.address
            for t in self.tasks
            if tf_config_lib.is_local_address(t.config.address)
            and _address_in_use(t.config.address)
        ]
        if taken and self.generated:
            # Something else took a port meanwhile: move the whole cluster.
            self.cluster = local_cluster(
                len(self.cluster["worker"]), 0, self.args.host, "sync"
            )
            base = self._base()
            for task in self.tasks:
                task.config = base.for_task(
                    task.config.task_type, task.config.task_index
                )
            _log(f"{', '.join(taken)} in use; new cluster: {json.dumps(self.cluster)}")
        for task in self.tasks:
            task.restarts += 1
        _log(
            f"restart {self.job_restarts} of {self.args.restart_job}: starting "
            f"every worker again ({RESTART_ENV}={self.job_restarts})"
        )
        self._start_all()
        return None


def stop_all(tasks, grace=5.0):
    """SIGTERM every task's process group, then SIGKILL what is left."""
    for task in tasks:
        task.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for task in tasks:
        if task.process is None:
            continue
        with contextlib.suppress(subprocess.TimeoutExpired):
            task.process.wait(max(0.0, deadline - time.monotonic()))
    for task in tasks:
        task.signal(signal.SIGKILL)
        if task.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                task.process.wait(5.0)
    # Signal 0 finds each emptied group gone, so its id is forgotten.
    deadline = time.monotonic() + 1.0
    while any(task.signal(0) for task in tasks) and time.monotonic() < deadline:
        time.sleep(0.02)


if __name__ == "__main__":
    sys.exit(main())
