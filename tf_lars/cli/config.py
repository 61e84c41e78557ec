"""Loading and validating `tf-lars` YAML configs.

A config is the default (`configs/<command>.yaml`) with the user's
`--config` file merged over it block by block, then `--set key=value`
overrides applied, then the whole tree validated once. Every problem is a
`ConfigError` whose one-line message names the dotted key, the rule and the
received value.

The defaults are the commented YAML files rather than pydantic field
defaults: each key's comment there is its documentation. The validation is a
pydantic (v2) model per command: `extra="forbid"` refuses unknown keys,
strict types refuse `true` for an int or `"3"` for a number, and each error's
location becomes the dotted key. The one departure from pydantic's own
messages: each leaf type carries its rule text (e.g. "must be an int >= 1"),
the wording every message has had.

The optimizer block is checked for shape here, then once, in one forward
pass, when a command builds its optimizer: `optimizer_spec` checks the class
and the argument names and types against the constructor (constructors check
ranges, not always types) and reads the learning rate; `build_optimizer`
builds it with `keras.optimizers.deserialize`, the constructor checking the
values.

Two rules on merging: an `optimizer` block given by the user replaces the
default one as a whole (its `config` holds one optimizer class's constructor
arguments, which do not mix with another class's), and lists replace lists.
"""

import collections
import copy
import datetime
import importlib.resources
import inspect
import math
import os
import pathlib
import re
import sys
import typing
from typing import Annotated, Any, Literal

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

__all__ = [
    "ConfigError",
    "apply_overrides",
    "default_config",
    "default_config_path",
    "dump_config",
    "load_config",
    "build_optimizer",
    "optimizer_from_block",
    "optimizer_spec",
]


class ConfigError(ValueError):
    """A config value the CLI refuses; the message is one line for the user.

    `key`, when known, is the dotted key (or tuple of its parts) of the
    refused value: `located_message` uses it to name the `--config` file
    the value came from.
    """

    def __init__(self, message, key=None):
        super().__init__(message)
        self.key = tuple(key.split(".")) if isinstance(key, str) else key


def _sets(node, parts):
    """Whether a parsed YAML tree sets the key `parts` or a value above it."""
    for part in parts:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and str(part).isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return not isinstance(node, dict | list)
    return True


def located_message(error, path=None, overrides=()):
    """`error`'s message, prefixed with `--config FILE: ` when it came from there.

    A value set by `--set` (applied last) keeps the message as it is; one
    set in the `--config` file (and not by `--set`) is named by the file.
    """
    message = " ".join(str(error).split())
    parts = tuple(str(part) for part in (getattr(error, "key", None) or ()))
    if path is None or not parts:
        return message
    for override in overrides:
        override_parts = tuple(override.partition("=")[0].strip().split("."))
        common = min(len(parts), len(override_parts))
        if parts[:common] == override_parts[:common]:
            return message
    try:
        user = parse_yaml(read_config_file(path), "")
    except ConfigError:
        return message
    if isinstance(user, dict) and parts[0] in user and _sets(user, parts):
        return f"--config {path}: {message}"
    return message


# What a config may be: a few kB of a few hundred values, a handful of
# levels deep. The bounds refuse a file that would take the memory instead:
# /dev/zero, or a few hundred bytes of aliases of aliases ("billion laughs").
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_VALUES = 100_000
MAX_CONFIG_DEPTH = 64


class _TooLarge(ValueError):
    pass


def _expanded_size(node, depth, sizes):
    """The number of values `node` expands to, aliases repeated in full.

    `sizes` holds the nodes already counted, so a node that aliases repeat
    is walked once; an alias of a node inside itself never ends, and is
    refused as too deep.
    """
    if depth > MAX_CONFIG_DEPTH:
        raise _TooLarge(f"nested more than {MAX_CONFIG_DEPTH} levels deep")
    if id(node) not in sizes:
        children = node.value if isinstance(node, yaml.SequenceNode) else []
        if isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        size = 1 + sum(_expanded_size(child, depth + 1, sizes) for child in children)
        if size > MAX_CONFIG_VALUES:
            raise _TooLarge(
                f"expands to more than {MAX_CONFIG_VALUES} values (aliases "
                "repeated inside aliases); a config holds a few hundred"
            )
        sizes[id(node)] = size
    return sizes[id(node)]


