"""LAMB: `tf_lars.TrustRatio` around Adam.

The rule is docs/algorithms.md, section "TrustRatio and LAMB"; the table
there maps the published LAMB variants onto this class's flags.
"""

import keras
import tensorflow as tf

from tf_lars import _internals
from tf_lars._lamb_adam import DirectionBuffers, LambAdam
from tf_lars._validation import check_config_keys, check_number, is_real
from tf_lars.trust_ratio import TrustRatio

__all__ = ["LAMB"]


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
    gradient of that shape arrives, never saved (for ResNet-50: 28 buffers,
    45% of the parameters). Under XLA the same rule runs as plain ops.

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
        exclude_from_weight_decay: list of str or None. Regular expressions
            searched in each `variable.path`; `"<1d>"` names every variable
            of rank <= 1. Defaults to `None`.
        exclude_from_layer_adaptation: list of str or None. Same form;
            matching variables use `T = 1`. Defaults to `None`: the
            weight-decay list (pass `[]` to adapt every variable).
        trust_coefficient: float > 0. Defaults to `1.0`.
        trust_clip: bool. `T = min(T, 1)` (timm). Defaults to `False`.
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
        self._direction_buffers = DirectionBuffers()

    def _inner_step(self, gradient, variable, learning_rate, decay):
        # Adam's direction and its scalar, never their product (one pass
        # fewer); without XLA and outside tf.distribute, one fused kernel.
        adam = self.inner_optimizer
        if self._fusable(variable):
            buffer = self._direction_buffers.get(variable)
            # The scale depends on the step count and the rate only, so it
            # is known before the kernel runs (the decay term needs it).
            scale = adam.direction_scale(variable.dtype, learning_rate)
            if decay == 0.0:
                start = tf.zeros_like(variable)
            else:
                start = self._decay_factor(scale, learning_rate, decay) * variable
            adam.fused_direction(gradient, variable, buffer, start)
            return scale, tf.convert_to_tensor(buffer)
        scale, direction = adam.direction(gradient, variable, learning_rate)
        return scale, self._with_decay(direction, scale, variable, learning_rate, decay)

    def _fusable(self, variable):
        return (
            variable.dtype in (tf.float32, tf.float64)
            and not tf.distribute.has_strategy()
            and not _internals.in_xla_context()
        )

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

    def get_config(self):
        config = self._trust_ratio_config()
        del config["epsilon"]
        return {
            "learning_rate": self.inner_optimizer.get_config()["learning_rate"],
            "beta_1": self.beta_1,
            "beta_2": self.beta_2,
            "epsilon": self.epsilon,
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
