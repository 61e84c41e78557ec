"""Each optimizer's subclass for the running Keras backend.

Keras's own pattern (`keras/src/backend/torch/optimizers/`, where
`TorchOptimizer.__new__` swaps `SGD` for `TorchSGD`): the rule files hold
the portable rule in `keras.ops`, and `tf_lars.LARS(...)`,
`tf_lars.TrustRatio(...)` and `tf_lars.LAMB(...)` construct the running
backend's subclass: `tf_lars/backend/tensorflow.py` (fused kernels, sparse
rows, cross-replica steps, XLA's compile-time tricks), `jax.py` (what
`jax.jit` needs to keep the norms in one pass) or `torch.py` (the norms'
range check as a branch `torch.compile` traces without breaking its graph).
The subclasses keep the public class's name, module and registered name, so
configs and saved files read the same. A user's subclass of a public class
gets the same overrides (a class made once, on first use).
"""

import functools
import importlib

import keras


@functools.cache
def subclass(cls):
    """The class that `cls(...)` constructs on the running backend."""
    backend = keras.backend.backend()
    if backend not in ("tensorflow", "jax", "torch"):
        return cls
    fast_classes = importlib.import_module(f"tf_lars.backend.{backend}").SUBCLASSES
    if any(issubclass(cls, fast) for fast in fast_classes.values()):
        return cls
    for public, fast in fast_classes.items():
        if issubclass(cls, public):  # the public class, or a user's subclass
            if cls is public:
                return fast
            return with_name_of(cls, type(cls.__name__, (fast, cls), {}))
    return cls


def with_name_of(public, cls):
    """`cls` with `public`'s name, module, docstring and registered name, so
    that configs and saved files read as `public`'s."""
    cls.__name__, cls.__qualname__ = public.__name__, public.__qualname__
    cls.__module__, cls.__doc__ = public.__module__, public.__doc__
    registered = keras.saving.get_registered_name(public)
    if registered != public.__name__:  # registered as "package>name"
        package, _, name = registered.partition(">")
        keras.saving.register_keras_serializable(package, name)(cls)
        # `cls` serializes under that name, but the name still loads `public`,
        # whose constructor picks the running backend's subclass: importing
        # another backend's module (the docs build, a test importing every
        # module) must not make saved files load as that backend's class.
        keras.saving.get_custom_objects()[registered] = public
    return cls


def like(public):
    """Class decorator: `with_name_of(public, cls)`."""
    return lambda cls: with_name_of(public, cls)


def eagerly(function):
    """`function()` outside any traced function: Keras may build an optimizer
    inside the first traced train step, where XLA cannot lift a variable whose
    initial value reads another variable (TensorFlow's `init_scope`; JAX and
    PyTorch build outside their traces)."""
    if keras.backend.backend() != "tensorflow":
        return function()
    import tensorflow as tf

    with tf.init_scope():
        return function()


class BackendSubclass:
    """Mixin (first in the bases): construct the backend's subclass."""

    def __new__(cls, *args, **kwargs):
        return super().__new__(subclass(cls))
