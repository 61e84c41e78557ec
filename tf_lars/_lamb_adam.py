"""The Adam inside `tf_lars.LAMB` (docs/algorithms.md, "TrustRatio and LAMB").

`keras.optimizers.Adam` adds its `epsilon` to `sqrt(v)` before the bias
correction of `v`; LAMB (the paper, optax, Keras's own `Lamb`, timm,
tensorflow-addons) adds it to `sqrt(v_hat)`, after. `LambAdam` is a
`keras.optimizers.Adam` whose step uses LAMB's placement; its slots, their
update and its bias correction are Adam's:

```
m <- b1 m + (1 - b1) g          v <- b2 v + (1 - b2) g**2
w <- w - lr * (m / (1 - b1**t)) / (sqrt(v / (1 - b2**t)) + epsilon)
```

Sparse gradients (`tf.IndexedSlices`) update the slots with scatters, so the
gradient is never densified; repeated indices are summed before they are
squared, so the result equals Adam on the summed dense gradient (every row
of `m` and `v` decays and the whole variable moves, as in Adam).
"""

import keras
import tensorflow as tf

from tf_lars import _internals


def _scalar_dtype(dtype):
    """Bias corrections are computed in float32 (float64 for float64)."""
    return tf.float64 if dtype == tf.float64 else tf.float32


class LambAdam(keras.optimizers.Adam):
    """`keras.optimizers.Adam` with epsilon added after the bias correction."""

    def __init__(self, *args, name=None, **kwargs):
        # Keras 3.5 to 3.11's Adam defaults to name="adam", so two LAMBs' slot
        # paths collide; None auto-names ("lamb_adam", "lamb_adam_1"), as
        # Keras 3.15 does.
        super().__init__(*args, name=name, **kwargs)

    def update_step(self, gradient, variable, learning_rate):
        scale, direction = self.direction(gradient, variable, learning_rate)
        self.assign_sub(variable, scale * direction)

    def direction(self, gradient, variable, learning_rate):
        """Updates `m` and `v`; returns `(scale, direction)` of the step.

        The step `lr * m_hat / (sqrt(v_hat) + eps)` is `scale * direction`
        with `direction = m / (sqrt(v) + eps * sqrt(1 - b2**t))` and the
        scalar `scale = lr * sqrt(1 - b2**t) / (1 - b1**t)`: the two bias
        corrections are folded into scalars, one pass over `m` and `v`.
        """
        dtype = variable.dtype
        index = _internals.variable_index(self, variable)
        m, v = _internals.adam_slots(self, index)
        # `1 - beta` is rounded once from the Python float: bfloat16 holds
        # 0.999 as 1.0, so `1 - beta_2` in bfloat16 would be 0 (v frozen).
        one_minus_1 = tf.constant(1 - self.beta_1, dtype)
        one_minus_2 = tf.constant(1 - self.beta_2, dtype)
        if isinstance(gradient, tf.IndexedSlices):
            self._sparse_moments(gradient, m, v, one_minus_1, one_minus_2)
        else:
            gradient = tf.cast(gradient, dtype)
            self.assign_add(m, (gradient - m) * one_minus_1)
            self.assign_add(v, (tf.square(gradient) - v) * one_minus_2)
        epsilon = tf.cast(
            tf.constant(self.epsilon, _scalar_dtype(dtype)) * self._root_2(dtype), dtype
        )
        return self.direction_scale(dtype, learning_rate), m / (tf.sqrt(v) + epsilon)

    def _root_2(self, dtype):
        """`sqrt(1 - b2**t)` in float32 (float64 for float64 variables)."""
        dtype = _scalar_dtype(dtype)
        step = tf.cast(self.iterations + 1, dtype)
        return tf.sqrt(1 - tf.pow(tf.constant(self.beta_2, dtype), step))

    def direction_scale(self, dtype, learning_rate):
        """`lr * sqrt(1 - b2**t) / (1 - b1**t)`: the step is this times `direction`.

        Computed in float32 and cast to `dtype`: in bfloat16 `b2**t` rounds
        to 1 and the scale to 0 (with a zero epsilon term: 0 * inf = NaN).
        """
        scalar = _scalar_dtype(dtype)
        step = tf.cast(self.iterations + 1, scalar)
        correction_1 = 1 - tf.pow(tf.constant(self.beta_1, scalar), step)
        scale = tf.cast(learning_rate, scalar) / correction_1 * self._root_2(dtype)
        return tf.cast(scale, dtype)

    def fused_direction(self, gradient, variable, buffer, start):
        """`direction` in one kernel pass, added to `start` in `buffer`.

        `buffer` (a `tf.Variable` of the variable's shape) is set to `start`;
        TensorFlow's `ResourceApplyAdam` kernel then updates `m` and `v`
        exactly as `direction` does and adds
        `m / (sqrt(v) + eps * sqrt(1 - b2**t))` to `buffer`, in one pass over
        the gradient, `m`, `v` and `buffer` (its own bias correction is
        switched off: `lr = -1`, both beta powers 0, so it adds the
        direction). The step is `direction_scale(...)` times the buffer.
        """
        dtype = variable.dtype
        index = _internals.variable_index(self, variable)
        m, v = _internals.adam_slots(self, index)
        buffer.assign(start)
        zero = tf.zeros([], dtype)
        tf.raw_ops.ResourceApplyAdam(
            var=buffer.handle,
            m=m.value.handle,
            v=v.value.handle,
            beta1_power=zero,
            beta2_power=zero,
            lr=-tf.ones([], dtype),
            beta1=tf.constant(self.beta_1, dtype),
            beta2=tf.constant(self.beta_2, dtype),
            epsilon=tf.constant(self.epsilon, dtype) * self._root_2(dtype),
            grad=tf.cast(gradient, dtype),
            use_locking=False,
            use_nesterov=False,
        )

    def _sparse_moments(self, gradient, m, v, one_minus_1, one_minus_2):
        dtype = m.dtype
        values = tf.cast(gradient.values, dtype)
        rows, position = tf.unique(tf.cast(gradient.indices, tf.int64))
        summed = tf.math.unsorted_segment_sum(values, position, tf.size(rows))
        self.assign(m, m * tf.constant(self.beta_1, dtype))
        self.assign_add(m, tf.IndexedSlices(summed * one_minus_1, rows))
        self.assign(v, v * tf.constant(self.beta_2, dtype))
        self.assign_add(v, tf.IndexedSlices(tf.square(summed) * one_minus_2, rows))


class DirectionBuffers:
    """One scratch `tf.Variable` per variable shape and dtype, for `LAMB`.

    `LambAdam.fused_direction` writes the direction into a buffer; variables
    of one shape share it (their updates run one after another on it). A
    buffer is made the first time a dense gradient of its shape arrives,
    so sparse-only variables (embedding tables) never get one. A plain
    object, not a list or dict: neither Keras nor `tf.train.Checkpoint`
    tracks it, so buffers are never saved and checkpoints are unchanged.
    """

    def __init__(self):
        self._buffers = {}

    def get(self, variable):
        key = (tuple(variable.shape), variable.dtype)
        buffer = self._buffers.get(key)
        if buffer is None:
            with tf.init_scope():
                buffer = tf.Variable(
                    tf.zeros(variable.shape, variable.dtype),
                    trainable=False,
                    name="lamb_direction",
                )
            self._buffers[key] = buffer
        return buffer

    def __len__(self):
        return len(self._buffers)
