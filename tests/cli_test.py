"""Tests for the `tf-lars` command line (the `tf_lars.cli` package)."""

import contextlib
import inspect
import io
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import tomllib

import keras
import matplotlib.image
import numpy as np
import pytest
import yaml

import tf_lars
import tf_lars.cli
from tests.cli_helpers import process_env, run_python
from tf_lars.cli.config import (
    ConfigError,
    apply_overrides,
    default_config,
    default_config_path,
    load_config,
    optimizer_from_block,
    parse_yaml,
    unused_settings,
)
from tf_lars.cli.main import main

REPO = pathlib.Path(__file__).resolve().parents[1]

# A training small enough for seconds: 5 epochs of 21 steps, an 8-filter CNN.
TINY_TRAIN = [
    "--set", "training.epochs=5",
    "--set", "training.batch_size=64",
    "--set", "model.width=8",
    "--set", "schedule.warmup_epochs=1",
    "--set", "optimizer.config.learning_rate=0.5",
]  # fmt: skip


def _assert_png(path, min_width=400, min_height=300):
    assert os.path.getsize(path) > 10_000
    image = matplotlib.image.imread(path)
    height, width = image.shape[:2]
    assert width >= min_width and height >= min_height
    # Not a blank canvas: the plot draws lines/colours over the background.
    assert float(np.std(image[..., :3])) > 0.02
    return image


# ------------------------------------------------------------- train: e2e
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    output = tmp_path_factory.mktemp("runs")
    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = main(
            [
                "train",
                *TINY_TRAIN,
                "--set", f"output_dir={output}",
                "--set", "run_name=tiny",
                "--set", "monitor.tensorboard=true",
            ]
        )  # fmt: skip
    return code, output / "tiny", out.getvalue()


def test_train_exit_code_and_run_folder(tiny_run):
    code, run_dir, _ = tiny_run
    assert code == 0
    names = sorted(os.listdir(run_dir))
    assert names == [
        "config.yaml",
        "curves.png",
        "history.json",
        "learning_rate.png",
        "model.keras",
        "summary.json",
        "tensorboard",
        "trust_ratio.png",
        "trust_ratios.npz",
    ]
    assert os.listdir(run_dir / "tensorboard")[0].startswith("events.out.tfevents")
    for name in ("curves.png", "learning_rate.png", "trust_ratio.png"):
        _assert_png(run_dir / name)


def test_train_history_is_finite_and_loss_falls(tiny_run):
    _, run_dir, _ = tiny_run
    history = json.loads((run_dir / "history.json").read_text())
    assert history["epoch"] == [1, 2, 3, 4, 5]
    for key, values in history.items():
        assert len(values) == 5, key
        assert all(v is not None and math.isfinite(v) for v in values), key
    loss = history["loss"]
    assert loss[-1] < 0.7 * loss[0]
    assert history["val_loss"][-1] < history["val_loss"][0]
    assert history["accuracy"][-1] > history["accuracy"][0] + 0.3
    paths = ["conv1/kernel", "conv1/bias", "conv2/kernel", "conv2/bias",
             "conv3/kernel", "conv3/bias", "logits/kernel", "logits/bias"]  # fmt: skip
    ratios = np.load(run_dir / "trust_ratios.npz")
    assert list(ratios["paths"]) == paths
    assert ratios["trust_ratios"].shape == (5, 8)
    assert list(ratios["steps"]) == [21, 42, 63, 84, 105]
    for index, path in enumerate(paths):
        np.testing.assert_allclose(
            history["trust_ratio/" + path], ratios["trust_ratios"][:, index], rtol=1e-6
        )
    # Learning rate of each epoch's last step, from the schedule: warm-up of
    # 21 steps to 0.5, then (1 - t/84)^2 decay.
    want = [
        0.5 * 20 / 21,
        *(0.5 * (1 - (21 * e - 1 - 21) / 84) ** 2 for e in (2, 3, 4, 5)),
    ]
    np.testing.assert_allclose(history["learning_rate_at_epoch_end"], want, rtol=1e-5)


def test_a_diverged_run_names_its_epoch_as_history_json_counts(tmp_path, run_cli):
    code, out, err = run_cli(
        "train", *TINY_TRAIN, "--set", f"output_dir={tmp_path}", "--set", "run_name=d",
        "--set", "optimizer={class_name: SGD, config: {learning_rate: 1.0e+12}}",
        "--set", "schedule.name=none", "--set", "training.epochs=3",
    )  # fmt: skip
    assert code == 0, err
    assert (
        "Training DIVERGED: the loss became NaN/inf in epoch 1; stopped there." in out
    )
    summary = json.loads((tmp_path / "d" / "summary.json").read_text())
    history = json.loads((tmp_path / "d" / "history.json").read_text())
    # 1-based, as history.json's epochs and the printed line (it was 0).
    assert summary["diverged"] is True and summary["diverged_epoch"] == 1
    assert history["epoch"] == [1] and summary["epochs_run"] == 1


