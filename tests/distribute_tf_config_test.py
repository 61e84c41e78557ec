"""Bad input, refused before any work: `TF_CONFIG` (parsing, `tf-lars train`,
a program's `run_main`) and the launcher's command line (in this process:
every usage error comes before a port is picked or a task started)."""

import json
import os
import subprocess
import sys
import time

import pytest

from tests.distribute_launch_helpers import EXAMPLE, REPO, launcher_env
from tf_lars.cli.main import main as cli_main
from tf_lars.distribute import launch
from tf_lars.distribute import tf_config as tf_config_lib
from tf_lars.distribute._process import die_with_parent
from tf_lars.distribute.tf_config import TFConfigError, parse_tf_config

CLUSTER = {
    "chief": ["localhost:2000"],
    "worker": ["localhost:2001", "localhost:2002"],
    "ps": ["localhost:2003"],
}


def _config(task_type="worker", index=1, cluster=None, **extra):
    return json.dumps(
        {
            "cluster": cluster or CLUSTER,
            "task": {"type": task_type, "index": index},
            **extra,
        }
    )


def test_parses_a_valid_config():
    config = parse_tf_config(_config())
    assert config.task_type == "worker"
    assert config.task_index == 1
    assert config.address == "localhost:2002"
    assert config.task_name == "/job:worker/replica:0/task:1"
    assert (config.num_workers, config.num_ps) == (2, 1)
    assert json.loads(config.to_json())["task"] == {"type": "worker", "index": 1}
    assert config.for_task("ps", 0).address == "localhost:2003"


def test_reads_the_environment_and_accepts_indexed_objects():
    cluster = dict(CLUSTER, worker={"1": "localhost:2002", "0": "localhost:2001"})
    config = parse_tf_config(environ={"TF_CONFIG": _config("ps", 0, cluster)})
    assert config.cluster["worker"] == ["localhost:2001", "localhost:2002"]
    assert config.address == "localhost:2003"


def _sync(workers=("localhost:2222", "localhost:2223"), task=None, **cluster):
    task = {"type": "worker", "index": 0} if task is None else task
    return json.dumps({"cluster": {"worker": list(workers), **cluster}, "task": task})


#: Refused by `parse_tf_config(text, mode=...)`: (text, mode, part of the
#: error). The sync ones also by `tf-lars train` (one line, below).
BAD_SYNC = [
    (_sync(["localhost:²", "localhost:2223"]),
     "Address 'localhost:²' must end with a port in 1..65535."),
    (_sync(["localhost:" + "1" * 5000, "localhost:2223"]),
     "must end with a port in 1..65535."),
    (_sync(task={"type": ["worker"], "index": 0}),
     "`task.type` must be a string, one of ['worker']. Received: type=['worker']"),
    (_sync().replace('"index": 0', '"index": ' + "9" * 4301),
     "`task.index` must be an int in [0, 2) for task type 'worker'. "
     "Received: index=<an integer of 4301 digits>"),
    ('{"cluster": ' * 100000, "TF_CONFIG is not valid JSON (nested too deeply)"),
]  # fmt: skip
REFUSED = [(text, "sync", message) for text, message in BAD_SYNC] + [
    (None, "ps", "TF_CONFIG is not set"),
    ("{cluster: }", "ps", "TF_CONFIG is not valid JSON"),
    ("[1, 2]", "ps", "TF_CONFIG must be a JSON object"),
    (json.dumps({"task": {"type": "chief"}}), "ps", "TF_CONFIG has no 'cluster'"),
    (_config(cluster=dict(CLUSTER, master=["localhost:2004"])), "ps",
     "Unknown task type(s) ['master'] in the cluster"),
    (_config("evaluator", 0), "ps",
     "names task type 'evaluator', which does not exist"),
    (_config("worker", 2), "ps", "`task.index` must be an int in [0, 2)"),
    (_config("worker", -1), "ps", "`task.index` must be an int in [0, 2)"),
    (_config("worker", True), "ps", "`task.index` must be an int"),
    (_config("worker", "0"), "ps", "`task.index` must be an int in [0, 2) for "
     "task type 'worker'. Received: index='0'"),
    (_config("worker", 0.0), "ps", "Received: index=0.0"),
    (json.dumps({"cluster": CLUSTER}), "ps", "must have a 'task' object"),
    (_sync(task={"type": "worker"}), "sync", "must have an 'index'"),
    (_config(cluster={k: v for k, v in CLUSTER.items() if k != "ps"}), "ps",
     "The cluster has no 'ps' task"),
    (_sync(ps=["localhost:2"]), "sync", "'ps' tasks, but synchronous"),
    (_config(cluster=dict(CLUSTER, chief=["localhost:2000", "localhost:2005"])),
     "ps", "exactly one 'chief'"),
    (_config(cluster=dict(CLUSTER, ps=["localhost"])), "ps",
     "must look like 'host:port'"),
    (_config(cluster=dict(CLUSTER, ps=["localhost:70000"])), "ps",
     "port in 1..65535"),
    (_config(cluster=dict(CLUSTER, ps=[])), "ps", "non-empty list"),
    (_config(cluster=dict(CLUSTER, ps=["localhost:2001"])), "ps",
     "used by both worker:0 and ps:0"),
    (_config(rpc_layer="grpc+verbs"), "ps", "`rpc_layer` must be 'grpc'"),
]  # fmt: skip


