"""`tf_lars.GradientNoiseScale` on whichever Keras backend runs the suite.

Known answers (tests/noise_scale_problems.py): the noisy quadratic model and
linear regression at fixed weights, whose `B_simple = tr(Σ) / |G|²` is exact;
the wrapper, given small-batch gradients drawn from them, must come within
10%. Then a NumPy transcription of the estimator, the inner step unchanged,
serialization, bad arguments and the callback. Under MirroredStrategy (the
replicas' batches as the small ones): tests/mirrored_script.py, `noise_scale`.
"""

import math
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
from keras import ops

import tf_lars
from tests import harness
from tests import noise_scale_problems as problems

BACKEND = keras.backend.backend()
#: How `apply` runs, per backend (tests/harness.py `step_function`): compiled
#: where Keras's accumulation is slow op by op (a `cond` per step).
MODE = {"tensorflow": "function", "jax": "jit", "torch": "eager"}[BACKEND]


def noise_scale(inner=None, batch_size=8, steps=4, **kwargs):
    inner = keras.optimizers.SGD(0.0) if inner is None else inner
    return tf_lars.GradientNoiseScale(
        inner, batch_size=batch_size, gradient_accumulation_steps=steps, **kwargs
    )


def apply_all(optimizer, variable, gradients):
    step = harness.step_function(optimizer, [variable], MODE)
    for gradient in gradients:
        step([ops.convert_to_tensor(gradient)])


def test_noisy_quadratic_known_answer():
    # Fixed weights (learning rate 0): 100 updates of 4 micro-batches of 8.
    problem = problems.NoisyQuadratic(scale=2.0)
    optimizer = noise_scale(batch_size=8, steps=4, beta=0.999)
    variable = keras.Variable(problem.theta)
    apply_all(optimizer, variable, problem.batch_gradients(8, 400, seed=0))
    np.testing.assert_array_equal(ops.convert_to_numpy(variable), problem.theta)
    assert optimizer.b_simple == pytest.approx(problem.b_simple(), rel=0.1)
    assert optimizer.trace_covariance == pytest.approx(problem.trace(), rel=0.1)
    assert optimizer.gradient_norm_squared == pytest.approx(
        problem.norm_squared(), rel=0.1
    )
    assert int(ops.convert_to_numpy(optimizer.iterations)) == 100


def test_linear_regression_known_answer_through_fit_and_history():
    # Keras computes each micro-batch's gradient of the mean squared error;
    # the exact value is from the 2,048 examples' own gradients (NumPy).
    x, y = problems.regression_data(2048, 8, seed=0)
    kernel = np.random.default_rng(5).normal(size=(8, 1)).astype("float32")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.set_weights([kernel, np.zeros(1, "float32")])
    model.compile(optimizer=noise_scale(batch_size=8, beta=0.999), loss="mse")
    monitor = tf_lars.callbacks.GradientNoiseScaleMonitor()
    history = model.fit(
        x, y, batch_size=8, epochs=2, verbose=0, callbacks=[monitor], shuffle=True
    )
    exact = problems.regression_b_simple(x, y, kernel, np.zeros(1))
    scales = history.history["gradient_noise_scale"]
    assert len(scales) == 2
    assert scales[-1] == pytest.approx(exact, rel=0.1)
    assert scales[-1] == model.optimizer.b_simple
    for key in ("gradient_norm_squared", "trace_covariance"):
        assert history.history[key][-1] == getattr(model.optimizer, key)
    np.testing.assert_array_equal(model.get_weights()[0], kernel)


def test_the_estimator_as_written_in_numpy():
    # Three updates of two micro-batches (batch 5), beta 0.5, bias-corrected.
    rng = np.random.default_rng(2)
    gradients = rng.normal(size=(6, 3)).astype("float32")
    optimizer = noise_scale(batch_size=5, steps=2, beta=0.5)
    apply_all(optimizer, keras.Variable(np.zeros(3, "float32")), gradients)
    norm_average = trace_average = 0.0
    for first, second in gradients.reshape(3, 2, 3).astype("float64"):
        small = (first @ first + second @ second) / 2
        big = (first + second) @ (first + second) / 4
        norm_average = 0.5 * norm_average + 0.5 * (2 * big - small)
        trace_average = 0.5 * trace_average + 0.5 * (small - big) * 10
    correction = 1 - 0.5**3
    assert optimizer.gradient_norm_squared == pytest.approx(
        norm_average / correction, rel=1e-5
    )
    assert optimizer.trace_covariance == pytest.approx(
        trace_average / correction, rel=1e-5
    )
    assert optimizer.b_simple == pytest.approx(trace_average / norm_average, rel=1e-5)


def test_nothing_measured_reads_nan():
    optimizer = noise_scale()
    assert math.isnan(optimizer.b_simple)
    optimizer.build([keras.Variable(np.zeros(2, "float32"))])
    assert math.isnan(optimizer.gradient_norm_squared)
    assert math.isnan(optimizer.trace_covariance)


