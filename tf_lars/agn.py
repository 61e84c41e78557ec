"""Accumulated Gradient Normalization (Hermans, Spanakis, Möckel 2017)."""

import numbers

import keras
import tensorflow as tf
from keras.src.utils import tracking

from tf_lars._wrapper import InnerOptimizerWrapper, all_finite
from tf_lars.lars import SOURCE_PATH_ATTRIBUTE

# Base-optimizer arguments that belong on the inner optimizer. Only their
# defaults are accepted, so that configs written by other tools still load.
_BASE_DEFAULTS = {
    "learning_rate": None,
    "weight_decay": None,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}


def _is_loss_scale_optimizer(optimizer):
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


def _unwrap_loss_scale(optimizer):
    """The optimizer that applies unscaled gradients."""
    if _is_loss_scale_optimizer(optimizer):
        return optimizer.inner_optimizer
    return optimizer


def _clone(optimizer, suffix, drop_loss_scale_factor=False):
    """A fresh optimizer with `optimizer`'s hyperparameters and no state."""
    config = optimizer.get_config()
    config["name"] = f"{optimizer.name}_{suffix}"
    if drop_loss_scale_factor and "loss_scale_factor" in config:
        config["loss_scale_factor"] = None
    return optimizer.__class__.from_config(config)


def _is_parameter_server_strategy(strategy):
    return isinstance(strategy, tf.distribute.ParameterServerStrategy)


def _map_values(gradient, fn):
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(
            fn(gradient.values), gradient.indices, gradient.dense_shape
        )
    return fn(gradient)


class _State:
    """Which variables play which role. Deliberately not trackable.

    Single worker: `local` are the model's variables, `center` and
    `accumulators` are optimizer variables, `local_optimizer` is the user's
    inner optimizer and `center_optimizer` a fresh copy of it.

    Parameter servers: `center` are the model's variables (on the parameter
    servers), `local` and `accumulators` are worker-local variables,
    `center_optimizer` is the user's inner optimizer (slots on the parameter
    servers) and `local_optimizer` a fresh copy whose slots are worker-local.
    Worker-local variables are never checkpointed, so this holder keeps them
    out of the object graph.
    """

    def __init__(
        self, local, center, accumulators, local_optimizer, center_optimizer, lock
    ):
        self.local = list(local)
        self.center = list(center)
        self.accumulators = list(accumulators)
        self.local_optimizer = local_optimizer
        self.center_optimizer = center_optimizer
        self.lock = lock


