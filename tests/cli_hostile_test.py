"""`tf-lars` against hostile input, races and faults: files stay whole and in place.

A run name stays inside `output_dir`; one run at a time holds a run folder;
every file of a run folder is written whole or not at all, `summary.json`
last; SIGTERM is handled as Ctrl-C is (exit status 143); a saved
`config.yaml` replays; a config is bounded in size; and each bad input is
one line on stderr with exit status 2, never a traceback.
"""

import errno
import fcntl
import json
import os
import pathlib
import resource
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import yaml

from tests.cli_helpers import process_env, refused_before_tensorflow, run_python
from tf_lars.cli import preflight
from tf_lars.cli.config import ConfigError, load_config

REPO = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT = 300
# One epoch of a 2-filter CNN: seconds once TensorFlow is loaded.
CHEAP = [
    "--set", "training.epochs=1", "--set", "schedule.name=none",
    "--set", "model.width=2", "--set", "training.verbose=0",
]  # fmt: skip
RUN_NAME_RULE = (
    "`run_name` must be one folder name (not empty, '.' or '..', without '/', NUL "
    "or unpaired surrogate characters) or null"
)


def _tf_lars(argv, cwd, **options):
    """`python -m tf_lars.cli ARGV` in `cwd`: a `subprocess.run` result."""
    return subprocess.run(
        [sys.executable, "-m", "tf_lars.cli", *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=options.pop("env", process_env()),
        timeout=TIMEOUT,
        **options,
    )


def _error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("tf-lars")]


# ------------------------------------------------- run_name and output_dir
@pytest.mark.parametrize(
    "run_name, shown",
    [
        ("..", "'..'"),
        (".", "'.'"),
        ("../x", "'../x'"),
        ("a/b", "'a/b'"),
        ("/TMP/abs", "'/TMP/abs'"),
        ("''", "''"),
        ('"a\\0b"', "'a\\x00b'"),
        ('"a\\ud800b"', "'a\\ud800b'"),
    ],
)
def test_a_run_name_is_one_folder_name(
    run_name, shown, tmp_path, one_line_error, run_cli
):
    output = tmp_path / "runs"
    # An absolute name: one inside tmp_path, so that nothing lands elsewhere.
    run_name = run_name.replace("/TMP", str(tmp_path))
    shown = shown.replace("/TMP", str(tmp_path))
    code, out, err = run_cli(
        "train", "--set", f"output_dir={output}",
        "--set", f"run_name={run_name}", *CHEAP,
    )  # fmt: skip
    assert one_line_error(code, err) == (
        f"tf-lars train: error: {RUN_NAME_RULE}. Received: run_name={shown}"
    )
    assert out == ""
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "output_dir, shown", [('"a\\0b"', "'a\\x00b'"), ('"a\\udc80b"', "'a\\udc80b'")]
)
def test_an_output_dir_with_nul_or_a_lone_surrogate(
    output_dir, shown, one_line_error, run_cli
):
    code, _, err = run_cli("train", "--set", f"output_dir={output_dir}", *CHEAP)
    assert one_line_error(code, err) == (
        "tf-lars train: error: `output_dir` must be a path without NUL or unpaired "
        f"surrogate characters. Received: output_dir={shown}"
    )


def _parent_files(folder):
    (folder / "tensorboard").mkdir(parents=True)
    (folder / "tensorboard" / "events").write_text("the user's")
    (folder / "config.yaml").write_text("the user's")
    return sorted(path.name for path in folder.iterdir())


def test_overwrite_deletes_nothing_outside_the_run_folder(
    tmp_path, one_line_error, run_cli
):
    output = tmp_path / "runs"
    names = _parent_files(tmp_path)
    code, _, err = run_cli(
        "train", "--overwrite", "--set", f"output_dir={output}",
        "--set", "run_name=..", *CHEAP,
    )  # fmt: skip
    assert one_line_error(code, err).endswith("Received: run_name='..'")
    assert sorted(path.name for path in tmp_path.iterdir()) == names
    assert (tmp_path / "config.yaml").read_text() == "the user's"
    assert (tmp_path / "tensorboard" / "events").read_text() == "the user's"