def test_train_summary_stdout_and_saved_model_agree(tiny_run, capsys):
    _, run_dir, _ = tiny_run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["batch_size"] == 64
    assert summary["steps_per_epoch"] == 21
    assert summary["epochs_run"] == 5
    assert summary["diverged"] is False
    assert summary["optimizer"] == "LARS"
    assert summary["peak_learning_rate"] == pytest.approx(0.5, rel=1e-6)
    assert summary["learning_rate_schedule"]["config"]["warmup_steps"] == 21
    assert summary["learning_rate_schedule"]["config"]["decay_steps"] == 84
    assert summary["test_accuracy"] > 0.5
    # The saved model loads without custom objects and scores the same.
    model = keras.models.load_model(run_dir / "model.keras")
    assert isinstance(model.optimizer, tf_lars.LARS)
    schedule = keras.optimizers.schedules.deserialize(
        model.optimizer.get_config()["learning_rate"]
    )
    assert isinstance(schedule, tf_lars.WarmupPolynomialDecay)
    assert int(model.optimizer.iterations.numpy()) == 105
    data = load_config("train")["data"]
    from tf_lars.cli.data import load_data

    digits = load_data(data)
    logits = model.predict(digits.x_test, verbose=0)
    accuracy = float(np.mean(np.argmax(logits, axis=1) == digits.y_test))
    assert accuracy == pytest.approx(summary["test_accuracy"], abs=1e-6)


def test_train_prints_final_accuracies(tiny_run):
    _, run_dir, out = tiny_run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert f"Final train accuracy: {100 * summary['train_accuracy']:.2f}%" in out
    assert f"Final test accuracy:  {100 * summary['test_accuracy']:.2f}%" in out
    assert "Epoch 5/5" in out  # Keras progress output


def test_resolved_config_reloads_to_the_same_values(tiny_run):
    _, run_dir, _ = tiny_run
    resolved = load_config("train", run_dir / "config.yaml")
    assert resolved["training"]["epochs"] == 5
    assert resolved["model"]["width"] == 8
    assert resolved["optimizer"]["class_name"] == "LARS"
    config = resolved["optimizer"]["config"]
    assert config["learning_rate"] == 0.5
    assert config["trust_coefficient"] == 0.02
    assert config["exclude_from_layer_adaptation"] == []
    rebuilt = optimizer_from_block(resolved["optimizer"])
    assert rebuilt.get_config() == tf_lars.LARS(**config).get_config()


def test_user_npz_data_with_mlp(tmp_path, run_cli):
    rng = np.random.default_rng(0)
    centers = np.array([[3.0, 0, 0, 0], [0, 3.0, 0, 0], [0, 0, 3.0, 0]])
    y = rng.integers(0, 3, size=300)
    x = centers[y] + rng.normal(scale=0.5, size=(300, 4))
    path = tmp_path / "blobs.npz"
    np.savez(path, x_train=x[:240], y_train=y[:240], x_test=x[240:], y_test=y[240:])
    code, out, err = run_cli(
        "train",
        "--set", f"data.path={path}", "--set", "model.name=mlp",
        "--set", "model.width=16", "--set", "training.epochs=8",
        "--set", "training.batch_size=32", "--set", "schedule.warmup_epochs=1",
        "--set", "optimizer.config.learning_rate=1.0",
        "--set", f"output_dir={tmp_path}", "--set", "run_name=blobs",
    )  # fmt: skip
    assert code == 0, err
    assert "240 training / 60 test examples, 3 classes" in out
    summary = json.loads((tmp_path / "blobs" / "summary.json").read_text())
    assert summary["test_accuracy"] > 0.9
    assert summary["steps_per_epoch"] == 7


def test_mixed_precision_with_loss_scale(tmp_path, run_cli):
    code, out, err = run_cli(
        "train", *TINY_TRAIN, "--set", "training.epochs=2",
        "--set", "training.precision=mixed_float16",
        "--set", "loss_scale.enabled=true", "--set", "loss_scale.initial_scale=256",
        "--set", "loss_scale.dynamic_growth_steps=10",
        "--set", f"output_dir={tmp_path}", "--set", "run_name=mp",
    )  # fmt: skip
    assert code == 0, err
    summary = json.loads((tmp_path / "mp" / "summary.json").read_text())
    assert summary["optimizer"] == "LossScaleOptimizer"
    assert summary["inner_optimizer"] == "LARS"
    history = json.loads((tmp_path / "mp" / "history.json").read_text())
    # 21 finite steps per epoch, doubling every 10: 256 * 2**2, 256 * 2**4.
    assert history["loss_scale"] == [1024.0, 4096.0]
    assert keras.config.dtype_policy().name == "float32"  # restored
    model = keras.models.load_model(tmp_path / "mp" / "model.keras")
    assert isinstance(model.optimizer, tf_lars.LossScaleOptimizer)
    assert model.layers[1].compute_dtype == "float16"


