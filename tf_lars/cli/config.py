"""Loading and validating `tf-lars` YAML configs.

A config is the default (`configs/<command>.yaml`, whose comments document
each key) with the user's `--config` file merged over it block by block,
then the `--set key=value` overrides, then validated once by a pydantic (v2)
model per command: `extra="forbid"` refuses unknown keys, strict types
refuse `true` for an int or `"3"` for a number, and each error's location is
the dotted key. Every problem is a `ConfigError` whose one-line message
names that key, the rule (the one each leaf type carries) and the received
value.

Two rules on merging: an `optimizer` block given by the user replaces the
default one as a whole (its `config` holds one class's constructor
arguments, which do not mix with another class's), and lists replace lists.
The optimizer block is checked for shape here, and against its class's
constructor by `optimizer_spec` once TensorFlow is loaded.
"""

import collections
import contextlib
import copy
import datetime
import importlib.resources
import inspect
import math
import os
import pathlib
import re
import sys
from typing import Annotated, Any, Literal

import pydantic
import yaml
from pydantic_core import PydanticCustomError

__all__ = [
    "ConfigError",
    "apply_overrides",
    "build_optimizer",
    "default_config",
    "default_config_path",
    "dump_config",
    "load_config",
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


def _one_line(error):
    return " ".join(str(error).split())


# ------------------------------------------------------------------- YAML
# What a config may be: a few kB of a few hundred values, a handful of
# levels deep. The bounds refuse a file that would take the memory instead:
# /dev/zero, or a few hundred bytes of aliases of aliases ("billion laughs").
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_VALUES = 100_000
MAX_CONFIG_DEPTH = 64
_TOO_DEEP = f"nested more than {MAX_CONFIG_DEPTH} levels deep"


class _Refused(ValueError):
    pass


_MERGE = "tag:yaml.org,2002:merge"  # `<<: *base`, which may repeat a key of base


def _expanded_size(node, depth, sizes):
    """The number of values `node` expands to, aliases repeated in full.

    `sizes` holds the nodes already counted, so a node that aliases repeat
    is walked once; an alias of a node inside itself never ends, and is
    refused as too deep.
    """
    if depth > MAX_CONFIG_DEPTH:
        raise _Refused(_TOO_DEEP)
    if id(node) not in sizes:
        children = node.value if isinstance(node, yaml.SequenceNode) else []
        if isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        size = 1 + sum(_expanded_size(child, depth + 1, sizes) for child in children)
        if size > MAX_CONFIG_VALUES:
            raise _Refused(
                f"expands to more than {MAX_CONFIG_VALUES} values (aliases "
                "repeated inside aliases); a config holds a few hundred"
            )
        sizes[id(node)] = size
    return sizes[id(node)]


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader within the bounds above, `1e-4` read as a float,
    a key given twice in one mapping refused."""

    _depth = 0

    def compose_node(self, parent, index):
        # Refused on the way down, before PyYAML's recursion goes deeper.
        self._depth += 1
        try:
            if self._depth > MAX_CONFIG_DEPTH:
                raise _Refused(_TOO_DEEP)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_mapping_node(self, anchor):
        # PyYAML keeps the later of two equal keys silently: a config that
        # sets `learning_rate` twice would train with the one below.
        node = super().compose_mapping_node(anchor)
        lines = {}
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != _MERGE:
                value = self.construct_object(key)
                line = key.start_mark.line + 1
                if value in lines:
                    at = f"lines {lines[value]} and {line}"
                    if lines[value] == line:
                        at = f"line {line}"
                    raise _Refused(
                        f"has the key {value!r} twice in one mapping ({at}); give "
                        "each key once"
                    )
                lines[value] = line
        return node

    def compose_document(self):
        node = super().compose_document()
        if node is not None:
            _expanded_size(node, 0, {})
        return node


# PyYAML follows YAML 1.1, where `1e-4` is a string; every user types it
# expecting a float (as YAML 1.2 reads it).
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
            bounds above, gives a key twice in one mapping, or holds a value
            Python cannot read (an int of more than
            `sys.get_int_max_str_digits()` digits, a date out of range).
    """
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as error:
        raise ConfigError(f"{source}: not valid YAML: {_one_line(error)}") from None
    except _Refused as error:
        raise ConfigError(f"{source}: refused: the YAML {error}") from None
    except RecursionError:  # PyYAML composes nested values recursively
        raise ConfigError(f"{source}: refused: the YAML {_TOO_DEEP}") from None
    except ValueError as error:
        detail = _one_line(error)
        if "integer string conversion" in detail:
            detail = f"an int of more than {sys.get_int_max_str_digits()} digits"
        raise ConfigError(f"{source}: not a config value: {detail}") from None


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


def _user_config(path):
    """The parsed `--config` file, a dict."""
    user = parse_yaml(read_config_file(path), f"--config {path}")
    if user is not None and not isinstance(user, dict):
        raise ConfigError(
            f"--config {path}: must hold a mapping of config keys. "
            f"Received: {type(user).__name__}"
        )
    return user or {}


def default_config_path(command):
    """The default config file of `command` ("train" or "sweep").

    Installed, it is the package data `tf_lars/cli/configs/<command>.yaml`;
    in a source checkout (no such package data), the repository's
    `configs/<command>.yaml`: the build installs `configs/` as that package
    data.

    Returns:
        A `pathlib.Path` or `importlib.resources` traversable (both have
        `read_text` and `read_bytes`).

    Examples:
        >>> default_config_path("train").name
        'train.yaml'
    """
    name = f"{command}.yaml"
    with contextlib.suppress(ModuleNotFoundError):
        packaged = importlib.resources.files("tf_lars.cli.configs") / name
        if packaged.is_file():
            return packaged
    return pathlib.Path(__file__).resolve().parents[2] / "configs" / name


def default_config(command):
    """The default config of `command`, as a dict (not validated)."""
    text = default_config_path(command).read_text(encoding="utf-8")
    return parse_yaml(text, f"default {command}.yaml")


# --------------------------------------------------------------- leaf types
def _ruled(kind, rule, whole_only=False):
    """`kind`, every refusal of which is one error of type "rule": `rule`.

    With `whole_only` (lists and blocks) the errors of the items or keys
    inside stand; only the value itself (not a list, not a mapping, too
    short) gets `rule`.
    """

    def validate(value, handler):
        try:
            return handler(value)
        except pydantic.ValidationError as error:
            if whole_only and any(
                e["loc"] or e["type"] == "unknown" for e in error.errors()
            ):
                raise
            raise PydanticCustomError("rule", "{rule}", {"rule": rule}) from None

    return Annotated[kind, pydantic.WrapValidator(validate)]


def _or(kind, rule, words=(), null=False):
    """`kind` or one of the literal `words` or null, with its rule."""
    for word in words:
        kind = kind | Literal[word]
    rule += "".join(f" or {word!r}" for word in words) + (" or null" if null else "")
    return _ruled(kind | None if null else kind, rule)


def _int(low, high=None, words=(), null=False):
    span = f"in [{low}, {high}]" if high is not None else f">= {low}"
    kind = Annotated[int, pydantic.Strict(), pydantic.Field(ge=low, le=high)]
    return _or(kind, f"must be an int {span}", words, null)


def _number(span, **bounds):
    kind = Annotated[
        float, pydantic.Strict(), pydantic.AllowInfNan(False), pydantic.Field(**bounds)
    ]
    return _ruled(kind, f"must be a finite number {span}")


def _choice(*choices):
    return _ruled(Literal[choices], f"must be one of {list(choices)}")


def _bool(*words):
    return _or(pydantic.StrictBool, "must be true or false", words)


def _path_text(value):
    # A NUL or an unpaired surrogate cannot name a file (the OS calls raise).
    if "\0" in value:
        raise ValueError("NUL")
    value.encode("utf-8")  # UnicodeEncodeError, a ValueError, on a surrogate
    return value


def _folder_name(value):
    separators = {os.sep, os.altsep} - {None}
    if _path_text(value) in ("", ".", "..") or any(s in value for s in separators):
        raise ValueError("not one path component")
    return value


_NON_NEGATIVE = _number(">= 0.0", ge=0.0)
_POSITIVE = _number("> 0.0", gt=0.0)
_BATCH = _int(1, words=("full",))


class _Block(pydantic.BaseModel):
    # Every key is required (the defaults hold them all) and no other key
    # is accepted; fields are in the order the messages list them.
    model_config = pydantic.ConfigDict(extra="forbid")

    @pydantic.model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data):
        # One error that lists the block's keys: a misspelt key explains the
        # errors of the key it meant, so it is reported first.
        for name in data if isinstance(data, dict) else ():
            if name not in cls.model_fields:
                valid = ", ".join(cls.model_fields)
                raise PydanticCustomError(
                    "unknown", "{name}", {"name": str(name), "valid": valid}
                )
        return data


