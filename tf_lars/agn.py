"""Accumulated Gradient Normalization (Hermans, Spanakis, Möckel 2017).

`AGN` is the public optimizer. In one process it holds every role; under
`tf.distribute.ParameterServerStrategy` it holds the center side only and
`tf_lars.distribute.ParameterServerAGN` adds the worker side. The rule
(`local_step`, `reset`, `commit_gradients`, `apply_commit`) is written once,
here, and both modes (and `tf-lars lowcomm`) call it.
"""

# ruff: noqa: E402
import numbers

from tf_lars import _require_tensorflow_backend

# Before Keras and TensorFlow are imported: without TensorFlow, or on another
# backend, one clear error.
_require_tensorflow_backend("tf_lars.AGN")

import keras
import tensorflow as tf

from tf_lars import _internals
from tf_lars._exclusions import mark_stand_in
from tf_lars._internals import no_automatic_dependency_tracking
from tf_lars._validation import check_inner_learning_rate, check_outer_optimizer
from tf_lars._wrapper import (
    BASE_ARGUMENT_DEFAULTS,
    InnerOptimizerWrapper,
    all_finite,
    gradient_as_tensor,
    pop_inner_arguments,
    refuse_outer_loss_scale,
    require_built,
    track_attribute_variables,
)
from tf_lars.diloco import takes_outer_steps
from tf_lars.schedules import check_step_count

__all__ = ["AGN"]

# The inner optimizer owns the learning rate too (None or 0.0 accepted).
_BASE_DEFAULTS = {"learning_rate": None, **BASE_ARGUMENT_DEFAULTS}


def unwrap_loss_scale(optimizer):
    """The optimizer that applies unscaled gradients."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


def clone_optimizer(optimizer, suffix, drop_loss_scale_factor=False):
    """A fresh optimizer with `optimizer`'s hyperparameters and no state."""
    config = optimizer.get_config()
    config["name"] = f"{optimizer.name}_{suffix}"
    if drop_loss_scale_factor and "loss_scale_factor" in config:
        config["loss_scale_factor"] = None
    return optimizer.__class__.from_config(config)


def _map_values(gradient, fn):
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(
            fn(gradient.values), gradient.indices, gradient.dense_shape
        )
    return fn(gradient)


def local_step(writer, local_optimizer, local_variables, accumulators, grads):
    """One local step and its unscaled gradient added to the accumulators.

    Args:
        writer: the `keras.optimizers.Optimizer` whose `assign_add` writes
            the accumulators.
        local_optimizer: applies the step to `local_variables`.
        local_variables: list of variables.
        accumulators: list of variables, one per local variable (empty with
            an outer optimizer: nothing is accumulated).
        grads: list, one gradient (or None) per local variable, of
            `local_optimizer.scale_loss(loss)`.

    Returns:
        A scalar bool tensor: whether the step was applied.
    """
    grads = [gradient_as_tensor(g) for g in grads]
    if len(grads) != len(local_variables):
        raise ValueError(
            f"`grads` must have one entry per local variable "
            f"({len(local_variables)}). Received {len(grads)}."
        )
    finite, scale = tf.constant(True), local_optimizer.scale_loss(1.0)
    if isinstance(local_optimizer, keras.optimizers.LossScaleOptimizer):
        finite, scale = all_finite(grads), tf.convert_to_tensor(scale)
    pairs = [(g, v) for g, v in zip(grads, local_variables) if g is not None]
    if pairs:
        local_optimizer.apply([g for g, _ in pairs], [v for _, v in pairs])
    for accumulator, grad in zip(accumulators, grads):
        if grad is None:
            continue
        if not (isinstance(scale, float) and scale == 1.0):
            grad = _map_values(grad, lambda g: g / tf.cast(scale, g.dtype))
        grad = _map_values(grad, lambda g: tf.where(finite, g, tf.zeros_like(g)))
        writer.assign_add(accumulator, grad)
    return finite


