"""Loading and validating `tf-lars` YAML configs.

A config is the default (`configs/<command>.yaml`, whose comments document
each key) with the user's `--config` file merged over it block by block,
then the `--set key=value` overrides, then validated once by a pydantic (v2)
model per command: `extra="forbid"` refuses unknown keys, strict types
refuse `true` for an int or `"3"` for a number, and each error's location is
the dotted key. Every problem is a `ConfigError` whose one-line message
names that key, the rule (the one each leaf type carries) and the received
value.

Two rules on merging: an optimizer block given by the user (`optimizer`,
or a key ending in `_optimizer`: `outer_optimizer`, ...) replaces the
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
import types
import typing
from typing import Annotated, Any, Literal

import pydantic
import yaml
from pydantic import Field

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


def one_line(error):
    """`error`'s message on one line."""
    return " ".join(str(error).split())


# ------------------------------------------------------------------- YAML
# A config is a few kB: the size bound and refusing aliases (no "billion
# laughs") are all the bounds it needs; the depth bound stops PyYAML's
# recursion before Python's does.
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_DEPTH = 64
_TOO_DEEP = f"nested more than {MAX_CONFIG_DEPTH} levels deep"


class _Refused(ValueError):
    pass


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader refusing aliases, deep nesting and a key given
    twice in one mapping; `1e-4` read as a float."""

    _depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise _Refused(
                f"uses the alias *{self.peek_event().anchor}; a config gives each "
                "value in full"
            )
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
        node, lines = super().compose_mapping_node(anchor), {}
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode):
                continue
            value, line = self.construct_object(key), key.start_mark.line + 1
            if value in lines:
                at = (
                    f"line {line}"
                    if lines[value] == line
                    else f"lines {lines[value]} and {line}"
                )
                raise _Refused(
                    f"has the key {value!r} twice in one mapping ({at}); give each "
                    "key once"
                )
            lines[value] = line
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
    """Parses YAML text with `1e-4` read as a float."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as error:
        raise ConfigError(f"{source}: not valid YAML: {one_line(error)}") from None
    except _Refused as error:
        raise ConfigError(f"{source}: refused: the YAML {error}") from None
    except RecursionError:  # PyYAML composes nested values recursively
        raise ConfigError(f"{source}: refused: the YAML {_TOO_DEEP}") from None
    except ValueError as error:
        detail = one_line(error)
        if "integer string conversion" in detail:
            detail = f"an int of more than {sys.get_int_max_str_digits()} digits"
        raise ConfigError(f"{source}: not a config value: {detail}") from None


