"""tf_lars: LARS, LAMB, TrustRatio and loss scaling for Keras 3; AGN for TensorFlow.

`import tf_lars` imports neither Keras nor TensorFlow: the public names below
load on first use (PEP 562 `__getattr__`), the same way in every process, so
that `tf-lars --help` answers at once and a JAX or PyTorch user never pays
TensorFlow's start-up. Loading an optimizer imports Keras (and, on Keras's
TensorFlow backend, TensorFlow) and checks their versions
(`tf_lars/_internals.py`). TensorFlow is an optional dependency (the
`tensorflow` extra): the optimizers run without it on JAX and PyTorch, and
the TensorFlow-only `AGN` and `tf_lars.distribute` name the extra when it is
missing (`_require_tensorflow_backend`).

Saved files: Keras looks a saved class up only in its registry of custom
objects. So that `keras.models.load_model` finds a tf_lars optimizer in a
program that only did `import tf_lars`, each registered name gets a stand-in
in that registry as soon as Keras is imported (at once if it already is);
deserializing through a stand-in loads the real class, which then replaces
it. `load_public_names()` loads and registers every name at once.
"""

import importlib
import importlib.util
import json
import os
import sys
from typing import TYPE_CHECKING

__version__ = "0.3.0"

# Public name -> defining module. Sorted by name; one line per name.
_PUBLIC = {
    "AGN": "tf_lars.agn",
    "DiLoCo": "tf_lars.diloco",
    "GradientNoiseScale": "tf_lars.noise_scale",
    "LAMB": "tf_lars.lamb",
    "LARS": "tf_lars.lars",
    "LossScaleOptimizer": "tf_lars.loss_scale",
    "MissingInternalError": "tf_lars.errors",
    "TrustRatio": "tf_lars.trust_ratio",
    "UnsupportedVersionError": "tf_lars.errors",
    "WarmupPolynomialDecay": "tf_lars.schedules",
    "callbacks": "tf_lars.callbacks",
    "schedules": "tf_lars.schedules",
}

# The public classes and errors, sorted (the submodules `callbacks` and `schedules` load
# with them).
__all__ = [
    "AGN",
    "DiLoCo",
    "GradientNoiseScale",
    "LAMB",
    "LARS",
    "LossScaleOptimizer",
    "MissingInternalError",
    "TrustRatio",
    "UnsupportedVersionError",
    "WarmupPolynomialDecay",
]

if TYPE_CHECKING:  # What the loading below binds, spelled out.
    from tf_lars import callbacks as callbacks
    from tf_lars import schedules as schedules
    from tf_lars.agn import AGN
    from tf_lars.diloco import DiLoCo
    from tf_lars.errors import MissingInternalError, UnsupportedVersionError
    from tf_lars.lamb import LAMB
    from tf_lars.lars import LARS
    from tf_lars.loss_scale import LossScaleOptimizer
    from tf_lars.noise_scale import GradientNoiseScale
    from tf_lars.schedules import WarmupPolynomialDecay
    from tf_lars.trust_ratio import TrustRatio


def __getattr__(name):
    module_name = _PUBLIC.get(name)
    # Only an identifier can name a submodule: `find_spec("tf_lars.x.y")`
    # would import `tf_lars.x`, and raise ModuleNotFoundError where a module
    # `__getattr__` raises AttributeError (`hasattr(tf_lars, "x.y")`).
    if (
        module_name is None
        and name.isidentifier()
        and importlib.util.find_spec(f"tf_lars.{name}")
    ):
        # A submodule (`tf_lars.lars.ALL_1D`): bound on first use, as an
        # eager import of the package used to bind it.
        module_name = f"tf_lars.{name}"
    if module_name is None:
        raise AttributeError(f"module 'tf_lars' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if module_name == f"tf_lars.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))


def load_public_names():
    """Imports every public name (and so registers every class with Keras).

    On a backend other than TensorFlow the TensorFlow-only `AGN` is left out.
    """
    for name in _PUBLIC:
        if name != "AGN" or _keras_backend() == "tensorflow":
            __getattr__(name)