def reset(writer, local_variables, center_variables, saved, keeps_center=False):
    """The pull, written through `writer`'s `assign`: `local <- center`, and
    `saved` (the accumulators) `<- 0`, or with `keeps_center` (an outer
    optimizer's pulled copy) `<- center`, the center read once."""
    for i, (local, center) in enumerate(zip(local_variables, center_variables)):
        value = tf.convert_to_tensor(center)
        writer.assign(local, value)
        if saved:
            writer.assign(saved[i], value if keeps_center else tf.zeros_like(value))


def pseudo_gradients(pulled_variables, local_variables):
    """The outer optimizer's gradients: `pulled - local`, per variable.

    With an outer optimizer a commit sends how far the local copy moved
    since it was pulled (DiLoCo's pseudo-gradient), not the gradients.
    """
    return [
        tf.convert_to_tensor(pulled) - tf.cast(local, pulled.dtype)
        for pulled, local in zip(pulled_variables, local_variables, strict=True)
    ]


def normalized(accumulators, period):
    """The commit's gradients: each accumulator divided by the period."""
    return [tf.convert_to_tensor(a) / tf.cast(period, a.dtype) for a in accumulators]


def commit_gradients(agn, saved, local_variables):
    """What a commit applies to the center: the accumulators (`saved`) / the
    period, or with an outer optimizer the pseudo-gradient `saved - local`
    (`saved`: the pulled copy)."""
    if agn.outer_optimizer is None:
        return normalized(saved, agn.communication_period)
    return pseudo_gradients(saved, local_variables)


def apply_commit(agn, optimizer, grads, centers, local_steps=0):
    """Applies one commit to `centers` and counts it in `agn.commits` (and
    `local_steps` more in `agn.local_steps`); returns both counts, read after.

    The counters are written after reads of every center-side variable, so
    that a `tf.CriticalSection` returning the counts holds the whole update.
    """
    optimizer.apply(grads, centers)
    done = [tf.convert_to_tensor(v) for v in centers + optimizer.variables]
    with tf.control_dependencies(done):
        if local_steps:
            agn.assign_add(agn.local_steps, tf.constant(local_steps, tf.int64))
        agn.assign_add(agn._commits, tf.constant(1, tf.int64))
    # Reads after the writes (same variables: program order).
    return tf.convert_to_tensor(agn._commits), tf.convert_to_tensor(agn.local_steps)


class _Untracked:
    """Holds lists of variables out of the checkpoint's object graph (they
    are checkpointed once, as optimizer variables)."""

    def __init__(self, **values):
        self.__dict__.update(values)


