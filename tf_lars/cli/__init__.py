"""The `tf-lars` command line (`pip install ".[cli]"`): train, sweep.

Modules: `main` (the argparse entry, `tf-lars = tf_lars.cli.main:main`),
`config` (YAML defaults, merging, pydantic validation), `preflight`, `data`,
`train`, `sweep` and `plots`. Only `main` and this module load for
`tf-lars --help`: neither imports TensorFlow. A command calls
`set_tensorflow_log_level` and then `import_tensorflow` before anything else.

The package may import `tf_lars` and `tf_lars.distribute`; nothing there
imports it.
"""

import contextlib
import os
import sys

__all__ = ["import_tensorflow", "set_tensorflow_log_level"]


def set_tensorflow_log_level(tf_log=False):
    """Quiets TensorFlow's C++ logging unless asked not to.

    Sets `TF_CPP_MIN_LOG_LEVEL=3` when the user has not set it and `tf_log`
    is false. Spawned worker processes (the sweep's) inherit the setting.
    It must run before TensorFlow is imported.

    Args:
        tf_log: bool, the `--tf-log` option: leave TensorFlow's own default
            (or the user's `TF_CPP_MIN_LOG_LEVEL`) in place.
    """
    if not tf_log:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _log_level():
    try:
        return int(os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0"))
    except ValueError:
        return 0


@contextlib.contextmanager
def _stderr_to_devnull():
    """Points file descriptor 2 at /dev/null (C++ writes included)."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to quiet
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def import_tensorflow():
    """Imports TensorFlow and every public `tf_lars` name, quietly.

    TensorFlow 2.21 writes a few C++ lines while it is imported (absl's
    "WARNING: All log messages before absl::InitializeLog() ...", oneDNN,
    cudart and CPU-feature notices) before it reads `TF_CPP_MIN_LOG_LEVEL`.
    With that level at 1 or more, file descriptor 2 points at /dev/null
    during the import, so the level holds from the first line on; later
    messages follow the level as usual. Python exceptions are unaffected.

    Returns:
        The `tensorflow` module.
    """
    if "tensorflow" not in sys.modules and _log_level() >= 1:
        with _stderr_to_devnull():
            import tensorflow  # noqa: F401 - imported for its side effect
    import tensorflow as tf

    import tf_lars

    tf_lars.load_public_names()
    return tf
