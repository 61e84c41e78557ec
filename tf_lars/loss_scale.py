"""Loss scaling for mixed-precision training, with a fixed or a dynamic scale."""

import math
import numbers

import keras
import numpy as np
from keras import ops

from tf_lars import _internals
from tf_lars._validation import check_inner_learning_rate, check_int
from tf_lars._wrapper import (
    BASE_ARGUMENT_DEFAULTS,
    InnerOptimizerWrapper,
    all_finite,
    gradient_as_tensor,
    is_indexed_slices,
    on_tensorflow,
    require_built,
)

# TensorFlow is imported inside the methods of the TensorFlow path only, so
# that the wrapper loads without it on the JAX and PyTorch backends.

# The scale lives in a float32 variable. Doubling past the largest float32
# would make it inf (every later step non-finite, the scale stuck at inf) and
# halving past the smallest normal float32 drives it to 0 (the unscaled
# gradient becomes 0 / 0). Keras 3 lets both happen; we stop at the edge.
_MAX_SCALE = float(np.finfo(np.float32).max)
_MIN_SCALE = float(np.finfo(np.float32).tiny)


def _count_dtype():
    # JAX without its 64-bit mode has no int64 (a cast warns and gives int32).
    return "int32" if keras.backend.backend() == "jax" else "int64"


def _is_bool(value):
    return isinstance(value, bool | np.bool_)


def _check_initial_scale(initial_scale):
    if (
        _is_bool(initial_scale)
        or not isinstance(initial_scale, numbers.Real)
        or not math.isfinite(initial_scale)
        or not 0 < initial_scale <= _MAX_SCALE
    ):
        raise ValueError(
            "`initial_scale` must be a finite number > 0 (at most the largest "
            f"float32, {_MAX_SCALE:g}). Received: initial_scale={initial_scale!r}"
        )


def _check_dynamic(dynamic):
    if not _is_bool(dynamic):
        raise ValueError(f"`dynamic` must be a bool. Received: dynamic={dynamic!r}")


def _check_inner_optimizer(inner_optimizer):
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        raise ValueError(
            "`inner_optimizer` must be a `keras.optimizers.Optimizer` instance. "
            f"Received: inner_optimizer={inner_optimizer!r}"
        )
    if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "`inner_optimizer` must not itself be a loss-scale optimizer: the "
            "loss would be scaled twice. Received: "
            f"inner_optimizer={inner_optimizer!r}"
        )
    check_inner_learning_rate(inner_optimizer)


def _unscale(gradient, scale):
    """`gradient / scale`, computed in float32 for float16 / bfloat16 gradients.

    The scale can exceed the float16 range (2**16 and up), so it is never cast
    down to a half-precision gradient dtype.
    """
    if gradient is None:
        return None
    if is_indexed_slices(gradient):
        return type(gradient)(
            _unscale(gradient.values, scale), gradient.indices, gradient.dense_shape
        )
    dtype = keras.backend.standardize_dtype(gradient.dtype)
    compute_dtype = "float32" if dtype in ("float16", "bfloat16") else dtype
    unscaled = ops.divide(
        ops.cast(gradient, compute_dtype), ops.cast(scale, compute_dtype)
    )
    return ops.cast(unscaled, dtype)


def _as_applied(gradient, variable):
    """`gradient` in the dtype the inner optimizer applies it in: the
    variable's, where that is another float type (a float32 gradient of a
    float16 variable overflows there, not before)."""
    if gradient is None:
        return None
    dtype = keras.backend.standardize_dtype(variable.dtype)
    if is_indexed_slices(gradient):
        values = _as_applied(gradient.values, variable)
        return type(gradient)(values, gradient.indices, gradient.dense_shape)
    if keras.backend.standardize_dtype(gradient.dtype) == dtype:
        return gradient
    return ops.cast(gradient, dtype)


