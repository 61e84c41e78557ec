"""Every private TensorFlow / Keras access tf_lars needs, fenced in one place.

Nothing else in tf_lars imports `tensorflow.python`, `keras.src` or
`tf.__internal__`, or reads a `_private` attribute of a TensorFlow object.
Each access below says why no public API serves (the documentation's
development guide shows this list; it is kept only here). They were written
against, and are tested with, the versions in `SUPPORTED`; importing this
module (which `import tf_lars` does) with any other installed version raises
`UnsupportedVersionError`, naming both installed versions and the supported
range, instead of failing later in an obscure way. Set
`TF_LARS_SKIP_VERSION_CHECK=1` to try other versions at your own risk.

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
8. `in_xla_context()` (`tf.__internal__.get_enclosing_xla_context`): whether
   the step being traced will be compiled by XLA. The norms of
   `tf_lars._lars_fast.squared_norm` take the form that is fastest there:
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
"""

import contextlib
import itertools
import os

import keras
import tensorflow as tf

#: The versions every access below was written against and is tested with,
#: as (lowest included, highest excluded) `major.minor` pairs.
SUPPORTED = {"tensorflow": ((2, 21), (2, 22)), "keras": ((3, 15), (3, 16))}


class UnsupportedVersionError(ImportError):
    """The installed TensorFlow or Keras is outside tf_lars's tested range."""


def _major_minor(version):
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def _range_text(name):
    (low_major, low_minor), (high_major, high_minor) = SUPPORTED[name]
    return f"{name}>={low_major}.{low_minor},<{high_major}.{high_minor}"


def check_versions(installed):
    """Raises `UnsupportedVersionError` unless `installed` is in `SUPPORTED`.

    Args:
        installed: dict from package name (`"tensorflow"`, `"keras"`) to its
            version string.
    """
    outside = []
    for name, (low, high) in SUPPORTED.items():
        version = _major_minor(installed[name])
        if version is None or not low <= version < high:
            outside.append(name)
    if outside:
        found = ", ".join(f"{name} {installed[name]}" for name in SUPPORTED)
        wanted = ", ".join(_range_text(name) for name in SUPPORTED)
        raise UnsupportedVersionError(
            f"tf_lars {'/'.join(outside)} version not supported: installed "
            f"{found}; tf_lars supports {wanted} (it uses private TensorFlow/Keras "
            "internals that are checked against these versions; see "
            "tf_lars/_internals.py). Install a supported version, or set "
            "TF_LARS_SKIP_VERSION_CHECK=1 to try at your own risk."
        )


if os.environ.get("TF_LARS_SKIP_VERSION_CHECK", "") in ("", "0"):
    check_versions({"tensorflow": tf.__version__, "keras": keras.__version__})

# The imports are after the check: on an unsupported version they may be the
# first thing to fail, and the check's message is the one that should show.
from keras.src.utils import tracking as _keras_tracking  # noqa: E402
from tensorflow.python.distribute import ps_values as _ps_values  # noqa: E402
from tensorflow.python.eager import context as _context  # noqa: E402
from tensorflow.python.framework import ops as _ops  # noqa: E402
from tensorflow.python.ops import (  # noqa: E402
    control_flow_v2_func_graphs as _control_flow_graphs,
)
from tensorflow.python.saved_model import save_context as _save_context  # noqa: E402

# 1 and 2 -------------------------------------------------------------------


# Not converted by AutoGraph: plain calls, no tensor-dependent Python control
# flow, and converting them would only re-read this file's source.
@tf.autograph.experimental.do_not_convert
def maybe_merge_call(fn, strategy, *args):
    """`fn(strategy, *args)` through a merge call where the strategy needs one."""
    return tf.__internal__.distribute.interim.maybe_merge_call(fn, strategy, *args)


