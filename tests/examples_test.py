"""The example scripts run and do what their docstrings say."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _env():
    # The examples import `tf_lars` from this checkout (not installed).
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_train_lars_example_prints_a_falling_loss():
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "train_lars.py"),
            "--epochs",
            "4",
            "--samples",
            "2048",
            "--batch-size",
            "256",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    epochs = re.findall(r"epoch\s+\d+\s+loss (\d+\.\d+)", result.stdout)
    assert len(epochs) == 4, result.stdout
    losses = [float(x) for x in epochs]
    assert losses[-1] < losses[0], losses
    final = re.search(r"test accuracy (\d\.\d+)", result.stdout)
    assert final and float(final.group(1)) > 0.6, result.stdout


def test_agn_digits_example_checks_its_arguments_first():
    # The full run is a cluster (tests/distribute_launch_test.py); alone, the
    # script rejects bad arguments before reading TF_CONFIG or starting work.
    env = _env()
    env.pop("TF_CONFIG", None)
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "agn_digits.py"), "--period", "0"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "--period must be >= 1" in result.stderr
    assert "[agn]" not in result.stdout


TF_START_UP_LINE = re.compile(
    r"^[IWEF]\d{4} |absl::InitializeLog|cpu_feature_guard|oneDNN|cudart|cuInit", re.M
)


def test_examples_print_no_tensorflow_start_up_lines():
    # As run by a user: no TF_CPP_MIN_LOG_LEVEL in the environment.
    env = _env()
    env.pop("TF_CPP_MIN_LOG_LEVEL")
    env.pop("TF_CONFIG", None)
    train = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_lars.py"),
         "--epochs", "3", "--samples", "512", "--batch-size", "128"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert train.returncode == 0, train.stderr
    assert "test accuracy" in train.stdout
    agn = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "agn_digits.py"), "--period", "0"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert agn.returncode == 2
    for result in (train, agn):
        assert TF_START_UP_LINE.search(result.stderr) is None, result.stderr
    assert agn.stderr == (
        "error: --period must be >= 1 and --steps-per-worker >= --period\n"
    )
