"""What `tf-lars --help`, the CLI docstrings, the README and the guides say is true.

Every `tf-lars` command they show is valid: the help text's examples run
for real; the README's, the guides' and the docstrings' go through every check up to
the training itself (which `fit_once` / `execute` would start).
"""

import ast
import pathlib
import re
import shlex

import keras
import numpy as np
import pytest
import yaml

import tf_lars
from tests import benchmark_scripts
from tf_lars.cli import main as main_module
from tf_lars.cli import study, train
from tf_lars.cli.config import load_config
from tf_lars.cli.main import main

REPO = pathlib.Path(__file__).resolve().parents[1]
BENCH = "benchmarks/bench.py"  # the step benchmarks: a script of the checkout
bench = benchmark_scripts.load("bench")
README = (REPO / "README.md").read_text()
GUIDES = {
    path.name: path.read_text() for path in (REPO / "docs" / "guides").glob("*.md")
}
# What a user reads: the front page and the guides it links to.
DOCUMENTATION = "\n".join([README, *(GUIDES[name] for name in sorted(GUIDES))])
PLACEHOLDER = re.compile(r"\[--|\.\.\.|COMMAND|FILE|key=value|\bargs\b")


def _help(capsys, *argv):
    assert main([*argv, "--help"]) == 0
    return capsys.readouterr().out


def _help_examples(capsys, command):
    text = " ".join(_help(capsys, command).split())
    return re.findall(r"e\.g\. (--set \S+=\S+)", text)


def test_train_help_example_runs(capsys, tmp_path, monkeypatch):
    examples = _help_examples(capsys, "train")
    assert examples == ["--set training.epochs=20"]
    monkeypatch.chdir(tmp_path)
    for example in examples:
        argv = ["train", *shlex.split(example), "--set", "run_name=help"]
        assert main(argv) == 0, capsys.readouterr().err
        assert (tmp_path / "runs" / "help" / "model.keras").is_file()


def test_study_help_names_the_default_optimizers(capsys):
    labels = [entry["label"] for entry in load_config("study")["optimizers"]]
    assert labels == ["Nesterov", "AdamW", "LARS", "LAMB"]
    for text in (_help(capsys), _help(capsys, "study")):
        flat = " ".join(text.split())
        for label in labels:
            assert label in flat


def _commands(text):
    """`tf-lars train|study ...` and `python benchmarks/bench.py ...` commands.

    Of `text`, continuations joined.
    """
    text = text.replace("\\\n", " ")
    found = []
    pattern = (
        r"(?:tf-lars (?:--tf-log )?(?:train|study)|python benchmarks/bench\.py)"
        r"(?=[ `\n]|$)[^`\n&#]*"
    )
    for match in re.finditer(pattern, text):
        command = match.group(0).strip()
        argv = shlex.split(command)[1:]
        if not PLACEHOLDER.search(command) and argv not in found:
            found.append(argv)
    return found


def _docstring_commands():
    found = []
    for source in (REPO / "tf_lars" / "cli").glob("*.py"):
        for call in re.findall(r">>> main\((\[.*?\])\)", source.read_text()):
            found.append(ast.literal_eval(call))
    return found


class _Checked(Exception):
    """Raised where training would start: every check before it passed."""


def _write_users_files(folder):
    """The files the documented commands name as the user's own."""
    rng = np.random.default_rng(0)
    # Larger than the study's largest default batch (512), with a validation split.
    arrays = {
        "x_train": rng.random((900, 8, 8)), "y_train": np.arange(900) % 3,
        "x_test": rng.random((60, 8, 8)), "y_test": np.arange(60) % 3,
    }  # fmt: skip
    for name in ("my_data.npz", "d.npz"):
        np.savez(folder / name, **arrays)
    optimizer = tf_lars.LARS(
        learning_rate=2.0,
        trust_coefficient=0.02,
        exclude_from_weight_decay=["<1d>"],
        exclude_from_layer_adaptation=[],
    )
    (folder / "mine.yaml").write_text(
        yaml.safe_dump({"optimizer": keras.optimizers.serialize(optimizer)})
    )
    (folder / "runs" / "x").mkdir(parents=True)
    (folder / "runs" / "x" / "config.yaml").write_bytes(
        (REPO / "configs" / "train.yaml").read_bytes()
    )


