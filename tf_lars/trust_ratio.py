"""A layer-wise trust ratio around any Keras optimizer.

The rule is docs/algorithms.md, section "TrustRatio and LAMB", step by step
in `TrustRatio.update_step`. `tf_lars.LAMB` is a TrustRatio whose
`update_step` computes Adam's direction itself.

How the inner optimizer's step is read (`captured_step`, `step_each_variable`):
a Keras optimizer has no public "compute the step, do not apply it". So
TrustRatio runs the inner optimizer's own `_backend_update_step` (its loop
over the variables, `tf_lars._internals.own_update_step`) with its
`update_step` replaced, for that call, by `TrustRatio.update_step` (an
instance attribute in `inner.__dict__`); that calls the inner class's
`update_step` with the instance's `assign`, `assign_add` and `assign_sub`
replaced in the same way, which record the writes aimed at the variable and
pass every other write (the slots) through. The step `s = w - w_new` is
rebuilt from the recorded writes; the variable is left as it was.

What it depends on: every write an optimizer's `update_step` makes to the
variable goes through `self.assign`, `self.assign_add` or `self.assign_sub`.
Read from the sources of every optimizer in `keras.optimizers` of Keras
3.8.0 and 3.15.1, the ends of the supported range (Muon's direct
`variable.assign` is in its `_apply_weight_decay`, which the wrapper never
has the inner optimizer run). An optimizer that writes its variable some
other way (`variable.assign(...)`, or `variable.value.assign(...)` on
TensorFlow) is not seen, and nothing here detects it (that would take a
read and a comparison of every variable each step): the variable moves by
the inner step unscaled and the captured step is zero.
`tests/backends_rules_test.py::
test_every_keras_optimizer_writes_its_variable_only_through_assign` checks,
for every Keras optimizer on each backend, that the captured step equals the
step an identical optimizer takes and that the variable is left as it was:
a Keras release that writes another way fails it.
"""

import keras
from keras import ops

from tf_lars import _internals, _trust
from tf_lars._exclusions import LayerwiseExclusions
from tf_lars._validation import (
    ShapeCheckedApply,
    check_base_arguments,
    check_bool,
    check_config_keys,
    check_inner_built_on,
    check_inner_optimizer,
    check_number,
)
from tf_lars._wrapper import (
    InnerOptimizerWrapper,
    InnerOwnsTheRate,
    pop_inner_arguments,
    track_attribute_variables,
)
from tf_lars.backend import BackendSubclass

__all__ = ["TrustRatio"]

_WRITES = ("assign", "assign_add", "assign_sub")


def step_each_variable(optimizer, update_step, grads, variables, learning_rate):
    """Runs `optimizer`'s own step with its `update_step` replaced by
    `update_step` (an instance attribute, removed after).

    The step is the optimizer's own `_backend_update_step`
    (`_internals.own_update_step`), so the per-step state it advances
    (Nadam's `_u_product`) moves as it would alone.
    """
    step = _internals.own_update_step(optimizer)
    optimizer.__dict__["update_step"] = update_step
    try:
        step(grads, variables, learning_rate)
    finally:
        optimizer.__dict__.pop("update_step", None)


def captured_step(optimizer, gradient, variable, learning_rate):
    """The step `s = w - w_new` `optimizer`'s own `update_step` takes for
    `variable`, its slots updated but `variable` left as it was.

    For the call, `optimizer`'s `assign`, `assign_add` and `assign_sub`
    record the writes aimed at `variable` and pass every other write (the
    slots) through (the module docstring says what this relies on). Zeros
    where the step wrote nothing.
    """
    writes = []

    def unwrap(target):
        # TensorFlow hands `update_step` the `tf.Variable` of a Keras one.
        if keras.backend.backend() == "tensorflow" and isinstance(
            target, keras.Variable
        ):
            return target.value
        return target

    def redirect(kind):
        original = getattr(optimizer, kind)

        def write(target, value):
            if target is variable or unwrap(target) is unwrap(variable):
                writes.append((kind, ops.cast(value, variable.dtype)))
                return None
            return original(target, value)

        return write

    for kind in _WRITES:
        optimizer.__dict__[kind] = redirect(kind)
    try:
        type(optimizer).update_step(optimizer, gradient, variable, learning_rate)
    finally:
        for kind in _WRITES:
            optimizer.__dict__.pop(kind, None)
    step = None
    for kind, value in writes:
        if kind == "assign_sub":
            step = value if step is None else step + value
        elif kind == "assign_add":
            step = -value if step is None else step - value
        else:  # a full assign: w_new = value
            step = ops.convert_to_tensor(variable) - value
    if step is None:
        return ops.zeros(variable.shape, variable.dtype)
    return step


