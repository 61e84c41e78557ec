"""Learning-rate schedules for large-batch training.

`WarmupPolynomialDecay` is the schedule of the MLPerf ResNet-50 LARS reference
(linear warm-up from 0 to a peak, then polynomial decay), and
`linear_scaled_learning_rate` is the linear-scaling rule that picks the peak
for a batch size (Goyal et al. 2017, arXiv 1706.02677).
"""

import math

import keras
from keras import ops

from tf_lars._validation import check_int, check_positive, is_real

__all__ = ["WarmupPolynomialDecay", "linear_scaled_learning_rate"]

#: The largest step count a schedule can reach: `optimizer.iterations` is an
#: int64 variable, and a step count that does not fit in it fails at the
#: first step instead of at construction.
MAX_STEPS = 2**63 - 1


def check_step_count(name, value):
    """Refuses a step count (already an int) that int64 does not hold."""
    if value > MAX_STEPS:
        raise ValueError(
            f"`{name}` must be at most {MAX_STEPS} (2**63 - 1, the largest "
            f"value of the int64 step counter). Received: {name}={value!r}"
        )
    return value


def linear_scaled_learning_rate(base_learning_rate, batch_size, base_batch_size=256):
    """Scales a learning rate linearly with the batch size.

    ```
    peak = base_learning_rate * batch_size / base_batch_size
    ```

    The rule of Goyal et al. (2017): a recipe tuned at `base_batch_size` keeps
    the same per-example step when the batch grows, if the learning rate grows
    by the same factor. It breaks down for plain SGD at large batches (the
    reason LARS exists), so use it with warm-up, and with LARS beyond a few
    thousand examples per batch.

    Args:
        base_learning_rate: float. The learning rate tuned at `base_batch_size`;
            finite and > 0.
        batch_size: int. The batch size to scale to; >= 1.
        base_batch_size: int. The batch size `base_learning_rate` was tuned
            for; >= 1. Defaults to `256`.

    Returns:
        The scaled learning rate, a Python float.

    References:
        - [Goyal et al., 2017](https://arxiv.org/abs/1706.02677)

    Examples:
        >>> tf_lars.schedules.linear_scaled_learning_rate(0.1, 1024)
        0.4
    """
    base_learning_rate = check_positive("base_learning_rate", base_learning_rate)
    batch_size = check_int("batch_size", batch_size, 1)
    base_batch_size = check_int("base_batch_size", base_batch_size, 1)
    return base_learning_rate * batch_size / base_batch_size


