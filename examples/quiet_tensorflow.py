"""Imports TensorFlow without its C++ start-up lines, as `tf-lars` does.

TensorFlow 2.21 writes a few C++ lines while it is imported (absl's
"WARNING: All log messages before absl::InitializeLog() ...", cudart and
cuInit notices) before it reads `TF_CPP_MIN_LOG_LEVEL`. The examples import
this module before anything else: it sets that level to 3 unless the
environment sets it, and while TensorFlow is imported it points file
descriptor 2 at /dev/null (only when the level is 1 or more, so
`TF_CPP_MIN_LOG_LEVEL=0 python examples/...` shows every line). Python
exceptions are unaffected: the import is the only thing silenced.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _quiet_import():
    try:
        level = int(os.environ["TF_CPP_MIN_LOG_LEVEL"])
    except ValueError:
        level = 0
    if level < 1 or "tensorflow" in sys.modules:
        import tensorflow  # noqa: F401 - imported for its side effect

        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        import tensorflow  # noqa: F401 - imported for its side effect
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


_quiet_import()
