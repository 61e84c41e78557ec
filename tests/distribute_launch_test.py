"""End to end: the launcher starts 1 chief, 2 workers and 1 parameter server
as separate processes on localhost and AGN trains a digits classifier; the
terminal filter (`tf_lars.distribute.logs`) on recorded lines."""

import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys

import pytest

from tests.distribute_launch_helpers import (
    REPO,
    LaunchedCluster,
    launcher_env,
    read_json,
)
from tf_lars.distribute.logs import TerminalFilter, filter_lines, last_error_line

# The accuracy this run reaches is stated in docs/guides/parameter-servers.md; the bar
# leaves room for the random worker interleaving (measured 0.975-0.986).
ACCURACY = 0.95


def _refused(address):
    host, port = address.rsplit(":", 1)
    with socket.socket() as sock:
        sock.settimeout(2.0)
        code = sock.connect_ex(
            ("127.0.0.1" if host == "localhost" else host, int(port))
        )
    return code in (errno.ECONNREFUSED, errno.ECONNRESET)


@pytest.mark.slow
def test_two_workers_one_ps_train_digits(tmp_path):
    result_path = tmp_path / "result.json"
    args = [
        "--period",
        "10",
        "--steps-per-worker",
        "300",
        "--batch-size",
        "32",
        "--learning-rate",
        "0.5",
        "--result-json",
        str(result_path),
    ]
    with LaunchedCluster(
        tmp_path / "logs", ["--workers", "2", "--ps", "1"], args
    ) as run:
        network = run.wait_for(r"\[launch\] network: (\w+)", 60).group(1)
        run.wait_for(r"\[agn\] commits \d+/60 ", 180)
        cluster = run.state()["cluster"]
        if network == "private":
            # TensorFlow's servers listen on all interfaces; in the launcher's
            # private network namespace nothing outside it can connect.
            for address in cluster["ps"] + cluster["worker"]:
                assert _refused(address), address
        else:
            assert "no authentication" in run.output
        code = run.wait(180)
        output = run.output

    assert code == 0, output[-6000:]
    for task in ("chief", "worker", "ps"):
        assert re.search(rf"\[launch\] {task} 0 .* log .*{task}-0\.log", output), output
    assert re.search(r"\[launch\] worker 1 .* log .*worker-1\.log", output)
    assert "[launch] chief exited with status 0; stopping the other tasks" in output
    for name in ("chief-0", "worker-0", "worker-1", "ps-0"):
        assert os.path.getsize(tmp_path / "logs" / f"{name}.log") > 0
    assert "serving on" in (tmp_path / "logs" / "ps-0.log").read_text()

    result = read_json(result_path)
    # K * N / P = 2 * 300 / 10 commits, counted at the center.
    assert result["commits"] == result["target_commits"] == 60
    assert result["local_steps"] == 600
    assert result["test_accuracy"] >= ACCURACY, result
    progress = re.findall(
        r"\[agn\] commits (\d+)/60 \| local steps (\d+) \| loss ([\d.]+)", output
    )
    assert [int(c) for c, _, _ in progress] == [10, 20, 30, 40, 50, 60]
    assert float(progress[-1][2]) < float(progress[0][2])
    # Each commit pushes one gradient (the model's size) to the parameter server.
    assert result["pushed_payload_bytes"] == 60 * result["param_bytes"]
    if result["ps_bytes_received"] is not None:
        assert result["ps_bytes_received"] >= result["pushed_payload_bytes"]


