"""The worker side of `tf_lars.AGN` under `ParameterServerStrategy`."""

import contextlib
import functools
import itertools

import keras
import tensorflow as tf

from tf_lars import agn as agn_rule
from tf_lars._exclusions import mark_stand_in
from tf_lars.distribute import _internals

_ids = itertools.count()


class WorkerLocalHandle:
    """A `PerWorkerVariable` whose handle is captured once per traced function.

    AGN keeps a local copy of the model, the gradient accumulators and the
    local optimizer slots on each worker. TensorFlow's
    `tf.Variable(..., per_worker_variable=True)` (a `PerWorkerVariable`) is
    the mechanism, but as shipped it is unusable for an optimizer: every
    access to its `handle` inside a `tf.function` captures a *new* call-time
    placeholder, so automatic control dependencies see unrelated resources and
    reorder reads and writes (measured: two `assign_add`s followed by a read
    returned the initial value). There is no public per-worker variable an
    optimizer can update in program order.

    This mixin captures the worker's handle under a stable key, so every op
    in a traced function refers to one placeholder and runs in program order.
    Inside `tf.cond` / `tf.while_loop` bodies (which do not forward call-time
    captures; TF documents per-worker variables as unreadable in `tf.cond`
    branches) it captures the handle in the enclosing function and passes it
    into the branch as an ordinary captured tensor, so a loss-scale
    optimizer's conditional update works on worker-local variables, with or
    without XLA. Everything else (creation on each worker, re-creation when a
    restarted worker comes back, `read_all`) is TensorFlow's own; the private
    members it needs are read through `tf_lars._internals`.

    Caveats (TensorFlow's, unchanged): values are lost when a worker restarts
    (the variable is re-created with its initial value), they are never
    checkpointed, and they must not be created inside a `tf.function`.
    `worker_local_variable_class()` joins it to TensorFlow's class on first
    use, so that `import tf_lars` never touches `PerWorkerVariable`.
    """

    def __init__(self, strategy, next_creator, **kwargs):
        super().__init__(strategy, next_creator, **kwargs)
        # Keras optimizers key their slots by the unique id; PerWorkerVariable
        # leaves it None for every instance.
        unique_id = f"tf_lars_worker_local_{next(_ids)}"
        _internals.set_unique_id(self, unique_id)
        self._capture_key = ("tf_lars_worker_local", unique_id)

    @property
    def handle(self):
        if _internals.reads_the_coordinator_handle():
            return _internals.coordinator_handle(self)
        _internals.create_per_worker_values(self)
        closure, spec = self.handle_call_time_value()
        function_graph, graph = _internals.function_graph_of_branch()
        with function_graph.as_default():
            handle = function_graph.capture_call_time_value(
                closure, spec, key=self._capture_key
            )
        if function_graph is graph:
            return handle
        return graph.capture(handle)

    def read_each_worker(self):
        """Each worker's value as a NumPy value, None for a worker that is down."""
        _internals.create_per_worker_values(self)
        values = []
        for remote in _internals.per_worker_remote_values(self):
            try:
                values.append(remote.get().numpy())
            except Exception:  # noqa: BLE001 - a failed worker reads as None
                values.append(None)
        return values


@functools.cache
def worker_local_variable_class():
    """`WorkerLocalVariable`: `WorkerLocalHandle` over TF's `PerWorkerVariable`."""
    base = _internals.per_worker_variable_class()
    return type("WorkerLocalVariable", (WorkerLocalHandle, base), {})


@contextlib.contextmanager
def worker_local_scope(strategy):
    """Variables created in this scope are `WorkerLocalVariable`s.

    Args:
        strategy: the `tf.distribute.ParameterServerStrategy`; a
            `ClusterCoordinator` must already exist for it.
    """
    if _internals.coordinator_of(strategy) is None:
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


def check_strategy_and_agn(strategy, agn, argument):
    """Raises `ValueError` unless `strategy` is a parameter-server strategy and
    `agn` (passed as `argument`) a `tf_lars.AGN` created under its scope."""
    if not isinstance(strategy, tf.distribute.ParameterServerStrategy):
        raise ValueError(
            "`strategy` must be a `tf.distribute.ParameterServerStrategy`. "
            f"Received: strategy={strategy!r}"
        )
    if not isinstance(agn, agn_rule.AGN) or not agn.is_parameter_server:
        raise ValueError(
            f"`{argument}` must be a `tf_lars.AGN` created under "
            f"`strategy.scope()`. Received: {argument}={agn!r}"
        )