def test_overwrite_refuses_a_run_folder_that_is_a_symbolic_link(
    tmp_path, one_line_error, run_cli
):
    elsewhere = tmp_path / "elsewhere"
    names = _parent_files(elsewhere)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "link").symlink_to(elsewhere)
    code, _, err = run_cli(
        "train", "--overwrite", "--set", f"output_dir={tmp_path / 'runs'}",
        "--set", "run_name=link", *CHEAP,
    )  # fmt: skip
    assert one_line_error(code, err) == (
        f"tf-lars train: error: the run folder {tmp_path / 'runs' / 'link'} exists "
        "and is a symbolic link; choose another `run_name`. Received: run_name='link'"
    )
    assert sorted(path.name for path in elsewhere.iterdir()) == names
    assert (elsewhere / "config.yaml").read_text() == "the user's"


# ------------------------------------------------------ claiming the folder
def _hold(folder):
    """Locks `folder` as another `tf-lars` run holding it does."""
    descriptor = os.open(folder, os.O_RDONLY)
    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return descriptor


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_folder_another_run_holds_is_refused(
    overwrite, tmp_path, one_line_error, run_cli
):
    folder = tmp_path / "r"
    folder.mkdir()
    (folder / "history.json").write_text("the other run's")
    descriptor = _hold(folder)
    try:
        code, out, err = run_cli("train", *(["--overwrite"] if overwrite else []),
            "--set", f"output_dir={tmp_path}", "--set", "run_name=r", *CHEAP,
        )  # fmt: skip
    finally:
        os.close(descriptor)
    assert one_line_error(code, err) == (
        f"tf-lars train: error: the run folder {folder} is taken: another tf-lars "
        "run is writing it; choose another `run_name`. Received: run_name='r'"
    )
    assert out == ""
    assert os.listdir(folder) == ["history.json"]
    assert (folder / "history.json").read_text() == "the other run's"


def test_a_claim_is_exclusive_until_released(tmp_path):
    config = {"output_dir": str(tmp_path / "runs"), "run_name": "r"}
    folder = preflight.claim_run_dir(config, "train")
    assert folder == str(tmp_path / "runs" / "r")
    assert os.path.isdir(folder)
    try:
        for overwrite in (False, True):
            with pytest.raises(ConfigError, match="is taken: another tf-lars run"):
                preflight.claim_run_dir(config, "train", overwrite)
    finally:
        preflight.release_run_dirs()
    # Released and empty: removed, with the `runs` folder it created.
    assert os.listdir(tmp_path) == []
    (tmp_path / "runs" / "r").mkdir(parents=True)
    assert preflight.claim_run_dir(config, "train", True) == folder
    preflight.release_run_dirs()
    assert os.path.isdir(folder)  # not created by the claim: kept


@pytest.mark.parametrize("overwrite", [False, True])
def test_two_runs_started_together_with_one_name(overwrite, tmp_path):
    argv = [
        "train", *(["--overwrite"] if overwrite else []),
        "--set", "run_name=r", "--set", "optimizer={class_name: SGD}", *CHEAP,
    ]  # fmt: skip
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "tf_lars.cli", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            env=process_env(),
        )
        for _ in range(2)
    ]
    results = [process.communicate(timeout=TIMEOUT) for process in processes]
    codes = sorted(process.returncode for process in processes)
    assert codes == [0, 2], results
    refused = next(err for (_, err), p in zip(results, processes) if p.returncode)
    lines = _error_lines(refused)
    assert len(lines) == 1 and "Traceback" not in refused, refused
    # Which message depends on how far the winner got when the other looked.
    assert lines[0].startswith("tf-lars train: error: the run folder runs/r "), lines
    assert "is taken: another tf-lars run is writing it" in lines[0] or (
        not overwrite and "exists (an earlier run)" in lines[0]
    ), lines
    summary = json.loads((tmp_path / "runs" / "r" / "summary.json").read_text())
    assert summary["epochs_run"] == 1


# --------------------------------------------------------- whole files
def test_write_file_leaves_the_old_file_or_the_new_one(tmp_path):
    path = tmp_path / "history.json"
    path.write_text("the epoch before")

    def full_disk(temporary):
        with open(temporary, "w") as handle:
            handle.write("half of the next ep")
        assert path.read_text() == "the epoch before"  # not touched yet
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(ConfigError) as raised:
        preflight.write_file(str(path), full_disk)
    assert str(raised.value) == f"cannot write {path}: No space left on device"
    assert path.read_text() == "the epoch before"
    assert os.listdir(tmp_path) == ["history.json"]
    preflight.write_text(str(tmp_path), "history.json", "the next epoch")
    assert path.read_text() == "the next epoch"
    assert os.listdir(tmp_path) == ["history.json"]