def _block(model, rule="must be a mapping"):
    return _ruled(model, rule, whole_only=True)


# ------------------------------------------------------------------- schema
class OptimizerBlock(_Block):
    """`{class_name, config}`: `keras.optimizers.serialize(optimizer)` output.

    `config` is the optimizer's `get_config()`; omitted arguments take the
    constructor's defaults. `module` and `registered_name` (present in
    `keras.saving.serialize_keras_object` output) are accepted and used to
    find the class. `config` is checked when the optimizer is built
    (`optimizer_spec`, `build_optimizer`).
    """

    class_name: _ruled(
        pydantic.StrictStr, "must name a Keras optimizer (e.g. LARS, SGD, Adam)"
    )
    config: _ruled(dict[str, Any], "must be a mapping of constructor arguments")
    module: Any = None
    registered_name: Any = None

    @pydantic.model_validator(mode="before")
    @classmethod
    def _config_defaults_to_empty(cls, data):
        if isinstance(data, dict) and data.get("config") is None:
            return {**data, "config": {}}
        return data


_OPTIMIZER = _block(OptimizerBlock, "must be a mapping with `class_name` and `config`")
_OPTIMIZER_OR_NULL = _block(
    OptimizerBlock | None, "must be null or a mapping with `class_name` and `config`"
)