@pytest.mark.parametrize("text, mode, message", REFUSED)
def test_bad_tf_config_is_a_tf_config_error_naming_the_key(text, mode, message):
    with pytest.raises(TFConfigError) as info:
        parse_tf_config(environ={} if text is None else {"TF_CONFIG": text}, mode=mode)
    assert message in str(info.value) and len(str(info.value)) < 1000


@pytest.mark.parametrize(
    "first, second",
    [
        ("0.0.0.0:2002", "localhost:2002"),
        ("[::]:2002", "127.0.0.1:2002"),
        ("127.0.0.2:2002", "localhost:2002"),
        ("[::ffff:127.0.0.1]:2002", "[::1]:2002"),
        ("localhost:2002", "127.0.0.1:2002"),
        ("localhost:2002", "LOCALHOST:2002"),
        ("localhost:2002", "[::1]:2002"),
    ],
)
def test_addresses_of_this_machine_with_one_port_are_duplicates(first, second):
    # TensorFlow's server listens on [::]:port whatever the host: one socket.
    with pytest.raises(TFConfigError) as info:
        parse_tf_config(_sync([first, second]), mode="sync")
    assert str(info.value) == (
        f"Address {second!r} is used by both worker:0 and worker:1."
    )


@pytest.mark.parametrize(
    "workers",
    [
        ["10.0.0.1:2002", "10.0.0.2:2002"],
        ["0.0.0.0:2002", "10.0.0.2:2002"],
        ["localhost:2002", "localhost:2003"],
    ],
)
def test_sync_mode_takes_workers_on_other_hosts_or_ports(workers):
    config = parse_tf_config(_sync(workers), mode="sync")
    assert config.cluster == {"worker": workers}
    assert (config.task_type, config.task_index, config.num_workers) == ("worker", 0, 2)


@pytest.mark.parametrize("text, message", BAD_SYNC)
def test_bad_tf_config_is_one_line_on_the_command_line(
    text, message, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("TF_CONFIG", text)
    output = tmp_path / "out"
    code = cli_main(
        ["train", "--set", "distribute.strategy=multi_worker"]
        + ["--set", f"output_dir={output}"]
    )
    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("tf-lars train: error: "), captured.err
    assert message in captured.err
    assert not output.exists()


def test_local_addresses():
    assert tf_config_lib.is_local_address("localhost:1")
    assert tf_config_lib.is_local_address("127.0.0.2:1")
    assert tf_config_lib.is_local_address("[::1]:1")
    assert not tf_config_lib.is_local_address("10.0.0.5:1")
    assert not tf_config_lib.is_local_address("example.com:1")


def _run(args, tf_config=None, timeout=120):
    env = launcher_env()
    env.pop("TF_CONFIG", None)
    if tf_config is not None:
        env["TF_CONFIG"] = tf_config
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=True,
        preexec_fn=die_with_parent,
    )
    return proc, time.monotonic() - start


