"""`tf-lars` keeps results safe and fails fast: run folders, Ctrl-C, errors.

Every error here is one line on stderr and exit status 2; a Ctrl-C is one
line and exit status 130, the run folder keeping what finished.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from tests.cli_helpers import process_env, refused_before_tensorflow, run_python

REPO = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT = 300


# Settings that make a run that should have been refused (as the code
# before these checks did not) end in seconds instead of minutes.
CHEAP = {
    "train": ["--set", "training.epochs=1", "--set", "schedule.name=none",
              "--set", "model.width=2", "--set", "training.verbose=0"],
    "study": ["--quick", "--set", "study.batch_sizes=[8]", "--set", "study.trials=1",
              "--set", "study.seeds=1"],
    "lowcomm": ["--set", "training.steps=2", "--set", "training.batch_size=4",
                "--set", "workers=[2]", "--set", "sync_every=[1]",
                "--set", "model.width=2", "--set", "methods=[dp]",
                "--set", "tuning.trials=1", "--set", "tuning.seeds=1",
                "--set", "tuning.workers=1", "--set", "mnist1d.num_samples=400"],
}  # fmt: skip


# ------------------------------------------------------------ run folders
@pytest.mark.parametrize("command", ["train", "study", "lowcomm"])
def test_an_existing_named_run_folder_is_refused(
    command, tmp_path, one_line_error, run_cli
):
    earlier = tmp_path / "runs" / "mine"
    earlier.mkdir(parents=True)
    (earlier / "history.json").write_text("the earlier run")
    code, out, err = run_cli(
        command, "--set", f"output_dir={tmp_path / 'runs'}",
        "--set", "run_name=mine", *CHEAP[command],
    )  # fmt: skip
    line = one_line_error(code, err, command)
    assert line == (
        f"tf-lars {command}: error: the run folder {earlier} exists (an earlier "
        "run); choose another `run_name` (e.g. --set run_name=NAME), or give "
        "--overwrite to replace its files. Received: run_name='mine'"
    )
    assert out == ""
    assert os.listdir(earlier) == ["history.json"]
    assert (earlier / "history.json").read_text() == "the earlier run"


def test_overwrite_replaces_the_earlier_runs_files(tmp_path, run_cli):
    folder = tmp_path / "mine"
    folder.mkdir()
    # An earlier LARS run's files; the SGD run below writes no trust ratios.
    (folder / "trust_ratio.png").write_text("stale")
    (folder / "notes.txt").write_text("the user's own file")
    code, out, err = run_cli(
        "train", "--overwrite", "--set", f"output_dir={tmp_path}",
        "--set", "run_name=mine", "--set", "training.epochs=2",
        "--set", "schedule.name=none", "--set", "model.width=4",
        "--set", "optimizer={class_name: SGD, config: {learning_rate: 0.1}}",
        "--set", "training.verbose=0",
    )  # fmt: skip
    assert code == 0, err
    assert sorted(os.listdir(folder)) == [
        "config.yaml", "curves.png", "history.json", "learning_rate.png",
        "model.keras", "notes.txt", "summary.json",
    ]  # fmt: skip
    assert (folder / "notes.txt").read_text() == "the user's own file"
    assert json.loads((folder / "summary.json").read_text())["epochs_run"] == 2


def test_an_unnamed_run_never_takes_an_existing_folder(tmp_path, monkeypatch):
    from tf_lars.cli import preflight

    monkeypatch.setattr(
        preflight, "run_dir", lambda config, command: str(tmp_path / "train-x")
    )
    config = {"output_dir": str(tmp_path), "run_name": None}
    assert preflight.choose_run_dir(config, "train") == str(tmp_path / "train-x")
    (tmp_path / "train-x").mkdir()
    (tmp_path / "train-x-2").mkdir()
    assert preflight.choose_run_dir(config, "train") == str(tmp_path / "train-x-3")


# -------------------------------------------------------------- Ctrl-C
# `python -m tf_lars.cli` as from a terminal. A process started in the
# background by a shell without job control (`cmd &` in a script, as a CI
# runner may start the suite) inherits SIGINT ignored, and Python then never
# raises KeyboardInterrupt; the child restores the terminal's default.
_AS_FROM_A_TERMINAL = (
    "import runpy, signal, sys; "
    "signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'tf-lars'; "
    "runpy.run_module('tf_lars.cli', run_name='__main__', alter_sys=True)"
)


def _start(argv, cwd):
    return subprocess.Popen(
        [sys.executable, "-c", _AS_FROM_A_TERMINAL, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=process_env(),
    )


def _interrupt_after(process, marker, signum=signal.SIGINT):
    """Sends `signum` once stdout shows `marker`; returns (code, out, err)."""
    seen = []
    deadline = time.monotonic() + TIMEOUT
    for line in process.stdout:
        seen.append(line)
        if marker in line or time.monotonic() > deadline:
            break
    process.send_signal(signum)
    out, err = process.communicate(timeout=60)
    return process.returncode, "".join(seen) + out, err


@pytest.mark.parametrize(
    "signum, name, status",
    [(signal.SIGINT, "Ctrl-C", 130), (signal.SIGTERM, "SIGTERM", 143)],
)
def test_ctrl_c_in_train_keeps_the_config_and_history(signum, name, status, tmp_path):
    # SIGTERM (a scheduler's preemption) is handled as Ctrl-C is, status 143.
    process = _start(
        ["train", "--set", "run_name=r", "--set", "training.verbose=2",
         "--set", "model.width=4"],
        tmp_path,
    )  # fmt: skip
    code, out, err = _interrupt_after(process, "Epoch 4/100", signum)
    folder = tmp_path / "runs" / "r"
    assert code == status, err
    history = json.loads((folder / "history.json").read_text())
    done = len(history["epoch"])
    assert 3 <= done < 100
    assert history["epoch"] == list(range(1, done + 1))
    assert len(history["loss"]) == len(history["val_accuracy"]) == done
    assert err == (
        f"tf-lars train: interrupted ({name}); the run folder runs/r keeps "
        f"INTERRUPTED, config.yaml, history.json ({done} of 100 epochs)\n"
    )
    assert sorted(os.listdir(folder)) == ["INTERRUPTED", "config.yaml", "history.json"]
    assert (
        (folder / "INTERRUPTED")
        .read_text()
        .startswith(f"Interrupted ({name}) after {done} of 100 epochs.")
    )
    assert "model:\n  name: cnn\n  width: 4\n" in (folder / "config.yaml").read_text()


# Ctrl-C in `study`: tests/cli_study_test.py::
# test_ctrl_c_keeps_finished_trials_and_a_rerun_resumes (and, in-process,
# test_a_rerun_resumes_the_study: a trial is kept once Optuna records it).


@pytest.mark.parametrize(
    "signum, name, when",
    [(signal.SIGTERM, "SIGTERM", "printing"), (signal.SIGINT, "Ctrl-C", "summary")],
)
def test_a_signal_once_the_run_is_complete_exits_0(
    signum, name, when, tmp_path, monkeypatch, run_cli
):
    # It arrives while the files are listed (after summary.json), or while
    # summary.json is written: the folder is complete either way, and the
    # run ended with 143/130 and no message, or an INTERRUPTED note in it.
    from tf_lars.cli import train

    write_text = train.write_text

    def printing(*args, **kwargs):
        if when == "printing" and args and str(args[0]).startswith("Wrote "):
            signal.raise_signal(signum)  # its handler runs before this returns
        print(*args, **kwargs)

    def write(folder, file_name, text):
        if when == "summary" and file_name == "summary.json":
            signal.raise_signal(signum)
        write_text(folder, file_name, text)

    monkeypatch.setattr(train, "print", printing, raising=False)
    monkeypatch.setattr(train, "write_text", write)
    code, out, err = run_cli(
        "train", "--set", f"output_dir={tmp_path}", "--set", "run_name=r",
        *CHEAP["train"],
    )  # fmt: skip
    assert code == 0, err
    assert err == (
        f"tf-lars train: {name} arrived after the run finished; the run folder "
        f"{tmp_path}/r is complete\n"
    )
    assert "Final test accuracy:" in out and f"Wrote {tmp_path}/r/: " in out
    files = sorted(os.listdir(tmp_path / "r"))
    assert "summary.json" in files and "INTERRUPTED" not in files


def test_the_process_ends_without_collecting_its_garbage(tmp_path):
    # Python's exit collected every object in a cycle (TensorFlow makes
    # hundreds of thousands): 4 to 19 s after a Ctrl-C'd run's last line
    # beside busy processes, measured (docs/guides/cli.md). The cycle made
    # here after `main` returned is not collected: its `__del__` never runs.
    probe = textwrap.dedent(
        """
        import os, sys
        from tf_lars.cli.main import main
        code = main(["train", "--set", "training.epochs=ten"])
        class Cycle:
            def __del__(self, write=os.write):
                write(1, b"collected")
        cycle = Cycle()
        cycle.self = cycle
        del cycle
        sys.exit(code)
        """
    )
    process = run_python(probe, tmp_path, TIMEOUT)
    assert process.returncode == 2, process.stderr
    assert process.stdout == ""


# ------------------------------------------------------ one-line errors
def test_a_config_file_that_is_not_text(tmp_path, one_line_error, run_cli):
    binary = tmp_path / "b.yaml"
    binary.write_bytes(bytes(range(256)))
    code, _, err = run_cli("train", "--config", str(binary))
    assert one_line_error(code, err, "train") == (
        f"tf-lars train: error: --config {binary}: not a text file (byte 128 is "
        "not UTF-8); give a YAML file of config keys"
    )


def test_an_error_in_the_config_file_names_the_file(tmp_path, one_line_error, run_cli):
    path = tmp_path / "c.yaml"
    path.write_text("training:\n  epochs: ten\n")
    code, _, err = run_cli("train", "--config", str(path))
    assert one_line_error(code, err, "train") == (
        f"tf-lars train: error: --config {path}: `training.epochs` must be an int "
        ">= 1. Received: training.epochs='ten'"
    )
    # The same value from --set (applied last) is named as before.
    code, _, err = run_cli(
        "train", "--config", str(path), "--set", "training.epochs=eleven"
    )
    assert one_line_error(code, err, "train") == (
        "tf-lars train: error: `training.epochs` must be an int >= 1. "
        "Received: training.epochs='eleven'"
    )
    optimizer = tmp_path / "o.yaml"
    optimizer.write_text(
        "optimizer:\n  class_name: SGD\n  config: {learning_rate: 0.1, nesterov: 1}\n"
    )
    code, _, err = run_cli("train", "--config", str(optimizer))
    assert one_line_error(code, err, "train") == (
        f"tf-lars train: error: --config {optimizer}: `optimizer.config.nesterov` "
        "must be true or false. Received: optimizer.config.nesterov=1"
    )


def test_data_that_is_not_an_npz_gets_no_pickle_advice(
    tmp_path, one_line_error, run_cli
):
    npy = tmp_path / "x.npy"
    np.save(npy, np.zeros(3))
    pickled = tmp_path / "p.npz"
    np.savez(
        pickled,
        x_train=np.array([{"a": 1}], dtype=object),
        y_train=np.zeros(1),
        x_test=np.zeros((1, 2)),
        y_test=np.zeros(1),
    )
    for path, expected in (
        (npy, "not an .npz archive; the file must be what numpy.savez writes, "
         "with the numeric arrays x_train, y_train, x_test, y_test"),
        (pickled, "holds object (pickled) arrays, which are not loaded: x_train, "
         "y_train, x_test, y_test must be numeric arrays"),
    ):  # fmt: skip
        code, _, err = run_cli("train", "--set", f"data.path={path}")
        line = one_line_error(code, err, "train")
        assert line == f"tf-lars train: error: data.path={path}: {expected}"
        assert "allow_pickle" not in line


@pytest.mark.parametrize("command", ["train", "study", "lowcomm"])
def test_an_output_dir_that_cannot_hold_a_run_folder(
    command, tmp_path, one_line_error, run_cli
):
    regular = tmp_path / "file"
    regular.write_text("x")
    for output_dir, expected in (
        (regular, "`output_dir` is a file, not a folder"),
        (regular / "runs", f"`output_dir` is under {regular}, which is a file, "
         "not a folder"),
    ):  # fmt: skip
        code, _, err = run_cli(
            command, "--set", f"output_dir={output_dir}", *CHEAP[command]
        )
        assert one_line_error(code, err, command) == (
            f"tf-lars {command}: error: {expected}. Received: output_dir='{output_dir}'"
        )


@pytest.mark.parametrize("command", ["train", "study", "lowcomm"])
def test_a_read_only_output_dir(
    command, tmp_path, monkeypatch, one_line_error, run_cli
):
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    read_only.chmod(0o555)
    if os.geteuid() == 0:
        # root may write in any folder but not on a read-only file system,
        # which `os.access` reports the same way; this stands in for one.
        access = os.access
        monkeypatch.setattr(
            os,
            "access",
            lambda path, mode: access(path, mode) and str(path) != str(read_only),
        )
    try:
        code, _, err = run_cli(
            command, "--set", f"output_dir={read_only}/runs", *CHEAP[command]
        )
    finally:
        read_only.chmod(0o755)
    assert one_line_error(code, err, command) == (
        f"tf-lars {command}: error: `output_dir`: cannot write in {read_only} "
        "(permission denied or a read-only file system). "
        f"Received: output_dir='{read_only}/runs'"
    )
    assert os.listdir(read_only) == []


def test_a_run_name_longer_than_a_folder_name_is_named(
    tmp_path, one_line_error, run_cli
):
    # `mkdir` failed with "File name too long", and the line blamed
    # `output_dir`. "é" is 2 bytes in UTF-8: 150 of them are 300.
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    for run_name, size in (("a" * 300, 300), ("é" * 150, 300)):
        code, _, err = run_cli(
            "train", "--set", f"output_dir={tmp_path}/runs",
            "--set", f"run_name={run_name}", *CHEAP["train"],
        )  # fmt: skip
        assert one_line_error(code, err) == (
            f"tf-lars train: error: `run_name` must be at most {limit} bytes (in "
            "UTF-8), the file system's limit on a folder name. Received: "
            f"run_name='{run_name}' ({size} bytes)"
        )
    assert os.listdir(tmp_path) == []


# ------------------------------------------- checked before TensorFlow
@pytest.mark.parametrize(
    "argv, expected",
    [
        (["train", "--set", "training.epochs=ten"], "`training.epochs` must be"),
        (["train", "--set", "training.epochs=5"], "`schedule.warmup_epochs` must"),
        (["train", "--set", "training.batch_size=5000"], "at most the training"),
        (["train", "--set", "data.path=missing.npz"], "file not found"),
        (["train", "--set", "model.name=cnn", "--set", "data.path=flat.npz"],
         "`model.name`=cnn needs image examples"),
        (["train", "--set", "run_name=taken"], "the run folder runs/taken exists"),
        (["study", "--set", "optimizers.0.label=AdamW"], "must be unique"),
        (["study", "--set", "workload=data", "--set", "study.batch_sizes=[99999]"],
         "at most the training"),
        (["study", "--set", "search.warmup_share=[0.5, 0.1]"], "must be [low, high]"),
    ],
)  # fmt: skip
def test_config_mistakes_are_reported_before_tensorflow_is_imported(
    argv, expected, tmp_path
):
    (tmp_path / "runs" / "taken").mkdir(parents=True)
    np.savez(
        tmp_path / "flat.npz",
        x_train=np.zeros((4, 3)),
        y_train=np.arange(4) % 2,
        x_test=np.zeros((2, 3)),
        y_test=np.arange(2),
    )
    assert expected in refused_before_tensorflow(argv, tmp_path)
