"""Every private TensorFlow / Keras access of tf_lars's core, fenced in one place.

Nothing else in tf_lars imports `tensorflow.python`, `keras.src` or
`tf.__internal__`, reads a `_private` member of a TensorFlow or Keras object,
or overrides a private Keras method outside `OVERRIDDEN_HOOKS`
(tests/internals_test.py); `tf_lars.distribute` keeps its own accessors in
`tf_lars/distribute/_internals.py`, built on this module's. Loading an
optimizer refuses TensorFlow or Keras below `SUPPORTED`'s floor; newer
releases run, and each accessor checks itself where used
(`MissingInternalError` naming the feature and versions). Sections:
1 tf.distribute's merge call; 2 untracked attributes; 3 XLA; 4 Keras
optimizer members and hooks (with the release that added one, where it differs).
"""

import functools
import importlib
import inspect
import os

import keras

from tf_lars.errors import MissingInternalError, UnsupportedVersionError

if keras.backend.backend() == "tensorflow":
    # Already imported by Keras; elsewhere only AGN and distribute need it.
    import tensorflow as tf
else:
    tf = None

#: (floor, newest tested) `major.minor`. Keras 3.5 to 3.7 are out: their
#: `fit` on several replicas does not divide the loss by the replica count
#: (docs/guides/versions.md).
SUPPORTED = {"tensorflow": ((2, 16), (2, 21)), "keras": ((3, 8), (3, 15))}


def _major_minor(version):
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def _range_text(name):
    (low_major, low_minor), (high_major, high_minor) = SUPPORTED[name]
    return f"{name}>={low_major}.{low_minor} (tested through {high_major}.{high_minor})"


def _installed():
    """{package: version} to check (TensorFlow only on its backend)."""
    if tf is None:
        return {"keras": keras.__version__}
    return {"tensorflow": tf.__version__, "keras": keras.__version__}


def installed_versions():
    """`"tensorflow 2.21.0, keras 3.15.1"` (`"keras 3.15.1"` off TensorFlow)."""
    return ", ".join(f"{name} {version}" for name, version in _installed().items())


def check_versions(installed):
    """Raises `UnsupportedVersionError` if `installed` ({package: version};
    a package left out is not checked) is below the floor; newer and
    unparseable versions pass."""
    names = [name for name in SUPPORTED if name in installed]
    below = []
    for name in names:
        version = _major_minor(installed[name])
        if version is not None and version < SUPPORTED[name][0]:
            below.append(name)
    if below:
        found = ", ".join(f"{name} {installed[name]}" for name in names)
        wanted = ", ".join(_range_text(name) for name in names)
        raise UnsupportedVersionError(
            f"tf_lars {'/'.join(below)} version too old: installed {found}; "
            f"tf_lars supports {wanted}. Upgrade, or set "
            "TF_LARS_SKIP_VERSION_CHECK=1 to try at your own risk."
        )


if os.environ.get("TF_LARS_SKIP_VERSION_CHECK", "") in ("", "0"):
    check_versions(_installed())


def _missing(feature, what):
    tested = " and ".join(_range_text(name) for name in _installed())
    return MissingInternalError(
        f"tf_lars {feature} needs {what}, which the installed versions "
        f"({installed_versions()}) do not have. tf_lars is tested with "
        f"{tested}; please report this with "
        f"{'both versions' if len(_installed()) > 1 else 'the version'}."
    )


def _do_not_convert(function):
    """`tf.autograph.experimental.do_not_convert` on TensorFlow, else `function`."""
    return (
        function if tf is None else tf.autograph.experimental.do_not_convert(function)
    )


def _tf_internal(path, feature):
    """`tf.__internal__.<path>`, checked as `private_member` checks."""
    try:
        return functools.reduce(getattr, path.split("."), tf.__internal__)
    except AttributeError:
        raise _missing(feature, f"`tf.__internal__.{path}`") from None


def private_member(owner, name, feature):
    """`owner.<name>`, or `MissingInternalError` naming `feature` and versions."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise _missing(feature, f"`{type(owner).__name__}.{name}`") from None


def private_module(path, feature):
    """Imports a private module (`keras.src...`, `tensorflow.python...`) on use."""
    try:
        return importlib.import_module(path)
    except ImportError:
        raise _missing(feature, f"the module `{path}`") from None


# 1 ---------------------------------------------------------------------------


@_do_not_convert
def maybe_merge_call(fn, strategy, *args):
    """`fn(strategy, *args)` through a merge call where the strategy needs one
    (`tf.__internal__`; the public `merge_call` would force one where a
    strategy opted out): LARS's cross-replica update."""
    merge_call = _tf_internal("distribute.interim.maybe_merge_call", "LARS")
    return merge_call(fn, strategy, *args)


@_do_not_convert
def strategy_supports_no_merge_call():
    """Whether the current strategy updates without a merge call (the loss
    scale's finite check); TensorFlow has no public query."""
    name = "distribute.strategy_supports_no_merge_call"
    return _tf_internal(name, "LossScaleOptimizer")()


# 2 ---------------------------------------------------------------------------


def no_automatic_dependency_tracking(method):
    """Decorator: attributes set inside `method` are not tracked by Keras
    (AGN's worker-local state); Keras's own decorator, looked up on use."""

    @functools.wraps(method)
    def untracked(*args, **kwargs):
        tracking = private_module("keras.src.utils.tracking", "AGN")
        keras_decorator = private_member(
            tracking, "no_automatic_dependency_tracking", "AGN"
        )
        return keras_decorator(method)(*args, **kwargs)

    return untracked


