"""LAMB: Adam with a layer-wise trust ratio; `LAMB.update_step` is the rule.

The rule is docs/algorithms.md, section "TrustRatio and LAMB"; the table
there maps the published LAMB variants onto this class's flags.
`LAMB.update_step` reads top to bottom (Adam's moments and bias
corrections, the direction, the decay, the trust ratio and the write);
`tf_lars.TrustRatio`, its base, takes the trust ratio of every variable a
step updates together where a compiler sees the step.
"""

import keras
from keras import ops

from tf_lars import _internals, _trust
from tf_lars._validation import check_config_keys, check_learning_rate, check_number
from tf_lars.trust_ratio import TrustRatio

__all__ = ["LAMB"]


class LambAdam(keras.optimizers.Adam):
    """LAMB's inner optimizer: Adam's slots and settings, plus `eps_root`.

    `LAMB.update_step` takes the step, with `epsilon` added to
    `sqrt(v_hat)`, after the bias correction, as the paper, optax, Keras's
    `Lamb`, timm and tensorflow-addons do (`keras.optimizers.Adam` adds it
    before).
    """

    def __init__(self, *args, eps_root=0.0, name=None, **kwargs):
        # Keras 3.8 to 3.11's Adam defaults to name="adam", so two LAMBs' slot
        # paths collide; None auto-names ("lamb_adam", "lamb_adam_1"), as
        # Keras 3.15 does.
        super().__init__(*args, name=name, **kwargs)
        self.eps_root = eps_root


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

    On the TensorFlow backend without XLA and `tf.distribute` (Keras's
    `model.fit` on a CPU), Adam's moments and the direction come from one
    pass of TensorFlow's fused Adam kernel into a scratch buffer per
    variable shape, never saved (docs/guides/benchmarks.md has what that
    costs and saves).

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
        clipnorm: float or None. Clips each variable's gradient to this norm
            before the step (Keras's base argument). Defaults to `None`.
        clipvalue: float or None. Clips each gradient entry to
            `[-clipvalue, clipvalue]`. Defaults to `None`.
        global_clipnorm: float or None. Clips all gradients together to this
            global norm. Defaults to `None`.
        use_ema: bool. Keeps an exponential moving average of the weights
            (Keras's base argument). Defaults to `False`.
        ema_momentum: float. The moving average's momentum, with
            `use_ema=True`. Defaults to `0.99`.
        ema_overwrite_frequency: int or None. With `use_ema=True`, every this
            many steps the weights are replaced by their average; `None`
            leaves that to `optimizer.finalize_variable_values()`. Defaults
            to `None`.
        loss_scale_factor: float or None. Multiplies the loss and divides the
            gradients by this fixed factor (for mixed precision, prefer
            `tf_lars.LossScaleOptimizer`). Defaults to `None`.
        gradient_accumulation_steps: int or None. Applies one update every
            this many batches, with the mean of their gradients; a schedule
            then counts updates, not batches (docs/algorithms.md, "Gradient
            accumulation"). Defaults to `None`.
        name: str or None. Defaults to `None` (numbered `lamb`, `lamb_1`, ...).

    References:
        - [You et al. 2019: Large Batch Optimization for Deep Learning:
          Training BERT in 76 minutes](https://arxiv.org/abs/1904.00962)

    Examples:
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
        if "inner_optimizer" in kwargs:
            raise ValueError(
                "`inner_optimizer` is not an argument of LAMB, which builds its own "
                "Adam; tf_lars.TrustRatio takes the trust ratio around another "
                f"optimizer. Received: inner_optimizer={kwargs['inner_optimizer']!r}"
            )
        learning_rate = check_learning_rate(learning_rate)
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

    def update_step(self, gradient, variable, learning_rate):
        """Steps 1 to 5 (inner step, decay, trust ratio, clip, update) of
        docs/algorithms.md, "TrustRatio and LAMB", for one variable (the
        TensorFlow subclass takes step 6 (sparse gradients))."""
        index = _internals.variable_index(self, variable)
        m, v = _internals.adam_slots(self.inner_optimizer, index)
        decay = self._variable_weight_decay[index]
        dtype = variable.dtype
        gradient = ops.cast(gradient, dtype)
        lr, correction_1, correction_2 = self._bias_corrections(dtype, learning_rate)

        # Step 1 (inner step): Adam's moments, their bias corrections at step
        # t and Adam's direction d. `1 - beta` is rounded once from the
        # Python float: bfloat16 holds 0.999 as 1.0, so `1 - beta_2` computed
        # in bfloat16 would be 0 (v frozen).
        one_minus_1 = ops.convert_to_tensor(1 - self.beta_1, dtype)
        one_minus_2 = ops.convert_to_tensor(1 - self.beta_2, dtype)
        # m <- m + (1 - b1) (g - m);  v <- v + (1 - b2) (g**2 - v)
        self.assign_add(m, (gradient - m) * one_minus_1)
        self.assign_add(v, (ops.square(gradient) - v) * one_minus_2)
        # d = m_hat / (sqrt(v_hat + eps_root) + epsilon)
        update = self._direction(
            m, v, correction_1, correction_2, self.epsilon, self.eps_root
        )

        # Step 2 (decay): u = d + wd w.
        if decay != 0.0:
            update = update + decay * ops.convert_to_tensor(variable)

        # Steps 3 to 5 (trust ratio, clip, update): T from |w| and |u|;
        # w <- w - lr * T * u.
        for_norm = self._for_norm(
            update, m, v, variable, correction_1, correction_2, decay
        )
        self._take_step(index, variable, lr, update, learning_rate, for_norm)

    def _for_norm(self, update, m, v, variable, correction_1, correction_2, decay):
        """What the norm of step 3 (trust ratio) reads: `u` as computed (the
        compiled backends' subclasses may compute it again, same values)."""
        return update

    def _direction(self, m, v, correction_1, correction_2, epsilon, eps_root):
        """Adam's direction `d = m_hat / (sqrt(v_hat + eps_root) + epsilon)`
        from the moments and their bias corrections (`eps_root` added where
        the setting is not 0). Where `epsilon` and `eps_root` are both 0, 1
        in place of a 0 denominator: there `m = v = 0` (every gradient so
        far 0), and the direction is 0, not NaN."""
        m_hat = m / correction_1  # m / (1 - b1**t)
        v_hat = v / correction_2  # v / (1 - b2**t)
        if self.eps_root != 0.0:
            v_hat = v_hat + eps_root
        denominator = ops.sqrt(v_hat) + epsilon
        if self.epsilon == 0.0 and self.eps_root == 0.0:
            denominator = ops.where(
                denominator > 0, denominator, ops.ones_like(denominator)
            )
        return m_hat / denominator

    def _bias_corrections(self, dtype, learning_rate):
        """`(lr, 1 - b1**t, 1 - b2**t)` in `dtype` at Adam's step `t`
        (1-based), once per step. The bias corrections are computed in
        float32 (float64 for float64 variables): in bfloat16 `b2**t` rounds
        to 1."""
        adam = self.inner_optimizer
        scalar = _trust.compute_dtype(dtype)

        def compute():
            step = ops.cast(adam.iterations + 1, scalar)
            corrections = [
                1 - ops.power(ops.convert_to_tensor(beta, scalar), step)
                for beta in (adam.beta_1, adam.beta_2)
            ]
            lr = ops.cast(learning_rate, dtype)
            return (lr, *(ops.cast(c, dtype) for c in corrections))

        key = ("adam", keras.backend.standardize_dtype(dtype), id(learning_rate))
        return self._once_per_step(key, compute)

    def _step_each_variable(self, grads, variables, learning_rate):
        # LAMB's own `update_step` for each variable, through Keras's loop
        # (on TensorFlow: the cross-replica sum and each variable's update
        # context under tf.distribute).
        _internals.keras_update_step(self)(grads, variables, learning_rate)

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
