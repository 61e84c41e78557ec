"""Which variables an exclusion list names (shared by LARS and TrustRatio).

An exclusion list is a tuple of regular expressions searched (`re.search`) in
each variable's path (Keras 3: `"dense/kernel"`), plus the token `"<1d>"`
(`ALL_1D`) that names every variable of rank 0 or 1. Lists are resolved once,
in `build()`, from the Keras variables: on the TensorFlow backend
`update_step` receives the backing `tf.Variable`, which has no path.
"""

import re

#: Entry for `exclude_from_weight_decay` / `exclude_from_layer_adaptation`
#: that matches every variable of rank 0 or 1 (biases, normalization scales
#: and offsets). It cannot collide with a real variable path.
ALL_1D = "<1d>"

#: Attribute that tf_lars sets on variables standing in for a model variable
#: (AGN's center and worker-local copies): the model variable's path, so that
#: exclusions written against model paths apply to the copies too.
SOURCE_PATH_ATTRIBUTE = "_tf_lars_source_path"


def check_patterns(name, value):
    """Normalizes an exclusion list to a tuple of valid regexes.

    Raises:
        ValueError: naming `name` and the received value, if `value` is not
            None, a string or a list of strings that compile as regexes.
    """
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


def matches(patterns, variable):
    """Whether any entry of `patterns` names `variable`."""
    path = variable_path(variable)
    for pattern in patterns:
        if pattern == ALL_1D:
            if len(variable.shape) <= 1:
                return True
        elif re.search(pattern, path):
            return True
    return False
