"""Each optimizer's subclass for the running Keras backend.

Keras's own pattern (`keras/src/backend/torch/optimizers/`, where
`TorchOptimizer.__new__` swaps `SGD` for `TorchSGD`): the rule files hold
the portable rule in `keras.ops`, and on the TensorFlow backend
`tf_lars.LARS(...)`, `tf_lars.TrustRatio(...)` and `tf_lars.LAMB(...)`
construct the subclass of `tf_lars/backend/tensorflow.py`, which overrides
methods with TensorFlow's fused kernels, sparse rows and cross-replica
steps. The subclasses keep the public class's name, module and registered
name, so configs and saved files read the same. A user's subclass of a
public class gets the same overrides (a class made once, on first use).
"""

import functools

import keras


@functools.cache
def subclass(cls):
    """The class that `cls(...)` constructs on the running backend."""
    if keras.backend.backend() != "tensorflow":
        return cls
    from tf_lars.backend import tensorflow

    if cls in tensorflow.SUBCLASSES or issubclass(cls, tensorflow.CompiledApply):
        return tensorflow.SUBCLASSES.get(cls, cls)
    for public, fast in tensorflow.SUBCLASSES.items():
        if issubclass(cls, public):  # a user's subclass, e.g. of LARS
            return tensorflow.with_name_of(cls, type(cls.__name__, (fast, cls), {}))
    return cls


class BackendSubclass:
    """Mixin (first in the bases): construct the backend's subclass."""

    def __new__(cls, *args, **kwargs):
        return super().__new__(subclass(cls))