# Every name tf_lars registers with Keras ("tf_lars>NAME") -> defining module.
_REGISTERED = {
    "AGN": "tf_lars.agn",
    "DiLoCo": "tf_lars.diloco",
    "GradientNoiseScale": "tf_lars.noise_scale",
    "GradientNoiseScaleMonitor": "tf_lars.callbacks",
    "LAMB": "tf_lars.lamb",
    "LARS": "tf_lars.lars",
    "LossScaleMonitor": "tf_lars.callbacks",
    "LossScaleOptimizer": "tf_lars.loss_scale",
    "TrustRatio": "tf_lars.trust_ratio",
    "TrustRatioMonitor": "tf_lars.callbacks",
    "WarmupPolynomialDecay": "tf_lars.schedules",
}


class _RegisteredStandIn:
    """Keras's registry entry for a tf_lars class whose module is not loaded.

    Keras deserializes a registered object with `entry.from_config(config)`
    (inside its custom-object scope); this loads the real class (whose
    decorator replaces the entry) and hands the config to it.
    """

    def __init__(self, name):
        self.__name__ = name
        self.module = _REGISTERED[name]

    def from_config(self, config):
        cls = getattr(importlib.import_module(self.module), self.__name__)
        return cls.from_config(config)


def _register_stand_ins():
    import keras

    registry = keras.saving.get_custom_objects()
    for name in _REGISTERED:
        registry.setdefault(f"tf_lars>{name}", _RegisteredStandIn(name))


class _WhenKerasLoads:
    """A one-shot import hook: registers the stand-ins once `keras` has run."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "keras":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        execute_keras = spec.loader.exec_module

        def exec_module(module):
            execute_keras(module)
            _register_stand_ins()

        spec.loader.exec_module = exec_module
        return spec


def _keras_backend():
    """The Keras backend name, without importing Keras if it is not loaded.

    Keras's own order: the `KERAS_BACKEND` variable, else the `backend` of
    `keras.json` in `$KERAS_HOME` (default `~/.keras`), else "tensorflow".
    """
    keras = sys.modules.get("keras")
    if keras is not None and hasattr(keras, "backend"):
        return keras.backend.backend()
    if os.environ.get("KERAS_BACKEND"):
        return os.environ["KERAS_BACKEND"]
    home = os.environ.get("KERAS_HOME") or os.path.join(
        os.path.expanduser("~"), ".keras"
    )
    try:
        with open(os.path.join(home, "keras.json")) as config:
            return json.load(config).get("backend", "tensorflow")
    except (OSError, ValueError, AttributeError):
        return "tensorflow"


def _require_tensorflow_backend(feature):
    """Raises ImportError for a TensorFlow-only `feature` where it cannot run.

    Without TensorFlow installed (`pip install tf_lars` alone brings Keras and
    NumPy only), a `ModuleNotFoundError` naming the extra that brings it; with
    TensorFlow installed but Keras on another backend, an `ImportError` saying
    which backend to set. Checked before Keras or TensorFlow is imported.
    """
    if importlib.util.find_spec("tensorflow") is None:
        raise ModuleNotFoundError(
            f"{feature} needs TensorFlow, which is not installed: install it "
            'with `pip install "tf_lars[tensorflow]"` and run it on Keras\'s '
            "TensorFlow backend (KERAS_BACKEND=tensorflow).",
            name="tensorflow",
        )
    backend = _keras_backend()
    if backend != "tensorflow":
        raise ImportError(
            f"{feature} needs TensorFlow: it runs only on Keras's TensorFlow "
            f"backend, and Keras is set to the {backend!r} backend. Set "
            "KERAS_BACKEND=tensorflow to use it."
        )


if "keras" in sys.modules:
    _register_stand_ins()
else:
    sys.meta_path.insert(0, _WhenKerasLoads())