# 3 ---------------------------------------------------------------------------


def in_xla_context():
    """Whether the graph being built is compiled by XLA (no public query; a
    wrong answer costs speed, never a result)."""
    enclosing = _tf_internal("get_enclosing_xla_context", "LARS and LAMB")
    return enclosing() is not None


# 4 ---------------------------------------------------------------------------

_OPTIMIZERS = "LARS, LAMB, TrustRatio and LossScaleOptimizer"


def variable_index(optimizer, variable):
    """`Optimizer._get_variable_index`: the variable's position in `build`."""
    find = private_member(optimizer, "_get_variable_index", _OPTIMIZERS)
    return find(variable)


def all_reduce_sum_gradients(optimizer, grads_and_vars):
    """`TFOptimizer._all_reduce_sum_gradients`: the cross-replica gradient sum."""
    reduce = private_member(optimizer, "_all_reduce_sum_gradients", "LARS")
    return reduce(grads_and_vars)


def distribution_strategy(optimizer):
    """`TFOptimizer._distribution_strategy`: the strategy it was created under."""
    return private_member(optimizer, "_distribution_strategy", "LARS")


def uses_weight_decay(optimizer, variable):
    """`Optimizer._use_weight_decay`: Keras's own exclusion list for `variable`."""
    check = private_member(optimizer, "_use_weight_decay", "LARS and TrustRatio")
    return check(variable)


def trainable_variables_of(optimizer):
    """`Optimizer._trainable_variables`: the model variables it was built with."""
    return private_member(optimizer, "_trainable_variables", _OPTIMIZERS)


def check_variables_are_known(optimizer, variables):
    """`Optimizer._check_variables_are_known`: raises for unbuilt variables."""
    check = private_member(optimizer, "_check_variables_are_known", _OPTIMIZERS)
    check(variables)


def learning_rate_setting(optimizer):
    """`Optimizer._learning_rate`: the float, variable, schedule or callable given."""
    return private_member(optimizer, "_learning_rate", _OPTIMIZERS)


def iterations_variable(optimizer):
    """`Optimizer._iterations`: the step counter behind the `iterations` property."""
    return private_member(optimizer, "_iterations", "LARS and AGN")


def adam_slots(optimizer, index):
    """`Adam._momentums[index]`, `Adam._velocities[index]`: LAMB's m and v."""
    momentums = private_member(optimizer, "_momentums", "LAMB")
    velocities = private_member(optimizer, "_velocities", "LAMB")
    return momentums[index], velocities[index]


def overwrites_with_gradient(optimizer, variable):
    """`Optimizer._overwrite_variable_with_gradient(variable)` (Keras 3.11+);
    before it, the variable's `overwrite_with_gradient` attribute."""
    check = getattr(optimizer, "_overwrite_variable_with_gradient", None)
    if check is None:
        return getattr(variable, "overwrite_with_gradient", False)
    return check(variable)


def track_variable(optimizer, variable):
    """`Optimizer._track_variable`: `variable` becomes part of its state."""
    private_member(optimizer, "_track_variable", "wrappers")(variable)


def keras_update_step(optimizer):
    """Keras's `Optimizer._backend_update_step`, bound (LAMB's loop)."""
    return functools.partial(keras.optimizers.Optimizer._backend_update_step, optimizer)


def own_update_step(optimizer):
    """`optimizer`'s own `_backend_update_step`, bound (Nadam advances
    `_u_product` in it); on torch, skipping Keras's `TorchParallelOptimizer`
    (Keras 3.15), which never calls `update_step`."""
    parallel = None
    if keras.backend.backend() == "torch":
        module = private_module(
            "keras.src.backend.torch.optimizers.torch_parallel_optimizer",
            "TrustRatio",
        )
        parallel = private_member(module, "TorchParallelOptimizer", "TrustRatio")
    for klass in type(optimizer).__mro__:
        if "_backend_update_step" in vars(klass) and klass is not parallel:
            return functools.partial(klass._backend_update_step, optimizer)
    return private_member(optimizer, "_backend_update_step", "TrustRatio")


def portable_optimizer_config(optimizer):
    """`serialize_keras_object(optimizer)` naming `keras.optimizers` where the
    torch backend's own subclass (Keras 3.15) would record its module."""
    config = keras.saving.serialize_keras_object(optimizer)
    name = config.get("class_name")
    public = getattr(keras.optimizers, name, None) if name else None
    if (
        str(config.get("module", "")).startswith("keras.src.backend.torch.")
        and isinstance(public, type)
        and isinstance(optimizer, public)
    ):
        config = {**config, "module": "keras.optimizers", "registered_name": None}
    return config


#: Keras hooks tf_lars overrides, with their parameters (`check_hooks`).
OVERRIDDEN_HOOKS = {
    "_backend_update_step": ("grads", "trainable_variables", "learning_rate"),
    "_apply_weight_decay": ("variables",),
    "_get_current_learning_rate": (),
}


def check_hooks(feature, base=keras.optimizers.Optimizer, hooks=OVERRIDDEN_HOOKS):
    """Raises `MissingInternalError` (naming `feature`) unless Keras's `base`
    has `hooks` ({name: parameters after self}) with those parameters."""
    for name, parameters in hooks.items():
        hook = getattr(base, name, None)
        found = None if hook is None else tuple(inspect.signature(hook).parameters)
        wanted = ("self", *parameters)
        if found != wanted:
            call = f"{base.__name__}.{name}({', '.join(wanted)})"
            raise _missing(feature, f"Keras to call `{call}` (found {found})")