def test_train_with_a_keras_optimizer_has_no_trust_ratio_outputs(tmp_path, run_cli):
    path = tmp_path / "sgd.yaml"
    path.write_text(
        "optimizer:\n  class_name: SGD\n"
        "  config: {learning_rate: 0.05, momentum: 0.9}\n"
        "training: {epochs: 3, batch_size: 64}\nschedule: {warmup_epochs: 1}\n"
        f"model: {{width: 8}}\noutput_dir: {tmp_path}\nrun_name: sgd\n"
    )
    code, out, err = run_cli("train", "--config", str(path))
    assert code == 0, err
    run_dir = tmp_path / "sgd"
    assert "trust_ratio.png" not in os.listdir(run_dir)
    history = json.loads((run_dir / "history.json").read_text())
    assert not [key for key in history if key.startswith("trust_ratio")]
    assert history["loss"][-1] < history["loss"][0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["optimizer"] == "SGD"
    assert summary["peak_learning_rate"] == pytest.approx(0.05, rel=1e-6)
    _assert_png(run_dir / "curves.png")


# ------------------------------------------------------------ bad inputs
def _write_npz(path, **arrays):
    np.savez(path, **arrays)
    return str(path)


def _good_arrays(n_train=20, n_test=10, shape=(8, 8)):
    rng = np.random.default_rng(1)
    return {
        "x_train": rng.random((n_train, *shape)),
        "y_train": np.arange(n_train) % 3,
        "x_test": rng.random((n_test, *shape)),
        "y_test": np.arange(n_test) % 3,
    }


def _bad_data_cases(tmp_path):
    good = _good_arrays()
    cases = {}
    cases["missing file"] = (
        str(tmp_path / "nope.npz"),
        [],
        f"data.path={tmp_path / 'nope.npz'}: file not found",
    )
    text = tmp_path / "text.npz"
    text.write_text("not an archive")
    cases["not npz"] = (
        str(text),
        [],
        "not an .npz archive; the file must be what numpy.savez writes, with the "
        "numeric arrays x_train, y_train, x_test, y_test",
    )
    renamed = {("X_train" if k == "x_train" else k): v for k, v in good.items()}
    cases["wrong names"] = (
        _write_npz(tmp_path / "names.npz", **renamed),
        [],
        "missing array(s) x_train; the file has X_train, x_test, y_test, y_train; "
        "expected x_train, y_train, x_test, y_test",
    )
    cases["length mismatch"] = (
        _write_npz(tmp_path / "len.npz", **{**good, "y_train": good["y_train"][:19]}),
        [],
        "x_train has 20 examples but y_train has 19",
    )
    cases["feature mismatch"] = (
        _write_npz(
            tmp_path / "feat.npz", **{**good, "x_test": good["x_test"][:, :, :7]}
        ),
        [],
        "x_train examples have shape (8, 8) but x_test examples have shape (8, 7)",
    )
    negative = good["y_train"].copy()
    negative[3] = -1
    cases["negative label"] = (
        _write_npz(tmp_path / "neg.npz", **{**good, "y_train": negative}),
        [],
        "labels out of range: y_train holds class ids in [-1, 2] but they must be "
        "in [0, 2] (num_classes=3)",
    )
    high = good["y_test"].copy()
    high[0] = 5
    cases["label >= num_classes"] = (
        _write_npz(tmp_path / "high.npz", **{**good, "y_test": high}),
        ["--set", "data.num_classes=3"],
        "labels out of range: y_test holds class ids in [0, 5] but they must be "
        "in [0, 2] (num_classes=3)",
    )
    cases["fractional labels"] = (
        _write_npz(tmp_path / "frac.npz", **{**good, "y_train": good["y_train"] + 0.5}),
        [],
        "y_train must hold integer class ids",
    )
    cases["2-D labels"] = (
        _write_npz(
            tmp_path / "onehot.npz", **{**good, "y_train": np.eye(3)[good["y_train"]]}
        ),
        [],
        "y_train must be a 1-D array of class ids, got shape (20, 3)",
    )
    nan = good["x_train"].copy()
    nan[0, 0, 0] = np.nan
    cases["nan features"] = (
        _write_npz(tmp_path / "nan.npz", **{**good, "x_train": nan}),
        [],
        "x_train holds NaN or infinite values",
    )
    flat = _good_arrays(shape=(5,))
    cases["cnn on flat features"] = (
        _write_npz(tmp_path / "flat.npz", **flat),
        [],
        "`model.name`=cnn needs image examples of shape (H, W) or (H, W, C)",
    )
    return cases


BAD_DATA = [
    "missing file", "not npz", "wrong names", "length mismatch", "feature mismatch",
    "negative label", "label >= num_classes", "fractional labels", "2-D labels",
    "nan features", "cnn on flat features",
]  # fmt: skip


@pytest.mark.parametrize("case", BAD_DATA)
def test_bad_data_train(case, tmp_path, one_line_error, run_cli):
    path, extra, expected = _bad_data_cases(tmp_path)[case]
    output = tmp_path / "out"
    code, _, err = run_cli(
        "train", "--set", f"data.path={path}", *extra,
        "--set", "training.batch_size=4", "--set", f"output_dir={output}",
    )  # fmt: skip
    assert expected in one_line_error(code, err, "train")
    assert not output.exists()  # nothing written for a refused run


def test_bad_data_study(tmp_path, one_line_error, run_cli):
    path, _, expected = _bad_data_cases(tmp_path)["wrong names"]
    code, _, err = run_cli(
        "study", "--set", "workload=data", "--set", f"data.path={path}"
    )
    assert expected in one_line_error(code, err, "study")


def test_bad_data_in_a_real_process_has_no_traceback(tmp_path):
    python_path = os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")])
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=python_path)
    missing = tmp_path / "missing.npz"
    process = subprocess.run(
        [sys.executable, "-m", "tf_lars.cli", "train", "--set", f"data.path={missing}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert process.returncode == 2
    assert "Traceback" not in process.stderr
    ours = [line for line in process.stderr.splitlines() if "tf-lars" in line]
    assert ours == [f"tf-lars train: error: data.path={missing}: file not found"]
    assert process.stdout == ""


BAD_CONFIG = [
    (["--set", "trainng.epochs=3"], "Unknown config key `trainng`. Valid keys in the "
     "config: seed, output_dir, run_name, data, model, training, schedule, optimizer"),
    (["--set", "training.epoch=3"], "Unknown config key `training.epoch`. Valid keys "
     "in `training`: epochs, batch_size, precision, jit_compile, verbose"),
    (["--set", "training.epochs=ten"],
     "`training.epochs` must be an int >= 1. Received: training.epochs='ten'"),
    (["--set", "training.epochs=true"], "Received: training.epochs=True"),
    (["--set", "training.epochs=0"], "Received: training.epochs=0"),
    (["--set", "run_name=2020-01-01"], "or null (YAML read this value as a date: "
     "quote it to give it as text). Received: run_name=datetime.date(2020, 1, 1)"),
    (["--set", "data={1: 2}"], "Config keys must be strings: `data` has the key 1 "
     "(quote it to give it as text)"),
    (["--set", "training.batch_size=half"],
     "`training.batch_size` must be an int >= 1 or 'full'"),
    (["--set", "data.test_fraction=1.5"],
     "`data.test_fraction` must be a finite number in (0.0, 1.0)"),
    (["--set", "model.name=resnet"],
     "`model.name` must be one of ['cnn', 'mlp']. Received: model.name='resnet'"),
    (["--set", "training.precision=float8"], "`training.precision` must be one of"),
    (["--set", "loss_scale.enabled=yes please"], "`loss_scale.enabled` must be true "
     "or false. Received: loss_scale.enabled='yes please'"),
    (["--set", "optimizer.config.eeta=0.1"], "Unknown config key "
     "`optimizer.config.eeta`: not an argument of LARS. Valid keys: "),
    (["--set", "optimizer.config.nesterov=1"],
     "`optimizer.config.nesterov` must be true or false"),
    (["--set", "optimizer.config.momentum=fast"],
     "`optimizer.config.momentum` must be a number"),
    (["--set", "optimizer.config.momentum=1.5"], "`optimizer.config`: `momentum` "
     "must be"),
    (["--set", "optimizer.config.trust_ratio=weird"],
     "Received: trust_ratio='weird'"),
    (["--set", "optimizer.class_name=Foo"], "`optimizer.class_name` must be an "
     "optimizer's class name alone (no module path): LAMB, LARS (tf_lars), Adadelta, "),
    # A module path: `tf_lars.__getattr__` raised ModuleNotFoundError for it.
    (["--set", "optimizer={class_name: keras.optimizers.SGD}"], "(keras.optimizers), "
     "or a name registered with Keras. Received: "
     "optimizer.class_name='keras.optimizers.SGD'"),
    (["--set", "optimizer.class_name=SGD"], "Unknown config key "
     "`optimizer.config.trust_coefficient`: not an argument of SGD"),
    (["--set", "optimizer.class_name=SGD"], "use_ema, weight_decay (`--set "
     "optimizer.class_name` changes the class alone: the block's other arguments "
     "stay; give the whole block, e.g. --set 'optimizer={class_name: SGD}')"),
    (["--set", "optimizer.class_name=LossScaleOptimizer"], "names a loss-scale "
     "wrapper"),
    (["--set", "optimizer.bogus=1"], "Unknown config key `optimizer.bogus`"),
    (["--set", "training.epochs"],
     "`--set` must be given as key=value. Received: --set 'training.epochs'"),
    (["--set", "seed.x=1"], "`--set seed.x`: `seed` is not a block of keys"),
    (["--set", "training.batch_size=5000"], "`training.batch_size` must be at most "
     "the training set size (1347) or 'full'. Received: training.batch_size=5000"),
    (["--set", "schedule.warmup_epochs=200"],
     "`schedule.warmup_epochs` must be less than the number of epochs (100)"),
    (["--set", "schedule.end_learning_rate=5.0"],
     "schedule: `end_learning_rate` must be a finite number in"),
    (["--set", "loss_scale.enabled=true", "--set", "loss_scale.initial_scale=-1"],
     "`loss_scale.initial_scale` must be a finite number > 0.0"),
    (["--set", "training.epochs=[1"], "--set training.epochs: not valid YAML"),
    (["--config", "/nonexistent/dir/c.yaml"],
     "--config /nonexistent/dir/c.yaml: cannot read: No such file or directory"),
]  # fmt: skip


@pytest.mark.parametrize("argv, expected", BAD_CONFIG)
def test_bad_config_train(argv, expected, tmp_path, one_line_error, run_cli):
    output = tmp_path / "out"
    code, _, err = run_cli("train", *argv, "--set", f"output_dir={output}")
    assert expected in one_line_error(code, err, "train")
    assert not output.exists()


def test_bad_config_file_contents(tmp_path, one_line_error, run_cli):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("training: {epochs: 3\n")
    code, _, err = run_cli("train", "--config", str(bad_yaml))
    assert f"--config {bad_yaml}: not valid YAML" in one_line_error(code, err, "train")
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("training:\n  epochs: 3\n  bogus: 1\n")
    code, _, err = run_cli("train", "--config", str(unknown))
    assert "Unknown config key `training.bogus`" in one_line_error(code, err, "train")
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    code, _, err = run_cli("train", "--config", str(listing))
    assert "must hold a mapping of config keys" in one_line_error(code, err, "train")


def test_a_key_given_twice_is_refused(tmp_path, one_line_error, run_cli):
    # PyYAML keeps the later value silently; the run would train with it
    # (for one cheap epoch, in the folder `o`).
    cheap = ["--set", f"output_dir={tmp_path / 'o'}", "--set", "training.epochs=1",
             "--set", "schedule.name=none", "--set", "training.verbose=0"]  # fmt: skip
    twice = tmp_path / "twice.yaml"
    twice.write_text("optimizer:\n  config:\n    learning_rate: 0.1\n"
                     "    momentum: 0.9\n    learning_rate: 5.0\n")  # fmt: skip
    code, _, err = run_cli("train", "--config", str(twice), *cheap)
    assert one_line_error(code, err) == (
        f"tf-lars train: error: --config {twice}: refused: the YAML has the key "
        "'learning_rate' twice in one mapping (lines 3 and 5); give each key once"
    )
    code, _, err = run_cli(
        "train", "--set", "optimizer={class_name: SGD, class_name: Adam}", *cheap
    )
    assert one_line_error(code, err) == (
        "tf-lars train: error: --set optimizer: refused: the YAML has the key "
        "'class_name' twice in one mapping (line 1); give each key once"
    )
    # A merge key (`<<`) takes an alias, which a config never needs.
    with pytest.raises(ConfigError, match=r"^m: refused: the YAML uses the alias \*b;"):
        parse_yaml("base: &b {x: 1, y: 2}\nd:\n  <<: *b\n  x: 3\n", "m")
    assert not (tmp_path / "o").exists()


def test_command_line_usage_errors(run_cli):
    code, _, err = run_cli("fly")
    assert code == 2
    assert "invalid choice: 'fly'" in err
    code, _, err = run_cli()
    assert code == 2
    assert "the following arguments are required: COMMAND" in err
    code, out, _ = run_cli("--help")
    assert code == 0
    for command in ("train", "study", "bench"):
        assert command in out


# ------------------------------------------------------------ config logic
def test_optimizer_block_is_get_config_saved_from_python(tmp_path):
    optimizer = tf_lars.LARS(
        learning_rate=0.7,
        momentum=0.8,
        weight_decay=1e-4,
        trust_coefficient=0.01,
        nesterov=True,
        exclude_from_weight_decay=["bias", "<1d>"],
        exclude_from_layer_adaptation=[],
        clipnorm=2.0,
    )
    path = tmp_path / "saved.yaml"
    path.write_text(
        yaml.safe_dump({"optimizer": keras.optimizers.serialize(optimizer)})
    )
    config = load_config("train", path)
    assert config["optimizer"]["registered_name"] == "tf_lars>LARS"
    rebuilt = optimizer_from_block(config["optimizer"])
    assert type(rebuilt) is type(optimizer) and isinstance(rebuilt, tf_lars.LARS)
    assert rebuilt.get_config() == optimizer.get_config()
    # A plain Keras optimizer works the same way.
    sgd = keras.optimizers.SGD(learning_rate=0.3, momentum=0.5, nesterov=True)
    path.write_text(yaml.safe_dump({"optimizer": keras.optimizers.serialize(sgd)}))
    rebuilt = optimizer_from_block(load_config("train", path)["optimizer"])
    assert type(rebuilt) is keras.optimizers.SGD
    assert rebuilt.get_config() == sgd.get_config()


def test_optimizer_with_schedule_saved_from_python(tmp_path, run_cli):
    schedule = tf_lars.WarmupPolynomialDecay(0.4, 21, 42, end_learning_rate=0.01)
    optimizer = tf_lars.LARS(learning_rate=schedule, trust_coefficient=0.02)
    path = tmp_path / "sched.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "optimizer": keras.optimizers.serialize(optimizer),
                "schedule": {"name": "none"},
                "training": {"epochs": 3, "batch_size": 64},
                "model": {"width": 4},
                "output_dir": str(tmp_path),
                "run_name": "s",
            }
        )
    )
    rebuilt = optimizer_from_block(load_config("train", path)["optimizer"])
    assert rebuilt.get_config()["learning_rate"]["config"] == schedule.get_config()
    code, _, err = run_cli("train", "--config", str(path))
    assert code == 0, err
    history = json.loads((tmp_path / "s" / "history.json").read_text())
    want = [float(schedule(s)) for s in (20, 41, 62)]
    np.testing.assert_allclose(history["learning_rate_at_epoch_end"], want, rtol=1e-6)


