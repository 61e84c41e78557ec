"""`tf-lars train` distributed: the `distribute` config block.

A two-replica run with a per-replica batch of 32 is compared with a
one-process run with batch 64 (the same global batch, seed and learning
rate): mirrored on two logical CPUs in its own process, and two
MultiWorkerMirroredStrategy workers started by the launcher.
"""

import collections
import json
import os
import re
import signal
import subprocess
import sys
import types

import keras
import numpy as np
import pytest
import tensorflow as tf
import yaml

import tf_lars
from tests.distribute_launch_helpers import LaunchedCluster, launcher_env
from tf_lars.cli.config import ConfigError, default_config
from tf_lars.cli.main import main
from tf_lars.cli.train import (
    describe_batches,
    epoch_orders,
    evaluation_batch_size,
    global_batch_size,
    make_dataset,
)

TIMEOUT = 300
# 3 epochs of 14 steps of a global batch of 64 (898 training digits: 2
# dropped per epoch). The peak learning rate 0.25 x 64 / 32 = 0.5 comes from
# linear scaling by the global batch. The 899 test digits are evaluated in
# batches of 896 and 3 under a strategy (`evaluation_batch_size`), in one
# batch without.
TINY = {
    "data": {"test_fraction": 0.5},
    "model": {"width": 8},
    "training": {"epochs": 3, "verbose": 2},
    "schedule": {"warmup_epochs": 1, "base_batch_size": 32},
}
TINY_SET = ["--set", "optimizer.config.learning_rate=0.25"]
NUM_TRAIN = 898
GLOBAL_BATCH = 64
PER_REPLICA = 32
STEPS = NUM_TRAIN // GLOBAL_BATCH  # 14
PEAK = 0.25 * GLOBAL_BATCH / 32
# Float32 sums in another order (two half-batch gradients all-reduced instead
# of one batch), over 42 LARS steps: the weights agree to about 2e-7.
WEIGHTS_ATOL = 1e-5
LOSS_RTOL = 1e-5


def _tiny_config(path, **blocks):
    config = {**TINY, **blocks}
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _weights(path):
    return keras.models.load_model(path).get_weights()


def _summary(run_dir):
    with open(os.path.join(run_dir, "summary.json")) as handle:
        return json.load(handle)


RUN_FILES = [
    "config.yaml",
    "curves.png",
    "history.json",
    "learning_rate.png",
    "model.keras",
    "summary.json",
    "trust_ratio.png",
    "trust_ratios.npz",
]


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    """One process, no strategy, batch 64: the run the others must equal."""
    folder = tmp_path_factory.mktemp("single")
    config = _tiny_config(folder / "tiny.yaml")
    code = main(
        ["train", "--config", config, *TINY_SET,
         "--set", f"training.batch_size={GLOBAL_BATCH}",
         "--set", f"output_dir={folder / 'runs'}", "--set", "run_name=single"]
    )  # fmt: skip
    assert code == 0
    return folder / "runs" / "single"


def _assert_equals_single_run(run_dir, single_run):
    summary, single = _summary(run_dir), _summary(single_run)
    assert summary["batch_size"] == PER_REPLICA
    assert summary["global_batch_size"] == GLOBAL_BATCH == 2 * PER_REPLICA
    assert summary["replicas"] == 2
    assert summary["steps_per_epoch"] == STEPS == 14
    assert summary["examples_dropped_per_epoch"] == NUM_TRAIN % GLOBAL_BATCH == 2
    assert summary["peak_learning_rate"] == pytest.approx(PEAK, rel=1e-6)
    assert single["peak_learning_rate"] == pytest.approx(PEAK, rel=1e-6)
    assert summary["learning_rate_schedule"] == single["learning_rate_schedule"]
    mine = _weights(run_dir / "model.keras")
    theirs = _weights(single_run / "model.keras")
    assert len(mine) == len(theirs) == 8  # 4 kernels, 4 biases
    for index, (value, expected) in enumerate(zip(mine, theirs, strict=True)):
        np.testing.assert_allclose(
            value, expected, rtol=0, atol=WEIGHTS_ATOL, err_msg=f"weight {index}"
        )
    assert summary["test_loss"] == pytest.approx(single["test_loss"], rel=LOSS_RTOL)
    assert summary["train_loss"] == pytest.approx(single["train_loss"], rel=LOSS_RTOL)
    # Equal weights to 1e-5 classify the same 899 test digits.
    assert summary["test_accuracy"] == single["test_accuracy"]


# ------------------------------------------------------ strategy none
def test_no_strategy_records_one_replica(single_run, capsys):
    summary = _summary(single_run)
    assert summary["strategy"] == "none"
    assert summary["batch_size"] == summary["global_batch_size"] == GLOBAL_BATCH
    assert (summary["replicas"], summary["workers"]) == (1, 1)
    assert summary["examples_dropped_per_epoch"] == 2
    assert sorted(os.listdir(single_run)) == RUN_FILES
    config = yaml.safe_load((single_run / "config.yaml").read_text())
    assert config["distribute"] == {
        "strategy": "none",
        "logical_cpus": None,
        "diloco": {
            "sync_every": 50,
            "compression": "none",
            "outer_optimizer": {
                "class_name": "SGD",
                "config": {"learning_rate": 0.7, "momentum": 0.9, "nesterov": True},
            },
        },
        "agn": {"communication_period": 10, "outer_optimizer": None},
    }


