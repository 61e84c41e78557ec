"""LAMB: `tf_lars.TrustRatio` around Adam, its whole step in this file.

The rule is docs/algorithms.md, section "TrustRatio and LAMB"; the table
there maps the published LAMB variants onto this class's flags.
`LAMB.update_step` reads top to bottom: Adam's moments and direction
(`lamb_direction`, with `LambAdam`), the weight decay, the trust ratio and
the write (`TrustRatio._take_step`). On the TensorFlow backend, without XLA,
`tf_lars._tf_fast.lamb_direction` computes the same direction in one fused
kernel; under XLA (TensorFlow's or JAX's) step 3 (trust ratio) computes it
again instead of reading it back (`lamb_direction`).
"""

import keras
from keras import ops

from tf_lars import _internals, _kernels, _rules
from tf_lars._validation import check_config_keys, check_number, is_real
from tf_lars.trust_ratio import TrustRatio

__all__ = ["LAMB"]


class LambAdam(keras.optimizers.Adam):
    """`keras.optimizers.Adam` with epsilon added after the bias correction.

    `keras.optimizers.Adam` adds its `epsilon` to `sqrt(v)` before the bias
    correction of `v`; LAMB (the paper, optax, Keras's own `Lamb`, timm,
    tensorflow-addons) adds it to `sqrt(v_hat)`, after. The slots, their
    update and the bias correction are Adam's:

    ```
    m <- b1 m + (1 - b1) g          v <- b2 v + (1 - b2) g**2
    w <- w - lr * (m / (1 - b1**t)) / (sqrt(v / (1 - b2**t)) + epsilon)
    ```
    """

    def __init__(self, *args, eps_root=0.0, name=None, **kwargs):
        # Keras 3.8 to 3.11's Adam defaults to name="adam", so two LAMBs' slot
        # paths collide; None auto-names ("lamb_adam", "lamb_adam_1"), as
        # Keras 3.15 does.
        super().__init__(*args, name=name, **kwargs)
        self.eps_root = eps_root

    @property
    def fusable(self):
        """Whether TensorFlow's fused Adam kernel computes this direction:
        it has no `eps_root`, and divides 0 by 0 where `epsilon` is 0."""
        return self.eps_root == 0.0 and self.epsilon != 0.0

    def divide(self, m, v, epsilon):
        """`m / (sqrt(v + eps_root (1 - b2**t)) + epsilon)`, 0 where that is 0 / 0.

        `sqrt(v_hat + eps_root) = sqrt(v + eps_root (1 - b2**t)) / sqrt(1 -
        b2**t)`: optax's `eps_root` with the bias correction folded as in
        `direction`. With both epsilons 0 a variable whose gradients were
        all 0 has `m = v = 0`: its direction is 0, not NaN.
        """
        if self.eps_root != 0.0:
            dtype = keras.backend.standardize_dtype(v.dtype)
            scalar = _rules.compute_dtype(dtype)
            shift = ops.convert_to_tensor(self.eps_root, scalar) * ops.square(
                self._root_2(dtype)
            )
            v = v + ops.cast(shift, dtype)
        denominator = ops.sqrt(v) + epsilon
        if self.eps_root == 0.0 and self.epsilon == 0.0:
            denominator = ops.where(
                denominator > 0, denominator, ops.ones_like(denominator)
            )
        return m / denominator

    def update_step(self, gradient, variable, learning_rate):
        scale, direction = self.direction(gradient, variable, learning_rate)
        self.assign_sub(variable, scale * direction)

    def direction(self, gradient, variable, learning_rate):
        """Updates `m` and `v`; returns `(scale, direction)` of the step.

        The step `lr * m_hat / (sqrt(v_hat) + eps)` is `scale * direction`
        with `direction = m / (sqrt(v) + eps * sqrt(1 - b2**t))` and the
        scalar `scale = lr * sqrt(1 - b2**t) / (1 - b1**t)`: the two bias
        corrections are folded into scalars, one pass over `m` and `v`.
        Sparse gradients (TensorFlow's `tf.IndexedSlices`) update the slots
        with scatters, repeated rows summed first (Adam on the summed dense
        gradient), never densified.
        """
        dtype = variable.dtype
        m, v = _internals.adam_slots(self, _internals.variable_index(self, variable))
        # `1 - beta` is rounded once from the Python float: bfloat16 holds
        # 0.999 as 1.0, so `1 - beta_2` in bfloat16 would be 0 (v frozen).
        one_minus_1 = ops.convert_to_tensor(1 - self.beta_1, dtype)
        one_minus_2 = ops.convert_to_tensor(1 - self.beta_2, dtype)
        if _kernels.is_sparse(gradient):
            _kernels.sparse_adam_moments(self, gradient, m, v, one_minus_1, one_minus_2)
        else:
            gradient = ops.cast(gradient, dtype)
            self.assign_add(m, (gradient - m) * one_minus_1)
            self.assign_add(v, (ops.square(gradient) - v) * one_minus_2)
        epsilon = self.bias_corrected_epsilon(dtype)
        return self.direction_scale(dtype, learning_rate), self.divide(m, v, epsilon)

    def moments(self, variable):
        """The values of `m` and `v` of `variable` (after `direction`)."""
        m, v = _internals.adam_slots(self, _internals.variable_index(self, variable))
        return ops.convert_to_tensor(m), ops.convert_to_tensor(v)

    def _once_per_step(self, key, compute):
        """`compute()`, or its value from earlier in this step.

        Adam's scalars are the same for every variable of one dtype; where
        a compiler sees the whole step (`TrustRatio._backend_update_step`
        opens `_step_scalars` then) they are computed once instead of once
        per variable, which kept LAMB's compiled program, and its compile
        time, growing faster than Adam's (docs/guides/benchmarks.md,
        "Compile time"). Elsewhere every call computes them.
        """
        memo = self.__dict__.get("_step_scalars")
        if memo is None:
            return compute()
        if key not in memo:
            memo[key] = compute()
        return memo[key]

    def _root_2(self, dtype):
        """`sqrt(1 - b2**t)` in float32 (float64 for float64 variables)."""
        scalar = _rules.compute_dtype(dtype)

        def compute():
            step = ops.cast(self.iterations + 1, scalar)
            beta_2 = ops.convert_to_tensor(self.beta_2, scalar)
            return ops.sqrt(1 - ops.power(beta_2, step))

        return self._once_per_step(("root_2", scalar), compute)

    def bias_corrected_epsilon(self, dtype):
        """`eps * sqrt(1 - b2**t)`, the epsilon of `direction`, in `dtype`."""
        scalar = _rules.compute_dtype(dtype)
        return self._once_per_step(
            ("epsilon", str(dtype)),
            lambda: ops.cast(
                ops.convert_to_tensor(self.epsilon, scalar) * self._root_2(dtype),
                dtype,
            ),
        )

    def direction_scale(self, dtype, learning_rate):
        """`lr * sqrt(1 - b2**t) / (1 - b1**t)`: the step is this times `direction`.

        Computed in float32 and cast to `dtype`: in bfloat16 `b2**t` rounds
        to 1 and the scale to 0 (with a zero epsilon term: 0 * inf = NaN).
        """
        scalar = _rules.compute_dtype(dtype)

        def compute():
            step = ops.cast(self.iterations + 1, scalar)
            beta_1 = ops.convert_to_tensor(self.beta_1, scalar)
            correction_1 = 1 - ops.power(beta_1, step)
            scale = ops.cast(learning_rate, scalar) / correction_1 * self._root_2(dtype)
            return ops.cast(scale, dtype)

        return self._once_per_step(("scale", str(dtype), id(learning_rate)), compute)


