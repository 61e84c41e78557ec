"""Tests for `tf_lars.callbacks.LossScaleMonitor`."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lars
from tf_lars.callbacks import LossScaleMonitor

EPOCHS = 3


def _data():
    """12 samples in 3 batches of 4; batch 2 holds an inf, so one skip per epoch."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 3)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5]], np.float32)).astype(np.float32)
    x[9, 1] = np.inf
    return x, y


def _fit(optimizer, callbacks):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse")
    x, y = _data()
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


def test_bad_arguments():
    with pytest.raises(ValueError, match="at most one of `log_dir` and `writer`"):
        LossScaleMonitor(log_dir="/tmp/x", writer=tf.summary.create_noop_writer())
    with pytest.raises(ValueError, match="`prefix` must be a str. Received: prefix=3"):
        LossScaleMonitor(prefix=3)


def test_config_round_trip():
    monitor = LossScaleMonitor(log_dir="/tmp/logs", prefix="a/")
    config = monitor.get_config()
    assert config == {"log_dir": "/tmp/logs", "prefix": "a/"}
    assert LossScaleMonitor(**config).get_config() == config
    assert (
        keras.saving.get_registered_name(LossScaleMonitor) == "tf_lars>LossScaleMonitor"
    )
