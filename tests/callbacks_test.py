"""Tests for `tf_lars.callbacks`: `TrustRatioMonitor` and `LossScaleMonitor`."""

import csv

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lars
from tf_lars.callbacks import LossScaleMonitor, TrustRatioMonitor

TRUST_COEFFICIENT = 0.02
WEIGHT_DECAY = 0.01


def _data(n=32):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 5)).astype(np.float32)
    y = (x @ rng.normal(size=(5, 2))).astype(np.float32)
    return x, y


def _model():
    return keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(4, activation="tanh", name="hidden"),
            keras.layers.Dense(2, name="out"),
        ],
        name="net",
    )


def _lars(**kwargs):
    arguments = dict(
        learning_rate=0.5,
        trust_coefficient=TRUST_COEFFICIENT,
        weight_decay=WEIGHT_DECAY,
        exclude_from_weight_decay=["<1d>"],
    )
    arguments.update(kwargs)
    return tf_lars.LARS(**arguments)


class _SnapshotWeights(keras.callbacks.Callback):
    """Keeps a copy of the weights at each epoch start (before its step)."""

    def __init__(self):
        super().__init__()
        self.weights = []

    def on_epoch_begin(self, epoch, logs=None):
        self.weights.append([v.numpy().copy() for v in self.model.trainable_variables])


def _reference_trust_ratios(model, weights, x, y, excluded):
    """The "paper" trust ratio (docs/algorithms.md, LARS step 2) in NumPy."""
    for variable, value in zip(model.trainable_variables, weights, strict=True):
        variable.assign(value)
    with tf.GradientTape() as tape:
        loss = keras.losses.mean_squared_error(y, model(x))
        loss = tf.reduce_mean(loss)
    grads = tape.gradient(loss, model.trainable_variables)
    ratios = []
    for value, grad, skip in zip(weights, grads, excluded, strict=True):
        w_norm = np.linalg.norm(value.astype(np.float64))
        g_norm = np.linalg.norm(grad.numpy().astype(np.float64))
        # "<1d>" excludes the biases from weight decay.
        decay = 0.0 if value.ndim <= 1 else WEIGHT_DECAY
        if skip or w_norm == 0 or g_norm == 0:
            ratios.append(1.0)
        else:
            ratios.append(TRUST_COEFFICIENT * w_norm / (g_norm + decay * w_norm))
    return np.array(ratios)