DOCUMENTED_COMMANDS = _commands(DOCUMENTATION)
_SOURCES = "\n".join(
    path.read_text() for path in (REPO / "tf_lars" / "cli").glob("*.py")
)
DOCSTRING_COMMANDS = [
    argv
    for argv in _docstring_commands() + _commands(_SOURCES)
    if argv not in DOCUMENTED_COMMANDS
]


def test_the_documentation_shows_commands_of_each_kind():
    kinds = {
        argv[0] if argv[0] != "--tf-log" else argv[1] for argv in DOCUMENTED_COMMANDS
    }
    assert kinds == {"train", "study", BENCH}
    assert len(DOCUMENTED_COMMANDS) >= 10
    assert ["train", "--set", "training.epochs=20"] in DOCSTRING_COMMANDS
    assert ["train", "--config", "mine.yaml"] in DOCUMENTED_COMMANDS


@pytest.mark.parametrize(
    "argv", DOCUMENTED_COMMANDS + DOCSTRING_COMMANDS, ids=lambda argv: " ".join(argv)
)
def test_every_documented_command_is_valid(argv, tmp_path, monkeypatch, capsys):
    if argv[0] == BENCH:
        bench.parse_arguments(argv[1:])  # exits 2 if bad
        return
    _write_users_files(tmp_path)
    monkeypatch.chdir(tmp_path)

    def stop(*args, **kwargs):
        raise _Checked

    monkeypatch.setattr(train, "fit_once", stop)
    monkeypatch.setattr(study, "execute", stop)
    # A new process would split the CPU; this one has set up its devices.
    monkeypatch.setattr(
        train,
        "make_distribution",
        lambda config: train.Distribution(None, "none", 1, 1, True, None),
    )
    monkeypatch.setattr(main_module, "quiet_python_logs", lambda: None)
    with pytest.raises(_Checked):
        code = main(argv)
        pytest.fail(f"exit status {code}: {capsys.readouterr().err}")


# ----------------------------------------------------------- README text
def test_readme_trust_ratio_monitor_snippet_gives_its_key():
    block = re.search(
        r"## `tf_lars.callbacks.TrustRatioMonitor`\n\n```python\n(.*?)```",
        GUIDES["cli.md"],
        re.S,
    ).group(1)
    rng = np.random.default_rng(0)
    namespace = {
        "keras": keras,
        "tf_lars": tf_lars,
        "x": rng.random((16, 8, 8, 1)).astype("float32"),
        "y": np.arange(16) % 10,
    }
    lines = block.splitlines()
    keys = re.findall(r'history\.history\["([^"]+)"\]', block)
    exec("\n".join(line for line in lines if "history.history[" not in line), namespace)
    history = namespace["history"].history
    assert keys == ["trust_ratio/sequential/conv1/kernel"]
    assert len(history[keys[0]]) == 3
    assert namespace["monitor"].paths[0] == "sequential/conv1/kernel"


def test_readme_speed_section_has_one_xla_dense_table_with_its_command():
    assert DOCUMENTATION.count("| dense step, ResNet-50 shapes, XLA |") == 1
    benchmarks = GUIDES["benchmarks.md"]
    speed = benchmarks[benchmarks.index("## Speed") : benchmarks.index("## AGN")]
    table = speed.index("| dense step, ResNet-50 shapes, XLA |")
    assert "measured 2026-11-23 with the third command above" in speed[:table]
    assert (
        "python benchmarks/bench.py --only dense --only adaptive --no-optax "
        "--repeats 10" in (speed[:table])
    )


def test_readme_quickstart_time_says_what_was_measured():
    quickstart = README[README.index("## Quickstart") : README.index("## Supported")]
    assert "about 15 seconds" not in quickstart
    assert (
        "`time tf-lars train` took 9.2 s to 14.9 s wall in five runs, TensorFlow's "
        "start-up included, on 2 idle CPU cores"
    ) in " ".join(quickstart.split())


@pytest.mark.parametrize(
    "command, example",
    [("study", "study.trials=4"), ("lowcomm", "training.steps=300")],
)
def test_each_help_example_is_a_key_of_its_command(capsys, command, example):
    # Both gave train's `training.epochs=20`, which they refuse.
    assert _help_examples(capsys, command) == [f"--set {example}"]
    key, value = example.split("=")
    config = load_config(command, overrides=[example])
    section, name = key.split(".")
    assert config[section][name] == int(value)
