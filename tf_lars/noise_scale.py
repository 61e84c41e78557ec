"""McCandlish et al.'s simple gradient noise scale, measured around any optimizer.

The estimator is docs/algorithms.md, section "Gradient noise scale". The
TensorFlow subclass (`tf_lars/backend/tensorflow.py`) takes the big batch from
the replicas under `tf.distribute` and sums sparse gradients' rows.
"""

import math

import keras
from keras import ops

from tf_lars import _validation
from tf_lars._wrapper import (
    InnerOptimizerWrapper,
    InnerOwnsTheRate,
    gradient_as_tensor,
    require_built,
    track_attribute_variables,
)
from tf_lars.backend import BackendSubclass

__all__ = ["GradientNoiseScale"]


def _check_inner(inner_optimizer):
    _validation.check_optimizer("inner_optimizer", inner_optimizer)
    if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "`inner_optimizer` must not be a loss-scale optimizer (its gradients "
            "are scaled): put the loss scale around the GradientNoiseScale. "
            f"Received: inner_optimizer={inner_optimizer!r}"
        )
    try:
        inner_optimizer.learning_rate  # noqa: B018 - read at every update
    except (AttributeError, ValueError, TypeError) as error:  # MultiOptimizer's
        raise ValueError(
            "`inner_optimizer` must have a learning rate, read at every update "
            f"({error}). Received: inner_optimizer={inner_optimizer!r}"
        ) from None
    if inner_optimizer.gradient_accumulation_steps:
        raise ValueError(
            "`inner_optimizer.gradient_accumulation_steps` must be unset: set it "
            "on the GradientNoiseScale. Received: inner_optimizer."
            f"gradient_accumulation_steps={inner_optimizer.gradient_accumulation_steps}"
        )