def test_fit_takes_the_epoch_orders_of_make_dataset():
    # `make_distributed_dataset` draws the shuffles `fit` would take from
    # `make_dataset` (Keras 3.15: two iterators per epoch). If this fails,
    # Keras changed how many iterators `fit` makes: update
    # `tf_lars.cli.train.ITERATORS_PER_EPOCH`.
    x = np.arange(40, dtype="float32").reshape(-1, 1)
    seen = []
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse", run_eagerly=True)
    train_step = model.train_step

    def recording_step(data):
        seen.append(data[0].numpy()[:, 0].astype(int))
        return train_step(data)

    model.train_step = recording_step
    keras.utils.set_random_seed(7)
    model.fit(make_dataset(x, x, 8, seed=7), epochs=3, verbose=0)
    keras.utils.set_random_seed(7)
    orders = epoch_orders(40, 3, seed=7)
    assert len(seen) == 15
    np.testing.assert_array_equal(np.concatenate(seen), orders.reshape(-1))
    assert sorted(orders[1].tolist()) == list(range(40))
    assert orders[0].tolist() != orders[1].tolist()


# --------------------------------------------------------- batch sizes
@pytest.mark.parametrize(
    "batch_size, examples, replicas, expected",
    [
        (32, 1347, 1, (32, 32)),
        (32, 1347, 2, (32, 64)),
        (673, 1347, 2, (673, 1346)),
        ("full", 1347, 1, (1347, 1347)),
        ("full", 898, 2, (449, 898)),
        ("full", 900, 3, (300, 900)),
    ],
)
def test_global_batch_size(batch_size, examples, replicas, expected):
    assert global_batch_size(batch_size, examples, replicas) == expected


def test_global_batch_size_errors():
    with pytest.raises(ConfigError) as error:
        global_batch_size("full", 1347, 2)
    assert str(error.value) == (
        "`training.batch_size`=full makes the whole training set (1347 examples) "
        "the global batch, which must divide by the 2 replicas; give the batch "
        "per replica as an int instead. Received: training.batch_size='full'"
    )
    with pytest.raises(ConfigError) as error:
        global_batch_size(674, 1347, 2)
    assert str(error.value) == (
        "`training.batch_size` is per replica: the global batch 674 x 2 replicas "
        "must be at most the training set size (1347), so `training.batch_size` "
        "at most 673 or 'full'. Received: training.batch_size=674"
    )
    with pytest.raises(ConfigError, match=r"at most the training set size \(1347\)"):
        global_batch_size(1348, 1347, 1)


def test_describe_batches_names_the_dropped_examples():
    assert describe_batches(32, 64, 2, 1347) == (
        "Batches: 21 steps per epoch of 64 examples (32 per replica x 2 "
        "replicas); 3 of the 1347 training examples do not fill a batch and are "
        "dropped each epoch (different ones each epoch: the data is reshuffled)"
    )
    assert describe_batches(449, 898, 2, 898) == (
        "Batches: 1 step per epoch of 898 examples (449 per replica x 2 replicas)"
    )
    assert describe_batches(64, 64, 1, 128) == (
        "Batches: 2 steps per epoch of 64 examples"
    )


@pytest.mark.parametrize(
    "examples, replicas, expected",
    [
        (450, 2, 450),
        (1347, 2, 1024),  # 1024 + 323
        (899, 2, 896),  # 898 + 1 would leave a replica without an example
        (1025, 2, 1022),  # 1022 + 3
        (2049, 4, 1020),  # 2 x 1020 + 9
        (3, 3, 3),
    ],
)
def test_evaluation_batch_size(examples, replicas, expected):
    size = evaluation_batch_size(examples, replicas)
    assert size == expected
    assert size % replicas == 0
    assert examples % size == 0 or examples % size >= replicas


def test_evaluation_needs_an_example_per_replica():
    with pytest.raises(ConfigError) as error:
        evaluation_batch_size(1, 2, "test set")
    assert str(error.value) == (
        "`distribute`: evaluating on 2 replicas needs at least one example per "
        "replica; the test set has 1"
    )


