"""Tests for `tf_lars.LossScaleOptimizer` (tf_lars/loss_scale.py)."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lars
from tests import harness
from tf_lars import loss_scale
from tf_lars._wrapper import BASE_ARGUMENT_DEFAULTS
from tf_lars.loss_scale import LossScaleOptimizer

MODES = ["eager", "function", "jit"]

# Tolerances of the NumPy reference comparison, by variable dtype. float16 has
# an 11-bit significand (eps = 2**-10 ~ 9.8e-4): each step rounds once.
TOLERANCES = {
    "float16": dict(rtol=2e-3, atol=2e-3),
    "float32": dict(rtol=1e-6, atol=1e-6),
    "float64": dict(rtol=1e-12, atol=1e-12),
}


def in_mode(fn, mode):
    """`fn` run eagerly, as a `tf.function`, or as an XLA-compiled function."""
    if mode == "eager":
        return fn
    return tf.function(fn, jit_compile=mode == "jit")


def numpy_state(optimizer):
    """Every optimizer variable (own and inner) as NumPy, keyed by path."""
    return {v.path: np.array(v.numpy()) for v in optimizer.variables}


def make_step(optimizer, kernel, embedding, rows):
    """A train step on `sum(kernel * c_kernel) + sum(embedding[rows] * c_rows)`;
    the embedding's gradient is a `tf.IndexedSlices`."""

    def step(c_kernel, c_rows):
        with tf.GradientTape() as tape:
            dense = kernel * c_kernel
            gathered = tf.gather(embedding, rows)
            loss = tf.reduce_sum(dense) + tf.reduce_sum(gathered * c_rows)
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, [kernel, embedding])
        assert isinstance(grads[1], tf.IndexedSlices)
        optimizer.apply(grads, [kernel, embedding])

    return step


def assert_states_equal(before, after):
    assert before.keys() == after.keys()
    for key in before:
        np.testing.assert_array_equal(after[key], before[key], err_msg=key)


class NumpyLossScaleSGD:
    """The wrapper's rule around `keras.optimizers.SGD(lr, momentum)`, in NumPy."""

    def __init__(self, values, lr, momentum, initial_scale, dynamic, growth_steps):
        self.values = [np.array(v, np.float64) for v in values]
        self.slots = [np.zeros_like(v) for v in self.values]
        self.lr, self.momentum = lr, momentum
        self.scale, self.dynamic, self.growth_steps = (
            initial_scale,
            dynamic,
            growth_steps,
        )
        self.step_counter = self.skipped = self.iterations = 0

    def step(self, unscaled_grads):
        if not all(np.all(np.isfinite(g)) for g in unscaled_grads):
            self.skipped += 1
            if self.dynamic:
                self.step_counter, self.scale = 0, self.scale / 2
            return
        for i, g in enumerate(unscaled_grads):
            self.slots[i] = self.momentum * self.slots[i] - self.lr * g
            self.values[i] = self.values[i] + self.slots[i]
        self.iterations += 1
        if self.dynamic:
            if self.step_counter == self.growth_steps - 1:
                self.step_counter, self.scale = 0, self.scale * 2
            else:
                self.step_counter += 1


# Per step: the coefficient of the dense variable and of the gathered rows of
# the sparse one. The loss is sum(kernel * c_kernel) + sum(rows * c_rows), so
# the gradient of the scaled loss is scale * c (exact: the scale is a power of 2).
EMBEDDING_ROWS = [1, 3, 1]  # row 1 twice: duplicate sparse indices are summed.


def _coefficients():
    rng = np.random.default_rng(7)
    steps = []
    for bad in [None, None, "kernel_nan", None, None, None, "rows_inf", None, None]:
        c_kernel = rng.uniform(-2, 2, size=(3, 2))
        c_rows = rng.uniform(-2, 2, size=(3, 2))
        if bad == "kernel_nan":
            c_kernel[1, 0] = np.nan
        if bad == "rows_inf":
            c_rows[2, 1] = np.inf
        steps.append((c_kernel, c_rows))
    return steps