def test_records_the_trust_ratio_of_each_epochs_last_step(tmp_path):
    # Full batch: one step per epoch, so the ratio recorded at an epoch's end
    # is the one computed from the weights at that epoch's start.
    x, y = _data()
    model = _model()
    optimizer = _lars(exclude_from_layer_adaptation=["out/bias"])
    model.compile(optimizer=optimizer, loss="mse")
    monitor = TrustRatioMonitor()
    snapshot = _SnapshotWeights()
    csv_path = tmp_path / "log.csv"
    history = model.fit(
        x,
        y,
        batch_size=32,
        epochs=3,
        verbose=0,
        shuffle=False,
        callbacks=[snapshot, monitor, keras.callbacks.CSVLogger(str(csv_path))],
    )
    paths = ["net/hidden/kernel", "net/hidden/bias", "net/out/kernel", "net/out/bias"]
    assert monitor.paths == paths
    assert monitor.steps == [1, 2, 3]
    assert monitor.epochs == [0, 1, 2]
    assert monitor.trust_ratios.shape == (3, 4)
    assert monitor.loss_scales == [None, None, None]
    final_weights = [v.numpy().copy() for v in model.trainable_variables]
    for epoch in range(3):
        want = _reference_trust_ratios(
            model, snapshot.weights[epoch], x, y, [False, False, False, True]
        )
        np.testing.assert_allclose(monitor.trust_ratios[epoch], want, rtol=2e-4)
        for index, path in enumerate(paths):
            assert history.history["trust_ratio/" + path][epoch] == pytest.approx(
                float(monitor.trust_ratios[epoch, index])
            )
    for variable, value in zip(model.trainable_variables, final_weights, strict=True):
        variable.assign(value)
    # The hidden bias starts at zero: its first trust ratio is 1 by the rule.
    assert monitor.trust_ratios[0, 1] == 1.0
    assert 0 < monitor.trust_ratios[1, 1] < 1
    # The excluded variable stays at exactly 1.
    np.testing.assert_array_equal(monitor.trust_ratios[:, 3], [1.0, 1.0, 1.0])
    # The values are written into the epoch logs: History and a CSVLogger
    # after the monitor carry them.
    assert "loss_scale" not in history.history
    assert len(history.history["loss"]) == 3
    with open(csv_path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    for index, path in enumerate(paths):
        np.testing.assert_allclose(
            [float(row["trust_ratio/" + path]) for row in rows],
            monitor.trust_ratios[:, index],
            rtol=1e-6,
        )


def test_every_n_batches_and_epoch_end_without_duplicates():
    x, y = _data(32)
    model = _model()
    model.compile(optimizer=_lars(), loss="mse")
    seen = []

    class Spy(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(self.model.optimizer.trust_ratios.numpy().copy())

    monitor = TrustRatioMonitor(log_every_n_batches=2)
    history = model.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        verbose=0,
        shuffle=False,
        callbacks=[Spy(), monitor],
    )
    # 4 steps per epoch: records at steps 2 and 4 (the epoch end, once), 6, 8.
    assert monitor.steps == [2, 4, 6, 8]
    assert monitor.epochs == [0, 0, 1, 1]
    np.testing.assert_array_equal(
        monitor.trust_ratios, np.stack([seen[1], seen[3], seen[5], seen[7]])
    )
    np.testing.assert_allclose(
        history.history["trust_ratio/net/out/kernel"],
        [seen[3][2], seen[7][2]],
    )
    # The ratios change from step to step.
    assert not np.allclose(seen[1], seen[3])


def test_loss_scale_wrapper_logs_scale_and_reads_inner_trust_ratios():
    x, y = _data()
    model = _model()
    optimizer = tf_lars.LossScaleOptimizer(
        _lars(), initial_scale=1024.0, dynamic_growth_steps=2
    )
    model.compile(optimizer=optimizer, loss="mse")
    monitor = TrustRatioMonitor()
    history = model.fit(
        x, y, batch_size=32, epochs=4, verbose=0, shuffle=False, callbacks=[monitor]
    )
    # Finite steps double the scale every 2 steps: 1, 2, 3, 4 steps taken.
    assert history.history["loss_scale"] == [1024.0, 2048.0, 2048.0, 4096.0]
    assert monitor.loss_scales == [1024.0, 2048.0, 2048.0, 4096.0]
    assert monitor.paths == optimizer.inner_optimizer.trust_ratio_paths
    np.testing.assert_array_equal(
        monitor.trust_ratios[-1], optimizer.inner_optimizer.trust_ratios.numpy()
    )
    # Biases are rank 1: excluded by "<1d>" (both lists, by default).
    np.testing.assert_array_equal(monitor.trust_ratios[:, [1, 3]], np.ones((4, 2)))
    assert np.all(monitor.trust_ratios[:, [0, 2]] < 1.0)


def _read_scalars(log_dir):
    """{tag: [(step, value), ...]} from every event file under `log_dir`."""
    scalars = {}
    for path in tf.io.gfile.glob(f"{log_dir}/events.out.tfevents.*"):
        for record in tf.data.TFRecordDataset(path):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                number = float(tf.make_ndarray(value.tensor))
                scalars.setdefault(value.tag, []).append((event.step, number))
    return {tag: sorted(points) for tag, points in scalars.items()}


def test_tensorboard_scalars_at_optimizer_steps(tmp_path):
    x, y = _data()
    model = _model()
    model.compile(optimizer=_lars(), loss="mse")
    log_dir = str(tmp_path / "tb")
    monitor = TrustRatioMonitor(log_dir=log_dir, prefix="lars/")
    history = model.fit(
        x, y, batch_size=16, epochs=2, verbose=0, shuffle=False, callbacks=[monitor]
    )
    scalars = _read_scalars(log_dir)
    assert sorted(scalars) == [
        "lars/net/hidden/bias",
        "lars/net/hidden/kernel",
        "lars/net/out/bias",
        "lars/net/out/kernel",
    ]
    for index, path in enumerate(monitor.paths):
        assert [step for step, _ in scalars["lars/" + path]] == [2, 4]
        np.testing.assert_allclose(
            [value for _, value in scalars["lars/" + path]],
            monitor.trust_ratios[:, index],
            rtol=1e-6,
        )
        np.testing.assert_allclose(
            history.history["lars/" + path], monitor.trust_ratios[:, index], rtol=1e-6
        )
    assert monitor.writer is None  # closed at train end


def test_refuses_an_optimizer_without_trust_ratios():
    x, y = _data()
    model = _model()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    with pytest.raises(ValueError) as error:
        model.fit(x, y, epochs=1, verbose=0, callbacks=[TrustRatioMonitor()])
    assert "`TrustRatioMonitor` needs a model compiled with `tf_lars.LARS`" in str(
        error.value
    )
    assert "SGD" in str(error.value)


BAD_ARGUMENTS = (
    [
        (
            monitor,
            {"prefix": prefix},
            f"`prefix` must be a str. Received: prefix={prefix}",
        )
        for monitor, prefix in ((TrustRatioMonitor, None), (LossScaleMonitor, 3))
    ]
    + [
        (
            monitor,
            {"log_dir": "a", "writer": object()},
            "at most one of `log_dir` and `writer`",
        )
        for monitor in (TrustRatioMonitor, LossScaleMonitor)
    ]
    + [
        (
            TrustRatioMonitor,
            {"log_every_n_batches": n},
            f"Received: log_every_n_batches={n!r}",
        )
        for n in (0, 1.5, True)
    ]
)


@pytest.mark.parametrize("monitor, kwargs, message", BAD_ARGUMENTS)
def test_bad_arguments(monitor, kwargs, message):
    with pytest.raises(ValueError) as error:
        monitor(**kwargs)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "monitor, config",
    [
        (
            TrustRatioMonitor,
            {"log_every_n_batches": 5, "log_dir": "logs", "prefix": "t/"},
        ),
        (LossScaleMonitor, {"log_dir": "/tmp/logs", "prefix": "a/"}),
    ],
)
def test_config_round_trip_and_registration(monitor, config):
    assert monitor(**config).get_config() == config
    name = monitor.__name__
    assert keras.saving.get_registered_name(monitor) == f"tf_lars>{name}"
    assert getattr(tf_lars.callbacks, name) is monitor