@keras.saving.register_keras_serializable(package="tf_lars")
class WarmupPolynomialDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up from 0, then polynomial decay (MLPerf ResNet-50 LARS).

    With `W = warmup_steps`, `D = decay_steps`, `p = power`, peak `α`, end `e`:

    ```
    step <= W:  lr = α * step / W
    step >  W:  t  = min(step - W, D)
                lr = (α - e) * (1 - t / D) ** p + e
    ```

    `decay_steps` counts from the end of warm-up, as in the MLPerf reference
    (`lars_util.PolynomialDecayWithWarmup`), so a run of `W + D` optimizer
    steps ends exactly at `end_learning_rate`, and the learning rate stays there
    afterwards. With `warmup_steps=0` the schedule starts at the peak.

    Keras optimizers call the schedule with `optimizer.iterations` *before*
    incrementing it, so with warm-up the very first update uses `lr = 0` (as in
    MLPerf); the peak is used by update number `W + 1`.

    The computation is a handful of element-wise ops in float32 with no Python
    branch on the step, so it runs inside `tf.function(jit_compile=True)` and
    `model.fit`'s XLA train step; step counts above `2**24` are rounded to
    float32's 24 significant bits before the formula is applied.
    `warmup_steps + decay_steps` may not exceed `2**63 - 1`, the largest value
    of the int64 step counter.

    Args:
        peak_learning_rate: float. The learning rate at the end of warm-up;
            finite and > 0.
        warmup_steps: int. Number of optimizer steps of linear warm-up; >= 0;
            `warmup_steps + decay_steps` <= `2**63 - 1`.
        decay_steps: int. Number of optimizer steps of polynomial decay after
            warm-up; >= 1.
        end_learning_rate: float. Learning rate after `warmup_steps +
            decay_steps` steps; in `[0, peak_learning_rate]`. Defaults to `0.0`.
        power: float. Exponent of the polynomial; finite and > 0. Defaults to
            `2.0` (the MLPerf LARS recipe).
        name: str. Name scope of the ops. Defaults to
            `"WarmupPolynomialDecay"`.

    References:
        - [You et al., 2017](https://arxiv.org/abs/1708.03888) (LARS)
        - [MLPerf Training ResNet-50 reference, `lars_util.py`](
          https://github.com/mlcommons/training/blob/master/image_classification/tensorflow2/lars_util.py)

    Examples:
        >>> steps_per_epoch = 1347 // 256
        >>> schedule = tf_lars.schedules.WarmupPolynomialDecay(
        ...     peak_learning_rate=tf_lars.schedules.linear_scaled_learning_rate(
        ...         0.1, 256, base_batch_size=32),
        ...     warmup_steps=5 * steps_per_epoch,
        ...     decay_steps=95 * steps_per_epoch,
        ... )
        >>> optimizer = tf_lars.LARS(learning_rate=schedule, trust_coefficient=0.02)
        >>> [round(float(schedule(step)), 4) for step in (0, 5, 25, 260, 500)]
        [0.0, 0.16, 0.8, 0.2042, 0.0]
    """

    def __init__(
        self,
        peak_learning_rate,
        warmup_steps,
        decay_steps,
        end_learning_rate=0.0,
        power=2.0,
        name="WarmupPolynomialDecay",
    ):
        super().__init__()
        check_positive("peak_learning_rate", peak_learning_rate)
        check_step_count("warmup_steps", check_int("warmup_steps", warmup_steps, 0))
        check_step_count("decay_steps", check_int("decay_steps", decay_steps, 1))
        if int(warmup_steps) + int(decay_steps) > MAX_STEPS:
            # The last step of the decay, W + D, must be a reachable count.
            raise ValueError(
                f"`warmup_steps + decay_steps` must be at most {MAX_STEPS} "
                "(2**63 - 1, the largest value of the int64 step counter). "
                f"Received: warmup_steps={warmup_steps!r}, "
                f"decay_steps={decay_steps!r}"
            )
        if not is_real(end_learning_rate) or not (
            math.isfinite(end_learning_rate)
            and 0 <= end_learning_rate <= peak_learning_rate
        ):
            raise ValueError(
                "`end_learning_rate` must be a finite number in "
                f"[0, peak_learning_rate={peak_learning_rate!r}]. "
                f"Received: end_learning_rate={end_learning_rate!r}"
            )
        check_positive("power", power)
        if not isinstance(name, str):
            raise ValueError(f"`name` must be a str. Received: name={name!r}")
        self.peak_learning_rate = float(peak_learning_rate)
        self.warmup_steps = int(warmup_steps)
        self.decay_steps = int(decay_steps)
        self.end_learning_rate = float(end_learning_rate)
        self.power = float(power)
        self.name = name

    def __call__(self, step):
        with keras.name_scope(self.name):
            step = ops.maximum(ops.cast(step, "float32"), 0.0)
            constants = (self.peak_learning_rate, self.end_learning_rate)
            constants += (self.warmup_steps, self.decay_steps, self.power)
            peak, end, warmup, decay, power = (
                ops.cast(c, "float32") for c in constants
            )
            # ops.where evaluates both branches: max(warmup, 1) keeps the unused
            # one finite when warmup_steps=0. At step == warmup both equal peak.
            warmup_lr = peak * step / ops.maximum(warmup, 1.0)
            decay_fraction = 1.0 - ops.clip(step - warmup, 0.0, decay) / decay
            decay_lr = (peak - end) * ops.power(decay_fraction, power) + end
            return ops.where(step < warmup, warmup_lr, decay_lr)

    def get_config(self):
        keys = ("peak_learning_rate", "warmup_steps", "decay_steps")
        keys += ("end_learning_rate", "power", "name")
        return {key: getattr(self, key) for key in keys}