def _dense_rows_gradient(c_rows, num_rows):
    grad = np.zeros((num_rows, c_rows.shape[1]))
    np.add.at(grad, EMBEDDING_ROWS, c_rows)
    return grad


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize("mode", MODES)
def test_matches_numpy_reference(mode, dtype):
    kernel_init = np.arange(6, dtype=np.float64).reshape(3, 2) / 4 - 0.5
    embedding_init = np.arange(10, dtype=np.float64).reshape(5, 2) / 8 + 0.25
    tolerance = TOLERANCES[dtype]
    for dynamic in [True, False]:
        kernel = keras.Variable(kernel_init, dtype=dtype)
        embedding = keras.Variable(embedding_init, dtype=dtype)
        optimizer = LossScaleOptimizer(
            keras.optimizers.SGD(0.05, momentum=0.9),
            initial_scale=16.0,
            dynamic=dynamic,
            dynamic_growth_steps=3,
        )
        optimizer.build([kernel, embedding])
        inner = optimizer.inner_optimizer
        # Keras SGD rounds its learning rate and momentum to float32.
        reference = NumpyLossScaleSGD(
            [kernel_init, embedding_init],
            lr=float(np.float32(0.05)),
            momentum=float(np.float32(0.9)),
            initial_scale=16.0,
            dynamic=dynamic,
            growth_steps=3,
        )

        step = in_mode(make_step(optimizer, kernel, embedding, EMBEDDING_ROWS), mode)
        for c_kernel, c_rows in _coefficients():
            step(tf.constant(c_kernel, dtype), tf.constant(c_rows, dtype))
            reference.step([c_kernel, _dense_rows_gradient(c_rows, 5)])
            for got, want in [
                (kernel, reference.values[0]),
                (embedding, reference.values[1]),
                (inner.momentums[0], reference.slots[0]),
                (inner.momentums[1], reference.slots[1]),
            ]:
                np.testing.assert_allclose(got.numpy(), want, **tolerance)
            assert float(optimizer.loss_scale) == reference.scale
            assert int(optimizer.step_counter.numpy()) == reference.step_counter
            assert int(optimizer.skipped_steps) == reference.skipped
            assert int(optimizer.iterations) == reference.iterations
        assert reference.skipped == 2
        # 16 -> 8 (NaN) -> 16 (three finite steps) -> 8 (inf).
        assert reference.scale == (8.0 if dynamic else 16.0)


def _make_inner(kind):
    if kind == "adam":
        return keras.optimizers.Adam(0.01)
    return tf_lars.LARS(learning_rate=0.5, momentum=0.9, weight_decay=1e-3)


NON_FINITE_CASES = (
    [
        ("adam", bad, where, mode)
        for bad in [np.nan, np.inf]
        for where in ["dense", "sparse"]
        for mode in MODES
    ]
    + [("lars", np.nan, "dense", mode) for mode in MODES]
    + [("lars", -np.inf, "sparse", mode) for mode in MODES]
)


@pytest.mark.parametrize("inner_kind,bad,where,mode", NON_FINITE_CASES)
def test_non_finite_gradient_skips_step(inner_kind, bad, where, mode):
    kernel = keras.Variable(np.linspace(-1, 1, 6).reshape(3, 2), dtype="float32")
    bias = keras.Variable([0.5, -0.5], dtype="float32")
    embedding = keras.Variable(np.linspace(0, 1, 10).reshape(5, 2), dtype="float32")
    variables = [kernel, bias, embedding]
    optimizer = LossScaleOptimizer(_make_inner(inner_kind), initial_scale=64.0)
    optimizer.build(variables)

    def step(c_kernel, c_bias, c_rows):
        with tf.GradientTape() as tape:
            rows = tf.gather(embedding, [0, 4])
            loss = (
                tf.reduce_sum(kernel * c_kernel)
                + tf.reduce_sum(bias * c_bias)
                + tf.reduce_sum(rows * c_rows)
            )
            scaled = optimizer.scale_loss(loss)
        optimizer.apply(tape.gradient(scaled, variables), variables)

    step = in_mode(step, mode)
    c_kernel = np.full((3, 2), 0.3, np.float32)
    c_bias = np.array([0.2, -0.1], np.float32)
    c_rows = np.full((2, 2), -0.4, np.float32)
    # One finite step first, so the slots hold non-zero values to protect.
    step(c_kernel, c_bias, c_rows)
    assert int(optimizer.iterations) == 1
    before = numpy_state(optimizer)
    values_before = [v.numpy() for v in variables]
    assert any(np.any(value != 0) for value in before.values())

    if where == "dense":
        c_kernel = c_kernel.copy()
        c_kernel[2, 1] = bad
    else:
        c_rows = c_rows.copy()
        c_rows[1, 0] = bad
    step(c_kernel, c_bias, c_rows)

    for var, value in zip(variables, values_before, strict=True):
        np.testing.assert_array_equal(var.numpy(), value)
    after = numpy_state(optimizer)
    inner_paths = [v.path for v in optimizer.inner_optimizer.variables]
    assert_states_equal(
        {k: before[k] for k in inner_paths}, {k: after[k] for k in inner_paths}
    )
    assert int(optimizer.iterations) == 1
    assert float(optimizer.loss_scale) == 32.0
    assert int(optimizer.skipped_steps) == 1
    assert int(optimizer.step_counter.numpy()) == 0