def read_config_file(path):
    """The text of a `--config` file, read up to `MAX_CONFIG_BYTES`."""
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
    """The default config file of `command` ("train", "study" or "lowcomm").

    Installed, it is the package data `tf_lars/cli/configs/<command>.yaml`;
    in a source checkout (no such package data), the repository's
    `configs/<command>.yaml`: the build installs `configs/` as that package
    data.
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


# ------------------------------------------------------------------- schema
# Each key is a pydantic type with its own constraints (`conint`, `confloat`,
# `conlist`, `Literal`); `_rule` reads the rule a refused value breaks back
# from them, or from the field's `description` where no type says it.
MAX_SEED = 2**32 - 1  # NumPy's seeds (and scikit-learn's `random_state`)
MAX_CLASSES = 1_000_000  # the units of a Dense layer
_NON_NEGATIVE = pydantic.confloat(strict=True, allow_inf_nan=False, ge=0.0)
_POSITIVE = pydantic.confloat(strict=True, allow_inf_nan=False, gt=0.0)
_BATCH = pydantic.conint(strict=True, ge=1) | Literal["full"]
_OPTIMIZER_RULE = "a mapping with `class_name` and `config`"


#: The largest count a key takes (steps, widths, trials, ...): TensorFlow
#: holds shapes and step counts in int32; a larger one failed deep inside.
MAX_COUNT = 2**31 - 1


def _int(low, high=MAX_COUNT):
    return pydantic.conint(strict=True, ge=low, le=high)


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


class _Block(pydantic.BaseModel):
    # Every key is required (the defaults hold them all) and no other key
    # is accepted; fields are in the order the messages list them.
    model_config = pydantic.ConfigDict(extra="forbid")


class OptimizerBlock(_Block):
    """`{class_name, config}`: `keras.optimizers.serialize(optimizer)` output.

    `config` is the optimizer's `get_config()` (checked when the optimizer
    is built: `optimizer_spec`); `module` and `registered_name` (of
    `keras.saving.serialize_keras_object`) are accepted and find the class.
    """

    class_name: pydantic.StrictStr = Field(
        description="must name a Keras optimizer (e.g. LARS, SGD, Adam)"
    )
    config: dict[str, Any] = Field(
        description="must be a mapping of constructor arguments"
    )
    module: Any = None
    registered_name: Any = None

    @pydantic.model_validator(mode="before")
    @classmethod
    def _config_defaults_to_empty(cls, data):
        if isinstance(data, dict) and data.get("config") is None:
            return {**data, "config": {}}
        return data


def _optimizer():
    return Field(description=f"must be {_OPTIMIZER_RULE}")


class Data(_Block):
    # null = scikit-learn's digits; a path = an .npz with x_train, y_train,
    # x_test, y_test.
    path: pydantic.StrictStr | None
    test_fraction: pydantic.confloat(strict=True, allow_inf_nan=False, gt=0.0, lt=1.0)
    split_seed: _int(0, MAX_SEED)
    num_classes: _int(2, MAX_CLASSES) | None


class Model(_Block):
    name: Literal["cnn", "mlp"]
    width: _int(1)


class _Common(_Block):
    """Keys that every command's config shares, in this order."""

    seed: _int(0, MAX_SEED)
    output_dir: Annotated[pydantic.StrictStr, pydantic.AfterValidator(_path_text)] = (
        Field(description="must be a path without NUL or unpaired surrogate characters")
    )
    run_name: (
        Annotated[pydantic.StrictStr, pydantic.AfterValidator(_folder_name)] | None
    ) = Field(
        description="must be one folder name (not empty, '.' or '..', without '/', "
        "NUL or unpaired surrogate characters) or null"
    )
    data: Data
    model: Model


class TrainTraining(_Block):
    epochs: _int(1)
    batch_size: _BATCH
    precision: Literal["float32", "mixed_float16", "mixed_bfloat16"]
    jit_compile: pydantic.StrictBool | Literal["auto"]
    verbose: _int(0, 2)


class TrainSchedule(_Block):
    name: Literal["warmup_polynomial_decay", "none"]
    warmup_epochs: _NON_NEGATIVE
    end_learning_rate: _NON_NEGATIVE
    power: _POSITIVE
    base_batch_size: _int(1) | None


class LossScale(_Block):
    enabled: pydantic.StrictBool
    dynamic: pydantic.StrictBool
    initial_scale: _POSITIVE
    dynamic_growth_steps: _int(1)


class Monitor(_Block):
    log_every_n_batches: _int(1) | None
    tensorboard: pydantic.StrictBool


class DiLoCoBlock(_Block):
    sync_every: _int(1)
    compression: Literal["none", "bfloat16", "int8", "int4"]
    outer_optimizer: OptimizerBlock = _optimizer()


class AGNBlock(_Block):
    communication_period: _int(1)
    outer_optimizer: OptimizerBlock | None = Field(
        description=f"must be null or {_OPTIMIZER_RULE}"
    )


class Distribute(_Block):
    # none = one device; mirrored = every local GPU (or `logical_cpus` CPU
    # devices); multi_worker = MultiWorkerMirroredStrategy from TF_CONFIG;
    # diloco = the same cluster, synchronous DiLoCo (the `diloco` block);
    # parameter_server = AGN on ParameterServerStrategy (the `agn` block).
    strategy: Literal["none", "mirrored", "multi_worker", "diloco", "parameter_server"]
    logical_cpus: _int(2) | None
    # Optional (the two keys that are): a `distribute` block written before
    # they existed, or set whole with --set, stays valid; train.py takes the
    # default block's values then.
    diloco: DiLoCoBlock | None = None
    agn: AGNBlock | None = None