def _cast(tensor, dtype):
    """`tensor` cast to `dtype`; a function returning it (see `_trust.norms`)
    stays a function, returning it cast."""
    if callable(tensor):
        return lambda: ops.cast(tensor(), dtype)
    return ops.cast(tensor, dtype)


@keras.saving.register_keras_serializable(package="tf_lars")
class TrustRatio(
    BackendSubclass,
    InnerOptimizerWrapper,
    ShapeCheckedApply,
    LayerwiseExclusions,
    InnerOwnsTheRate,
    keras.optimizers.Optimizer,
):
    """A layer-wise trust ratio around any Keras optimizer.

    Each step the inner optimizer computes its step for every variable as
    usual (Adam's, SGD's momentum, Lion's sign, ...) and updates its own
    slots exactly as it would alone; the wrapper adds weight decay to that
    step and rescales it per variable by a trust ratio (LAMB's Algorithm 2,
    optax's `scale_by_trust_ratio`). The rule is stated once, in
    docs/algorithms.md, section "TrustRatio and LAMB".

    Sparse gradients (`tf.IndexedSlices`) take the inner optimizer's own
    update, repeated rows summed, without ratio or weight decay.

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
        clipnorm: float or None. Clips each variable's gradient to this norm
            before the step (Keras's base argument; the wrapper applies it,
            and the other gradient arguments below, before the inner
            optimizer sees the gradient). Defaults to `None`.
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

    Examples:
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
        check_inner_optimizer(inner_optimizer)
        # The base arguments are TrustRatio's own, all but the learning rate.
        pop_inner_arguments("TrustRatio", kwargs, {"learning_rate": None})
        super().__init__(
            learning_rate=0.0,  # unused: the inner optimizer's rate applies
            weight_decay=None,  # the wrapper's decay sits inside the ratio
            **check_base_arguments(
                clipnorm=clipnorm,
                clipvalue=clipvalue,
                global_clipnorm=global_clipnorm,
                use_ema=use_ema,
                ema_momentum=ema_momentum,
                ema_overwrite_frequency=ema_overwrite_frequency,
                loss_scale_factor=loss_scale_factor,
                gradient_accumulation_steps=gradient_accumulation_steps,
            ),
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
        self.jit_compile = True  # read by the TensorFlow subclass's eager apply

    # ----------------------------------------------------------------- state
    def build(self, variables):
        """Builds the inner optimizer and resolves per-variable exclusions."""
        if self.built:
            return
        check_inner_built_on(self.inner_optimizer, variables)
        super().build(variables)
        # The inner slots are `<name>/<inner name>/...` however it is reached.
        with keras.name_scope(self.name, caller=self):
            self.inner_optimizer.build(variables)
        track_attribute_variables(self.inner_optimizer, variables)
        self._resolve_exclusions(variables)

    @property
    def epsilon(self):
        """The `epsilon` of the ratio's denominator."""
        return self._trust_epsilon

    def _apply_weight_decay(self, variables):
        # The decay is inside the ratio (step 2 (decay)); never the base class's.
        return

    # ------------------------------------------------------- the update rule
    def update_step(self, gradient, variable, learning_rate):
        """Steps 1 to 5 (inner step, decay, trust ratio, clip, update) for one
        variable, around the inner `update_step` (the TensorFlow subclass takes
        step 6 (sparse gradients))."""
        index = _internals.variable_index(self, variable)
        decay = self._variable_weight_decay[index]
        dtype = variable.dtype
        # Step 1 (inner step): the inner optimizer's step s (w_new = w - s),
        # its slots updated as alone; lr d = s, kept as scale 1 times s.
        step = captured_step(self.inner_optimizer, gradient, variable, learning_rate)
        key = ("unit", keras.backend.standardize_dtype(dtype))
        scale = self._once_per_step(key, lambda: ops.ones((), dtype))
        # Step 2 (decay): lr u = s + lr wd w.
        if decay != 0.0:
            factor = _trust.decay_factor(scale, learning_rate, decay)
            step = step + factor * ops.convert_to_tensor(variable)
        # Steps 3 to 5 (trust ratio, clip, update).
        self._take_step(index, variable, scale, step, learning_rate)

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        # Where `_batches_trust_ratios()` (outside `tf.distribute`),
        # `_take_step` defers steps 3 to 5 (trust ratio, clip, update) to one
        # `_take_steps` over every variable, and `_once_per_step` computes
        # the per-step scalars once (both kept in `__dict__`, out of Keras's
        # and TensorFlow's tracking).
        if self._batches_trust_ratios():
            self.__dict__.update(_deferred_steps=[], _step_scalars={})
        try:
            self._step_each_variable(grads, trainable_variables, learning_rate)
            deferred = self.__dict__.pop("_deferred_steps", None)
            if deferred:
                self._take_steps(deferred)
        finally:
            self.__dict__.pop("_deferred_steps", None)
            self.__dict__.pop("_step_scalars", None)
        # The inner optimizer's own step count (Adam's bias correction).
        inner = self.inner_optimizer
        self.assign_add(inner.iterations, ops.ones((), inner.iterations.dtype))

    def _step_each_variable(self, grads, variables, learning_rate):
        # The inner optimizer's own step, calling this `update_step` for
        # each variable (`step_each_variable`).
        step_each_variable(
            self.inner_optimizer, self.update_step, grads, variables, learning_rate
        )

    def _once_per_step(self, key, compute):
        """`compute()`, or its value from earlier in this step: where the
        step's ratios are batched, scalars shared by every variable of a
        dtype are computed once, not once per variable (compile time and
        program size; docs/guides/benchmarks.md, "Compile time")."""
        memo = self.__dict__.get("_step_scalars")
        if memo is None:
            return compute()
        if key not in memo:
            memo[key] = compute()
        return memo[key]

    def _take_step(
        self, index, variable, scale, direction, learning_rate, for_norm=None
    ):
        """Steps 3 to 5 (trust ratio, clip, update): `w <- w - T * scale * d`.

        `for_norm`: the direction for the norm, or a function computing it
        (LAMB's under XLA); defaults to `direction`.
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
        self._scaled_step(variable, scale, direction)

    def _take_steps(self, steps):
        """`_take_step` of adapted variables, as `(index, variable, scale,
        direction, learning_rate, for_norm)`: one `norms` call and one
        record per compute dtype."""
        by_dtype = {}
        for step in steps:
            by_dtype.setdefault(_trust.compute_dtype(step[1].dtype), []).append(step)
        for group in by_dtype.values():
            indices, variables, scales, directions, rates, for_norms = zip(
                *group, strict=True
            )
            ratios = self._step_trust_ratios(variables, for_norms, scales, rates[0])
            _trust.record_trust_ratios(self, list(indices), ratios)
            self._write_steps(variables, scales, directions, ratios)

    def _write_steps(self, variables, scales, directions, ratios):
        """Step 5 (update) of one dtype's variables: `w <- w - T * scale * d`.

        A method of its own: `torch.compile` breaks its graph at the range
        check in `norms`, and compiles this frame once for the list of
        variables instead of each write once per shape (its recompile limit).
        """
        for variable, scale, direction, ratio in zip(
            variables,
            scales,
            directions,
            self._entries(ratios, variables),
            strict=True,
        ):
            scale = ops.cast(ratio, variable.dtype) * scale
            self._scaled_step(variable, scale, direction)

    def _step_trust_ratios(self, variables, directions, scales, learning_rate):
        """Step 3 (trust ratio) for variables of one compute dtype, as one
        vector: `T` from `|w|` and `|u| = |scale| |direction| / lr`.

        `directions`: tensors, or functions returning them (see `norms`).
        """
        compute = _trust.compute_dtype(variables[0].dtype)
        count = len(variables)
        both = self._norms(
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
        ratio = _trust.trust_ratio(
            w_norm, u_norm, self.trust_coefficient, self._trust_epsilon, defined
        )
        if self.trust_clip:
            ratio = ops.minimum(ratio, ops.ones_like(ratio))
        return ratio

    def _scaled_step(self, variable, scale, step):
        """`w <- w - scale * step` (`scale` a scalar of the variable's dtype)."""
        self.assign_sub(variable, scale * step)

    def _norms(self, tensors):
        return _trust.norms(tensors)

    def _entries(self, vector, tensors):
        return _trust.entries(vector, tensors)

    def _batches_trust_ratios(self):
        # Steps 3 to 5 (trust ratio, clip, update) of every variable at once:
        # one `norms` call and one record per step (the TensorFlow subclass:
        # not under tf.distribute).
        return True

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