def test_check_finite_dense_and_sparse_never_densifies():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD())
    huge = tf.constant([2**31 - 1, 8], tf.int64)  # 68 GB if densified.
    finite_slices = tf.IndexedSlices(tf.ones((2, 8)), tf.constant([0, 5]), huge)
    bad_slices = tf.IndexedSlices(
        tf.constant([[1.0] * 7 + [-np.inf]] * 2), tf.constant([0, 5]), huge
    )
    dense = tf.ones((3,))
    assert bool(optimizer.check_finite([dense, finite_slices, None]))
    assert not bool(optimizer.check_finite([dense, bad_slices]))
    assert not bool(optimizer.check_finite([tf.constant([0.0, np.nan]), None]))
    assert not bool(optimizer.check_finite([tf.constant([np.inf], tf.float16)]))
    unscaled = loss_scale._unscale(finite_slices, tf.constant(4.0))
    assert isinstance(unscaled, tf.IndexedSlices)
    np.testing.assert_array_equal(unscaled.values.numpy(), np.full((2, 8), 0.25))


def test_float16_gradient_unscaled_in_float32():
    # 2**16 overflows float16: the scale must never be cast to the grad dtype.
    grad = tf.constant([2.0**14, 6.0], tf.float16)
    unscaled = loss_scale._unscale(grad, tf.constant(2.0**16))
    assert unscaled.dtype == tf.float16
    np.testing.assert_array_equal(
        unscaled.numpy(), np.array([0.25, 6 / 65536], np.float16)
    )


def test_jit_step_is_an_on_device_conditional():
    kernel = keras.Variable(np.ones((3, 2), np.float32))
    embedding = keras.Variable(np.ones((5, 2), np.float32))
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), initial_scale=8.0
    )
    optimizer.build([kernel, embedding])

    @tf.function(jit_compile=True)
    def step(c):
        with tf.GradientTape() as tape:
            rows = tf.gather(embedding, [1, 3])
            loss = tf.reduce_sum(kernel * c) + tf.reduce_sum(rows * c[:2])
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, [kernel, embedding])
        optimizer.apply(grads, [kernel, embedding])

    c = tf.ones((3, 2))
    graph_ops = {op.type for op in step.get_concrete_function(c).graph.get_operations()}
    assert {"If", "IsFinite"} <= graph_ops
    assert not graph_ops & {"PyFunc", "EagerPyFunc", "PyFuncStateless"}
    hlo = step.experimental_get_compiler_ir(c)(stage="hlo")
    # The skip decision is the only XLA conditional (the scale is selected).
    assert hlo.count("conditional(") == 1
    for host_op in ["send(", "recv(", "outfeed(", "infeed(", "custom-call("]:
        assert host_op not in hlo
    step(c)
    step(c * np.inf)
    np.testing.assert_allclose(kernel.numpy(), np.full((3, 2), 0.9), rtol=1e-6)
    assert float(optimizer.loss_scale) == 4.0


def test_overwrite_with_gradient_variable_is_not_unscaled():
    var = keras.Variable([1.0, 2.0])
    var.overwrite_with_gradient = True
    # One ordinary variable beside it: Keras 3.5 and 3.6 raise "No gradients
    # provided" when every variable is overwritten.
    other = keras.Variable([1.0])
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=4.0)
    optimizer.apply([tf.constant([7.0, 8.0]), tf.constant([8.0])], [var, other])
    np.testing.assert_array_equal(var.numpy(), [7.0, 8.0])
    np.testing.assert_array_equal(other.numpy(), [0.0])


