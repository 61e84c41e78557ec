"""Loading and validating `tf-lars` YAML configs (private to the CLI).

A config is the embedded default (`tf_lars/configs/<command>.yaml`) with the
user's `--config` file merged over it block by block, then `--set key=value`
overrides applied, then the whole tree validated against a schema. Every
problem is a `ConfigError` whose one-line message names the dotted key.

Two rules on merging: an `optimizer` block given by the user replaces the
default one as a whole (its `config` holds one optimizer class's constructor
arguments, which do not mix with another class's), and lists replace lists.
"""

import copy
import importlib.resources
import inspect
import math
import re

import yaml

from tf_lars._validation import is_int, is_real

__all__ = [
    "ConfigError",
    "apply_overrides",
    "default_config",
    "load_config",
    "optimizer_from_block",
    "resolve_optimizer_class",
]


class ConfigError(ValueError):
    """A config value the CLI refuses; the message is one line for the user."""


# PyYAML follows YAML 1.1, where `1e-4` is a string; every user types it
# expecting a float, so such scalars resolve to floats here.
class _Loader(yaml.SafeLoader):
    pass


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def parse_yaml(text, source):
    """Parses YAML text with `1e-4` read as a float."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as error:
        detail = " ".join(str(error).split())
        raise ConfigError(f"{source}: not valid YAML: {detail}") from None


def default_config_text(command):
    """The text of the embedded default config of `command` ("train"/"sweep")."""
    return (
        importlib.resources.files("tf_lars")
        .joinpath("configs", f"{command}.yaml")
        .read_text(encoding="utf-8")
    )


def default_config(command):
    """The embedded default config of `command`, as a dict (not validated)."""
    return parse_yaml(default_config_text(command), f"default {command}.yaml")


# ----------------------------------------------------------------- value specs
def _show(key, value):
    return f"Received: {key}={value!r}"


class Int:
    def __init__(self, low=None, high=None, nullable=False, words=()):
        self.low, self.high, self.nullable, self.words = low, high, nullable, words

    def describe(self):
        text = "an int"
        if self.low is not None and self.high is not None:
            text += f" in [{self.low}, {self.high}]"
        elif self.low is not None:
            text += f" >= {self.low}"
        for word in self.words:
            text += f" or {word!r}"
        if self.nullable:
            text += " or null"
        return text

    def check(self, key, value):
        if value is None and self.nullable:
            return None
        if isinstance(value, str) and value in self.words:
            return value
        if (
            not is_int(value)
            or (self.low is not None and value < self.low)
            or (self.high is not None and value > self.high)
        ):
            raise ConfigError(f"`{key}` must be {self.describe()}. {_show(key, value)}")
        return int(value)


class Float:
    def __init__(
        self, low=None, high=None, low_open=False, high_open=False, nullable=False
    ):
        self.low, self.high = low, high
        self.low_open, self.high_open = low_open, high_open
        self.nullable = nullable

    def describe(self):
        if self.low is not None and self.high is not None:
            left = "(" if self.low_open else "["
            right = ")" if self.high_open else "]"
            text = f"a finite number in {left}{self.low}, {self.high}{right}"
        elif self.low is not None:
            text = f"a finite number {'>' if self.low_open else '>='} {self.low}"
        else:
            text = "a finite number"
        return text + (" or null" if self.nullable else "")

    def check(self, key, value):
        if value is None and self.nullable:
            return None
        ok = is_real(value) and math.isfinite(value)
        if ok and self.low is not None:
            ok = value > self.low if self.low_open else value >= self.low
        if ok and self.high is not None:
            ok = value < self.high if self.high_open else value <= self.high
        if not ok:
            raise ConfigError(f"`{key}` must be {self.describe()}. {_show(key, value)}")
        return float(value)


class Bool:
    def __init__(self, words=()):
        self.words = words

    def check(self, key, value):
        if isinstance(value, bool) or (isinstance(value, str) and value in self.words):
            return value
        extra = "".join(f" or {word!r}" for word in self.words)
        raise ConfigError(f"`{key}` must be true or false{extra}. {_show(key, value)}")


class Str:
    def __init__(self, choices=None, nullable=False):
        self.choices, self.nullable = choices, nullable

    def check(self, key, value):
        if value is None and self.nullable:
            return None
        if not isinstance(value, str) or (
            self.choices is not None and value not in self.choices
        ):
            rule = (f"one of {list(self.choices)}" if self.choices else "a string") + (
                " or null" if self.nullable else ""
            )
            raise ConfigError(f"`{key}` must be {rule}. {_show(key, value)}")
        return value


class ListOf:
    def __init__(self, item, min_length=1):
        self.item, self.min_length = item, min_length

    def check(self, key, value):
        if not isinstance(value, list) or len(value) < self.min_length:
            raise ConfigError(
                f"`{key}` must be a list of at least {self.min_length} item(s). "
                f"{_show(key, value)}"
            )
        return [_check(f"{key}.{i}", self.item, item) for i, item in enumerate(value)]


class OptimizerBlock:
    """`{class_name, config}`: `keras.optimizers.serialize(optimizer)` output.

    `config` is the optimizer's `get_config()`; omitted arguments take the
    constructor's defaults. `module` and `registered_name` (present in
    `keras.saving.serialize_keras_object` output) are accepted and used to
    find the class.
    """

    _keys = ("class_name", "config", "module", "registered_name")

    def check(self, key, value):
        if not isinstance(value, dict):
            raise ConfigError(
                f"`{key}` must be a mapping with `class_name` and `config`. "
                f"{_show(key, value)}"
            )
        for name in value:
            if name not in self._keys:
                raise ConfigError(
                    f"Unknown config key `{key}.{name}`. Valid keys in `{key}`: "
                    f"{', '.join(self._keys)}"
                )
        if "class_name" not in value:
            raise ConfigError(f"`{key}.class_name` is missing (e.g. LARS, SGD, Adam)")
        block = dict(value)
        block.setdefault("config", {})
        if block["config"] is None:
            block["config"] = {}
        if not isinstance(block["config"], dict):
            raise ConfigError(
                f"`{key}.config` must be a mapping of constructor arguments. "
                f"{_show(key + '.config', block['config'])}"
            )
        cls = resolve_optimizer_class(block, key)
        _check_optimizer_arguments(cls, block["config"], f"{key}.config")
        return block


def _check(key, spec, value):
    if isinstance(spec, dict):
        return _check_block(key, spec, value)
    return spec.check(key, value)


def _check_block(key, schema, value):
    where = f"`{key}`" if key else "the config"
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping. {_show(key or 'config', value)}")
    for name in value:
        if name not in schema:
            raise ConfigError(
                f"Unknown config key `{_join(key, name)}`. Valid keys in {where}: "
                f"{', '.join(schema)}"
            )
    result = {}
    for name, spec in schema.items():
        if name not in value:
            raise ConfigError(f"Config key `{_join(key, name)}` is missing")
        result[name] = _check(_join(key, name), spec, value[name])
    return result


def _join(prefix, name):
    return f"{prefix}.{name}" if prefix else str(name)


# ------------------------------------------------------------------- schemas
_DATA = {
    # null = scikit-learn's digits; a path = an .npz with x_train, y_train,
    # x_test, y_test.
    "path": Str(nullable=True),
    "test_fraction": Float(0.0, 1.0, low_open=True, high_open=True),
    "split_seed": Int(low=0),
    "num_classes": Int(low=2, nullable=True),
}
_MODEL = {
    "name": Str(choices=("cnn", "mlp")),
    "width": Int(low=1),
}
_SCHEDULE = {
    "warmup_epochs": Float(low=0.0),
    "end_learning_rate": Float(low=0.0),
    "power": Float(low=0.0, low_open=True),
}
_LOSS_SCALE = {
    "enabled": Bool(),
    "dynamic": Bool(),
    "initial_scale": Float(low=0.0, low_open=True),
    "dynamic_growth_steps": Int(low=1),
}
_PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")

# Keys that `train` and `sweep` configs share, in this order.
_COMMON = {
    "seed": Int(low=0),
    "output_dir": Str(),
    "run_name": Str(nullable=True),
    "data": _DATA,
    "model": _MODEL,
}

TRAIN_SCHEMA = {
    **_COMMON,
    "training": {
        "epochs": Int(low=1),
        "batch_size": Int(low=1, words=("full",)),
        "precision": Str(choices=_PRECISIONS),
        "jit_compile": Bool(words=("auto",)),
        "verbose": Int(low=0, high=2),
    },
    "schedule": {
        "name": Str(choices=("warmup_polynomial_decay", "none")),
        **_SCHEDULE,
        "base_batch_size": Int(low=1, nullable=True),
    },
    "optimizer": OptimizerBlock(),
    "loss_scale": _LOSS_SCALE,
    "monitor": {
        "log_every_n_batches": Int(low=1, nullable=True),
        "tensorboard": Bool(),
    },
}

SWEEP_SCHEMA = {
    **_COMMON,
    "training": {
        "epochs": Int(low=1),
        "jit_compile": Bool(words=("auto",)),
    },
    "schedule": dict(_SCHEDULE),
    "sweep": {
        "batch_sizes": ListOf(Int(low=1, words=("full",))),
        "base_batch_size": Int(low=1),
        "grid_factors": ListOf(Float(low=0.0, low_open=True)),
        "workers": Int(low=1, words=("auto",)),
    },
    "optimizers": ListOf(
        {
            "label": Str(),
            "base_learning_rate": Float(low=0.0, low_open=True),
            "optimizer": OptimizerBlock(),
        }
    ),
}

SCHEMAS = {"train": TRAIN_SCHEMA, "sweep": SWEEP_SCHEMA}


# ---------------------------------------------------------------- optimizers
def resolve_optimizer_class(block, key="optimizer"):
    """The optimizer class named by an optimizer block."""
    import keras

    import tf_lars

    names = [block.get("registered_name"), block.get("class_name")]
    candidates = []
    for name in names:
        if not isinstance(name, str):
            continue
        candidates.append(keras.saving.get_registered_object(name))
        candidates.append(keras.saving.get_registered_object(f"tf_lars>{name}"))
        candidates.append(getattr(tf_lars, name, None))
        candidates.append(getattr(keras.optimizers, name, None))
    for cls in candidates:
        if inspect.isclass(cls) and issubclass(cls, keras.optimizers.Optimizer):
            if issubclass(cls, keras.optimizers.LossScaleOptimizer):
                raise ConfigError(
                    f"`{key}.class_name` names a loss-scale wrapper; configure the "
                    "inner optimizer here and loss scaling in the `loss_scale` "
                    f"block. {_show(key + '.class_name', block.get('class_name'))}"
                )
            return cls
    raise ConfigError(
        f"`{key}.class_name` must name a Keras optimizer (e.g. LARS, SGD, Adam). "
        f"{_show(key + '.class_name', block.get('class_name'))}"
    )


def constructor_parameters(cls):
    """`{name: default}` of the constructor arguments an optimizer accepts."""
    import keras

    parameters = {}
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        signature = inspect.signature(klass.__init__)
        for name, parameter in signature.parameters.items():
            if name == "self" or parameter.kind in (
                parameter.VAR_POSITIONAL,
                parameter.VAR_KEYWORD,
            ):
                continue
            parameters.setdefault(name, parameter.default)
        has_var_keyword = any(
            p.kind == p.VAR_KEYWORD for p in signature.parameters.values()
        )
        # Stop at the first constructor that does not forward **kwargs, and at
        # the Keras base class (whose own **kwargs are internal).
        if not has_var_keyword or klass is keras.optimizers.Optimizer:
            break
    return parameters


def _check_optimizer_arguments(cls, config, key):
    import keras

    parameters = constructor_parameters(cls)
    for name, value in config.items():
        full = f"{key}.{name}"
        if name not in parameters:
            raise ConfigError(
                f"Unknown config key `{full}`: not an argument of {cls.__name__}. "
                f"Valid keys: {', '.join(sorted(parameters))}"
            )
        default = parameters[name]
        if name == "learning_rate":
            if isinstance(value, dict):
                try:
                    keras.optimizers.schedules.deserialize(value)
                except Exception as error:  # noqa: BLE001 - reported to the user
                    raise ConfigError(
                        f"`{full}` is not a loadable learning-rate schedule: "
                        f"{_one_line(error)}"
                    ) from None
            elif not (is_real(value) and math.isfinite(value)):
                raise ConfigError(
                    f"`{full}` must be a finite number or a serialized "
                    f"learning-rate schedule. {_show(full, value)}"
                )
        elif isinstance(default, bool):
            if not isinstance(value, bool):
                raise ConfigError(
                    f"`{full}` must be true or false. {_show(full, value)}"
                )
        elif is_real(default):
            if not is_real(value):
                raise ConfigError(f"`{full}` must be a number. {_show(full, value)}")
        elif isinstance(default, str):
            if not isinstance(value, str):
                raise ConfigError(f"`{full}` must be a string. {_show(full, value)}")


def _one_line(error):
    return " ".join(str(error).split())


def optimizer_from_block(block, learning_rate=None, key="optimizer"):
    """Builds the optimizer of a validated block.

    Args:
        block: dict, a validated optimizer block.
        learning_rate: float, schedule or `None`. Replaces the block's
            `learning_rate` when given.
        key: str. The block's dotted key, for error messages.
    """
    import keras

    cls = resolve_optimizer_class(block, key)
    config = copy.deepcopy(block["config"])
    if isinstance(config.get("learning_rate"), dict):
        config["learning_rate"] = keras.optimizers.schedules.deserialize(
            config["learning_rate"]
        )
    if learning_rate is not None:
        config["learning_rate"] = learning_rate
    try:
        return cls(**config)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"`{key}.config`: {_one_line(error)}") from None


# ---------------------------------------------------------- merge and --set
def _merge(base, update):
    result = copy.deepcopy(base)
    for name, value in update.items():
        if (
            name != "optimizer"
            and isinstance(value, dict)
            and isinstance(result.get(name), dict)
        ):
            result[name] = _merge(result[name], value)
        else:
            result[name] = copy.deepcopy(value)
    return result


def apply_overrides(config, overrides):
    """Applies `key=value` strings (values parsed as YAML) to a config dict."""
    config = copy.deepcopy(config)
    for override in overrides:
        key, sep, text = override.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(
                f"`--set` must be given as key=value. Received: --set {override!r}"
            )
        value = parse_yaml(text, f"--set {key}") if text.strip() else None
        parts = key.split(".")
        node = config
        for depth, part in enumerate(parts[:-1]):
            where = ".".join(parts[: depth + 1])
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(
                        f"`--set {key}`: `{where}` is not an index into a list of "
                        f"{len(node)}"
                    )
                node = node[int(part)]
            elif isinstance(node, dict):
                node = node.setdefault(part, {})
            else:
                raise ConfigError(f"`--set {key}`: `{where}` is not a block of keys")
            if node is None:
                raise ConfigError(f"`--set {key}`: `{where}` is null")
        last = parts[-1]
        if isinstance(node, list):
            if not last.isdigit() or int(last) >= len(node):
                raise ConfigError(
                    f"`--set {key}`: `{last}` is not an index into a list of "
                    f"{len(node)}"
                )
            node[int(last)] = value
        elif isinstance(node, dict):
            node[last] = value
        else:
            raise ConfigError(
                f"`--set {key}`: `{'.'.join(parts[:-1])}` is not a block of keys"
            )
    return config


def load_config(command, path=None, overrides=()):
    """Default config of `command`, merged with `path`, then `overrides`.

    Returns:
        The validated config dict.

    Raises:
        ConfigError: on a missing or unreadable file, an unknown key, a value
            of the wrong type or out of range.
    """
    config = default_config(command)
    if path is not None:
        try:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
        except OSError as error:
            raise ConfigError(
                f"--config {path}: cannot read: {error.strerror or error}"
            ) from None
        user = parse_yaml(text, f"--config {path}")
        if user is None:
            user = {}
        if not isinstance(user, dict):
            raise ConfigError(
                f"--config {path}: must hold a mapping of config keys. "
                f"Received: {type(user).__name__}"
            )
        config = _merge(config, user)
    config = apply_overrides(config, overrides)
    return _check_block("", SCHEMAS[command], config)


def dump_config(config):
    """YAML text of a config, in the schema's key order."""
    return yaml.safe_dump(config, sort_keys=False, default_flow_style=False)
