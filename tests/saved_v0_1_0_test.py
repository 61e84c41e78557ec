"""Files written by tf_lars 0.1.0 load and train on exactly as under 0.1.0.

The files in tests/data were written by tests/data/make_v0_1_0.py with the
0.1.0 release; the expected weights are what 0.1.0 itself computed when it
continued training from them. Registered names (`tf_lars>LARS`, ...) and the
checkpoint layout are frozen: this test is what holds them.
"""

import pathlib

import keras
import numpy as np
import tensorflow as tf

import tf_lars

DATA = pathlib.Path(__file__).resolve().parent / "data"


def _data():
    with np.load(DATA / "v0_1_0_data.npz") as arrays:
        return arrays["x"], arrays["y"]


def _expected(name):
    with np.load(DATA / name) as arrays:
        return [arrays[f"arr_{i}"] for i in range(len(arrays.files))]


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(5, activation="tanh", name="hidden"),
            keras.layers.Dense(3, name="out"),
        ]
    )


def test_keras_file_from_0_1_0_continues_exactly():
    x, y = _data()
    model = keras.models.load_model(DATA / "v0_1_0_lars.keras")
    optimizer = model.optimizer
    assert isinstance(optimizer, tf_lars.LossScaleOptimizer)
    assert isinstance(optimizer.inner_optimizer, tf_lars.LARS)
    assert optimizer.inner_optimizer.nesterov
    assert int(optimizer.iterations.numpy()) == 4
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert int(optimizer.iterations.numpy()) == 8
    for got, want in zip(model.weights, _expected("v0_1_0_lars_expected.npz")):
        np.testing.assert_array_equal(got.numpy(), want)


def test_agn_checkpoint_from_0_1_0_continues_exactly():
    x, y = _data()
    model = _model()
    optimizer = tf_lars.AGN(
        tf_lars.LARS(learning_rate=0.3, momentum=0.9, weight_decay=1e-3),
        communication_period=3,
    )
    optimizer.build(model.trainable_variables)
    status = tf.train.Checkpoint(model=model, optimizer=optimizer).read(
        str(DATA / "v0_1_0_agn_ckpt")
    )
    status.assert_existing_objects_matched()
    assert int(optimizer.commits.numpy()) == 1
    assert int(optimizer.iterations.numpy()) == 4

    for i in range(4):
        with tf.GradientTape() as tape:
            logits = model(x[8 * i : 8 * i + 8])
            loss = tf.reduce_mean(
                keras.losses.sparse_categorical_crossentropy(
                    y[8 * i : 8 * i + 8], logits, from_logits=True
                )
            )
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
    assert int(optimizer.commits.numpy()) == 2
    for got, want in zip(model.weights, _expected("v0_1_0_agn_expected.npz")):
        np.testing.assert_array_equal(got.numpy(), want)