@pytest.mark.parametrize(
    "tf_config, message",
    [
        ('{"cluster": ', "error: TF_CONFIG is not valid JSON"),
        (_config("master", 0), "error: TF_CONFIG names task type 'master'"),
        (_config("worker", "0"), "error: `task.index` must be an int in [0, 2)"),
    ],
)
def test_entry_point_fails_before_any_work(tf_config, message, tmp_path):
    result = tmp_path / "result.json"
    proc, _ = _run(
        [EXAMPLE, "--result-json", str(result)],
        tf_config,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    # Nothing ran: no server line, no training line, no result.
    assert "serving on" not in proc.stdout
    assert "[agn]" not in proc.stdout
    assert not result.exists()


@pytest.mark.parametrize(
    "tf_config, status",
    [("{not json", 2), (_sync(ps=["localhost:2"]), 2), (_sync(task={}), 2)]
    + [(_sync(), 0)],
)
def test_run_main_ends_a_bad_tf_config_with_one_line_and_status_2(tf_config, status):
    script = os.path.join("tests", "distribute_multi_worker_script.py")
    proc, _ = _run([script, "run_main"], tf_config)
    assert proc.returncode == status, proc.stderr
    if status == 0:  # the program's own status, passed through
        assert proc.stdout == "started\n"
        return
    assert proc.stdout == ""
    # TensorFlow's own import-time lines (absl, oneDNN) may precede it; the
    # program's output is the one error line, no traceback.
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert proc.stderr.strip().splitlines()[-1] == lines[0]


# ------------------------------------------------------------------ launcher
_SYNC_PS = json.dumps({"worker": ["localhost:2001"], "ps": ["localhost:2002"]})
_LIMIT = launch.max_local_tasks()
_TWO = json.dumps({"worker": ["localhost:2001", "localhost:2002"]})
_PROGRAM_HELP = (
    "error: give the training program after `--`: a script path or `-m "
    "module`, then its arguments, e.g. `-- examples/agn_digits.py "
    "--steps-per-worker 300`"
)
#: (launcher options, program, the one line on stderr); `{tmp}` is the test's
#: folder, `--log-dir {tmp}/logs` comes first.
USAGE_ERRORS = [
    (["--mode", "sync", "--ps", "1"], [EXAMPLE],
     "error: `--ps` starts parameter servers, which --mode sync does not use "
     "(MultiWorkerMirroredStrategy runs workers only). Received: --mode sync --ps 1"),
    (["--mode", "sync", "--restart-workers"], [EXAMPLE],
     "error: `--restart-workers` restarts one parameter-server worker; --mode sync "
     "restarts the whole job: use --restart-job N. Received: --mode sync "
     "--restart-workers"),
    (["--restart-job", "1"], [EXAMPLE],
     "error: `--restart-job` restarts a synchronous job (--mode sync); in ps mode "
     "use --restart-workers. Received: --mode ps --restart-job 1"),
    (["--peer-grace", "1"], [EXAMPLE],
     "error: `--peer-grace` is how long a synchronous job's other workers get "
     "once one failed (--mode sync); in ps mode the chief carries on. Received: "
     "--mode ps --peer-grace 1"),
    (["--mode", "sync", "--peer-grace", "-1"], [EXAMPLE],
     "error: argument --peer-grace: must be a finite number >= 0. "
     "Received: '-1'"),
    (["--mode", "sync", "--cluster", _SYNC_PS], [EXAMPLE],
     "error: The cluster has 'ps' tasks, but synchronous multi-worker training "
     "(MultiWorkerMirroredStrategy) uses only 'worker' tasks (and at most one "
     "'chief'); remove 'ps' or use parameter-server training."),
    (["--cluster", json.dumps(dict(CLUSTER, evaluator=["localhost:2009"]))],
     [EXAMPLE], "error: Unknown task type(s) ['evaluator'] in the cluster: "
     "parameter-server training uses only ['chief', 'worker', 'ps']."),
    (["--cluster", json.dumps(CLUSTER), "--tasks", "worker:5"], [EXAMPLE],
     "error: `--tasks` names 'worker:5', which is not a task of the cluster."),
    (["--mode", "sync", "--cluster", '{"worker": ["localhost:²"]}'], [EXAMPLE],
     "error: Address 'localhost:²' must end with a port in 1..65535."),
    (["--mode", "sync", "--cluster", "@{tmp}/binary.json"], [EXAMPLE],
     "error: `--cluster @{tmp}/binary.json` is not UTF-8 text (a JSON file was "
     "expected)."),
    (["--mode", "sync", "--cluster", "@/dev/zero"], [EXAMPLE],
     "error: `--cluster @/dev/zero` is larger than 1048576 bytes; a cluster file "
     "is a small JSON object."),
    (["--mode", "sync", "--cluster", _TWO, "--tasks", "worker:²"], [EXAMPLE],
     "error: `--tasks` names 'worker:²': the index after ':' must be a "
     "non-negative int, e.g. 'worker:0'."),
    # Without --cluster the task list is read after the network is chosen.
    (["--mode", "sync", "--network", "host", "--tasks", "worker:x"], [EXAMPLE],
     "error: `--tasks` names 'worker:x': the index after ':' must be a "
     "non-negative int, e.g. 'worker:0'."),
    (["--log-dir", "{tmp}/a-file"], [EXAMPLE],
     "error: argument --log-dir: must be a directory (it is created if missing). "
     "Received: '{tmp}/a-file'"),
    (["--python", "/nonexistent"], [EXAMPLE], "error: argument --python: must be "
     "an executable Python interpreter. Received: '/nonexistent'"),
    (["--host", ""], [EXAMPLE],
     "error: argument --host: must be a host name or IP address. Received: ''"),
    (["--timeout", "0"], [EXAMPLE],
     "error: argument --timeout: must be a finite number > 0. Received: '0'"),
    (["--mode", "sync", "--workers", "0"], [EXAMPLE],
     "error: argument --workers: must be an int >= 1. Received: '0'"),
    (["--mode", "sync", "--workers", "abc"], [EXAMPLE],
     "error: argument --workers: must be an int >= 1. Received: 'abc'"),
    (["--ps", "0"], [EXAMPLE], "error: argument --ps: must be an int >= 1. "
     "Received: '0'"),
    (["--mode", "sync", "--restart-job", "-1"], [EXAMPLE],
     "error: argument --restart-job: must be an int >= 0. Received: '-1'"),
    (["--restart-delay", "nan"], [EXAMPLE],
     "error: argument --restart-delay: must be a finite number >= 0. "
     "Received: 'nan'"),
    (["--bogus"], [EXAMPLE], "error: unrecognized arguments: --bogus"),
    # One task more than the machine takes, refused before a port is picked.
    *[
        (args, [EXAMPLE], f"error: the launcher starts at most {launch.TASKS_PER_CPU} "
         f"tasks per CPU here ({_LIMIT}); this cluster has {tasks} tasks to start. "
         f"Received: {' '.join(received)}")
        for args, tasks, received in [
            (["--mode", "sync", "--workers", f"{_LIMIT + 1}"], _LIMIT + 1,
             ["--mode", "sync", "--workers", f"{_LIMIT + 1}"]),
            (["--workers", "100000"], 100002, ["--mode", "ps", "--workers", "100000"]),
            (["--workers", "1", "--ps", f"{_LIMIT + 1}"], _LIMIT + 3,
             ["--mode", "ps", "--workers", "1", "--ps", f"{_LIMIT + 1}"]),
        ]
    ],
    ([], None, _PROGRAM_HELP),
    ([], [], _PROGRAM_HELP),
    ([], ["-m"], _PROGRAM_HELP),
]  # fmt: skip


@pytest.mark.parametrize("args, program, message", USAGE_ERRORS)
def test_launcher_usage_error_is_one_line_and_status_2(
    args, program, message, tmp_path, capsys, monkeypatch
):
    def started(*_):
        raise AssertionError("a usage error must come before anything starts")

    monkeypatch.setattr(launch, "enter_private_network", started)
    monkeypatch.setattr(launch, "_Launch", started)
    (tmp_path / "binary.json").write_bytes(bytes(range(128, 256)))
    (tmp_path / "a-file").write_text("not a directory")
    argv = ["--log-dir", str(tmp_path / "logs")]
    argv += [a.replace("{tmp}", str(tmp_path)) for a in args]
    argv += [] if program is None else ["--", *program]
    try:
        code = launch.main(argv)
    except SystemExit as exit:  # argparse's own errors
        code = exit.code
    out, err = capsys.readouterr()
    assert code == 2
    assert err.splitlines() == [message.replace("{tmp}", str(tmp_path))]
    # Only the warning of `--network host` reaches the terminal.
    assert all(line.startswith("[launch] WARNING: ") for line in out.splitlines())
    assert not (tmp_path / "logs").exists()  # no task log, no cluster.json
