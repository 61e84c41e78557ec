"""Tests for tf_lars.callbacks.TrustRatioMonitor."""

import glob
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.util import event_pb2

import tf_lars
from tf_lars.callbacks import TrustRatioMonitor

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


def test_records_the_trust_ratio_of_each_epochs_last_step():
    # Full batch: one step per epoch, so the ratio recorded at an epoch's end
    # is the one computed from the weights at that epoch's start.
    x, y = _data()
    model = _model()
    optimizer = _lars(exclude_from_layer_adaptation=["out/bias"])
    model.compile(optimizer=optimizer, loss="mse")
    monitor = TrustRatioMonitor()
    snapshot = _SnapshotWeights()
    history = model.fit(
        x,
        y,
        batch_size=32,
        epochs=3,
        verbose=0,
        shuffle=False,
        callbacks=[snapshot, monitor],
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
    # The per-layer values go to the history, not the progress-bar logs.
    assert "loss_scale" not in history.history
    assert len(history.history["loss"]) == 3


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
    values = {}
    for path in glob.glob(os.path.join(log_dir, "events.out.tfevents.*")):
        for record in tf.data.TFRecordDataset(path):
            event = event_pb2.Event.FromString(record.numpy())
            for value in event.summary.value:
                assert value.metadata.plugin_data.plugin_name == "scalars"
                values.setdefault(value.tag, []).append(
                    (event.step, float(tf.make_ndarray(value.tensor)))
                )
    return values


def test_tensorboard_scalars_at_optimizer_steps(tmp_path):
    x, y = _data()
    model = _model()
    model.compile(optimizer=_lars(), loss="mse")
    log_dir = os.path.join(tmp_path, "tb")
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


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"log_every_n_batches": 0}, "Received: log_every_n_batches=0"),
        ({"log_every_n_batches": 1.5}, "Received: log_every_n_batches=1.5"),
        ({"log_every_n_batches": True}, "Received: log_every_n_batches=True"),
        ({"prefix": None}, "`prefix` must be a str. Received: prefix=None"),
        ({"log_dir": "a", "writer": object()}, "Give at most one of `log_dir`"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError) as error:
        TrustRatioMonitor(**kwargs)
    assert message in str(error.value)


def test_config_round_trip_and_registration():
    monitor = TrustRatioMonitor(log_every_n_batches=5, log_dir="logs", prefix="t/")
    config = monitor.get_config()
    assert config == {"log_every_n_batches": 5, "log_dir": "logs", "prefix": "t/"}
    restored = TrustRatioMonitor(**config)
    assert restored.get_config() == config
    assert (
        keras.saving.get_registered_name(TrustRatioMonitor)
        == "tf_lars>TrustRatioMonitor"
    )
    assert tf_lars.callbacks.TrustRatioMonitor is TrustRatioMonitor
