"""Loss scaling for mixed-precision training, with a fixed or a dynamic scale."""

import keras
import numpy as np
from keras import ops

from tf_lars import _internals, _validation, _wrapper
from tf_lars._wrapper import is_indexed_slices, on_tensorflow

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


def _on_values(function, gradient):
    """`function` of a dense gradient, or of a sparse one's values (kept sparse)."""
    if gradient is None or not is_indexed_slices(gradient):
        return None if gradient is None else function(gradient)
    values = function(gradient.values)
    return type(gradient)(values, gradient.indices, gradient.dense_shape)


def _unscale(gradient, scale):
    """`gradient / scale`, computed in float32 for float16 / bfloat16 gradients
    (the scale can exceed the float16 range, so it is never cast down)."""

    def divide(values):
        dtype = keras.backend.standardize_dtype(values.dtype)
        wide = "float32" if dtype in ("float16", "bfloat16") else dtype
        quotient = ops.divide(ops.cast(values, wide), ops.cast(scale, wide))
        return ops.cast(quotient, dtype)

    return _on_values(divide, gradient)


def _as_applied(gradient, variable):
    """`gradient` in the variable's dtype, the one the inner optimizer applies
    it in (a float32 gradient of a float16 variable overflows there)."""
    return _on_values(lambda values: ops.cast(values, variable.dtype), gradient)


def _check_arguments(inner_optimizer, initial_scale, dynamic, kwargs):
    """Refuses bad arguments before `super().__init__`, which writes to the
    inner optimizer (an AttributeError on a non-optimizer)."""
    _validation.check_optimizer("inner_optimizer", inner_optimizer)
    if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "`inner_optimizer` must not itself be a loss-scale optimizer: the "
            "loss would be scaled twice. Received: "
            f"inner_optimizer={inner_optimizer!r}"
        )
    _validation.check_inner_learning_rate(inner_optimizer)
    _validation.check_positive("initial_scale", initial_scale)
    if not isinstance(dynamic, bool | np.bool_):
        raise ValueError(f"`dynamic` must be a bool. Received: dynamic={dynamic!r}")
    # Keras 3.15's `LossScaleOptimizer` refuses base arguments itself; 3.8 to
    # 3.11 silently ignored them: refused on every release, in Keras's words
    # (code matching Keras's message keeps working). Old configs carry them
    # at their defaults, which are dropped.
    for name, default in _wrapper.BASE_ARGUMENT_DEFAULTS.items():
        if kwargs.get(name, default) != default:
            raise ValueError(
                f"LossScaleOptimizer does not support `{name}`. Instead, set "
                f"`{name}` on the `inner_optimizer`. Received: "
                f"{name}={kwargs[name]!r}"
            )
        kwargs.pop(name, None)
    if kwargs:  # Keras 3.15's words (3.8 to 3.11 said "not recognized")
        raise ValueError(
            f"LossScaleOptimizer does not support arguments: `{'`, `'.join(kwargs)}`."
        )


def _check_float_gradients(grads, variables):
    """Refuses a gradient that is not floating point (it cannot be unscaled)."""
    for gradient, variable in zip(grads, variables, strict=True):
        values = gradient.values if is_indexed_slices(gradient) else gradient
        dtype = (
            None if values is None else keras.backend.standardize_dtype(values.dtype)
        )
        if dtype is not None and "float" not in dtype:
            raise ValueError(
                "`grads` must be floating-point: an integer or bool gradient "
                "cannot be unscaled. Received: a gradient of dtype "
                f"{dtype} for the variable {getattr(variable, 'path', variable.name)!r}"
            )


