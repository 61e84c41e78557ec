"""What 0.2.x promised still holds on this tree.

`tests/data/public_api_0_2.json` is 0.2.x's public API as
`tests/data/public_api.py` reads it (run on 067030b's tree): every public
name of `tf_lars`, `tf_lars.callbacks`, `tf_lars.distribute`, `tf_lars.errors`
and `tf_lars.schedules`; every argument of their classes and functions with
its default; every registered serialization name and optimizer config key;
the `tf-lars` commands and their options; the default config files. Each
must still be here, unchanged (new ones may be added), except `tf-lars sweep`,
which `tf-lars study` replaced (`cli_study_test.py::
test_sweep_is_gone_and_names_study`: a one-line error naming `study`).
"""

import copy
import json
import pathlib

import pytest

from tests.data import public_api

OLD = json.loads(
    (pathlib.Path(__file__).parent / "data" / "public_api_0_2.json").read_text(
        encoding="utf-8"
    )
)
REMOVED_COMMANDS = {"sweep"}


@pytest.fixture(scope="module")
def now():
    return public_api.public_api()


def broken_promises(old, new):
    """Each name, argument, default, registered name, config key, command
    and option of `old` that `new` lacks or changed, as a line."""
    broken = []
    for module, names in old["modules"].items():
        for name, entry in names.items():
            where = f"{module}.{name}"
            found = new["modules"].get(module, {}).get(name)
            if found is None or found["kind"] != entry["kind"]:
                broken.append(f"{where}: {entry['kind']} gone ({found})")
                continue
            parameters = found.get("parameters") or {}
            for argument, default in (entry.get("parameters") or {}).items():
                if argument not in parameters:
                    broken.append(f"{where}: argument `{argument}` gone")
                elif parameters[argument] != default:
                    broken.append(
                        f"{where}: `{argument}` default {default} -> "
                        f"{parameters[argument]}"
                    )
            if entry.get("registered_name") != found.get("registered_name"):
                broken.append(
                    f"{where}: registered as {entry.get('registered_name')!r}, "
                    f"now {found.get('registered_name')!r}"
                )
            keys = set(entry.get("config") or ()) - set(found.get("config") or ())
            if keys:
                broken.append(f"{where}: config keys gone: {sorted(keys)}")
    for command, options in old["commands"].items():
        if command in REMOVED_COMMANDS:
            continue
        if command not in new["commands"]:
            broken.append(f"tf-lars {command}: command gone")
            continue
        gone = set(options) - set(new["commands"][command])
        if gone:
            broken.append(f"tf-lars {command}: options gone: {sorted(gone)}")
    return broken


def test_every_name_argument_default_and_registered_name_is_kept(now):
    assert sum(len(names) for names in OLD["modules"].values()) == 34
    assert broken_promises(OLD, now) == []
    assert set(now["commands"]) == set(OLD["commands"]) - REMOVED_COMMANDS | {"study"}


@pytest.mark.parametrize(
    "change, line",
    [
        (
            lambda api: api["modules"]["tf_lars"].pop("LAMB"),
            "tf_lars.LAMB: class gone (None)",
        ),
        (
            lambda api: api["modules"]["tf_lars"]["LARS"]["parameters"].pop(
                "trust_clip"
            ),
            "tf_lars.LARS: argument `trust_clip` gone",
        ),
        (
            lambda api: api["modules"]["tf_lars"]["LARS"]["parameters"].update(
                momentum="0.95"
            ),
            "tf_lars.LARS: `momentum` default 0.9 -> 0.95",
        ),
        (
            lambda api: api["modules"]["tf_lars"]["AGN"].update(
                registered_name="tf_lars>AGNOptimizer"
            ),
            "tf_lars.AGN: registered as 'tf_lars>AGN', now 'tf_lars>AGNOptimizer'",
        ),
        (
            lambda api: api["modules"]["tf_lars"]["LAMB"]["config"].remove("beta_2"),
            "tf_lars.LAMB: config keys gone: ['beta_2']",
        ),
        (
            lambda api: api["commands"]["train"].remove("--overwrite"),
            "tf-lars train: options gone: ['--overwrite']",
        ),
    ],
)
def test_the_check_reports_each_kind_of_broken_promise(now, change, line):
    changed = copy.deepcopy(now)
    change(changed)
    assert broken_promises(OLD, changed) == [line]


@pytest.mark.parametrize("command", ["train", "lowcomm"])
def test_a_default_config_of_0_2_still_loads_as_a_user_s_file(command, tmp_path):
    from tf_lars.cli import config

    path = tmp_path / f"{command}.yaml"
    path.write_text(OLD["config_files"][command], encoding="utf-8")
    old = config.parse_yaml(OLD["config_files"][command], str(path))
    loaded = config.load_config(command, path)
    # Every value the file sets is the loaded config's (10 == 10.0).
    leaves = _leaves(loaded)
    assert {k: leaves.get(k, "missing") for k in _leaves(old)} == _leaves(old)
    # lowcomm's rates and outer momenta are searched in 0.3.0: each such value
    # the file gives apart from 0.3.0's defaults is named as unused (a
    # warning), not refused.
    lines = config.unused_settings(command, loaded, path)
    searched = [
        "inner_optimizer.config.learning_rate",  # 0.001: 0.3.0's file has none
        "async_outer_optimizer.config.momentum",  # 0.5: 0.3.0's is 0.9
    ]
    assert [line.split("`")[1] for line in lines] == (
        searched if command == "lowcomm" else []
    )


def _leaves(value, prefix=""):
    if not isinstance(value, dict):
        return {prefix: value}
    leaves = {}
    for key, item in value.items():
        leaves.update(_leaves(item, f"{prefix}.{key}" if prefix else key))
    return leaves