@tf.autograph.experimental.do_not_convert
def strategy_supports_no_merge_call():
    """Whether the current strategy updates variables without a merge call."""
    return tf.__internal__.distribute.strategy_supports_no_merge_call()


# 3 ---------------------------------------------------------------------------

#: Decorator: attributes set inside the method are not tracked by Keras.
no_automatic_dependency_tracking = _keras_tracking.no_automatic_dependency_tracking


# 4 and 5 ---------------------------------------------------------------------


def coordinator_of(strategy):
    """The `ClusterCoordinator` created for `strategy`, or None."""
    return getattr(strategy, "_cluster_coordinator", None)


def cluster_resolver_of(strategy):
    """The strategy's `ClusterResolver` (public property first), or None."""
    return strategy.cluster_resolver or getattr(strategy, "_cluster_resolver", None)


_ids = itertools.count()
_CONTROL_FLOW_GRAPHS = (
    _control_flow_graphs.CondBranchFuncGraph,
    _control_flow_graphs.WhileBodyFuncGraph,
    _control_flow_graphs.WhileCondFuncGraph,
)


class WorkerLocalVariable(_ps_values.PerWorkerVariable):
    """A `PerWorkerVariable` whose handle is captured once per traced function.

    AGN keeps a local copy of the model, the gradient accumulators and the
    local optimizer slots on each worker. TensorFlow 2.21's
    `tf.Variable(..., per_worker_variable=True)` (a private `PerWorkerVariable`)
    is the mechanism, but as shipped it is unusable for an optimizer: every
    access to its `handle` inside a `tf.function` captures a *new* call-time
    placeholder, so automatic control dependencies see unrelated resources and
    reorder reads and writes (measured: two `assign_add`s followed by a read
    returned the initial value).

    This subclass captures the worker's handle under a stable key, so every op
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
    """

    def __init__(self, strategy, next_creator, **kwargs):
        super().__init__(strategy, next_creator, **kwargs)
        # Keras optimizers key their slots by `_unique_id`; PerWorkerVariable
        # leaves it None for every instance.
        self._unique_id = f"tf_lars_worker_local_{next(_ids)}"
        self._capture_key = ("tf_lars_worker_local", self._unique_id)

    @property
    def handle(self):
        if _context.executing_eagerly() or _save_context.in_save_context():
            return self._coordinator_instance.handle
        self._maybe_create_per_worker_vars()
        closure, spec = self.handle_call_time_value()
        graph = _ops.get_default_graph()
        function_graph = graph
        while isinstance(function_graph, _CONTROL_FLOW_GRAPHS):
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

    def creator(next_creator, **kwargs):
        # Colocation with a parameter-server variable and the strategy's own
        # per-worker flag do not apply: the variable lives on every worker.
        kwargs.pop("colocate_with", None)
        kwargs.pop("per_worker_variable", None)
        return WorkerLocalVariable(strategy, next_creator, **kwargs)

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
    scope. The class and other models are unchanged.
    """
    strategy = model.distribute_strategy

    def first_local(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return strategy.experimental_local_results(value)[0]
        return value

    def local_symbolic_build(iterator=None, data_batch=None):
        if iterator is not None:
            # Keras's epoch iterator yields (begin, end, tf iterator).
            for _, _, batches in iterator:
                data_batch = next(batches)
                break
        if data_batch is not None:
            data_batch = tf.nest.map_structure(first_local, data_batch)
        with strategy.scope():
            model._symbolic_build(data_batch=data_batch)

    model._maybe_symbolic_build = local_symbolic_build
    return model


# 8 ---------------------------------------------------------------------------


def in_xla_context():
    """Whether the graph being built is compiled by XLA (`jit_compile=True`)."""
    return tf.__internal__.get_enclosing_xla_context() is not None


# 9 ---------------------------------------------------------------------------


def start_fit_at_epoch(model, epoch):
    """Makes the running (or next) `fit` start at `epoch`; None: Keras's default."""
    model._initial_epoch = epoch