def lamb_direction(lamb, gradient, variable, learning_rate, decay):
    """Steps 1 and 2 (inner step, decay) of `lamb`: Adam's moments, `lr * u` with
    `u = m_hat / (sqrt(v_hat) + eps) + wd * w` as `(scale, direction)`.

    Returns `(scale, direction, for_norm)`. `for_norm` is what step 3
    (trust ratio) takes the norm of: `direction` itself, or, where XLA
    compiles the step (JAX under `jit`, TensorFlow under XLA;
    `_rules.recomputes_for_norms`), a
    function that computes the same values again from `m`, `v` and `w`.
    XLA then sums their squares in the pass that reads `m`, `v` and `w`,
    instead of writing the direction (used twice) to memory and reading it
    back (docs/guides/benchmarks.md: LAMB's XLA step over ResNet-50's
    shapes, and the same step with the direction stored for its norm).
    """
    adam = lamb.inner_optimizer
    scale, direction = adam.direction(gradient, variable, learning_rate)
    direction = lamb._with_decay(direction, scale, variable, learning_rate, decay)
    if not _kernels.recomputes_for_norms(direction) or _rules.stacks(direction):
        # A small direction is copied into its shape's rows for the norm
        # (`_rules.norm_groups`) anyway: computing it again saves nothing.
        return scale, direction, direction
    m, v = adam.moments(variable)
    scalars = [adam.bias_corrected_epsilon(variable.dtype)]
    if decay != 0.0:
        scalars.append(lamb._decay_factor(scale, learning_rate, decay))
    weights = ops.convert_to_tensor(variable)

    def for_norm():
        # The same values as `direction` (`TrustRatio._with_decay`'s sum);
        # `abs` (v >= 0) only makes the expression a different one, so that
        # XLA does not share the two. The scalars pass `apart` with `v`: on
        # JAX, XLA would otherwise fold their arithmetic into a broadcast
        # and write it out as large as `v` before the norm reads it (a
        # barrier around the scalars alone did not stop that;
        # docs/guides/backends.md).
        kept = _rules.apart([v, *scalars])  # v, epsilon, the decay factor
        again = adam.divide(m, ops.abs(kept[0]), kept[1])
        if decay == 0.0:
            return again
        return again + kept[2] * weights

    return scale, direction, for_norm


