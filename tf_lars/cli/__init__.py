"""The `tf-lars` command line (`pip install ".[cli]"`): train, study, lowcomm.

Modules: `main` (the argparse entry, `tf-lars = tf_lars.cli.main:main`),
`config` (YAML defaults, merging, pydantic validation), `preflight`, `data`,
`train`, `study` (with `nqm`), `lowcomm` and `plots`. Only `main` and this
module load for `tf-lars --help`: neither imports TensorFlow. A command calls
`set_tensorflow_log_level` and then `import_tensorflow` before anything else.

The package may import `tf_lars` and `tf_lars.distribute`; nothing there
imports it. Its quiet start (the levels here) needs nothing from
`tf_lars.distribute`.
"""

import logging
import os
import sys
import time

__all__ = ["import_tensorflow", "quiet_python_logs", "set_tensorflow_log_level"]

LEVEL_ENV = "TF_CPP_MIN_LOG_LEVEL"
STARTED = time.perf_counter()  # the command's start: a study times its preparation


def set_tensorflow_log_level(tf_log=False):
    """Quiets TensorFlow's C++ logging in this process and its children.

    Sets `TF_CPP_MIN_LOG_LEVEL=3` unless the user has set it or `tf_log` is
    true. It must run before TensorFlow is imported.
    """
    if not tf_log:
        os.environ.setdefault(LEVEL_ENV, "3")


def import_tensorflow():
    """Imports TensorFlow, quietly, and every public `tf_lars` name.

    TensorFlow 2.21 writes a few C++ lines while it is imported (absl's
    "WARNING: All log messages before absl::InitializeLog() ...", oneDNN,
    cudart and CPU-feature notices) before it reads `TF_CPP_MIN_LOG_LEVEL`.
    With that level at 1 or more, file descriptor 2 points at /dev/null
    during the import, so the level holds from the first line on. Python
    exceptions are unaffected.
    """
    if "tensorflow" not in sys.modules and _level() >= 1:
        sys.stderr.flush()
        saved = None
        try:
            saved = os.dup(2)
        except OSError:  # no stderr to quiet
            pass
        if saved is not None:
            try:
                with open(os.devnull, "w") as devnull:
                    os.dup2(devnull.fileno(), 2)
                import tensorflow  # noqa: F401 - imported for its side effect
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
    import tensorflow as tf

    import tf_lars

    tf_lars.load_public_names()
    return tf


def _level():
    try:
        return int(os.environ.get(LEVEL_ENV, "0"))
    except ValueError:
        return 0


def quiet_python_logs():
    """Sets TensorFlow's and absl's Python loggers to ERROR."""
    import absl.logging

    absl.logging.set_verbosity(absl.logging.ERROR)
    logging.getLogger("tensorflow").setLevel(logging.ERROR)
