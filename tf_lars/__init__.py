"""tf_lars: LARS, loss scaling and AGN optimizers for TensorFlow 2 / Keras 3.

`import tf_lars` imports TensorFlow and Keras, checks their versions
(`tf_lars/_internals.py`) and registers every public class with Keras, so
that `keras.models.load_model` finds them in saved files.

One exception: in the `tf-lars` command-line process the names below load on
first use (PEP 562), so that `tf-lars --help` answers without importing
TensorFlow; each command that trains imports them through
`load_public_names()` before it touches a config or a saved model.
"""

import importlib
import os
import sys
from typing import TYPE_CHECKING

__version__ = "0.2.0"

# Public name -> defining module. Sorted by name; one line per name.
_PUBLIC = {
    "AGN": "tf_lars.agn",
    "LAMB": "tf_lars.lamb",
    "LARS": "tf_lars.lars",
    "LossScaleOptimizer": "tf_lars.loss_scale",
    "TrustRatio": "tf_lars.trust_ratio",
    "WarmupPolynomialDecay": "tf_lars.schedules",
    "callbacks": "tf_lars.callbacks",
    "schedules": "tf_lars.schedules",
}

# The public classes, sorted (the submodules `callbacks` and `schedules` load
# with them).
__all__ = [
    "AGN",
    "LAMB",
    "LARS",
    "LossScaleOptimizer",
    "TrustRatio",
    "WarmupPolynomialDecay",
]

if TYPE_CHECKING:  # What the loading below binds, spelled out.
    from tf_lars import callbacks as callbacks
    from tf_lars import schedules as schedules
    from tf_lars.agn import AGN
    from tf_lars.lamb import LAMB
    from tf_lars.lars import LARS
    from tf_lars.loss_scale import LossScaleOptimizer
    from tf_lars.schedules import WarmupPolynomialDecay
    from tf_lars.trust_ratio import TrustRatio


def __getattr__(name):
    module_name = _PUBLIC.get(name)
    if module_name is None:
        raise AttributeError(f"module 'tf_lars' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if module_name == f"tf_lars.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))


def load_public_names():
    """Imports every public name (and so registers every class with Keras)."""
    for name in _PUBLIC:
        __getattr__(name)


def _started_as_command():
    # The console script `tf-lars` runs with its own path as argv[0];
    # `python -m tf_lars.cli[.module]` and the launcher
    # (`python -m tf_lars.distribute.launch`) show in `sys.orig_argv`. Anything else
    # (a user's program, pytest) loads eagerly; a renamed script only loses
    # the fast `--help`, never correctness.
    path = sys.argv[0] if sys.argv and sys.argv[0] else ""
    if os.path.basename(path) in ("tf-lars", "tf-lars.exe"):
        return True
    # `python -m tf_lars.cli[.module]` sets argv[0] to the module's file, and
    # the sweep's spawned worker processes get only that argv[0].
    if os.path.normpath(path).split(os.sep)[-3:-1] == ["tf_lars", "cli"]:
        return True
    original = list(getattr(sys, "orig_argv", []))
    if "-m" in original:
        module = original[original.index("-m") + 1 :][:1] or [""]
        return module[0] in ("tf_lars.cli", "tf_lars.distribute.launch") or (
            module[0].startswith("tf_lars.cli.")
        )
    return False


if not _started_as_command():
    load_public_names()