@pytest.mark.slow
def test_interrupt_stops_every_task(tmp_path):
    args = ["--period", "5", "--steps-per-worker", "5000", "--input-delay-ms", "5"]
    with LaunchedCluster(
        tmp_path / "logs", ["--workers", "2", "--ps", "1"], args
    ) as run:
        run.wait_for(r"\[agn\] commits \d+/", 180)
        pids = [task["pid"] for task in run.state()["tasks"]]
        assert len(pids) == 4
        run.process.send_signal(signal.SIGINT)
        code = run.wait(60)
        output = run.output
    assert code == 128 + signal.SIGINT, output[-4000:]
    assert "[launch] got SIGINT; stopping all tasks" in output
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# A program that only reports which task it is: the chief prints and exits
# with status 5, the other tasks wait to be stopped. No TensorFlow.
_PROBE = """
import json, os, sys, time
task = json.loads(os.environ["TF_CONFIG"])["task"]
print("probe", task["type"], task["index"], sys.argv[1:], flush=True)
if task["type"] == "chief":
    sys.exit(5)
time.sleep(120)
"""


@pytest.mark.parametrize("form", ["script", "script_without_suffix", "module"])
def test_launcher_runs_a_script_path_or_a_module(tmp_path, form):
    modules = tmp_path / "modules"
    modules.mkdir()
    if form == "module":
        (modules / "launch_probe.py").write_text(_PROBE)
        program = ["-m", "launch_probe"]
    else:
        script = tmp_path / ("probe.py" if form == "script" else "probe")
        script.write_text(_PROBE)
        program = [str(script)]
    env = launcher_env()
    env["PYTHONPATH"] = str(modules) + os.pathsep + env["PYTHONPATH"]
    log_dir = tmp_path / "logs"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tf_lars.distribute.launch",
            "--workers",
            "1",
            "--ps",
            "1",
            "--log-dir",
            str(log_dir),
            "--",
            *program,
            "--flag",
            "x",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
    )
    output = proc.stdout + proc.stderr
    # The launcher exits with the chief's status.
    assert proc.returncode == 5, output
    assert "probe chief 0 ['--flag', 'x']" in proc.stdout
    assert "[launch] chief exited with status 5; stopping the other tasks" in output
    with open(log_dir / "cluster.json") as handle:
        command = json.load(handle)["command"]
    if form == "module":
        assert command == [sys.executable, "-m", "launch_probe", "--flag", "x"]
    else:
        assert command == [sys.executable, str(script), "--flag", "x"]