def test_write_text_never_truncates_in_place(tmp_path, monkeypatch):
    # A reader of history.json must never see it empty: the new text goes to
    # a temporary file that replaces it.
    path = tmp_path / "history.json"
    path.write_text("the epoch before")

    def no_rename(source, target):
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))

    monkeypatch.setattr(preflight.os, "replace", no_rename)
    with pytest.raises(ConfigError, match="history.json: File too large"):
        preflight.write_text(str(tmp_path), "history.json", "the next epoch")
    assert path.read_text() == "the epoch before"
    assert os.listdir(tmp_path) == ["history.json"]


def _limit_file_size():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    # config.yaml and history.json fit; model.keras (about 34 kB) does not.
    resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))


def test_a_full_disk_is_one_line_and_leaves_no_partial_file(tmp_path):
    process = _tf_lars(
        ["train", "--set", "run_name=r", "--set", "optimizer={class_name: SGD}",
         *CHEAP],
        tmp_path,
        preexec_fn=_limit_file_size,
    )  # fmt: skip
    folder = tmp_path / "runs" / "r"
    assert process.returncode == 2, process.stderr
    assert "Traceback" not in process.stderr
    assert _error_lines(process.stderr) == [
        "tf-lars train: error: cannot write runs/r/model.keras: File too large"
    ]
    # The scores are printed all the same (they were lost before 0.3.0).
    assert "Final test accuracy: " in process.stdout
    assert "Wrote " not in process.stdout
    # No truncated model, no summary claiming a finished run, no temporary.
    assert sorted(os.listdir(folder)) == ["config.yaml", "history.json"]
    assert json.loads((folder / "history.json").read_text())["epoch"] == [1]


def test_a_study_storage_that_cannot_be_written_is_one_line(tmp_path):
    limit = 150_000  # the storage is made, a trial's commit fails

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    process = _tf_lars(
        ["study", "--quick", "--set", "study.batch_sizes=[8, 32]",
         "--set", "study.trials=2", "--set", "study.seeds=1",
         "--set", "study.workers=1", "--set", "run_name=r"],
        tmp_path,
        preexec_fn=limit_file_size,
    )  # fmt: skip
    # It was SQLAlchemy's and Optuna's tracebacks and status 1.
    assert process.returncode == 2, process.stderr
    assert "Traceback" not in process.stderr
    assert _error_lines(process.stderr) == [
        "tf-lars study: error: cannot write the trials in "
        f"sqlite:///{tmp_path}/runs/r/study.db: disk I/O error"
    ]


# --------------------------------------------------------------- SIGTERM
# How long a test waits for a signal it sent to be handled: an event, never a
# fixed time; on a quiet machine it takes microseconds.
SIGNAL_DEADLINE_S = 30


def _signal_self(signum):
    """Sends `signum` to the main thread and returns once the handler of the
    running `_signals_handled()` has recorded it, failing after
    `SIGNAL_DEADLINE_S`. A handler that raises ends the wait with its
    exception, as the signal would have ended the code it interrupted.

    A fixed sleep after sending is no synchronization: a full run once saw the
    SIGINT not yet received 10 ms after `pthread_kill`. (`os.kill` to the
    process is worse: it may land on one of TensorFlow's threads.)
    """
    from tf_lars.cli import main

    signals = main._SIGNALS
    assert signals is not None, "_signal_self needs a `_signals_handled()` block"
    before = len(signals.received)
    signal.pthread_kill(threading.main_thread().ident, signum)
    deadline = time.monotonic() + SIGNAL_DEADLINE_S
    # Python runs the handler in the main thread between two bytecodes, or
    # when a sleep there is interrupted.
    while len(signals.received) == before:
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{signal.Signals(signum).name} sent to the main thread was not "
                f"handled within {SIGNAL_DEADLINE_S} s"
            )
        time.sleep(0.001)