def test_read_outs_before_and_after_build():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=64)
    assert float(optimizer.loss_scale) == 64.0
    assert int(optimizer.skipped_steps) == 0
    assert float(optimizer.scale_loss(tf.constant(0.5))) == 32.0
    var = keras.Variable([1.0])
    optimizer.apply([tf.constant([np.inf])], [var])
    assert optimizer.skipped_steps.dtype == tf.int64
    assert int(optimizer.skipped_steps) == 1
    assert float(optimizer.scale_loss(tf.constant(0.5))) == 16.0
    # Read-outs are snapshots, not live variables.
    snapshot = optimizer.skipped_steps
    optimizer.apply([tf.constant([np.inf])], [var])
    assert int(snapshot) == 1 and int(optimizer.skipped_steps) == 2
    # `apply_gradients` reports the inner optimizer's step count.
    assert int(optimizer.apply_gradients([(tf.constant([1.0]), var)])) == 1
    assert optimizer.learning_rate is optimizer.inner_optimizer.learning_rate


def _regression_data(n=256):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    w = rng.normal(size=(8, 1)).astype(np.float32)
    y = (x @ w / 3 + 0.1 * np.sin(3 * x[:, :1])).astype(np.float32)
    return x, y


def _lars_for_fit():
    return tf_lars.LARS(
        learning_rate=0.5, momentum=0.9, weight_decay=1e-3, trust_coefficient=0.02
    )


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


# The tolerance of the mixed_float16 end-to-end comparison. Power-of-two scales
# commute with float16 rounding, so the scaled and unscaled runs differ only
# where unscaled float16 gradients fall below 2**-14 (subnormal) and lose bits;
# measured: max |difference| 1.7e-5 after 32 steps. Asserted: float16's
# relative precision (2**-10) plus an absolute 1e-4.
MIXED_RTOL = 2.0**-10
MIXED_ATOL = 1e-4


def test_mixed_float16_fit_with_lars(mixed_float16):
    x, y = _regression_data()

    def make_model():
        keras.utils.set_random_seed(1)
        return keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(16, activation="tanh"),
                keras.layers.Dense(1, dtype="float32"),
            ]
        )

    scaled_model, unscaled_model = make_model(), make_model()
    optimizer = LossScaleOptimizer(
        _lars_for_fit(), initial_scale=256.0, dynamic_growth_steps=5
    )
    scaled_model.compile(optimizer=optimizer, loss="mse", jit_compile=True)
    # `compile(auto_scale_loss=True)` must not wrap it a second time.
    assert scaled_model.optimizer is optimizer
    history = scaled_model.fit(
        x,
        y,
        batch_size=32,
        epochs=4,
        shuffle=False,
        verbose=0,
        callbacks=[tf_lars.callbacks.LossScaleMonitor()],
    )
    unscaled_model.compile(
        optimizer=_lars_for_fit(), loss="mse", jit_compile=True, auto_scale_loss=False
    )
    assert isinstance(unscaled_model.optimizer, tf_lars.LARS)
    unscaled_model.fit(x, y, batch_size=32, epochs=4, shuffle=False, verbose=0)

    losses = history.history["loss"]
    assert losses[-1] < 0.25 * losses[0]
    # 32 finite steps, growth every 5: 256 * 2**6.
    assert history.history["skipped_steps"] == [0, 0, 0, 0]
    assert history.history["loss_scale"][-1] == 256.0 * 2**6
    assert int(optimizer.iterations) == 32
    assert scaled_model.layers[0].kernel.dtype == "float32"
    for scaled, unscaled in zip(
        scaled_model.trainable_variables,
        unscaled_model.trainable_variables,
        strict=True,
    ):
        assert scaled.dtype == "float32"
        np.testing.assert_allclose(
            scaled.numpy(), unscaled.numpy(), rtol=MIXED_RTOL, atol=MIXED_ATOL
        )