# Seeds go to NumPy (`np.random.seed`, scikit-learn's `random_state`), which
# takes 32 bits; the classes to a Dense layer of that many units.
MAX_SEED = 2**32 - 1
MAX_CLASSES = 1_000_000


class Data(_Block):
    # null = scikit-learn's digits; a path = an .npz with x_train, y_train,
    # x_test, y_test.
    path: _or(pydantic.StrictStr, "must be a string", null=True)
    test_fraction: _number("in (0.0, 1.0)", gt=0.0, lt=1.0)
    split_seed: _int(0, MAX_SEED)
    num_classes: _int(2, MAX_CLASSES, null=True)


class Model(_Block):
    name: _choice("cnn", "mlp")
    width: _int(1)


class _Common(_Block):
    """Keys that `train` and `sweep` configs share, in this order."""

    seed: _int(0, MAX_SEED)
    output_dir: _ruled(
        Annotated[pydantic.StrictStr, pydantic.AfterValidator(_path_text)],
        "must be a path without NUL or unpaired surrogate characters",
    )
    run_name: _or(
        Annotated[pydantic.StrictStr, pydantic.AfterValidator(_folder_name)],
        "must be one folder name (not empty, '.' or '..', without '/', NUL or "
        "unpaired surrogate characters)",
        null=True,
    )
    data: _block(Data)
    model: _block(Model)