class TrainConfig(_Common):
    """A `tf-lars train` config."""

    training: TrainTraining
    schedule: TrainSchedule
    optimizer: OptimizerBlock = _optimizer()
    loss_scale: LossScale
    monitor: Monitor
    distribute: Distribute


class StudyTraining(_Block):
    jit_compile: pydantic.StrictBool | Literal["auto"]


class Mnist1d(_Block):
    num_samples: _int(100)


class Nqm(_Block):
    dimensions: _int(1)
    max_steps: _int(1)


def _range(low=0.0):
    """A search range `[low, high]`, or null: not searched."""
    bound = pydantic.confloat(strict=True, allow_inf_nan=False, ge=low)
    return pydantic.conlist(bound, min_length=2, max_length=2) | None


class Study(_Block):
    batch_sizes: pydantic.conlist(_int(1), min_length=1)
    trials: _int(1)
    seeds: _int(1)
    target: _POSITIVE
    max_steps: _int(1)
    eval_every: _int(1)
    schedule: Literal["linear_decay", "constant"]
    storage: pydantic.StrictStr | None
    workers: _int(1) | Literal["auto"]
    confidence: pydantic.confloat(strict=True, gt=0.0, lt=1.0)
    resamples: _int(100)


class Search(_Block):
    one_minus_momentum: _range()
    warmup_share: _range()
    weight_decay: _range()


class StudyOptimizer(_Block):
    label: pydantic.StrictStr
    learning_rate: pydantic.conlist(_POSITIVE, min_length=2, max_length=2)
    optimizer: OptimizerBlock = _optimizer()


class StudyConfig(_Common):
    """A `tf-lars study` config."""

    workload: Literal["nqm", "mnist1d", "data"]
    validation_fraction: pydantic.confloat(strict=True, gt=0.0, lt=1.0)
    mnist1d: Mnist1d
    nqm: Nqm
    training: StudyTraining
    study: Study
    search: Search
    optimizers: pydantic.conlist(StudyOptimizer, min_length=1)


class LowcommTraining(_Block):
    steps: _int(1)
    batch_size: _int(1)


class Speeds(_Block):
    name: pydantic.StrictStr
    step_times: pydantic.conlist(_POSITIVE, min_length=1)
    dynamic_local_updates: pydantic.StrictBool


class Tuning(_Block):
    trials: _int(1)
    seeds: _int(1)
    storage: pydantic.StrictStr | None
    workers: _int(1) | Literal["auto"]
    confidence: pydantic.confloat(strict=True, gt=0.0, lt=1.0)
    resamples: _int(100)


class LowcommSearch(_Block):
    inner_learning_rate: pydantic.conlist(_POSITIVE, min_length=2, max_length=2)
    outer_learning_rate: _range()
    outer_one_minus_momentum: _range()


class LowcommConfig(_Common):
    """A `tf-lars lowcomm` config."""

    problem: Literal["mnist1d", "synthetic", "data"]
    validation_fraction: pydantic.confloat(strict=True, gt=0.0, lt=1.0)
    mnist1d: Mnist1d
    training: LowcommTraining
    # One worker exchanges nothing: there is no communication to compare.
    workers: pydantic.conlist(_int(2, 64), min_length=1)
    sync_every: pydantic.conlist(_int(1), min_length=1)
    methods: pydantic.conlist(
        Literal["dp", "diloco", "agn", "async_diloco"], min_length=1
    )
    speeds: pydantic.conlist(Speeds, min_length=1)
    tuning: Tuning
    search: LowcommSearch
    inner_optimizer: OptimizerBlock = _optimizer()
    outer_optimizer: OptimizerBlock = _optimizer()
    async_outer_optimizer: OptimizerBlock = _optimizer()


SCHEMAS = {"train": TrainConfig, "study": StudyConfig, "lowcomm": LowcommConfig}