def test_set_values_are_parsed_as_yaml():
    config = apply_overrides(
        default_config("study"),
        [
            "optimizers.1.optimizer.config.weight_decay=1e-4",
            "study.batch_sizes=[64, 128]",
            "run_name=null",
            "data.path=",
            "training.jit_compile=false",
            "optimizers.0.learning_rate=[0.1, 2]",
        ],
    )
    assert config["optimizers"][1]["optimizer"]["config"]["weight_decay"] == 1e-4
    assert isinstance(
        config["optimizers"][1]["optimizer"]["config"]["weight_decay"], float
    )
    assert config["study"]["batch_sizes"] == [64, 128]
    assert config["run_name"] is None and config["data"]["path"] is None
    assert config["training"]["jit_compile"] is False
    assert config["optimizers"][0]["learning_rate"] == [0.1, 2]


def test_user_file_merges_over_default_and_replaces_optimizer(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "training:\n  epochs: 7\n"
        "optimizer:\n  class_name: Adam\n  config:\n    learning_rate: 1.0e-3\n"
    )
    config = load_config("train", path, ["training.batch_size=full"])
    assert config["training"] == {
        "epochs": 7,
        "batch_size": "full",
        "precision": "float32",
        "jit_compile": "auto",
        "verbose": 1,
    }
    assert config["optimizer"] == {
        "class_name": "Adam",
        "config": {"learning_rate": 0.001},
    }
    assert type(optimizer_from_block(config["optimizer"])) is keras.optimizers.Adam


