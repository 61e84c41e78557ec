"""Private TensorFlow / Keras access of `tf_lars.distribute`, fenced here.

The package's fence, as `tf_lars/_internals.py` is the core's: nothing else in
`tf_lars.distribute` reaches a private member (tests/internals_test.py), and
each accessor raises `MissingInternalError` naming its feature and the
installed versions when a release lacks it. Sections: 1 the parameter-server
coordinator and worker-local variables (AGN under `ParameterServerStrategy`);
2 multi-worker `fit`; 3 `fit`'s start epoch and Keras's `BackupAndRestore`.
"""

import functools

import keras

from tf_lars._internals import (
    check_hooks,
    no_automatic_dependency_tracking,
    private_member,
    private_module,
)

# 1 ---------------------------------------------------------------------------


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
        name.rpartition(".")[2]: private_module(
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


# 2 ---------------------------------------------------------------------------


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


# 3 ---------------------------------------------------------------------------


def start_fit_at_epoch(model, epoch):
    """Sets `Model._initial_epoch`, which `fit` reads (as Keras's own
    `BackupAndRestore` does): the epoch a running `fit` starts at."""
    private_member(model, "_initial_epoch", "BackupAndRestore")
    model._initial_epoch = epoch


#: Keras's `BackupAndRestore` hooks `tf_lars.distribute.BackupAndRestore`
#: overrides, with their parameters: `on_train_begin` calls `_load_model()`,
#: `on_epoch_end` sets `_current_epoch` and calls `_save_model()`.
OVERRIDDEN_BACKUP_HOOKS = {"_load_model": (), "_save_model": ()}


def check_backup_hooks():
    """`check_hooks` for Keras's `BackupAndRestore` (the resume tests check
    that it calls them)."""
    check_hooks(
        "BackupAndRestore", keras.callbacks.BackupAndRestore, OVERRIDDEN_BACKUP_HOOKS
    )


def epochs_done(callback):
    """`BackupAndRestore._current_epoch`, set by Keras's `on_epoch_end`: the
    epochs done, the one just ended included."""
    return private_member(callback, "_current_epoch", "BackupAndRestore")
