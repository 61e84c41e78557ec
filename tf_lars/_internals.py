"""Every private TensorFlow / Keras access tf_lars needs, fenced in one place.

Nothing else in tf_lars imports `tensorflow.python`, `keras.src` or
`tf.__internal__`, reads a `_private` attribute of a TensorFlow or Keras
object (inherited `self._x` included), or overrides a private Keras method
other than those in `OVERRIDDEN_HOOKS`; tests/internals_test.py checks it.
Each access below says why no public API serves (the documentation's
development guide shows this list; it is kept only here).

Versions: loading an optimizer refuses only TensorFlow or Keras older than
the floor in `SUPPORTED` (`UnsupportedVersionError`, naming the installed
versions and the range; `TF_LARS_SKIP_VERSION_CHECK=1` tries anyway). On the
JAX and PyTorch backends only the Keras floor applies, and TensorFlow is not
imported (this module imports it only when Keras runs on it). Newer releases
import and run: nothing private is imported when tf_lars loads, and each
access checks itself where it is used, raising `MissingInternalError` with
the feature and the installed versions if a release removed it.
Where releases differ, the shim is here (section 11), with the release that
changed it.

The accesses:

1. `maybe_merge_call` (`tf.__internal__.distribute.interim`): LARS computes
   its trust ratios in replica context and then enters the strategy's merge
   call to update the variables, exactly as Keras's own TensorFlow optimizer
   does. Under strategies that need no merge call (MultiWorkerMirrored) it
   calls the function directly. `ReplicaContext.merge_call` is public but
   would force a merge call where the strategy has opted out of it.
2. `strategy_supports_no_merge_call` (`tf.__internal__.distribute`): the loss
   scale wrapper decides whether its finite check can branch in replica
   context (no merge call) or must branch in cross-replica context.
3. `no_automatic_dependency_tracking` (`keras.src.utils.tracking`): AGN keeps
   worker-local variables (never checkpointed) on an optimizer without Keras
   tracking them into the saved state. Keras exports no public switch.
4. `WorkerLocalVariable` (subclass of `tensorflow.python.distribute.ps_values.
   PerWorkerVariable`, plus the `context`, `ops`, `save_context` and
   control-flow graph modules it needs): AGN's worker-local copies under
   `ParameterServerStrategy`. TensorFlow's `per_worker_variable=True` (the
   public entry, documented as experimental) re-captures its handle on every
   access inside a `tf.function`, so reads and writes get reordered; see the
   class docstring. There is no public per-worker variable that an optimizer
   can update in program order. Its `read_each_worker()` reads each worker's
   value through `_per_worker_vars`: the public `read_all()` fails as a whole
   when one worker is down, and `ClusterCoordinator` cannot run a function on
   a chosen worker.
5. `coordinator_of(strategy)` (`strategy._cluster_coordinator`): whether a
   `ClusterCoordinator` exists for a strategy. TensorFlow keeps that link only
   in this attribute; worker-local variables need the coordinator.
   `cluster_resolver_of(strategy)`: the public `strategy.cluster_resolver`,
   else `strategy._cluster_resolver`; `ParameterServerStrategy` 2.21 keeps
   its resolver only there (the public property returns None).
6. `base_optimizer_keyword_args()` (`keras.src.optimizers.optimizer`): the
   text Keras's own optimizers splice into their docstrings for the base
   arguments (`clipnorm`, `use_ema`, ...); LARS's docstring includes it. Keras
   exports it nowhere public. Read inside a `try`: if Keras moves it, a short
   pointer stands in and `import tf_lars` still works.
7. `build_from_local_batch(model)` (overrides the instance's
   `Model._maybe_symbolic_build` and calls `Model._symbolic_build`, both
   `keras.src.backend.tensorflow.trainer` / `keras.src.trainers.trainer`):
   Keras 3.15's `model.fit`/`evaluate` under `MultiWorkerMirroredStrategy`
   first pass a tuple of `PerReplica` batches to `strategy.reduce("MEAN",
   ...)` only to learn their shapes, and the collective cross-device ops
   cannot reduce a tuple ("Attempt to convert a value (PerReplica...) to a
   Tensor"). The override builds from this worker's first local batch (only
   shapes and dtypes matter). There is no public hook: the reduction runs
   before Keras checks whether anything needs building. Used only by
   `tf_lars.distribute.enable_multi_worker_fit`, which users call explicitly.
   Where Keras writes metric variables through on every replica (3.8), the
   same function replaces the loss tracker `Model._loss_tracker` (untracked,
   as `compile` sets it) and builds the compiled metrics under a variable
   creator that makes their `"sum"` variables sum on read, as Keras does
   since keras-team/keras#21072.
8. `in_xla_context()` (`tf.__internal__.get_enclosing_xla_context`): whether
   the step being traced will be compiled by XLA. The norms of
   `tf_lars._tf_fast.squared_norm` take the form that is fastest there:
   folded into a matrix-vector product under XLA (a full reduction is a
   serial loop), one `MatMul` of the flat tensor with itself otherwise
   (half the time of `reduce_sum(square(x))`, no temporary). TensorFlow
   exposes no public query; a wrong answer only costs speed, never a result.
9. `start_fit_at_epoch(model, epoch)` (`Model._initial_epoch`, read by
   `fit` as `self._initial_epoch or initial_epoch`): the only way a callback
   can choose the epoch a running `fit` starts at. Keras's own
   `BackupAndRestore` sets the same attribute;
   `tf_lars.distribute.BackupAndRestore` sets it to the restored epoch and
   back to None (Keras's default) when `fit` ends.
10. Keras optimizer members (`variable_index`, `all_reduce_sum_gradients`,
   `distribution_strategy`, `uses_weight_decay`, `trainable_variables_of`,
   `check_variables_are_known`, `learning_rate_setting`,
   `iterations_variable`, `adam_slots`, `overwrites_with_gradient`) and the
   hooks LARS and TrustRatio override (`OVERRIDDEN_HOOKS`:
   `_backend_update_step`, `_apply_weight_decay`, and LARS's
   `_get_current_learning_rate`, `learning_rate_at_update_count`): a Keras optimizer
   subclass that updates several variables at once (LARS's batched trust
   ratios, LAMB's fused Adam step) needs the per-variable index, the slots
   and the TensorFlow backend's all-reduce; Keras exposes them only to its
   own subclasses.
11. Release differences: `add_optimizer_variables` (Keras 3.11),
   `backing_variable` (`keras.Variable` as the base class, Keras 3.8),
   `unaggregated()` (`aggregation="none"`, Keras 3.7), `finish_wrapper_build`
   (`LossScaleOptimizer.build` calls `super().build()` after 3.11).
"""