class _Schedule(_Block):
    warmup_epochs: _NON_NEGATIVE
    end_learning_rate: _NON_NEGATIVE
    power: _POSITIVE


class TrainTraining(_Block):
    epochs: _int(1)
    batch_size: _BATCH
    precision: _choice("float32", "mixed_float16", "mixed_bfloat16")
    jit_compile: _bool("auto")
    verbose: _int(0, 2)


class TrainSchedule(_Block):
    name: _choice("warmup_polynomial_decay", "none")
    warmup_epochs: _NON_NEGATIVE
    end_learning_rate: _NON_NEGATIVE
    power: _POSITIVE
    base_batch_size: _int(1, null=True)


class LossScale(_Block):
    enabled: _bool()
    dynamic: _bool()
    initial_scale: _POSITIVE
    dynamic_growth_steps: _int(1)


class Monitor(_Block):
    log_every_n_batches: _int(1, null=True)
    tensorboard: _bool()


class DiLoCoBlock(_Block):
    sync_every: _int(1)
    compression: _choice("none", "bfloat16", "int8", "int4")
    outer_optimizer: _OPTIMIZER


class AGNBlock(_Block):
    communication_period: _int(1)
    outer_optimizer: _OPTIMIZER_OR_NULL


class Distribute(_Block):
    # none = one device; mirrored = every local GPU (or `logical_cpus` CPU
    # devices); multi_worker = MultiWorkerMirroredStrategy from TF_CONFIG;
    # diloco = the same cluster, synchronous DiLoCo (the `diloco` block);
    # parameter_server = AGN on ParameterServerStrategy (the `agn` block).
    strategy: _choice("none", "mirrored", "multi_worker", "diloco", "parameter_server")
    logical_cpus: _int(2, null=True)
    # Optional (the two keys that are): a `distribute` block written before
    # they existed, or set whole with --set, stays valid; train.py takes the
    # default block's values then.
    diloco: _block(DiLoCoBlock) = None
    agn: _block(AGNBlock) = None


class TrainConfig(_Common):
    """A `tf-lars train` config."""

    training: _block(TrainTraining)
    schedule: _block(TrainSchedule)
    optimizer: _OPTIMIZER
    loss_scale: _block(LossScale)
    monitor: _block(Monitor)
    distribute: _block(Distribute)


class SweepTraining(_Block):
    epochs: _int(1)
    jit_compile: _bool("auto")


def _list(item):
    kind = Annotated[list[item], pydantic.Strict(), pydantic.Field(min_length=1)]
    return _ruled(kind, "must be a list of at least 1 item(s)", whole_only=True)


class Sweep(_Block):
    batch_sizes: _list(_BATCH)
    base_batch_size: _int(1)
    grid_factors: _list(_POSITIVE)
    workers: _int(1, words=("auto",))


class SweepOptimizer(_Block):
    label: _ruled(pydantic.StrictStr, "must be a string")
    base_learning_rate: _POSITIVE
    optimizer: _OPTIMIZER


class SweepConfig(_Common):
    """A `tf-lars sweep` config."""

    training: _block(SweepTraining)
    schedule: _block(_Schedule)
    sweep: _block(Sweep)
    optimizers: _list(_block(SweepOptimizer))


class LowcommTraining(_Block):
    steps: _int(1)
    batch_size: _int(1)


class LowcommConfig(_Common):
    """A `tf-lars lowcomm` config."""

    problem: _choice("synthetic", "data")
    training: _block(LowcommTraining)
    # One worker exchanges nothing: there is no communication to compare.
    workers: _list(_int(2, 64))
    sync_every: _list(_int(1))
    inner_optimizer: _OPTIMIZER
    outer_optimizer: _OPTIMIZER
    async_outer_optimizer: _OPTIMIZER


SCHEMAS = {"train": TrainConfig, "sweep": SweepConfig, "lowcomm": LowcommConfig}