@keras.saving.register_keras_serializable(package="tf_lars")
class AGN(InnerOptimizerWrapper, keras.optimizers.Optimizer):
    """Accumulated Gradient Normalization: local steps, normalized commits.

    Each worker trains a local copy of the model with the inner optimizer and
    adds every raw gradient to an accumulator. Every `communication_period`
    local steps it commits: the accumulator / period is applied to the center
    by the inner optimizer, the local copy is reset to the center and the
    accumulator to zero (the TF contrib `AGNOptimizer` seed). With an
    `outer_optimizer` (asynchronous DiLoCo) a commit applies it to the center
    with the pseudo-gradient `pulled - local` instead (no accumulators). The
    rules: docs/algorithms.md, "AGN" and "AGN with an outer optimizer".

    * **One process** (default strategy): `model.fit`, or `apply` in a custom
      loop. The model's variables are the local copy; the center, the
      accumulators and a copy of the inner optimizer for the center are
      optimizer state; the commit is an on-device `tf.cond` (XLA compiles it).
    * **Parameter servers**: create the model and the `AGN` under
      `strategy.scope()` and train with
      `tf_lars.distribute.ParameterServerTrainer`. The model's variables are
      the center; this object holds the center side (the inner or outer
      optimizer's slots, the commit counter), saved with the model; the
      worker side is `tf_lars.distribute.ParameterServerAGN`'s, whose commits
      are applied one at a time (a `tf.CriticalSection`: none is lost).
      `apply`, `local_update`, `pull`, `commit`, `local_variables`,
      `accumulators` and `local_optimizer` raise here.

    With a loss-scale inner optimizer gradients are unscaled before they are
    accumulated, and a skipped (non-finite) step adds nothing and does not
    count towards the period.

    Args:
        inner_optimizer: `keras.optimizers.Optimizer`. Applies the local steps
            and the commits (e.g. `tf_lars.LARS`, a Keras optimizer, or a
            loss-scale optimizer). Base-optimizer options such as clipping
            belong here.
        communication_period: int >= 1. Local steps between two commits; at
            most `2**63 - 1`, the largest count of the int64 step counter.
            Defaults to `10`.
        name: str. The optimizer's name. Defaults to `None` (`"agn"`).
        outer_optimizer: `keras.optimizers.Optimizer` or None. Applies each
            commit's pseudo-gradient to the center (DiLoCo's recipe:
            `SGD(learning_rate=0.7, momentum=0.9, nesterov=True)`). Not the
            inner optimizer, not a loss-scale optimizer; its learning rate a
            finite number > 0. Defaults to `None`: AGN's own commit.
        **kwargs: Keras base optimizer arguments are not supported on the
            wrapper (set them on `inner_optimizer`); only their default values
            are accepted, for loading configs written elsewhere.

    References:
        - [Hermans, Spanakis, Möckel, 2017. Accumulated Gradient
          Normalization](https://arxiv.org/abs/1710.02368) (ACML 2017).
        - TF contrib `tf.contrib.opt.AGNOptimizer` (the seed).

    Examples:
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

    def __init__(
        self,
        inner_optimizer,
        communication_period=10,
        name=None,
        *,
        outer_optimizer=None,
        **kwargs,
    ):
        pop_inner_arguments("AGN", kwargs, _BASE_DEFAULTS)
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
        check_inner_learning_rate(inner_optimizer)
        if (
            isinstance(communication_period, bool)
            or not isinstance(communication_period, numbers.Integral)
            or communication_period < 1
        ):
            raise ValueError(
                "`communication_period` must be an int >= 1. "
                f"Received: communication_period={communication_period!r}"
            )
        check_step_count("communication_period", int(communication_period))
        if outer_optimizer is not None:
            check_outer_optimizer(outer_optimizer, inner_optimizer)
        for argument, value in (("inner", inner_optimizer), ("outer", outer_optimizer)):
            if takes_outer_steps(value):
                raise ValueError(
                    f"`{argument}_optimizer` must not be an AGN or a DiLoCo: each "
                    f"takes outer steps of its own. Received: {argument}_optimizer"
                    f"={value!r}"
                )
        self.inner_optimizer = inner_optimizer
        self.outer_optimizer = outer_optimizer
        self.communication_period = int(communication_period)
        # The strategy in scope at creation, as Keras records it for itself.
        self._strategy = tf.distribute.get_strategy()
        self._parameter_server = isinstance(
            self._strategy, tf.distribute.ParameterServerStrategy
        )
        # Set by `build`: `_Untracked` lists of the variables of each role.
        self._roles = None

    # ------------------------------------------------------------------ build
    @no_automatic_dependency_tracking
    def build(self, var_list):
        refuse_outer_loss_scale(self)
        if self.built:
            return
        var_list = list(var_list)
        # Keras may build inside the first traced train step; the state (and
        # the copy of the inner optimizer, made from its config) is created
        # eagerly all the same.
        with tf.init_scope():
            if self._parameter_server:
                self._build_center_side(var_list)
            else:
                self._build_one_process(var_list)
        super().build(var_list)

    def _build_one_process(self, var_list):
        strategy = self._strategy
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
        centers = [
            mark_stand_in(
                self.add_variable_from_reference(
                    variable, name="agn_center", initializer=_copy_of(variable)
                ),
                variable,
            )
            for variable in var_list
        ]
        # With an outer optimizer the centers are the pulled values (only a
        # commit moves them, and a pull follows): nothing to accumulate.
        accumulators = [
            self.add_variable_from_reference(variable, name="agn_accumulator")
            for variable in var_list
            if self.outer_optimizer is None
        ]
        self._commits = self.add_variable(
            shape=(), dtype="int64", initializer="zeros", name="commits"
        )
        center_optimizer = self.outer_optimizer or clone_optimizer(
            unwrap_loss_scale(self.inner_optimizer),
            "center",
            drop_loss_scale_factor=True,
        )
        center_optimizer.build(centers)
        self.inner_optimizer.build(var_list)
        # Built with Keras's tracking off (this method's decorator).
        track_attribute_variables(center_optimizer, centers)
        track_attribute_variables(self.inner_optimizer, var_list)
        # Tracked attribute: the center optimizer's slots are checkpointed.
        self._center_optimizer = center_optimizer
        # Keras passes its variables, a custom loop may pass their tf.Variables.
        index = {id(v): i for i, v in enumerate(var_list)}
        index.update(
            (id(v.value), i)
            for i, v in enumerate(var_list)
            if isinstance(v, keras.Variable)
        )
        self._roles = _Untracked(
            model=var_list, centers=centers, accumulators=accumulators, index=index
        )

    def _build_center_side(self, var_list):
        strategy = self._strategy
        for variable in var_list:
            if not isinstance(variable, keras.Variable):
                raise ValueError(
                    "Under ParameterServerStrategy AGN expects the model's "
                    f"Keras variables. Received: {variable!r}"
                )
        # The inner (and outer) optimizer's own state, created with it, must
        # be on the parameter servers too: created under the same scope.
        for argument in ("inner_optimizer", "outer_optimizer"):
            optimizer = getattr(self, argument)
            if optimizer is None:
                continue
            device = tf.DeviceSpec.from_string(optimizer.iterations.value.device)
            if device.job != "ps":
                raise ValueError(
                    f"`{argument}` must be created under the same "
                    "`strategy.scope()` as AGN, so that its state lives on the "
                    f"parameter servers. Received: {argument}={optimizer!r} "
                    f"with its state on {device.to_string() or 'this process'}."
                )
        with strategy.scope():
            self._commits = self.add_variable(
                shape=(), dtype="int64", initializer="zeros", name="commits"
            )
            self.inner_optimizer.build(var_list)
            track_attribute_variables(self.inner_optimizer, var_list)
            if self.outer_optimizer is not None:
                self.outer_optimizer.build(var_list)
                track_attribute_variables(self.outer_optimizer, var_list)
        self._roles = _Untracked(model=var_list, centers=var_list)

    # ------------------------------------------------------------- read-outs
    @property
    def commits(self):
        """Commits applied to the center so far, an int64 `keras.Variable`."""
        self._require_built("commits")
        return self._commits

    @property
    def local_steps(self):
        """Local steps so far, an int64 `keras.Variable`: applied ones (one
        process), or committed by all workers together (parameter servers)."""
        return _internals.iterations_variable(self)

    @property
    def local_variables(self):
        """The variables the local steps update: the model's (one process)."""
        self._require_one_process("local_variables")
        return list(self._roles.model)

    @property
    def center_variables(self):
        """The variables the commits update (see the class docstring)."""
        self._require_built("center_variables")
        return list(self._roles.centers)

    @property
    def accumulators(self):
        """The gradient accumulators, one per variable (one process only);
        none with an outer optimizer."""
        self._require_one_process("accumulators")
        return list(self._roles.accumulators)

    @property
    def local_optimizer(self):
        """The optimizer that applies local steps (one process only)."""
        self._require_one_process("local_optimizer")
        return self.inner_optimizer

    @property
    def center_optimizer(self):
        """The optimizer that applies commits: the outer optimizer, else the
        inner one without loss scaling (one process: a copy of it)."""
        self._require_built("center_optimizer")
        if self.outer_optimizer is not None:
            return self.outer_optimizer
        if self._parameter_server:
            return unwrap_loss_scale(self.inner_optimizer)
        return self._center_optimizer

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

    def _require_one_process(self, what):
        self._require_built(what)
        if self._parameter_server:
            raise ValueError(
                f"Under ParameterServerStrategy AGN is driven round by round "
                "(`pull`, `local_update` x communication_period, `commit`) by "
                "`tf_lars.distribute.ParameterServerTrainer`, which holds the "
                f"worker-local state (`trainer.ps_agn`); `{what}` is for the "
                "one-process mode."
            )

    @property
    def variables(self):
        variables = super().variables + self.inner_optimizer.variables
        if self.built and not self._parameter_server:
            variables += self._center_optimizer.variables
        elif self.built and self.outer_optimizer is not None:
            variables += self.outer_optimizer.variables
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
        if self.built and self.outer_optimizer is None:
            self._center_optimizer.learning_rate = learning_rate

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    # ------------------------------------------------------------ the steps
    def apply(self, grads, trainable_variables=None):
        """One local step; commits when `communication_period` steps are done.

        One-process mode only. `grads` are gradients of `scale_loss(loss)`.
        """
        grads = list(grads)
        if not grads:
            return
        if trainable_variables is None:
            require_built(self)
            trainable_variables = self._roles.model
        else:
            trainable_variables = list(trainable_variables)
            if not self.built:
                with keras.name_scope(self.name, caller=self):
                    self.build(trainable_variables)
        self._require_one_process("apply")
        full = [None] * len(self._roles.model)
        for grad, variable in zip(grads, trainable_variables, strict=True):
            full[self._index_of(variable)] = grad
        finite = self.local_update(full)
        steps = self.local_steps
        self.assign_add(steps, tf.cast(finite, steps.dtype))
        step = tf.convert_to_tensor(steps)
        due = tf.logical_and(finite, tf.equal(step % self.communication_period, 0))
        tf.cond(due, self._commit_and_pull, lambda: tf.constant(False))

    def apply_gradients(self, grads_and_vars):
        grads, trainable_variables = zip(*grads_and_vars, strict=True)
        self.apply(grads, trainable_variables)
        return self.local_steps

    def _index_of(self, variable):
        index = self._roles.index.get(id(variable))
        if index is None:
            raise ValueError(
                "`trainable_variables` must be variables this optimizer was "
                f"built with. Received: {variable!r}"
            )
        return index

    def local_update(self, grads):
        """One local step (one process), its unscaled gradient accumulated.

        Args:
            grads: list, one gradient (or `None`) per entry of
                `local_variables`, of `scale_loss(loss)`.

        Returns:
            A scalar bool tensor: whether the step was applied (false when a
            loss-scale inner optimizer skipped a non-finite step).
        """
        self._require_one_process("local_update")
        roles = self._roles
        return local_step(
            self, self.inner_optimizer, roles.model, roles.accumulators, list(grads)
        )

    def pull(self):
        """Resets the local copy to the center and the accumulators to zero."""
        self._require_one_process("pull")
        roles = self._roles
        reset(
            self,
            roles.model,
            roles.centers,
            roles.accumulators,
            keeps_center=self.outer_optimizer is not None,
        )

    def commit(self):
        """Applies the commit to the center, then pulls (one process).

        Returns:
            The number of commits after this one, an int64 scalar tensor.
        """
        self._require_one_process("commit")
        self._commit_and_pull()
        return tf.convert_to_tensor(self._commits)

    def _commit_and_pull(self):
        roles = self._roles
        # With an outer optimizer the centers are the pulled copy.
        saved = roles.accumulators if self.outer_optimizer is None else roles.centers
        grads = commit_gradients(self, saved, roles.model)
        apply_commit(self, self._center_optimizer, grads, roles.centers)
        self.pull()
        return tf.constant(True)

    def get_config(self):
        outer = self.outer_optimizer
        return self._wrapper_config(
            communication_period=self.communication_period,
            outer_optimizer=(
                None if outer is None else _internals.portable_optimizer_config(outer)
            ),
        )

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        if config.get("outer_optimizer") is not None:
            config["outer_optimizer"] = keras.saving.deserialize_keras_object(
                config["outer_optimizer"], custom_objects=custom_objects
            )
        return super().from_config(config, custom_objects=custom_objects)


def _copy_of(variable):
    def initializer(shape, dtype=None):
        return tf.cast(tf.convert_to_tensor(variable), dtype or variable.dtype)

    return initializer
