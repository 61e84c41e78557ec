"""Argument checks shared by tf_lars's constructors.

Every check raises `ValueError` naming the argument, the rule and the
received value: "`momentum` must be >= 0.0 and < 1.0. Received: momentum=1.5".
"""

import inspect
import math
import numbers

import numpy as np

#: The largest finite float32. Learning rates, decays and coefficients live
#: in float32 variables or are cast to float32 in the step; a Python float
#: beyond this is finite in Python but `inf` there, so it is refused as
#: non-finite.
FLOAT32_MAX = 3.4028234663852886e38


def is_real(value):
    """A real number (Python or NumPy), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_int(value):
    """An integer (Python or NumPy), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_float32_range(name, value):
    """Refuses a finite real that float32 holds as `inf` (|value| > FLOAT32_MAX)."""
    if abs(value) > FLOAT32_MAX:
        raise ValueError(
            f"`{name}` must be at most {FLOAT32_MAX:.8g} in magnitude, the "
            f"largest float32 (larger is inf there). Received: {name}={value!r}"
        )


def check_number(name, value, *, low=None, low_inclusive=True, high=None):
    """A real finite in float32 and in the given range, returned as a float."""
    rule = []
    if low is not None:
        rule.append(f"{'>=' if low_inclusive else '>'} {low}")
    if high is not None:
        rule.append(f"< {high}")
    rule_text = " and ".join(rule) if rule else "finite"
    if not is_real(value) or not math.isfinite(value):
        raise ValueError(
            f"`{name}` must be a finite number {rule_text}. Received: {name}={value!r}"
        )
    check_float32_range(name, value)
    too_low = low is not None and (value < low if low_inclusive else value <= low)
    too_high = high is not None and value >= high
    if too_low or too_high:
        raise ValueError(f"`{name}` must be {rule_text}. Received: {name}={value!r}")
    return float(value)


def check_learning_rate(learning_rate):
    """A non-negative float (returned as a float), a schedule or a callable."""
    if is_real(learning_rate):
        return check_number("learning_rate", learning_rate, low=0.0)
    if not callable(learning_rate):  # schedules are callable too
        raise ValueError(
            "`learning_rate` must be a non-negative finite float, a "
            "`keras.optimizers.schedules.LearningRateSchedule` or a "
            f"callable. Received: learning_rate={learning_rate!r}"
        )
    return learning_rate


def check_positive(name, value):
    """A real > 0 and finite in float32, returned as a float."""
    if not is_real(value) or not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"`{name}` must be a finite number > 0. Received: {name}={value!r}"
        )
    check_float32_range(name, value)
    return float(value)


def check_inner_built_on(inner_optimizer, variables):
    """Refuses, at the wrapper's build, an inner optimizer built before on
    other variables (its slots are theirs; the first step failed in Keras's
    words). Built on the same ones, it steps on."""
    from tf_lars import _internals

    if not inner_optimizer.built:
        return
    for variable in variables:
        try:
            _internals.variable_index(inner_optimizer, variable)
        except KeyError:
            raise ValueError(
                "`inner_optimizer` was built on other variables than the ones "
                "it is asked to step: give the wrapper a new one. Received: "
                f"variable {getattr(variable, 'path', variable.name)!r}, unknown "
                f"to {type(inner_optimizer).__name__}"
            ) from None


def check_inner_learning_rate(inner_optimizer, negative=True):
    """Refuses a wrapped Keras optimizer whose learning rate is not finite
    (or, with `negative=False`, below 0: TrustRatio's ratio is 1 at a rate
    of 0 and not defined below it).

    Keras stores a float rate in a float32 variable without checking it, so
    `Adam(learning_rate=1e300)` holds `inf`; wrapped, every step would be
    NaN. Schedules and callables are left to their own checks.
    """
    rate = getattr(inner_optimizer, "_learning_rate", None)
    if rate is None or callable(rate) or not hasattr(rate, "numpy"):
        return
    value = float(rate.numpy())
    if not math.isfinite(value):
        raise ValueError(
            "`inner_optimizer.learning_rate` must be finite in float32 (at most "
            f"{FLOAT32_MAX:.8g}). Received: inner_optimizer="
            f"{type(inner_optimizer).__name__} with learning_rate={value!r}"
        )
    if value < 0 and not negative:
        raise ValueError(
            "`inner_optimizer.learning_rate` must be >= 0: the trust ratio is 1 at "
            "a rate of 0 and not defined below it. Received: inner_optimizer="
            f"{type(inner_optimizer).__name__} with learning_rate={value:.8g}"
        )


def check_optimizer(name, optimizer):
    """A `keras.optimizers.Optimizer` instance, returned unchanged."""
    import keras

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(
            f"`{name}` must be a `keras.optimizers.Optimizer` instance. "
            f"Received: {name}={optimizer!r}"
        )
    return optimizer


