"""`tf_lars.LossScaleOptimizer` on whichever Keras backend runs the suite.

The same file runs under `KERAS_BACKEND=tensorflow`, `jax` and `torch`:
gradients are given as arrays (no autodiff), and every number is the Keras 3
reference of docs/algorithms.md ("Loss scaling") or a NumPy reference.
"""

import keras
import numpy as np
import pytest
from keras import ops

import tf_lars
from tests import harness

BACKEND = keras.backend.backend()


def numpy_of(value):
    return np.asarray(ops.convert_to_numpy(value))


def sgd_wrapper(dynamic=True, **kwargs):
    inner = keras.optimizers.SGD(0.5, momentum=0.5)
    return tf_lars.LossScaleOptimizer(inner, dynamic=dynamic, **kwargs)


def inner_state(optimizer):
    """The inner optimizer's variables (momentum, `iterations`) as NumPy."""
    return {v.path: numpy_of(v) for v in optimizer.inner_optimizer.variables}


#: How `apply` runs, per backend (tests/harness.py `step_function`).
MODES = {
    "tensorflow": ["eager", "function", "jit"],
    "jax": ["eager", "stateless", "jit"],
    "torch": ["eager"],
}[BACKEND]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dynamic", [True, False])
def test_apply_reference_values(dynamic, mode):
    # Keras 3 reference: gradients [1, 1, 1, 1] * initial_scale on
    # [1, 2, 3, 4] with SGD(0.5) give [0.5, 1.5, 2.5, 3.5]; four non-finite
    # steps from 400 leave 25 (fixed: 400), and touch nothing else.
    optimizer = sgd_wrapper(dynamic, initial_scale=400.0)
    variable = keras.Variable([1.0, 2.0, 3.0, 4.0])
    step = harness.step_function(optimizer, [variable], mode)
    step([ops.convert_to_tensor(np.full(4, 400.0, "float32"))])
    np.testing.assert_array_equal(numpy_of(variable), [0.5, 1.5, 2.5, 3.5])
    assert int(numpy_of(optimizer.skipped_steps)) == 0
    assert float(numpy_of(optimizer.loss_scale)) == 400.0
    before = inner_state(optimizer)
    for bad in (np.inf, -np.inf, np.nan, np.inf):
        # An eager `apply` with a non-finite gradient: Keras's own wrapper
        # fails here on JAX (UnexpectedTracerError in `Cond.call`).
        step([ops.convert_to_tensor(np.array([1.0, bad, 1.0, 1.0], "float32"))])
    np.testing.assert_array_equal(numpy_of(variable), [0.5, 1.5, 2.5, 3.5])
    after = inner_state(optimizer)
    assert before.keys() == after.keys()
    for path in before:
        np.testing.assert_array_equal(after[path], before[path], err_msg=path)
    assert int(numpy_of(optimizer.iterations)) == 1
    assert int(numpy_of(optimizer.skipped_steps)) == 4
    assert float(numpy_of(optimizer.loss_scale)) == (25.0 if dynamic else 400.0)
    assert float(numpy_of(optimizer.scale_loss(1.0))) == (25.0 if dynamic else 400.0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dynamic", [True, False])
def test_growth_reference_values(dynamic, mode):
    # Keras 3 reference: initial 2 with growth 2 reaches 32 after 8 finite
    # steps; every step applies the unscaled gradient (ones).
    optimizer = tf_lars.LossScaleOptimizer(
        keras.optimizers.SGD(0.5),
        initial_scale=2.0,
        dynamic=dynamic,
        dynamic_growth_steps=2,
    )
    variable = keras.Variable([1.0, 2.0, 3.0, 4.0])
    step = harness.step_function(optimizer, [variable], mode)
    scales = []
    for _ in range(8):
        step([optimizer.scale_loss(ops.ones((4,)))])
        scales.append(float(numpy_of(optimizer.loss_scale)))
    if dynamic:
        assert scales == [2.0, 4.0, 4.0, 8.0, 8.0, 16.0, 16.0, 32.0]
    else:
        assert scales == [2.0] * 8
    np.testing.assert_array_equal(numpy_of(variable), [-3.0, -2.0, -1.0, 0.0])
    assert int(numpy_of(optimizer.iterations)) == 8
    assert int(numpy_of(optimizer.skipped_steps)) == 0


def test_scale_stays_within_the_float32_normal_range():
    top = float(np.finfo(np.float32).max)
    tiny = float(np.finfo(np.float32).tiny)
    optimizer = tf_lars.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=2.0**127, dynamic_growth_steps=1
    )
    variable = keras.Variable([1.0])
    optimizer.apply([np.full(1, 2.0**127, "float32")], [variable])
    assert float(numpy_of(optimizer.loss_scale)) == 2.0**127  # 2**128 is inf
    np.testing.assert_allclose(numpy_of(variable), [0.9], rtol=1e-6)
    optimizer = tf_lars.LossScaleOptimizer(
        keras.optimizers.SGD(0.0), initial_scale=top, dynamic_growth_steps=1
    )
    optimizer.apply([np.ones(1, "float32")], [variable])
    assert float(numpy_of(optimizer.loss_scale)) == np.float32(top)
    low = tf_lars.LossScaleOptimizer(keras.optimizers.SGD(0.0), initial_scale=tiny)
    low.apply([np.array([np.nan], "float32")], [variable])
    assert float(numpy_of(low.loss_scale)) == np.float32(tiny)
    assert int(numpy_of(low.skipped_steps)) == 1