def test_launcher_needs_a_program():
    for program in ([], ["-m"]):
        proc = subprocess.run(
            [sys.executable, "-m", "tf_lars.distribute.launch", "--", *program],
            cwd=REPO,
            env=launcher_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stderr.startswith("error: give the training program after `--`")
        assert len(proc.stderr.splitlines()) == 1


# ------------------------------------------------------------ terminal filter
# What the launcher shows of an echoed task. The samples are lines of the
# kinds TensorFlow 2.21 prints (C++ log lines before and after absl starts,
# Python `ERROR:tensorflow:` records with gRPC status dumps, printed twice
# when absl has configured the root logger, tracebacks, retracing warnings).
LOG = "/tmp/logs/chief-0.log"
ABSL = (
    "WARNING: All log messages before absl::InitializeLog() is called are "
    "written to STDERR"
)
ONEDNN = (
    "I0000 00:00:1795435920.244333   29269 port.cc:153] oneDNN custom operations "
    "are on. You may see slightly different numerical results."
)
CUINIT = (
    "E0000 00:00:1795435933.382247   29295 cuda_platform.cc:52] failed call to "
    "cuInit: INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)"
)
OLD_FORMAT = (
    "2024-05-12 14:03:12.345678: W tensorflow/core/framework/op_kernel.cc:1840] "
    "OP_REQUIRES failed at iterator_ops.cc:1101 : OUT_OF_RANGE: End of sequence"
)
PS_LOST = [
    "ERROR:tensorflow:Remote function on worker /job:worker/replica:0/task:0 "
    "failed with UnavailableError():Graph execution error:",
    "",
    "Detected at node critical_section_execute/MutexLock/_15 defined at (most "
    "recent call last):",
    "<stack traces unavailable>",
    "2 root error(s) found.",
    "  (0) UNAVAILABLE:  Socket closed",
    "Additional GRPC error information from remote target "
    "/job:ps/replica:0/task:0 while calling /tensorflow.WorkerService/RecvTensor:",
    ':UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"Socket closed"}',
    "\t [[{{node critical_section_execute/MutexLock/_15}}]]",
    "0 successful operations.",
    "0 derived errors ignored.",
    "It is treated as a transient connectivity failure for now.",
]
RECONNECT = [
    "ERROR:tensorflow:Remote function on worker /job:worker/replica:0/task:1 "
    "failed with UnavailableError():Graph execution error:",
    "",
    "failed to connect to all addresses; last error: UNAVAILABLE: "
    "ipv4:127.0.0.1:37253: recvmsg:Connection reset by peer",
    "Additional GRPC error information from remote target "
    "/job:worker/replica:0/task:1 while calling /tensorflow.eager.EagerService/"
    "Enqueue:",
    ':UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"failed '
    'to connect to all addresses"}',
]
PS_ERROR = (
    "error: parameter server /job:ps/replica:0/task:0 (localhost:37253) is "
    "unavailable; training stopped. Restart the parameter servers and rerun: "
    "training resumes from /tmp/ckpt/ckpt-40 (commit 40). [UnavailableError: "
    "UNAVAILABLE: Socket closed]"
)
TRACEBACK = [
    "Traceback (most recent call last):",
    '  File "/work/examples/agn_digits.py", line 264, in train',
    "    history = trainer.fit(steps_per_worker=args.steps_per_worker)",
    "              ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
    '  File "/site-packages/tensorflow/python/eager/execute.py", line 53, in '
    "quick_execute",
    "    tensors = pywrap_tfe.TFE_Py_Execute(ctx._handle, device_name, op_name,",
    "tensorflow.python.framework.errors_impl.OutOfRangeError: Graph execution error:",
    "",
    "Detected at node IteratorGetNext defined at (most recent call last):",
    '  File "/work/tf_lars/distribute/trainer.py", line 352, in round_fn',
    "",
    "End of sequence",
    "\t [[{{node IteratorGetNext}}]] [Op:__inference_round_fn_568]",
]
RETRACING = (
    "WARNING:tensorflow:{n} out of the last {n} calls to <function "
    "MultiDeviceSaver.save.<locals>.tf_function_save at 0x7f1a7c7e60c0> "
    "triggered tf.function retracing. Tracing is expensive and the excessive "
    "number of tracings could be due to (1) creating @tf.function repeatedly "
    "in a loop."
)


def _note(count, what="TensorFlow logging"):
    return f"[launch] ({count} lines of {what} hidden; full text in {LOG})"


def test_filter_drops_startup_logging_and_collapses_a_dump_before_the_error():
    lines = [
        ABSL,
        ONEDNN,
        ABSL,
        ONEDNN,
        CUINIT,
        "[agn] training to 60 commits (300 local steps, period 5, 2 workers)",
        "[agn] commits 10/60 | local steps 50 | loss 0.9910 | 6.0 commits/s",
        *PS_LOST,
        *PS_LOST,  # the same record again, from the root logger's handler
        *RECONNECT,
        OLD_FORMAT,
        PS_ERROR,
    ]
    assert filter_lines(lines, LOG) == [
        "[agn] training to 60 commits (300 local steps, period 5, 2 workers)",
        "[agn] commits 10/60 | local steps 50 | loss 0.9910 | 6.0 commits/s",
        _note(2 * len(PS_LOST) + len(RECONNECT)),
        PS_ERROR,
    ]


def test_filter_reduces_a_traceback_to_its_exception_line():
    lines = [*PS_LOST, *TRACEBACK]
    assert filter_lines(lines, LOG) == [
        _note(len(PS_LOST) + len(TRACEBACK), "TensorFlow logging and tracebacks"),
        "tensorflow.python.framework.errors_impl.OutOfRangeError: Graph execution "
        "error:",
    ]
    # A program's own one-line error after the traceback says it better.
    assert filter_lines([*TRACEBACK, "error: the loss is NaN"], LOG) == [
        _note(len(TRACEBACK), "TensorFlow logging and tracebacks"),
        "error: the loss is NaN",
    ]


def test_filter_shows_each_function_s_retracing_warning_once():
    other = RETRACING.replace("MultiDeviceSaver.save.<locals>.tf_function_save", "f")
    lines = [
        RETRACING.format(n=5),
        RETRACING.format(n=5),
        "[agn] checkpoint saved: /tmp/ckpt/ckpt-50 (commit 50)",
        RETRACING.format(n=6),
        other.format(n=5),
    ]
    assert filter_lines(lines, LOG) == [
        "WARNING:tensorflow:5 out of the last 5 calls to <function "
        "MultiDeviceSaver.save.<locals>.tf_function_save at 0x7f1a7c7e60c0> "
        "triggered tf.function retracing (shown once per function; full text in "
        f"{LOG})",
        "[agn] checkpoint saved: /tmp/ckpt/ckpt-50 (commit 50)",
        "WARNING:tensorflow:5 out of the last 5 calls to <function f at "
        "0x7f1a7c7e60c0> triggered tf.function retracing (shown once per "
        f"function; full text in {LOG})",
    ]


def test_filter_keeps_warnings_once_and_the_program_s_lines_as_they_are():
    warning = [
        "WARNING:tensorflow:Using CollectiveAllReduceStrategy eagerly has "
        "significant overhead currently.",
    ]
    lines = [
        *warning,
        *warning,  # printed twice: dropped
        "epoch 1: loss 0.52",
        "",
        "    an indented line of the program's",
        *warning,  # after the program's own lines: shown again
        "Traceback-like words in a sentence stay: ValueError is a class",
    ]
    assert filter_lines(lines, LOG) == [
        *warning,
        "epoch 1: loss 0.52",
        "",
        "    an indented line of the program's",
        *warning,
        "Traceback-like words in a sentence stay: ValueError is a class",
    ]


def test_filter_alone_c_plus_plus_errors_are_dropped_without_a_note():
    assert filter_lines([CUINIT, OLD_FORMAT, "[script] done"], LOG) == ["[script] done"]


def test_filter_holds_a_record_until_it_ends_and_flushes_on_a_pause():
    terminal = TerminalFilter(LOG)
    assert terminal.feed("[agn] commits 10/60") == ["[agn] commits 10/60"]
    assert terminal.feed(PS_LOST[0]) == []
    assert terminal.feed(PS_LOST[1]) == []
    # The output pauses (a hung job): the note comes without waiting.
    assert terminal.flush() == [_note(2)]
    assert terminal.flush() == []
    assert terminal.feed("error: lost") == ["error: lost"]


def test_filter_needs_a_log_path():
    with pytest.raises(ValueError, match="`log_path` must be a non-empty str"):
        TerminalFilter("")


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            f"{ONEDNN}\n[agn] commits 10/60\n" + "\n".join(PS_LOST) + f"\n{PS_ERROR}\n",
            PS_ERROR,
        ),
        (
            "\n".join([*PS_LOST, *TRACEBACK]),
            "tensorflow.python.framework.errors_impl.OutOfRangeError: Graph "
            "execution error:",
        ),
        (
            "\n".join([ONEDNN, *PS_LOST, "[agn] commits 20/60"]),
            "Remote function on worker /job:worker/replica:0/task:0 failed with "
            "UnavailableError():Graph execution error:",
        ),
        (
            "[script] step 3\nValueError raised by the model's call\n[script] x\n",
            "ValueError raised by the model's call",
        ),
        # A process killed by a signal: startup logging only, no error line.
        (f"{ABSL}\n{ONEDNN}\n{CUINIT}\n{OLD_FORMAT}\n[script] started\n", None),
    ],
)
def test_last_error_line(text, expected):
    assert last_error_line(text) == expected


def test_last_error_line_cuts_long_lines():
    line = last_error_line("error: " + "x" * 500, limit=40)
    assert line == "error: " + "x" * 30 + "..." and len(line) == 40