def test_a_signal_while_tensorflow_runs_is_raised_at_the_next_safe_point():
    """Inside `deferred()` the first signal waits for `raise_pending` (a
    batch or epoch end) or the block's end; elsewhere it is raised at once.
    Raised inside TensorFlow's Python code (an iterator being made), it could
    corrupt the heap: CI saw the SIGTERM test below die of SIGSEGV (-11),
    and repeated, it aborted in `make_iterator` ("free(): invalid next
    size")."""
    from tf_lars.cli.main import Terminated, _signals_handled, deferred, raise_pending

    with _signals_handled() as signals:
        with pytest.raises(Terminated):
            with deferred():
                _signal_self(signal.SIGTERM)
                _signal_self(signal.SIGTERM)  # a second SIGTERM: counted only
                assert signals.received == [signal.SIGTERM, signal.SIGTERM]
                raise_pending()
        assert signals.terminated
        raise_pending()  # raised once only
    with _signals_handled() as signals:
        with pytest.raises(KeyboardInterrupt) as raised:
            with deferred():
                _signal_self(signal.SIGINT)
                assert signals.received == [signal.SIGINT]
        assert type(raised.value) is KeyboardInterrupt  # at the block's end
        with pytest.raises(KeyboardInterrupt):
            _signal_self(signal.SIGINT)  # a second Ctrl-C: at once
    with _signals_handled():
        with pytest.raises(Terminated):
            _signal_self(signal.SIGTERM)  # outside `deferred()`: at once
    raise_pending()  # outside `main`: nothing pending, nothing raised
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_ignored_sigint_stays_ignored():
    from tf_lars.cli.main import Terminated, _signals_handled

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with _signals_handled() as signals:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            # No event to wait for: a handled signal sent after it is the
            # barrier. Python runs pending handlers in signal-number order
            # (SIGINT 2 before SIGTERM 15), so once SIGTERM's has run, a SIGINT
            # that reached a handler would have been recorded before it.
            with pytest.raises(Terminated):
                _signal_self(signal.SIGTERM)
            assert signals.received == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGINT, previous)


def test_sigterm_in_a_step_ends_training_when_that_step_ends(
    tmp_path, monkeypatch, run_cli
):
    """The signal, sent from inside the fourth batch of the second epoch, is
    raised as that batch ends: one whole epoch in history.json, 143."""
    from tf_lars.cli import train

    def signal_in_batch(self, batch, logs=None):
        if self._epoch == 1 and batch == 3:
            _signal_self(signal.SIGTERM)

    ended = []
    monkeypatch.setattr(train._StopOnNonFinite, "on_train_batch_begin", signal_in_batch)
    monkeypatch.setattr(
        train._RaiseInterrupts,
        "on_train_batch_end",
        lambda self, batch, logs=None: (ended.append(batch), train.raise_pending()),
    )
    code, _, err = run_cli(
        "train", "--set", f"output_dir={tmp_path}", "--set", "run_name=r",
        "--set", "training.epochs=5", "--set", "model.width=2",
        "--set", "schedule.name=none", "--set", "training.batch_size=128",
        "--set", "training.verbose=0",
    )  # fmt: skip
    assert code == 143, err
    assert ended[-1] == 3 and len(ended) > 4
    folder = tmp_path / "r"
    assert json.loads((folder / "history.json").read_text())["epoch"] == [1]
    assert err.startswith("tf-lars train: interrupted (SIGTERM); ")


# ------------------------------------------------------- config replay
@pytest.mark.parametrize("loss_scaled", [False, True])
def test_a_lamb_runs_config_yaml_replays(loss_scaled, tmp_path, run_cli):
    argv = [
        "--set", f"output_dir={tmp_path}", *CHEAP,
        "--set", "optimizer={class_name: LAMB, config: {learning_rate: 0.01}}",
        "--set", f"loss_scale.enabled={str(loss_scaled).lower()}",
    ]  # fmt: skip
    code, _, err = run_cli("train", *argv, "--set", "run_name=first")
    assert code == 0, err
    saved = tmp_path / "first" / "config.yaml"
    code, _, err = run_cli("train", "--config", str(saved), "--set", "run_name=again")
    assert code == 0, err
    first = yaml.safe_load(saved.read_text())
    again = yaml.safe_load((tmp_path / "again" / "config.yaml").read_text())
    assert first["optimizer"]["class_name"] == "LAMB"
    assert "amsgrad" not in first["optimizer"]["config"]
    assert first["optimizer"]["config"]["trust_coefficient"] == 1.0
    assert first["optimizer"]["config"]["learning_rate"] == 0.01
    assert first["loss_scale"]["enabled"] is loss_scaled
    assert {**first, "run_name": "again"} == again
    # LAMB has trust ratios with or without the loss-scale wrapper: both
    # runs record them, and the summary names LAMB, not its inner Adam.
    for run in ("first", "again"):
        assert (tmp_path / run / "trust_ratios.npz").is_file()
        summary = json.loads((tmp_path / run / "summary.json").read_text())
        assert summary["inner_optimizer"] == "LAMB"


