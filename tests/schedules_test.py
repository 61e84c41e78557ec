"""Tests for tf_lars.schedules: WarmupPolynomialDecay and linear scaling."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lars
from tf_lars.schedules import WarmupPolynomialDecay, linear_scaled_learning_rate


def reference_schedule(step, peak, warmup, decay, end=0.0, power=2.0):
    """NumPy reference, written from the docstring's formula (float64)."""
    step = np.asarray(step, dtype=np.float64)
    warm = peak * step / max(warmup, 1)
    t = np.clip(step - warmup, 0, decay)
    poly = (peak - end) * (1.0 - t / decay) ** power + end
    return np.where(step < warmup, warm, poly)


CASES = [
    # peak, warmup_steps, decay_steps, end, power
    (0.8, 5, 20, 0.0, 2.0),  # the MLPerf recipe shape
    (1.5, 3, 7, 0.1, 1.0),  # linear decay to a non-zero end
    (0.3, 0, 10, 0.0, 2.0),  # no warm-up: starts at the peak
    (2.0, 4, 1, 0.5, 0.5),  # one decay step, fractional power
    (10.0, 1, 6, 0.0, 3.0),
]


@pytest.mark.parametrize("peak, warmup, decay, end, power", CASES)
def test_matches_numpy_reference_at_every_step(peak, warmup, decay, end, power):
    schedule = WarmupPolynomialDecay(peak, warmup, decay, end, power)
    steps = np.arange(0, warmup + decay + 4)
    got = np.array([float(schedule(int(s))) for s in steps])
    want = reference_schedule(steps, peak, warmup, decay, end, power)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    # The boundaries, spelled out.
    assert float(schedule(warmup)) == pytest.approx(peak, rel=1e-6)
    assert float(schedule(warmup + decay)) == pytest.approx(end, abs=1e-7)
    assert float(schedule(warmup + decay + 100)) == pytest.approx(end, abs=1e-7)
    if warmup:
        assert float(schedule(0)) == 0.0
        assert float(schedule(warmup - 1)) == pytest.approx(
            peak * (warmup - 1) / warmup, rel=1e-6
        )
    assert float(schedule(warmup + 1)) == pytest.approx(
        (peak - end) * (1 - 1 / decay) ** power + end, rel=1e-6
    )


@pytest.mark.parametrize("jit_compile", [False, True])
def test_same_values_under_tf_function_and_xla(jit_compile):
    peak, warmup, decay, end, power = 1.5, 3, 7, 0.1, 1.0
    schedule = WarmupPolynomialDecay(peak, warmup, decay, end, power)
    compiled = tf.function(schedule.__call__, jit_compile=jit_compile)
    steps = np.arange(0, 14)
    got = np.array([float(compiled(tf.constant(s, tf.int64))) for s in steps])
    want = reference_schedule(steps, peak, warmup, decay, end, power)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    # A vector of steps in one call (element-wise ops only).
    vector = compiled(tf.range(14, dtype=tf.int64)).numpy()
    np.testing.assert_allclose(vector, want, rtol=1e-6, atol=1e-7)


def test_optimizer_applies_the_schedule_step_by_step():
    # SGD without momentum and a constant gradient of 1: after n steps the
    # variable has moved by the sum of the first n learning rates, lr(0..n-1)
    # (Keras calls the schedule with `iterations` before incrementing it).
    schedule = WarmupPolynomialDecay(0.5, warmup_steps=2, decay_steps=4, power=2.0)
    variable = keras.Variable(np.zeros(3, np.float32))
    optimizer = keras.optimizers.SGD(learning_rate=schedule)
    positions = []
    for _ in range(8):
        optimizer.apply([tf.ones(3)], [variable])
        positions.append(float(variable.numpy()[0]))
    want = -np.cumsum(reference_schedule(np.arange(8), 0.5, 2, 4))
    np.testing.assert_allclose(positions, want, rtol=1e-6, atol=1e-7)


def test_lars_with_schedule_in_model_fit_uses_xla_and_trains():
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    schedule = WarmupPolynomialDecay(1.0, warmup_steps=4, decay_steps=36)
    optimizer = tf_lars.LARS(learning_rate=schedule, trust_coefficient=0.02)
    model.compile(optimizer=optimizer, loss="mse")  # jit_compile="auto"
    history = model.fit(x, y, batch_size=16, epochs=10, verbose=0, shuffle=False)
    assert int(optimizer.iterations.numpy()) == 40
    assert float(optimizer.learning_rate.numpy()) == pytest.approx(0.0, abs=1e-7)
    assert history.history["loss"][-1] < 0.5 * history.history["loss"][0]


def test_config_round_trip_and_registered_name():
    schedule = WarmupPolynomialDecay(0.4, 10, 90, end_learning_rate=0.01, power=1.5)
    config = schedule.get_config()
    assert config == {
        "peak_learning_rate": 0.4,
        "warmup_steps": 10,
        "decay_steps": 90,
        "end_learning_rate": 0.01,
        "power": 1.5,
        "name": "WarmupPolynomialDecay",
    }
    assert WarmupPolynomialDecay.from_config(config).get_config() == config
    serialized = keras.saving.serialize_keras_object(schedule)
    assert serialized["registered_name"] == "tf_lars>WarmupPolynomialDecay"
    restored = keras.optimizers.schedules.deserialize(serialized)
    assert isinstance(restored, WarmupPolynomialDecay)
    assert [float(restored(s)) for s in (0, 5, 10, 55, 100)] == [
        float(schedule(s)) for s in (0, 5, 10, 55, 100)
    ]
    assert tf_lars.WarmupPolynomialDecay is WarmupPolynomialDecay
    assert tf_lars.schedules.WarmupPolynomialDecay is WarmupPolynomialDecay


