"""Every private TensorFlow / Keras access tf_lars needs, fenced in one place.

Nothing else in tf_lars imports `tensorflow.python`, `keras.src` or
`tf.__internal__`, reads a `_private` member of a TensorFlow or Keras object,
or overrides a private Keras method outside `OVERRIDDEN_HOOKS`
(tests/internals_test.py). Loading an optimizer refuses TensorFlow or Keras
below `SUPPORTED`'s floor; newer releases run, and each accessor checks
itself where used (`MissingInternalError` naming the feature and versions).
Sections: 1 tf.distribute's merge call; 2 untracked attributes; 3 the
parameter-server coordinator and worker-local variables; 4 multi-worker
`fit`; 5 XLA; 6 `fit`'s start epoch; 7 Keras optimizer members and hooks;
8 release differences in the supported range, each with its release.
"""

import functools
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
    if tf is None:
        return function
    return tf.autograph.experimental.do_not_convert(function)


def _tf_internal(path, feature):
    """`tf.__internal__.<path>`, checked as `private_member` checks."""
    owner = tf.__internal__
    for name in path.split("."):
        try:
            owner = getattr(owner, name)
        except AttributeError:
            raise _missing(feature, f"`tf.__internal__.{path}`") from None
    return owner


def private_member(owner, name, feature):
    """`owner.<name>`, or `MissingInternalError` naming `feature` and versions."""
    try:
        return getattr(owner, name)
    except AttributeError:
        kind = type(owner).__name__
        raise _missing(feature, f"`{kind}.{name}`") from None


def _private_module(path, feature):
    """Imports a private module (`keras.src...`, `tensorflow.python...`) on use."""
    import importlib

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
    supports = _tf_internal(
        "distribute.strategy_supports_no_merge_call", "LossScaleOptimizer"
    )
    return supports()


# 2 ---------------------------------------------------------------------------


def no_automatic_dependency_tracking(method):
    """Decorator: attributes set inside `method` are not tracked by Keras
    (AGN's worker-local state); Keras's own decorator, looked up on use."""

    @functools.wraps(method)
    def untracked(*args, **kwargs):
        tracking = _private_module("keras.src.utils.tracking", "AGN")
        keras_decorator = private_member(
            tracking, "no_automatic_dependency_tracking", "AGN"
        )
        return keras_decorator(method)(*args, **kwargs)

    return untracked


# 3 ---------------------------------------------------------------------------


def coordinator_of(strategy):
    """`strategy._cluster_coordinator`: the `ClusterCoordinator`, or None."""
    return getattr(strategy, "_cluster_coordinator", None)


def cluster_resolver_of(strategy):
    """The strategy's `ClusterResolver`; `ParameterServerStrategy` 2.21 keeps it
    only in `_cluster_resolver` (the public property returns None)."""
    return strategy.cluster_resolver or getattr(strategy, "_cluster_resolver", None)


_WORKER_LOCAL_FEATURE = "AGN under ParameterServerStrategy"


@functools.cache
def _tf_modules():
    """TensorFlow's private modules worker-local variables need, on first use."""
    return {
        name.rpartition(".")[2]: _private_module(
            f"tensorflow.python.{name}", _WORKER_LOCAL_FEATURE
        )
        for name in (
            "distribute.ps_values",
            "eager.context",
            "framework.ops",
            "ops.control_flow_v2_func_graphs",
            "saved_model.save_context",
        )
    }


def per_worker_variable_class():
    """`ps_values.PerWorkerVariable`, which
    `tf_lars.distribute.ps_agn.WorkerLocalHandle` subclasses (no public class)."""
    return private_member(
        _tf_modules()["ps_values"], "PerWorkerVariable", _WORKER_LOCAL_FEATURE
    )


def reads_the_coordinator_handle():
    """Whether a per-worker variable is read eagerly or while being saved
    (its handle is then the coordinator's copy)."""
    modules = _tf_modules()
    return (
        modules["context"].executing_eagerly()
        or modules["save_context"].in_save_context()
    )