def _fit_embedding_model(targets_of, initial_scale):
    """3 epochs of `fit` (XLA) of an embedding model in the loss-scale wrapper.

    Returns the history, the optimizer, the model and the types of the
    gradients its finite check saw.
    """
    seen_gradient_types = set()

    class Spy(LossScaleOptimizer):
        def check_finite(self, grads):
            seen_gradient_types.update(type(g).__name__ for g in grads)
            return super().check_finite(grads)

    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 50, size=(128, 4))
    targets = targets_of(tokens)
    model = keras.Sequential(
        [
            keras.Input((4,), dtype="int32"),
            keras.layers.Embedding(50, 8),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )
    optimizer = Spy(
        keras.optimizers.SGD(0.5, momentum=0.5),
        initial_scale=initial_scale,
        dynamic_growth_steps=10**6,
    )
    model.compile(optimizer=optimizer, loss="mse", jit_compile=True)
    history = model.fit(
        tokens,
        targets,
        batch_size=16,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[tf_lars.callbacks.LossScaleMonitor()],
    )
    return history, optimizer, model, seen_gradient_types


def _mean_token_targets(tokens):
    return (tokens.mean(axis=1, keepdims=True) / 50).astype(np.float32)


def _with_huge_target(tokens):
    targets = _mean_token_targets(tokens)
    targets[3] = 3e38
    return targets


def test_mixed_float16_fit_non_finite_sparse_batches_are_skipped(mixed_float16):
    # Every release: the first batch of each epoch has a target near the
    # float32 maximum, so its gradient is inf in float32 already (not only
    # where float16 overflows, which depends on how XLA keeps float16
    # intermediates: TensorFlow 2.16's CPU compiler computes them in float32,
    # so the 2**30 scale of the test below overflows nothing there). Exactly
    # those 3 steps are skipped inside the XLA-compiled train step, with a
    # sparse embedding gradient, and the other 21 train.
    history, optimizer, model, seen_gradient_types = _fit_embedding_model(
        _with_huge_target, initial_scale=2.0**10
    )
    assert "IndexedSlices" in seen_gradient_types
    assert history.history["skipped_steps"] == [1, 2, 3]
    assert int(optimizer.skipped_steps) == 3
    assert history.history["loss_scale"] == [2.0**9, 2.0**8, 2.0**7]
    assert int(optimizer.iterations) == 3 * 8 - 3
    for var in model.trainable_variables:
        assert var.dtype == "float32"
        assert np.all(np.isfinite(var.numpy()))


def test_mixed_float16_fit_embedding_overflow_is_skipped(mixed_float16):
    # A too-large initial scale overflows float16 in the backward pass: the
    # wrapper must skip those steps (inside the XLA-compiled train step),
    # halve the scale, then train. The embedding's gradient is sparse.
    history, optimizer, model, seen_gradient_types = _fit_embedding_model(
        _mean_token_targets, initial_scale=2.0**30
    )
    assert "IndexedSlices" in seen_gradient_types
    skipped = history.history["skipped_steps"]
    assert skipped[0] >= 1 and skipped == sorted(skipped)
    assert int(optimizer.skipped_steps) == skipped[-1]
    # No growth (10**6 steps), so the scale is exactly initial / 2**skipped.
    assert history.history["loss_scale"][-1] == 2.0**30 / 2.0 ** skipped[-1]
    assert int(optimizer.iterations) == 3 * 8 - skipped[-1]
    for var in model.trainable_variables:
        assert var.dtype == "float32"
        assert np.all(np.isfinite(var.numpy()))
    assert history.history["loss"][-1] < history.history["loss"][0]


def _train_to_interesting_state(optimizer, variables):
    """Finite and non-finite steps so that every counter is non-default."""
    grads_ok = [tf.ones_like(v) * 0.1 for v in variables]
    grads_bad = [tf.fill(v.shape, np.nan) for v in variables]
    for grads in [
        grads_ok,
        grads_bad,
        grads_ok,
        grads_ok,
        grads_bad,
        grads_ok,
        grads_ok,
    ]:
        optimizer.apply(grads, variables)


def test_checkpoint_round_trip(tmp_path):
    def make():
        variables = [keras.Variable(np.ones((2, 2), np.float32)), keras.Variable([0.5])]
        optimizer = LossScaleOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.9),
            initial_scale=1024.0,
            dynamic_growth_steps=3,
        )
        optimizer.build(variables)
        return optimizer, variables

    optimizer, variables = make()
    _train_to_interesting_state(optimizer, variables)
    path = tf.train.Checkpoint(optimizer=optimizer).write(str(tmp_path / "ckpt"))
    names = [name for name, _ in tf.train.list_variables(path)]
    assert "optimizer/skipped_step_counter/.ATTRIBUTES/VARIABLE_VALUE" in names
    assert "optimizer/dynamic_scale/.ATTRIBUTES/VARIABLE_VALUE" in names

    fresh, _ = make()
    assert float(fresh.loss_scale) == 1024.0
    tf.train.Checkpoint(optimizer=fresh).read(path).assert_consumed()
    assert float(fresh.loss_scale) == 256.0
    assert int(fresh.skipped_steps) == 2
    assert int(fresh.step_counter.numpy()) == 2
    assert int(fresh.iterations) == 5
    # By position: the two optimizers' auto-generated names differ.
    assert len(fresh.variables) == len(optimizer.variables)
    for saved, restored in zip(optimizer.variables, fresh.variables, strict=True):
        np.testing.assert_array_equal(restored.numpy(), saved.numpy())


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        (dict(initial_scale=0), "initial_scale"),
        (dict(initial_scale=-2.0), "initial_scale"),
        (dict(initial_scale=float("inf")), "initial_scale"),
        (dict(initial_scale=float("nan")), "initial_scale"),
        (dict(initial_scale=1e39), "initial_scale"),  # inf in float32
        (dict(initial_scale=True), "initial_scale"),
        (dict(initial_scale="1024"), "initial_scale"),
        (dict(dynamic_growth_steps=0), "dynamic_growth_steps"),
        (dict(dynamic_growth_steps=-5), "dynamic_growth_steps"),
        (dict(dynamic_growth_steps=2.5), "dynamic_growth_steps"),
        (dict(dynamic_growth_steps=True), "dynamic_growth_steps"),
        (dict(dynamic_growth_steps="10"), "dynamic_growth_steps"),
        (dict(dynamic="yes"), "dynamic"),
        (dict(dynamic=1), "dynamic"),
    ],
)
def test_bad_hyperparameters(kwargs, argument):
    ((name, value),) = kwargs.items()
    with pytest.raises(ValueError) as info:
        LossScaleOptimizer(keras.optimizers.SGD(), **kwargs)
    message = str(info.value)
    assert f"`{argument}`" in message
    assert f"Received: {argument}={value!r}" in message


