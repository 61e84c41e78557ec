"""Every private TensorFlow / Keras access tf_lars needs, fenced in one place.

Nothing else in tf_lars imports `tensorflow.python`, `keras.src` or
`tf.__internal__`, reads a `_private` attribute of a TensorFlow or Keras
object (inherited `self._x` included), or overrides a private Keras method
other than those in `OVERRIDDEN_HOOKS`; tests/internals_test.py checks it.
Each accessor's docstring says why no public API serves. Loading an
optimizer refuses TensorFlow or Keras below `SUPPORTED`'s floor
(`tf_lars.UnsupportedVersionError`); a newer release runs, and each access
checks itself where it is used (`tf_lars.MissingInternalError`, naming the
feature and the installed versions).

Index (the section comments below carry the same numbers):

1. `maybe_merge_call`, `strategy_supports_no_merge_call`: tf.distribute's
   merge-call switches (LARS, the loss scale).
2. `no_automatic_dependency_tracking`: untracked attributes (AGN).
3. `coordinator_of`, `cluster_resolver_of`, `watch_workers` and the
   `PerWorkerVariable` accessors: the parameter-server strategy's
   coordinator, its lost and recovered workers, and the worker-local
   variables of `tf_lars.distribute.ps_agn` (AGN).
4. `replace_symbolic_build`, `loss_tracker_of`, `set_loss_tracker`: what
   `tf_lars.distribute.enable_multi_worker_fit` changes on a model.
5. `in_xla_context`: whether the step being traced is compiled by XLA.
6. `start_fit_at_epoch`: the epoch a running `fit` starts at.
7. Keras optimizer members and the hooks in `OVERRIDDEN_HOOKS`.
8. Release differences inside the supported range, each with its release.
"""

import functools
import inspect
import os

import keras

from tf_lars.errors import MissingInternalError, UnsupportedVersionError

if keras.backend.backend() == "tensorflow":
    # Already imported by Keras: free. On the other backends TensorFlow is
    # needed only by the TensorFlow-only features (AGN, tf_lars.distribute),
    # which import it themselves.
    import tensorflow as tf
else:
    tf = None

#: The range tf_lars supports, as (floor, newest tested) `major.minor` pairs.
#: Below the floor `import tf_lars` refuses; above the newest tested release
#: it imports and runs, and each private access below checks itself where it
#: is used.
#: Keras 3.5 to 3.7 are out: their `model.fit` on several replicas does not
#: divide the loss by the number of replicas (Keras 3.8 does), so LARS's
#: unadapted biases step with twice the gradient and diverge (measured with
#: tests/mirrored_script.py; docs/guides/versions.md).
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
    """{package: version} of what the backend in use needs checked.

    TensorFlow only on its backend: on JAX and PyTorch it may be absent, or
    any release, and is never imported.
    """
    if tf is None:
        return {"keras": keras.__version__}
    return {"tensorflow": tf.__version__, "keras": keras.__version__}


def installed_versions():
    """`"tensorflow 2.21.0, keras 3.15.1"` (`"keras 3.15.1"` off TensorFlow)."""
    return ", ".join(f"{name} {version}" for name, version in _installed().items())


def check_versions(installed):
    """Raises `UnsupportedVersionError` if `installed` is below the floor.

    Newer (and unparseable, e.g. custom-built) versions pass: tf_lars cannot
    know that they break, and each private access checks itself where used.

    Args:
        installed: dict from package name (`"tensorflow"`, `"keras"`) to its
            version string; a package left out is not checked (TensorFlow
            off its backend).
    """
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
    """`tf.autograph.experimental.do_not_convert` on TensorFlow, else `function`.

    The functions it marks are plain calls with no tensor-dependent Python
    control flow: converting them would only re-read this file's source.
    """
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
    """`fn(strategy, *args)` through a merge call where the strategy needs one.

    LARS computes its trust ratios in replica context and then updates the
    variables in the strategy's merge call, as Keras's own TensorFlow
    optimizer does; under strategies that need no merge call
    (MultiWorkerMirrored) `fn` is called directly. The public
    `ReplicaContext.merge_call` would force a merge call where the strategy
    has opted out of it.
    """
    merge_call = _tf_internal("distribute.interim.maybe_merge_call", "LARS")
    return merge_call(fn, strategy, *args)


