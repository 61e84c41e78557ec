"""Which variables an exclusion list names (shared by LARS and TrustRatio).

An exclusion list is a tuple of regular expressions searched (`re.search`) in
each variable's path (Keras 3: `"dense/kernel"`), plus the token `"<1d>"`
(`ALL_1D`) that names every variable of rank 0 or 1. Lists are resolved once,
in `build()`, from the Keras variables: on the TensorFlow backend
`update_step` receives the backing `tf.Variable`, which has no path.
"""

import re

import keras
import numpy as np

from tf_lars import _internals

#: Entry for `exclude_from_weight_decay` / `exclude_from_layer_adaptation`
#: that matches every variable of rank 0 or 1 (biases, normalization scales
#: and offsets). It cannot collide with a real variable path.
ALL_1D = "<1d>"

#: Attribute that tf_lars sets on variables standing in for a model variable
#: (AGN's center and worker-local copies): the model variable's path, so that
#: exclusions written against model paths apply to the copies too.
SOURCE_PATH_ATTRIBUTE = "_tf_lars_source_path"


def check_patterns(name, value):
    """Normalizes an exclusion list to a tuple of valid regexes, or a callable.

    A callable (optax's masks, ported: `lambda v: not mask(v)`) is kept as
    it is: it is called with each Keras variable in `build()` and returns
    whether that variable is excluded. A serialized function (what
    `get_config()` writes for one) is deserialized.

    Raises:
        ValueError: naming `name` and the received value, if `value` is not
            None, a string, a list of strings that compile as regexes, or a
            callable.
    """
    if value is None:
        return ()
    if isinstance(value, dict) and value.get("class_name") == "function":
        value = keras.saving.deserialize_keras_object(value)
    if callable(value):
        return value
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple):
        raise ValueError(
            f"`{name}` must be None, a string, a list of strings (regular "
            f"expressions matched against `variable.path`) or a callable of "
            f"the variable. "
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


def variable_path(variable):
    """The path exclusions are matched against.

    A stand-in's source path, else `variable.path`, else (a bare
    `tf.Variable`) its name without the `:0` suffix.
    """
    path = getattr(variable, SOURCE_PATH_ATTRIBUTE, None) or getattr(
        variable, "path", None
    )
    if path is None:
        path = variable.name.split(":")[0]
    return path


def mark_stand_in(copy, reference):
    """Marks `copy` as standing in for the model variable `reference`.

    Copies (AGN's center and local variables) have paths of their own; the
    mark lets an inner optimizer resolve exclusions against the model
    variable's path, as for the model's own optimizer. Returns `copy`.
    """
    path = getattr(reference, SOURCE_PATH_ATTRIBUTE, None) or getattr(
        reference, "path", None
    )
    if path is not None:
        setattr(copy, SOURCE_PATH_ATTRIBUTE, path)
    return copy


def matches(patterns, variable, name="exclusions"):
    """Whether any entry of `patterns` names `variable` (or, for a callable,
    whether it returns True for it; `name` is the argument, for its error)."""
    if callable(patterns):
        excluded = patterns(variable)
        if not isinstance(excluded, bool | np.bool_):
            raise ValueError(
                f"`{name}` must return a bool for each variable. Received: "
                f"{excluded!r} for the variable {variable_path(variable)!r}"
            )
        return bool(excluded)
    path = variable_path(variable)
    for pattern in patterns:
        if pattern == ALL_1D:
            if len(variable.shape) <= 1:
                return True
        elif re.search(pattern, path):
            return True
    return False


class LayerwiseExclusions:
    """Mixin: the two exclusion lists of LARS and TrustRatio, one way.

    `exclude_from_layer_adaptation=None` means "the weight-decay list";
    lists are checked at construction, resolved per variable in `build()`
    (the backing `tf.Variable` that `update_step` sees has no path), and the
    per-step trust ratios are recorded in an optimizer variable.
    """

    def _init_exclusions(
        self, exclude_from_weight_decay, exclude_from_layer_adaptation
    ):
        # Stored privately: the Keras base class owns a method called
        # `exclude_from_weight_decay` and a `_exclude_from_weight_decay` set.
        self._weight_decay_exclusions = check_patterns(
            "exclude_from_weight_decay", exclude_from_weight_decay
        )
        self._adaptation_exclusions_given = exclude_from_layer_adaptation
        self._layer_adaptation_exclusions = (
            self._weight_decay_exclusions
            if exclude_from_layer_adaptation is None
            else check_patterns(
                "exclude_from_layer_adaptation", exclude_from_layer_adaptation
            )
        )

    def _resolve_exclusions(self, variables):
        """Per-variable decay and adaptation, and the `trust_ratios` record."""
        _internals.check_hooks(type(self).__name__)
        self._variable_weight_decay = [
            self.weight_decay
            if _internals.uses_weight_decay(self, v)
            and not matches(
                self._weight_decay_exclusions, v, "exclude_from_weight_decay"
            )
            else 0.0
            for v in variables
        ]
        self._variable_adapted = [
            not matches(
                self._layer_adaptation_exclusions, v, "exclude_from_layer_adaptation"
            )
            for v in variables
        ]
        self.trust_ratio_paths = [variable_path(v) for v in variables]
        self.trust_ratios = self.add_variable(
            shape=(len(variables),),
            initializer="ones",
            dtype="float32",
            aggregation="only_first_replica",
            name="trust_ratios",
        )

    def _exclusions_config(self):
        """The two constructor arguments, as `get_config()` reports them.

        A callable is written as Keras serializes a function: by its
        registered name (`keras.saving.register_keras_serializable`), which
        is what loading it needs.
        """
        return {
            "exclude_from_weight_decay": _config_of(self._weight_decay_exclusions)
            or None,
            "exclude_from_layer_adaptation": (
                None
                if self._adaptation_exclusions_given is None
                else _config_of(self._layer_adaptation_exclusions)
            ),
        }


def _config_of(exclusions):
    if callable(exclusions):
        return keras.saving.serialize_keras_object(exclusions)
    return list(exclusions)