def _check_float_gradients(grads, variables):
    """Refuses a gradient that is not floating point (it cannot be unscaled)."""
    for gradient, variable in zip(grads, variables, strict=True):
        if gradient is None:
            continue
        values = gradient.values if is_indexed_slices(gradient) else gradient
        dtype = keras.backend.standardize_dtype(values.dtype)
        if "float" not in dtype:
            raise ValueError(
                "`grads` must be floating-point: an integer or bool gradient "
                "cannot be unscaled. Received: a gradient of dtype "
                f"{dtype} for the variable {getattr(variable, 'path', variable.name)!r}"
            )


def _snapshot(variable):
    """The variable's current value, kept apart from later in-place updates.

    JAX arrays are immutable; PyTorch optimizers update tensors in place, so
    there the value is copied.
    """
    value = variable.value
    return value if keras.backend.backend() == "jax" else ops.copy(value)


def _pop_base_defaults(kwargs):
    """Removes base arguments at their defaults; refuses any other value.

    Keras 3.15's `LossScaleOptimizer` refuses them itself; Keras 3.8 to 3.11
    accepted and silently ignored them, so the wrapper checks on every release,
    in Keras's own words (code matching Keras's message keeps working).
    """
    for name, default in BASE_ARGUMENT_DEFAULTS.items():
        if name in kwargs and kwargs[name] != default:
            raise ValueError(
                f"LossScaleOptimizer does not support `{name}`. Instead, set "
                f"`{name}` on the `inner_optimizer`. Received: "
                f"{name}={kwargs[name]!r}"
            )
        kwargs.pop(name, None)