def test_every_optimizer_block_of_a_user_file_replaces_the_default_one(tmp_path):
    # The outer optimizers too: before, they were merged key by key, so SGD
    # took the default's Nesterov momentum and Adam was refused its `momentum`.
    path = tmp_path / "c.yaml"
    path.write_text(
        "outer_optimizer: {class_name: SGD, config: {learning_rate: 0.5}}\n"
        "async_outer_optimizer: {class_name: Adam, config: {learning_rate: 0.01}}\n"
    )
    config = load_config("lowcomm", path)
    assert config["outer_optimizer"] == {
        "class_name": "SGD",
        "config": {"learning_rate": 0.5},
    }
    assert config["async_outer_optimizer"]["config"] == {"learning_rate": 0.01}
    path.write_text(
        "distribute:\n  diloco:\n    outer_optimizer:\n      class_name: Adam\n"
    )
    block = load_config("train", path)["distribute"]["diloco"]
    assert block["outer_optimizer"] == {"class_name": "Adam", "config": {}}
    assert (
        block["sync_every"]
        == default_config("train")["distribute"]["diloco"]["sync_every"]
    )


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("cls", [tf_lars.LARS, tf_lars.LAMB])
def test_a_tf_lars_block_takes_its_class_s_own_arguments(cls):
    # LAMB forwards **kwargs to TrustRatio, whose `inner_optimizer` LAMB
    # refuses: the keys a refusal lists are LAMB's own.
    from tf_lars.cli.config import constructor_parameters

    own = set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}
    assert set(constructor_parameters(cls)) == own
    assert "inner_optimizer" not in own