@pytest.mark.parametrize(
    "inner",
    [
        "sgd",
        None,
        lambda: tf.Variable(1.0),
        lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()),
        lambda: LossScaleOptimizer(keras.optimizers.SGD()),
    ],
)
def test_bad_inner_optimizer(inner):
    inner = inner() if callable(inner) else inner
    with pytest.raises(ValueError) as info:
        LossScaleOptimizer(inner)
    message = str(info.value)
    assert "`inner_optimizer`" in message
    assert f"Received: inner_optimizer={inner!r}" in message


@pytest.mark.parametrize(
    "argument, value",
    [
        ("clipnorm", 1.0),
        ("global_clipnorm", 2.0),
        ("use_ema", True),
        ("weight_decay", 0.1),
    ],
)
def test_base_argument_refusal_keeps_keras_wording(argument, value):
    """A drop-in for Keras's wrapper: code matching Keras's message still does."""
    keras_message = f"set `{argument}` on the `inner_optimizer`"
    try:
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(), **{argument: value})
    except ValueError as keras_error:  # Keras 3.15 refuses; 3.8 to 3.11 ignore it
        assert keras_message in str(keras_error)
    else:  # Only releases before 3.15 accept them.
        major_minor = tuple(int(part) for part in keras.__version__.split(".")[:2])
        assert major_minor < (3, 15), keras.__version__
    with pytest.raises(ValueError) as ours:
        LossScaleOptimizer(keras.optimizers.SGD(), **{argument: value})
    message = str(ours.value)
    assert message.startswith(f"LossScaleOptimizer does not support `{argument}`. ")
    assert keras_message in message
    assert message.endswith(f"Received: {argument}={value!r}")
    # Their defaults are accepted (old configs carry them).
    default = {argument: BASE_ARGUMENT_DEFAULTS[argument]}
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(), **default)
    assert optimizer.dynamic is True