@keras.saving.register_keras_serializable(package="tf_lars")
class LossScaleOptimizer(InnerOptimizerWrapper, keras.optimizers.LossScaleOptimizer):
    """Scales the loss, unscales and checks the gradients, skips non-finite steps.

    For mixed-precision training (`keras.mixed_precision.set_global_policy(
    "mixed_float16")`): small float16 gradients underflow to zero unless the
    loss is multiplied by a large scale `S` before differentiation. This
    wrapper owns `S`; `model.fit` calls `scale_loss` for you. Each step it
    unscales the gradients and applies them if every entry is finite, or
    skips the step (and, with `dynamic=True`, halves `S`) if not; the rule,
    growth included, is stated once, in docs/algorithms.md, section "Loss
    scaling".

    With `dynamic=False` the scale is `initial_scale` forever (TF contrib's
    `FixedLossScaleManager`); non-finite steps are still skipped and counted.
    Sparse (`tf.IndexedSlices`) gradients are checked and unscaled without
    being densified. Under `tf.distribute` every replica takes the same skip
    decision (the per-replica verdicts are summed before branching). The
    scale is kept within the float32 normal range: it stops doubling at the
    largest float32 and stops halving at the smallest normal float32.

    It runs on every Keras backend: on JAX and PyTorch through `model.fit`,
    `stateless_apply` (what the JAX trainer calls) and `apply`, the skip
    decision kept on the device. `stateless_apply` is refused on
    TensorFlow, whose optimizers write their variables directly.

    Because the gradients are unscaled before the inner optimizer sees them,
    gradient-dependent rules such as LARS's trust ratio (not scale-invariant
    when weight decay is on) see the true gradient.

    `dynamic_scale` (the current scale, float32), `step_counter` (finite steps
    since the last scale change; stays 0 when `dynamic=False`) and
    `skipped_step_counter` (non-finite steps skipped so far) are optimizer
    variables: they are saved by `model.save` and `tf.train.Checkpoint`. Read
    them through the `loss_scale` and `skipped_steps` properties, or log them
    with `tf_lars.callbacks.LossScaleMonitor`.

    Args:
        inner_optimizer: `keras.optimizers.Optimizer`. The optimizer that
            applies the unscaled gradients (`tf_lars.LARS` or any Keras
            optimizer; not itself a loss-scale optimizer). Its own
            `loss_scale_factor` is set to `None`.
        initial_scale: float. The loss scale at the start, a finite number
            greater than 0. Defaults to `2**15`.
        dynamic: bool. Whether the scale adapts (halves on a non-finite step,
            doubles after `dynamic_growth_steps` finite steps in a row).
            Defaults to `True`.
        dynamic_growth_steps: int >= 1. Finite steps in a row before the
            scale doubles; unused when `dynamic=False`. Defaults to `2000`.
        name: str. The optimizer's name. Defaults to `None`
            (`"loss_scale_optimizer"`).
        **kwargs: Keras base optimizer arguments are not supported on the
            wrapper (set them on `inner_optimizer`); only their default values
            are accepted, for loading old configs.

    References:
        - [Micikevicius et al., 2018. Mixed Precision Training](
          https://arxiv.org/abs/1710.03740)
        - Keras 3 `keras.optimizers.LossScaleOptimizer` (the dynamic rule);
          TF contrib `LossScaleOptimizer` / `FixedLossScaleManager` (the
          fixed one).

    Examples:
        Custom training loop:

        >>> var = keras.Variable([1.0, 2.0])
        >>> opt = tf_lars.LossScaleOptimizer(keras.optimizers.SGD(0.5),
        ...                                  initial_scale=8.0)
        >>> with tf.GradientTape() as tape:
        ...     loss = tf.reduce_sum(var * var) / 2.0
        ...     scaled = opt.scale_loss(loss)      # loss * 8
        >>> grads = tape.gradient(scaled, [var])   # [8.0, 16.0]
        >>> opt.apply(grads, [var])                # applies [1.0, 2.0]
        >>> var.numpy()
        array([0.5, 1. ], dtype=float32)

        With `model.fit`:

        ```python
        keras.mixed_precision.set_global_policy("mixed_float16")
        model.compile(
            optimizer=tf_lars.LossScaleOptimizer(tf_lars.LARS(learning_rate=1.0)),
            loss="mse",
        )
        model.fit(x, y, callbacks=[tf_lars.callbacks.LossScaleMonitor()])
        ```
    """

    def __init__(
        self,
        inner_optimizer,
        initial_scale=2.0**15,
        dynamic=True,
        dynamic_growth_steps=2000,
        name=None,
        **kwargs,
    ):
        # Validated before `super().__init__`, which writes to the inner
        # optimizer and would fail on a non-optimizer with an AttributeError.
        _check_inner_optimizer(inner_optimizer)
        _check_initial_scale(initial_scale)
        _check_dynamic(dynamic)
        check_int("dynamic_growth_steps", dynamic_growth_steps, 1)
        _pop_base_defaults(kwargs)
        super().__init__(
            inner_optimizer,
            initial_scale=float(initial_scale),
            dynamic_growth_steps=int(dynamic_growth_steps),
            name=name,
            **kwargs,
        )
        self.dynamic = bool(dynamic)

    def build(self, var_list):
        if self.built:
            return
        # Creates `step_counter`, `dynamic_scale`, builds the inner optimizer.
        super().build(var_list)
        _internals.finish_wrapper_build(self, var_list)
        self.skipped_step_counter = self.add_variable(
            shape=(),
            dtype="int",
            initializer="zeros",
            aggregation="none",
            name="skipped_step_counter",
        )

    # ------------------------------------------------------------ read-outs
    @property
    def loss_scale(self):
        """The current loss scale, a float32 scalar tensor."""
        if not self.built:
            return ops.convert_to_tensor(self.initial_scale, "float32")
        # A copy: PyTorch's variable value is the live, updated tensor.
        return ops.copy(self.dynamic_scale.value)

    @property
    def skipped_steps(self):
        """How many steps were skipped for a non-finite gradient.

        int64 (int32 on JAX unless its 64-bit mode is on).
        """
        if not self.built:
            return ops.convert_to_tensor(0, _count_dtype())
        return ops.cast(ops.copy(self.skipped_step_counter.value), _count_dtype())

    def check_finite(self, grads):
        """A scalar bool tensor: every gradient (dense or sparse) is finite."""
        return all_finite(grads)

    @property
    def iterations(self):
        """The inner optimizer's step count (the wrapper's own never moves).

        Keras's `LossScaleOptimizer` reports the inner count in 3.11 (and
        3.15); 3.8 reports the wrapper's own, which stays 0 here.
        """
        return self.inner_optimizer.iterations

    # ---------------------------------------------------------------- apply
    def apply(self, grads, trainable_variables=None):
        """Unscales and applies `grads`, or skips the step if any is non-finite.

        `grads` are gradients of `scale_loss(loss)`. On TensorFlow, call in
        replica context (eagerly, in a `tf.function`, or inside
        `strategy.run`).
        """
        grads = [gradient_as_tensor(g) for g in grads]
        if len(grads) == 0:
            return
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
            if not self.built:
                with keras.name_scope(self.name, caller=self):
                    self.build(trainable_variables)
                self.built = True
        else:
            require_built(self)
        _check_float_gradients(
            grads, trainable_variables or _internals.trainable_variables_of(self)
        )
        if on_tensorflow():
            self._apply_on_tensorflow(grads, trainable_variables)
        else:
            self._apply_and_select(grads, trainable_variables)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        """`apply` on given values: returns the new model and optimizer values.

        What the JAX trainer calls (under `jax.jit` or not). Not on the
        TensorFlow backend, whose optimizers write their variables directly.
        """
        if on_tensorflow():
            return super().stateless_apply(
                optimizer_variables, grads, trainable_variables
            )
        if not self.built:
            raise ValueError(
                "To call `stateless_apply`, LossScaleOptimizer must be built. "
                "Call `optimizer.build(trainable_variables)` first."
            )
        model_variables = list(_internals.trainable_variables_of(self))
        own_variables = list(self.variables)
        mapping = list(zip(model_variables, trainable_variables, strict=True))
        mapping += list(zip(own_variables, optimizer_variables, strict=True))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            self._apply_and_select(grads, None)

        def current(variables, values):
            found = [scope.get_current_value(v) for v in variables]
            return [v if f is None else f for f, v in zip(found, values)]

        return (
            current(model_variables, trainable_variables),
            current(own_variables, optimizer_variables),
        )

    def apply_gradients(self, grads_and_vars):
        grads, trainable_variables = zip(*grads_and_vars, strict=True)
        self.apply(grads, trainable_variables)
        # The wrapper's own `_iterations` never moves; report the inner one.
        return self.iterations

    def _unscale_and_check(self, grads, variables):
        """The unscaled gradients, and whether every one is finite.

        The check is on what the inner optimizer applies, not on the scaled
        gradient: at a scale near its floor (or below 1) a finite scaled
        gradient can overflow when divided, and a float32 gradient of a
        float16 variable can overflow when cast.
        """
        scale = self.dynamic_scale.value
        unscaled = [
            g
            if g is None or _internals.overwrites_with_gradient(self, v)
            else _unscale(g, scale)
            for g, v in zip(grads, variables, strict=True)
        ]
        applied = [_as_applied(g, v) for g, v in zip(unscaled, variables, strict=True)]
        return unscaled, self.check_finite(applied)

    # ------------------------------------------- JAX and PyTorch: selection
    def _apply_and_select(self, grads, trainable_variables):
        """The inner step, kept where every gradient is finite, else undone.

        The decision stays a device tensor: both outcomes are computed and
        `ops.where` picks one for every model variable, inner variable
        (slots, `iterations`) and counter. A branch (`ops.cond`) would be a
        host round trip on PyTorch and leaks tracers from an eager `apply`
        on JAX; under `jax.jit` XLA fuses the selection into the update.
        """
        variables = trainable_variables or _internals.trainable_variables_of(self)
        unscaled, finite = self._unscale_and_check(grads, variables)
        state = [*variables, *self.inner_optimizer.variables]
        before = [_snapshot(v) for v in state]
        self.inner_optimizer.apply(unscaled, trainable_variables=trainable_variables)
        for variable, old in zip(state, before, strict=True):
            variable.assign(ops.where(finite, variable.value, old))
        self._select_scale(finite)

    def _select_scale(self, finite):
        skipped = self.skipped_step_counter.value
        self.skipped_step_counter.assign(ops.where(finite, skipped, skipped + 1))
        if not self.dynamic:
            return
        counter = self.step_counter.value
        scale = self.dynamic_scale.value
        grow = ops.equal(counter, self.dynamic_growth_steps - 1)
        doubled = scale * 2.0
        scale_if_finite = ops.where(
            grow, ops.where(doubled <= _MAX_SCALE, doubled, scale), scale
        )
        counter_if_finite = ops.where(grow, ops.zeros_like(counter), counter + 1)
        self.step_counter.assign(
            ops.where(finite, counter_if_finite, ops.zeros_like(counter))
        )
        self.dynamic_scale.assign(
            ops.where(finite, scale_if_finite, ops.maximum(scale * 0.5, _MIN_SCALE))
        )

    # -------------------------------------------- TensorFlow: a conditional
    def _apply_on_tensorflow(self, grads, trainable_variables):
        import tensorflow as tf

        if tf.distribute.in_cross_replica_context():
            raise ValueError("`apply()` must be called in a replica context.")

        # Replicas see different local gradients (the all-reduce happens
        # inside the inner optimizer): each replica's verdict is combined
        # before branching, or one replica's inf would reach the variables
        # through the others' summed gradient.
        variables = trainable_variables or _internals.trainable_variables_of(self)
        unscaled, finite = self._unscale_and_check(grads, variables)
        non_finite = tf.cast(tf.logical_not(finite), tf.float32)
        if _internals.strategy_supports_no_merge_call():
            context = tf.distribute.get_replica_context()
            if context.num_replicas_in_sync > 1:
                non_finite = context.all_reduce(tf.distribute.ReduceOp.SUM, non_finite)
            finite = tf.equal(non_finite, 0.0)
            self._apply_or_skip(finite, unscaled, trainable_variables)
        else:
            # The inner optimizer's update calls `merge_call`, which may not
            # sit inside a `tf.cond` in replica context: branch in
            # cross-replica context and re-enter the replicas for the update.
            tf.distribute.get_replica_context().merge_call(
                self._cross_replica_apply_or_skip,
                args=(non_finite, unscaled, trainable_variables),
            )

    def _cross_replica_apply_or_skip(
        self, distribution, non_finite, unscaled, trainable_variables
    ):
        import tensorflow as tf

        if distribution.num_replicas_in_sync > 1:
            # Summed where the strategy reduces to (on one host for a single
            # worker): no extra collective in the step.
            non_finite = distribution.reduce(
                tf.distribute.ReduceOp.SUM, non_finite, axis=None
            )
        else:
            (non_finite,) = distribution.experimental_local_results(non_finite)

        def apply_unscaled():
            distribution.extended.call_for_each_replica(
                self._apply_unscaled, args=(unscaled, trainable_variables)
            )

        tf.cond(tf.equal(non_finite, 0.0), apply_unscaled, self._skip_step)

    def _apply_or_skip(self, finite, unscaled, trainable_variables):
        import tensorflow as tf

        tf.cond(
            finite,
            lambda: self._apply_unscaled(unscaled, trainable_variables),
            self._skip_step,
        )

    def _apply_unscaled(self, unscaled, trainable_variables):
        self.inner_optimizer.apply(unscaled, trainable_variables=trainable_variables)
        if self.dynamic:
            self._count_finite_step()

    def _count_finite_step(self):
        import tensorflow as tf

        def grow():
            doubled = self.dynamic_scale.value * 2.0
            self.assign(self.step_counter, 0)
            self.assign(
                self.dynamic_scale,
                tf.where(doubled <= _MAX_SCALE, doubled, self.dynamic_scale.value),
            )

        def count():
            self.assign_add(self.step_counter, 1)

        tf.cond(
            tf.equal(self.step_counter.value, self.dynamic_growth_steps - 1),
            grow,
            count,
        )

    def _skip_step(self):
        import tensorflow as tf

        self.assign_add(self.skipped_step_counter, 1)
        if self.dynamic:
            self.assign(self.step_counter, 0)
            self.assign(
                self.dynamic_scale,
                tf.maximum(self.dynamic_scale.value * 0.5, _MIN_SCALE),
            )

    def get_config(self):
        return self._wrapper_config(
            initial_scale=self.initial_scale,
            dynamic=self.dynamic,
            dynamic_growth_steps=self.dynamic_growth_steps,
        )