def test_a_value_of_a_block_that_is_off_is_named_unused():
    sets = [
        "schedule.name=none",
        "schedule.power=3",
        "schedule.base_batch_size=64",  # scales the rate even with no schedule
        "loss_scale.initial_scale=1024",
        "distribute.diloco.sync_every=10",
        "distribute.agn.communication_period=5",
        "distribute.diloco.compression=none",  # the default's value
    ]
    assert unused_settings("train", load_config("train", None, sets), None, sets) == [
        "`schedule.power` (3.0) is not used: `schedule.name` is none",
        "`loss_scale.initial_scale` (1024.0) is not used: `loss_scale.enabled` is "
        "false",
        "`distribute.diloco.sync_every` (10) is not used: `distribute.strategy` is "
        "none",
        "`distribute.agn.communication_period` (5) is not used: `distribute.strategy` "
        "is none",
    ]
    sets += ["distribute.strategy=diloco", "loss_scale.enabled=true"]
    assert unused_settings("train", load_config("train", None, sets), None, sets) == [
        "`schedule.power` (3.0) is not used: `schedule.name` is none",
        "`distribute.agn.communication_period` (5) is not used: `distribute.strategy` "
        "is diloco",
    ]


@pytest.mark.parametrize("command", ["train", "study", "lowcomm"])
def test_a_copy_of_the_default_config_names_nothing_unused(command):
    path = REPO / "configs" / f"{command}.yaml"
    assert unused_settings(command, load_config(command, path), path) == []