def function_graph_of_branch():
    """`(enclosing function graph, current graph)`: call-time captures inside
    `tf.cond` / `tf.while_loop` bodies are not forwarded."""
    graph = _tf_modules()["ops"].get_default_graph()
    function_graph = graph
    while isinstance(function_graph, _control_flow_graphs()):
        function_graph = function_graph.outer_graph
    return function_graph, graph


@functools.cache
def _control_flow_graphs():
    """TensorFlow's `tf.cond` / `tf.while_loop` body graph classes."""
    graphs = _tf_modules()["control_flow_v2_func_graphs"]
    return tuple(
        private_member(graphs, name, _WORKER_LOCAL_FEATURE)
        for name in ("CondBranchFuncGraph", "WhileBodyFuncGraph", "WhileCondFuncGraph")
    )


def coordinator_handle(variable):
    """`PerWorkerVariable._coordinator_instance.handle`: the coordinator's copy."""
    instance = private_member(variable, "_coordinator_instance", _WORKER_LOCAL_FEATURE)
    return instance.handle


def create_per_worker_values(variable):
    """`PerWorkerVariable._maybe_create_per_worker_vars()`: a copy per worker
    (again for a restarted one)."""
    private_member(variable, "_maybe_create_per_worker_vars", _WORKER_LOCAL_FEATURE)()


def per_worker_remote_values(variable):
    """`_per_worker_vars._values`, in worker order: `read_all()` fails as a
    whole when one worker is down."""
    per_worker = private_member(variable, "_per_worker_vars", _WORKER_LOCAL_FEATURE)
    return list(private_member(per_worker, "_values", _WORKER_LOCAL_FEATURE))


def watch_workers(coordinator, lost, recovered):
    """Calls `lost(index, error)` / `recovered(index)` as `coordinator` loses
    and regains worker `index`: TensorFlow 2.21's `Worker._on_closure_failure`,
    `_on_resource_closure_failure` and `_on_worker_recovery`, wrapped on
    these instances (the coordinator says it only in log records)."""
    feature = "the parameter-server trainer's worker status lines"
    cluster = private_member(coordinator, "_cluster", feature)
    for worker in private_member(cluster, "workers", feature):
        index = private_member(worker, "worker_index", feature)
        for name, report in (
            ("_on_closure_failure", lambda *a, i=index: lost(i, a[-1])),
            ("_on_resource_closure_failure", lambda *a, i=index: lost(i, a[-1])),
            ("_on_worker_recovery", lambda i=index: recovered(i)),
        ):
            method = private_member(worker, name, feature)
            setattr(worker, name, _reported(method, report))


def _reported(method, report):
    def reported(*args):
        report(*args)
        return method(*args)

    return reported


def set_unique_id(variable, unique_id):
    """Sets `variable._unique_id` (Keras keys slots by it; `PerWorkerVariable`
    leaves it None for every instance)."""
    private_member(variable, "_unique_id", _WORKER_LOCAL_FEATURE)
    variable._unique_id = unique_id


# 4 ---------------------------------------------------------------------------


_LOCAL_BUILD_FEATURE = "enable_multi_worker_fit"


def replace_symbolic_build(model, build):
    """Makes `fit`/`evaluate` build `model` with `build` (this instance) and
    returns Keras's `Model._symbolic_build`: Keras 3.15 under MWMS reduces a
    tuple of `PerReplica` batches in `_maybe_symbolic_build`, which the
    collective ops cannot (`tf_lars.distribute.enable_multi_worker_fit`)."""
    private_member(model, "_maybe_symbolic_build", _LOCAL_BUILD_FEATURE)
    symbolic_build = private_member(model, "_symbolic_build", _LOCAL_BUILD_FEATURE)
    model._maybe_symbolic_build = build
    return symbolic_build


def loss_tracker_of(model):
    """`Model._loss_tracker`: the metric `compile` made for the logged loss."""
    return private_member(model, "_loss_tracker", _LOCAL_BUILD_FEATURE)


