"""A layer-wise trust ratio around any Keras optimizer.

The rule is docs/algorithms.md, section "TrustRatio and LAMB"; the steps of
`TrustRatio.update_step` carry its numbers. `tf_lars.LAMB` is this wrapper
around Adam.
"""

import contextlib

import keras
from keras import ops

from tf_lars import _internals, _kernels, _rules
from tf_lars._exclusions import LayerwiseExclusions
from tf_lars._validation import (
    ShapeCheckedApply,
    check_bool,
    check_config_keys,
    check_inner_learning_rate,
    check_number,
)
from tf_lars._wrapper import InnerOptimizerWrapper

__all__ = ["TrustRatio"]

_Apply = _kernels.Apply

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


def _check_inner_optimizer(inner_optimizer):
    # tf_lars's own refusals carry a marker (`takes_no_trust_ratio`: LARS,
    # AGN, TrustRatio, LAMB, the loss scale); Keras's loss scale wraps a whole
    # optimizer, and Keras's own `Lamb` already applies a trust ratio: a
    # second one on top of it is no published rule (`tf_lars.LAMB` is the
    # wrapped Adam).
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
            raise ValueError(
                f"`inner_optimizer.{argument}` must be unset: set `{argument}` "
                "on the TrustRatio (its weight decay sits inside the ratio). "
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
    check_inner_learning_rate(inner_optimizer)
    if getattr(inner_optimizer, "use_ema", False):
        raise ValueError(
            "`inner_optimizer.use_ema` must be False: set `use_ema` on the "
            "TrustRatio. Received: inner_optimizer.use_ema=True"
        )


def _same_variable(a, b):
    if a is b or keras.backend.backend() != "tensorflow":
        return a is b
    # TensorFlow hands `update_step` the backing `tf.Variable` of a Keras one.
    unwrap = lambda x: x.value if isinstance(x, keras.Variable) else x  # noqa: E731
    return unwrap(a) is unwrap(b)


def _cast(tensor, dtype):
    """`tensor` cast to `dtype`; a function returning it (see `_rules.norms`)
    stays a function, returning it cast."""
    if callable(tensor):
        return lambda: ops.cast(tensor(), dtype)
    return ops.cast(tensor, dtype)


@contextlib.contextmanager
def _captured_step(optimizer, variable):
    """Runs the inner optimizer's writes to `variable` into a list instead.

    Keras optimizers write every variable through `self.assign`,
    `self.assign_add` and `self.assign_sub` (the contract tf_lars's tests
    hold every optimizer to); for the duration of the block, those three
    methods of `optimizer` record the writes aimed at `variable` as
    `(kind, value)` and pass every other write (the slots) through. The
    overrides are instance attributes, removed on exit.
    """
    writes = []

    def redirect(kind):
        original = getattr(optimizer, kind)

        def write(target, value):
            if _same_variable(target, variable):
                writes.append((kind, value))
                return None
            return original(target, value)

        return write

    kinds = ("assign", "assign_add", "assign_sub")
    for kind in kinds:
        optimizer.__dict__[kind] = redirect(kind)
    try:
        yield writes
    finally:
        for kind in kinds:
            optimizer.__dict__.pop(kind, None)


def _step_of(writes, variable):
    """The inner step `s` (`w_new = w - s`) from the captured writes."""
    step = None
    for kind, value in writes:
        value = ops.cast(value, variable.dtype)
        if kind == "assign_sub":
            step = value if step is None else step + value
        elif kind == "assign_add":
            step = -value if step is None else step - value
        else:  # a full assign: w_new = value
            step = ops.convert_to_tensor(variable) - value
    return step


@keras.saving.register_keras_serializable(package="tf_lars")
class TrustRatio(
    InnerOptimizerWrapper,
    ShapeCheckedApply,
    LayerwiseExclusions,
    _Apply,
    keras.optimizers.Optimizer,
):
    """A layer-wise trust ratio around any Keras optimizer.

    Each step the inner optimizer computes its step for every variable as
    usual (Adam's, SGD's momentum, Lion's sign, ...) and updates its own
    slots exactly as it would alone; the wrapper adds weight decay to that
    step and rescales it per variable by a trust ratio (LAMB's Algorithm 2,
    optax's `scale_by_trust_ratio`). The rule is stated once, in
    docs/algorithms.md, section "TrustRatio and LAMB".

    Norms are of the whole tensor, computed in float32 (float64 for float64
    variables). Sparse gradients (`tf.IndexedSlices`) take the inner
    optimizer's own sparse update on the gradient with repeated rows summed
    (as the dense gradient has them): no ratio, no weight decay.

    Args:
        inner_optimizer: `keras.optimizers.Optimizer`. Computes the direction
            and owns the learning rate (`optimizer.learning_rate` reads and
            sets the inner one). Its `weight_decay`, clipping, EMA,
            loss-scale factor and gradient accumulation must be unset (set
            them on the wrapper).
        weight_decay: float >= 0. `wd`: added to the direction before the
            ratio, as in LAMB. Defaults to `0.0`.
        trust_coefficient: float > 0. Defaults to `1.0`.
        epsilon: float >= 0. Added to the ratio's denominator. Defaults to
            `0.0`.
        trust_clip: bool. Caps `T` at 1, so no variable takes a larger step
            than the inner optimizer's own (timm's `trust_clip`; LARC's clip
            caps the local rate at the global one, the same rule where the
            rate multiplies `T`). Defaults to `False`.
        exclude_from_weight_decay: list of str, callable or None. Regular
            expressions searched in each `variable.path`; `"<1d>"`
            (`tf_lars.lars.ALL_1D`) names every variable of rank <= 1; a
            callable takes the Keras variable and returns True to exclude
            it. Defaults to `None`.
        exclude_from_layer_adaptation: list of str, callable or None. Same
            form; matching variables use `T = 1`. Defaults to `None`: the
            weight-decay list (Model Garden's convention, not optax's: see
            docs/algorithms.md, "Exclusion lists and masks"; pass `[]` to
            adapt every variable).
        clipnorm, clipvalue, global_clipnorm, use_ema, ema_momentum,
        ema_overwrite_frequency, loss_scale_factor,
        gradient_accumulation_steps: the `keras.optimizers.Optimizer` base
            arguments, applied by the wrapper to the gradient before the
            inner optimizer sees it. Default to Keras's defaults.
        name: str or None. Defaults to `None` (numbered `trust_ratio`,
            `trust_ratio_1`, ...).

    After a step, `trust_ratios` holds every trainable variable's `T` (1 for
    excluded and sparse ones) in the order of `trust_ratio_paths`, as for
    `tf_lars.LARS`, so `tf_lars.callbacks.TrustRatioMonitor` reads it.

    References:
        - [You et al. 2019: Large Batch Optimization for Deep Learning:
          Training BERT in 76 minutes](https://arxiv.org/abs/1904.00962)
        - [You, Gitman, Ginsburg 2017: Large Batch Training of Convolutional
          Networks](https://arxiv.org/abs/1708.03888)

    Example:

    >>> import keras, tf_lars
    >>> optimizer = tf_lars.TrustRatio(
    ...     keras.optimizers.Lion(learning_rate=1e-4), weight_decay=1e-2,
    ...     exclude_from_weight_decay=[tf_lars.lars.ALL_1D])
    >>> w = keras.Variable([[3.0, 4.0]])
    >>> optimizer.apply([keras.ops.convert_to_tensor([[1.0, -1.0]])], [w])
    >>> round(float(optimizer.trust_ratios[0]), 3)  # |w| / |sign(g) + 0.01 w|
    3.551
    """

    def __init__(
        self,
        inner_optimizer,
        weight_decay=0.0,
        trust_coefficient=1.0,
        epsilon=0.0,
        trust_clip=False,
        exclude_from_weight_decay=None,
        exclude_from_layer_adaptation=None,
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
        _check_inner_optimizer(inner_optimizer)
        super().__init__(
            learning_rate=0.0,  # unused: the inner optimizer's rate applies
            weight_decay=None,  # the wrapper's decay sits inside the ratio
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
        self.inner_optimizer = inner_optimizer
        self.weight_decay = check_number("weight_decay", weight_decay, low=0.0)
        self.trust_coefficient = check_number(
            "trust_coefficient", trust_coefficient, low=0.0, low_inclusive=False
        )
        self._trust_epsilon = check_number("epsilon", epsilon, low=0.0)
        self.trust_clip = check_bool("trust_clip", trust_clip)
        self._init_exclusions(exclude_from_weight_decay, exclude_from_layer_adaptation)
        self._init_compiled_apply()

    # ----------------------------------------------------------------- state
    def build(self, variables):
        """Builds the inner optimizer and resolves per-variable exclusions."""
        if self.built:
            return
        super().build(variables)
        # Inside this optimizer's name scope, as when `apply` builds it: the
        # inner slots are `<name>/<inner name>/...` however the build is
        # reached (`fit` under MultiWorkerMirroredStrategy calls `build`).
        with keras.name_scope(self.name, caller=self):
            self.inner_optimizer.build(variables)
        self._resolve_exclusions(variables)

    @property
    def epsilon(self):
        """The `epsilon` of the ratio's denominator."""
        return self._trust_epsilon

    @property
    def variables(self):
        return super().variables + self.inner_optimizer.variables

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        # Called once by the base constructor, before `inner_optimizer` is set.
        if getattr(self, "inner_optimizer", None) is None:
            keras.optimizers.Optimizer.learning_rate.fset(self, learning_rate)
            return
        self.inner_optimizer.learning_rate = learning_rate

    def _apply_weight_decay(self, variables):
        # The decay is inside the ratio (step 2 (decay)); never the base class's.
        return

    # ------------------------------------------------------- the update rule
    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        # The inner optimizer's own `_backend_update_step` runs the step, so
        # the per-step state it advances there (Nadam's `_u_product`) moves
        # as it would alone; for each variable it calls `update_step`, which
        # is this wrapper's for the duration.
        # Where a compiler sees the whole step, `_take_step` defers steps 3
        # to 5 (trust ratio, clip, update) to one `_take_steps` over every
        # variable (kept in `__dict__`, out of Keras's and TensorFlow's
        # tracking).
        inner = self.inner_optimizer
        inner.__dict__["update_step"] = self.update_step
        if _kernels.batches_trust_ratios(grads):
            self.__dict__["_deferred_steps"] = []
            # Per-step scalars computed once (`LambAdam._once_per_step`,
            # `_unit_scale`).
            inner.__dict__["_step_scalars"] = {}
        try:
            _internals.per_variable_update_step(inner)(
                grads, trainable_variables, learning_rate
            )
            deferred = self.__dict__.pop("_deferred_steps", None)
            if deferred:
                self._take_steps(deferred)
        finally:
            inner.__dict__.pop("update_step", None)
            inner.__dict__.pop("_step_scalars", None)
            self.__dict__.pop("_deferred_steps", None)
        # The inner optimizer's own step count (Adam's bias correction).
        self.assign_add(inner.iterations, ops.ones((), inner.iterations.dtype))

    def _inner_update_step(self, gradient, variable, learning_rate):
        """The inner optimizer's own `update_step` (its class's, never ours)."""
        inner = self.inner_optimizer
        type(inner).update_step(inner, gradient, variable, learning_rate)

    def update_step(self, gradient, variable, learning_rate):
        """Steps 1-6 (inner step, decay, trust ratio, clip, update, sparse
        gradients) for one variable (docs/algorithms.md)."""
        if _kernels.is_sparse(gradient):
            # Step 6 (sparse gradients): the inner optimizer's own update, on
            # the gradient with repeated rows summed.
            gradient = _kernels.summed_rows(gradient)
            self._inner_update_step(gradient, variable, learning_rate)
            return
        index = _internals.variable_index(self, variable)
        # Steps 1 and 2 (inner step, decay): lr * u = scale * direction.
        scale, direction = self._inner_step(
            gradient, variable, learning_rate, self._variable_weight_decay[index]
        )
        self._take_step(index, variable, scale, direction, learning_rate)

    def _take_step(
        self, index, variable, scale, direction, learning_rate, for_norm=None
    ):
        """Steps 3 to 5 (trust ratio, clip, update): `w <- w - T * scale * d`.

        `for_norm`: the direction for the norm, or a function computing it
        (`tf_lars.lamb.lamb_direction`); defaults to `direction`.
        """
        if self._variable_adapted[index]:
            for_norm = direction if for_norm is None else for_norm
            step = (index, variable, scale, direction, learning_rate, for_norm)
            deferred = self.__dict__.get("_deferred_steps")
            if deferred is not None:  # see `_backend_update_step`
                deferred.append(step)
                return
            self._take_steps([step])
            return
        _kernels.scaled_step(self, variable, scale, direction)

    def _take_steps(self, steps):
        """`_take_step` of adapted variables, as `(index, variable, scale,
        direction, learning_rate, for_norm)`: one `norms` call and one
        record per compute dtype."""
        by_dtype = {}
        for step in steps:
            by_dtype.setdefault(_rules.compute_dtype(step[1].dtype), []).append(step)
        for group in by_dtype.values():
            indices, variables, scales, directions, rates, for_norms = zip(
                *group, strict=True
            )
            ratios = self._step_trust_ratios(variables, for_norms, scales, rates[0])
            _rules.record_trust_ratios(self, list(indices), ratios)
            self._write_steps(variables, scales, directions, ratios)

    def _write_steps(self, variables, scales, directions, ratios):
        """Step 5 (update) of one dtype's variables: `w <- w - T * scale * d`.

        A method of its own: under `torch.compile` the range check's branch
        in `norms` breaks the graph inside `_take_steps`'s loop, so Dynamo
        runs that loop eagerly; this frame it compiles whole, once for the
        list of variables, instead of each write once per variable shape
        (past its recompile limit).
        """
        for variable, scale, direction, ratio in zip(
            variables,
            scales,
            directions,
            _kernels.entries(ratios, variables),
            strict=True,
        ):
            scale = ops.cast(ratio, variable.dtype) * scale
            _kernels.scaled_step(self, variable, scale, direction)

    def _inner_step(self, gradient, variable, learning_rate, decay):
        """Steps 1 and 2 (inner step, decay): `lr * u` as `(scale, direction)`.

        The inner optimizer runs its own `update_step`; its write to
        `variable` is captured (`s = w - w_new`) and taken with scale 1;
        then the decay is added.
        """
        with _captured_step(self.inner_optimizer, variable) as writes:
            self._inner_update_step(gradient, variable, learning_rate)
        step = _step_of(writes, variable)
        if step is None:
            step = ops.zeros(variable.shape, variable.dtype)
        scale = self._unit_scale(variable.dtype)
        return scale, self._with_decay(step, scale, variable, learning_rate, decay)

    def _unit_scale(self, dtype):
        """A scale of 1 in `dtype`: one per dtype and step where the step's
        scalars are shared (`_backend_update_step` opens `_step_scalars`, as
        for `LambAdam._once_per_step`), so `_step_trust_ratios` sees one
        scale."""
        memo = self.inner_optimizer.__dict__.get("_step_scalars")
        if memo is None:
            return ops.ones((), dtype)
        key = ("unit", keras.backend.standardize_dtype(dtype))
        if key not in memo:
            memo[key] = ops.ones((), dtype)
        return memo[key]

    @staticmethod
    def _decay_factor(scale, learning_rate, decay):
        """`lr * wd / scale` (0 where scale is 0: then nothing moves anyway)."""
        dtype = scale.dtype
        divisor = ops.where(ops.equal(scale, 0), ops.ones_like(scale), scale)
        return (
            ops.cast(learning_rate, dtype)
            * ops.convert_to_tensor(decay, dtype)
            / divisor
        )

    def _with_decay(self, direction, scale, variable, learning_rate, decay):
        """Step 2 (decay): u = d + wd * w, kept as lr * u = scale * (direction +
        (lr * wd / scale) * w)."""
        if decay == 0.0:
            return direction
        factor = self._decay_factor(scale, learning_rate, decay)
        return direction + factor * ops.convert_to_tensor(variable)

    def _step_trust_ratios(self, variables, directions, scales, learning_rate):
        """Step 3 (trust ratio) for variables of one compute dtype, as one
        vector: `T` from `|w|` and `|u| = |scale| |direction| / lr`.

        `directions`: tensors, or functions returning them (see `norms`).
        """
        compute = _rules.compute_dtype(variables[0].dtype)
        count = len(variables)
        both = _kernels.norms(
            [ops.cast(variable, compute) for variable in variables]
            + [_cast(direction, compute) for direction in directions]
        )
        w_norm, direction_norm = both[:count], both[count:]
        if all(scale is scales[0] for scale in scales):
            # One scale for all (LAMB's per-step Adam scale, the unit scale
            # of a captured step): a scalar, not a stack of copies.
            scale = ops.cast(scales[0], compute)
        else:
            scale = ops.stack([ops.cast(scale, compute) for scale in scales])
        step_norm = ops.abs(scale) * direction_norm
        rate = ops.cast(learning_rate, compute)
        defined = ops.logical_and(w_norm > 0, ops.logical_and(step_norm > 0, rate > 0))
        u_norm = step_norm / ops.where(defined, rate, ops.ones_like(rate))
        ratio = _rules.trust_ratio(
            w_norm, u_norm, self.trust_coefficient, self._trust_epsilon, defined
        )
        if self.trust_clip:
            ratio = ops.minimum(ratio, ops.ones_like(ratio))
        return ratio

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        """Keras's `stateless_apply` (what the JAX trainer calls).

        Every write of the wrapper and of the inner optimizer goes through
        `assign*`, so Keras's stateless scope records it. The TensorFlow
        backend refuses it, as for every Keras optimizer there.
        """
        if keras.backend.backend() == "tensorflow":
            return super().stateless_apply(
                optimizer_variables, grads, trainable_variables
            )
        return keras.optimizers.Optimizer.stateless_apply(
            self, optimizer_variables, grads, trainable_variables
        )

    # --------------------------------------------------------- serialization
    def _trust_ratio_config(self):
        return {
            "weight_decay": self.weight_decay,
            "trust_coefficient": self.trust_coefficient,
            "epsilon": self._trust_epsilon,
            "trust_clip": self.trust_clip,
            **self._exclusions_config(),
            "clipnorm": self.clipnorm,
            "clipvalue": self.clipvalue,
            "global_clipnorm": self.global_clipnorm,
            "use_ema": self.use_ema,
            "ema_momentum": self.ema_momentum,
            "ema_overwrite_frequency": self.ema_overwrite_frequency,
            "loss_scale_factor": self.loss_scale_factor,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
        }

    def get_config(self):
        return self._wrapper_config(**self._trust_ratio_config())

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Creates a `TrustRatio` from `get_config()` output; unknown keys raise."""
        check_config_keys(cls, config)
        return super().from_config(config, custom_objects=custom_objects)
