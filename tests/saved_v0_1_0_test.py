"""Files written by tf_lars 0.1.0 load and train on exactly as under 0.1.0.

The files in tests/data were written by tests/data/make_v0_1_0.py with the
0.1.0 release; the expected weights are what 0.1.0 itself computed when it
continued training from them. Registered names (`tf_lars>LARS`, ...) and the
checkpoint layout are frozen: this test is what holds them.

Two checks per file. Bit for bit: the loaded file continues exactly as an
optimizer built in this process with 0.1.0's arguments and given the loaded
values continues. Within `ULPS` float32 ulps: the weights 0.1.0 stored. Those
were computed on another CPU, and float32 results differ in the last bit
between CPUs (AVX-512 and AVX2 kernels sum in different orders: 5 of 30
elements differ by one ulp), so across machines bit-exactness is not a
property to test.
"""

import keras
import numpy as np
import tensorflow as tf

import tf_lars
from tests.saved_across_versions_test import (
    DATA,
    data,
    loop_epoch,
    make_keras_file_optimizer,
    make_model,
)


def _expected(name):
    with np.load(DATA / name) as arrays:
        return [arrays[f"arr_{i}"] for i in range(len(arrays.files))]


# Stored weights agree within this many float32 ulps of each tensor's
# largest entry (one ulp is observed between AVX-512 and AVX2 machines).
ULPS = 8


def _assert_close_to_stored(weights, name):
    stored = _expected(name)
    assert len(weights) == len(stored)
    for got, want in zip(weights, stored, strict=True):
        tolerance = ULPS * np.spacing(np.max(np.abs(want)))
        np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=tolerance)


def _copy_state(source_model, source_optimizer, model, optimizer):
    """Gives `model` and `optimizer` the values of the source ones."""
    for target, value in zip(model.weights, source_model.weights, strict=True):
        target.assign(value)
    shapes = [tuple(v.shape) for v in source_optimizer.variables]
    assert [tuple(v.shape) for v in optimizer.variables] == shapes
    for target, value in zip(
        optimizer.variables, source_optimizer.variables, strict=True
    ):
        target.assign(value)


def test_keras_file_from_0_1_0_continues_exactly():
    x, y = data()
    model = keras.models.load_model(DATA / "v0_1_0_lars.keras")
    optimizer = model.optimizer
    assert isinstance(optimizer, tf_lars.LossScaleOptimizer)
    assert isinstance(optimizer.inner_optimizer, tf_lars.LARS)
    assert optimizer.inner_optimizer.nesterov
    assert int(optimizer.iterations.numpy()) == 4
    fresh = make_model()
    fresh.compile(optimizer=make_keras_file_optimizer(), loss=model.loss)
    fresh.optimizer.build(fresh.trainable_variables)
    _copy_state(model, optimizer, fresh, fresh.optimizer)
    for continued in (model, fresh):
        continued.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert int(optimizer.iterations.numpy()) == 8
    for got, want in zip(model.weights, fresh.weights, strict=True):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    _assert_close_to_stored(model.weights, "v0_1_0_lars_expected.npz")


def _agn_as_in_0_1_0():
    return tf_lars.AGN(
        tf_lars.LARS(learning_rate=0.3, momentum=0.9, weight_decay=1e-3),
        communication_period=3,
    )


def test_agn_checkpoint_from_0_1_0_continues_exactly():
    model = make_model()
    optimizer = _agn_as_in_0_1_0()
    optimizer.build(model.trainable_variables)
    status = tf.train.Checkpoint(model=model, optimizer=optimizer).read(
        str(DATA / "v0_1_0_agn_ckpt")
    )
    status.assert_existing_objects_matched()
    assert int(optimizer.commits.numpy()) == 1
    assert int(optimizer.iterations.numpy()) == 4
    fresh, fresh_optimizer = make_model(), _agn_as_in_0_1_0()
    fresh_optimizer.build(fresh.trainable_variables)
    _copy_state(model, optimizer, fresh, fresh_optimizer)

    loop_epoch(model, optimizer)
    loop_epoch(fresh, fresh_optimizer)
    assert int(optimizer.commits.numpy()) == 2
    for got, want in zip(model.weights, fresh.weights, strict=True):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    _assert_close_to_stored(model.weights, "v0_1_0_agn_expected.npz")