@keras.saving.register_keras_serializable(package="tf_lars")
class AGN(InnerOptimizerWrapper, keras.optimizers.Optimizer):
    """Accumulated Gradient Normalization: local steps, normalized commits.

    Each worker trains a local copy of the model with the inner optimizer and
    adds every raw gradient to an accumulator. Every `communication_period`
    local steps it commits: the accumulator divided by the period is applied
    to the center variables by the inner optimizer, the local copy is reset to
    the center, and the accumulator to zero (the TF contrib `AGNOptimizer`
    seed, with the Keras 3 inner optimizer in place of the TF1 one):

    ```
    every step:     local <- inner_local.update(local, g);   a <- a + g
    every P steps:  center <- inner_center.update(center, a / P)   # commit
                    local <- center;  a <- 0
    ```

    Two ways to run it:

    * **One process** (default strategy): `model.compile(optimizer=AGN(...))`
      and `model.fit`, or `apply` in a custom loop. The model's variables are
      the local copy; the center variables, the accumulators and a second
      copy of the inner optimizer (for the center) are optimizer state. The
      commit is an on-device `tf.cond`, so the step compiles with XLA.
    * **Parameter servers** (`tf.distribute.ParameterServerStrategy`): create
      the model and the `AGN` under `strategy.scope()` and train with
      `tf_lars.distribute.ParameterServerTrainer`. The model's variables are
      the center (on the parameter servers, checkpointed with the inner
      optimizer's state); each worker holds its own local copy, accumulators
      and inner-optimizer slots (worker-local, never checkpointed). A commit
      runs the inner optimizer on the parameter servers inside a
      `tf.CriticalSection`, so concurrent commits from several workers are
      applied one at a time with `tf.Variable` ops (as the seed's
      `use_locking=True`): none is lost, and the commit counter is exact.
      Under this strategy the trainer calls `pull`, `local_update` and
      `commit`; `apply` raises.

    If the inner optimizer is a loss-scale optimizer, gradients are unscaled
    before they are accumulated, a skipped (non-finite) step adds nothing and
    does not count towards the period, and the center is updated by the
    wrapped optimizer without loss scaling.

    Args:
        inner_optimizer: `keras.optimizers.Optimizer`. Applies the local steps
            and the commits (e.g. `tf_lars.LARS`, a Keras optimizer, or a
            loss-scale optimizer). Base-optimizer options such as clipping
            belong here.
        communication_period: int >= 1. Local steps between two commits.
            Defaults to `10`.
        name: str. The optimizer's name. Defaults to `None` (`"agn"`).
        **kwargs: Keras base optimizer arguments are not supported on the
            wrapper (set them on `inner_optimizer`); only their default values
            are accepted, for loading configs written elsewhere.

    References:
        - [Hermans, Spanakis, Möckel, 2017. Accumulated Gradient
          Normalization](https://arxiv.org/abs/1710.02368) (ACML 2017).
        - TF contrib `tf.contrib.opt.AGNOptimizer` (the seed).

    Example:

    >>> var = keras.Variable([0.0, 0.5])
    >>> opt = tf_lars.AGN(keras.optimizers.SGD(0.1), communication_period=2)
    >>> for _ in range(2):
    ...     opt.apply([tf.constant([-1.0, -1.0])], [var])
    >>> var.numpy()                      # reset to the center after the commit
    array([0.1, 0.6], dtype=float32)
    >>> int(opt.commits.numpy())
    1

    With `model.fit`:

    ```python
    model.compile(
        optimizer=tf_lars.AGN(tf_lars.LARS(learning_rate=1.0), 10),
        loss="sparse_categorical_crossentropy",
    )
    model.fit(x, y)
    ```
    """

    def __init__(self, inner_optimizer, communication_period=10, name=None, **kwargs):
        for arg_name, default in _BASE_DEFAULTS.items():
            if arg_name not in kwargs:
                continue
            value = kwargs.pop(arg_name)
            accepted = (None, 0.0) if arg_name == "learning_rate" else (default,)
            if value not in accepted:
                raise ValueError(
                    f"`{arg_name}` is not supported by AGN; set it on "
                    f"`inner_optimizer`. Received: {arg_name}={value!r}"
                )
        if kwargs:
            raise ValueError(
                f"Argument(s) not recognized by AGN: {sorted(kwargs)}. "
                f"Received: {kwargs!r}"
            )
        super().__init__(learning_rate=0.0, name=name)
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise ValueError(
                "`inner_optimizer` must be a `keras.optimizers.Optimizer` "
                f"instance. Received: inner_optimizer={inner_optimizer!r}"
            )
        if isinstance(inner_optimizer, AGN):
            raise ValueError(
                "`inner_optimizer` must not itself be an AGN optimizer. "
                f"Received: inner_optimizer={inner_optimizer!r}"
            )
        if (
            isinstance(communication_period, bool)
            or not isinstance(communication_period, numbers.Integral)
            or communication_period < 1
        ):
            raise ValueError(
                "`communication_period` must be an int >= 1. "
                f"Received: communication_period={communication_period!r}"
            )
        self.inner_optimizer = inner_optimizer
        self.communication_period = int(communication_period)
        self._parameter_server = _is_parameter_server_strategy(
            self._distribution_strategy
        )

    # ------------------------------------------------------------------ build
    @tracking.no_automatic_dependency_tracking
    def build(self, var_list):
        if self.built:
            return
        var_list = list(var_list)
        # Keras may build inside the first traced train step; the state (and
        # the copies of the inner optimizer, made from its config) is created
        # eagerly all the same.
        with tf.init_scope():
            if self._parameter_server:
                self._build_parameter_server(var_list)
            else:
                self._build_single_worker(var_list)
        super().build(var_list)

    def _check_strategy(self):
        strategy = self._distribution_strategy
        if strategy.num_replicas_in_sync != 1 or isinstance(
            strategy,
            tf.distribute.MirroredStrategy | tf.distribute.MultiWorkerMirroredStrategy,
        ):
            raise ValueError(
                "AGN runs with the default strategy (one worker, "
                "`model.fit`) or with `tf.distribute.ParameterServerStrategy` "
                "(many workers, `tf_lars.distribute.ParameterServerTrainer`). "
                f"Received: {type(strategy).__name__} with "
                f"{strategy.num_replicas_in_sync} replicas."
            )

    def _build_single_worker(self, var_list):
        self._check_strategy()
        centers = [
            _stand_in_for(
                self.add_variable_from_reference(
                    variable, name="agn_center", initializer=_copy_of(variable)
                ),
                variable,
            )
            for variable in var_list
        ]
        accumulators = [
            self.add_variable_from_reference(variable, name="agn_accumulator")
            for variable in var_list
        ]
        self._commits = self.add_variable(
            shape=(), dtype="int64", initializer="zeros", name="commits"
        )
        center_optimizer = _clone(
            _unwrap_loss_scale(self.inner_optimizer),
            "center",
            drop_loss_scale_factor=True,
        )
        center_optimizer.build(centers)
        self.inner_optimizer.build(var_list)
        # Tracked attribute: the center optimizer's slots are checkpointed.
        self._center_optimizer = center_optimizer
        self._state = _State(
            var_list,
            centers,
            accumulators,
            self.inner_optimizer,
            center_optimizer,
            None,
        )

    def _build_parameter_server(self, var_list):
        from tf_lars.distribute import _per_worker

        strategy = self._distribution_strategy
        if tf.distribute.has_strategy():
            raise ValueError(
                "Under ParameterServerStrategy, build AGN outside "
                "`strategy.scope()` (tf_lars.distribute.ParameterServerTrainer "
                "does): its worker-local variables must not be placed on the "
                "parameter servers."
            )
        inner_strategy = getattr(self.inner_optimizer, "_distribution_strategy", None)
        if inner_strategy is not strategy:
            raise ValueError(
                "`inner_optimizer` must be created under the same "
                "`strategy.scope()` as AGN, so that its state lives on the "
                "parameter servers. Received: inner_optimizer="
                f"{self.inner_optimizer!r} created under "
                f"{type(inner_strategy).__name__}, AGN under "
                f"{type(strategy).__name__}."
            )
        for variable in var_list:
            if isinstance(variable, keras.Variable):
                continue
            raise ValueError(
                "Under ParameterServerStrategy AGN expects the model's Keras "
                f"variables. Received: {variable!r}"
            )
        with strategy.scope():
            self._commits = self.add_variable(
                shape=(), dtype="int64", initializer="zeros", name="commits"
            )
            self.inner_optimizer.build(var_list)
            # Commits from different workers are serialized at the parameter
            # server holding the first variable; the lock waits for the
            # gradients to arrive, so a worker dying mid-push cannot hold it.
            with tf.device(var_list[0].value.device):
                lock = tf.CriticalSection(name=f"{self.name}_commit")
        with _per_worker.worker_local_scope(strategy):
            with keras.name_scope(self.name, caller=self):
                local = [
                    _stand_in_for(_worker_variable(v, "local"), v) for v in var_list
                ]
                accumulators = [_worker_variable(v, "accumulator") for v in var_list]
                local_optimizer = _clone(self.inner_optimizer, "local")
                local_optimizer.build(local)
        self._state = _State(
            local,
            var_list,
            accumulators,
            local_optimizer,
            _unwrap_loss_scale(self.inner_optimizer),
            lock,
        )

    # ------------------------------------------------------------- read-outs
    @property
    def commits(self):
        """Commits applied to the center so far, an int64 `keras.Variable`."""
        self._require_built("commits")
        return self._commits

    @property
    def local_steps(self):
        """Local steps taken so far (int64).

        One process: steps applied since the start (a skipped non-finite step
        does not count). Parameter servers: local steps committed by all
        workers together (`communication_period` per commit).
        """
        return self._iterations

    @property
    def local_variables(self):
        """The variables the local steps update (see the class docstring)."""
        self._require_built("local_variables")
        return list(self._state.local)

    @property
    def center_variables(self):
        """The variables the commits update (see the class docstring)."""
        self._require_built("center_variables")
        return list(self._state.center)

    @property
    def accumulators(self):
        """The gradient accumulators, one per variable."""
        self._require_built("accumulators")
        return list(self._state.accumulators)

    @property
    def local_optimizer(self):
        """The optimizer instance that applies local steps."""
        self._require_built("local_optimizer")
        return self._state.local_optimizer

    @property
    def center_optimizer(self):
        """The optimizer instance that applies commits to the center."""
        self._require_built("center_optimizer")
        return self._state.center_optimizer

    @property
    def is_parameter_server(self):
        """Whether this AGN was created under `ParameterServerStrategy`."""
        return self._parameter_server

    def _require_built(self, what):
        if not self.built:
            raise ValueError(
                f"`{what}` exists once the optimizer is built; call "
                "`optimizer.build(model.trainable_variables)` first."
            )

    @property
    def variables(self):
        variables = self._variables + self.inner_optimizer.variables
        if self.built and not self._parameter_server:
            variables += self._state.center_optimizer.variables
        return variables

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        if self.built and self._parameter_server:
            raise ValueError(
                "Under ParameterServerStrategy the workers' learning rate lives "
                "on the workers and cannot be assigned from the coordinator; "
                "use a `LearningRateSchedule` on the inner optimizer. "
                f"Received: learning_rate={learning_rate!r}"
            )
        self.inner_optimizer.learning_rate = learning_rate
        if self.built:
            self._state.center_optimizer.learning_rate = learning_rate

    def scale_loss(self, loss):
        if self.built:
            return self._state.local_optimizer.scale_loss(loss)
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    # ------------------------------------------------------------ the steps
    def apply(self, grads, trainable_variables=None):
        """One local step; commits when `communication_period` steps are done.

        Single-worker mode only. `grads` are gradients of `scale_loss(loss)`.
        """
        grads = list(grads)
        if not grads:
            return
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "When passing `grads` without `trainable_variables`, the "
                    "optimizer must already be built. Call "
                    "`optimizer.build(trainable_variables)` first."
                )
            trainable_variables = self._trainable_variables
        else:
            trainable_variables = list(trainable_variables)
            if not self.built:
                with keras.name_scope(self.name, caller=self):
                    self.build(trainable_variables)
        if self._parameter_server:
            raise ValueError(
                "Under ParameterServerStrategy AGN is driven round by round "
                "(`pull`, `local_update` x communication_period, `commit`) by "
                "`tf_lars.distribute.ParameterServerTrainer`; `apply` is for "
                "the one-process mode."
            )
        full = [None] * len(self._state.local)
        for grad, variable in zip(grads, trainable_variables, strict=True):
            full[self._get_variable_index(variable)] = grad
        finite = self.local_update(full)
        step = self._iterations.value.assign_add(
            tf.cast(finite, self._iterations.dtype)
        )
        due = tf.logical_and(finite, tf.equal(step % self.communication_period, 0))
        tf.cond(due, self._commit_single_worker, lambda: tf.constant(False))

    def apply_gradients(self, grads_and_vars):
        grads, trainable_variables = zip(*grads_and_vars, strict=True)
        self.apply(grads, trainable_variables)
        return self._iterations

    def local_update(self, grads):
        """Applies one local step and accumulates its unscaled gradient.

        Args:
            grads: list, one gradient (or `None`) per entry of
                `local_variables`, of `scale_loss(loss)`.

        Returns:
            A scalar bool tensor: whether the step was applied (always true
            unless the inner optimizer is a loss-scale optimizer that skipped
            a non-finite step).
        """
        self._require_built("local_update")
        state = self._state
        grads = list(grads)
        if len(grads) != len(state.local):
            raise ValueError(
                f"`grads` must have one entry per local variable "
                f"({len(state.local)}). Received {len(grads)}."
            )
        if _is_loss_scale_optimizer(state.local_optimizer):
            finite = all_finite(grads)
            scale = tf.convert_to_tensor(state.local_optimizer.scale_loss(1.0))
        else:
            finite = tf.constant(True)
            scale = state.local_optimizer.scale_loss(1.0)
        unscaled = []
        for grad in grads:
            if grad is None or (isinstance(scale, float) and scale == 1.0):
                unscaled.append(grad)
            else:
                unscaled.append(
                    _map_values(grad, lambda g: g / tf.cast(scale, g.dtype))
                )
        pairs = [(g, v) for g, v in zip(grads, state.local) if g is not None]
        if pairs:
            state.local_optimizer.apply([g for g, _ in pairs], [v for _, v in pairs])
        for accumulator, grad in zip(state.accumulators, unscaled):
            if grad is None:
                continue
            grad = _map_values(grad, lambda g: tf.where(finite, g, tf.zeros_like(g)))
            self.assign_add(accumulator, grad)
        return finite

    def pull(self):
        """Resets the local copy to the center and the accumulators to zero."""
        self._require_built("pull")
        state = self._state
        for local, center in zip(state.local, state.center):
            self.assign(local, center)
        for accumulator in state.accumulators:
            self.assign(accumulator, tf.zeros(accumulator.shape, accumulator.dtype))

    def commit(self):
        """Applies the accumulated gradient / period to the center.

        Single worker: also pulls the new center (the seed's commit).
        Parameter servers: serialized with the other workers' commits at the
        parameter server; the next round starts with `pull`.

        Returns:
            The number of commits after this one, an int64 scalar tensor.
        """
        self._require_built("commit")
        if not self._parameter_server:
            self._commit_single_worker()
            return tf.convert_to_tensor(self._commits.value)
        state = self._state
        period = self.communication_period
        # Read and normalized on the worker: one tensor per variable travels.
        grads = [
            tf.convert_to_tensor(a) / tf.cast(period, a.dtype)
            for a in state.accumulators
        ]

        def critical():
            state.center_optimizer.apply(grads, state.center)
            # The lock is released once the returned tensors exist; reading
            # every center-side variable makes the whole update part of them.
            done = [
                tf.convert_to_tensor(v)
                for v in state.center + state.center_optimizer.variables
            ]
            with tf.control_dependencies(done):
                steps = self._iterations.value.assign_add(
                    tf.constant(period, self._iterations.dtype), read_value=True
                )
                commits = self._commits.value.assign_add(
                    tf.constant(1, tf.int64), read_value=True
                )
            return commits, steps

        commits, _ = state.lock.execute(critical)
        return commits

    def _commit_single_worker(self):
        state = self._state
        period = self.communication_period
        grads = [
            tf.convert_to_tensor(a) / tf.cast(period, a.dtype)
            for a in state.accumulators
        ]
        state.center_optimizer.apply(grads, state.center)
        self._commits.value.assign_add(tf.constant(1, tf.int64))
        self.pull()
        return tf.constant(True)

    def get_config(self):
        return self._wrapper_config(
            communication_period=self.communication_period,
        )


def _stand_in_for(copy, reference):
    """Marks `copy` as standing in for the model variable `reference`.

    The center and local copies have paths of their own; the mark lets an
    inner `tf_lars.LARS` resolve exclusions (regexes on `variable.path`)
    against the model variable's path, as for the model's own optimizer.
    """
    path = getattr(reference, SOURCE_PATH_ATTRIBUTE, None) or getattr(
        reference, "path", None
    )
    if path is not None:
        setattr(copy, SOURCE_PATH_ATTRIBUTE, path)
    return copy


def _copy_of(variable):
    def initializer(shape, dtype=None):
        return tf.cast(tf.convert_to_tensor(variable), dtype or variable.dtype)

    return initializer


def _worker_variable(reference, role):
    name = reference.path.replace("/", "_") if hasattr(reference, "path") else "var"
    return keras.Variable(
        initializer="zeros",
        shape=reference.shape,
        dtype=reference.dtype,
        trainable=False,
        name=f"{name}_{role}",
    )
