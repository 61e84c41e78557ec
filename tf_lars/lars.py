"""Layer-wise Adaptive Rate Scaling (LARS) for Keras 3 on TensorFlow."""

import inspect
import math
import re

import keras
import tensorflow as tf

from tf_lars import _norms
from tf_lars._validation import is_real

#: Entry for `exclude_from_weight_decay` / `exclude_from_layer_adaptation`
#: that matches every variable of rank 0 or 1 (biases, normalization scales
#: and offsets). It cannot collide with a real variable path.
ALL_1D = "<1d>"

_TRUST_RATIOS = ("paper", "decayed")


def _check_number(name, value, *, low=None, low_inclusive=True, high=None):
    """Validates a hyperparameter; raises `ValueError` naming it."""
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
    too_low = low is not None and (value < low if low_inclusive else value <= low)
    too_high = high is not None and value >= high
    if too_low or too_high:
        raise ValueError(f"`{name}` must be {rule_text}. Received: {name}={value!r}")
    return float(value)


def _check_bool(name, value):
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be a bool. Received: {name}={value!r}")
    return value


def _check_patterns(name, value):
    """Normalizes an exclusion list to a tuple of compiled-checked regexes."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple):
        raise ValueError(
            f"`{name}` must be None, a string or a list of strings (regular "
            f"expressions matched against `variable.path`). "
            f"Received: {name}={value!r}"
        )
    patterns = []
    for pattern in value:
        if not isinstance(pattern, str):
            raise ValueError(
                f"`{name}` entries must be strings. Received: {name}={value!r}"
            )
        if pattern != ALL_1D:
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(
                    f"`{name}` entry {pattern!r} is not a valid regular "
                    f"expression ({error}). Received: {name}={value!r}"
                ) from None
        patterns.append(pattern)
    return tuple(patterns)


#: Attribute that tf_lars sets on variables standing in for a model variable
#: (AGN's center and worker-local copies): the model variable's path, so that
#: exclusions written against model paths apply to the copies too.
SOURCE_PATH_ATTRIBUTE = "_tf_lars_source_path"


def _variable_path(variable):
    path = getattr(variable, SOURCE_PATH_ATTRIBUTE, None) or getattr(
        variable, "path", None
    )
    if path is None:
        # A bare `tf.Variable` has no path; its name is the closest thing.
        path = variable.name.split(":")[0]
    return path


def _matches(patterns, variable):
    path = _variable_path(variable)
    for pattern in patterns:
        if pattern == ALL_1D:
            if len(variable.shape) <= 1:
                return True
        elif re.search(pattern, path):
            return True
    return False


class _FunctionCache(dict):
    """Compiled `apply` functions by variable list; never tracked or saved."""


@keras.saving.register_keras_serializable(package="tf_lars")
class LARS(keras.optimizers.Optimizer):
    """Layer-wise Adaptive Rate Scaling (LARS).

    Each dense variable `w` gets its own trust ratio `T` from the norms of the
    variable and its gradient, so that every layer moves by a similar
    fraction of its size whatever the batch size. With `momentum` `mu`,
    weight decay `wd` and learning rate `lr` (defaults shown):

    ```
    g' = g + wd * w                                   # decay_in_gradient
    T  = trust_coefficient * |w| / (|g| + wd * |w| + epsilon)   # "paper"
    T  = trust_coefficient * |w| / (|g'| + epsilon)             # "decayed"
    T  = 1 if |w| == 0 or the gradient norm == 0, or w is excluded
    r  = lr * T                  (trust_clip: r = min(T, lr))
    v  = mu * v + r * g'         w = w - v            # classic_momentum
    v  = mu * v + g'             w = w - r * v        # classic_momentum=False
    ```

    Sparse `tf.IndexedSlices` gradients (embeddings) skip the trust ratio and
    weight decay: duplicate indices are summed and only the touched rows of
    the variable and its momentum change (`v[i] = mu * v[i] + lr * g[i];
    w[i] -= v[i]`, or `v[i] = mu * v[i] + g[i]; w[i] -= lr * v[i]` with
    `classic_momentum=False`).

    Flags reproduce the well-known variants:

    - You et al. 2017, MLPerf, MXNet: the defaults.
    - TF contrib `LARSOptimizer`: `classic_momentum=False,
      decay_in_gradient=False`.
    - TF Model Garden, optax `lars`: `trust_ratio="decayed"` (Model Garden:
      `epsilon=0`).
    - timm `Lars(trust_clip=True)`, apex `LARC(clip=True)`: `trust_clip=True`.

    Args:
        learning_rate: float, a `keras.optimizers.schedules.LearningRateSchedule`
            or a callable with no arguments. The global learning rate `lr`.
            Defaults to `0.1`.
        momentum: float in [0, 1). Momentum `mu`; 0 keeps no momentum slot.
            Defaults to `0.9`.
        weight_decay: float >= 0. Coupled (L2) weight decay `wd`: it sits in
            the trust ratio and, with `decay_in_gradient`, in the gradient.
            Defaults to `0.0`.
        trust_coefficient: float > 0. `eta` in the paper, `eeta` in TF
            contrib. Defaults to `0.001`.
        epsilon: float >= 0. Added to the trust ratio's denominator.
            Defaults to `0.0`.
        nesterov: bool. Nesterov momentum. Defaults to `False`.
        classic_momentum: bool. `True` scales the gradient by the local rate
            before the momentum; `False` scales the momentum (TF contrib).
            Defaults to `True`.
        trust_ratio: str, `"paper"` or `"decayed"`: which gradient norm the
            trust ratio divides by (see above). Defaults to `"paper"`.
        decay_in_gradient: bool. Add `wd * w` to the gradient that is
            applied. Defaults to `True`.
        trust_clip: bool. LARC clip mode: the local rate is `min(T, lr)`.
            Defaults to `False`.
        exclude_from_weight_decay: list of str or None. Regular expressions
            searched (`re.search`) in each `variable.path`
            (e.g. `"dense/bias"`); matching variables get no weight decay.
            The entry `"<1d>"` (`tf_lars.lars.ALL_1D`) matches every variable
            of rank <= 1. Defaults to `None`.
        exclude_from_layer_adaptation: list of str or None. Same form;
            matching variables use `T = 1`. Defaults to `None`, which means
            the same list as `exclude_from_weight_decay` (the Model Garden
            and optax convention); pass `[]` to adapt every variable.
        {{base_optimizer_keyword_args}}

    Besides the constructor arguments, `jit_compile` (attribute, default
    `True`) makes an eager `optimizer.apply(...)` run as one XLA-compiled
    function instead of op by op; inside `tf.function`, `model.fit` and
    multi-replica strategies it has no effect. After the first step,
    `trust_ratios` holds the trust ratio of every trainable variable from the
    latest step (1 for excluded and sparse variables), in the order of
    `trust_ratio_paths`.

    The base class's decoupled `weight_decay` is not used: LARS's weight
    decay is coupled, and the base method
    `exclude_from_weight_decay(var_list, var_names)` still works (call it
    before the first step); its exclusions add to the constructor's
    weight-decay list (layer adaptation follows the constructor's lists only).

    References:
        - [You, Gitman, Ginsburg 2017: Large Batch Training of Convolutional
          Networks](https://arxiv.org/abs/1708.03888)

    Example:

    >>> import keras, tf_lars
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> optimizer = tf_lars.LARS(
    ...     learning_rate=1.0, weight_decay=1e-4, trust_coefficient=0.02,
    ...     exclude_from_weight_decay=[tf_lars.lars.ALL_1D])
    >>> model.compile(optimizer=optimizer, loss="mse")
    """

    def __init__(
        self,
        learning_rate=0.1,
        momentum=0.9,
        weight_decay=0.0,
        trust_coefficient=0.001,
        epsilon=0.0,
        nesterov=False,
        classic_momentum=True,
        trust_ratio="paper",
        decay_in_gradient=True,
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
        name="lars",
        **kwargs,
    ):
        if is_real(learning_rate):
            learning_rate = _check_number("learning_rate", learning_rate, low=0.0)
        elif not (
            isinstance(learning_rate, keras.optimizers.schedules.LearningRateSchedule)
            or callable(learning_rate)
        ):
            raise ValueError(
                "`learning_rate` must be a non-negative finite float, a "
                "`keras.optimizers.schedules.LearningRateSchedule` or a "
                f"callable. Received: learning_rate={learning_rate!r}"
            )
        super().__init__(
            learning_rate=learning_rate,
            weight_decay=None,
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
        self.momentum = _check_number("momentum", momentum, low=0.0, high=1.0)
        self.weight_decay = _check_number("weight_decay", weight_decay, low=0.0)
        self.trust_coefficient = _check_number(
            "trust_coefficient", trust_coefficient, low=0.0, low_inclusive=False
        )
        self.epsilon = _check_number("epsilon", epsilon, low=0.0)
        self.nesterov = _check_bool("nesterov", nesterov)
        self.classic_momentum = _check_bool("classic_momentum", classic_momentum)
        if trust_ratio not in _TRUST_RATIOS:
            raise ValueError(
                f"`trust_ratio` must be one of {list(_TRUST_RATIOS)}. "
                f"Received: trust_ratio={trust_ratio!r}"
            )
        self.trust_ratio = trust_ratio
        self.decay_in_gradient = _check_bool("decay_in_gradient", decay_in_gradient)
        self.trust_clip = _check_bool("trust_clip", trust_clip)
        # Stored privately: the base class owns a method called
        # `exclude_from_weight_decay` and a `_exclude_from_weight_decay` set.
        self._weight_decay_exclusions = _check_patterns(
            "exclude_from_weight_decay", exclude_from_weight_decay
        )
        self._adaptation_exclusions_given = exclude_from_layer_adaptation
        self._layer_adaptation_exclusions = (
            self._weight_decay_exclusions
            if exclude_from_layer_adaptation is None
            else _check_patterns(
                "exclude_from_layer_adaptation", exclude_from_layer_adaptation
            )
        )
        self.jit_compile = True
        self._compiled_apply = _FunctionCache()

    # ------------------------------------------------------------------ state
    def build(self, variables):
        """Creates the momentum slots and resolves per-variable exclusions.

        Args:
            variables: list of model variables (Keras variables, so that
                exclusions can match `variable.path`).
        """
        if self.built:
            return
        super().build(variables)
        self.momentums = []
        if self.momentum != 0:
            self.momentums = self.add_optimizer_variables(variables, "momentum")
        # Per-variable settings are resolved here, from the Keras variables:
        # `update_step` receives the backing `tf.Variable`, which has no path.
        self._variable_weight_decay = []
        self._variable_adapted = []
        for variable in variables:
            decayed = not _matches(self._weight_decay_exclusions, variable) and (
                self._use_weight_decay(variable)
            )
            self._variable_weight_decay.append(self.weight_decay if decayed else 0.0)
            self._variable_adapted.append(
                not _matches(self._layer_adaptation_exclusions, variable)
            )
        self.trust_ratio_paths = [_variable_path(v) for v in variables]
        self.trust_ratios = self.add_variable(
            shape=(len(variables),),
            initializer="ones",
            dtype="float32",
            aggregation="only_first_replica",
            name="trust_ratios",
        )

    def _apply_weight_decay(self, variables):
        # LARS's weight decay is coupled (inside `update_step`); the base
        # class's decoupled decay must never run on top of it.
        return

    # ---------------------------------------------------------------- compute
    def _compute_dtype(self, variable):
        return tf.float64 if variable.dtype == tf.float64 else tf.float32

    def _trust_ratio_values(self, grads, variables):
        """Trust ratios for dense gradients, all norms in one batched pass.

        Returns a list with one scalar per variable (`None` for sparse
        gradients), in the compute dtype of each variable.
        """
        indices = [self._get_variable_index(v) for v in variables]
        ratios = [None] * len(variables)
        adapted = []
        for position, (grad, variable, index) in enumerate(
            zip(grads, variables, indices, strict=True)
        ):
            if isinstance(grad, tf.IndexedSlices):
                continue
            ratios[position] = tf.constant(1.0, self._compute_dtype(variable))
            if self._variable_adapted[index]:
                adapted.append(position)
        if not adapted:
            return ratios

        # Ratios are computed as vectors, one per compute dtype, so that the
        # scalar arithmetic of hundreds of variables is a handful of ops.
        by_dtype = {}
        for p in adapted:
            by_dtype.setdefault(self._compute_dtype(variables[p]), []).append(p)
        decayed_norm = self.trust_ratio == "decayed" and self.decay_in_gradient
        for dtype, positions in by_dtype.items():
            decays = [self._variable_weight_decay[indices[p]] for p in positions]
            weight_squares, grad_squares = _norms.squared_norms(
                [variables[p] for p in positions],
                [grads[p] for p in positions],
                decays if decayed_norm else None,
                dtype,
            )
            vector = self._ratio_vector(weight_squares, grad_squares, decays, dtype)
            for k, p in enumerate(positions):
                ratios[p] = vector[k]
        return ratios

    def _ratio_vector(self, weight_squares, grad_squares, decays, dtype):
        w_norm = tf.sqrt(weight_squares)
        g_norm = tf.sqrt(grad_squares)
        epsilon = tf.constant(self.epsilon, dtype)
        if self.trust_ratio == "paper":
            denominator = g_norm + tf.constant(decays, dtype) * w_norm + epsilon
        else:
            denominator = g_norm + epsilon
        usable = tf.logical_and(w_norm > 0, g_norm > 0)
        ones = tf.ones_like(w_norm)
        ratio = tf.constant(self.trust_coefficient, dtype) * w_norm
        return tf.where(usable, ratio / tf.where(usable, denominator, ones), ones)

    def _local_rate(self, ratio, learning_rate, index):
        learning_rate = tf.cast(learning_rate, ratio.dtype)
        if self.trust_clip and self._variable_adapted[index]:
            return tf.minimum(ratio, learning_rate)
        return learning_rate * ratio

    def update_step(self, gradient, variable, learning_rate):
        """Updates one variable (used on its own, e.g. by wrappers).

        `apply` computes all trust ratios in one batched pass and goes
        through `_update_with_ratio` directly.
        """
        ratio = self._trust_ratio_values([gradient], [variable])[0]
        self._update_with_ratio(gradient, variable, learning_rate, ratio)

    def _update_with_ratio(self, gradient, variable, learning_rate, ratio):
        index = self._get_variable_index(variable)
        dtype = variable.dtype
        momentum_slot = self.momentums[index] if self.momentum != 0 else None
        if isinstance(gradient, tf.IndexedSlices):
            self._sparse_update(gradient, variable, learning_rate, momentum_slot)
            return
        gradient = tf.cast(gradient, dtype)
        decay = self._variable_weight_decay[index]
        if self.decay_in_gradient and decay != 0.0:
            gradient = gradient + tf.constant(decay, dtype) * variable
        rate = tf.cast(self._local_rate(ratio, learning_rate, index), dtype)
        if momentum_slot is None:
            self.assign_sub(variable, rate * gradient)
            return
        # One fused kernel updates the slot and the variable in a single pass
        # (`v <- mu * v + lr' * g''; w <- w - lr * v`, or the Nesterov form).
        if self.classic_momentum:
            applied, step_rate = rate * gradient, tf.ones([], dtype)
        else:
            applied, step_rate = gradient, rate
        target = variable.value if isinstance(variable, keras.Variable) else variable
        tf.raw_ops.ResourceApplyMomentum(
            var=target.handle,
            accum=momentum_slot.value.handle,
            lr=step_rate,
            grad=applied,
            momentum=tf.constant(self.momentum, dtype),
            use_locking=False,
            use_nesterov=self.nesterov,
        )

    def _sparse_update(self, gradient, variable, learning_rate, momentum_slot):
        """Row-wise momentum on the touched rows; duplicate indices summed.

        Duplicates are handled without sorting or `tf.unique` (slow under XLA):
        scatter-adds sum repeated rows by themselves, and every other write is
        a scatter-update of values that are identical for repeated rows, so
        its result does not depend on which duplicate lands last. Gathers and
        scatters go through the backing `tf.Variable`: reading a
        `keras.Variable` as a tensor would read every row.
        """
        dtype = variable.dtype
        rows = gradient.indices
        values = tf.cast(gradient.values, dtype)
        rate = tf.cast(learning_rate, dtype)
        target = variable.value if isinstance(variable, keras.Variable) else variable
        if momentum_slot is None:
            target.scatter_sub(tf.IndexedSlices(rate * values, rows))
            return
        mu = tf.constant(self.momentum, dtype)
        slot = momentum_slot.value
        # v[i] <- mu * v[i] (idempotent), then v[i] += (rate *) g for each
        # occurrence: v[i] = mu * v[i] + (rate *) sum of g[i].
        slot.scatter_update(tf.IndexedSlices(mu * tf.gather(slot, rows), rows))
        added = rate * values if self.classic_momentum else values
        slot.scatter_add(tf.IndexedSlices(added, rows))
        velocity = tf.gather(slot, rows)
        if self.nesterov:
            # The gradient part of the Nesterov step, summed over duplicates.
            target.scatter_sub(tf.IndexedSlices(rate * values, rows))
            step = mu * velocity if self.classic_momentum else rate * mu * velocity
        else:
            step = velocity if self.classic_momentum else rate * velocity
        target.scatter_update(tf.IndexedSlices(tf.gather(target, rows) - step, rows))

    # ------------------------------------------------------------- apply path
    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        tf_variables = [
            v.value if isinstance(v, keras.Variable) else v for v in trainable_variables
        ]
        grads_and_vars = self._all_reduce_sum_gradients(list(zip(grads, tf_variables)))
        grads = [g for g, _ in grads_and_vars]
        # Trust ratios are computed before the merge call, in replica
        # context, on the all-reduced gradients: every replica gets the same
        # ratios and each variable's norms are computed once per step.
        ratios = self._trust_ratio_values(grads, tf_variables)
        self._record_trust_ratios(tf_variables, ratios)
        tf.__internal__.distribute.interim.maybe_merge_call(
            self._distributed_update,
            self._distribution_strategy,
            grads_and_vars,
            ratios,
            learning_rate,
        )

    def _record_trust_ratios(self, variables, ratios):
        positions = [[self._get_variable_index(v)] for v in variables]
        values = tf.stack(
            [tf.constant(1.0) if r is None else tf.cast(r, tf.float32) for r in ratios]
        )
        # A read and a full assign rather than a scatter: `assign` is what
        # mirrored variables support from replica context.
        self.trust_ratios.assign(
            tf.tensor_scatter_nd_update(
                tf.convert_to_tensor(self.trust_ratios), positions, values
            )
        )

    def _distributed_update(self, distribution, grads_and_vars, ratios, learning_rate):
        def update(variable, gradient, ratio, learning_rate):
            return self._update_with_ratio(gradient, variable, learning_rate, ratio)

        for (gradient, variable), ratio in zip(grads_and_vars, ratios, strict=True):
            distribution.extended.update(
                variable, update, args=(gradient, ratio, learning_rate), group=False
            )

    def apply(self, grads, trainable_variables=None):
        """Applies gradients; eagerly, as one compiled function.

        Same contract as `keras.optimizers.Optimizer.apply`. When called
        eagerly outside a multi-replica strategy and `self.jit_compile` is
        true, the whole update (every variable, slot and the iteration
        counter) runs as one `tf.function(jit_compile=True)`, traced once per
        list of variables. A float or a `LearningRateSchedule` learning rate
        is read inside the compiled step; with a plain callable learning rate
        `apply` runs op by op, so that the callable is called at every step.
        """
        if not self._should_compile_apply():
            return super().apply(grads, trainable_variables)
        grads = list(grads)
        if trainable_variables is None:
            if not self.built:
                return super().apply(grads, trainable_variables)
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        if len(grads) == 0:
            return None
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        self._check_variables_are_known(trainable_variables)
        key = tuple(id(v) for v in trainable_variables)
        compiled = self._compiled_apply.get(key)
        if compiled is None:
            variables = trainable_variables

            def apply_all(gradients):
                Optimizer = keras.optimizers.Optimizer
                Optimizer.apply(self, gradients, variables)

            compiled = tf.function(apply_all, jit_compile=True, autograph=False)
            self._compiled_apply[key] = compiled
        compiled(grads)
        return None

    def _should_compile_apply(self):
        if not self.jit_compile or not tf.executing_eagerly():
            return False
        if callable(self._learning_rate) and not isinstance(
            self._learning_rate,
            keras.Variable | keras.optimizers.schedules.LearningRateSchedule,
        ):
            # A plain callable is Python: a compiled step would freeze the
            # value it returned when the step was traced.
            return False
        if tf.distribute.has_strategy():
            strategy = tf.distribute.get_strategy()
            if strategy.num_replicas_in_sync > 1:
                return False
        return True

    # ---------------------------------------------------------- serialization
    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "momentum": self.momentum,
                "weight_decay": self.weight_decay,
                "trust_coefficient": self.trust_coefficient,
                "epsilon": self.epsilon,
                "nesterov": self.nesterov,
                "classic_momentum": self.classic_momentum,
                "trust_ratio": self.trust_ratio,
                "decay_in_gradient": self.decay_in_gradient,
                "trust_clip": self.trust_clip,
                "exclude_from_weight_decay": list(self._weight_decay_exclusions)
                or None,
                "exclude_from_layer_adaptation": (
                    None
                    if self._adaptation_exclusions_given is None
                    else list(self._layer_adaptation_exclusions)
                ),
            }
        )
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Creates a `LARS` from `get_config()` output.

        Raises:
            ValueError: if the config holds a key that is not a constructor
                argument.
        """
        known = set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}
        unknown = sorted(set(config) - known)
        if unknown:
            received = {key: config[key] for key in unknown}
            raise ValueError(
                f"Unknown key(s) in {cls.__name__} config: {unknown}. "
                f"Received: {received}. Valid keys: {sorted(known)}"
            )
        return super().from_config(dict(config), custom_objects=custom_objects)


LARS.__doc__ = LARS.__doc__.replace(
    "{{base_optimizer_keyword_args}}",
    keras.src.optimizers.optimizer.base_optimizer_keyword_args,
)