@_do_not_convert
def strategy_supports_no_merge_call():
    """Whether the current strategy updates variables without a merge call.

    The loss scale's finite check branches in replica context where it can,
    else in cross-replica context; TensorFlow has no public query.
    """
    supports = _tf_internal(
        "distribute.strategy_supports_no_merge_call", "LossScaleOptimizer"
    )
    return supports()


# 2 ---------------------------------------------------------------------------


def no_automatic_dependency_tracking(method):
    """Decorator: attributes set inside `method` are not tracked by Keras.

    AGN keeps worker-local variables (never checkpointed) on an optimizer
    without Keras tracking them into the saved state; Keras exports no
    public switch.

    Keras's own decorator is looked up when `method` runs, not when tf_lars
    is imported, so that a Keras without it fails only AGN's `build`.
    """

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
    """The `ClusterCoordinator` created for `strategy`, or None.

    TensorFlow keeps that link only in `strategy._cluster_coordinator`;
    worker-local variables need the coordinator.
    """
    return getattr(strategy, "_cluster_coordinator", None)


def cluster_resolver_of(strategy):
    """The strategy's `ClusterResolver` (public property first), or None.

    `ParameterServerStrategy` 2.21 keeps its resolver only in
    `_cluster_resolver` (the public property returns None).
    """
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
    """TensorFlow's `PerWorkerVariable` (`tensorflow.python.distribute.ps_values`).

    What `tf.Variable(..., per_worker_variable=True)` creates under a
    `ParameterServerStrategy` with a coordinator; the public entry (documented
    as experimental) gives no class an optimizer could subclass, and
    `tf_lars.distribute.ps_agn.WorkerLocalHandle` needs one (see there).
    """
    return private_member(
        _tf_modules()["ps_values"], "PerWorkerVariable", _WORKER_LOCAL_FEATURE
    )


def reads_the_coordinator_handle():
    """Whether a per-worker variable is read eagerly or while being saved.

    There its handle is the coordinator's copy; inside a traced function it
    is a call-time capture. `tensorflow.python.eager.context` and
    `saved_model.save_context` hold the two tests.
    """
    modules = _tf_modules()
    return (
        modules["context"].executing_eagerly()
        or modules["save_context"].in_save_context()
    )


def function_graph_of_branch():
    """The graph a call-time capture must go to, and the current graph.

    Inside `tf.cond` / `tf.while_loop` bodies (private control-flow graph
    classes) call-time captures are not forwarded, so the capture goes to
    the enclosing function's graph: `(that graph, the current graph)`.
    """
    graph = _tf_modules()["ops"].get_default_graph()
    function_graph = graph
    while isinstance(function_graph, _control_flow_graphs()):
        function_graph = function_graph.outer_graph
    return function_graph, graph


@functools.cache
def _control_flow_graphs():
    """TensorFlow's `tf.cond` / `tf.while_loop` body graph classes, once."""
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
    """`PerWorkerVariable._maybe_create_per_worker_vars()`: a copy per worker.

    Creates them on first use and again for a worker that restarted;
    TensorFlow calls it itself only from its own reads.
    """
    private_member(variable, "_maybe_create_per_worker_vars", _WORKER_LOCAL_FEATURE)()


def per_worker_remote_values(variable):
    """Each worker's remote value of a `PerWorkerVariable`, in worker order.

    `_per_worker_vars._values`: the public `read_all()` fails as a whole when
    one worker is down, and `ClusterCoordinator` cannot run a function on a
    chosen worker, so AGN reads each one on its own.
    """
    per_worker = private_member(variable, "_per_worker_vars", _WORKER_LOCAL_FEATURE)
    return list(private_member(per_worker, "_values", _WORKER_LOCAL_FEATURE))