# ------------------------------------------------------ config errors
BAD_DISTRIBUTE = [
    (["--set", "distribute.strategy=ring"],
     "`distribute.strategy` must be one of ['none', 'mirrored', 'multi_worker', "
     "'diloco', 'parameter_server']. "
     "Received: distribute.strategy='ring'"),
    (["--set", "distribute.strategy=mirrored", "--set", "distribute.logical_cpus=1"],
     "`distribute.logical_cpus` must be an int >= 2 or null. "
     "Received: distribute.logical_cpus=1"),
    (["--set", "distribute.strategy=mirrored", "--set", "distribute.logical_cpus=two"],
     "`distribute.logical_cpus` must be an int >= 2 or null. "
     "Received: distribute.logical_cpus='two'"),
    (["--set", "distribute.strategy=mirrored", "--set", "distribute.logical_cpus=true"],
     "Received: distribute.logical_cpus=True"),
    (["--set", "distribute.logical_cpus=2"],
     "`distribute.logical_cpus` applies to `distribute.strategy`=mirrored only. "
     "Received: distribute.logical_cpus=2 with distribute.strategy='none'"),
    (["--set", "distribute={strategy: multi_worker, logical_cpus: 2}"],
     "Received: distribute.logical_cpus=2 with distribute.strategy='multi_worker'"),
    (["--set", "distribute.workers=2"], "Unknown config key `distribute.workers`. "
     "Valid keys in `distribute`: strategy, logical_cpus, diloco, agn"),
    (["--set", "distribute.agn.communication_period=0"],
     "`distribute.agn.communication_period` must be an int >= 1. "
     "Received: distribute.agn.communication_period=0"),
    (["--set", "distribute.agn.outer_optimizer=SGD"],
     "`distribute.agn.outer_optimizer` must be null or a mapping with `class_name` "
     "and `config`. Received: distribute.agn.outer_optimizer='SGD'"),
    (["--set", "distribute.strategy=parameter_server",
      "--set", "training.precision=mixed_bfloat16"],
     "`training.precision` must be float32 on parameter servers. Received: "
     "training.precision='mixed_bfloat16' with distribute.strategy='parameter_server'"),
    (["--set", "distribute.strategy=parameter_server",
      "--set", "loss_scale.enabled=true"],
     "`loss_scale.enabled` must be false on parameter servers (AGN's rounds train in "
     "float32). Received: loss_scale.enabled=True with "
     "distribute.strategy='parameter_server'"),
    (["--set", "distribute=mirrored"],
     "`distribute` must be a mapping. Received: distribute='mirrored'"),
]  # fmt: skip


@pytest.mark.parametrize("argv, expected", BAD_DISTRIBUTE)
def test_bad_distribute_config(argv, expected, tmp_path, one_line_error, run_cli):
    output = tmp_path / "out"
    code, _, err = run_cli("train", *argv, "--set", f"output_dir={output}")
    assert expected in one_line_error(code, err, "train")
    assert not output.exists()


def test_logical_cpus_once_devices_are_initialized(tmp_path, one_line_error, run_cli):
    # This process has set up its devices: the CPU cannot be split any more.
    have = len(tf.config.list_logical_devices("CPU"))
    output = tmp_path / "out"
    code, _, err = run_cli(
        "train", "--set", "distribute.strategy=mirrored",
        "--set", f"distribute.logical_cpus={have + 1}",
        "--set", f"output_dir={output}",
    )  # fmt: skip
    assert (
        "`distribute.logical_cpus` must be set before TensorFlow initializes its "
        f"devices, and this process already has {have} CPU device(s); run "
        "`tf-lars train` in a new process. Received: distribute.logical_cpus="
        f"{have + 1}"
    ) in one_line_error(code, err, "train")
    assert not output.exists()


TF_CONFIG_ERRORS = [
    (None, "TF_CONFIG is not set."),
    ("{not json", "TF_CONFIG is not valid JSON"),
    (json.dumps({"cluster": {"worker": ["localhost:1"], "ps": ["localhost:2"]},
                 "task": {"type": "worker", "index": 0}}),
     "The cluster has 'ps' tasks, but synchronous multi-worker training"),
    (json.dumps({"cluster": {"worker": ["localhost:1"]},
                 "task": {"type": "worker", "index": 3}}),
     "`task.index` must be an int in [0, 1) for task type 'worker'. "
     "Received: index=3"),
]  # fmt: skip


TWO_WORKERS = json.dumps(
    {"cluster": {"worker": ["localhost:1", "localhost:2"]},
     "task": {"type": "worker", "index": 1}}
)  # fmt: skip
NOT_A_CLUSTER_STRATEGY = (
    "TF_CONFIG is set (this process is a task of a cluster), so "
    "`distribute.strategy` must be multi_worker, diloco or parameter_server "
    "(or unset TF_CONFIG). Received: distribute.strategy='none'"
)
PS_TF_CONFIG_ERRORS = [
    (None, "TF_CONFIG is not set. Set it to the cluster description"),
    (json.dumps({"cluster": {"worker": ["localhost:1", "localhost:2"]},
                 "task": {"type": "worker", "index": 0}}),
     "The cluster has no 'chief' task; parameter-server training needs one "
     "'chief', at least one 'worker' and at least one 'ps'."),
]  # fmt: skip


@pytest.mark.parametrize(
    "strategy, tf_config, expected",
    [("multi_worker", *case) for case in TF_CONFIG_ERRORS]
    + [("parameter_server", *case) for case in PS_TF_CONFIG_ERRORS]
    # A task of a cluster without a cluster strategy: each task would train
    # alone and write the same run folder.
    + [("none", TWO_WORKERS, NOT_A_CLUSTER_STRATEGY)],
)
def test_bad_tf_config_is_one_line(
    strategy, tf_config, expected, tmp_path, monkeypatch, one_line_error, run_cli
):
    if tf_config is None:
        monkeypatch.delenv("TF_CONFIG", raising=False)
    else:
        monkeypatch.setenv("TF_CONFIG", tf_config)
    output = tmp_path / "out"
    code, out, err = run_cli(
        "train", "--set", f"distribute.strategy={strategy}",
        "--set", f"output_dir={output}",
    )  # fmt: skip
    assert expected in one_line_error(code, err, "train")
    assert out == ""
    assert not output.exists()


def _env():
    env = launcher_env()
    env.pop("TF_CONFIG", None)
    return env