import contextlib
import functools
import inspect
import itertools
import os

import keras

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


class UnsupportedVersionError(ImportError):
    """The installed TensorFlow or Keras is older than tf_lars supports."""


class MissingInternalError(RuntimeError):
    """A private TensorFlow / Keras member tf_lars uses is gone or changed."""


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


# 1 and 2 -------------------------------------------------------------------


@_do_not_convert
def maybe_merge_call(fn, strategy, *args):
    """`fn(strategy, *args)` through a merge call where the strategy needs one."""
    merge_call = _tf_internal("distribute.interim.maybe_merge_call", "LARS")
    return merge_call(fn, strategy, *args)


@_do_not_convert
def strategy_supports_no_merge_call():
    """Whether the current strategy updates variables without a merge call."""
    supports = _tf_internal(
        "distribute.strategy_supports_no_merge_call", "LossScaleOptimizer"
    )
    return supports()


# 3 ---------------------------------------------------------------------------


def no_automatic_dependency_tracking(method):
    """Decorator: attributes set inside `method` are not tracked by Keras.

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


# 4 and 5 ---------------------------------------------------------------------


def coordinator_of(strategy):
    """The `ClusterCoordinator` created for `strategy`, or None."""
    return getattr(strategy, "_cluster_coordinator", None)


def cluster_resolver_of(strategy):
    """The strategy's `ClusterResolver` (public property first), or None."""
    return strategy.cluster_resolver or getattr(strategy, "_cluster_resolver", None)


_ids = itertools.count()


_WORKER_LOCAL_FEATURE = "AGN under ParameterServerStrategy"


@functools.cache
def _tf_modules():
    """TensorFlow's private modules that `WorkerLocalVariable` needs, on first use."""
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


@functools.cache
def _control_flow_graphs():
    graphs = _tf_modules()["control_flow_v2_func_graphs"]
    return tuple(
        private_member(graphs, name, _WORKER_LOCAL_FEATURE)
        for name in ("CondBranchFuncGraph", "WhileBodyFuncGraph", "WhileCondFuncGraph")
    )


