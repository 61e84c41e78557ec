"""Tests for tf_lars.LARS against NumPy references and the seeds' numbers."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lars
from tests import harness
from tests import lars_reference as ref
from tf_lars.lars import ALL_1D

SHAPES = [(), (5,), (4, 3), (2, 3, 2, 3)]
STEPS = 4

# The rows of the mapping table in docs/algorithms.md ("LARS") and the
# momentum variants that the contract table (tests/optimizer_table.py,
# `LARS_VARIANTS`) does not hold. Its rows `lars_paper`, `lars_nesterov`,
# `lars_contrib`, `lars_contrib_nesterov` and `lars_clip` (this file's
# "paper", "paper_nesterov", "contrib", "contrib_nesterov" and "larc_clip")
# follow the same reference there, weights, momentum slots and trust ratios,
# in float32 in every mode and float64 eager and compiled
# (tests/contract_test.py, `test_apply_follows_the_numpy_reference`).
CONFIGS = {
    "model_garden": {"trust_ratio": "decayed", "epsilon": 0.0},
    "optax": {"trust_ratio": "decayed", "epsilon": 1e-6, "nesterov": True},
    "no_momentum": {"momentum": 0.0},
    "contrib_in_gradient": {"classic_momentum": False},
}

BASE = {
    "momentum": 0.9,
    "weight_decay": 0.01,
    "trust_coefficient": 0.02,
    "epsilon": 1e-5,
}


def _problem(dtype, seed=0):
    return harness.random_problem(dtype, SHAPES, STEPS, seed)


def _run_numpy(weights, grads, lr, config, decayed=None, adapted=None):
    w = [np.array(x, np.float64) for x in weights]
    v = [np.zeros_like(x) for x in w]
    ratios = []
    for step_grads in grads:
        step_ratios = []
        for i, g in enumerate(step_grads):
            w[i], v[i], t = ref.dense_step(
                w[i],
                g,
                v[i],
                lr,
                decayed=True if decayed is None else decayed[i],
                adapted=True if adapted is None else adapted[i],
                **config,
            )
            step_ratios.append(t)
        ratios.append(step_ratios)
    return w, v, ratios


def _tolerance(dtype):
    return {"float32": 2e-5, "float64": 1e-10}[dtype]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_numpy_reference(name, dtype):
    config = dict(BASE, **CONFIGS[name])
    weights, grads = _problem(dtype)
    lr = 0.5
    optimizer = tf_lars.LARS(learning_rate=lr, **config)
    variables = harness.run_steps(
        optimizer, weights, grads, dtype, harness.FLAG_MATRIX_MODE[dtype]
    )
    expected_w, expected_v, ratios = _run_numpy(weights, grads, lr, config)
    tol = _tolerance(dtype)
    for variable, want in zip(variables, expected_w, strict=True):
        np.testing.assert_allclose(variable.numpy(), want, rtol=tol, atol=tol)
    if config["momentum"]:
        for slot, want in zip(optimizer.momentums, expected_v, strict=True):
            np.testing.assert_allclose(slot.numpy(), want, rtol=tol, atol=tol)
    np.testing.assert_allclose(
        optimizer.trust_ratios.numpy(), ratios[-1], rtol=1e-5, atol=0
    )
    assert optimizer.iterations.numpy() == STEPS


def _contrib_seed_case(steps, dtype):
    """The TF contrib `LARSOptimizer` test, computed as that test does."""
    var_np = np.ones([3, 3])
    grad_np = np.ones([3, 3])
    vel_np = np.zeros([3, 3])
    lr_np, m_np, wd_np, ep_np, eeta = 0.1, 0.9, 0.1, 1e-5, 0.1
    for _ in range(steps):
        w_norm = np.linalg.norm(var_np.flatten(), ord=2)
        g_norm = np.linalg.norm(grad_np.flatten(), ord=2)
        trust_ratio = eeta * w_norm / (g_norm + wd_np * w_norm + ep_np)
        scaled_lr = lr_np * trust_ratio
        vel_np = m_np * vel_np + grad_np
        var_np = var_np - scaled_lr * vel_np
    optimizer = tf_lars.LARS(
        learning_rate=lr_np,
        momentum=m_np,
        weight_decay=wd_np,
        epsilon=ep_np,
        trust_coefficient=eeta,
        classic_momentum=False,
        decay_in_gradient=False,
    )
    var = keras.Variable(np.ones([3, 3]), dtype=dtype)
    for _ in range(steps):
        optimizer.apply([tf.ones([3, 3], dtype)], [var])
    return var.numpy(), optimizer.momentums[0].numpy(), var_np, vel_np


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("steps", [1, 10])
def test_tf_contrib_seed_case(steps, dtype):
    var, vel, want_var, want_vel = _contrib_seed_case(steps, dtype)
    np.testing.assert_allclose(var, want_var, rtol=1e-6)
    np.testing.assert_allclose(vel, want_vel, rtol=1e-6)
    if steps == 1:
        # 1 - 0.1 * 0.1 * 3 / (3 + 0.3 + 1e-5) = 0.990909...
        np.testing.assert_allclose(var, np.full([3, 3], 0.9909091184), rtol=1e-7)


def _model_garden_step(param, grad, v, lr, momentum, wd, eeta, nesterov):
    """TF Model Garden `LARS` (classic), as its docstring describes it."""
    grad = grad + wd * param
    w_norm = np.linalg.norm(param)
    g_norm = np.linalg.norm(grad)
    trust = eeta * w_norm / g_norm if (w_norm > 0 and g_norm > 0) else 1.0
    scaled_lr = lr * trust
    next_v = momentum * v + scaled_lr * grad
    update = momentum * next_v + scaled_lr * grad if nesterov else next_v
    return param - update, next_v


def _optax_step(param, grad, trace, lr, momentum, wd, eeta, eps, nesterov):
    """optax `lars`: add_decayed_weights -> scale_by_trust_ratio -> lr -> trace."""
    update = grad + wd * param
    p_norm = np.linalg.norm(param)
    u_norm = np.linalg.norm(update)
    ratio = eeta * p_norm / (u_norm + eps)
    ratio = 1.0 if (p_norm == 0 or u_norm == 0) else ratio
    update = -lr * (update * ratio)
    new_trace = update + momentum * trace
    update = update + momentum * new_trace if nesterov else new_trace
    return param + update, new_trace


def _timm_clip_step(param, grad, buf, lr, momentum, wd, eeta, eps):
    """timm `Lars(trust_clip=True)` / apex `LARC(clip=True)` then SGD."""
    w_norm = np.linalg.norm(param)
    g_norm = np.linalg.norm(grad)
    ratio = eeta * w_norm / (g_norm + w_norm * wd + eps)
    ratio = ratio if (w_norm > 0 and g_norm > 0) else 1.0
    ratio = min(ratio / lr, 1.0)
    grad = (grad + wd * param) * ratio
    buf = momentum * buf + grad
    return param - lr * buf, buf


@pytest.mark.parametrize("nesterov", [False, True])
def test_anchor_model_garden_and_optax(nesterov):
    weights, grads = _problem("float64", seed=7)
    # Learning rates exactly representable in float32 (Keras keeps lr in floatx).
    lr, mu, wd, eeta = 0.375, 0.9, 0.005, 0.01
    for anchor in ("model_garden", "optax"):
        eps = 0.0 if anchor == "model_garden" else 1e-7
        optimizer = tf_lars.LARS(
            learning_rate=lr,
            momentum=mu,
            weight_decay=wd,
            trust_coefficient=eeta,
            epsilon=eps,
            nesterov=nesterov,
            trust_ratio="decayed",
        )
        variables = harness.run_steps(optimizer, weights, grads, "float64")
        for i, variable in enumerate(variables):
            w, v = np.array(weights[i], np.float64), np.zeros(SHAPES[i])
            for step in range(STEPS):
                if anchor == "model_garden":
                    w, v = _model_garden_step(
                        w, grads[step][i], v, lr, mu, wd, eeta, nesterov
                    )
                else:
                    w, v = _optax_step(
                        w, grads[step][i], v, lr, mu, wd, eeta, eps, nesterov
                    )
            np.testing.assert_allclose(variable.numpy(), w, rtol=1e-10, err_msg=anchor)


def test_anchor_timm_and_larc_clip():
    weights, grads = _problem("float64", seed=11)
    lr, mu, wd, eeta, eps = 0.0625, 0.9, 0.01, 0.02, 1e-8
    optimizer = tf_lars.LARS(
        learning_rate=lr,
        momentum=mu,
        weight_decay=wd,
        trust_coefficient=eeta,
        epsilon=eps,
        trust_clip=True,
    )
    variables = harness.run_steps(optimizer, weights, grads, "float64")
    clipped_somewhere = False
    for i, variable in enumerate(variables):
        w, buf = np.array(weights[i], np.float64), np.zeros(SHAPES[i])
        for step in range(STEPS):
            w, buf = _timm_clip_step(w, grads[step][i], buf, lr, mu, wd, eeta, eps)
        np.testing.assert_allclose(variable.numpy(), w, rtol=1e-10)
    ratios = optimizer.trust_ratios.numpy()
    clipped_somewhere = bool(np.any(ratios > lr)) and bool(np.any(ratios < lr))
    assert clipped_somewhere, ratios  # both branches of the clip are exercised


def test_zero_norms_give_no_nan_and_zero_bias_moves():
    optimizer = tf_lars.LARS(learning_rate=0.1, momentum=0.0, weight_decay=0.1)
    bias = keras.Variable(np.zeros(3), dtype="float32")
    kernel = keras.Variable(np.ones((2, 2)), dtype="float32")
    optimizer.apply([tf.constant([1.0, 2.0, 3.0]), tf.zeros((2, 2))], [bias, kernel])
    # ||w|| = 0 -> T = 1: the bias takes a plain SGD step.
    np.testing.assert_allclose(bias.numpy(), [-0.1, -0.2, -0.3], rtol=1e-6)
    # ||g|| = 0 -> T = 1, and g' = 0.1 * w is applied.
    np.testing.assert_allclose(kernel.numpy(), np.full((2, 2), 0.99), rtol=1e-6)
    np.testing.assert_array_equal(optimizer.trust_ratios.numpy(), [1.0, 1.0])
    # Both norms zero, decayed variant: still finite.
    optimizer = tf_lars.LARS(trust_ratio="decayed", weight_decay=0.0)
    zero = keras.Variable(np.zeros(4), dtype="float32")
    optimizer.apply([tf.zeros(4)], [zero])
    assert np.all(np.isfinite(zero.numpy())) and np.all(zero.numpy() == 0)


def _two_layer_model():
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, name="hidden"),
            keras.layers.Dense(2, name="head"),
        ],
        name="net",
    )
    return model


def test_exclusions_match_variable_path():
    model = _two_layer_model()
    paths = [v.path for v in model.trainable_variables]
    assert paths == [
        "net/hidden/kernel",
        "net/hidden/bias",
        "net/head/kernel",
        "net/head/bias",
    ]
    optimizer = tf_lars.LARS(
        learning_rate=0.5,
        weight_decay=0.01,
        trust_coefficient=0.02,
        exclude_from_weight_decay=["bias", r"^net/head/"],
        exclude_from_layer_adaptation=["hidden/bias"],
    )
    rng = np.random.default_rng(0)
    grads = [
        rng.normal(size=v.shape).astype("float32") for v in model.trainable_variables
    ]
    before = [v.numpy() for v in model.trainable_variables]
    optimizer.apply([tf.constant(g) for g in grads], model.trainable_variables)
    decayed = [True, False, False, False]
    adapted = [True, False, True, True]
    want, _, ratios = _run_numpy(
        before,
        [grads],
        0.5,
        {"momentum": 0.9, "weight_decay": 0.01, "trust_coefficient": 0.02},
        decayed=decayed,
        adapted=adapted,
    )
    for variable, expected in zip(model.trainable_variables, want, strict=True):
        np.testing.assert_allclose(variable.numpy(), expected, rtol=1e-5, atol=1e-7)
    assert optimizer.trust_ratio_paths == paths
    assert optimizer.trust_ratios.numpy()[1] == 1.0
    np.testing.assert_allclose(optimizer.trust_ratios.numpy(), ratios[0], rtol=1e-5)


def test_all_1d_and_layer_adaptation_default_follows_weight_decay():
    model = _two_layer_model()
    optimizer = tf_lars.LARS(weight_decay=0.1, exclude_from_weight_decay=[ALL_1D])
    optimizer.build(model.trainable_variables)
    assert optimizer._variable_weight_decay == [0.1, 0.0, 0.1, 0.0]
    assert optimizer._variable_adapted == [True, False, True, False]
    # An explicit empty list adapts everything.
    optimizer = tf_lars.LARS(
        weight_decay=0.1,
        exclude_from_weight_decay=ALL_1D,
        exclude_from_layer_adaptation=[],
    )
    optimizer.build(model.trainable_variables)
    assert optimizer._variable_adapted == [True, True, True, True]
    assert optimizer.get_config()["exclude_from_weight_decay"] == [ALL_1D]
    assert optimizer.get_config()["exclude_from_layer_adaptation"] == []


def test_base_exclude_from_weight_decay_method_is_honoured():
    model = _two_layer_model()
    optimizer = tf_lars.LARS(weight_decay=0.1)
    optimizer.exclude_from_weight_decay(var_names=["kernel"])
    optimizer.build(model.trainable_variables)
    assert optimizer._variable_weight_decay == [0.0, 0.1, 0.0, 0.1]
    # The base class's decoupled decay never runs on top of LARS's.
    assert optimizer._apply_weight_decay(model.trainable_variables) is None


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"nesterov": True},
        {"classic_momentum": False},
        {"classic_momentum": False, "nesterov": True},
        {"momentum": 0.0},
    ],
)
@pytest.mark.parametrize("compiled", [False, True])
def test_sparse_rows_with_duplicate_indices(config, compiled):
    rng = np.random.default_rng(5)
    table = rng.normal(size=(10, 3)).astype("float32")
    variable = keras.Variable(table)
    optimizer = tf_lars.LARS(learning_rate=0.2, weight_decay=0.5, **config)
    optimizer.jit_compile = compiled
    steps = [
        ([1, 4, 1, 7], rng.normal(size=(4, 3))),
        ([4, 2, 2], rng.normal(size=(3, 3))),
    ]
    w = table.astype(np.float64)
    v = np.zeros_like(w)
    full = dict({"momentum": 0.9}, **config)
    for indices, values in steps:
        grad = tf.IndexedSlices(
            tf.constant(values, tf.float32), tf.constant(indices), tf.constant([10, 3])
        )
        optimizer.apply([grad], [variable])
        w, v = ref.sparse_step(w, v, indices, values, 0.2, **full)
    np.testing.assert_allclose(variable.numpy(), w, rtol=1e-5, atol=1e-6)
    untouched = [0, 3, 5, 6, 8, 9]
    np.testing.assert_array_equal(variable.numpy()[untouched], table[untouched])
    if full["momentum"]:
        np.testing.assert_allclose(
            optimizer.momentums[0].numpy(), v, rtol=1e-5, atol=1e-6
        )
        assert np.all(optimizer.momentums[0].numpy()[untouched] == 0)


def test_embedding_model_trains_with_sparse_gradients():
    model = keras.Sequential(
        [
            keras.Input((4,), dtype="int32"),
            keras.layers.Embedding(50, 8),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1),
        ]
    )
    optimizer = tf_lars.LARS(learning_rate=0.5, trust_coefficient=0.02)
    model.compile(optimizer=optimizer, loss="mse")
    x = np.random.randint(0, 25, size=(64, 4))
    y = (x.mean(axis=1, keepdims=True) / 25.0).astype("float32")
    table_before = model.layers[0].embeddings.numpy()
    history = model.fit(x, y, epochs=8, batch_size=16, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    # Rows 25..49 were never looked up: neither they nor their momentum moved.
    np.testing.assert_array_equal(
        model.layers[0].embeddings.numpy()[25:], table_before[25:]
    )
    assert np.all(optimizer.momentums[0].numpy()[25:] == 0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_variables_use_float32_norms(dtype):
    # float16 weights whose squared norm overflows float16 (1e3^2 * 100 > 65504):
    # a float16 norm would be inf and T would be 0.
    weights = np.full((10, 10), 1000.0)
    grads = np.full((10, 10), 1.0)
    optimizer = tf_lars.LARS(learning_rate=1.0, momentum=0.0, trust_coefficient=0.01)
    variable = keras.Variable(weights, dtype=dtype)
    optimizer.apply([tf.constant(grads, dtype=dtype)], [variable])
    want, _, ratio = ref.dense_step(
        weights,
        grads,
        np.zeros_like(weights),
        1.0,
        momentum=0.0,
        trust_coefficient=0.01,
    )
    assert math.isclose(ratio, 10.0)
    np.testing.assert_allclose(optimizer.trust_ratios.numpy(), [10.0], rtol=1e-6)
    # Tolerance: one rounding of values near 990 (bfloat16 spacing 4, float16 0.5).
    np.testing.assert_allclose(want, np.full((10, 10), 990.0))
    np.testing.assert_allclose(
        variable.numpy().astype(np.float64), want, rtol=0, atol=4.0
    )


def test_learning_rate_schedule():
    # Values exact in float32: the schedule computes in floatx.
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([2], [0.5, 0.0625])
    config = dict(BASE)
    weights, grads = _problem("float64", seed=2)
    optimizer = tf_lars.LARS(learning_rate=schedule, **config)
    variables = [keras.Variable(w, dtype="float64") for w in weights]
    w = [np.array(x) for x in weights]
    v = [np.zeros_like(x) for x in w]
    for step, step_grads in enumerate(grads):
        optimizer.apply([tf.constant(g) for g in step_grads], variables)
        lr = 0.5 if step <= 2 else 0.0625
        for i, g in enumerate(step_grads):
            w[i], v[i], _ = ref.dense_step(w[i], g, v[i], lr, **config)
    for variable, want in zip(variables, w, strict=True):
        np.testing.assert_allclose(variable.numpy(), want, rtol=1e-10)
    restored = tf_lars.LARS.from_config(optimizer.get_config())
    assert isinstance(
        restored._learning_rate, keras.optimizers.schedules.PiecewiseConstantDecay
    )


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"learning_rate": -0.1}, "learning_rate=-0.1"),
        ({"learning_rate": float("nan")}, "learning_rate=nan"),
        ({"learning_rate": float("inf")}, "learning_rate=inf"),
        ({"learning_rate": "fast"}, "learning_rate='fast'"),
        ({"learning_rate": True}, "learning_rate=True"),
        ({"momentum": 1.0}, "momentum=1.0"),
        ({"momentum": 1.5}, "momentum=1.5"),
        ({"momentum": -0.1}, "momentum=-0.1"),
        ({"weight_decay": -1e-4}, "weight_decay=-0.0001"),
        ({"weight_decay": float("nan")}, "weight_decay=nan"),
        ({"trust_coefficient": 0.0}, "trust_coefficient=0.0"),
        ({"trust_coefficient": -1}, "trust_coefficient=-1"),
        ({"epsilon": -1e-9}, "epsilon=-1e-09"),
        ({"trust_ratio": "lamb"}, "trust_ratio='lamb'"),
        ({"nesterov": "yes"}, "nesterov='yes'"),
        ({"classic_momentum": 1}, "classic_momentum=1"),
        ({"exclude_from_weight_decay": ["("]}, "exclude_from_weight_decay"),
        ({"exclude_from_layer_adaptation": 3}, "exclude_from_layer_adaptation=3"),
        # Keras's base arguments, which its base class takes unchecked: it
        # fails at the first step, or (a negative clipnorm) clips nothing.
        ({"gradient_accumulation_steps": 2.5}, "gradient_accumulation_steps=2.5"),
        ({"gradient_accumulation_steps": "4"}, "gradient_accumulation_steps='4'"),
        ({"clipnorm": -1.0}, "clipnorm=-1.0"),
        ({"clipvalue": "x"}, "clipvalue='x'"),
        ({"global_clipnorm": float("nan")}, "global_clipnorm=nan"),
        ({"loss_scale_factor": 0}, "loss_scale_factor=0"),
        ({"use_ema": "yes"}, "use_ema='yes'"),
        ({"ema_momentum": 1.5}, "ema_momentum=1.5"),
        ({"ema_overwrite_frequency": 0}, "ema_overwrite_frequency=0"),
    ],
)
def test_bad_hyperparameters_raise_naming_the_argument(kwargs, fragment):
    with pytest.raises(ValueError) as error:
        tf_lars.LARS(**kwargs)
    name = next(iter(kwargs))
    assert f"`{name}`" in str(error.value)
    assert fragment in str(error.value)


def test_integers_are_accepted_where_floats_are():
    optimizer = tf_lars.LARS(learning_rate=1, momentum=0, weight_decay=0, epsilon=0)
    assert optimizer.get_config()["learning_rate"] == 1.0
    assert optimizer.momentum == 0.0


# --------------------------------------------------------------- serialization
# Unknown config keys and numbers beyond float32, refused for every class
# (this file's tests of them are there): tests/contract_test.py,
# `test_from_config_refuses_an_unknown_key`,
# `test_numbers_beyond_float32_are_refused`,
# `test_an_inner_learning_rate_beyond_float32_is_refused`.


def _regression_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype("float32")
    y = np.stack([x.sum(1), x[:, 0] - x[:, 2]], axis=1).astype("float32")
    return x, y


def _fitted_model():
    model = _two_layer_model()
    model.compile(
        optimizer=tf_lars.LARS(
            learning_rate=0.5,
            weight_decay=1e-3,
            trust_coefficient=0.02,
            exclude_from_weight_decay=[ALL_1D],
        ),
        loss="mse",
    )
    x, y = _regression_data()
    model.fit(x, y, epochs=2, batch_size=16, verbose=0, shuffle=False)
    return model


# A tf.train.Checkpoint of the model and the optimizer restores and continues
# bit-identically: tests/contract_test.py,
# `test_checkpoint_restores_and_continues_bit_identically` (every row).


def test_saved_model_serves(tmp_path):
    model = _fitted_model()
    x, y = _regression_data()
    # One eager, compiled apply as well: its cached function must not break saving.
    with tf.GradientTape() as tape:
        loss = keras.losses.mean_squared_error(y, model(x))
    grads = tape.gradient(loss, model.trainable_variables)
    model.optimizer.apply(grads, model.trainable_variables)
    expected = model(x).numpy()
    export = str(tmp_path / "export")
    model.export(export)
    served = tf.saved_model.load(export)
    np.testing.assert_allclose(
        served.serve(tf.constant(x)).numpy(), expected, rtol=1e-6
    )
    tf.saved_model.save(model, str(tmp_path / "plain"))
    plain = tf.saved_model.load(str(tmp_path / "plain"))
    outputs = plain.signatures["serving_default"](tf.constant(x))
    np.testing.assert_allclose(
        next(iter(outputs.values())).numpy(), expected, rtol=1e-6
    )


def test_fit_with_xla_and_without_agree():
    histories = []
    weights = []
    for jit in (False, True):
        keras.utils.set_random_seed(7)
        model = _two_layer_model()
        model.compile(
            optimizer=tf_lars.LARS(learning_rate=0.5, trust_coefficient=0.02),
            loss="mse",
            jit_compile=jit,
        )
        x, y = _regression_data()
        histories.append(
            model.fit(x, y, epochs=3, batch_size=16, verbose=0, shuffle=False).history
        )
        weights.append([w.numpy() for w in model.weights])
    np.testing.assert_allclose(histories[0]["loss"], histories[1]["loss"], rtol=1e-5)
    assert histories[0]["loss"][-1] < histories[0]["loss"][0]
    for a, b in zip(*weights, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_mirrored_strategy_uses_all_reduced_gradient():
    # LARS, LAMB and TrustRatio in one process (one start-up of TensorFlow
    # and of the strategy for the three).
    stdout = harness.run_mirrored("optimizers", "LARS", "LAMB", "TrustRatio(SGD)")
    assert "MIRRORED OK" in stdout, stdout


def test_gradient_accumulation_applies_the_mean_gradient():
    config = dict(BASE)
    weights, grads = _problem("float64", seed=4)
    optimizer = tf_lars.LARS(learning_rate=0.5, gradient_accumulation_steps=2, **config)
    variables = [keras.Variable(w, dtype="float64") for w in weights]
    for step_grads in grads:
        optimizer.apply([tf.constant(g) for g in step_grads], variables)
    w = [np.array(x) for x in weights]
    v = [np.zeros_like(x) for x in w]
    for first, second in zip(grads[0::2], grads[1::2], strict=True):
        for i in range(len(w)):
            mean = (first[i] + second[i]) / 2
            w[i], v[i], _ = ref.dense_step(w[i], mean, v[i], 0.5, **config)
    for variable, want in zip(variables, w, strict=True):
        np.testing.assert_allclose(variable.numpy(), want, rtol=1e-9, atol=1e-12)
    assert optimizer.iterations.numpy() == STEPS // 2


def test_clipnorm_clips_before_the_trust_ratio():
    config = dict(BASE, momentum=0.0)
    optimizer = tf_lars.LARS(learning_rate=0.5, clipnorm=0.01, **config)
    weight = np.linspace(-1, 1, 12).reshape(3, 4)
    grad = np.linspace(0.5, 2, 12).reshape(3, 4)
    variable = keras.Variable(weight, dtype="float64")
    optimizer.apply([tf.constant(grad)], [variable])
    clipped = grad * 0.01 / np.linalg.norm(grad)
    want, _, _ = ref.dense_step(weight, clipped, np.zeros_like(weight), 0.5, **config)
    np.testing.assert_allclose(variable.numpy(), want, rtol=1e-6)


def test_update_step_accepts_keras_variables_directly():
    weights, grads = _problem("float64", seed=8)
    config = dict(BASE, classic_momentum=False, decay_in_gradient=False, nesterov=True)
    optimizer = tf_lars.LARS(learning_rate=0.5, **config)
    variables = [keras.Variable(w, dtype="float64") for w in weights]
    optimizer.build(variables)
    for step_grads in grads:
        for g, v in zip(step_grads, variables, strict=True):
            optimizer.update_step(tf.constant(g), v, 0.5)
    expected, _, _ = _run_numpy(weights, grads, 0.5, config)
    for variable, want in zip(variables, expected, strict=True):
        np.testing.assert_allclose(variable.numpy(), want, rtol=1e-10)


def test_numpy_scalars_are_accepted_where_floats_are():
    optimizer = tf_lars.LARS(
        learning_rate=np.float32(0.5),
        momentum=np.float64(0.8),
        weight_decay=np.int64(0),
    )
    assert optimizer.get_config()["learning_rate"] == 0.5
    assert optimizer.momentum == 0.8 and type(optimizer.momentum) is float
    with pytest.raises(ValueError, match=r"momentum=(np.float64\()?1.5"):
        tf_lars.LARS(momentum=np.float64(1.5))


# Keras's optimizer contract (found by running Keras 3.15's own optimizer
# tests against LARS).


@pytest.mark.parametrize("sparse", [False, True])
def test_optimizer_variables_are_written_through_self_assign(sparse):
    # Keras's sparse test: no direct `assign*` on a non-scalar tf.Variable,
    # and a sparse gradient reaches `self.assign*` as IndexedSlices.
    from unittest import mock

    variable = keras.Variable(np.ones((5, 4), "float32"))
    optimizer = tf_lars.LARS(learning_rate=0.1, momentum=0.9, weight_decay=0.01)
    optimizer.build([variable])
    if sparse:
        grad = tf.IndexedSlices(tf.fill((3, 4), 0.5), tf.constant([0, 2, 4]), (5, 4))
    else:
        grad = tf.fill((5, 4), 0.5)
    direct, through_optimizer, depth = [], [], [0]
    variable_class = variable.value.__class__
    originals = {
        name: getattr(type(optimizer), name)
        for name in ("assign", "assign_add", "assign_sub")
    }

    def recorder(name):
        def record(self, target, value):
            through_optimizer.append((name, isinstance(value, tf.IndexedSlices)))
            depth[0] += 1
            try:
                return originals[name](self, target, value)
            finally:
                depth[0] -= 1

        return record

    def refuse(name):
        original = getattr(variable_class, name)

        def check(self, *args, **kwargs):
            if len(self.shape) and not depth[0]:
                direct.append(name)
            return original(self, *args, **kwargs)

        return check

    patches = [
        mock.patch.object(type(optimizer), n, recorder(n)) for n in originals
    ] + [mock.patch.object(variable_class, n, refuse(n)) for n in originals]
    for patch in patches:
        patch.start()
    try:
        optimizer.apply([grad], [variable])
    finally:
        for patch in patches:
            patch.stop()
    assert direct == []
    # The trust-ratio record is the one dense write; with a sparse gradient
    # every other write is sparse (the variable and its momentum rows).
    assert through_optimizer.count(("assign", False)) == 1
    if sparse:
        assert len(through_optimizer) == 4
        assert all(s for n, s in through_optimizer if (n, s) != ("assign", False))


# Python lists (and NumPy arrays, tensors) as gradients, the compiled eager
# apply traced once: tests/contract_test.py,
# `test_tuples_and_python_lists_are_accepted[default-...]` (every row).


@pytest.mark.parametrize("compiled", ["eager", "jit"])
@pytest.mark.parametrize("mode", ["paper", "decayed", "clip"])
@pytest.mark.parametrize("scale", ref.MAGNITUDES)
def test_extreme_magnitudes_give_finite_reference_steps(scale, mode, compiled):
    options = dict(momentum=0.9, weight_decay=1e-4, trust_coefficient=0.001)
    if mode == "clip":
        options.update(trust_ratio="paper", trust_clip=True)
    else:
        options.update(trust_ratio=mode)
    weights = ref.extreme_values(scale)
    grads = ref.extreme_values(scale, seed=1)
    optimizer = tf_lars.LARS(learning_rate=0.1, **options)
    variables = ref.apply_once(optimizer, weights, grads, compiled)
    for k, (variable, w, g) in enumerate(zip(variables, weights, grads, strict=True)):
        want, _, ratio = ref.dense_step(w, g, np.zeros_like(w), 0.1, **options)
        got = variable.numpy()
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, want, rtol=2e-5)
        np.testing.assert_allclose(optimizer.trust_ratios.numpy()[k], ratio, rtol=2e-5)