# --------------------------------------------------------- config size
def _laughs(levels=8):
    lines = ["optimizer:", "  class_name: LARS", "  module:"]
    lines.append("    l0: &l0 [" + ",".join(["lol"] * 9) + "]")
    for level in range(1, levels + 1):
        lines.append(
            f"    l{level}: &l{level} [" + ",".join([f"*l{level - 1}"] * 9) + "]"
        )
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("case", ["laughs", "dev zero", "large", "deep", "deep set"])
def test_a_config_is_bounded_in_size(case, tmp_path):
    path = tmp_path / "c.yaml"
    argv = ["train", "--config", str(path)]
    if case == "laughs":
        path.write_text(_laughs())
        assert len(path.read_bytes()) < 600
        expected = (
            f"--config {path}: refused: the YAML uses the alias *l0; a config "
            "gives each value in full"
        )
    elif case == "dev zero":
        argv = ["train", "--config", "/dev/zero"]
        expected = (
            "--config /dev/zero: refused: larger than 1048576 bytes (1 MiB); a "
            "config is a few kB of YAML"
        )
    elif case == "large":
        path.write_text("seed: 0\n" + "#" * (1 << 20))
        expected = (
            f"--config {path}: refused: larger than 1048576 bytes (1 MiB); a "
            "config is a few kB of YAML"
        )
    elif case == "deep":
        path.write_text("seed: " + "[" * 5000 + "]" * 5000 + "\n")
        expected = f"--config {path}: refused: the YAML nested more than 64 levels deep"
    else:
        argv = ["train", "--set", "seed=" + "- " * 5000 + "x"]
        expected = "--set seed: refused: the YAML nested more than 64 levels deep"
    line = refused_before_tensorflow(argv, tmp_path)
    assert line == f"tf-lars train: error: {expected}"


def test_a_config_within_the_bounds_loads(tmp_path):
    path = tmp_path / "c.yaml"
    text = (
        "optimizer:\n  class_name: SGD\n  config:\n    learning_rate: &rate 0.5\n"
        "    momentum: 0.5\n"
    )
    path.write_text(text + "#" * ((1 << 20) - len(text) - 1) + "\n")
    assert len(path.read_bytes()) == 1 << 20
    config = load_config("train", str(path))
    assert config["optimizer"]["config"] == {"learning_rate": 0.5, "momentum": 0.5}
    nested = "training: " + "{a: " * 30 + "1" + "}" * 30
    with pytest.raises(ConfigError, match="Unknown config key `training.a`"):
        load_config("train", overrides=[nested.replace(": ", "=", 1)])


# ------------------------------------------------------ one-line errors
def _huge_npz(path):
    """An .npz whose x_train header claims 10**13 examples of 8x8."""
    rng = np.random.default_rng(0)
    np.savez(
        path,
        x_train=rng.random((8, 8, 8)).astype("float32"),
        y_train=np.arange(8) % 2,
        x_test=rng.random((4, 8, 8)).astype("float32"),
        y_test=np.arange(4) % 2,
    )
    import zipfile

    with zipfile.ZipFile(path) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    old = members["x_train.npy"]
    members["x_train.npy"] = old.replace(b"(8, 8, 8)", b"(10000000000000, 8, 8)", 1)
    assert members["x_train.npy"] != old
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)


ONE_LINE = [
    (["--set", "training.epochs=" + "9" * 5000],
     "--set training.epochs: not a config value: an int of more than 4300 digits"),
    (["--set", "seed=4294967296"],
     "`seed` must be an int in [0, 4294967295]. Received: seed=4294967296"),
    (["--set", "data.split_seed=4294967296"], "`data.split_seed` must be an int in "
     "[0, 4294967295]. Received: data.split_seed=4294967296"),
    (["--set", "data.num_classes=2147483648"], "`data.num_classes` must be an int in "
     "[2, 1000000] or null. Received: data.num_classes=2147483648"),
    (["--set", "seed=2020-13-45"], "--set seed: not a config value: month must be "
     "in 1..12"),
]  # fmt: skip