@pytest.mark.parametrize(
    "inner",
    [
        lambda steps: keras.optimizers.SGD(
            0.1, momentum=0.9, nesterov=True, gradient_accumulation_steps=steps
        ),
        lambda steps: keras.optimizers.Adam(
            0.01, clipnorm=1.0, gradient_accumulation_steps=steps
        ),
        lambda steps: tf_lars.LARS(
            0.5, momentum=0.9, weight_decay=1e-3, gradient_accumulation_steps=steps
        ),
    ],
    ids=["SGD", "Adam", "LARS"],
)
def test_weights_equal_the_inner_optimizer_alone(inner):
    # Keras's accumulation of 3 micro-batches, with and without the wrapper
    # (a constant learning rate: Keras evaluates a schedule at the count of
    # micro-batches, the wrapper's inner optimizer at the count of updates).
    weights, grads = harness.random_problem("float32", [(4, 3), (3,)], steps=9)
    results = []
    for optimizer in (inner(3), noise_scale(inner(None), steps=3)):
        variables = [keras.Variable(w) for w in weights]
        step = harness.step_function(optimizer, variables, MODE)
        for step_grads in grads:
            step([ops.convert_to_tensor(g) for g in step_grads])
        results.append([ops.convert_to_numpy(v) for v in variables])
        assert int(ops.convert_to_numpy(optimizer.iterations)) == 3
    for wrapped, own, start in zip(results[1], results[0], weights, strict=True):
        np.testing.assert_allclose(wrapped, own, rtol=1e-6, atol=1e-7)
        assert not np.allclose(wrapped, start)


def test_the_inner_moving_average_becomes_the_weights():
    # What `fit` calls at its end, `finalize_variable_values`, reaches the
    # inner optimizer (before, the wrapper passed it on to none, and `fit`
    # ended on the raw weights). The inner optimizer alone takes the mean of
    # each 3 micro-batches (Keras's own accumulation would also update the
    # average at every micro-batch).
    weights, grads = harness.random_problem("float32", [(4, 3), (3,)], steps=9)
    means = [
        [np.mean([g[i] for g in grads[k : k + 3]], axis=0) for i in range(2)]
        for k in range(0, 9, 3)
    ]
    results = []
    for wrapped in (False, True):
        inner = keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.5)
        optimizer = noise_scale(inner, steps=3) if wrapped else inner
        variables = [keras.Variable(w) for w in weights]
        step = harness.step_function(optimizer, variables, MODE)
        for step_grads in grads if wrapped else means:
            step([ops.convert_to_tensor(g) for g in step_grads])
        raw = [ops.convert_to_numpy(v) for v in variables]
        optimizer.finalize_variable_values(variables)
        results.append([ops.convert_to_numpy(v) for v in variables])
        assert not np.allclose(results[-1][0], raw[0])  # the average, not w
    for wrapped, own in zip(results[1], results[0], strict=True):
        np.testing.assert_allclose(wrapped, own, rtol=1e-6, atol=1e-7)


def test_measures_the_unscaled_gradients_inside_a_loss_scale():
    rng = np.random.default_rng(3)
    gradients = rng.normal(size=(4, 3)).astype("float32")
    measured = []
    for scale in (None, 1024.0):
        optimizer = noise_scale(batch_size=2, steps=2, beta=0.0)
        if scale is not None:
            optimizer = tf_lars.LossScaleOptimizer(optimizer, initial_scale=scale)
        apply_all(
            optimizer, keras.Variable(np.ones(3, "float32")), gradients * (scale or 1)
        )
        wrapper = optimizer if scale is None else optimizer.inner_optimizer
        measured.append((wrapper.gradient_norm_squared, wrapper.trace_covariance))
    np.testing.assert_allclose(measured[1], measured[0], rtol=1e-5)


def test_config_round_trip():
    optimizer = tf_lars.GradientNoiseScale(
        keras.optimizers.Adam(0.003),
        batch_size=32,
        beta=0.9,
        gradient_accumulation_steps=4,
        name="gns",
    )
    config = optimizer.get_config()
    assert {k: v for k, v in config.items() if k != "inner_optimizer"} == {
        "batch_size": 32,
        "beta": 0.9,
        "gradient_accumulation_steps": 4,
        "name": "gns",
    }
    again = tf_lars.GradientNoiseScale.from_config(config)
    assert again.get_config() == config
    assert isinstance(again.inner_optimizer, keras.optimizers.Adam)
    serialized = keras.saving.serialize_keras_object(optimizer)
    assert serialized["registered_name"] == "tf_lars>GradientNoiseScale"
    assert type(keras.saving.deserialize_keras_object(serialized)) is type(optimizer)
    with pytest.raises(ValueError, match="Unknown key"):
        tf_lars.GradientNoiseScale.from_config({**config, "batchsize": 3})


