"""Shared test set-up: quiet TensorFlow logs, a fresh Keras state per test, and
the command line's harness (`run_cli`, `one_line_error`) as fixtures."""

import inspect
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# Keras's state is reset before every test. `clear_session()`'s default also
# runs a full `gc.collect()`, which is slow once TensorFlow is loaded (a
# fifth of the optimizer tests' time, measured in the closing note of this
# change) and resets nothing Keras keeps; Python's own collector still runs.
_CLEAR = {"free_memory": False}
if "free_memory" not in inspect.signature(keras.backend.clear_session).parameters:
    _CLEAR = {}


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    keras.backend.clear_session(**_CLEAR)
    keras.utils.set_random_seed(1234)
    np.random.seed(1234)
    yield


@pytest.fixture
def run_cli(capsys):
    """`run_cli(*argv)`: `tf-lars ARGV` in this process, as `(code, out, err)`."""
    from tf_lars.cli.main import main

    def run(*argv):
        code = main(list(argv))
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


def _one_line_error(code, err, command="train"):
    """The one error line of a refused `tf-lars COMMAND`, checked.

    Exit status 2, no traceback, and stderr exactly one line that starts
    with `tf-lars COMMAND: error: `; returns that line.
    """
    assert code == 2, err
    assert "Traceback" not in err, err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    line = err.rstrip("\n")
    assert line.startswith(f"tf-lars {command}: error: "), err
    return line


@pytest.fixture
def one_line_error():
    """`one_line_error(code, err, command="train")`: the checked error line."""
    return _one_line_error