@pytest.mark.parametrize("argv, expected", ONE_LINE)
def test_values_python_cannot_hold_are_one_line(argv, expected, tmp_path):
    line = refused_before_tensorflow(["train", *argv, *CHEAP], tmp_path)
    assert line == f"tf-lars train: error: {expected}"
    assert os.listdir(tmp_path) == []


def test_an_npz_claiming_more_than_it_stores(tmp_path):
    path = tmp_path / "huge.npz"
    _huge_npz(path)
    line = refused_before_tensorflow(
        ["train", "--set", f"data.path={path}", "--set", "model.name=mlp",
         "--set", "training.batch_size=4", *CHEAP],
        tmp_path,
    )  # fmt: skip
    assert line.startswith(
        f"tf-lars train: error: data.path={path}: x_train claims shape "
        "(10000000000000, 8, 8) (2560000000000000 bytes of float32) but the file "
        "stores "
    ), line
    assert line.endswith(
        "bytes for it; the file is damaged or not what numpy.savez writes"
    )


def test_labels_beyond_the_class_bound(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(
        path,
        x_train=np.zeros((4, 3)),
        y_train=np.array([0, 1, 2, 2147483647]),
        x_test=np.zeros((2, 3)),
        y_test=np.array([0, 1]),
    )
    line = refused_before_tensorflow(
        ["train", "--set", f"data.path={path}", "--set", "model.name=mlp",
         "--set", "training.batch_size=4", *CHEAP],
        tmp_path,
    )  # fmt: skip
    assert line == (
        f"tf-lars train: error: data.path={path}: labels go up to 2147483647, which "
        "would make 2147483648 classes; at most 1000000 are supported"
    )


def _patched_zip(path, offsets, value):
    """Sets the 16-bit field at `offsets` = (local header, central header)
    of every member of the zip file at `path` to `value` | its bit 0."""
    data = bytearray(path.read_bytes())
    for signature, offset in zip((b"PK\x03\x04", b"PK\x01\x02"), offsets):
        start = data.find(signature)
        while start != -1:
            field = int.from_bytes(data[start + offset : start + offset + 2], "little")
            field = value if value > 1 else field | value
            data[start + offset : start + offset + 2] = field.to_bytes(2, "little")
            start = data.find(signature, start + 4)
    path.write_bytes(bytes(data))


HOSTILE_NPZ = {
    "no features": (
        {"x_train": np.zeros((4, 0)), "x_test": np.zeros((2, 0))},
        "x_train's examples have shape (0,): no values",
    ),
    "no channels": (
        {"x_train": np.zeros((4, 3, 3, 0)), "x_test": np.zeros((2, 3, 3, 0))},
        "x_train's examples have shape (3, 3, 0): no values",
    ),
    "beyond float32": (
        {"x_test": np.full((2, 3), -1e300)},
        "x_test holds values up to 1e+300 in magnitude, beyond float32's range (the "
        "model computes in float32)",
    ),
    "float labels beyond int64": (
        {"y_train": np.full(4, 1e30)},
        "labels out of range: y_train holds class ids in [1e+30, 1e+30], beyond any "
        "number of classes",
    ),
    "uint64 labels beyond int64": (
        {"y_test": np.array([0, 2**64 - 1], np.uint64)},
        "labels out of range: y_test holds class ids in [0, 18446744073709551615], "
        "beyond any number of classes",
    ),
    # zipfile raises RuntimeError and NotImplementedError for these.
    "encrypted": (
        (6, 8),
        "cannot read as .npz (a member is encrypted); the file "
        "must be what numpy.savez writes",
    ),
    "unknown compression": (
        (8, 10),
        "cannot read as .npz (That compression method "
        "is not supported); the file must be what numpy.savez "
        "writes",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_NPZ))
def test_a_hostile_npz_is_one_line(case, tmp_path):
    # Each crashed before (a traceback, a C++ abort, or a wrapped label).
    change, expected = HOSTILE_NPZ[case]
    arrays = {
        "x_train": np.zeros((4, 3)),
        "y_train": np.array([0, 1, 0, 1]),
        "x_test": np.zeros((2, 3)),
        "y_test": np.array([0, 1]),
    }
    path = tmp_path / "d.npz"
    if isinstance(change, dict):
        np.savez(path, **(arrays | change))
    else:
        np.savez(path, **arrays)
        _patched_zip(path, change, 1 if case == "encrypted" else 97)
    line = refused_before_tensorflow(
        ["train", "--set", f"data.path={path}", "--set", "model.name=mlp",
         "--set", "training.batch_size=2", *CHEAP],
        tmp_path,
    )  # fmt: skip
    assert line == f"tf-lars train: error: data.path={path}: {expected}"


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--set", "loss_scale.dynamic_growth_steps=100000000000000000000"],
         "`loss_scale.dynamic_growth_steps` must be at most 2147483647 (2**31 - 1). "
         "Received: loss_scale.dynamic_growth_steps=100000000000000000000"),
        (["--set", "schedule.name=warmup_polynomial_decay",
          "--set", "schedule.warmup_epochs=1e308"],
         "`schedule.warmup_epochs` must be less than the number of epochs (1). "
         "Received: schedule.warmup_epochs=1e+308"),
    ],
)  # fmt: skip
def test_numbers_too_large_for_a_run_are_one_line(argv, expected, tmp_path):
    # Before: a TypeError deep in TensorFlow, and an OverflowError.
    line = refused_before_tensorflow(["train", *CHEAP, *argv], tmp_path)
    assert line == f"tf-lars train: error: {expected}"
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "class_name, advice",
    [
        ("TrustRatio", "TrustRatio wraps an optimizer that a config cannot give; use "
         "LAMB (the trust ratio around Adam) or LARS (around SGD with momentum)"),
        ("AGN", "AGN trains on parameter servers: name its inner optimizer here and "
         "set distribute.strategy=parameter_server (the distribute.agn block; "
         "docs/guides/parameter-servers.md)"),
    ],
)  # fmt: skip
def test_a_wrapper_optimizer_is_refused(
    class_name, advice, tmp_path, one_line_error, run_cli
):
    code, _, err = run_cli(
        "train", "--set", f"optimizer={{class_name: {class_name}}}",
        "--set", f"output_dir={tmp_path}/o", *CHEAP,
    )  # fmt: skip
    assert one_line_error(code, err) == (
        f"tf-lars train: error: `optimizer.class_name` names an optimizer wrapper: "
        f"{advice}. Received: optimizer.class_name='{class_name}'"
    )
    assert os.listdir(tmp_path) == []  # the claimed folder, released