def _run_ok(tmp_path, *argv):
    """`python ARGV` in `tmp_path`, which must exit with 0; the process."""
    process = subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=_env(),
        timeout=TIMEOUT,
    )
    assert process.returncode == 0, process.stdout + process.stderr
    return process


def test_multi_worker_bad_tf_config_in_a_real_process(tmp_path):
    env = _env()
    env["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": ["localhost:1"], "ps": ["localhost:2"]},
         "task": {"type": "worker", "index": 0}}
    )  # fmt: skip
    process = subprocess.run(
        [sys.executable, "-m", "tf_lars.cli", "train",
         "--set", "distribute.strategy=multi_worker",
         "--set", f"output_dir={tmp_path / 'out'}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=TIMEOUT,
    )  # fmt: skip
    assert process.returncode == 2
    ours = [line for line in process.stderr.splitlines() if "tf-lars" in line]
    assert len(ours) == 1 and "Traceback" not in process.stderr, process.stderr
    assert ours[0].startswith("tf-lars train: error: The cluster has 'ps' tasks")
    assert process.stdout == ""
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------ mirrored
@pytest.mark.slow
def test_mirrored_on_two_logical_cpus_equals_one_process(single_run, tmp_path):
    # Its own process: the CPU is split before TensorFlow sets up devices.
    config = _tiny_config(
        tmp_path / "tiny.yaml",
        distribute={"strategy": "mirrored", "logical_cpus": 2},
    )
    process = _run_ok(
        tmp_path, "-m", "tf_lars.cli", "train", "--config", config,
        *TINY_SET, "--set", f"training.batch_size={PER_REPLICA}",
        "--set", f"output_dir={tmp_path / 'runs'}", "--set", "run_name=mirrored",
    )  # fmt: skip
    lines = process.stdout.splitlines()
    assert "Strategy: mirrored over 2 replica(s)" in lines
    assert describe_batches(PER_REPLICA, GLOBAL_BATCH, 2, NUM_TRAIN) in lines
    assert (
        "Batches: 14 steps per epoch of 64 examples (32 per replica x 2 replicas); "
        "2 of the 898 training examples do not fill a batch and are dropped each "
        "epoch (different ones each epoch: the data is reshuffled)"
    ) in lines
    run_dir = tmp_path / "runs" / "mirrored"
    assert sorted(os.listdir(run_dir)) == RUN_FILES
    summary = _summary(run_dir)
    assert (summary["strategy"], summary["workers"]) == ("mirrored", 1)
    _assert_equals_single_run(run_dir, single_run)


# -------------------------------------------------------- multi_worker
def _train_on_two_workers(tmp_path, config, output, logs, *extra):
    """The documented command, `python -m tf_lars.distribute.launch --mode sync
    --workers 2 -- -m tf_lars.cli train --config CONFIG ...`, run to its end;
    returns the two workers' logs `(chief, other)`."""
    _run_ok(
        tmp_path, "-m", "tf_lars.distribute.launch", "--mode", "sync",
        "--workers", "2", "--log-dir", str(logs), "--",
        "-m", "tf_lars.cli", "train", "--config", config, *TINY_SET,
        "--set", f"training.batch_size={PER_REPLICA}",
        "--set", f"output_dir={output}", *extra,
    )  # fmt: skip
    return tuple((logs / f"worker-{i}.log").read_text() for i in range(2))


@pytest.mark.slow
def test_two_workers_through_the_launcher_equal_one_process(single_run, tmp_path):
    # The documented command: python -m tf_lars.distribute.launch --mode sync
    # --workers 2 -- -m tf_lars.cli train --config tiny.yaml
    output = tmp_path / "runs"
    logs = tmp_path / "logs"
    config = _tiny_config(
        tmp_path / "tiny.yaml", distribute={"strategy": "multi_worker"}
    )
    chief_log, other_log = _train_on_two_workers(
        tmp_path, config, output, logs, "--set", "run_name=two_workers"
    )
    run_dir = output / "two_workers"
    # Worker 0 wrote the run folder and printed the progress; worker 1 wrote
    # nothing (the temporary folders of the test hold only these).
    assert f"Run folder: {run_dir}" in chief_log
    assert "Epoch 3/3" in chief_log
    assert "Final test accuracy:" in chief_log
    assert "Run folder" not in other_log and "Epoch" not in other_log
    assert "worker 1: done; final test accuracy" in other_log
    assert os.listdir(output) == ["two_workers"]
    assert sorted(os.listdir(tmp_path)) == ["logs", "runs", "tiny.yaml"]
    assert sorted(os.listdir(run_dir)) == RUN_FILES
    summary = _summary(run_dir)
    assert (summary["strategy"], summary["workers"]) == ("multi_worker", 2)
    _assert_equals_single_run(run_dir, single_run)
    model = keras.models.load_model(run_dir / "model.keras")
    assert isinstance(model.optimizer, tf_lars.LARS)
    assert int(model.optimizer.iterations.numpy()) == 3 * STEPS


# --------------------------------------------------------------- diloco
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["float32", "mixed_float16"])
def test_two_workers_train_with_diloco_through_the_launcher(tmp_path, precision):
    # distribute.strategy=diloco: each worker its own copy on its half of the
    # 898 training digits (449 each: 14 steps of 32 per epoch), 3 epochs,
    # an outer step every 7 inner steps: 6 outer steps. Under mixed_float16
    # the `loss_scale` block's scale sits inside DiLoCo (no second one from
    # `compile`); the weights, theta and the payloads stay float32.
    output = tmp_path / "runs"
    logs = tmp_path / "logs"
    config = _tiny_config(tmp_path / "tiny.yaml", distribute={"strategy": "diloco"})
    mixed = () if precision == "float32" else (
        "--set", "training.precision=mixed_float16",
        "--set", "loss_scale.enabled=true",
    )  # fmt: skip
    chief_log, other_log = _train_on_two_workers(
        tmp_path, config, output, logs,
        "--set", "distribute.diloco.sync_every=7", "--set", "run_name=diloco",
        *mixed,
    )  # fmt: skip
    run_dir = output / "diloco"
    assert "Strategy: diloco, 2 workers" in chief_log
    assert "worker 1: done; final test accuracy" in other_log
    assert os.listdir(output) == ["diloco"]
    # The CNN of width 8: 2,002 float32 weights, 8,008 bytes per exchange.
    payload = 4 * ((9 * 8 + 8) + (9 * 8 * 8 + 8) + (9 * 8 * 16 + 16) + (16 * 10 + 10))
    summary = _summary(run_dir)
    assert (summary["strategy"], summary["workers"]) == ("diloco", 2)
    assert summary["steps_per_epoch"] == 14 and summary["global_batch_size"] == 32
    assert summary["communication"] == {
        "outer_steps": 6, "bytes_sent": 6 * payload, "bytes_received": 6 * payload
    }  # fmt: skip
    assert (
        f"Communicated (this worker): 6 outer steps, {6 * payload:,} bytes sent"
        in chief_log
    )
    # The saved model is theta after the last outer step (step 42 = 6 x 7),
    # which both workers hold, and the optimizer is the DiLoCo around LARS.
    model = keras.models.load_model(run_dir / "model.keras")
    optimizer = model.optimizer
    assert isinstance(optimizer, tf_lars.DiLoCo)
    inner = optimizer.inner_optimizer
    if precision == "mixed_float16":
        assert isinstance(inner, tf_lars.LossScaleOptimizer)
        inner = inner.inner_optimizer
    assert isinstance(inner, tf_lars.LARS)
    assert int(optimizer.iterations.numpy()) == 3 * 14
    assert int(optimizer.outer_optimizer.iterations.numpy()) == 6
    for weight, theta in zip(
        model.trainable_variables, optimizer.global_variables, strict=True
    ):
        np.testing.assert_array_equal(weight.numpy(), theta.numpy())
    # The final evaluation is theta's.
    from tf_lars.cli.data import load_data

    data = load_data(
        {"path": None, "test_fraction": 0.5, "split_seed": 0, "num_classes": None}
    )
    _, accuracy = model.evaluate(data.x_test, data.y_test, verbose=0)
    assert summary["test_accuracy"] == pytest.approx(accuracy, abs=1e-6)


