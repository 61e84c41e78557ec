"""Start a parameter-server cluster as separate local processes.

Usage:

    python -m tf_lars.distribute.launch --workers 2 --ps 1 -- \\
        examples/agn_digits.py --steps-per-worker 300

Everything after `--` is the training program, followed by its arguments:
a script path (`examples/agn_digits.py`; anything that ends in `.py`, names
an existing file or contains a path separator), `-m some.module`, or a bare
module name (run with `python -m`). The launcher
starts one process per task (1 chief, `--workers` workers, `--ps` parameter
servers), each with its own `TF_CONFIG`, writes each task's output to
`<log-dir>/<type>-<index>.log` (the chief's is also echoed here), and prints
where. When the chief exits, the other tasks are stopped and the launcher
exits with the chief's status; Ctrl-C (or SIGTERM) stops every task.

Security: TensorFlow's gRPC servers have no authentication, and they listen
on every network interface whatever host the cluster spec names (TensorFlow
2.21 has no bind-address option). By default the cluster uses `localhost`
addresses and, on Linux, runs in a private network namespace that has only a
loopback interface, so no other machine can reach its ports
(`--network private`, the default when every address is local). Pass
`--network host` to opt out, or `--host`/`--cluster` to use other addresses;
then keep the machines on a private network or behind a firewall.

`--restart-workers` restarts a worker process that dies while the chief runs
(the coordinator re-dispatches its work and takes it back when it returns).
The state of the cluster (addresses, pids, logs) is kept in
`<log-dir>/cluster.json`.
"""

import argparse
import contextlib
import ctypes
import ctypes.util
import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

from tf_lars.distribute import tf_config as tf_config_lib

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_IFREQ = "16sh22x"


class NamespaceSetupError(OSError):
    """The namespace was entered but could not be set up; no way back."""


def _log(message):
    print(f"[launch] {message}", flush=True)


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
        self._tee = None

    @property
    def label(self):
        return f"{self.config.task_type} {self.config.task_index}"

    def start(self, echo=False):
        env = dict(self.environ)
        env["TF_CONFIG"] = self.config.to_json()
        log = open(self.log_path, "ab", buffering=0)  # noqa: SIM115 - closed by tee/exit
        if echo:
            self.process = subprocess.Popen(
                self.command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self._tee = threading.Thread(
                target=_tee, args=(self.process.stdout, log), daemon=True
            )
            self._tee.start()
        else:
            self.process = subprocess.Popen(
                self.command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            log.close()
        self.reported_exit = False
        return self.process

    def poll(self):
        return None if self.process is None else self.process.poll()

    def signal(self, signum):
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signum)

    def finish_echo(self, timeout=5.0):
        if self._tee is not None:
            self._tee.join(timeout)


def _tee(pipe, log):
    try:
        for line in iter(pipe.readline, b""):
            log.write(line)
            sys.stdout.buffer.write(line)
            sys.stdout.flush()
    finally:
        log.close()


def _describe_exit(code):
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


_PROGRAM_HELP = (
    "give the training program after `--`: a script path or `-m module`, "
    "then its arguments, e.g. `-- examples/agn_digits.py --steps-per-worker 300`"
)


def _program_command(program, python):
    """The command of each task: `python script args` or `python -m module args`."""
    if not program or program == ["-m"]:
        raise SystemExit(f"error: {_PROGRAM_HELP}")
    head, *rest = program
    if head == "-m":
        return [python, "-m", *rest]
    if head.endswith(".py") or os.sep in head or os.path.isfile(head):
        return [python, head, *rest]
    return [python, "-m", head, *rest]


def local_cluster(num_workers, num_ps, host="localhost"):
    """A cluster dict with free ports on `host` (1 chief, workers, ps)."""
    from tf_lars.distribute.cluster import pick_free_port

    bind_host = "127.0.0.1" if host == "localhost" else host
    ports = set()

    def address():
        while True:
            port = pick_free_port(bind_host)
            if port not in ports:
                ports.add(port)
                return f"{host}:{port}"

    return {
        "chief": [address()],
        "worker": [address() for _ in range(num_workers)],
        "ps": [address() for _ in range(num_ps)],
    }


def _parse_task_list(text, cluster):
    if text is None:
        return [
            (t, i) for t in ("ps", "worker", "chief") for i in range(len(cluster[t]))
        ]
    tasks = []
    for item in text.split(","):
        item = item.strip()
        task_type, _, index = item.partition(":")
        if index and not index.isdigit():
            raise tf_config_lib.TFConfigError(
                f"`--tasks` names {item!r}: the index after ':' must be a "
                "non-negative int, e.g. 'worker:0'."
            )
        index = int(index) if index else 0
        if task_type not in cluster or not 0 <= index < len(cluster[task_type]):
            raise tf_config_lib.TFConfigError(
                f"`--tasks` names {item!r}, which is not a task of the cluster."
            )
        tasks.append((task_type, index))
    return tasks


def _positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m tf_lars.distribute.launch",
        description=(
            "Start a ParameterServerStrategy cluster (1 chief, N workers, M "
            "parameter servers) as local processes, each with its own TF_CONFIG."
        ),
        epilog=(
            "Everything after `--` is the training program and its arguments: a "
            "script path, `-m module`, or a module name."
        ),
    )
    parser.add_argument(
        "--workers", type=_positive, default=2, help="worker tasks (default 2)"
    )
    parser.add_argument(
        "--ps", type=_positive, default=1, help="parameter-server tasks (default 1)"
    )
    parser.add_argument(
        "--host",
        default="localhost",
        help="host name used in the cluster addresses (default localhost)",
    )
    parser.add_argument(
        "--cluster",
        help="a cluster as JSON (or @file.json) instead of --workers/--ps/--host",
    )
    parser.add_argument(
        "--tasks",
        help="comma-separated tasks to start here, e.g. 'worker:0,ps:0' (default all)",
    )
    parser.add_argument(
        "--log-dir", help="directory for task logs (default: a new temp dir)"
    )
    parser.add_argument(
        "--network",
        choices=("auto", "private", "host"),
        default="auto",
        help=(
            "private: run in a loopback-only network namespace; host: the "
            "machine's network; auto (default): private when every address is "
            "local and the kernel allows it"
        ),
    )
    parser.add_argument(
        "--restart-workers",
        action="store_true",
        help="restart a worker process that dies while the chief runs",
    )
    parser.add_argument(
        "--restart-delay", type=float, default=1.0, help="seconds before a restart"
    )
    parser.add_argument("--python", default=sys.executable, help="Python interpreter")
    return parser