# --------------------------------------------------------- LossScaleMonitor
EPOCHS = 3


def _scaled_data():
    """12 samples in 3 batches of 4; batch 2 holds an inf, so one skip per epoch."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 3)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5]], np.float32)).astype(np.float32)
    x[9, 1] = np.inf
    return x, y


def _fit(optimizer, callbacks):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse")
    x, y = _scaled_data()
    history = model.fit(
        x, y, batch_size=4, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks
    )
    return model, history


def _optimizer(dynamic=True):
    return tf_lars.LossScaleOptimizer(
        keras.optimizers.SGD(0.01),
        initial_scale=1024.0,
        dynamic=dynamic,
        dynamic_growth_steps=10**6,
    )


@pytest.mark.parametrize("dynamic", [True, False])
def test_history_holds_scale_and_skipped_steps(dynamic):
    optimizer = _optimizer(dynamic)
    model, history = _fit(optimizer, [LossScaleMonitor()])
    assert history.history["skipped_steps"] == [1, 2, 3]
    if dynamic:
        assert history.history["loss_scale"] == [512.0, 256.0, 128.0]
    else:
        assert history.history["loss_scale"] == [1024.0] * 3
    assert all(isinstance(v, int) for v in history.history["skipped_steps"])
    assert all(isinstance(v, float) for v in history.history["loss_scale"])
    # The skipped steps really were skipped: 2 applied per epoch, weights finite.
    assert int(optimizer.iterations) == 2 * EPOCHS
    for variable in model.trainable_variables:
        assert np.all(np.isfinite(variable.numpy()))


@pytest.mark.parametrize("how", ["log_dir", "writer"])
def test_tensorboard_scalars(tmp_path, how):
    log_dir = str(tmp_path / "logs")
    if how == "log_dir":
        monitor = LossScaleMonitor(log_dir=log_dir)
    else:
        writer = tf.summary.create_file_writer(log_dir)
        monitor = LossScaleMonitor(writer=writer, prefix="opt/")
    _fit(_optimizer(), [monitor])
    if how == "writer":
        # A writer the user passed stays open and theirs.
        assert monitor.writer is writer
        writer.close()
    prefix = "" if how == "log_dir" else "opt/"
    scalars = _read_scalars(log_dir)
    assert scalars[prefix + "loss_scale"] == [(0, 512.0), (1, 256.0), (2, 128.0)]
    assert scalars[prefix + "skipped_steps"] == [(0, 1.0), (1, 2.0), (2, 3.0)]


def test_prefix_and_later_callbacks_see_the_values():
    seen = []
    later = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: seen.append(dict(logs))
    )
    _, history = _fit(_optimizer(), [LossScaleMonitor(prefix="ls_"), later])
    assert history.history["ls_loss_scale"] == [512.0, 256.0, 128.0]
    assert history.history["ls_skipped_steps"] == [1, 2, 3]
    assert [logs["ls_skipped_steps"] for logs in seen] == [1, 2, 3]
    assert "loss_scale" not in history.history


def test_plain_keras_loss_scale_optimizer_logs_the_scale_only():
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=1024.0
    )
    _, history = _fit(optimizer, [LossScaleMonitor()])
    assert history.history["loss_scale"] == [512.0, 256.0, 128.0]
    assert "skipped_steps" not in history.history


def test_requires_a_loss_scale_optimizer():
    with pytest.raises(ValueError, match="LossScaleMonitor.*loss-scale optimizer"):
        _fit(keras.optimizers.SGD(0.01), [LossScaleMonitor()])