def test_an_optimizer_block_without_config_takes_the_defaults():
    config = load_config("train", overrides=["optimizer={class_name: SGD}"])
    assert config["optimizer"] == {"class_name": "SGD", "config": {}}


def test_another_keras_backend(tmp_path):
    env = process_env(KERAS_BACKEND="jax")
    for argv in (["--help"], ["train", "--help"]):
        process = _tf_lars(argv, tmp_path, env=env)
        assert process.returncode == 0, process.stderr
        assert process.stdout.startswith("usage: tf-lars"), process.stdout
        assert process.stderr == ""
    process = _tf_lars(["train"], tmp_path, env=env)
    assert process.returncode == 2
    assert process.stderr == (
        "tf-lars train: error: the command line needs Keras's TensorFlow backend, "
        "and Keras is set to the 'jax' backend (KERAS_BACKEND or keras.json); set "
        "KERAS_BACKEND=tensorflow\n"
    )
    assert os.listdir(tmp_path) == []


def test_without_tensorflow_installed(tmp_path):
    # As if TensorFlow were not installed: `find_spec` and `import` see none.
    script = (
        "import sys; sys.modules['tensorflow'] = None; "
        "from tf_lars.cli.main import main; sys.exit(main(['train']))"
    )
    process = run_python(script, tmp_path, TIMEOUT)
    assert process.returncode == 2, process.stderr
    assert process.stderr == (
        "tf-lars train: error: the command line needs the `cli` extra: pip install "
        "\"tf_lars[cli]\" (no module named 'tensorflow')\n"
    )
    assert os.listdir(tmp_path) == []