# ------------------------------------ signals, restarts and lost workers
def _launched_train(tmp_path, strategy, launcher_args=(), epochs=20):
    """`tf-lars train` (run_name=run, `epochs` epochs, diloco's outer step
    every 7 of the 14 steps per epoch) on two workers through the launcher
    (`--mode sync`), watched as it runs: a `LaunchedCluster`."""
    config = _tiny_config(tmp_path / "tiny.yaml", distribute={"strategy": strategy})
    return LaunchedCluster(
        tmp_path / "logs",
        ["--mode", "sync", "--workers", "2", *launcher_args],
        ["train", "--config", config, *TINY_SET,
         "--set", f"training.batch_size={PER_REPLICA}",
         "--set", f"training.epochs={epochs}",
         "--set", "distribute.diloco.sync_every=7",
         "--set", f"output_dir={tmp_path / 'runs'}", "--set", "run_name=run"],
        program=("-m", "tf_lars.cli"),
    )  # fmt: skip


def _worker_logs(tmp_path):
    return [(tmp_path / "logs" / f"worker-{i}.log").read_text() for i in range(2)]


NOTE_END = (
    " of 20 epochs. config.yaml and history.json hold what finished; the model, "
    "summary and plots were not written."
)


def test_an_agreed_signal_takes_one_collective_more_whose_loss_is_ignored():
    # The workers' signal agreement (`_signal_agreement`), on a strategy
    # that records each sum: a signal agreed takes one more (zeros) before
    # every worker stops, so one that exits at once cuts no other's read of
    # the agreement short; a peer lost in that one changes nothing.
    from tf_lars.cli import train

    sums = []

    def reduce(op, value, axis):
        def record(v):
            sums.append(v.numpy().tolist())
            if len(sums) == 5:  # the one after SIGINT's agreement
                raise RuntimeError("Socket closed")  # an OpError out of TensorFlow
            return v

        return tf.py_function(record, [value], tf.int64)

    strategy = types.SimpleNamespace(run=lambda fn: fn(), reduce=reduce)
    agree = train._signal_agreement(strategy)
    assert agree(None) is None
    assert agree(signal.SIGTERM) == signal.SIGTERM
    assert agree(signal.SIGINT) == signal.SIGINT
    assert sums == [[0, 0], [1, 0], [0, 0], [0, 1], [0, 0]]


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy, target",
    [
        ("multi_worker", "worker 0"),
        ("diloco", "worker 0"),
        ("multi_worker", "launcher"),
    ],
)
def test_sigterm_stops_every_worker_at_a_step_end_with_a_note(
    tmp_path, strategy, target
):
    # A preempted pod (`kill -TERM` of worker 0) or a stopped launcher (which
    # passes SIGTERM on to both workers): the workers agree on the signal at
    # a step end, stop there together, and the chief leaves its note.
    with _launched_train(tmp_path, strategy) as run:
        run.wait_for(r"^Epoch 2/20$", 240)
        if target == "launcher":
            run.process.send_signal(signal.SIGTERM)
        else:
            os.kill(run.task("worker", 0)["pid"], signal.SIGTERM)
        code = run.wait(120)
        output = run.output
    logs = _worker_logs(tmp_path)
    assert code == 143, output[-6000:] + logs[1][-3000:]
    if target == "launcher":
        assert (
            "[launch] got SIGTERM; passing SIGTERM on to every task (SIGKILL 10s "
            "later)" in run.lines
        )
    else:
        assert re.search(r"^\[launch\] worker \d exited with status 143; stopping "
                         r"the job \(no --restart-job\)$", output, re.M)  # fmt: skip
    run_dir = tmp_path / "runs" / "run"
    note = (run_dir / "INTERRUPTED").read_text()
    done = int(re.search(r" after (\d+) of 20 epochs\.", note)[1])
    assert note == f"Interrupted (SIGTERM) after {done}{NOTE_END}\n"
    assert 1 <= done < 20
    with open(run_dir / "history.json") as handle:
        assert json.load(handle)["epoch"] == list(range(1, done + 1))
    assert not (run_dir / "model.keras").exists()
    # Each worker stopped itself (a SIGKILL prints nothing): the chief on its
    # signal or the launcher's, worker 1 on the one the chief received.
    kept = f"tf-lars train: interrupted (SIGTERM); the run folder {run_dir} keeps "
    assert kept in logs[0]
    assert "tf-lars train: interrupted (SIGTERM)\n" in logs[1]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["multi_worker", "diloco"])