@keras.saving.register_keras_serializable(package="tf_lars")
class GradientNoiseScale(
    BackendSubclass, InnerOptimizerWrapper, InnerOwnsTheRate, keras.optimizers.Optimizer
):
    """Measures the simple gradient noise scale `B_simple` while training.

    The inner optimizer takes its step unchanged. At every update the wrapper
    has the gradient at two batch sizes `B_small < B_big`, from which it
    estimates `|G|²` (the true gradient's squared norm) and `tr(Σ)` (the trace
    of the per-example gradients' covariance) without bias, and keeps a moving
    average of each; `B_simple = tr(Σ) / |G|²`, in examples (McCandlish et al.
    2018, Appendix A; docs/algorithms.md, "Gradient noise scale"; how to read
    it: docs/guides/noise-scale.md).

    The small batch is one micro-batch of gradient accumulation
    (`B_big = gradient_accumulation_steps * batch_size`) or, under a
    `tf.distribute` strategy of `R >= 2` replicas, one replica's batch
    (`B_big = R * batch_size`, read from the inner optimizer's own sum of the
    replicas' gradients: no extra collective). Exactly one is required. Under
    `keras.distribution` the optimizer sees the global gradient only: use
    gradient accumulation there.

    Args:
        inner_optimizer: `keras.optimizers.Optimizer`. Takes every step and
            owns the learning rate. Not a loss-scale optimizer (put that
            around the wrapper), no gradient accumulation of its own.
        batch_size: int >= 1. Examples per small batch: `model.fit`'s
            `batch_size` with accumulation, or that over the replicas.
        beta: float in [0, 1). The moving averages' decay per update.
            Defaults to `0.99`.
        gradient_accumulation_steps: int >= 2 or None. Applies one update
            every this many batches, with their mean gradient (Keras's base
            argument). Defaults to `None`.
        name: str or None. Defaults to `None` (`"gradient_noise_scale"`).

    `b_simple`, `gradient_norm_squared` and `trace_covariance` are Python
    floats (NaN before the first update) read outside compiled code; the
    averages behind them are optimizer variables, saved with it.
    `tf_lars.callbacks.GradientNoiseScaleMonitor` puts them in `fit`'s logs.

    References:
        - [McCandlish, Kaplan, Amodei 2018: An Empirical Model of
          Large-Batch Training](https://arxiv.org/abs/1812.06162)

    Examples:
        >>> import keras, numpy as np, tf_lars
        >>> optimizer = tf_lars.GradientNoiseScale(
        ...     keras.optimizers.SGD(0.1), batch_size=1,
        ...     gradient_accumulation_steps=2)
        >>> w = keras.Variable([0.0, 0.0])
        >>> optimizer.apply([np.array([3.0, 1.0], "float32")], [w])
        >>> optimizer.apply([np.array([1.0, 3.0], "float32")], [w])
        >>> w.numpy()  # one SGD step with the mean gradient [2, 2]
        array([-0.2, -0.2], dtype=float32)
        >>> round(optimizer.gradient_norm_squared, 4)  # (2 * 8 - 10) / (2 - 1)
        6.0
        >>> round(optimizer.trace_covariance, 4)  # (10 - 8) / (1/1 - 1/2)
        4.0
        >>> round(optimizer.b_simple, 4)
        0.6667
    """

    def __init__(
        self,
        inner_optimizer,
        batch_size,
        beta=0.99,
        gradient_accumulation_steps=None,
        name=None,
    ):
        _check_inner(inner_optimizer)
        if gradient_accumulation_steps is not None:
            _validation.check_int(
                "gradient_accumulation_steps", gradient_accumulation_steps, 2
            )
        super().__init__(
            learning_rate=0.0,  # unused: the inner optimizer's rate applies
            gradient_accumulation_steps=gradient_accumulation_steps,
            name=name,
        )
        self.inner_optimizer = inner_optimizer
        self.batch_size = _validation.check_int("batch_size", batch_size, 1)
        self.beta = _validation.check_number("beta", beta, low=0.0, high=1.0)

    def build(self, variables):
        """Builds the inner optimizer and the estimator's scalars (written
        with the same value by every replica)."""
        if self.built:
            return
        _validation.check_inner_built_on(self.inner_optimizer, variables)
        super().build(variables)
        with keras.name_scope(self.name, caller=self):
            self.inner_optimizer.build(variables)
        track_attribute_variables(self.inner_optimizer, variables)
        for name, dtype in (
            ("small_batch_norms", "float32"),  # Σ |g|² over the micro-batches
            ("norm_squared_average", "float32"),
            ("trace_average", "float32"),
            ("updates_measured", "int32"),
        ):
            variable = self.add_variable(
                (), dtype=dtype, aggregation="only_first_replica", name=name
            )
            setattr(self, name, variable)

    @property
    def iterations(self):
        """The inner optimizer's step count (updates, not micro-batches)."""
        return self.inner_optimizer.iterations

    def _corrected(self, name):
        """The moving average `name` over `1 - beta**updates`; NaN before."""
        updates = int(ops.convert_to_numpy(self.updates_measured)) if self.built else 0
        if updates == 0:
            return math.nan
        average = float(ops.convert_to_numpy(getattr(self, name)))
        return average / (1.0 - self.beta**updates)

    @property
    def gradient_norm_squared(self):
        """`|G|²`: the bias-corrected moving average of its estimates."""
        return self._corrected("norm_squared_average")

    @property
    def trace_covariance(self):
        """`tr(Σ)`: the bias-corrected moving average of its estimates."""
        return self._corrected("trace_average")

    @property
    def b_simple(self):
        """`B_simple = tr(Σ) / |G|²`, in examples."""
        norm_squared = self.gradient_norm_squared
        return self.trace_covariance / norm_squared if norm_squared else math.nan

    def finalize_variable_values(self, var_list):
        """The inner optimizer's (its moving average of the weights, if any,
        becomes the weights), as at the end of `fit`."""
        self.inner_optimizer.finalize_variable_values(var_list)

    def apply(self, grads, trainable_variables=None):
        """Adds this micro-batch's `|g|²`, then Keras's `apply`."""
        grads = [gradient_as_tensor(g) for g in grads]
        if trainable_variables is None:
            require_built(self)
        elif not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(list(trainable_variables))
        steps, replicas = self.gradient_accumulation_steps, self._replicas()
        if (steps is None) == (replicas == 1):
            raise ValueError(
                "GradientNoiseScale takes its second batch size from exactly "
                "one of `gradient_accumulation_steps` >= 2 and a `tf.distribute` "
                "strategy of 2 or more replicas (Keras's accumulation does not "
                "run under one; under `keras.distribution` the optimizer sees "
                "the global gradient only: use accumulation). Received: "
                f"gradient_accumulation_steps={steps!r} on {replicas} replica(s)"
            )
        if steps:
            self.assign_add(self.small_batch_norms, self._squared_norm(grads))
        return super().apply(grads, trainable_variables)

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        # Once per update, on the accumulated mean or on one replica's gradient.
        small, big, ratio = self._step_norms(grads, trainable_variables)
        # Unbiased: E|G_B|² = |G|² + tr(Σ)/B at B_small and B_big = ratio B_small.
        norm_squared = (ratio * big - small) / (ratio - 1.0)
        trace = (small - big) * (ratio * self.batch_size / (ratio - 1.0))
        beta = ops.convert_to_tensor(self.beta, "float32")
        for average, value in (
            (self.norm_squared_average, norm_squared),
            (self.trace_average, trace),
        ):
            self.assign(average, beta * average + (1.0 - beta) * value)
        self.assign_add(self.updates_measured, ops.ones((), "int32"))

    def _step_norms(self, grads, trainable_variables):
        """Takes the inner step; returns `|G_small|²` (the micro-batches'
        mean), `|G_big|²` and `B_big / B_small`."""
        steps = float(self.gradient_accumulation_steps)
        small = self.small_batch_norms / steps
        self.assign(self.small_batch_norms, ops.zeros((), "float32"))
        big = self._squared_norm(grads)
        self.inner_optimizer.apply(grads, trainable_variables)
        return small, big, steps

    def _squared_norm(self, grads):
        """`Σ |g|²` over the gradients, in float32."""
        squares = [
            ops.sum(ops.square(ops.cast(g, "float32"))) for g in grads if g is not None
        ]
        return sum(squares, ops.zeros((), "float32"))

    def _replicas(self):
        """The replicas the inner optimizer sums (TensorFlow's: the strategy's)."""
        return 1

    def get_config(self):
        return self._wrapper_config(
            batch_size=self.batch_size,
            beta=self.beta,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
        )

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Creates a `GradientNoiseScale` from `get_config()`; unknown keys raise."""
        _validation.check_config_keys(cls, config)
        return super().from_config(config, custom_objects=custom_objects)