def _split_argv(argv):
    if "--" in argv:
        index = argv.index("--")
        return argv[:index], argv[index + 1 :]
    return argv, []


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    own, program = _split_argv(argv)
    args = build_parser().parse_args(own)
    command = _program_command(program, args.python)

    try:
        if args.cluster:
            text = args.cluster
            if text.startswith("@"):
                with open(text[1:]) as handle:
                    text = handle.read()
            try:
                cluster = json.loads(text)
            except json.JSONDecodeError as error:
                raise tf_config_lib.TFConfigError(
                    f"`--cluster` is not valid JSON ({error})."
                ) from None
            cluster = tf_config_lib.validate_cluster(cluster)
        else:
            cluster = None
    except (tf_config_lib.TFConfigError, OSError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2

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
                print(
                    f"error: --network {args.network}: {error} (pass --network "
                    "host to use the machine's network)",
                    file=sys.stderr,
                    flush=True,
                )
                return 2
            _log(
                f"WARNING: no private network namespace ({error}); TensorFlow's "
                "unauthenticated gRPC servers listen on all interfaces of this "
                "machine."
            )
    elif args.network == "private":
        print(
            "error: --network private needs every cluster address to be local",
            file=sys.stderr,
            flush=True,
        )
        return 2
    if network == "host":
        _log(
            "WARNING: TensorFlow's gRPC servers have no authentication and listen "
            "on all interfaces; keep these ports unreachable from untrusted hosts."
        )

    try:
        if cluster is None:
            cluster = local_cluster(args.workers, args.ps, args.host)
        base = tf_config_lib.TFConfig(cluster, "chief", 0)
        wanted = _parse_task_list(args.tasks, cluster)
    except (tf_config_lib.TFConfigError, OSError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2

    log_dir = args.log_dir or tempfile.mkdtemp(prefix="tf_lars_launch_")
    os.makedirs(log_dir, exist_ok=True)
    environ = dict(os.environ)
    environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    environ["PYTHONUNBUFFERED"] = "1"

    tasks = []
    for task_type, index in wanted:
        log_path = os.path.join(log_dir, f"{task_type}-{index}.log")
        with open(log_path, "wb"):
            pass
        tasks.append(Task(base.for_task(task_type, index), command, log_path, environ))
    chief = next((t for t in tasks if t.config.task_type == "chief"), None)
    state_path = os.path.join(log_dir, "cluster.json")

    def write_state():
        state = {
            "cluster": cluster,
            "network": network,
            "command": command,
            "launcher_pid": os.getpid(),
            "tasks": [
                {
                    "type": t.config.task_type,
                    "index": t.config.task_index,
                    "address": t.config.address,
                    "pid": t.process.pid if t.process else None,
                    "log": t.log_path,
                    "restarts": t.restarts,
                }
                for t in tasks
            ],
        }
        tmp = state_path + ".tmp"
        with open(tmp, "w") as handle:
            json.dump(state, handle, indent=2)
        os.replace(tmp, state_path)

    stopping = {"signal": None}

    def on_signal(signum, frame):
        del frame
        stopping["signal"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    _log(f"network: {network}; cluster: {json.dumps(cluster)}")
    for task in tasks:
        task.start(echo=task is chief)
        _log(
            f"{task.label:<9} {task.config.address:<22} pid {task.process.pid:<7} "
            f"log {task.log_path}"
        )
    write_state()

    exit_code = 0
    pending_restarts = {}
    try:
        while True:
            if stopping["signal"] is not None:
                _log(
                    f"got {signal.Signals(stopping['signal']).name}; stopping all tasks"
                )
                exit_code = 128 + stopping["signal"]
                break
            if chief is not None and chief.poll() is not None:
                code = chief.poll()
                chief.finish_echo()
                how = _describe_exit(code)
                _log(f"chief exited with {how}; stopping the other tasks")
                exit_code = code if code >= 0 else 128 - code
                break
            if chief is None and all(t.poll() is not None for t in tasks):
                break
            now = time.monotonic()
            for task in tasks:
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
            for task, due in list(pending_restarts.items()):
                if now >= due:
                    del pending_restarts[task]
                    task.restarts += 1
                    task.start()
                    _log(f"{task.label} restarted: pid {task.process.pid}")
                    write_state()
            time.sleep(0.1)
    finally:
        stop_all(tasks)
        write_state()
    return exit_code


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


if __name__ == "__main__":
    sys.exit(main())