def _stateless_step(optimizer):
    """`stateless_apply` as the JAX trainer calls it (under `jax.jit` on JAX)."""
    if BACKEND != "jax":
        return optimizer.stateless_apply
    import jax

    return jax.jit(optimizer.stateless_apply)


def test_stateless_apply_matches_apply():
    # What the JAX trainer calls, under `jax.jit` on JAX. TensorFlow's
    # optimizers write their variables directly: refused there, naming it.
    optimizer = sgd_wrapper(initial_scale=4.0, dynamic_growth_steps=2)
    variable = keras.Variable([1.0, 2.0, 3.0, 4.0])
    optimizer.build([variable])
    if BACKEND == "tensorflow":
        with pytest.raises(ValueError, match="with the TensorFlow backend"):
            optimizer.stateless_apply([], [], [])
        return
    step = _stateless_step(optimizer)
    model_values = [ops.convert_to_tensor(numpy_of(variable))]
    values = [ops.convert_to_tensor(numpy_of(v)) for v in optimizer.variables]
    grads = [
        np.full(4, 4.0, "float32"),
        np.array([np.nan, 0.0, 0.0, 0.0], "float32"),
        np.full(4, 2.0, "float32"),
    ]
    for grad in grads:
        before = numpy_of(variable)
        model_values, values = step(values, [ops.convert_to_tensor(grad)], model_values)
        # `stateless_apply` leaves the variable alone; `apply` moves it.
        np.testing.assert_array_equal(numpy_of(variable), before)
        optimizer.apply([grad], [variable])
    np.testing.assert_array_equal(numpy_of(model_values[0]), numpy_of(variable))
    for value, reference in zip(values, optimizer.variables, strict=True):
        np.testing.assert_array_equal(numpy_of(value), numpy_of(reference))
    # Momentum SGD on ones, a skipped step, ones: v = -0.5, then -0.75.
    np.testing.assert_array_equal(numpy_of(variable), [-0.25, 0.75, 1.75, 2.75])
    assert float(numpy_of(optimizer.loss_scale)) == 2.0
    assert int(numpy_of(optimizer.iterations)) == 2


# --------------------------------------------------------------- model.fit

JIT_MODES = {"tensorflow": [False, True], "jax": [False, True], "torch": [False]}