@no_automatic_dependency_tracking
def set_loss_tracker(model, make_tracker):
    """Replaces `Model._loss_tracker` by `make_tracker()`, untracked, as
    `compile` sets it."""
    private_member(model, "_loss_tracker", _LOCAL_BUILD_FEATURE)
    model._loss_tracker = make_tracker()


# 5 ---------------------------------------------------------------------------


def in_xla_context():
    """Whether the graph being built is compiled by XLA (no public query; a
    wrong answer costs speed, never a result)."""
    enclosing = _tf_internal("get_enclosing_xla_context", "LARS and LAMB")
    return enclosing() is not None


# 6 ---------------------------------------------------------------------------


def start_fit_at_epoch(model, epoch):
    """Sets `Model._initial_epoch`, which `fit` reads (as Keras's own
    `BackupAndRestore` does): the epoch a running `fit` starts at."""
    private_member(model, "_initial_epoch", "BackupAndRestore")
    model._initial_epoch = epoch


# 7 ---------------------------------------------------------------------------

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


def keras_update_step(optimizer):
    """Keras's `Optimizer._backend_update_step`, bound (LAMB's loop)."""
    return functools.partial(keras.optimizers.Optimizer._backend_update_step, optimizer)


def own_update_step(optimizer):
    """`optimizer`'s own `_backend_update_step`, bound (Nadam advances
    `_u_product` in it); on torch, skipping Keras's `TorchParallelOptimizer`
    (Keras 3.15), which never calls `update_step`."""
    parallel = None
    if keras.backend.backend() == "torch":
        module = _private_module(
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


def check_hooks(optimizer):
    """Raises `MissingInternalError` unless Keras calls `OVERRIDDEN_HOOKS` so."""
    base = keras.optimizers.Optimizer
    for name, parameters in OVERRIDDEN_HOOKS.items():
        hook = getattr(base, name, None)
        found = None if hook is None else tuple(inspect.signature(hook).parameters)
        if found != ("self", *parameters):
            raise _missing(
                type(optimizer).__name__,
                f"Keras to call `Optimizer.{name}(self, {', '.join(parameters)})`"
                f" (found {found})",
            )


# 8 ---------------------------------------------------------------------------
# Release differences, each with the release that changed it.


def building_loss_scale(optimizer):
    """The Keras `LossScaleOptimizer` whose `build` is building `optimizer`
    now, or None: a loss scale around DiLoCo/AGN would unscale twice. Keras
    3.15 resets `inner.loss_scale_factor`, 3.8 does not; every release
    builds its inner optimizer from its `build`, so the frames are read."""
    frame = inspect.currentframe().f_back
    for _ in range(8):  # the wrapper's build and a decorator or two above it
        frame = frame.f_back if frame is not None else None
        owner = frame.f_locals.get("self") if frame is not None else None
        if (
            isinstance(owner, keras.optimizers.LossScaleOptimizer)
            and getattr(owner, "inner_optimizer", None) is optimizer
        ):
            return owner
    return None


def add_optimizer_variables(optimizer, variables, name, initializer="zeros"):
    """`Optimizer.add_optimizer_variables` (Keras 3.11+); before it, one
    `add_variable_from_reference` per variable."""
    add = getattr(optimizer, "add_optimizer_variables", None)
    if add is not None:
        return add(variables, name, initializer=initializer)
    return [
        optimizer.add_variable_from_reference(v, name=name, initializer=initializer)
        for v in variables
    ]


def backing_variable(variable):
    """The `tf.Variable` behind a Keras variable (the strategy's
    `extended.update` needs it); a `tf.Variable` passes through."""
    if tf is not None and not isinstance(variable, tf.Variable):
        return variable.value
    return variable


def finish_wrapper_build(optimizer, var_list):
    """Runs the base `Optimizer.build` that Keras's `LossScaleOptimizer.build`
    skips through Keras 3.11 (3.15 calls it)."""
    if not trainable_variables_of(optimizer) and var_list:
        keras.optimizers.Optimizer.build(optimizer, list(var_list))