# PyYAML follows YAML 1.1, where `1e-4` is a string; every user types it
# expecting a float, so such scalars resolve to floats here.
class _Loader(yaml.SafeLoader):
    _depth = 0

    def compose_node(self, parent, index):
        # Refused on the way down, before PyYAML's recursion goes deeper.
        self._depth += 1
        try:
            if self._depth > MAX_CONFIG_DEPTH:
                raise _TooLarge(f"nested more than {MAX_CONFIG_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self):
        node = super().compose_document()
        if node is not None:
            _expanded_size(node, 0, {})
        return node


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
    """Parses YAML text with `1e-4` read as a float.

    Args:
        text: str, YAML.
        source: str, where the text comes from, for the error message.

    Returns:
        The parsed value.

    Raises:
        ConfigError: the text is not valid YAML, nests or expands beyond the
            bounds above, or holds a value Python cannot read (an int of more
            than `sys.get_int_max_str_digits()` digits, a date out of range).
    """
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as error:
        raise ConfigError(f"{source}: not valid YAML: {_one_line(error)}") from None
    except _TooLarge as error:
        raise ConfigError(f"{source}: refused: the YAML {error}") from None
    except RecursionError:
        # PyYAML composes nested values recursively.
        raise ConfigError(
            f"{source}: refused: the YAML nested more than {MAX_CONFIG_DEPTH} "
            "levels deep"
        ) from None
    except ValueError as error:
        detail = _one_line(error)
        if "integer string conversion" in detail:
            detail = f"an int of more than {sys.get_int_max_str_digits()} digits"
        raise ConfigError(f"{source}: not a config value: {detail}") from None


def default_config_path(command):
    """The default config file of `command` ("train" or "sweep").

    Installed, it is the package data `tf_lars/cli/configs/<command>.yaml`;
    in a source checkout (no such package data), the repository's
    `configs/<command>.yaml`. Both are the same file: the build installs
    `configs/` as that package data.

    Args:
        command: str, "train" or "sweep".

    Returns:
        A `pathlib.Path` or `importlib.resources` traversable (both have
        `read_text` and `read_bytes`).

    Examples:
        >>> default_config_path("train").name
        'train.yaml'
    """
    try:
        packaged = importlib.resources.files("tf_lars.cli.configs")
    except ModuleNotFoundError:
        packaged = None
    if packaged is not None and packaged.joinpath(f"{command}.yaml").is_file():
        return packaged.joinpath(f"{command}.yaml")
    return pathlib.Path(__file__).resolve().parents[2] / "configs" / f"{command}.yaml"


def default_config(command):
    """The default config of `command`, as a dict (not validated)."""
    text = default_config_path(command).read_text(encoding="utf-8")
    return parse_yaml(text, f"default {command}.yaml")


# --------------------------------------------------------------- leaf types
# Each leaf (or list) type carries its rule; when pydantic refuses a value,
# the whole field gets one error of type "rule" with that text, whatever the
# type's branches (int or 'full') made of it.
def _ruled(rule, whole_only=False):
    def validate(value, handler):
        try:
            return handler(value)
        except ValidationError as error:
            # A list's items report their own rule; only the list itself
            # (not a list, too short) gets the list's rule.
            if whole_only and any(e["loc"] for e in error.errors()):
                raise
            raise PydanticCustomError("rule", "{rule}", {"rule": rule}) from None

    return pydantic.WrapValidator(validate)


def _int(low=None, high=None, *, words=(), nullable=False):
    rule = "must be an int"
    if low is not None and high is not None:
        rule += f" in [{low}, {high}]"
    elif low is not None:
        rule += f" >= {low}"
    rule += "".join(f" or {word!r}" for word in words)
    rule += " or null" if nullable else ""
    kind = Annotated[int, pydantic.Strict(), Field(ge=low, le=high)]
    for word in words:
        kind = kind | Literal[word]
    if nullable:
        kind = kind | None
    return Annotated[kind, _ruled(rule)]


def _float(low=None, high=None, *, low_open=False, high_open=False):
    if low is not None and high is not None:
        left, right = "(" if low_open else "[", ")" if high_open else "]"
        rule = f"must be a finite number in {left}{low}, {high}{right}"
    elif low is not None:
        rule = f"must be a finite number {'>' if low_open else '>='} {low}"
    else:
        rule = "must be a finite number"
    bounds = Field(
        gt=low if low_open else None,
        ge=None if low_open else low,
        lt=high if high_open else None,
        le=None if high_open else high,
    )
    kind = Annotated[float, pydantic.Strict(), pydantic.AllowInfNan(False), bounds]
    return Annotated[kind, _ruled(rule)]


def _path_text(value):
    # A NUL or an unpaired surrogate cannot name a file (the OS calls raise).
    if "\0" in value:
        raise ValueError("NUL")
    value.encode("utf-8")  # UnicodeEncodeError, a ValueError, on a surrogate
    return value


def _folder_name(value):
    _path_text(value)
    separators = {os.sep, os.altsep} - {None}
    if value in ("", ".", "..") or any(sep in value for sep in separators):
        raise ValueError("not one path component")
    return value


def _path(check, rule, *, nullable=False):
    kind = Annotated[pydantic.StrictStr, pydantic.AfterValidator(check)]
    if nullable:
        kind = kind | None
    return Annotated[kind, _ruled(rule)]


def _bool(*words):
    rule = "must be true or false" + "".join(f" or {word!r}" for word in words)
    kind = pydantic.StrictBool
    for word in words:
        kind = kind | Literal[word]
    return Annotated[kind, _ruled(rule)]


def _str(choices=None, *, nullable=False):
    rule = f"must be one of {list(choices)}" if choices else "must be a string"
    rule += " or null" if nullable else ""
    kind = Literal[tuple(choices)] if choices else pydantic.StrictStr
    if nullable:
        kind = kind | None
    return Annotated[kind, _ruled(rule)]


def _list(item, min_length=1):
    rule = f"must be a list of at least {min_length} item(s)"
    kind = Annotated[list[item], pydantic.Strict(), Field(min_length=min_length)]
    return Annotated[kind, _ruled(rule, whole_only=True)]


def _block(model, rule="must be a mapping"):
    return Annotated[model, _ruled(rule, whole_only=True)]


class _Block(BaseModel):
    # Every key is required (the defaults hold them all) and no other key
    # is accepted; fields are in the order the messages list them.
    model_config = ConfigDict(extra="forbid", frozen=True)


# ------------------------------------------------------------------- schema
class OptimizerBlock(_Block):
    """`{class_name, config}`: `keras.optimizers.serialize(optimizer)` output.

    `config` is the optimizer's `get_config()`; omitted arguments take the
    constructor's defaults. `module` and `registered_name` (present in
    `keras.saving.serialize_keras_object` output) are accepted and used to
    find the class. `config` is checked when the optimizer is built
    (`optimizer_spec`, `build_optimizer`).
    """

    class_name: Annotated[
        pydantic.StrictStr,
        _ruled("must name a Keras optimizer (e.g. LARS, SGD, Adam)"),
    ] = Field(description="e.g. LARS, SGD, Adam")
    config: Annotated[
        dict[str, Any] | None,
        _ruled("must be a mapping of constructor arguments"),
    ] = Field(default_factory=dict)
    module: Any = None
    registered_name: Any = None

    @pydantic.field_validator("config")
    @classmethod
    def _empty_config(cls, value):
        return {} if value is None else value

    @pydantic.model_serializer(mode="wrap")
    def _given_keys_only(self, handler):
        data = handler(self)
        return {
            name: value
            for name, value in data.items()
            if name in ("class_name", "config") or name in self.model_fields_set
        }


_OPTIMIZER = _block(OptimizerBlock, "must be a mapping with `class_name` and `config`")


# Seeds go to NumPy (`np.random.seed`, scikit-learn's `random_state`), which
# takes 32 bits; the classes to a Dense layer of that many units.
MAX_SEED = 2**32 - 1
MAX_CLASSES = 1_000_000


class Data(_Block):
    # null = scikit-learn's digits; a path = an .npz with x_train, y_train,
    # x_test, y_test.
    path: _str(nullable=True)
    test_fraction: _float(0.0, 1.0, low_open=True, high_open=True)
    split_seed: _int(0, MAX_SEED)
    num_classes: _int(2, MAX_CLASSES, nullable=True)


class Model(_Block):
    name: _str(("cnn", "mlp"))
    width: _int(low=1)


class _Common(_Block):
    """Keys that `train` and `sweep` configs share, in this order."""

    seed: _int(0, MAX_SEED)
    output_dir: _path(
        _path_text, "must be a path without NUL or unpaired surrogate characters"
    )
    run_name: _path(
        _folder_name,
        "must be one folder name (not empty, '.' or '..', without '/', NUL or "
        "unpaired surrogate characters) or null",
        nullable=True,
    )
    data: _block(Data)
    model: _block(Model)


class _Schedule(_Block):
    warmup_epochs: _float(0.0)
    end_learning_rate: _float(0.0)
    power: _float(0.0, low_open=True)


class TrainTraining(_Block):
    epochs: _int(low=1)
    batch_size: _int(low=1, words=("full",))
    precision: _str(("float32", "mixed_float16", "mixed_bfloat16"))
    jit_compile: _bool("auto")
    verbose: _int(0, 2)


class TrainSchedule(_Block):
    name: _str(("warmup_polynomial_decay", "none"))
    warmup_epochs: _float(0.0)
    end_learning_rate: _float(0.0)
    power: _float(0.0, low_open=True)
    base_batch_size: _int(low=1, nullable=True)


class LossScale(_Block):
    enabled: _bool()
    dynamic: _bool()
    initial_scale: _float(0.0, low_open=True)
    dynamic_growth_steps: _int(low=1)


class Monitor(_Block):
    log_every_n_batches: _int(low=1, nullable=True)
    tensorboard: _bool()


class Distribute(_Block):
    # none = one device; mirrored = every local GPU (or `logical_cpus` CPU
    # devices); multi_worker = MultiWorkerMirroredStrategy from TF_CONFIG.
    strategy: _str(("none", "mirrored", "multi_worker"))
    logical_cpus: _int(low=2, nullable=True)


class TrainConfig(_Common):
    """A `tf-lars train` config."""

    training: _block(TrainTraining)
    schedule: _block(TrainSchedule)
    optimizer: _OPTIMIZER
    loss_scale: _block(LossScale)
    monitor: _block(Monitor)
    distribute: _block(Distribute)


class SweepTraining(_Block):
    epochs: _int(low=1)
    jit_compile: _bool("auto")


class Sweep(_Block):
    batch_sizes: _list(_int(low=1, words=("full",)))
    base_batch_size: _int(low=1)
    grid_factors: _list(_float(0.0, low_open=True))
    workers: _int(low=1, words=("auto",))


class SweepOptimizer(_Block):
    label: _str()
    base_learning_rate: _float(0.0, low_open=True)
    optimizer: _OPTIMIZER


class SweepConfig(_Common):
    """A `tf-lars sweep` config."""

    training: _block(SweepTraining)
    schedule: _block(_Schedule)
    sweep: _block(Sweep)
    optimizers: _list(_block(SweepOptimizer))


SCHEMAS = {"train": TrainConfig, "sweep": SweepConfig}


# ------------------------------------------------- pydantic errors -> a line
def _show(key, value):
    return f"Received: {key}={value!r}"


def _model_of(annotation):
    """The model class (or list item type) an annotation holds, else None."""
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _walk(schema, loc):
    """The model holding the last key of `loc`, and that key's field."""
    node = schema
    for part in loc[:-1]:
        if isinstance(part, int):
            node = _model_of(typing.get_args(node)[0])
        else:
            node = _model_of(node.model_fields[part].annotation)
    return node, node.model_fields.get(loc[-1]) if loc else None


def _message(schema, error):
    loc = tuple(error["loc"])
    key = ".".join(str(part) for part in loc)
    if error["type"] == "rule":
        return f"`{key}` {error['ctx']['rule']}. {_show(key, error['input'])}"
    if not loc:
        return f"the config must be a mapping. {_show('config', error['input'])}"
    model, field = _walk(schema, loc)
    if error["type"] == "extra_forbidden":
        parent = ".".join(str(part) for part in loc[:-1])
        where = f"`{parent}`" if parent else "the config"
        return (
            f"Unknown config key `{key}`. Valid keys in {where}: "
            f"{', '.join(model.model_fields)}"
        )
    if error["type"] == "missing":
        if field is not None and field.description:
            return f"`{key}` is missing ({field.description})"
        return f"Config key `{key}` is missing"
    return f"`{key}`: {error['msg']}. {_show(key, error.get('input'))}"


def validate_config(command, config):
    """Validates a config dict of `command`; returns it as a plain dict.

    Args:
        command: str, "train" or "sweep".
        config: dict, the merged config.

    Returns:
        A new dict, keys in the schema's order, numbers of float keys as
        floats, every optimizer block with a `config` mapping.

    Raises:
        ConfigError: the first problem: an unknown key, else the first
            refused value in the order of the keys.

    Examples:
        >>> config = validate_config("train", default_config("train"))
        >>> config["training"]["epochs"]
        100
    """
    schema = SCHEMAS[command]
    try:
        return schema.model_validate(config).model_dump()
    except ValidationError as error:
        # Pydantic lists a block's unknown keys after its fields; a misspelt
        # key explains the rest, so it is reported first.
        first = min(error.errors(), key=lambda e: e["type"] != "extra_forbidden")
        raise ConfigError(_message(schema, first), key=tuple(first["loc"])) from None


# ---------------------------------------------------------------- optimizers
OptimizerSpec = collections.namedtuple(
    "OptimizerSpec", ["cls", "arguments", "learning_rate", "key"]
)
OptimizerSpec.__doc__ = """A checked optimizer block, ready to build.

`arguments` are the block's constructor arguments but the learning rate;
`learning_rate` is the block's (a number, or a serialized schedule) or,
when the block gives none, the constructor's default: the one place the
command line reads it. `key` is the block's dotted key, for messages.
"""


def _optimizer_class(block, key):
    """The optimizer class an optimizer block names (not a loss-scale wrapper)."""
    import keras

    import tf_lars

    candidates = []
    for name in (block.get("registered_name"), block.get("class_name")):
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
            _refuse_wrapper(cls, block, key)
            return cls
    raise ConfigError(
        f"`{key}.class_name` must name a Keras optimizer (e.g. LARS, SGD, Adam). "
        f"{_show(key + '.class_name', block.get('class_name'))}",
        key=f"{key}.class_name",
    )


def _refuse_wrapper(cls, block, key):
    """Refuses an optimizer that wraps another one (TrustRatio, AGN).

    Its `inner_optimizer` is a Python object, which a config cannot give;
    LAMB and LARS are the trust ratio around Adam and SGD-momentum, and AGN
    trains on parameter servers (`tf_lars.distribute`), not in `train`.
    """
    import tf_lars

    inner = inspect.signature(cls).parameters.get("inner_optimizer")
    if inner is None or inner.default is not inner.empty:
        return
    shown = _show(f"{key}.class_name", block.get("class_name"))
    if issubclass(cls, tf_lars.AGN):
        advice = (
            "AGN trains on parameter servers (tf_lars.distribute, see "
            "docs/guides/parameter-servers.md), not in one `tf-lars` training; "
            "name its inner optimizer here instead"
        )
    else:
        advice = (
            f"{cls.__name__} wraps an optimizer that a config cannot give; use "
            "LAMB (the trust ratio around Adam) or LARS (around SGD with momentum)"
        )
    raise ConfigError(
        f"`{key}.class_name` names an optimizer wrapper: {advice}. {shown}",
        key=f"{key}.class_name",
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


def _argument_rule(name, default, value):
    """The rule `value` breaks as argument `name` (default `default`), or None.

    The constructors check their values' ranges, not always their types
    (Keras's `SGD` takes `nesterov=1`); the types of the defaults are the
    rule here.
    """
    # Imported here: `tf_lars._validation` may load Keras (and TensorFlow),
    # which the checks before TensorFlow must not.
    from tf_lars._validation import is_real

    if name == "learning_rate":
        if isinstance(value, dict) or (is_real(value) and math.isfinite(value)):
            return None
        return "must be a finite number or a serialized learning-rate schedule"
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "must be true or false"
    if is_real(default):
        return None if is_real(value) else "must be a number"
    if isinstance(default, str):
        return None if isinstance(value, str) else "must be a string"
    return None


def optimizer_spec(block, key="optimizer"):
    """Checks an optimizer block's class and argument names and types.

    Args:
        block: dict, a validated optimizer block.
        key: str, the block's dotted key, for error messages.

    Returns:
        An `OptimizerSpec`.

    Raises:
        ConfigError: no such optimizer, an unknown argument, or a value of
            the wrong type; naming the key.
    """
    cls = _optimizer_class(block, key)
    parameters = constructor_parameters(cls)
    for name, value in block["config"].items():
        full = f"{key}.config.{name}"
        if name not in parameters:
            raise ConfigError(
                f"Unknown config key `{full}`: not an argument of {cls.__name__}. "
                f"Valid keys: {', '.join(sorted(parameters))}",
                key=full,
            )
        rule = _argument_rule(name, parameters[name], value)
        if rule is not None:
            raise ConfigError(f"`{full}` {rule}. {_show(full, value)}", key=full)
    arguments = copy.deepcopy(block["config"])
    learning_rate = arguments.pop("learning_rate", parameters.get("learning_rate"))
    return OptimizerSpec(cls, arguments, learning_rate, key)


def learning_rate_schedule(serialized, key="optimizer.config.learning_rate"):
    """Deserializes a learning-rate schedule saved from Python.

    Raises:
        ConfigError: it does not load.
    """
    import keras

    try:
        return keras.optimizers.schedules.deserialize(serialized)
    except Exception as error:  # noqa: BLE001 - reported to the user
        raise ConfigError(
            f"`{key}` is not a loadable learning-rate schedule: {_one_line(error)}"
        ) from None


def _one_line(error):
    return " ".join(str(error).split())


def build_optimizer(spec, learning_rate=None):
    """The optimizer of an `OptimizerSpec`, built once by Keras's deserializer.

    Args:
        spec: an `OptimizerSpec`.
        learning_rate: float or schedule; `None` keeps the spec's own (a
            serialized schedule is deserialized by Keras).

    Raises:
        ConfigError: the constructor refuses a value (its message, naming
            the block).
    """
    import keras

    if learning_rate is None:
        learning_rate = spec.learning_rate
    arguments = copy.deepcopy(spec.arguments)
    if learning_rate is not None:
        arguments["learning_rate"] = learning_rate
    # By the registered name ("tf_lars>LAMB"): Keras's deserializer takes the
    # name of any of its own optimizers in any case, so "LAMB" could be read
    # as a Keras built-in of that name.
    name = keras.saving.get_registered_name(spec.cls)
    serialized = {"class_name": name, "config": arguments}
    try:
        return keras.optimizers.deserialize(serialized, custom_objects={name: spec.cls})
    except (ValueError, TypeError) as error:
        raise ConfigError(
            f"`{spec.key}.config`: {_one_line(error)}", key=f"{spec.key}.config"
        ) from None


def optimizer_from_block(block, learning_rate=None, key="optimizer"):
    """`build_optimizer(optimizer_spec(block, key), learning_rate)`.

    Examples:
        >>> optimizer = optimizer_from_block(
        ...     {"class_name": "SGD", "config": {"momentum": 0.9}}, learning_rate=0.1
        ... )
        >>> type(optimizer).__name__, float(optimizer.momentum)
        ('SGD', 0.9)
    """
    return build_optimizer(optimizer_spec(block, key), learning_rate)


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


def _set_key(node, part, key, shown, block):
    """`part` as a key or list index of `node`, on the way of `--set key`.

    `shown` names `part` when it is not an index of a list `node`, `block`
    names `node` when it is neither a list nor a mapping.
    """
    if isinstance(node, list):
        if not part.isdigit() or int(part) >= len(node):
            raise ConfigError(
                f"`--set {key}`: `{shown}` is not an index into a list of {len(node)}"
            )
        return int(part)
    if not isinstance(node, dict):
        raise ConfigError(f"`--set {key}`: `{block}` is not a block of keys")
    return part


def apply_overrides(config, overrides):
    """Applies `key=value` strings (values parsed as YAML) to a config dict.

    Args:
        config: dict, left unchanged.
        overrides: iterable of str, `dotted.key=value`; list items by index.

    Returns:
        A new dict.

    Raises:
        ConfigError: a string without `=`, or a key that does not lead to a
            block or a list index.

    Examples:
        >>> apply_overrides({"training": {"epochs": 1}}, ["training.epochs=1e1"])
        {'training': {'epochs': 10.0}}
    """
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
            index = _set_key(node, part, key, where, where)
            node = node.setdefault(index, {}) if isinstance(node, dict) else node[index]
            if node is None:
                raise ConfigError(f"`--set {key}`: `{where}` is null")
        node[_set_key(node, parts[-1], key, parts[-1], ".".join(parts[:-1]))] = value
    return config


def load_config(command, path=None, overrides=()):
    """Default config of `command`, merged with `path`, then `overrides`.

    Args:
        command: str, "train" or "sweep".
        path: str or path-like, a YAML file merged over the default, or None.
        overrides: iterable of `key=value` strings (`--set`).

    Returns:
        The validated config, a plain dict (see `validate_config`).

    Raises:
        ConfigError: on a missing or unreadable file, an unknown key, a value
            of the wrong type or out of range.

    Examples:
        >>> load_config("sweep", overrides=["sweep.workers=1"])["sweep"]["workers"]
        1
    """
    config = default_config(command)
    if path is not None:
        user = parse_yaml(read_config_file(path), f"--config {path}")
        if user is None:
            user = {}
        if not isinstance(user, dict):
            raise ConfigError(
                f"--config {path}: must hold a mapping of config keys. "
                f"Received: {type(user).__name__}"
            )
        config = _merge(config, user)
    config = apply_overrides(config, overrides)
    return validate_config(command, config)


def read_config_file(path):
    """The text of a `--config` file, read up to `MAX_CONFIG_BYTES`.

    Raises:
        ConfigError: the file cannot be read, is larger, or is not UTF-8.
    """
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise ConfigError(
            f"--config {path}: cannot read: {error.strerror or error}"
        ) from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"--config {path}: refused: larger than {MAX_CONFIG_BYTES} bytes (1 MiB); "
            "a config is a few kB of YAML"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"--config {path}: not a text file (byte {error.start} is not "
            "UTF-8); give a YAML file of config keys"
        ) from None


def dump_config(config):
    """YAML text of a config, in the schema's key order."""
    return yaml.safe_dump(config, sort_keys=False, default_flow_style=False)


def run_dir(config, command):
    """The run folder: `<output_dir>/<run_name or command-YYYYmmdd-HHMMSS>`."""
    name = config["run_name"] or (
        f"{command}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    )
    return os.path.join(config["output_dir"], name)