def _rule(kind, metadata=()):
    """The rule of a type and its constraints, in words: "an int >= 1"."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is Annotated:
        return _rule(args[0], [*metadata, *args[1:]])
    if origin is Literal:
        return f"one of {list(args)}"
    if origin in (typing.Union, types.UnionType):
        words = [a for a in args if typing.get_origin(a) is Literal]
        kinds = [a for a in args if a not in words and a is not type(None)]
        rule = " or ".join(_rule(a) for a in kinds)
        rule += "".join(f" or {w!r}" for a in words for w in typing.get_args(a))
        return rule + " or null" * (type(None) in args)
    bound = {}
    for item in metadata:
        for name in ("ge", "gt", "le", "lt", "min_length"):
            if getattr(item, name, None) is not None:
                bound[name] = getattr(item, name)
    if bound.get("le") == MAX_COUNT:
        del bound["le"]  # said only when broken (`_message`)
    if origin is list:
        return f"a list of at least {bound['min_length']} item(s)"
    if isinstance(kind, type) and issubclass(kind, pydantic.BaseModel):
        return "a mapping"
    name = {int: "an int", float: "a finite number", bool: "true or false"}
    if kind not in name:
        return "a string"
    low = f"[{bound['ge']}" if "ge" in bound else f"({bound.get('gt')}"
    high = f"{bound['le']}]" if "le" in bound else f"{bound.get('lt')})"
    if "le" in bound or "lt" in bound:
        return f"{name[kind]} in {low}, {high}"
    if bound:
        return f"{name[kind]} {'>=' if 'ge' in bound else '>'} {low[1:]}"
    return name[kind]


def _bare(kind):
    """`kind` without its constraints, and an optional block without None."""
    while typing.get_origin(kind) in (Annotated, typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(kind) if a is not type(None)]
        if typing.get_origin(kind) is not Annotated and len(inner) > 1:
            break
        kind = inner[0]
    return kind


def _field(model, loc):
    """`(field, type, length)` of the key a pydantic error's `loc` names:
    the key is `loc[:length]` (the rest names union members)."""
    kind, field, length = model, None, 0
    for part in loc:
        bare = _bare(kind)
        if isinstance(part, int) and typing.get_origin(bare) is list:
            kind, field = typing.get_args(bare)[0], None
        elif part in getattr(bare, "model_fields", {}):
            field = bare.model_fields[part]
            kind = field.rebuild_annotation()
        else:
            break
        length += 1
    return field, kind, length


def _message(model, error):
    """A pydantic error as `(message, dotted key)`."""
    key = ".".join(str(part) for part in error["loc"])
    if error["type"] == "invalid_key":  # `1: 2` or `true: 1`
        parent = key.rpartition(".")[0]
        where = f"`{parent}`" if parent else "the config"
        return (
            f"Config keys must be strings: {where} has the key {error['input']!r} "
            "(quote it to give it as text)",
            parent or None,
        )
    if error["type"] == "extra_forbidden":
        parent = key.rpartition(".")[0]
        where = f"`{parent}`" if parent else "the config"
        block = _bare(_field(model, error["loc"][:-1])[1])
        valid = ", ".join(block.model_fields)
        return f"Unknown config key `{key}`. Valid keys in {where}: {valid}", key
    if error["type"] == "missing":
        if key.endswith(".class_name"):
            return f"`{key}` is missing (e.g. LARS, SGD, Adam)", key
        return f"Config key `{key}` is missing", key
    field, kind, length = _field(model, error["loc"])
    key = ".".join(str(part) for part in error["loc"][:length])
    rule = getattr(field, "description", None) or f"must be {_rule(kind)}"
    if error["type"] == "less_than_equal" and error["ctx"]["le"] == MAX_COUNT:
        rule = f"must be at most {MAX_COUNT} (2**31 - 1)"
    if error["type"] == "string_type" and not isinstance(error["input"], dict | list):
        # `run_name: 2020-01-01` is a date in YAML, `123` an int.
        kind = type(error["input"]).__name__
        rule += f" (YAML read this value as a {kind}: quote it to give it as text)"
    return f"`{key}` {rule}. Received: {key}={error['input']!r}", key


def validate_config(command, config):
    """Validates a config dict of `command`; returns it as a plain dict."""
    model = SCHEMAS[command]
    try:
        # Unset: only an optimizer block's `module` and `registered_name`.
        return model.model_validate(config).model_dump(exclude_unset=True)
    except pydantic.ValidationError as error:
        # A misspelt (or non-string) key explains the errors of the key it
        # meant: first.
        unknown = ("extra_forbidden", "invalid_key")
        first = min(error.errors(), key=lambda e: e["type"] not in unknown)
        raise ConfigError(*_message(model, first)) from None


# ---------------------------------------------------------- merge and --set
def _merge(base, update):
    result = copy.deepcopy(base)
    for name, value in update.items():
        # An optimizer block (`optimizer`, `outer_optimizer`, ...) is replaced.
        optimizer = name == "optimizer" or str(name).endswith("_optimizer")
        if not optimizer and isinstance(value, dict):
            if isinstance(result.get(name), dict):
                value = _merge(result[name], value)
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


def load_config(command, path=None, overrides=(), preset=None):
    """Default config of `command`, merged with the `preset` file of configs/
    (e.g. "study-quick"), with `path`, then `overrides`."""
    config = default_config(command)
    if preset is not None:
        config = _merge(config, default_config(preset))
    if path is not None:
        config = _merge(config, _user_config(os.fspath(path)))
    return validate_config(command, apply_overrides(config, overrides))


def _key_paths(value, prefix):
    """The key paths of `value`'s leaves under `prefix` (list items by index)."""
    if isinstance(value, dict | list):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        return {
            path
            for key, item in items
            for path in _key_paths(item, f"{prefix}.{key}" if prefix else str(key))
        }
    return {prefix}


