"""Tests for tf_lars.LAMB: one test per row of the LAMB table in
docs/algorithms.md ("TrustRatio and LAMB"), each against an independent
NumPy transcription of that project's update (tests/lamb_reference.py)."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lars
from tests import harness
from tests import lamb_reference as ref
from tf_lars.backend import tensorflow as tf_backend
from tf_lars.lars import ALL_1D

SHAPES = [(), (5,), (4, 3), (2, 3, 2, 3)]
STEPS = 4
LR = 2.0**-4  # exact in float32: the references use the same rate


def _problem(dtype, seed=0, scale=0.1):
    return harness.random_problem(dtype, SHAPES, STEPS, seed, scale)


def _run(optimizer, weights, grads, dtype, mode="default", paths=None):
    variables = harness.run_steps(optimizer, weights, grads, dtype, mode, paths)
    return [v.numpy() for v in variables]


def _close(actual, expected, dtype):
    tol = {"float32": 3e-5, "float64": 1e-11}[dtype]
    for a, b in zip(actual, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


# ------------------------------------------------------- the mapping table
# "function" (tf.function without XLA) takes LAMB's fused kernel path
# (`tf_lars.backend.tensorflow.adam_direction`); the other modes compile with XLA.
@pytest.mark.parametrize("mode", ["default", "function"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_row_optax_lamb(dtype, mode):
    weights, grads = _problem(dtype)
    optimizer = tf_lars.LAMB(
        learning_rate=LR, beta_1=0.8, beta_2=0.95, epsilon=1e-3, weight_decay=0.1
    )
    actual = _run(optimizer, weights, grads, dtype, mode=mode)
    expected = ref.optax_lamb(weights, grads, LR, 0.8, 0.95, 1e-3, weight_decay=0.1)
    _close(actual, expected, dtype)


@pytest.mark.parametrize("mode", ["default", "function"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_row_paper_algorithm_2(dtype, mode):
    weights, grads = _problem(dtype, seed=1)
    optimizer = tf_lars.LAMB(learning_rate=LR, epsilon=1e-6, weight_decay=0.01)
    actual = _run(optimizer, weights, grads, dtype, mode=mode)
    expected = ref.paper_lamb(weights, grads, LR, eps=1e-6, weight_decay=0.01)
    _close(actual, expected, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_row_keras_lamb_at_weight_decay_zero(dtype):
    weights, grads = _problem(dtype, seed=2)
    ours = _run(tf_lars.LAMB(learning_rate=LR, epsilon=1e-7), weights, grads, dtype)
    theirs = _run(keras.optimizers.Lamb(learning_rate=LR), weights, grads, dtype)
    _close(theirs, ref.keras_lamb(weights, grads, LR, eps=1e-7), dtype)
    # Keras rounds its betas to float32 in the bias corrections only, so in
    # float64 the two agree to float32's precision; in float32 they are equal.
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(a, b, rtol=3e-5, atol=3e-6)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_row_timm_lamb_with_no_decay_group(dtype):
    weights, grads = _problem(dtype, seed=3, scale=1.0)  # global norm > 1
    optimizer = tf_lars.LAMB(
        learning_rate=LR,
        weight_decay=0.05,
        exclude_from_weight_decay=[ALL_1D],
        global_clipnorm=1.0,
    )
    actual = _run(optimizer, weights, grads, dtype)
    no_decay = [len(s) <= 1 for s in SHAPES]
    expected = ref.timm_lamb(
        weights, grads, LR, weight_decay=0.05, no_decay=no_decay, max_grad_norm=1.0
    )
    _close(actual, expected, dtype)
    np.testing.assert_array_equal(optimizer.trust_ratios.numpy()[:2], [1.0, 1.0])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_row_timm_lamb_trust_clip_always_adapt(dtype):
    weights, grads = _problem(dtype, seed=4, scale=1.0)
    weights = [w * 0.05 for w in weights]  # small weights: ratios below 1 clip
    optimizer = tf_lars.LAMB(
        learning_rate=LR,
        weight_decay=0.05,
        exclude_from_weight_decay=[ALL_1D],
        exclude_from_layer_adaptation=[],
        trust_clip=True,
        global_clipnorm=1.0,
    )
    actual = _run(optimizer, weights, grads, dtype)
    expected = ref.timm_lamb(
        weights,
        grads,
        LR,
        weight_decay=0.05,
        no_decay=[len(s) <= 1 for s in SHAPES],
        trust_clip=True,
        always_adapt=True,
    )
    _close(actual, expected, dtype)
    assert np.all(optimizer.trust_ratios.numpy() <= 1.0)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_row_tensorflow_addons_and_model_garden_lamb(dtype):
    weights, grads = _problem(dtype, seed=5)
    paths = ["scale", "bias", "dense_kernel", "conv_kernel"]
    optimizer = tf_lars.LAMB(
        learning_rate=LR,
        weight_decay=0.02,
        exclude_from_weight_decay=["bias", "conv"],
        exclude_from_layer_adaptation=["bias"],
    )
    actual = _run(optimizer, weights, grads, dtype, paths=paths)
    expected = ref.tfa_lamb(
        weights,
        grads,
        LR,
        weight_decay_rate=0.02,
        do_decay=[True, False, True, False],
        do_adapt=[True, False, True, True],
    )
    _close(actual, expected, dtype)


# ----------------------------------------------------------------- behaviour
def test_fused_path_shares_one_unsaved_buffer_per_shape(tmp_path):
    # Without XLA and outside tf.distribute, Adam's moments and direction
    # come from one fused kernel through a scratch buffer per shape: two
    # variables of one shape share it, the embedding-like sparse variable
    # gets none, and the buffers are not optimizer state.
    rng = np.random.default_rng(9)
    shapes = [(4, 3), (4, 3), (5,), (6, 2)]
    weights = [rng.normal(size=s).astype("float32") for s in shapes]
    grads = [
        [rng.normal(scale=0.1, size=s).astype("float32") for s in shapes[:3]]
        for _ in range(STEPS)
    ]
    config = {"learning_rate": LR, "weight_decay": 0.05}
    results = {}
    for mode in ("function", "xla"):
        optimizer = tf_lars.LAMB(**config)
        variables = [keras.Variable(w) for w in weights]
        optimizer.build(variables)

        def make_step(optimizer, variables, jit_compile):
            def apply(dense, rows):
                sparse = tf.IndexedSlices(rows, tf.constant([0, 2, 2]), (6, 2))
                optimizer.apply([*dense, sparse], variables)

            return tf.function(apply, jit_compile=jit_compile)

        step = make_step(optimizer, variables, mode == "xla")
        for k, step_grads in enumerate(grads):
            step([tf.constant(g) for g in step_grads], tf.fill((3, 2), 0.1 * k))
        results[mode] = ([v.numpy() for v in variables], optimizer)
    fused = results["function"][1]
    assert len(tf_backend.direction_buffers(fused)) == 2  # (4, 3) and (5,)
    assert len(tf_backend.direction_buffers(results["xla"][1])) == 0
    # The same optimizer state (names aside: the two are lamb and lamb_1).
    assert [v.shape for v in fused.variables] == [
        v.shape for v in results["xla"][1].variables
    ]
    assert not any("lamb_direction" in v.name for v in fused.variables)
    checkpoint = tf.train.Checkpoint(optimizer=fused)
    saved = {
        name
        for name, _ in tf.train.list_variables(
            checkpoint.write(os.path.join(str(tmp_path), "fused"))
        )
    }
    assert not any("direction" in name for name in saved)
    for a, b in zip(results["function"][0], results["xla"][0], strict=True):
        np.testing.assert_allclose(a, b, rtol=3e-6, atol=3e-7)


def test_per_step_scalars_are_shared_within_a_step_only():
    # Under XLA, Adam's bias corrections are computed once per step and
    # shared by every variable (`TrustRatio._once_per_step`): the memo is
    # gone after the step, and each step (a schedule, a growing step count)
    # gets its own values, equal to the op-by-op ones.
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.5)
    rng = np.random.default_rng(3)
    starts = [rng.normal(size=s).astype("float32") for s in [(3,), (2, 2), (3,)]]
    grads = [tf.constant(rng.normal(size=w.shape).astype("float32")) for w in starts]
    results = []
    for jit in (True, False):
        optimizer = tf_lars.LAMB(learning_rate=schedule, weight_decay=0.01)
        optimizer.jit_compile = jit
        weights = [keras.Variable(w) for w in starts]
        for _ in range(3):
            optimizer.apply(grads, weights)
            assert "_step_scalars" not in optimizer.__dict__
        results.append([w.numpy() for w in weights])
    for compiled, plain in zip(*results, strict=True):
        np.testing.assert_allclose(compiled, plain, rtol=1e-6, atol=1e-7)


def test_zero_weights_and_zero_gradients_give_ratio_one():
    optimizer = tf_lars.LAMB(learning_rate=0.1, weight_decay=0.1)
    zero_w = keras.Variable(np.zeros((3,), "float32"))
    zero_g = keras.Variable(np.ones((2, 2), "float32"))
    optimizer.apply([tf.ones((3,)), tf.zeros((2, 2))], [zero_w, zero_g])
    ratios = optimizer.trust_ratios.numpy()
    np.testing.assert_array_equal(ratios[0], 1.0)
    # |u| = wd |w| > 0 for the zero gradient: a ratio of |w| / (0.1 |w|) = 10.
    np.testing.assert_allclose(ratios[1], 10.0, rtol=1e-6)
    assert np.all(np.isfinite(zero_w.numpy())) and np.all(zero_w.numpy() < 0)
    np.testing.assert_allclose(zero_g.numpy(), 1.0 - 0.1 * 10 * 0.1, rtol=1e-6)


# Sparse rows with duplicate indices take Adam without ratio or decay, the
# ratio recorded as 1: tests/contract_test.py,
# `test_sparse_gradient_rows_follow_the_numpy_reference[eager|default-lamb]`
# (float64 to 1e-10 of each value, the table's row `lamb`).


# LAMB inside tf_lars's loss scale fits as LAMB without one: tests/loss_scale_test.py,
# `test_one_loss_scale_around_the_adaptive_optimizers[mixed_bfloat16-LAMB]`.


def test_agn_with_period_one_follows_plain_lamb():
    weights, grads = _problem("float64", seed=9)
    plain = _run(tf_lars.LAMB(LR, weight_decay=0.1), weights, grads, "float64")
    agn = tf_lars.AGN(tf_lars.LAMB(LR, weight_decay=0.1), communication_period=1)
    _close(_run(agn, weights, grads, "float64"), plain, "float64")


def _model():
    keras.utils.set_random_seed(1)
    return keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(2),
        ]
    )


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype("float32")
    return x, np.stack([x.sum(1), x[:, 0] - x[:, 2]], axis=1).astype("float32")


def _lamb():
    return tf_lars.LAMB(
        learning_rate=0.01, weight_decay=0.01, exclude_from_weight_decay=[ALL_1D]
    )


def test_fit_with_and_without_xla_agree_and_monitor_reads_ratios():
    results = []
    for jit in (False, True):
        model = _model()
        model.compile(optimizer=_lamb(), loss="mse", jit_compile=jit)
        monitor = tf_lars.callbacks.TrustRatioMonitor()
        x, y = _data()
        history = model.fit(
            x, y, epochs=3, batch_size=16, verbose=0, shuffle=False, callbacks=[monitor]
        )
        results.append((history.history, [w.numpy() for w in model.weights]))
        assert monitor.trust_ratios.shape == (3, 4)
        assert monitor.paths == model.optimizer.trust_ratio_paths
        # Biases are excluded (ratio 1), kernels adapted.
        np.testing.assert_array_equal(monitor.trust_ratios[:, [1, 3]], 1.0)
        assert np.all(monitor.trust_ratios[:, [0, 2]] != 1.0)
    (first, w_first), (second, w_second) = results
    np.testing.assert_allclose(first["loss"], second["loss"], rtol=1e-5)
    assert first["loss"][-1] < first["loss"][0]
    for a, b in zip(w_first, w_second, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# A tf.train.Checkpoint of the model and the optimizer restores and continues
# bit-identically: tests/contract_test.py,
# `test_checkpoint_restores_and_continues_bit_identically[lamb]`.


def test_saved_model_serves(tmp_path):
    model = _model()
    model.compile(optimizer=_lamb(), loss="mse")
    x, y = _data()
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    expected = model(x).numpy()
    model.export(str(tmp_path / "export"))
    served = tf.saved_model.load(str(tmp_path / "export"))
    np.testing.assert_allclose(
        served.serve(tf.constant(x)).numpy(), expected, rtol=1e-5, atol=1e-6
    )


def test_learning_rate_schedule_round_trips():
    schedule = tf_lars.WarmupPolynomialDecay(0.01, warmup_steps=2, decay_steps=4)
    optimizer = tf_lars.LAMB(learning_rate=schedule)
    config = optimizer.get_config()
    again = tf_lars.LAMB.from_config(config)
    assert isinstance(
        again.inner_optimizer._learning_rate, tf_lars.WarmupPolynomialDecay
    )
    assert again.get_config() == config
    variable = keras.Variable(np.ones((2, 2), "float32"))
    optimizer.apply([tf.ones((2, 2))], [variable])  # lr 0 at step 0
    np.testing.assert_array_equal(variable.numpy(), 1.0)
    optimizer.apply([tf.ones((2, 2))], [variable])
    assert np.all(variable.numpy() < 1.0)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"learning_rate": -1.0}, "learning_rate=-1.0"),
        ({"learning_rate": "fast"}, "learning_rate='fast'"),
        ({"beta_1": 1.0}, "beta_1=1.0"),
        ({"beta_2": -0.1}, "beta_2=-0.1"),
        ({"epsilon": -1e-6}, "epsilon=-1e-06"),
        ({"weight_decay": float("nan")}, "weight_decay=nan"),
        ({"trust_coefficient": 0.0}, "trust_coefficient=0.0"),
        ({"trust_clip": "yes"}, "trust_clip='yes'"),
        ({"exclude_from_weight_decay": ["("]}, "exclude_from_weight_decay=['(']"),
        ({"exclude_from_layer_adaptation": 3}, "exclude_from_layer_adaptation=3"),
        ({"inner_optimizer": "sgd"}, "`inner_optimizer` is not an argument of LAMB"),
        ({"gradient_accumulation_steps": 2.5}, "gradient_accumulation_steps=2.5"),
        ({"clipnorm": -1.0}, "clipnorm=-1.0"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(kwargs, fragment):
    with pytest.raises(ValueError) as error:
        tf_lars.LAMB(**kwargs)
    assert fragment in str(error.value), str(error.value)


# Unknown config keys and numbers beyond float32, refused for every class
# (this file's tests of them are there): tests/contract_test.py,
# `test_from_config_refuses_an_unknown_key`,
# `test_numbers_beyond_float32_are_refused`,
# `test_an_inner_learning_rate_beyond_float32_is_refused`.


# LAMB and TrustRatio under MirroredStrategy: tests/lars_test.py's
# test_mirrored_strategy_uses_all_reduced_gradient runs them with LARS.


# Machine epsilon of the 16-bit floats: 2**-7 (bfloat16), 2**-10 (float16).
HALF_EPS = {"bfloat16": 2.0**-7, "float16": 2.0**-10}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("which", ["lamb", "trust_ratio_adam"])
def test_half_precision_weights_follow_the_float32_reference(which, dtype):
    # LAMB in bfloat16 used to give NaN from the first step: 1 - b2**t
    # rounds to 0 in bfloat16. Tolerance: 4 epsilons of `dtype` times the
    # largest weight after three steps (each weight is rounded every step).
    rng = np.random.default_rng(5)
    weights = [rng.normal(size=(3, 4)), rng.normal(size=(4,))]
    weights = [w.astype(dtype).astype("float64") for w in weights]  # exact
    grads = [
        [rng.normal(size=w.shape).astype(dtype).astype("float64") for w in weights]
        for _ in range(3)
    ]
    if which == "lamb":
        optimizer = tf_lars.LAMB(learning_rate=0.01, weight_decay=0.0)
        want = ref.optax_lamb(weights, grads, 0.01)
    else:
        optimizer = tf_lars.TrustRatio(keras.optimizers.Adam(learning_rate=0.01))
        want, _ = ref.wrapped_run(weights, grads, 0.01, ref.keras_adam_direction())
    variables = [keras.Variable(w, dtype=dtype) for w in weights]
    for step_grads in grads:
        optimizer.apply([tf.constant(g, dtype) for g in step_grads], variables)
    for variable, expected in zip(variables, want, strict=True):
        got = np.asarray(variable.numpy(), "float64")
        assert np.all(np.isfinite(got))
        tolerance = 4 * HALF_EPS[dtype] * np.max(np.abs(expected))
        np.testing.assert_allclose(got, expected, rtol=0, atol=tolerance)


def test_lamb_fits_a_bfloat16_dense_layer():
    rng = np.random.default_rng(6)
    x = rng.normal(size=(32, 5)).astype("float32")
    y = rng.normal(size=(32, 2)).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(2, dtype="bfloat16")]
    )
    model.compile(optimizer=tf_lars.LAMB(learning_rate=0.01), loss="mse")
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert all(np.isfinite(history.history["loss"]))
    for weight in model.weights:
        assert np.all(np.isfinite(np.asarray(weight.numpy(), "float32")))
    assert history.history["loss"][1] < history.history["loss"][0]