def test_keras_file_round_trip(tmp_path):
    x, y = problems.regression_data(64, 3, seed=1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=noise_scale(keras.optimizers.SGD(0.01), 8, 2), loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is type(model.optimizer)
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    for name in ("b_simple", "gradient_norm_squared", "trace_covariance"):
        assert getattr(loaded.optimizer, name) == getattr(model.optimizer, name)
    assert math.isfinite(loaded.optimizer.b_simple)
    assert int(ops.convert_to_numpy(loaded.optimizer.iterations)) == 4


class _NoRate(keras.optimizers.SGD):  # as Keras's MultiOptimizer
    @property
    def learning_rate(self):
        raise AttributeError("Learning rate cannot be accessed on a MultiOptimizer.")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch_size": 0}, "`batch_size` must be an int >= 1. Received: batch_size=0"),
        ({"batch_size": 2.5}, "Received: batch_size=2.5"),
        ({"batch_size": True}, "Received: batch_size=True"),
        ({"batch_size": None}, "Received: batch_size=None"),
        ({"beta": 1.0}, "`beta` must be >= 0.0 and < 1.0. Received: beta=1.0"),
        ({"beta": -0.1}, "Received: beta=-0.1"),
        ({"beta": float("nan")}, "Received: beta=nan"),
        ({"gradient_accumulation_steps": 1}, "Received: gradient_accumulation_steps=1"),
        ({"gradient_accumulation_steps": 2.0}, "int >= 2"),
        ({"inner_optimizer": "sgd"}, "Received: inner_optimizer='sgd'"),
        (
            {
                "inner_optimizer": keras.optimizers.LossScaleOptimizer(
                    keras.optimizers.SGD()
                )
            },
            "must not be a loss-scale optimizer",
        ),
        (
            {"inner_optimizer": keras.optimizers.SGD(gradient_accumulation_steps=2)},
            "Received: inner_optimizer.gradient_accumulation_steps=2",
        ),
        (  # it failed at the first update, inside Keras's accumulation `cond`
            {"inner_optimizer": _NoRate()},
            "`inner_optimizer` must have a learning rate, read at every update "
            "(Learning rate cannot be accessed on a MultiOptimizer.). Received: ",
        ),
    ],
)
def test_bad_arguments_name_the_argument_and_value(kwargs, message):
    arguments = {
        "inner_optimizer": keras.optimizers.SGD(),
        "batch_size": 8,
        "gradient_accumulation_steps": 2,
        **kwargs,
    }
    with pytest.raises(ValueError, match=re.escape(message)):
        tf_lars.GradientNoiseScale(**arguments)


def test_one_batch_size_alone_is_refused_at_the_first_step():
    optimizer = tf_lars.GradientNoiseScale(keras.optimizers.SGD(), batch_size=8)
    with pytest.raises(
        ValueError, match="gradient_accumulation_steps=None on 1 replica"
    ):
        optimizer.apply(
            [np.ones(2, "float32")], [keras.Variable(np.zeros(2, "float32"))]
        )


def test_the_monitor_needs_the_wrapper_and_takes_a_prefix():
    x, y = problems.regression_data(32, 2, seed=3)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(), loss="mse")
    monitor = tf_lars.callbacks.GradientNoiseScaleMonitor(prefix="gns/")
    with pytest.raises(ValueError, match="needs a model compiled with"):
        model.fit(x, y, verbose=0, callbacks=[monitor])
    assert monitor.get_config() == {"log_dir": None, "prefix": "gns/"}


@pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution runs on JAX only")
def test_keras_distribution_data_parallel_equals_one_device():
    script = os.path.join(os.path.dirname(__file__), "distribution_script.py")
    env = dict(
        os.environ,
        KERAS_BACKEND="jax",
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
    )
    result = subprocess.run(
        [sys.executable, script, "noise_scale"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "noise_scale OK" in result.stdout, result.stdout + result.stderr


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.distribute: TensorFlow only")
def test_mirrored_strategy_measures_the_replicas_batches():
    stdout = harness.run_mirrored("noise_scale")
    assert "MIRRORED NOISE SCALE OK" in stdout, stdout


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.IndexedSlices: TensorFlow")
def test_sparse_gradients_measure_as_their_dense_form():
    # Rows given twice are summed before squaring (an embedding's gradient).
    import tensorflow as tf

    values = [[[1.0, 2, 3], [1, 1, 1], [0, 1, 0]], [[2.0, 0, 1], [1, 0, 0], [3, 3, 3]]]
    rows = [[0, 2, 0], [0, 4, 4]]
    measured = []
    for sparse in (True, False):
        optimizer = noise_scale(batch_size=2, steps=2, beta=0.0)
        variable = keras.Variable(np.zeros((5, 3), "float32"))
        for value, row in zip(values, rows, strict=True):
            gradient = tf.IndexedSlices(tf.constant(value), tf.constant(row), [5, 3])
            optimizer.apply(
                [gradient if sparse else tf.convert_to_tensor(gradient)], [variable]
            )
        measured.append((optimizer.gradient_norm_squared, optimizer.trace_covariance))
    np.testing.assert_allclose(measured[0], measured[1], rtol=1e-6)
    assert measured[0][0] != 0.0 and measured[0][1] != 0.0