def _at(config, key):
    for part in key.split("."):
        config = config[int(part) if isinstance(config, list) else part]
    return config


#: `train`'s keys that do nothing with no schedule (`schedule.base_batch_size`
#: still scales the rate), and with the loss scale off.
_SCHEDULE = ["schedule.warmup_epochs", "schedule.end_learning_rate", "schedule.power"]
_LOSS_SCALE = [
    "loss_scale.dynamic",
    "loss_scale.initial_scale",
    "loss_scale.dynamic_growth_steps",
]


def _drawn(config, source):
    """Why a value the search replaces is unused: the range it is drawn from."""
    low, high = _at(config, source)
    nullable = source.startswith("search.") and "inner" not in source
    fixed = f" (set `{source}` to null to use it)" if nullable else ""
    drawn = "1 - it" if "one_minus" in source else "it"
    return f"each trial draws {drawn} from `{source}` [{low:g}, {high:g}]{fixed}"


def _unused_reasons(command, config):
    """`{key or block: why its values train nothing}` in `config`."""
    search, reasons = config.get("search", {}), {}
    if command == "study":
        for i in range(len(config["optimizers"])):
            block = f"optimizers.{i}.optimizer.config"
            rate = f"optimizers.{i}.learning_rate"
            reasons[f"{block}.learning_rate"] = _drawn(config, rate)
            for name, keys in (
                ("one_minus_momentum", ("momentum", "beta_1")),
                ("weight_decay", ("weight_decay",)),
            ):
                if search[name] is not None:
                    why = _drawn(config, f"search.{name}")
                    reasons.update({f"{block}.{key}": why for key in keys})
    elif command == "lowcomm":
        inner = _drawn(config, "search.inner_learning_rate")
        reasons["inner_optimizer.config.learning_rate"] = inner
        for block in ("outer_optimizer", "async_outer_optimizer"):
            for name, key in (
                ("outer_learning_rate", "learning_rate"),
                ("outer_one_minus_momentum", "momentum"),
            ):
                if search[name] is not None:
                    why = _drawn(config, f"search.{name}")
                    reasons[f"{block}.config.{key}"] = why
    elif command == "train":
        strategy = f"`distribute.strategy` is {config['distribute']['strategy']}"
        off = {
            "schedule": config["schedule"]["name"] == "none",
            "loss_scale": not config["loss_scale"]["enabled"],
            "diloco": config["distribute"]["strategy"] != "diloco",
            "agn": config["distribute"]["strategy"] != "parameter_server",
        }
        for block, keys, why in (
            ("schedule", _SCHEDULE, "`schedule.name` is none"),
            ("loss_scale", _LOSS_SCALE, "`loss_scale.enabled` is false"),
            ("diloco", ["distribute.diloco"], strategy),
            ("agn", ["distribute.agn"], strategy),
        ):
            if off[block]:
                reasons.update(dict.fromkeys(keys, why))
    return reasons