class ParameterServerAGN:
    """AGN's rounds on a parameter-server cluster, around a `tf_lars.AGN`.

    Fixed roles: the center is the model's variables on the parameter
    servers, updated by the AGN's inner optimizer (its slots there too) and
    counted by `agn.commits` / `agn.local_steps`; all of that is the `agn`'s
    checkpointed state. This object adds what lives on each worker and is
    never checkpointed: a local copy of the model, the gradient accumulators
    and a copy of the inner optimizer for the local steps. A commit runs the
    inner optimizer on the parameter servers inside a `tf.CriticalSection`,
    so concurrent commits from several workers are applied one at a time.

    `tf_lars.distribute.ParameterServerTrainer` creates it (as
    `trainer.ps_agn`) and schedules one round per closure: `pull`,
    `communication_period` times `local_update`, `commit`.

    Args:
        agn: `tf_lars.AGN` created under `strategy.scope()`; built here if it
            is not built yet.
        strategy: the `tf.distribute.ParameterServerStrategy`, with a
            `ClusterCoordinator` already created for it.
        model_variables: list of the model's trainable variables, if `agn` is
            not built yet. Defaults to None.
        name: str or None. Prefix of the worker-local variables' names.
            Defaults to None (the `agn`'s name).

    Attributes:
        local_variables: list, each worker's copy of the model (worker-local
            variables).
        center_variables: list, the model's variables on the parameter servers.
        accumulators: list, each worker's gradient accumulators, one per
            variable. With an outer optimizer: each worker's copy of the
            center as it was pulled (the commit sends `pulled - local`).
        local_optimizer: the copy of the inner optimizer that applies local
            steps.
        center_optimizer: the optimizer that applies commits: the AGN's outer
            optimizer, or its inner optimizer (without loss scaling).
        commits: `agn.commits`, commits applied to the center so far.
        local_steps: `agn.local_steps`, local steps committed by all workers
            together.

    Examples:
        ```python
        with strategy.scope():
            model = make_model()
            agn = tf_lars.AGN(keras.optimizers.SGD(0.1), communication_period=10)
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        ps_agn = ParameterServerAGN(agn, strategy, model.trainable_variables)

        @tf.function
        def round_fn(batches):
            ps_agn.pull()
            for x, y in batches:  # communication_period batches
                ...  # grads of ps_agn.scale_loss(loss) wrt ps_agn.local_variables
                ps_agn.local_update(grads)
            return ps_agn.commit()

        coordinator.schedule(round_fn, args=(per_worker_iterator,))
        ```
    """

    def __init__(self, agn, strategy, model_variables=None, name=None):
        check_strategy_and_agn(strategy, agn, "agn")
        if tf.distribute.has_strategy():
            raise ValueError(
                "Create ParameterServerAGN outside `strategy.scope()` "
                "(tf_lars.distribute.ParameterServerTrainer does): its "
                "worker-local variables must not be placed on the parameter "
                "servers."
            )
        if name is not None and not isinstance(name, str):
            raise ValueError(f"`name` must be a str or None. Received: name={name!r}")
        if not agn.built:
            if model_variables is None:
                raise ValueError(
                    "`model_variables` is needed when `agn` is not built yet. "
                    f"Received: model_variables={model_variables!r}"
                )
            agn.build(list(model_variables))
        self.agn = agn
        self.name = name or agn.name
        self.communication_period = agn.communication_period
        self.center_variables = agn.center_variables
        self.center_optimizer = agn.center_optimizer
        # Commits from different workers are serialized at the parameter
        # server holding the first variable; the lock waits for the gradients
        # to arrive, so a worker dying mid-push cannot hold it.
        with strategy.scope(), tf.device(self.center_variables[0].value.device):
            self._lock = tf.CriticalSection(name=f"{self.name}_commit")
        with worker_local_scope(strategy), keras.name_scope(self.name):
            self.local_variables = [
                mark_stand_in(_worker_variable(v, "local"), v)
                for v in self.center_variables
            ]
            role = "accumulator" if agn.outer_optimizer is None else "pulled"
            self.accumulators = [
                _worker_variable(v, role) for v in self.center_variables
            ]
            self.local_optimizer = agn_rule.clone_optimizer(
                agn.inner_optimizer, "local"
            )
            self.local_optimizer.build(self.local_variables)
        self.commits = agn.commits
        self.local_steps = agn.local_steps

    def scale_loss(self, loss):
        """The loss the local steps' gradients are taken of."""
        return self.local_optimizer.scale_loss(loss)

    # ------------------------------------------------------------ the round
    # `tf_lars.agn`'s rule, on the worker-local variables (`accumulators` hold
    # the pulled copy with an outer optimizer).
    def pull(self):
        """Resets the worker's local copy to the center, accumulators to 0
        (with an outer optimizer: the local and the pulled copy to the center)."""
        agn_rule.reset(
            self.agn,
            self.local_variables,
            self.center_variables,
            self.accumulators,
            keeps_center=self.agn.outer_optimizer is not None,
        )

    def local_update(self, grads):
        """One local step on the worker; accumulates its unscaled gradient.

        Args:
            grads: list, one gradient (or `None`) per entry of
                `local_variables`, of `scale_loss(loss)`.

        Returns:
            A scalar bool tensor: whether the step was applied (false when a
            loss-scale inner optimizer skipped a non-finite step).
        """
        accumulators = self.accumulators if self.agn.outer_optimizer is None else []
        return agn_rule.local_step(
            self.agn,
            self.local_optimizer,
            self.local_variables,
            accumulators,
            list(grads),
        )

    def commit(self):
        """Applies the accumulated gradient / period to the center (with an
        outer optimizer: the pseudo-gradient `pulled - local`), one worker's
        commit at a time at the parameter server; the next round starts with
        `pull`.

        Returns:
            The number of commits after this one, an int64 scalar tensor.
        """
        # Computed on the worker: one tensor per variable travels.
        grads = agn_rule.commit_gradients(
            self.agn, self.accumulators, self.local_variables
        )
        commits, _ = self._lock.execute(
            lambda: agn_rule.apply_commit(
                self.agn,
                self.center_optimizer,
                grads,
                self.center_variables,
                self.communication_period,
            )
        )
        return commits


def _worker_variable(reference, role):
    name = reference.path.replace("/", "_") if hasattr(reference, "path") else "var"
    return keras.Variable(
        initializer="zeros",
        shape=reference.shape,
        dtype=reference.dtype,
        trainable=False,
        name=f"{name}_{role}",
    )