class _WorkerLocalHandle:
    """A `PerWorkerVariable` whose handle is captured once per traced function.

    AGN keeps a local copy of the model, the gradient accumulators and the
    local optimizer slots on each worker. TensorFlow's
    `tf.Variable(..., per_worker_variable=True)` (a private `PerWorkerVariable`)
    is the mechanism, but as shipped it is unusable for an optimizer: every
    access to its `handle` inside a `tf.function` captures a *new* call-time
    placeholder, so automatic control dependencies see unrelated resources and
    reorder reads and writes (measured: two `assign_add`s followed by a read
    returned the initial value).

    This mixin captures the worker's handle under a stable key, so every op
    in a traced function refers to one placeholder and runs in program order.
    Inside `tf.cond` / `tf.while_loop` bodies (which do not forward call-time
    captures; TF documents per-worker variables as unreadable in `tf.cond`
    branches) it captures the handle in the enclosing function and passes it
    into the branch as an ordinary captured tensor, so a loss-scale
    optimizer's conditional update works on worker-local variables, with or
    without XLA. Everything else (creation on each worker, re-creation when a
    restarted worker comes back, `read_all`) is TensorFlow's own.

    Caveats (TensorFlow's, unchanged): values are lost when a worker restarts
    (the variable is re-created with its initial value), they are never
    checkpointed, and they must not be created inside a `tf.function`.
    `worker_local_variable_class()` joins it to TensorFlow's class on first
    use, so that `import tf_lars` never touches `PerWorkerVariable`.
    """

    def __init__(self, strategy, next_creator, **kwargs):
        super().__init__(strategy, next_creator, **kwargs)
        # Keras optimizers key their slots by `_unique_id`; PerWorkerVariable
        # leaves it None for every instance.
        self._unique_id = f"tf_lars_worker_local_{next(_ids)}"
        self._capture_key = ("tf_lars_worker_local", self._unique_id)

    @property
    def handle(self):
        modules = _tf_modules()
        if (
            modules["context"].executing_eagerly()
            or modules["save_context"].in_save_context()
        ):
            return self._coordinator_instance.handle
        self._maybe_create_per_worker_vars()
        closure, spec = self.handle_call_time_value()
        graph = modules["ops"].get_default_graph()
        function_graph = graph
        while isinstance(function_graph, _control_flow_graphs()):
            function_graph = function_graph.outer_graph
        with function_graph.as_default():
            handle = function_graph.capture_call_time_value(
                closure, spec, key=self._capture_key
            )
        if function_graph is graph:
            return handle
        return graph.capture(handle)

    def read_each_worker(self):
        """Each worker's value as a NumPy value, None for a worker that is down."""
        self._maybe_create_per_worker_vars()
        values = []
        for remote in self._per_worker_vars._values:
            try:
                values.append(remote.get().numpy())
            except Exception:  # noqa: BLE001 - a failed worker reads as None
                values.append(None)
        return values


@functools.cache
def worker_local_variable_class():
    """`WorkerLocalVariable`: `_WorkerLocalHandle` over TF's `PerWorkerVariable`."""
    base = private_member(
        _tf_modules()["ps_values"], "PerWorkerVariable", _WORKER_LOCAL_FEATURE
    )
    return type("WorkerLocalVariable", (_WorkerLocalHandle, base), {})


@contextlib.contextmanager
def worker_local_scope(strategy):
    """Variables created in this scope are `WorkerLocalVariable`s.

    Args:
        strategy: the `tf.distribute.ParameterServerStrategy`; a
            `ClusterCoordinator` must already exist for it.
    """
    if coordinator_of(strategy) is None:
        raise ValueError(
            "Create `tf.distribute.coordinator.ClusterCoordinator(strategy)` "
            "before building worker-local variables."
        )

    variable_class = worker_local_variable_class()

    def creator(next_creator, **kwargs):
        # Colocation with a parameter-server variable and the strategy's own
        # per-worker flag do not apply: the variable lives on every worker.
        kwargs.pop("colocate_with", None)
        kwargs.pop("per_worker_variable", None)
        return variable_class(strategy, next_creator, **kwargs)

    with tf.variable_creator_scope(creator):
        yield


# 6 ---------------------------------------------------------------------------


def base_optimizer_keyword_args():
    """Keras's docstring text for the base optimizer's keyword arguments.

    LARS's docstring includes it, as Keras's own optimizers do. Read when
    `tf_lars.lars` is imported; if Keras moved it, a short pointer stands in,
    so that a Keras change cannot break `import tf_lars`.
    """
    try:
        from keras.src.optimizers import optimizer as keras_optimizer
    except ImportError:
        keras_optimizer = None
    text = getattr(keras_optimizer, "base_optimizer_keyword_args", None)
    if not isinstance(text, str):
        return (
            "**kwargs: the `keras.optimizers.Optimizer` base arguments "
            "(`clipnorm`, `use_ema`, ...)."
        )
    return text