def watch_workers(coordinator, lost, recovered):
    """Calls `lost(index, error)` when `coordinator` takes worker `index` for
    lost, and `recovered(index)` once it has it back.

    `ClusterCoordinator` tells that only in its log records. Its workers'
    `_on_closure_failure(closure, error)`, `_on_resource_closure_failure(
    error)` and `_on_worker_recovery()` (TensorFlow 2.21's `Worker`) are
    where it acts on both; they are wrapped here, on these instances only.
    """
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
    """Sets `variable._unique_id`, which Keras optimizers key their slots by.

    `PerWorkerVariable` leaves it None for every instance, so two of them
    would share one slot.
    """
    private_member(variable, "_unique_id", _WORKER_LOCAL_FEATURE)
    variable._unique_id = unique_id


# 4 ---------------------------------------------------------------------------


_LOCAL_BUILD_FEATURE = "enable_multi_worker_fit"


def replace_symbolic_build(model, build):
    """Makes `model.fit` / `evaluate` build the model with `build` (this
    instance only); returns Keras's `Model._symbolic_build(data_batch=...)`.

    Keras 3.15's `fit`/`evaluate` under `MultiWorkerMirroredStrategy` first
    pass a tuple of `PerReplica` batches to `strategy.reduce("MEAN", ...)`
    in `Model._maybe_symbolic_build` only to learn their shapes, and the
    collective ops cannot reduce a tuple ("Attempt to convert a value
    (PerReplica...) to a Tensor"). No public hook exists: the reduction runs
    before Keras checks whether anything needs building. `build(iterator=None,
    data_batch=None)` takes its place as an instance attribute; used only by
    `tf_lars.distribute.enable_multi_worker_fit`, which users call.
    """
    private_member(model, "_maybe_symbolic_build", _LOCAL_BUILD_FEATURE)
    symbolic_build = private_member(model, "_symbolic_build", _LOCAL_BUILD_FEATURE)
    model._maybe_symbolic_build = build
    return symbolic_build


def loss_tracker_of(model):
    """`Model._loss_tracker`: the metric `compile` made for the logged loss."""
    return private_member(model, "_loss_tracker", _LOCAL_BUILD_FEATURE)


@no_automatic_dependency_tracking
def set_loss_tracker(model, make_tracker):
    """Replaces `Model._loss_tracker` by `make_tracker()`, made and set
    untracked, as `compile` makes and sets it."""
    private_member(model, "_loss_tracker", _LOCAL_BUILD_FEATURE)
    model._loss_tracker = make_tracker()


# 5 ---------------------------------------------------------------------------


def in_xla_context():
    """Whether the graph being built is compiled by XLA (`jit_compile=True`).

    The norms take the form that is fastest there (`tf_lars._tf_fast`).
    TensorFlow exposes no public query; a wrong answer costs only speed,
    never a result.
    """
    enclosing = _tf_internal("get_enclosing_xla_context", "LARS and LAMB")
    return enclosing() is not None


# 6 ---------------------------------------------------------------------------


def start_fit_at_epoch(model, epoch):
    """Makes the running (or next) `fit` start at `epoch`; None: Keras's default.

    `fit` reads `Model._initial_epoch` (`self._initial_epoch or
    initial_epoch`): the only way a callback can choose the epoch a running
    `fit` starts at. Keras's own `BackupAndRestore` sets the same attribute.
    """
    private_member(model, "_initial_epoch", "BackupAndRestore")
    model._initial_epoch = epoch


# 7 ---------------------------------------------------------------------------
# Keras optimizer internals: private members of `keras.optimizers.Optimizer`
# (TensorFlow backend) and `Adam` that tf_lars's optimizers read or call. An
# optimizer that updates several variables at once (LARS's batched trust
# ratios, LAMB's fused Adam step) needs the per-variable index, the slots and
# the backend's all-reduce; Keras exposes them only to its own subclasses.
# Each accessor checks that the member is there and names the feature that
# needs it; a fallback stands where a release lacks it (noted per function).

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
    """`Optimizer._overwrite_variable_with_gradient(variable)`.

    Keras 3.11 added the method; before it (3.8 to 3.10) the same rule is
    the variable's `overwrite_with_gradient` attribute, read here directly.
    """
    check = getattr(optimizer, "_overwrite_variable_with_gradient", None)
    if check is None:
        return getattr(variable, "overwrite_with_gradient", False)
    return check(variable)


