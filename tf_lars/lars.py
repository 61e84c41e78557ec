"""Layer-wise Adaptive Rate Scaling (LARS) for Keras 3, on every backend.

The rule is docs/algorithms.md, section "LARS": `LARS.update_step` is the
whole rule for one variable, in `keras.ops`; `apply` takes step 2 (trust
ratio) of every variable first (`LARS._trust_ratios`, one norms call) and
hands each its ratio.
On the TensorFlow backend `tf_lars.LARS(...)` constructs the subclass in
`tf_lars/backend/tensorflow.py` (fused kernels, sparse rows, replicas).
"""

import keras
from keras import ops

from tf_lars import _internals, _trust
from tf_lars._exclusions import (
    ALL_1D,
    SOURCE_PATH_ATTRIBUTE,
    LayerwiseExclusions,
)
from tf_lars._validation import (
    ShapeCheckedApply,
    check_base_arguments,
    check_bool,
    check_choice,
    check_config_keys,
    check_learning_rate,
    check_number,
)
from tf_lars.backend import BackendSubclass

__all__ = ["ALL_1D", "LARS", "SOURCE_PATH_ATTRIBUTE"]


@keras.saving.register_keras_serializable(package="tf_lars")
class LARS(
    BackendSubclass, ShapeCheckedApply, LayerwiseExclusions, keras.optimizers.Optimizer
):
    """Layer-wise Adaptive Rate Scaling (LARS).

    Each dense variable gets its own trust ratio from the norms of the
    variable and its gradient, so that every layer moves by a similar
    fraction of its size whatever the batch size; sparse `tf.IndexedSlices`
    gradients (embeddings) update only the touched rows, without trust ratio
    or weight decay. The rule, every flag, and the published variants the
    flags reproduce (You et al. 2017, TF contrib, TF Model Garden, optax,
    MXNet, timm/apex LARC) are stated once, in docs/algorithms.md, section
    "LARS".

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
        exclude_from_weight_decay: list of str, callable or None. Regular
            expressions searched (`re.search`) in each `variable.path`
            (e.g. `"dense/bias"`); matching variables get no weight decay.
            The entry `"<1d>"` (`tf_lars.lars.ALL_1D`) matches every variable
            of rank <= 1. A callable takes the Keras variable and returns
            True to exclude it. Defaults to `None`.
        exclude_from_layer_adaptation: list of str, callable or None. Same
            form; matching variables use `T = 1`. Defaults to `None`, which
            means the same list as `exclude_from_weight_decay` (the Model
            Garden convention; optax's two masks are independent: see
            docs/algorithms.md, "Exclusion lists and masks"); pass `[]` to
            adapt every variable.
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
        name: str or None. The optimizer's name, which prefixes its slot
            variables. Defaults to `None` (Keras picks `"lars"`, `"lars_1"`,
            ...).
        **kwargs: other arguments of `keras.optimizers.Optimizer`.

    Besides the constructor arguments, `jit_compile` (attribute, default
    `True`) makes an eager `optimizer.apply(...)` run as one XLA-compiled
    function instead of op by op; inside `tf.function`, `model.fit` and
    multi-replica strategies it has no effect; a learning rate or a
    hyperparameter set between steps is read, as op by op (the function is
    traced again), while each variable's weight decay and exclusions are
    resolved once, when the optimizer is built. After the first step,
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

    Examples:
        >>> import keras, tf_lars
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> optimizer = tf_lars.LARS(
        ...     learning_rate=1.0, weight_decay=1e-4, trust_coefficient=0.02,
        ...     exclude_from_weight_decay=[tf_lars.lars.ALL_1D])
        >>> model.compile(optimizer=optimizer, loss="mse")
    """

    #: `TrustRatio` refuses LARS as its inner optimizer (two trust ratios).
    takes_no_trust_ratio = True

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
        name=None,
        **kwargs,
    ):
        super().__init__(
            learning_rate=check_learning_rate(learning_rate),
            weight_decay=None,  # LARS's decay is coupled: see `update_step`.
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
        self.momentum = check_number("momentum", momentum, low=0.0, high=1.0)
        self.weight_decay = check_number("weight_decay", weight_decay, low=0.0)
        self.trust_coefficient = check_number(
            "trust_coefficient", trust_coefficient, low=0.0, low_inclusive=False
        )
        self.epsilon = check_number("epsilon", epsilon, low=0.0)
        self.nesterov = check_bool("nesterov", nesterov)
        self.classic_momentum = check_bool("classic_momentum", classic_momentum)
        self.trust_ratio = check_choice(
            "trust_ratio", trust_ratio, ("paper", "decayed")
        )
        self.decay_in_gradient = check_bool("decay_in_gradient", decay_in_gradient)
        self.trust_clip = check_bool("trust_clip", trust_clip)
        self._init_exclusions(exclude_from_weight_decay, exclude_from_layer_adaptation)
        self.jit_compile = True  # read by the TensorFlow subclass's eager apply

    def build(self, variables):
        """Creates the momentum slots and resolves per-variable exclusions."""
        if self.built:
            return
        super().build(variables)
        self.momentums = []
        if self.momentum != 0:
            self.momentums = _add_optimizer_variables(self, variables, "momentum")
        self._resolve_exclusions(variables)

    def _apply_weight_decay(self, variables):
        # Coupled (steps 1 and 2 (decay in the gradient, trust ratio)).
        return

    def _get_current_learning_rate(self):
        # A schedule at the count of updates, not of micro-batches: Keras's
        # own calls a schedule with `iterations`, which counts micro-batches
        # when `gradient_accumulation_steps = k` is set (Keras 3.8 to 3.15),
        # so it would run k times too fast. Called here with
        # `iterations // k`, the updates taken so far, k accumulated
        # micro-batches take the step one big batch would.
        setting = _internals.learning_rate_setting(self)
        steps = self.gradient_accumulation_steps
        if steps and isinstance(
            setting, keras.optimizers.schedules.LearningRateSchedule
        ):
            micro_steps = _internals.iterations_variable(self)
            return setting(ops.floor_divide(micro_steps, steps))
        return super()._get_current_learning_rate()

    # ------------------------------------------------------- the update rule
    def _decayed(self, gradient, variable, decay):
        """`g + wd w`, for the norm of step 2 (trust ratio)."""
        return gradient + ops.convert_to_tensor(decay, gradient.dtype) * variable

    def _trust_ratios(self, grads, variables):
        """Step 2 (trust ratio) for every dense gradient at once: one `norms`
        and one `trust_ratio` call per compute dtype. Returns each variable's
        ratio (`None`: sparse) and the float32 vector `trust_ratios` records
        (1 where sparse or excluded), built from the ratio vectors."""
        indices = [_internals.variable_index(self, v) for v in variables]
        ratios = [None] * len(variables)
        recorded = ops.ones([len(variables)], "float32")
        adapted = {}
        for position, (grad, variable) in enumerate(zip(grads, variables, strict=True)):
            if not self._is_dense(grad):
                continue
            dtype = _trust.compute_dtype(variable.dtype)
            if self._variable_adapted[indices[position]]:
                adapted.setdefault(dtype, []).append(position)
            else:
                ratios[position] = ops.ones((), dtype)
        for dtype, positions in adapted.items():
            decays = [self._variable_weight_decay[indices[p]] for p in positions]
            weights = [ops.cast(variables[p], dtype) for p in positions]
            grads_in_norm = [ops.cast(grads[p], dtype) for p in positions]
            if self.trust_ratio == "decayed" and self.decay_in_gradient:
                # |g'| with g' = g + wd w (step 1 (decay in the gradient)).
                grads_in_norm = [
                    self._decayed(g, w, decay) if decay != 0.0 else g
                    for g, w, decay in zip(grads_in_norm, weights, decays, strict=True)
                ]
            both = self._norms(weights + grads_in_norm)
            w_norm, g_norm = both[: len(positions)], both[len(positions) :]
            if self.trust_ratio == "paper":  # |g| + wd |w|
                update_norm = g_norm + ops.convert_to_tensor(decays, dtype) * w_norm
            else:  # |g'|
                update_norm = g_norm
            vector = _trust.trust_ratio(
                w_norm,
                update_norm,
                self.trust_coefficient,
                self.epsilon,
                defined=ops.logical_and(w_norm > 0, g_norm > 0),
            )
            for position, ratio in zip(
                positions, self._entries(vector, weights), strict=True
            ):
                ratios[position] = ratio
            recorded = _trust.placed(recorded, positions, ops.cast(vector, "float32"))
        return ratios, recorded

    def update_step(self, gradient, variable, learning_rate, ratio=None):
        """Steps 1 to 4 (decay in the gradient, trust ratio, local rate,
        momentum) for one variable (the TensorFlow subclass takes step 5
        (sparse gradients)).

        `ratio` is the variable's step 2 (trust ratio) when
        `_backend_update_step` took every variable's at once (one `norms`
        call); `None` takes it here, for this variable alone.
        """
        index = _internals.variable_index(self, variable)
        slot = self.momentums[index] if self.momentum != 0 else None
        dtype = variable.dtype
        # Step 2 (trust ratio) reads the gradient as given (the "decayed"
        # ratio computes the `g + wd w` of step 1 (decay in the gradient)
        # itself).
        if ratio is None:
            ratio = self._trust_ratios([gradient], [variable])[0][0]
        # Step 1 (decay in the gradient): coupled weight decay.
        gradient = ops.cast(gradient, dtype)
        decay = self._variable_weight_decay[index]
        if self.decay_in_gradient and decay != 0.0:
            gradient = gradient + ops.convert_to_tensor(decay, dtype) * variable
        # Step 3 (local rate).
        learning_rate = ops.cast(learning_rate, ratio.dtype)
        if self.trust_clip and self._variable_adapted[index]:
            rate = ops.cast(ops.minimum(ratio, learning_rate), dtype)
        else:
            rate = ops.cast(learning_rate * ratio, dtype)
        # Step 4 (momentum).
        if slot is None:
            self.assign_sub(variable, rate * gradient)
        elif self.classic_momentum:  # v <- mu v + r g';  w <- w - v
            self._momentum_step(variable, slot, rate * gradient, ops.ones((), dtype))
        else:  # v <- mu v + g';  w <- w - r v
            self._momentum_step(variable, slot, gradient, rate)

    def _momentum_step(self, variable, slot, gradient, rate):
        """`v <- mu v + gradient; w <- w - rate v` (Nesterov: `w <- w - rate
        (gradient + mu v)` with the new `v`); `gradient` and the scalar
        `rate` in the variable's dtype."""
        mu = ops.convert_to_tensor(self.momentum, variable.dtype)
        velocity = mu * ops.convert_to_tensor(slot) + gradient
        self.assign(slot, velocity)
        if self.nesterov:
            self.assign_sub(variable, rate * (gradient + mu * velocity))
        else:
            self.assign_sub(variable, rate * velocity)

    def _is_dense(self, gradient):
        # Only TensorFlow has sparse gradients (its subclass overrides this).
        return True

    def _norms(self, tensors):
        return _trust.norms(tensors)

    def _entries(self, vector, tensors):
        return _trust.entries(vector, tensors)

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        # Step 2 (trust ratio) for every variable, then for each steps 1, 3
        # and 4 (decay in the gradient, local rate, momentum).
        ratios, recorded = self._trust_ratios(grads, trainable_variables)
        self._record_trust_ratios(trainable_variables, recorded)
        for gradient, variable, ratio in zip(
            grads, trainable_variables, ratios, strict=True
        ):
            self.update_step(gradient, variable, learning_rate, ratio=ratio)

    def _record_trust_ratios(self, variables, recorded):
        _trust.record_trust_ratios(
            self, [_internals.variable_index(self, v) for v in variables], recorded
        )

    # --------------------------------------------------------- serialization
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
                **self._exclusions_config(),
            }
        )
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Creates a `LARS` from `get_config()` output; unknown keys raise."""
        check_config_keys(cls, config)
        return super().from_config(dict(config), custom_objects=custom_objects)


def _add_optimizer_variables(optimizer, variables, name, initializer="zeros"):
    """`Optimizer.add_optimizer_variables` (Keras 3.11+); before it, one
    `add_variable_from_reference` per variable."""
    add = getattr(optimizer, "add_optimizer_variables", None)
    if add is not None:
        return add(variables, name, initializer=initializer)
    return [
        optimizer.add_variable_from_reference(v, name=name, initializer=initializer)
        for v in variables
    ]
