"""What tf_lars's optimizer wrappers (`LossScaleOptimizer`, `AGN`,
`TrustRatio`) share."""

import inspect
import sys
import weakref

import keras
from keras import ops

from tf_lars import _internals

#: Keras base optimizer arguments and their defaults. Wrappers leave them to
#: the inner optimizer; configs written by other tools carry them at these
#: defaults, so only these values are accepted (and dropped) on a wrapper.
BASE_ARGUMENT_DEFAULTS = {
    "weight_decay": None,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}


def pop_inner_arguments(owner, kwargs, defaults):
    """Pops the arguments of `defaults` from `kwargs`, refusing one set away
    from its default: it belongs on the inner optimizer. `learning_rate`
    may also be None or 0.0 (Keras's placeholder in configs)."""
    for name in defaults.keys() & kwargs.keys():
        value = kwargs.pop(name)
        accepted = (None, 0.0) if name == "learning_rate" else ()
        if value not in (*accepted, defaults[name]):
            raise ValueError(
                f"`{name}` is not supported by {owner}; set it on "
                f"`inner_optimizer`. Received: {name}={value!r}"
            )


def on_tensorflow():
    """Whether Keras runs on its TensorFlow backend."""
    return keras.backend.backend() == "tensorflow"


def require_built(optimizer):
    """`apply(grads)` without variables: refused until `optimizer` is built
    (the same rule and message as Keras's own `apply`)."""
    if not optimizer.built:
        raise ValueError(
            "When passing `grads` without `trainable_variables`, the "
            "optimizer must already be built. Call "
            "`optimizer.build(trainable_variables)` first."
        )


def is_indexed_slices(value):
    """Whether `value` is a `tf.IndexedSlices`, without importing TensorFlow.

    If TensorFlow was never imported, nothing can be one.
    """
    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(value, tf.IndexedSlices)


def all_finite(gradients):
    """A scalar bool tensor: every entry of every gradient is finite.

    Sparse gradients are checked on their values, never densified. The result
    is a tensor, so the decision stays on device (under `tf.function` / XLA
    and `jax.jit` too).
    """
    checks = [
        ops.all(ops.isfinite(g.values if is_indexed_slices(g) else g))
        for g in gradients
        if g is not None
    ]
    return ops.all(ops.stack(checks)) if checks else ops.convert_to_tensor(True)


def gradient_as_tensor(gradient):
    """`gradient` as a backend tensor, or as `tf.IndexedSlices` of tensors.

    Python lists, NumPy arrays and tuple indices (as in
    `tf.IndexedSlices(values, (0, 2, 4), (5, 10))`) are converted, so that a
    compiled step sees one signature per variable list instead of re-tracing
    (or failing to trace) on every call. `None` stays `None`.
    """
    if gradient is None:
        return gradient
    if not on_tensorflow():
        return ops.convert_to_tensor(gradient)
    import tensorflow as tf

    if isinstance(gradient, tf.IndexedSlices):
        dense_shape = gradient.dense_shape
        return tf.IndexedSlices(
            tf.convert_to_tensor(gradient.values),
            tf.convert_to_tensor(gradient.indices),
            None if dense_shape is None else tf.convert_to_tensor(dense_shape),
        )
    return tf.convert_to_tensor(gradient)


def refuse_outer_loss_scale(wrapper):
    """Refuses a loss scale around `wrapper` (AGN, DiLoCo) when its inner
    optimizer is a loss scale already, in one `ValueError`; called first in
    the wrapper's `build`.

    Keras's `LossScaleOptimizer` (the one `model.compile` adds around any
    optimizer that is not one under the mixed_float16 policy, and tf_lars's
    subclass) would unscale every gradient before the inner loss scale
    unscales it again: steps `scale` times too small. Keras builds its inner
    optimizer from its own `build`, which is where the nesting is seen
    (`building_loss_scale`).
    """
    inner = wrapper.inner_optimizer
    if not isinstance(inner, keras.optimizers.LossScaleOptimizer):
        return
    if building_loss_scale(wrapper) is not None:
        kind = type(wrapper).__name__
        raise ValueError(
            f"{kind}'s `inner_optimizer` is a loss-scale optimizer already, "
            f"so a second one around {kind} (as `model.compile` adds under "
            "the mixed_float16 policy) would unscale the gradients twice. "
            "Compile with `auto_scale_loss=False` (the model then calls "
            f"{kind}.scale_loss, which is the inner loss scale's). "
            f"Received: {kind}({type(inner).__name__}(...)) inside "
            "another loss-scale optimizer"
        )


def building_loss_scale(optimizer):
    """The Keras `LossScaleOptimizer` whose `build` is building `optimizer`
    now, or None: a loss scale around DiLoCo/AGN would unscale twice. Keras
    3.15 resets `inner.loss_scale_factor`, 3.8 does not; every release
    builds its inner optimizer from its `build`, so the frames are read."""
    frame = inspect.currentframe().f_back
    for _ in range(8):  # the wrapper's build and a decorator or two above it
        frame = frame.f_back if frame is not None else None
        owner = frame.f_locals.get("self") if frame is not None else None
        if (
            isinstance(owner, keras.optimizers.LossScaleOptimizer)
            and getattr(owner, "inner_optimizer", None) is optimizer
        ):
            return owner
    return None