@keras.saving.register_keras_serializable(package="tf_lars")
class LossScaleOptimizer(
    _wrapper.InnerOptimizerWrapper, keras.optimizers.LossScaleOptimizer
):
    """Scales the loss, unscales and checks the gradients, skips non-finite steps.

    For mixed-precision training (`keras.mixed_precision.set_global_policy(
    "mixed_float16")`): small float16 gradients underflow to zero unless the
    loss is multiplied by a large scale `S` before differentiation. This
    wrapper owns `S`; `model.fit` calls `scale_loss` for you. Each step it
    unscales the gradients and applies them if every entry is finite, or
    skips the step (and, with `dynamic=True`, halves `S`) if not; the rule,
    growth included, is docs/algorithms.md, section "Loss scaling". With
    `dynamic=False` the scale is `initial_scale` forever (TF contrib's
    `FixedLossScaleManager`); non-finite steps are still skipped and counted.
    The scale stays within the float32 normal range.

    Sparse (`tf.IndexedSlices`) gradients are checked and unscaled without
    being densified. Under `tf.distribute` every replica takes the same skip
    decision (the per-replica verdicts are summed before branching). On JAX
    and PyTorch it runs through `model.fit`, `stateless_apply` (what the JAX
    trainer calls) and `apply`, the skip decision kept on the device. The
    inner optimizer sees the true gradient, so gradient-dependent rules such
    as LARS's trust ratio are unaffected by the scale.

    `dynamic_scale` (the current scale, float32), `step_counter` (finite steps
    since the last scale change; stays 0 when `dynamic=False`) and
    `skipped_step_counter` (non-finite steps skipped so far) are optimizer
    variables, saved by `model.save` and `tf.train.Checkpoint`. Read them
    through `loss_scale` and `skipped_steps`, or log them with
    `tf_lars.callbacks.LossScaleMonitor`.

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
        _check_arguments(inner_optimizer, initial_scale, dynamic, kwargs)
        super().__init__(
            inner_optimizer,
            initial_scale=float(initial_scale),
            dynamic_growth_steps=_validation.check_int(
                "dynamic_growth_steps", dynamic_growth_steps, 1
            ),
            name=name,
            **kwargs,
        )
        self.dynamic = bool(dynamic)

    def build(self, var_list):
        if self.built:
            return
        # Creates `step_counter`, `dynamic_scale`, builds the inner optimizer.
        super().build(var_list)
        _wrapper.track_attribute_variables(self.inner_optimizer, var_list)
        _finish_wrapper_build(self, var_list)
        self.skipped_step_counter = self.add_variable(
            shape=(),
            dtype="int",
            initializer="zeros",
            aggregation="none",
            name="skipped_step_counter",
        )

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
        return _wrapper.all_finite(grads)

    @property
    def iterations(self):
        """The inner optimizer's step count (the wrapper's own never moves;
        Keras 3.8's `LossScaleOptimizer` reports that one, 3.11 the inner)."""
        return self.inner_optimizer.iterations

    def apply(self, grads, trainable_variables=None):
        """Unscales and applies `grads`, or skips the step if any is non-finite.

        `grads` are gradients of `scale_loss(loss)`. On TensorFlow, call in
        replica context (eagerly, in a `tf.function`, or inside
        `strategy.run`).
        """
        grads = [_wrapper.gradient_as_tensor(g) for g in grads]
        if len(grads) == 0:
            return
        if trainable_variables is None:
            _wrapper.require_built(self)
        else:
            trainable_variables = list(trainable_variables)
            if not self.built:
                with keras.name_scope(self.name, caller=self):
                    self.build(trainable_variables)
                self.built = True
        variables = trainable_variables or _internals.trainable_variables_of(self)
        _check_float_gradients(grads, variables)
        # The check is on what the inner optimizer applies, not on the scaled
        # gradient: near the scale's floor (or below 1) a finite scaled
        # gradient can overflow when divided, and a float32 gradient of a
        # float16 variable when cast.
        scale = self.dynamic_scale.value
        unscaled = [
            g if _internals.overwrites_with_gradient(self, v) else _unscale(g, scale)
            for g, v in zip(grads, variables, strict=True)
        ]
        finite = self.check_finite(list(map(_as_applied, unscaled, variables)))
        if on_tensorflow():
            self._apply_on_tensorflow(finite, unscaled, trainable_variables)
        else:
            self._apply_and_select(finite, unscaled, trainable_variables, variables)

    def apply_gradients(self, grads_and_vars):
        grads, trainable_variables = zip(*grads_and_vars, strict=True)
        self.apply(grads, trainable_variables)
        return self.iterations

    def _next_scale(self, finite):
        """Writes the counters and the scale that follow a step (`finite`: a
        scalar bool tensor), on every backend: selected with `ops.where`, so
        the decision stays on the device and compiles to no branch."""
        skipped = self.skipped_step_counter.value
        self.assign(self.skipped_step_counter, ops.where(finite, skipped, skipped + 1))
        if not self.dynamic:
            return
        counter, scale = self.step_counter.value, self.dynamic_scale.value
        grow = ops.logical_and(
            finite, ops.equal(counter, self.dynamic_growth_steps - 1)
        )
        doubled = ops.where(scale * 2.0 <= _MAX_SCALE, scale * 2.0, scale)
        halved = ops.maximum(scale * 0.5, _MIN_SCALE)
        self.assign(
            self.step_counter,
            ops.where(
                ops.logical_and(finite, ops.logical_not(grow)),
                counter + 1,
                ops.zeros_like(counter),
            ),
        )
        self.assign(
            self.dynamic_scale,
            ops.where(grow, doubled, ops.where(finite, scale, halved)),
        )

    def _apply_and_select(self, finite, unscaled, trainable_variables, variables):
        """JAX and PyTorch: the inner step, kept where every gradient is
        finite, else undone.

        Both outcomes are computed and `ops.where` picks one for every model
        and inner variable: a branch (`ops.cond`) would be a host round trip
        on PyTorch and leaks tracers from an eager `apply` on JAX; under
        `jax.jit` XLA fuses the selection into the update.
        """
        state = [*variables, *self.inner_optimizer.variables]
        # JAX arrays are immutable; PyTorch updates its tensors in place.
        jax = keras.backend.backend() == "jax"
        before = [v.value if jax else ops.copy(v.value) for v in state]
        self.inner_optimizer.apply(unscaled, trainable_variables=trainable_variables)
        for variable, old in zip(state, before, strict=True):
            variable.assign(ops.where(finite, variable.value, old))
        self._next_scale(finite)

    def _apply_on_tensorflow(self, finite, unscaled, trainable_variables):
        """TensorFlow: `tf.cond` applies the inner step or skips it.

        Replicas see different local gradients (the all-reduce happens inside
        the inner optimizer): their verdicts are summed before branching, or
        one replica's inf would reach the variables through the others'.
        """
        import tensorflow as tf

        if tf.distribute.in_cross_replica_context():
            raise ValueError("`apply()` must be called in a replica context.")
        non_finite = tf.cast(tf.logical_not(finite), tf.float32)
        context = tf.distribute.get_replica_context()
        args = (unscaled, trainable_variables)
        if not _internals.strategy_supports_no_merge_call():
            # The inner optimizer's update calls `merge_call`, which may not
            # sit inside a `tf.cond` in replica context: branch in
            # cross-replica context and re-enter the replicas for the update.
            context.merge_call(self._apply_or_skip, args=(non_finite, *args))
            return
        if context.num_replicas_in_sync > 1:
            non_finite = context.all_reduce(tf.distribute.ReduceOp.SUM, non_finite)
        self._apply_or_skip(None, non_finite, *args)

    def _apply_or_skip(self, distribution, non_finite, *args):
        """The inner step where no replica saw a non-finite gradient, then the
        next scale; `distribution` is given in cross-replica context."""
        import tensorflow as tf

        def inner_apply():
            if distribution is None:
                self.inner_optimizer.apply(*args)
            else:
                call = distribution.extended.call_for_each_replica
                call(self.inner_optimizer.apply, args=args)

        if distribution is not None and distribution.num_replicas_in_sync > 1:
            # Summed where the strategy reduces to: no extra collective.
            sum_ = tf.distribute.ReduceOp.SUM
            non_finite = distribution.reduce(sum_, non_finite, axis=None)
        elif distribution is not None:
            (non_finite,) = distribution.experimental_local_results(non_finite)
        finite = tf.equal(non_finite, 0.0)
        tf.cond(finite, inner_apply, lambda: None)
        self._next_scale(finite)

    def get_config(self):
        return self._wrapper_config(
            initial_scale=self.initial_scale,
            dynamic=self.dynamic,
            dynamic_growth_steps=self.dynamic_growth_steps,
        )


def _finish_wrapper_build(optimizer, var_list):
    """Runs the base `Optimizer.build` that Keras's `LossScaleOptimizer.build`
    skips through Keras 3.11 (3.15 calls it)."""
    if not _internals.trainable_variables_of(optimizer) and var_list:
        keras.optimizers.Optimizer.build(optimizer, list(var_list))