def _check_learning_rate(learning_rate):
    if is_real(learning_rate):
        return check_number("learning_rate", learning_rate, low=0.0)
    if not callable(learning_rate):  # schedules are callable too
        raise ValueError(
            "`learning_rate` must be a non-negative finite float, a "
            "`keras.optimizers.schedules.LearningRateSchedule` or a "
            f"callable. Received: learning_rate={learning_rate!r}"
        )
    return learning_rate


@keras.saving.register_keras_serializable(package="tf_lars")
class LAMB(TrustRatio):
    """LAMB (You et al. 2019): Adam with a layer-wise trust ratio.

    `tf_lars.TrustRatio` around Adam; `optimizer.inner_optimizer` is the
    Adam (a `keras.optimizers.Adam` whose `epsilon` is added after the bias
    correction, as every LAMB does). Per variable, Adam's bias-corrected
    direction plus weight decay is rescaled by a layer-wise trust ratio; the
    rule is stated once, in docs/algorithms.md, section "TrustRatio and LAMB".

    `LAMB(learning_rate=lr, beta_1=b1, beta_2=b2, epsilon=eps,
    weight_decay=wd)` equals `optax.lamb(lr, b1, b2, eps, weight_decay=wd)`
    step for step; docs/algorithms.md maps the paper, Keras's `Lamb`, timm's
    `Lamb` and tensorflow-addons / Model Garden's `LAMB` onto the flags.
    Sparse gradients (`tf.IndexedSlices`) take Adam's update without ratio or
    weight decay, and are never densified.

    Speed and memory: without XLA and outside `tf.distribute` (Keras's
    `model.fit` on a CPU), Adam's moments and the direction come from one
    pass of TensorFlow's fused `ResourceApplyAdam` kernel into a scratch
    buffer: one per distinct variable shape, made when the first dense
    gradient of that shape arrives, never saved (how much memory that takes
    for ResNet-50 is in docs/guides/benchmarks.md). Under XLA
    (TensorFlow's `jit_compile`, and JAX's `jit`, as in the JAX trainer)
    the same rule runs as plain ops, and the
    trust ratio's norm computes the direction again from `m`, `v` and `w`
    rather than storing it (`lamb_direction`).

    Args:
        learning_rate: float, a `keras.optimizers.schedules.LearningRateSchedule`
            or a callable with no arguments. Defaults to `0.001`.
        beta_1: float in [0, 1). Decay of the first moment. Defaults to `0.9`.
        beta_2: float in [0, 1). Decay of the second moment. Defaults to
            `0.999`.
        epsilon: float >= 0. Adam's epsilon, added to `sqrt(v_hat)`.
            Defaults to `1e-6` (optax, timm, tensorflow-addons).
        weight_decay: float >= 0. LAMB's decay `wd`, inside the ratio (never
            Keras's decoupled one). Defaults to `0.0`.
        exclude_from_weight_decay: list of str, callable or None. Regular
            expressions searched in each `variable.path`; `"<1d>"` names
            every variable of rank <= 1; a callable takes the Keras variable
            and returns True to exclude it. Defaults to `None`.
        exclude_from_layer_adaptation: list of str, callable or None. Same
            form; matching variables use `T = 1`. Defaults to `None`: the
            weight-decay list, as Model Garden and tensorflow-addons do
            (optax's `lamb` adapts every variable: pass `[]`; see
            docs/algorithms.md, "Exclusion lists and masks").
        trust_coefficient: float > 0. Defaults to `1.0`.
        trust_clip: bool. `T = min(T, 1)` (timm). Defaults to `False`.
        eps_root: float >= 0. Added to `v_hat` inside the square root:
            `m_hat / (sqrt(v_hat + eps_root) + epsilon)` (optax's
            `eps_root`). Defaults to `0.0`.
        clipnorm, clipvalue, global_clipnorm, use_ema, ema_momentum,
        ema_overwrite_frequency, loss_scale_factor,
        gradient_accumulation_steps: the `keras.optimizers.Optimizer` base
            arguments. Default to Keras's defaults.
        name: str or None. Defaults to `None` (numbered `lamb`, `lamb_1`, ...).

    References:
        - [You et al. 2019: Large Batch Optimization for Deep Learning:
          Training BERT in 76 minutes](https://arxiv.org/abs/1904.00962)

    Example:

    >>> import keras, tf_lars
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> optimizer = tf_lars.LAMB(
    ...     learning_rate=1e-3, weight_decay=0.01,
    ...     exclude_from_weight_decay=[tf_lars.lars.ALL_1D])
    >>> model.compile(optimizer=optimizer, loss="mse")
    >>> isinstance(optimizer.inner_optimizer, keras.optimizers.Adam)
    True
    """

    def __init__(
        self,
        learning_rate=0.001,
        beta_1=0.9,
        beta_2=0.999,
        epsilon=1e-6,
        weight_decay=0.0,
        exclude_from_weight_decay=None,
        exclude_from_layer_adaptation=None,
        trust_coefficient=1.0,
        trust_clip=False,
        eps_root=0.0,
        clipnorm=None,
        clipvalue=None,
        global_clipnorm=None,
        use_ema=False,
        ema_momentum=0.99,
        ema_overwrite_frequency=None,
        loss_scale_factor=None,
        gradient_accumulation_steps=None,
        name=None,
        **kwargs,
    ):
        learning_rate = _check_learning_rate(learning_rate)
        adam = LambAdam(
            learning_rate=learning_rate,
            beta_1=check_number("beta_1", beta_1, low=0.0, high=1.0),
            beta_2=check_number("beta_2", beta_2, low=0.0, high=1.0),
            epsilon=check_number("epsilon", epsilon, low=0.0),
            eps_root=check_number("eps_root", eps_root, low=0.0),
        )
        super().__init__(
            adam,
            weight_decay=weight_decay,
            trust_coefficient=trust_coefficient,
            epsilon=0.0,  # LAMB's ratio has none; `epsilon` is Adam's
            trust_clip=trust_clip,
            exclude_from_weight_decay=exclude_from_weight_decay,
            exclude_from_layer_adaptation=exclude_from_layer_adaptation,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            use_ema=use_ema,
            ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
            loss_scale_factor=loss_scale_factor,
            gradient_accumulation_steps=gradient_accumulation_steps,
            name=name,
            **kwargs,
        )
        # LAMB's fused-kernel scratch space (TensorFlow only; never saved).
        self._direction_buffers = _kernels.direction_buffers()

    def update_step(self, gradient, variable, learning_rate):
        """LAMB's step for one variable (docs/algorithms.md).

        `lr * T * u` is taken as `T * scale * direction`: Adam's two bias
        corrections and the rate are the scalar `scale`, so the variable
        and the moments are each read once.
        """
        if _kernels.is_sparse(gradient):
            # Step 6 (sparse gradients): Adam's own update, no ratio, no decay.
            self._inner_update_step(gradient, variable, learning_rate)
            return
        index = _internals.variable_index(self, variable)
        decay = self._variable_weight_decay[index]
        # Steps 1 and 2 (inner step, decay): m, v and
        # lr * (m_hat / (sqrt(v_hat) + eps) + wd w).
        if (
            self._direction_buffers is not None
            and self.inner_optimizer.fusable
            and _kernels.lamb_fusable(variable)
        ):
            direction_of = _kernels.lamb_direction
        else:
            direction_of = lamb_direction
        scale, direction, for_norm = direction_of(
            self, gradient, variable, learning_rate, decay
        )
        # Steps 3 to 5 (trust ratio, clip, update): T from |w| and |u|;
        # w <- w - T * scale * direction.
        self._take_step(index, variable, scale, direction, learning_rate, for_norm)

    @property
    def beta_1(self):
        return self.inner_optimizer.beta_1

    @property
    def beta_2(self):
        return self.inner_optimizer.beta_2

    @property
    def epsilon(self):
        """Adam's `epsilon` (LAMB's ratio has none)."""
        return self.inner_optimizer.epsilon

    @property
    def eps_root(self):
        """Added to `v_hat` inside the square root (optax's `eps_root`)."""
        return self.inner_optimizer.eps_root

    def get_config(self):
        config = self._trust_ratio_config()
        del config["epsilon"]
        return {
            "learning_rate": self.inner_optimizer.get_config()["learning_rate"],
            "beta_1": self.beta_1,
            "beta_2": self.beta_2,
            "epsilon": self.epsilon,
            "eps_root": self.eps_root,
            **config,
            "name": self.name,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Creates a `LAMB` from `get_config()` output; unknown keys raise."""
        check_config_keys(cls, config)
        config = dict(config)
        if isinstance(config.get("learning_rate"), dict):
            config["learning_rate"] = keras.saving.deserialize_keras_object(
                config["learning_rate"], custom_objects=custom_objects
            )
        return cls(**config)