def _message(error):
    """A pydantic error as `(message, dotted key)`."""
    key = ".".join(str(part) for part in error["loc"])
    shown = f"Received: {key}={error['input']!r}"
    if error["type"] == "rule":
        return f"`{key}` {error['ctx']['rule']}. {shown}", key
    if error["type"] == "unknown":
        where = f"`{key}`" if key else "the config"
        key = f"{key}.{error['ctx']['name']}" if key else error["ctx"]["name"]
        valid = error["ctx"]["valid"]
        return f"Unknown config key `{key}`. Valid keys in {where}: {valid}", key
    if error["type"] == "missing":
        if key.endswith(".class_name"):
            return f"`{key}` is missing (e.g. LARS, SGD, Adam)", key
        return f"Config key `{key}` is missing", key
    return f"`{key}`: {error['msg']}. {shown}", key


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
    try:
        # Unset: only an optimizer block's `module` and `registered_name`.
        return SCHEMAS[command].model_validate(config).model_dump(exclude_unset=True)
    except pydantic.ValidationError as error:
        first = min(error.errors(), key=lambda e: e["type"] != "unknown")
        raise ConfigError(*_message(first)) from None


# ---------------------------------------------------------- merge and --set
def _merge(base, update):
    result = copy.deepcopy(base)
    for name, value in update.items():
        if name != "optimizer" and isinstance(value, dict):
            if isinstance(result.get(name), dict):
                value = _merge(result[name], value)
        result[name] = copy.deepcopy(value)
    return result


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
        for depth, part in enumerate(parts):
            where = ".".join(parts[: depth + 1])
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(
                        f"`--set {key}`: `{where if depth < len(parts) - 1 else part}`"
                        f" is not an index into a list of {len(node)}"
                    )
                part = int(part)
            elif not isinstance(node, dict):
                raise ConfigError(
                    f"`--set {key}`: `{'.'.join(parts[:depth])}` is not a block of keys"
                )
            if depth == len(parts) - 1:
                node[part] = value
            elif isinstance(node, dict):
                node = node.setdefault(part, {})
            else:
                node = node[part]
            if node is None:
                raise ConfigError(f"`--set {key}`: `{where}` is null")
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
        config = _merge(config, _user_config(os.fspath(path)))
    return validate_config(command, apply_overrides(config, overrides))


def located_message(error, path=None, overrides=()):
    """`error`'s message, prefixed with `--config FILE: ` when it came from there.

    A value set by `--set` (applied last) keeps the message as it is; one
    set in the `--config` file (and not by `--set`) is named by the file.
    """
    message = _one_line(error)
    parts = tuple(str(part) for part in (getattr(error, "key", None) or ()))
    if path is None or not parts:
        return message
    for override in overrides:
        given = tuple(override.partition("=")[0].strip().split("."))
        if parts[: len(given)] == given[: len(parts)]:
            return message
    try:
        node = _user_config(os.fspath(path))
    except ConfigError:
        return message
    for part in parts:
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, dict | list):
            return message  # not set there
        else:
            break  # a value set above the key
    return f"--config {path}: {message}"


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
    """The optimizer class an optimizer block names (not a wrapper)."""
    import keras

    import tf_lars

    key += ".class_name"
    shown = f"Received: {key}={block.get('class_name')!r}"
    for name in (block.get("registered_name"), block.get("class_name")):
        if not isinstance(name, str):
            continue
        for cls in (
            keras.saving.get_registered_object(name),
            keras.saving.get_registered_object(f"tf_lars>{name}"),
            getattr(tf_lars, name, None),
            getattr(keras.optimizers, name, None),
        ):
            if inspect.isclass(cls) and issubclass(cls, keras.optimizers.Optimizer):
                break
        else:
            continue
        if issubclass(cls, keras.optimizers.LossScaleOptimizer):
            raise ConfigError(
                f"`{key}` names a loss-scale wrapper; configure the inner optimizer "
                f"here and loss scaling in the `loss_scale` block. {shown}"
            )
        # A wrapper's `inner_optimizer` is a Python object, which a config
        # cannot give.
        inner = inspect.signature(cls).parameters.get("inner_optimizer")
        if inner is None or inner.default is not inner.empty:
            return cls
        advice = (
            f"{cls.__name__} wraps an optimizer that a config cannot give; use "
            "LAMB (the trust ratio around Adam) or LARS (around SGD with momentum)"
        )
        if issubclass(cls, tf_lars.AGN):
            advice = (
                "AGN trains on parameter servers: name its inner optimizer here "
                "and set distribute.strategy=parameter_server (the distribute.agn "
                "block; docs/guides/parameter-servers.md)"
            )
        raise ConfigError(f"`{key}` names an optimizer wrapper: {advice}. {shown}", key)
    raise ConfigError(
        f"`{key}` must be an optimizer's class name alone (no module path): "
        f"{_accepted_names(tf_lars)} (tf_lars), {_accepted_names(keras.optimizers)} "
        f"(keras.optimizers), or a name registered with Keras. {shown}",
        key,
    )