def test_a_restarted_job_resumes_its_own_run_from_its_backup(tmp_path, strategy):
    restart = ["--restart-job", "1", "--restart-delay", "0.5"]
    with _launched_train(tmp_path, strategy, restart, epochs=5) as run:
        run.wait_for(r"^Epoch 3/5$", 240)  # two epochs backed up
        run.kill_task("worker", 1)
        run.wait_for(r"^\[launch\] restart 1 of 1: starting every worker", 60)
        resumed = run.wait_for(r"^Resumed from the backup after epoch (\d+)$", 240)
        code = run.wait(300)
        output = run.output
    assert code == 0, output[-6000:]
    assert (
        "Restarted: this run goes on from its backup, if one was written (else "
        "from the start)" in run.lines
    )
    assert 2 <= int(resumed[1]) < 5
    run_dir = tmp_path / "runs" / "run"
    assert _summary(run_dir)["epochs_run"] == 5
    with open(run_dir / "history.json") as handle:
        history = json.load(handle)
    assert history["epoch"] == [1, 2, 3, 4, 5] and len(history["loss"]) == 5
    files = os.listdir(run_dir)
    assert "INTERRUPTED" not in files and "backup" not in files
    assert "model.keras" in files
    # The optimizer went on from the backup's state: every step of the run.
    optimizer = keras.models.load_model(run_dir / "model.keras").optimizer
    assert int(optimizer.iterations.numpy()) == 5 * STEPS
    if strategy == "multi_worker":  # diloco writes none (each worker's own)
        # The trust ratios of every epoch, the earlier start's included.
        records = np.load(run_dir / "trust_ratios.npz")
        assert sorted(set(records["epochs"].tolist())) == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_a_restarted_job_refuses_another_run_s_folder(tmp_path):
    from tf_lars.distribute.cluster import pick_free_port

    run_dir = tmp_path / "runs" / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("seed: 1\n")
    env = _env()
    env["TF_LARS_RESTART"] = "1"
    env["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": [f"localhost:{pick_free_port()}"]},
         "task": {"type": "worker", "index": 0}}
    )  # fmt: skip
    process = subprocess.run(
        [sys.executable, "-m", "tf_lars.cli", "train",
         "--set", "distribute.strategy=multi_worker",
         "--set", f"output_dir={tmp_path / 'runs'}", "--set", "run_name=run"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=TIMEOUT,
    )  # fmt: skip
    assert process.returncode == 2, process.stdout + process.stderr
    ours = [line for line in process.stderr.splitlines() if "tf-lars" in line]
    assert ours == [
        f"tf-lars train: error: the run folder {run_dir} exists and holds another "
        "run (its config.yaml is not this restarted job's); choose another "
        "`run_name`, or give --overwrite to replace its files. Received: "
        "run_name='run'"
    ], process.stderr
    assert os.listdir(run_dir) == ["config.yaml"]
    assert (run_dir / "config.yaml").read_text() == "seed: 1\n"


@pytest.mark.slow
def test_a_lost_diloco_worker_leaves_a_note_in_the_run_folder(tmp_path):
    with _launched_train(tmp_path, "diloco") as run:
        run.wait_for(r"^Epoch 2/20$", 240)
        run.kill_task("worker", 1)
        code = run.wait(120)
        output = run.output
    assert code == 137, output[-6000:]
    run_dir = tmp_path / "runs" / "run"
    note = (run_dir / "INTERRUPTED").read_text()
    done = int(re.search(r" after (\d+) of 20 epochs\.", note)[1])
    assert 1 <= done < 20
    # The error the next exchange raised once worker 1 was gone.
    lost = re.match(r"Stopped \(a worker of the cluster was lost: (\w+)\)", note)
    assert lost and lost[1] in ("UnavailableError", "AbortedError"), note
    # Worker 0 exited by itself within the launcher's default `--peer-grace`.
    assert "(--peer-grace)" not in output, output[-6000:]
    assert note == (
        f"{lost[0]} after {done}{NOTE_END} TensorFlow's error is on the chief's "
        "stderr (its log under the launcher).\n"
    )
    # The survivor says so on the terminal, in a line of its own.
    said = [line for line in run.lines if line.startswith("worker 0: stopped, ")]
    assert len(said) == 1, output[-6000:]
    assert said[0].startswith("worker 0: stopped, a worker of the cluster was lost (")
    assert said[0].endswith(
        f"; the run folder {run_dir} keeps INTERRUPTED, backup, config.yaml, "
        f"history.json ({done} of 20 epochs)"
    )


# ----------------------------------------------------- parameter_server
@pytest.mark.slow
def test_agn_with_an_outer_optimizer_on_parameter_servers_through_the_launcher(
    tmp_path,
):
    # distribute.strategy=parameter_server on the launcher's ps mode: a chief,
    # 2 workers, 1 parameter server. Each worker's epoch is 14 local steps of
    # 32 (a global batch of 64), a commit every 7: 2 x 14 / 7 = 4 commits per
    # epoch, 12 in 3 epochs. The outer SGD at 1e-9 applies every commit's
    # pseudo-gradient to the center, which so stays at its initial weights
    # (AGN's own commit, a LARS step at rate 0.5, would move it).
    output, logs = tmp_path / "runs", tmp_path / "logs"
    config = _tiny_config(
        tmp_path / "tiny.yaml", distribute={"strategy": "parameter_server"}
    )
    _run_ok(
        tmp_path, "-m", "tf_lars.distribute.launch", "--workers", "2",
        "--ps", "1", "--log-dir", str(logs), "--",
        "-m", "tf_lars.cli", "train", "--config", config, *TINY_SET,
        "--set", f"training.batch_size={PER_REPLICA}",
        "--set", f"output_dir={output}", "--set", "run_name=agn",
        "--set", "distribute.agn.communication_period=7",
        "--set", "distribute.agn.outer_optimizer={class_name: SGD, config: "
                 "{learning_rate: 1.0e-9}}",
    )  # fmt: skip
    chief_log = (logs / "chief-0.log").read_text()
    assert "Strategy: parameter_server, 2 workers" in chief_log
    assert "Epoch 3/3: 12 commits," in chief_log
    run_dir = output / "agn"
    assert os.listdir(output) == ["agn"]
    assert sorted(os.listdir(run_dir)) == [
        "config.yaml", "curves.png", "history.json", "learning_rate.png",
        "model.keras", "summary.json",
    ]  # fmt: skip
    payload = 4 * ((9 * 8 + 8) + (9 * 8 * 8 + 8) + (9 * 8 * 16 + 16) + (16 * 10 + 10))
    summary = _summary(run_dir)
    assert (summary["strategy"], summary["workers"]) == ("parameter_server", 2)
    assert (summary["optimizer"], summary["inner_optimizer"]) == ("AGN", "LARS")
    assert summary["outer_optimizer"]["class_name"] == "SGD"
    assert summary["outer_optimizer"]["config"]["learning_rate"] == np.float32(1e-9)
    assert summary["steps_per_epoch"] == STEPS and summary["global_batch_size"] == 64
    communication = summary["communication"]
    assert communication["commits"] == 12
    assert communication["bytes_per_commit"] == payload
    assert communication["bytes_sent"] == 12 * payload
    assert communication["bytes_received"] == 12 * payload
    # Each worker's commits (and pulls) since its start: 12 in all.
    assert sum(communication["worker_bytes_sent"]) == 12 * payload
    assert (
        f"Communicated: 12 commits of {payload:,} bytes, {12 * payload:,} bytes sent"
        in chief_log
    )
    with open(run_dir / "history.json") as handle:
        history = json.load(handle)
    assert history["epoch"] == [1, 2, 3]
    # The saved model is the center: the seeded initial weights (moved by
    # at most 1e-9 x the pseudo-gradients), and its test accuracy the summary's.
    from tf_lars.cli.data import load_data
    from tf_lars.cli.train import build_model

    model = keras.models.load_model(run_dir / "model.keras")
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    data = load_data(resolved["data"])
    keras.utils.set_random_seed(resolved["seed"])
    initial = build_model(resolved["model"], data.x_train.shape[1:], data.num_classes)
    for weight, start in zip(model.get_weights(), initial.get_weights(), strict=True):
        np.testing.assert_allclose(weight, start, rtol=0, atol=1e-6)
    model.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    loss, accuracy = model.evaluate(data.x_test, data.y_test, verbose=0)
    assert summary["test_accuracy"] == pytest.approx(accuracy, abs=1e-6)
    assert summary["test_loss"] == pytest.approx(loss, rel=1e-5)
    assert history["val_accuracy"][-1] == pytest.approx(accuracy, abs=1e-6)


def test_a_period_longer_than_an_epoch_is_refused():
    # Checked on the chief once the cluster gives the workers (the launcher
    # then exits with the chief's status 2 and its line).
    from tf_lars.cli.train import _agn

    block = {"communication_period": 15, "outer_optimizer": None}
    with pytest.raises(ConfigError) as caught:
        _agn(block, {"steps_per_epoch": 14}, distribution=None)
    assert str(caught.value) == (
        "`distribute.agn.communication_period` must be at most each worker's steps "
        "per epoch (14). Received: distribute.agn.communication_period=15"
    )


def test_a_diloco_round_longer_than_the_run_is_refused():
    # Before, the run trained, took no outer step and saved the model it
    # started with (exit status 0).
    from tf_lars.cli.train import _diloco

    block = {"sync_every": 43, "compression": "none", "outer_optimizer": None}
    with pytest.raises(ConfigError) as caught:
        _diloco(block, {"steps_per_epoch": 21, "optimizer": None}, epochs=2)
    assert str(caught.value) == (
        "`distribute.diloco.sync_every` must be at most the steps each worker runs "
        "(21 per epoch x 2 epochs), or no outer step runs. Received: "
        "distribute.diloco.sync_every=43"
    )


def test_a_lost_parameter_server_is_one_line_status_3_and_a_note(
    tmp_path, monkeypatch, run_cli
):
    # Before: a traceback and status 1 (which the launcher's docs and
    # `run_main` give as 3, never restarted), and no INTERRUPTED note.
    from tf_lars import distribute
    from tf_lars.cli import train

    lost = distribute.ParameterServerFailure(
        "/job:ps/replica:0/task:0", "localhost:1", None, None, OSError("Socket closed")
    )

    class LostTrainer:
        def __init__(self, *args, **kwargs):
            pass

        def fit(self, rounds):
            raise lost

    monkeypatch.setattr(distribute, "ParameterServerTrainer", LostTrainer)
    config = default_config("train")
    data = collections.namedtuple("Data", "x_train y_train x_test y_test")(
        *[np.zeros((4, 2), "float32"), np.zeros(4, "int32")] * 2
    )
    distribution = train.Distribution(None, "parameter_server", 2, 2, True, "chief 0")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    trial = {"model": model, "optimizer": types.SimpleNamespace(communication_period=1),
             "steps_per_epoch": 2, "learning_rate": 0.1}  # fmt: skip
    with pytest.raises(distribute.ParameterServerFailure):
        train._train_parameter_server(config, data, distribution, trial, str(tmp_path))
    note = (tmp_path / "INTERRUPTED").read_text()
    assert note.startswith(
        "Stopped (a parameter server of the cluster was lost: ParameterServerFailure) "
        f"after 0 of {config['training']['epochs']} epochs."
    )
    assert lost.kept == f"the run folder {tmp_path} keeps INTERRUPTED (0 of 100 epochs)"

    def run(*args):
        raise lost

    monkeypatch.setattr(train, "run", run)
    code, _, err = run_cli("train", "--set", f"output_dir={tmp_path / 'runs'}")
    assert code == 3
    assert err == (
        "tf-lars train: error: parameter server /job:ps/replica:0/task:0 "
        "(localhost:1) is unavailable; training stopped. No checkpoint was written "
        "yet (pass `checkpoint_dir`); a rerun starts from scratch. [OSError: Socket "
        f"closed]; the run folder {tmp_path} keeps INTERRUPTED (0 of 100 epochs)\n"
    )


def test_a_resumed_runs_trust_ratios_hold_the_earlier_epochs():
    # The monitor of a run resumed after epoch 2 starts empty: its files
    # held epochs 3 to 5 only; the earlier epochs' ratios are history.json's.
    from tf_lars.cli.train import trust_ratio_records

    monitor = types.SimpleNamespace(
        paths=["d/kernel", "d/bias"],
        trust_ratios=np.array([[3.0, 30.0], [4.0, 40.0], [5.0, 50.0]], "float32"),
        steps=[252, 336, 420],
        epochs=[2, 3, 4],
    )
    history = {
        "loss": [1.0] * 5,
        "trust_ratio/d/kernel": [1.0, 2.0, 3.0, 4.0, 5.0],
        "trust_ratio/d/bias": [10.0, 20.0, 30.0, 40.0, 50.0],
    }
    ratios, steps, epochs = trust_ratio_records(monitor, history, 84)
    np.testing.assert_array_equal(ratios[:, 0], [1, 2, 3, 4, 5])
    np.testing.assert_array_equal(ratios[:, 1], [10, 20, 30, 40, 50])
    assert ratios.dtype == np.float32
    assert steps == [84, 168, 252, 336, 420] and epochs == [0, 1, 2, 3, 4]
    monitor.epochs, monitor.steps = [0, 1, 2], [84, 168, 252]  # not resumed
    ratios, steps, epochs = trust_ratio_records(monitor, history, 84)
    assert len(ratios) == 3 and steps == [84, 168, 252] and epochs == [0, 1, 2]