@pytest.mark.parametrize("jit_compile", JIT_MODES[BACKEND])
def test_fit_applies_finite_batches_and_skips_a_non_finite_one(jit_compile):
    kernel = np.array([[0.5, -0.25], [0.125, 1.0], [-1.0, 0.75]], "float32")
    bias = np.array([0.1, -0.2], "float32")
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(
                2,
                kernel_initializer=keras.initializers.Constant(kernel),
                bias_initializer=keras.initializers.Constant(bias),
            ),
        ]
    )
    optimizer = tf_lars.LossScaleOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), initial_scale=2.0**10
    )
    model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 3)).astype("float32")
    y = rng.normal(size=(12, 2)).astype("float32")
    x[9, 1] = np.inf  # the third batch of four: a non-finite loss
    history = model.fit(
        x,
        y,
        batch_size=4,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[tf_lars.callbacks.LossScaleMonitor()],
    )
    assert history.history["loss_scale"] == [2.0**9]
    assert history.history["skipped_steps"] == [1]
    # NumPy: momentum SGD on the mean squared error over the first two
    # batches; the third is skipped.
    velocity = [np.zeros_like(kernel), np.zeros_like(bias)]
    expected_k, expected_b = kernel.astype("float64"), bias.astype("float64")
    for start in (0, 4):
        xb, yb = x[start : start + 4], y[start : start + 4]
        error = xb @ expected_k + expected_b - yb
        grads = (2.0 * xb.T @ error / error.size, 2.0 * error.sum(0) / error.size)
        velocity = [0.9 * v - 0.1 * g for v, g in zip(velocity, grads, strict=True)]
        expected_k, expected_b = expected_k + velocity[0], expected_b + velocity[1]
    dense = model.layers[0]
    np.testing.assert_allclose(numpy_of(dense.kernel), expected_k, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(numpy_of(dense.bias), expected_b, rtol=1e-5, atol=1e-6)
    assert int(numpy_of(optimizer.iterations)) == 2
    assert int(numpy_of(optimizer.skipped_steps)) == 1
    assert float(numpy_of(optimizer.loss_scale)) == 2.0**9


def _dense_model():
    kernel = np.array([[0.5, -0.25], [0.125, 1.0], [-1.0, 0.75]], "float32")
    return keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(
                2,
                kernel_initializer=keras.initializers.Constant(kernel),
                bias_initializer=keras.initializers.Constant([0.1, -0.2]),
            ),
        ]
    )


@pytest.mark.parametrize("jit_compile", JIT_MODES[BACKEND])
def test_wrapped_lars_takes_lars_steps_and_skips_a_non_finite_batch(jit_compile):
    # Around LARS (weight decay on, so the trust ratio is not scale-free):
    # the finite batches give exactly plain LARS's weights and slots, the
    # non-finite one is skipped.
    def lars():
        return tf_lars.LARS(0.5, momentum=0.9, weight_decay=0.01)

    rng = np.random.default_rng(1)
    x = rng.normal(size=(12, 3)).astype("float32")
    y = rng.normal(size=(12, 2)).astype("float32")
    plain = _dense_model()
    plain.compile(optimizer=lars(), loss="mse", jit_compile=jit_compile)
    plain.fit(x[:8], y[:8], batch_size=4, shuffle=False, verbose=0)
    x[10, 0] = np.nan
    wrapped = _dense_model()
    optimizer = tf_lars.LossScaleOptimizer(lars(), initial_scale=2.0**12)
    wrapped.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
    wrapped.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    for got, want in zip(wrapped.weights, plain.weights, strict=True):
        np.testing.assert_allclose(numpy_of(got), numpy_of(want), rtol=1e-6, atol=1e-7)
    inner = optimizer.inner_optimizer.variables
    for got, want in zip(inner, plain.optimizer.variables, strict=True):
        np.testing.assert_allclose(numpy_of(got), numpy_of(want), rtol=1e-6, atol=1e-7)
    assert int(numpy_of(optimizer.iterations)) == 2
    assert int(numpy_of(optimizer.skipped_steps)) == 1
    assert float(numpy_of(optimizer.loss_scale)) == 2.0**11