def test_mirrored_strategy_replicas_agree(tmp_path):
    out = tmp_path / "mirrored.json"
    harness.run_mirrored("loss_scale", str(out))
    report = json.loads(out.read_text())
    assert report["num_replicas"] == 2

    # Custom loop: per-replica gradients; replica 1 alone has a NaN (dense) at
    # step 2, replica 0 alone an inf (sparse) at step 3.
    for mode in ["eager", "function"]:
        run = report["custom_loop"][mode]
        reference = NumpyLossScaleSGD(
            [np.array(run["kernel_init"]), np.array(run["embedding_init"])],
            0.1,
            0.9,
            8.0,
            True,
            2,
        )
        for step, record in enumerate(run["steps"]):
            summed = [
                np.zeros_like(reference.values[0]),
                np.zeros_like(reference.values[1]),
            ]
            for c_kernel, c_rows in record["coefficients"]:
                summed[0] = summed[0] + np.array(c_kernel)
                summed[1] = summed[1] + _dense_rows_gradient(np.array(c_rows), 5)
            reference.step(summed)
            for name, index in [("kernel", 0), ("embedding", 1)]:
                replicas = record[name]
                assert len(replicas) == 2
                # Every replica holds the same value, the reference's.
                np.testing.assert_array_equal(replicas[0], replicas[1])
                np.testing.assert_allclose(
                    replicas[0], reference.values[index], rtol=1e-6, atol=1e-6
                )
            assert record["scale"] == [reference.scale] * 2, (mode, step)
            assert record["skipped"] == [reference.skipped] * 2
            assert record["iterations"] == reference.iterations
        assert reference.skipped == 2 and reference.iterations == 3

    fit = report["fit"]
    assert fit["skipped_steps"][0] >= 1
    assert fit["loss"][-1] < fit["loss"][0]
    assert fit["replicas_equal"] is True
    assert fit["all_finite"] is True
    assert (
        fit["loss_scale"][-1] == fit["initial_scale"] / 2.0 ** fit["skipped_steps"][-1]
    )


# Keras's optimizer contract, as for LARS (tests/lars_test.py).


def test_tuple_indices_and_list_gradients_through_the_wrapper():
    variable = keras.Variable(np.ones((5, 4), "float32"))
    # Every variable excluded from adaptation: plain SGD on the dense steps.
    inner = tf_lars.LARS(
        learning_rate=0.1, momentum=0.0, exclude_from_layer_adaptation=[".*"]
    )
    optimizer = tf_lars.LossScaleOptimizer(inner, initial_scale=4.0)
    values = np.full((3, 4), 2.0, "float32")  # 0.5 once unscaled
    optimizer.apply(
        [tf.IndexedSlices(tf.constant(values), (0, 2, 4), (5, 4))], [variable]
    )
    expected = np.ones((5, 4), "float32")
    expected[[0, 2, 4]] -= 0.1 * 0.5
    np.testing.assert_allclose(variable.numpy(), expected, rtol=1e-6)
    for _ in range(3):
        optimizer.apply([[[4.0] * 4] * 5], [variable])
    expected -= 3 * 0.1 * 1.0
    np.testing.assert_allclose(variable.numpy(), expected, rtol=1e-6)
    # Two signatures (the sparse step, then the dense ones), not four.
    assert len(inner._compiled_apply) == 1
    (compiled,) = inner._compiled_apply.values()
    assert compiled.experimental_get_tracing_count() == 2


def test_counters_are_written_through_self_assign():
    from unittest import mock

    variable = keras.Variable(np.ones((3,), "float32"))
    optimizer = tf_lars.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=8.0, dynamic_growth_steps=1
    )
    optimizer.build([variable])
    written = []
    original = type(optimizer).assign, type(optimizer).assign_add

    def assign(self, target, value):
        written.append(target.path)
        return original[0](self, target, value)

    def assign_add(self, target, value):
        written.append(target.path)
        return original[1](self, target, value)

    with (
        mock.patch.object(type(optimizer), "assign", assign),
        mock.patch.object(type(optimizer), "assign_add", assign_add),
    ):
        optimizer.apply([tf.constant([8.0, 8.0, 8.0])], [variable])  # grows
        optimizer.apply([tf.constant([np.inf, 8.0, 8.0])], [variable])  # skips
    names = sorted({path.split("/")[-1] for path in written})
    assert names == ["dynamic_scale", "skipped_step_counter", "step_counter"]
    assert float(optimizer.loss_scale) == 8.0  # 8 -> 16 -> 8
    assert int(optimizer.skipped_steps) == 1


