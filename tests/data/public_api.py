"""The public API of the tf_lars first on the import path, as JSON.

    PYTHONPATH=<checkout> python tests/data/public_api.py > api.json

What a release promises to keep (tests/public_api_test.py holds this
checkout to `public_api_0_2.json`, written by this script from 0.2.x's
tree, 067030b): each public module's names; each public class's and
function's parameters and defaults; each registered serialization name;
each optimizer's config keys; the `tf-lars` commands and their options; and
each command's default config file (a user's file that still has to load).
"""

import argparse
import importlib
import inspect
import json
import sys

import keras

MODULES = (
    "tf_lars",
    "tf_lars.callbacks",
    "tf_lars.distribute",
    "tf_lars.errors",
    "tf_lars.schedules",
)
#: The inner optimizer a wrapper's config is read with.
_INNER = ("inner_optimizer", "optimizer")


def _parameters(obj):
    """`{name: repr(default) or None}`, `*args` and `**kwargs` left out."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    return {
        name: None if p.default is p.empty else repr(p.default)
        for name, p in signature.parameters.items()
        if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }


def _config_keys(cls, parameters):
    """The config keys of `cls()` (an SGD as its inner optimizer), or None."""
    arguments = {n: keras.optimizers.SGD(0.1) for n in _INNER if n in parameters}
    try:
        return sorted(cls(**arguments).get_config())
    except Exception:  # noqa: BLE001 (not constructible alone: no config row)
        return None


def _entry(obj):
    if inspect.ismodule(obj):
        return {"kind": "module"}
    if inspect.isclass(obj):
        entry = {"kind": "class", "parameters": _parameters(obj.__init__)}
        if keras.saving.get_registered_object(keras.saving.get_registered_name(obj)):
            entry["registered_name"] = keras.saving.get_registered_name(obj)
        if issubclass(obj, keras.optimizers.Optimizer):
            entry["config"] = _config_keys(obj, entry["parameters"])
        return entry
    if callable(obj):
        return {"kind": "function", "parameters": _parameters(obj)}
    return {"kind": type(obj).__name__}


def _modules():
    api = {}
    for name in MODULES:
        module = importlib.import_module(name)
        names = getattr(module, "__all__", None) or [
            n
            for n, obj in vars(module).items()
            if not n.startswith("_")
            and getattr(obj, "__module__", "").startswith("tf_lars")
        ]
        api[name] = {n: _entry(getattr(module, n)) for n in sorted(names)}
    return api


def _commands():
    from tf_lars.cli import main

    parser = main._parser()
    (commands,) = (
        a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
    )
    return {
        name: sorted(s for a in command._actions for s in a.option_strings)
        for name, command in commands.choices.items()
    }


def _config_files(commands):
    from tf_lars.cli import config

    return {
        c: config.default_config_path(c).read_text(encoding="utf-8") for c in commands
    }


def public_api():
    commands = _commands()
    return {
        "modules": _modules(),
        "commands": commands,
        "config_files": _config_files(commands),
    }


if __name__ == "__main__":
    json.dump(public_api(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