def check_outer_optimizer(outer_optimizer, inner_optimizer):
    """Refuses an outer optimizer (DiLoCo's, AGN's) that cannot take the
    outer step: not an optimizer, the inner optimizer itself (each keeps its
    own state), a loss-scale optimizer (the pseudo-gradient is never scaled),
    or a learning rate that is not a finite number > 0 in float32."""
    import keras
    from keras import ops

    check_optimizer("outer_optimizer", outer_optimizer)
    if outer_optimizer is inner_optimizer:
        raise ValueError(
            "`outer_optimizer` must be another optimizer than "
            "`inner_optimizer` (each keeps its own state). Received: "
            f"outer_optimizer={outer_optimizer!r}, the inner optimizer"
        )
    if isinstance(outer_optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "`outer_optimizer` must not be a loss-scale optimizer: the "
            "pseudo-gradient is a difference of weights, never scaled. "
            f"Received: outer_optimizer={outer_optimizer!r}"
        )
    # It takes one step a round (a commit), and the weights are reset to its
    # result: an accumulating step would leave them at the round's start, and
    # an average of its variables would never be used.
    for name, unset in (("gradient_accumulation_steps", None), ("use_ema", False)):
        value = getattr(outer_optimizer, name, unset)
        if value not in (unset, 0):
            raise ValueError(
                f"`outer_optimizer.{name}` must be unset: the outer optimizer "
                "takes one step a round, and the weights are reset to its result. "
                f"Received: outer_optimizer.{name}={value!r}"
            )
    # A float32 variable in Keras (a schedule: its rate at step 0).
    value = np.float32(ops.convert_to_numpy(outer_optimizer.learning_rate))
    if not (np.isfinite(value) and value > 0):
        raise ValueError(
            "`outer_optimizer.learning_rate` must be a finite number > 0. "
            f"Received: outer_optimizer={type(outer_optimizer).__name__} with "
            f"learning_rate={value!s}"
        )
    return outer_optimizer


def check_int(name, value, low):
    """An int (not a bool) >= `low`, returned as an int."""
    if not is_int(value) or value < low:
        raise ValueError(
            f"`{name}` must be an int >= {low}. Received: {name}={value!r}"
        )
    return int(value)


def check_base_arguments(**base):
    """Keras's base arguments of an optimizer, which Keras's base class takes
    unchecked (a negative `clipnorm` silently clips nothing; a float
    `gradient_accumulation_steps` fails at the first step): `base` as given,
    or a `ValueError` naming the argument."""
    for name in ("clipnorm", "clipvalue", "global_clipnorm", "loss_scale_factor"):
        if base[name] is not None:
            check_positive(name, base[name])
    check_bool("use_ema", base["use_ema"])
    momentum = base["ema_momentum"]
    if not (is_real(momentum) and 0.0 <= momentum <= 1.0):
        raise ValueError(
            f"`ema_momentum` must be a number in [0, 1]. Received: "
            f"ema_momentum={momentum!r}"
        )
    if base["ema_overwrite_frequency"] is not None:
        check_int("ema_overwrite_frequency", base["ema_overwrite_frequency"], 1)
    steps = base["gradient_accumulation_steps"]
    if steps is not None and not (is_int(steps) and steps == 0):  # 0: off
        check_int("gradient_accumulation_steps", steps, 2)
    return base


def check_bool(name, value):
    """A Python bool, returned unchanged."""
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be a bool. Received: {name}={value!r}")
    return value


def check_choice(name, value, choices):
    """One of `choices` (strings), returned unchanged."""
    if value not in choices:
        raise ValueError(
            f"`{name}` must be one of {list(choices)}. Received: {name}={value!r}"
        )
    return value


def check_config_keys(cls, config):
    """Raises `ValueError` if `config` has a key `cls.__init__` does not take.

    Used by `from_config`, so that a typo in a hand-written config fails
    loudly instead of disappearing into `**kwargs`.
    """
    known = set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}
    unknown = sorted(set(config) - known)
    if unknown:
        received = {key: config[key] for key in unknown}
        raise ValueError(
            f"Unknown key(s) in {cls.__name__} config: {unknown}. "
            f"Received: {received}. Valid keys: {sorted(known)}"
        )


def check_gradient_shapes(grads, variables):
    """Refuses a dense gradient whose shape is not its variable's.

    Without this check `g + wd * w` and the trust ratio's norms broadcast a
    (3,) gradient over a (3, 3) variable silently; Keras's own optimizers
    fail on the write. Unknown dimensions (a traced shape) are not compared.
    Sparse gradients (`tf.IndexedSlices`) are checked row-wise: their
    values' trailing shape must be the variable's.
    """
    from tf_lars._wrapper import is_indexed_slices  # imports Keras: not at load

    for gradient, variable in zip(grads, variables, strict=True):
        if gradient is None:
            continue
        expected = tuple(variable.shape)
        if is_indexed_slices(gradient):  # sparse rows
            received, expected = tuple(gradient.values.shape)[1:], expected[1:]
        else:  # a tensor, or a nested Python list
            shape = getattr(gradient, "shape", None)
            if shape is not None and getattr(shape, "rank", 0) is None:
                continue  # a traced tensor of unknown rank
            received = tuple(np.shape(gradient) if shape is None else shape)
        compatible = len(received) == len(expected) and all(
            a is None or b is None or int(a) == int(b)
            for a, b in zip(received, expected, strict=True)
        )
        if not compatible:
            path = getattr(variable, "path", None) or variable.name
            raise ValueError(
                "Each gradient must have its variable's shape. Received: a "
                f"gradient of shape {received} for the variable "
                f"{path!r} of shape {tuple(variable.shape)}"
            )