def test_saved_model_file_restores_the_schedule_without_custom_objects(tmp_path):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    schedule = WarmupPolynomialDecay(0.2, 3, 17, end_learning_rate=0.02)
    model.compile(optimizer=tf_lars.LARS(learning_rate=schedule), loss="mse")
    model.fit(np.ones((8, 2)), np.ones((8, 1)), epochs=1, batch_size=4, verbose=0)
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    restored = loaded.optimizer._learning_rate
    assert isinstance(restored, WarmupPolynomialDecay)
    assert restored.get_config() == schedule.get_config()
    assert int(loaded.optimizer.iterations.numpy()) == 2
    assert float(loaded.optimizer.learning_rate.numpy()) == pytest.approx(
        0.2 * 2 / 3, rel=1e-6
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"peak_learning_rate": 0.0},
            "`peak_learning_rate` must be a finite number > 0. "
            "Received: peak_learning_rate=0.0",
        ),
        ({"peak_learning_rate": -1}, "Received: peak_learning_rate=-1"),
        ({"peak_learning_rate": float("nan")}, "Received: peak_learning_rate=nan"),
        ({"peak_learning_rate": True}, "Received: peak_learning_rate=True"),
        ({"peak_learning_rate": "0.1"}, "Received: peak_learning_rate='0.1'"),
        (
            {"warmup_steps": -1},
            "`warmup_steps` must be an int >= 0. Received: warmup_steps=-1",
        ),
        ({"warmup_steps": 2.5}, "Received: warmup_steps=2.5"),
        (
            {"decay_steps": 0},
            "`decay_steps` must be an int >= 1. Received: decay_steps=0",
        ),
        ({"decay_steps": None}, "Received: decay_steps=None"),
        (
            {"end_learning_rate": -0.1},
            "`end_learning_rate` must be a finite number in "
            "[0, peak_learning_rate=0.5]. Received: end_learning_rate=-0.1",
        ),
        ({"end_learning_rate": 0.6}, "Received: end_learning_rate=0.6"),
        ({"power": 0}, "`power` must be a finite number > 0. Received: power=0"),
        ({"power": float("inf")}, "Received: power=inf"),
        ({"name": 3}, "`name` must be a str. Received: name=3"),
        (
            {"peak_learning_rate": 1e300},
            "`peak_learning_rate` must be at most 3.4028235e+38",
        ),
        ({"power": 1e300}, "`power` must be at most 3.4028235e+38"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, message):
    arguments = {"peak_learning_rate": 0.5, "warmup_steps": 2, "decay_steps": 10}
    arguments.update(kwargs)
    with pytest.raises(ValueError) as error:
        WarmupPolynomialDecay(**arguments)
    assert message in str(error.value)


def test_linear_scaled_learning_rate_values():
    assert linear_scaled_learning_rate(0.1, 1024) == pytest.approx(0.4)
    assert linear_scaled_learning_rate(0.1, 256) == pytest.approx(0.1)
    assert linear_scaled_learning_rate(0.1, 1347, base_batch_size=32) == pytest.approx(
        0.1 * 1347 / 32
    )
    assert linear_scaled_learning_rate(2, 16, base_batch_size=64) == pytest.approx(0.5)
    assert isinstance(linear_scaled_learning_rate(1, 1, 1), float)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            (0.0, 32),
            "`base_learning_rate` must be a finite number > 0. "
            "Received: base_learning_rate=0.0",
        ),
        ((float("nan"), 32), "Received: base_learning_rate=nan"),
        ((0.1, 0), "`batch_size` must be an int >= 1. Received: batch_size=0"),
        ((0.1, 32.0), "Received: batch_size=32.0"),
        ((0.1, True), "Received: batch_size=True"),
        (
            (0.1, 32, 0),
            "`base_batch_size` must be an int >= 1. Received: base_batch_size=0",
        ),
        ((1e300, 256), "Received: base_learning_rate=1e+300"),
    ],
)
def test_linear_scaled_learning_rate_bad_arguments(args, message):
    with pytest.raises(ValueError) as error:
        linear_scaled_learning_rate(*args)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (
            dict(warmup_steps=2**63, decay_steps=10),
            "`warmup_steps` must be at most 9223372036854775807 (2**63 - 1, the "
            "largest value of the int64 step counter). Received: "
            "warmup_steps=9223372036854775808",
        ),
        (
            dict(warmup_steps=2, decay_steps=2**63),
            "`decay_steps` must be at most 9223372036854775807 (2**63 - 1, the "
            "largest value of the int64 step counter). Received: "
            "decay_steps=9223372036854775808",
        ),
        (
            dict(warmup_steps=2**62, decay_steps=2**62),
            "`warmup_steps + decay_steps` must be at most 9223372036854775807 "
            "(2**63 - 1, the largest value of the int64 step counter). Received: "
            "warmup_steps=4611686018427387904, decay_steps=4611686018427387904",
        ),
    ],
)
def test_step_counts_beyond_the_int64_step_counter_are_refused(arguments, message):
    with pytest.raises(ValueError) as error:
        WarmupPolynomialDecay(1.0, **arguments)
    assert str(error.value) == message


def test_largest_step_counts_run_a_step():
    schedule = WarmupPolynomialDecay(1.0, warmup_steps=2**63 - 2, decay_steps=1)
    variable = keras.Variable([1.0])
    optimizer = keras.optimizers.SGD(schedule)
    optimizer.apply([tf.constant([1.0])], [variable])
    # Step 0 of the warm-up: learning rate 0, the variable unchanged.
    np.testing.assert_array_equal(variable.numpy(), [1.0])
    # Half-way through the warm-up (float32 holds these powers of 2 exactly).
    assert float(schedule(2**62)) == 0.5