# 7 ---------------------------------------------------------------------------


def build_from_local_batch(model):
    """Makes `model` build its state from a local batch, not a reduced one.

    Sets an instance attribute that replaces Keras's `_maybe_symbolic_build`
    for this model only: the first batch of the distributed iterator is
    taken, each `DistributedValues` replaced by this worker's first local
    value, and Keras's own `_symbolic_build` runs on it in the strategy's
    scope. The class and other models are unchanged. Where Keras writes
    metric variables on every replica (3.8; `_metrics_sync_on_write`), the
    loss tracker and the compiled metrics are made to sum on read instead,
    so that `fit` logs the loss of the global batch.
    """
    strategy = model.distribute_strategy
    feature = "enable_multi_worker_fit"
    private_member(model, "_maybe_symbolic_build", feature)
    symbolic_build = private_member(model, "_symbolic_build", feature)
    on_write = _metrics_sync_on_write(model)

    def first_local(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return strategy.experimental_local_results(value)[0]
        return value

    def local_symbolic_build(iterator=None, data_batch=None):
        if iterator is not None:
            # Keras's epoch iterator yields (begin, end, tf iterator) from
            # Keras 3.11 on and (step, tf iterator) in 3.8: the last item.
            for item in iterator:
                data_batch = next(item[-1])
                break
        if data_batch is not None:
            data_batch = tf.nest.map_structure(first_local, data_batch)
        with contextlib.ExitStack() as stack:
            stack.enter_context(strategy.scope())
            if on_write:
                stack.enter_context(tf.variable_creator_scope(_sum_on_read))
            symbolic_build(data_batch=data_batch)

    model._maybe_symbolic_build = local_symbolic_build
    if on_write:
        _renew_loss_tracker_on_read(model)
    return model


def _sum_on_read(next_creator, **kwargs):
    """Variable creator: a `"sum"` variable with no synchronization set is
    created `ON_READ` (each replica keeps its own part; a read sums them).
    Only Keras metrics create `"sum"` variables."""
    if (
        kwargs.get("aggregation") == tf.VariableAggregation.SUM
        and kwargs.get("synchronization", tf.VariableSynchronization.AUTO)
        == tf.VariableSynchronization.AUTO
    ):
        kwargs["synchronization"] = tf.VariableSynchronization.ON_READ
    return next_creator(**kwargs)


def _metrics_sync_on_write(model):
    """Whether this Keras writes metric variables through on every replica.

    Keras 3.8 creates a metric's `"sum"` variables as mirrored (`ON_WRITE`)
    variables, and a metric updates them with `assign(total + value)`: under
    a strategy with several replicas each write is summed over the replicas,
    so the running totals double at each step and `fit` logs a wrong loss
    (tests/distribute_multi_worker_test.py, on the oldest pair). Keras
    creates them `ON_READ` since keras-team/keras#21072 (March 2025; 3.11
    does); the weights were never affected.
    """
    tracker = private_member(model, "_loss_tracker", "enable_multi_worker_fit")
    if tracker is None or not tracker.variables:
        return False
    value = backing_variable(tracker.variables[0])
    return (
        isinstance(value, tf.distribute.DistributedValues)
        and value.synchronization != tf.VariableSynchronization.ON_READ
    )


@no_automatic_dependency_tracking
def _renew_loss_tracker_on_read(model):
    """Replaces the loss tracker `compile` made by one whose variables sum on
    read (as `compile` sets it: untracked); `_symbolic_build` creates the
    compiled metrics the same way (`build_from_local_batch`)."""
    with model.distribute_strategy.scope(), tf.variable_creator_scope(_sum_on_read):
        model._loss_tracker = keras.metrics.Mean(name="loss")


# 8 ---------------------------------------------------------------------------


def in_xla_context():
    """Whether the graph being built is compiled by XLA (`jit_compile=True`)."""
    enclosing = _tf_internal("get_enclosing_xla_context", "LARS and LAMB")
    return enclosing() is not None


# 9 ---------------------------------------------------------------------------


def start_fit_at_epoch(model, epoch):
    """Makes the running (or next) `fit` start at `epoch`; None: Keras's default."""
    private_member(model, "_initial_epoch", "BackupAndRestore")
    model._initial_epoch = epoch


# 10 --------------------------------------------------------------------------
# Keras optimizer internals: private members of `keras.optimizers.Optimizer`
# (TensorFlow backend) and `Adam` that tf_lars's optimizers read or call.
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


def learning_rate_at_update_count(optimizer):
    """The current learning rate, a schedule evaluated at the count of updates.

    Keras's `Optimizer._get_current_learning_rate` (the `learning_rate`
    property) calls a schedule with `_iterations`, which counts micro-batches
    when `gradient_accumulation_steps = k` is set (Keras 3.8 to 3.15): the
    schedule would run k times too fast. Here it is called with
    `_iterations // k`, the number of updates taken so far, so that k
    accumulated micro-batches take the step one big batch would.
    """
    setting = learning_rate_setting(optimizer)
    steps = optimizer.gradient_accumulation_steps
    if steps and isinstance(setting, keras.optimizers.schedules.LearningRateSchedule):
        micro_steps = iterations_variable(optimizer)
        return setting(keras.ops.floor_divide(micro_steps, steps))
    return keras.optimizers.Optimizer._get_current_learning_rate(optimizer)


def adam_slots(optimizer, index):
    """`Adam._momentums[index]`, `Adam._velocities[index]`: LAMB's m and v."""
    momentums = private_member(optimizer, "_momentums", "LAMB")
    velocities = private_member(optimizer, "_velocities", "LAMB")
    return momentums[index], velocities[index]


def overwrites_with_gradient(optimizer, variable):
    """`Optimizer._overwrite_variable_with_gradient(variable)`.

    Keras 3.11 added the method; before it (3.5 to 3.10) the same rule is
    the variable's `overwrite_with_gradient` attribute, read here directly.
    """
    check = getattr(optimizer, "_overwrite_variable_with_gradient", None)
    if check is None:
        return getattr(variable, "overwrite_with_gradient", False)
    return check(variable)


def per_variable_update_step(optimizer):
    """`optimizer._backend_update_step`, or the one that steps variable by variable.

    The torch backend swaps in its own subclasses of nine Keras optimizers
    (`keras.src.backend.torch.optimizers`) whose `_backend_update_step` steps
    every variable at once with `torch._foreach_*`, never calling
    `update_step`; their Keras parent's (Nadam's included) takes the same
    step one variable at a time through `update_step` (TrustRatio needs that).
    """
    for klass in type(optimizer).__mro__:
        if "_backend_update_step" in vars(klass) and not klass.__module__.startswith(
            "keras.src.backend.torch."
        ):
            return functools.partial(klass._backend_update_step, optimizer)
    return optimizer._backend_update_step


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


# 11 --------------------------------------------------------------------------
# Release differences, each with the release that changed it.


def add_optimizer_variables(optimizer, variables, name, initializer="zeros"):
    """`Optimizer.add_optimizer_variables`: one slot per model variable.

    Keras 3.11 added it (not in 3.5 to 3.8; 3.11.3 measured); before it, one
    `add_variable_from_reference` per variable, which is what it does.
    """
    add = getattr(optimizer, "add_optimizer_variables", None)
    if add is not None:
        return add(variables, name, initializer=initializer)
    return [
        optimizer.add_variable_from_reference(v, name=name, initializer=initializer)
        for v in variables
    ]


def unaggregated():
    """The `aggregation` of a counter every replica advances identically.

    `"none"`, as Keras's `LossScaleOptimizer` gives its own step counter;
    Keras 3.5 and 3.6 refuse `"none"` (3.7 added it) and gave that counter
    the default, `"mean"`.
    """
    version = _major_minor(keras.__version__) or (99, 0)
    return "none" if version >= (3, 7) else "mean"


def backing_variable(variable):
    """The `tf.Variable` behind a Keras variable, as the strategy knows it.

    In Keras 3.5 to 3.7 the variables layers create are not instances of
    `keras.Variable` (an export-only subclass; 3.8 made it the base class),
    so the test is "not a `tf.Variable`" (measured: LARS under
    MirroredStrategy failed `distribution.extended.update`'s assertion).
    """
    if tf is not None and not isinstance(variable, tf.Variable):
        return variable.value
    return variable


def finish_wrapper_build(optimizer, var_list):
    """Runs the base `Optimizer.build` that Keras's `LossScaleOptimizer.build` skips.

    Through Keras 3.11 (3.5, 3.6 and 3.11.3 measured) that `build` never
    calls `super().build()`, so the wrapper's `_trainable_variables` stay
    empty; Keras 3.15 calls it. Runs it where it did not run.
    """
    if not trainable_variables_of(optimizer) and var_list:
        keras.optimizers.Optimizer.build(optimizer, list(var_list))