class ShapeCheckedApply:
    """Mixin: `apply` refuses gradients whose shapes are not their variables'.

    Checked before anything else runs (gradient accumulation would broadcast
    the wrong shape into its accumulator too). Put it before the Keras
    optimizer in the bases.
    """

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
            check_gradient_shapes(grads, trainable_variables)
        elif self.built:
            from tf_lars import _internals

            known = list(_internals.trainable_variables_of(self))
            if len(grads) == len(known):
                check_gradient_shapes(grads, known)
        return super().apply(grads, trainable_variables)


# Base-class arguments that belong to the wrapper: set on the inner optimizer
# they would act on the direction alone (or, for `weight_decay`, outside the
# ratio), so they are refused there.
_OUTER_ARGUMENTS = (
    "weight_decay",
    "clipnorm",
    "clipvalue",
    "global_clipnorm",
    "loss_scale_factor",
    "gradient_accumulation_steps",
)


def check_inner_optimizer(inner_optimizer):
    """Refuses what `tf_lars.TrustRatio` cannot wrap, in one `ValueError`."""
    # tf_lars's own refusals carry a marker (`takes_no_trust_ratio`: LARS,
    # AGN, TrustRatio, LAMB, the loss scale); Keras's loss scale wraps a whole
    # optimizer, and Keras's own `Lamb` already applies a trust ratio: a
    # second one on top of it is no published rule (`tf_lars.LAMB` is the
    # wrapped Adam).
    import keras

    refused = (keras.optimizers.LossScaleOptimizer,)
    refused += (keras.optimizers.Lamb,) if hasattr(keras.optimizers, "Lamb") else ()

    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        raise ValueError(
            "`inner_optimizer` must be a `keras.optimizers.Optimizer` instance. "
            f"Received: inner_optimizer={inner_optimizer!r}"
        )
    if isinstance(inner_optimizer, refused) or getattr(
        inner_optimizer, "takes_no_trust_ratio", False
    ):
        raise ValueError(
            "`inner_optimizer` must be a plain Keras optimizer (SGD, Adam, "
            "AdamW, Lion, ...), not a loss-scale, AGN, LARS, TrustRatio or "
            "Lamb optimizer (Keras's `Lamb` has its own trust ratio; use "
            "`tf_lars.LAMB`, or wrap the TrustRatio in the others). "
            f"Received: inner_optimizer={inner_optimizer!r}"
        )
    for argument in _OUTER_ARGUMENTS:
        value = getattr(inner_optimizer, argument, None)
        if value not in (None, 0, 0.0):
            why = (
                "its weight decay sits inside the ratio"
                if argument == "weight_decay"
                else "it applies it around the whole step, the ratio included"
            )
            raise ValueError(
                f"`inner_optimizer.{argument}` must be unset: set `{argument}` "
                f"on the TrustRatio ({why}). "
                f"Received: inner_optimizer.{argument}={value!r}"
            )
    base = keras.optimizers.Optimizer
    own_class = type(inner_optimizer)
    if own_class.update_step is base.update_step or own_class.apply is not base.apply:
        # The wrapper takes the step one variable at a time, through the
        # inner optimizer's `update_step`; one that steps only in its own
        # `apply` (MultiOptimizer hands variables to other optimizers) has
        # no step to rescale.
        raise ValueError(
            "`inner_optimizer` must take its step in its own `update_step`, "
            f"one variable at a time; {own_class.__name__} steps only in its "
            "own `apply` and cannot be wrapped. "
            f"Received: inner_optimizer={inner_optimizer!r}"
        )
    check_inner_learning_rate(inner_optimizer, negative=False)
    # Muon decays its Adam-stepped variables in `_apply_weight_decay`, which
    # the wrapper never runs (the decay sits inside the ratio instead).
    decay = getattr(inner_optimizer, "adam_weight_decay", None)
    if decay not in (None, 0, 0.0):
        raise ValueError(
            "`inner_optimizer.adam_weight_decay` must be 0: set `weight_decay` on "
            "the TrustRatio (its weight decay sits inside the ratio). "
            f"Received: inner_optimizer.adam_weight_decay={decay!r}"
        )
    if getattr(inner_optimizer, "use_ema", False):
        raise ValueError(
            "`inner_optimizer.use_ema` must be False: set `use_ema` on the "
            "TrustRatio. Received: inner_optimizer.use_ema=True"
        )