def keras_update_step(optimizer):
    """Keras's own `_backend_update_step` of `optimizer`, bound: its loop of
    `update_step` over the variables (on TensorFlow, across replicas).
    `tf_lars.LAMB` runs its rule through it, under its own override."""
    return functools.partial(keras.optimizers.Optimizer._backend_update_step, optimizer)


def own_update_step(optimizer):
    """`optimizer`'s own `_backend_update_step`, bound: its loop of
    `update_step` over the variables (Nadam's `_u_product` advances in it).

    On the torch backend Keras's `TorchParallelOptimizer` (`keras.src.
    backend.torch.optimizers.torch_parallel_optimizer`) updates every
    variable with `torch._foreach_*` and never calls `update_step`: its
    definition is skipped for the next one in the class's MRO (the Keras
    parent's, which steps variable by variable). `tf_lars.TrustRatio` runs
    a foreign optimizer's step through it.
    """
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
    """`keras.saving.serialize_keras_object(optimizer)`, naming the public class.

    The torch backend builds its own subclasses of nine Keras optimizers
    (`keras.optimizers.SGD()` there is a `keras.src.backend.torch...SGD`, read
    from Keras 3.15), and Keras records that module, so a file saved there
    would need PyTorch to load anywhere. Recording `keras.optimizers`, as the
    other backends do, lets each backend build its own class again.
    """
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


#: Keras hook methods tf_lars's optimizers override, with the parameters they
#: take: a dependency on private names as real as a read. `check_hooks` and
#: tests/internals_test.py compare them with the installed Keras.
OVERRIDDEN_HOOKS = {
    "_backend_update_step": ("grads", "trainable_variables", "learning_rate"),
    "_apply_weight_decay": ("variables",),
    "_get_current_learning_rate": (),
}


def check_hooks(optimizer):
    """Raises `MissingInternalError` unless Keras still calls the hooks as assumed.

    Args:
        optimizer: a tf_lars optimizer that overrides `OVERRIDDEN_HOOKS`.
    """
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
    """The `keras.optimizers.LossScaleOptimizer` whose `build` is building
    `optimizer` as its inner optimizer right now, or None.

    A loss scale around a wrapper that holds one already (DiLoCo, AGN)
    unscales every gradient twice; `model.compile` adds one under
    mixed_float16. Keras 3.15's `LossScaleOptimizer.__init__` sets
    `inner.loss_scale_factor = None`, Keras 3.8's does not (both measured):
    what every release in the range does is call `inner_optimizer.build`
    from its own `build`. So the calling frames are read for that `self`.
    """
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
    """`Optimizer.add_optimizer_variables`: one slot per model variable.

    Keras 3.11 added it (not in 3.8; 3.11.3 measured); before it, one
    `add_variable_from_reference` per variable, which is what it does.
    """
    add = getattr(optimizer, "add_optimizer_variables", None)
    if add is not None:
        return add(variables, name, initializer=initializer)
    return [
        optimizer.add_variable_from_reference(v, name=name, initializer=initializer)
        for v in variables
    ]


def backing_variable(variable):
    """The `tf.Variable` behind a Keras variable, as the strategy knows it.

    A Keras variable on the TensorFlow backend wraps its `tf.Variable` (its
    `value`); the strategy's `extended.update` asserts it gets the
    `tf.Variable` itself (measured: LARS under MirroredStrategy). Anything
    that already is a `tf.Variable` passes through.
    """
    if tf is not None and not isinstance(variable, tf.Variable):
        return variable.value
    return variable


def finish_wrapper_build(optimizer, var_list):
    """Runs the base `Optimizer.build` that Keras's `LossScaleOptimizer.build` skips.

    Through Keras 3.11 (3.11.3 measured) that `build` never
    calls `super().build()`, so the wrapper's `_trainable_variables` stay
    empty; Keras 3.15 calls it. Runs it where it did not run.
    """
    if not trainable_variables_of(optimizer) and var_list:
        keras.optimizers.Optimizer.build(optimizer, list(var_list))