def _accepted_names(module):
    """The optimizer classes of `module` a block can build, as "A, B, C":
    every constructor argument has a default (no wrapper, no base class)."""
    import keras

    names = []
    for name in getattr(module, "__all__", None) or dir(module):
        cls = getattr(module, name)
        if (
            inspect.isclass(cls)
            and issubclass(cls, keras.optimizers.Optimizer)
            and cls is not keras.optimizers.Optimizer
            and all(
                p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                for p in inspect.signature(cls).parameters.values()
            )
        ):
            names.append(name)
    return ", ".join(sorted(names))


def constructor_parameters(cls):
    """`{name: default}` of the constructor arguments an optimizer accepts."""
    import keras

    parameters = {}
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        signature = inspect.signature(klass.__init__).parameters.values()
        for parameter in signature:
            if parameter.name != "self" and parameter.kind not in (
                parameter.VAR_POSITIONAL,
                parameter.VAR_KEYWORD,
            ):
                parameters.setdefault(parameter.name, parameter.default)
        # Stop at the first constructor that does not forward **kwargs, and at
        # the Keras base class (whose own **kwargs are internal).
        if klass is keras.optimizers.Optimizer or all(
            p.kind != p.VAR_KEYWORD for p in signature
        ):
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
            raise ConfigError(f"`{full}` {rule}. Received: {full}={value!r}", full)
    arguments = copy.deepcopy(block["config"])
    learning_rate = arguments.pop("learning_rate", parameters.get("learning_rate"))
    return OptimizerSpec(cls, arguments, learning_rate, key)


def build_optimizer(spec, learning_rate=None):
    """The optimizer of an `OptimizerSpec`, built once by its class's `from_config`.

    Args:
        spec: an `OptimizerSpec`.
        learning_rate: float or schedule; `None` keeps the spec's own (a
            serialized schedule is deserialized by `from_config`).

    Raises:
        ConfigError: the constructor refuses a value (its message, naming
            the block).
    """
    if learning_rate is None:
        learning_rate = spec.learning_rate
    arguments = copy.deepcopy(spec.arguments)
    if learning_rate is not None:
        arguments["learning_rate"] = learning_rate
    try:
        return spec.cls.from_config(arguments)
    except (ValueError, TypeError) as error:
        key = f"{spec.key}.config"
        raise ConfigError(f"`{key}`: {_one_line(error)}", key) from None


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


# ------------------------------------------------------------------ output
def dump_config(config):
    """YAML text of a config, in the schema's key order."""
    return yaml.safe_dump(config, sort_keys=False, default_flow_style=False)


def run_dir(config, command):
    """The run folder: `<output_dir>/<run_name or command-YYYYmmdd-HHMMSS>`."""
    name = config["run_name"] or (
        f"{command}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    )
    return os.path.join(config["output_dir"], name)