# Unknown config keys and numbers beyond float32, refused for every class
# (this file's tests of them are there): tests/contract_test.py,
# `test_from_config_refuses_an_unknown_key`,
# `test_numbers_beyond_float32_are_refused`,
# `test_an_inner_learning_rate_beyond_float32_is_refused`.


# One loss scale, wherever it sits: a wrapper that holds one (DiLoCo, AGN)
# gives the loss scale's own weights, and a second one around it (which
# `compile` adds under mixed_float16, and would unscale every gradient twice)
# is refused when the first `fit` builds them. TrustRatio refuses to hold
# one; LARS, LAMB and TrustRatio train the same whether Keras's `compile`
# adds the loss scale or tf_lars's wraps them.
_HOLDERS = {
    # An outer SGD(1) without momentum makes theta the worker's weights.
    "DiLoCo": lambda inner: tf_lars.DiLoCo(
        inner, keras.optimizers.SGD(1.0), sync_every=2
    ),
    "AGN": lambda inner: tf_lars.AGN(inner, communication_period=1),
}
# Under mixed_bfloat16 Keras adds no loss scale, so there each one's fit
# with tf_lars's loss scale equals its fit without one.
_ADAPTIVE = {
    "TrustRatio": lambda: tf_lars.TrustRatio(keras.optimizers.SGD(0.1)),
    "TrustRatio_Adam": lambda: tf_lars.TrustRatio(
        keras.optimizers.Adam(0.01), weight_decay=0.1
    ),
    "LARS": lambda: tf_lars.LARS(0.5, momentum=0.9, trust_coefficient=0.02),
    "LAMB": lambda: tf_lars.LAMB(0.01, weight_decay=0.1),
}


def _fit_weights(optimizer, **compile_arguments):
    x, y = _regression_data()
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )
    model.compile(optimizer=optimizer, loss="mse", **compile_arguments)
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    return [w.numpy() for w in model.trainable_variables]


@pytest.fixture(params=["mixed_float16", "mixed_bfloat16"])
def mixed_policy(request):
    keras.mixed_precision.set_global_policy(request.param)
    try:
        yield request.param
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("holder", sorted(_HOLDERS))
def test_a_wrapper_holding_the_loss_scale_gives_its_weights(mixed_policy, holder):
    def scaled_sgd():
        return LossScaleOptimizer(
            keras.optimizers.SGD(0.1), initial_scale=2.0**10, dynamic=False
        )

    alone = _fit_weights(scaled_sgd())
    wrapper = _HOLDERS[holder](scaled_sgd())
    if mixed_policy == "mixed_float16":
        with pytest.raises(ValueError, match="would unscale the gradients twice"):
            _fit_weights(wrapper)
        held = _fit_weights(wrapper, auto_scale_loss=False)
    else:  # Keras adds no loss scale under bfloat16.
        held = _fit_weights(wrapper)
    for expected, actual in zip(alone, held, strict=True):
        np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-7)
    assert not np.allclose(alone[0], _fit_weights(keras.optimizers.SGD(0.0))[0])


@pytest.mark.parametrize("name", sorted(_ADAPTIVE))
def test_one_loss_scale_around_the_adaptive_optimizers(mixed_policy, name):
    if name.startswith("TrustRatio"):
        with pytest.raises(ValueError, match="inner_optimizer"):
            tf_lars.TrustRatio(LossScaleOptimizer(keras.optimizers.SGD(0.1)))
    # Keras's own loss scale (mixed_float16) or none (bfloat16), against
    # tf_lars's at the same initial scale.
    by_compile = _fit_weights(_ADAPTIVE[name]())
    by_tf_lars = _fit_weights(LossScaleOptimizer(_ADAPTIVE[name]()))
    for expected, actual in zip(by_compile, by_tf_lars, strict=True):
        np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-7)