def wrapped_chain(optimizer):
    """`optimizer`, then each optimizer it wraps (`inner_optimizer`), in turn."""
    while optimizer is not None:
        yield optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)


#: optimizer -> the variables `track_attribute_variables` tracked for it.
_ADOPTED = weakref.WeakKeyDictionary()


def track_attribute_variables(optimizer, model_variables=()):
    """Tracks as state every `keras.Variable` that `optimizer`, or an
    optimizer it wraps, keeps in a plain attribute but not in `variables`.

    Keras's `Nadam` keeps `_u_product` so: Keras tracks it only while its
    automatic tracking is on, which Keras's `LossScaleOptimizer.build` and
    AGN's turn off as they build the optimizers they hold. Untracked, it was
    not saved or restored, `stateless_apply` dropped its writes and a skipped
    step did not undo them. Called after each build of a held optimizer; the
    model's `model_variables` are never adopted.
    """
    model = {id(v) for v in model_variables}
    model |= {id(getattr(v, "value", v)) for v in model_variables}
    for one in wrapped_chain(optimizer):
        known = {id(v) for v in one.variables}
        for value in list(vars(one).values()):
            if isinstance(value, keras.Variable) and not {id(value)} & (known | model):
                _internals.track_variable(one, value)
                _ADOPTED.setdefault(one, []).append(value)
                known.add(id(value))


def load_variables(optimizer, store, load):
    """`load(store)`, or, for a file saved before `track_attribute_variables`
    (tf_lars 0.2.x), every variable but the adopted ones by their old
    positions: those keep their initial values, as such a file's optimizer
    did when it was loaded then."""
    adopted = set()
    for one in [optimizer, *_held(optimizer)]:
        adopted |= {id(v) for v in _ADOPTED.get(one, ())}
    kept = [v for v in optimizer.variables if id(v) not in adopted]
    if not adopted or len(store.keys()) != len(kept):
        return load(store)
    for position, variable in enumerate(kept):
        variable.assign(store[str(position)])


def _held(optimizer):
    """The optimizers `optimizer` holds (inner, outer, center), recursively."""
    held = []
    for name in ("inner_optimizer", "outer_optimizer", "_center_optimizer"):
        one = getattr(optimizer, name, None)
        if isinstance(one, keras.optimizers.Optimizer):
            held += [one, *_held(one)]
    return held


def backing_variable(variable):
    """The `tf.Variable` behind a Keras variable (the strategy's
    `extended.update` needs it); a `tf.Variable` passes through."""
    tf = sys.modules.get("tensorflow")
    if tf is not None and not isinstance(variable, tf.Variable):
        return variable.value
    return variable


class InnerOptimizerWrapper:
    """Mixin for optimizers built around an `inner_optimizer`.

    Serializes the inner optimizer with `keras.saving.serialize_keras_object`
    (so its class and config round-trip, `tf_lars.LARS` included) and refuses
    `stateless_apply` on the TensorFlow backend, whose optimizers write their
    variables directly. Put it first in the bases so that it overrides the
    Keras optimizer's versions.
    """

    #: The marker `TrustRatio` refuses an inner optimizer by: a wrapper's
    #: step is a whole optimizer's (loss scale, AGN) or already adapted
    #: layer-wise (TrustRatio, LAMB), not one direction per variable. LARS
    #: sets it too. Foreign optimizers never have it.
    takes_no_trust_ratio = True

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        """`apply` on given values: returns the new model and optimizer
        values (Keras's own, the base optimizer's: our `apply` in a
        stateless scope), as the JAX trainer calls it, under `jax.jit` or
        not. Refused on TensorFlow, as for every Keras optimizer there."""
        if on_tensorflow():
            raise ValueError(
                "`stateless_apply` is not supported with the TensorFlow backend; "
                "use `apply`."
            )
        return keras.optimizers.Optimizer.stateless_apply(
            self, optimizer_variables, grads, trainable_variables
        )

    def load_own_variables(self, store):
        # A file saved before an inner optimizer's attribute variables were
        # tracked (tf_lars 0.2.x) loads without them.
        load_variables(self, store, super().load_own_variables)

    def _wrapper_config(self, **arguments):
        """The config: the serialized inner optimizer, `arguments`, the name.

        Not `super().get_config()`: a wrapper has none of the base
        optimizer's hyperparameters.
        """
        return {
            "inner_optimizer": _internals.portable_optimizer_config(
                self.inner_optimizer
            ),
            **arguments,
            "name": self.name,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner_optimizer = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner_optimizer, **config)


class InnerOwnsTheRate:
    """Mixin for a wrapper whose inner optimizer owns the learning rate and
    whose variables are its own followed by the inner optimizer's
    (`TrustRatio`, `GradientNoiseScale`). Put it before
    `keras.optimizers.Optimizer` in the bases."""

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