# -------------------------------------------------------- shipped configs
@pytest.mark.parametrize("command", ["train", "study", "lowcomm"])
def test_the_located_defaults_are_the_repository_configs(command):
    # In a source checkout the defaults are configs/*.yaml themselves.
    top_level = REPO / "configs" / f"{command}.yaml"
    located = default_config_path(command)
    assert pathlib.Path(located) == top_level
    assert located.read_bytes() == top_level.read_bytes()
    config = load_config(command)  # validates
    assert config["seed"] == 0
    assert load_config(command, top_level) == config


def _installed_copy(root):
    """`tf_lars` laid out as the build installs it: configs/ as package data."""
    for source in (REPO / "tf_lars").rglob("*.py"):
        target = root / source.relative_to(REPO)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(source.read_bytes())
    data = root / "tf_lars" / "cli" / "configs"
    data.mkdir()
    for source in (REPO / "configs").glob("*.yaml"):
        (data / source.name).write_bytes(source.read_bytes())
    return data


def test_installed_package_reads_its_package_data(tmp_path):
    data = _installed_copy(tmp_path)
    script = textwrap.dedent(
        """
        import sys
        sys.argv = ["tf-lars"]  # lazy tf_lars: no TensorFlow needed here
        from tf_lars.cli.config import default_config_path, load_config
        for command in ("train", "study", "lowcomm"):
            print(default_config_path(command))
            load_config(command)
        print("tensorflow" in sys.modules)
        """
    )
    process = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(tmp_path)),
        timeout=120,
    )
    assert process.returncode == 0, process.stderr
    assert process.stdout.split() == [
        str(data / "train.yaml"),
        str(data / "study.yaml"),
        str(data / "lowcomm.yaml"),
        "False",
    ]


def test_pyproject_installs_configs_as_package_data():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    setuptools = pyproject["tool"]["setuptools"]
    assert setuptools["package-dir"]["tf_lars.cli.configs"] == "configs"
    assert setuptools["package-data"]["tf_lars.cli.configs"] == ["*.yaml"]
    assert {"tf_lars.cli", "tf_lars.cli.configs"} <= set(setuptools["packages"])
    assert not (REPO / "tf_lars" / "configs").exists()  # one source only


@pytest.mark.parametrize("command", ["train", "study", "lowcomm"])
def test_every_config_key_has_a_comment(command):
    text = (REPO / "configs" / f"{command}.yaml").read_text()
    undocumented = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        body = stripped.split("#", 1)[0]
        is_key = ":" in body and not body.rstrip().endswith(":")
        if is_key and "#" not in stripped:
            undocumented.append(line)
    assert undocumented == []


def test_pyproject_declares_the_console_script():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"] == {"tf-lars": "tf_lars.cli.main:main"}
    cli = pyproject["project"]["optional-dependencies"]["cli"]
    for package in ("pyyaml", "matplotlib", "scikit-learn", "pydantic", "rich"):
        assert any(entry.startswith(package) for entry in cli), package


# ------------------------------------------------------------------ bench
def test_bench_is_not_a_command_of_the_installed_command_line(run_cli):
    # The step benchmarks are benchmarks/bench.py of a source checkout.
    code, out, err = run_cli("bench", "--repeats", "2")
    assert code == 2
    assert out == ""
    assert err.splitlines()[-1] == (
        "tf-lars: error: argument COMMAND: invalid choice: 'bench' "
        "(choose from 'train', 'study', 'lowcomm')"
    )
    assert "Traceback" not in err


# ------------------------------------------------- console script, TF logs
def _console_script(directory):
    """A `tf-lars` script like the one pip writes (argv[0] ends in tf-lars)."""
    script = directory / "tf-lars"
    script.write_text(
        "import sys\n"
        "from tf_lars.cli.main import main\n"
        "if __name__ == '__main__':\n"
        "    sys.exit(main())\n"
    )
    return script


HELP_PROBE = textwrap.dedent(
    """
    import sys
    sys.argv = ["/usr/bin/tf-lars", *ARGS]
    from tf_lars.cli.main import main
    code = main()
    heavy = sorted(m for m in ("tensorflow", "keras", "numpy") if m in sys.modules)
    print("CODE", code, "HEAVY", heavy)
    """
)


@pytest.mark.parametrize(
    "args, expected",
    [
        ([], "usage: tf-lars [-h] [--tf-log] COMMAND"),
        (["train"], "usage: tf-lars train [-h] [--config FILE] [--set KEY=VALUE]"),
        (["study"], "usage: tf-lars study [-h] [--config FILE] [--set KEY=VALUE]"),
    ],
)
def test_help_does_not_import_tensorflow(args, expected, tmp_path):
    process = subprocess.run(
        [sys.executable, "-c", HELP_PROBE.replace("ARGS", repr([*args, "--help"]))],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=process_env(),
        timeout=120,
    )
    assert process.returncode == 0, process.stderr
    assert process.stdout.startswith(expected), process.stdout
    assert "--tf-log" in process.stdout
    assert process.stdout.rstrip().endswith("CODE 0 HEAVY []")
    assert process.stderr == ""