def unused_settings(command, config, path=None, overrides=()):
    """One line for each value the user's `--config` file or `--set` gives
    that trains nothing: in `study` and `lowcomm` one the search replaces in
    every trial (a learning rate, a momentum, a weight decay), in `train` one
    of a block that is off (the schedule's, the loss scale's, a strategy's
    other than `distribute.strategy`), unless it is the default file's
    value. Such a value is kept in the config (0.2.x's lowcomm files set the
    inner rate, and still load), and named.
    """
    given = _key_paths(_user_config(os.fspath(path)), "") if path else set()
    for override in overrides:
        key, _, text = override.partition("=")
        value = parse_yaml(text, f"--set {key}") if text.strip() else None
        given |= _key_paths(value, key.strip())
    default = default_config(command)
    return [
        f"`{key}` ({_at(config, key)!r}) is not used: {why}"
        for unused, why in _unused_reasons(command, config).items()
        for key in sorted(given)
        if (key == unused or key.startswith(f"{unused}."))
        and not _same(default, config, key)
    ]


def _same(default, config, key):
    """Whether `config` holds the default file's value at `key` (a copy of
    the default file names nothing)."""
    try:
        return _at(default, key) == _at(config, key)
    except (KeyError, IndexError, TypeError):
        return False


def _class_change_hint(parts, overrides):
    """For an argument refused in an optimizer block whose class `--set`
    changed alone: the block's other arguments are still the old class's."""
    if len(parts) < 3 or parts[-2] != "config":
        return ""
    block = ".".join(parts[:-2])
    for override in overrides:
        key, _, name = override.partition("=")
        if key.strip() == f"{block}.class_name":
            return (
                f" (`--set {block}.class_name` changes the class alone: the block's "
                f"other arguments stay; give the whole block, e.g. --set "
                f"'{block}={{class_name: {name.strip()}}}')"
            )
    return ""


def located_message(error, path=None, overrides=()):
    """`error`'s message, prefixed with `--config FILE: ` when it came from there.

    A value set by `--set` (applied last) keeps the message as it is; one
    set in the `--config` file (and not by `--set`) is named by the file.
    """
    message = one_line(error)
    parts = tuple(str(part) for part in (getattr(error, "key", None) or ()))
    message += _class_change_hint(parts, overrides)
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
        # Stop at the first constructor that does not forward **kwargs, at a
        # tf_lars class (its `from_config` takes its own arguments alone), and
        # at the Keras base class (whose own **kwargs are internal).
        if (
            klass is keras.optimizers.Optimizer
            or klass.__module__.startswith("tf_lars.")
            or all(p.kind != p.VAR_KEYWORD for p in signature)
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
    """Checks an optimizer block's class and argument names and types."""
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
    """The optimizer of an `OptimizerSpec`, built once by its class's `from_config`."""
    if learning_rate is None:
        learning_rate = spec.learning_rate
    arguments = copy.deepcopy(spec.arguments)
    if learning_rate is not None:
        arguments["learning_rate"] = learning_rate
    try:
        return spec.cls.from_config(arguments)
    except (ValueError, TypeError) as error:
        key = f"{spec.key}.config"
        raise ConfigError(f"`{key}`: {one_line(error)}", key) from None


def optimizer_from_block(block, learning_rate=None, key="optimizer"):
    """`build_optimizer(optimizer_spec(block, key), learning_rate)`."""
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