TF_LOG_LINE = re.compile(
    r"^[IWEF]\d{4} |absl::InitializeLog|cpu_feature_guard|oneDNN|cudart|cuInit",
    re.M,
)


def test_console_script_train_writes_no_tensorflow_log_lines(tmp_path):
    script = _console_script(tmp_path)
    process = subprocess.run(
        [sys.executable, str(script), "train", *TINY_TRAIN,
         "--set", "training.epochs=1", "--set", "training.verbose=0",
         "--set", "schedule.name=none", "--set", f"output_dir={tmp_path}",
         "--set", "run_name=quiet"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=process_env(),
        timeout=300,
    )  # fmt: skip
    assert process.returncode == 0, process.stderr
    assert "Final test accuracy:" in process.stdout
    assert TF_LOG_LINE.search(process.stderr) is None, process.stderr


def test_missing_cli_extra_is_a_clean_error(tmp_path):
    probe = (
        "import sys\n"
        "sys.modules['pydantic'] = None  # as without the `cli` extra\n"
        "sys.argv = ['/usr/bin/tf-lars', 'train']\n"
        "from tf_lars.cli.main import main\n"
        "sys.exit(main())\n"
    )
    process = run_python(probe, tmp_path)
    assert process.returncode == 2
    assert process.stderr.strip() == (
        "tf-lars train: error: the command line needs the `cli` extra: "
        "pip install \"tf_lars[cli]\" (no module named 'pydantic')"
    )


def test_another_backend_without_tensorflow_names_both_fixes(tmp_path):
    # One line for both: after setting KERAS_BACKEND=tensorflow alone, the
    # user met a second error asking for the extra.
    probe = (
        "import sys\n"
        "sys.modules['tensorflow'] = None  # as without TensorFlow installed\n"
        "from tf_lars.cli.main import main\n"
        "sys.exit(main(['train']))\n"
    )
    process = run_python(probe, tmp_path, KERAS_BACKEND="jax")
    assert process.returncode == 2
    assert process.stderr == (
        "tf-lars train: error: the command line needs Keras's TensorFlow backend, "
        "and Keras is set to the 'jax' backend (KERAS_BACKEND or keras.json); "
        'install the `cli` extra (pip install "tf_lars[cli]"; no module named '
        "'tensorflow') and set KERAS_BACKEND=tensorflow\n"
    )
    assert os.listdir(tmp_path) == []


def test_tf_log_leaves_tensorflow_logging_on(tmp_path):
    # --tf-log sets no level: TensorFlow's own default prints its INFO lines.
    # (An optimizer block is checked once TensorFlow is imported.)
    process = subprocess.run(
        [sys.executable, str(_console_script(tmp_path)), "--tf-log", "train",
         "--set", "optimizer.class_name=Foo"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=process_env(),
        timeout=300,
    )  # fmt: skip
    assert process.returncode == 2
    assert TF_LOG_LINE.search(process.stderr) is not None, process.stderr
    ours = [line for line in process.stderr.splitlines() if "tf-lars" in line]
    assert len(ours) == 1 and ours[0].startswith(
        "tf-lars train: error: `optimizer.class_name` must be an optimizer's class "
        "name alone (no module path): LAMB, LARS (tf_lars), "
    )
    assert ours[0].endswith("Received: optimizer.class_name='Foo'")


def test_optimizer_blocks_build_the_class_they_name():
    # Keras's deserializer reads the name of any of its own optimizers in
    # any case: a release that lists its `Lamb` there must not build it for
    # "LAMB".
    for class_name, cls in (
        ("LAMB", tf_lars.LAMB),
        ("Lamb", keras.optimizers.Lamb),
        ("LARS", tf_lars.LARS),
        ("SGD", keras.optimizers.SGD),
    ):
        optimizer = optimizer_from_block({"class_name": class_name, "config": {}})
        assert type(optimizer) is type(cls()), class_name  # the backend subclass


def test_the_command_line_datasets_are_not_autotuned():
    # An autotuned iterator left to Python's collector stalled `tf-lars
    # study` for 20 to 80 s (docs/guides/cli.md): in one process (a study's
    # trials) every dataset `fit` and `evaluate` read has tf.data's
    # autotuning off, and the evaluation sets are the arrays in order, in
    # batches of EVALUATION_BATCH_SIZE.
    from tf_lars.cli import train
    from tf_lars.cli.train import EVALUATION_BATCH_SIZE, _evaluation_data

    x = np.arange(2100, dtype="float32").reshape(-1, 1)
    y = np.arange(2100) % 10
    assert train.make_dataset(x, y, 8, seed=7).options().autotune.enabled is False
    evaluation = _evaluation_data(x, y, None)["x"]
    assert evaluation.options().autotune.enabled is False
    batches = [b[0].numpy()[:, 0] for b in evaluation]
    assert [len(b) for b in batches] == [EVALUATION_BATCH_SIZE] * 2 + [52]
    np.testing.assert_array_equal(np.concatenate(batches), x[:, 0])
