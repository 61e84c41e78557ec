"""Tests for tf_lars.AGN in one process: the seed's numbers, a NumPy reference,
model.fit under XLA, loss scaling, sparse gradients, saving and validation."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lars
from tf_lars.agn import AGN

# The seed's test: inner Adam(0.1, beta_1=0, beta_2=0) is sign-SGD with step
# 0.1; the gradient is -1 for both variables, which start at 0.0 and 0.5.
SEED_INNER = {
    "adam": lambda: keras.optimizers.Adam(0.1, beta_1=0.0, beta_2=0.0),
    "sgd": lambda: keras.optimizers.SGD(0.1),
}
# step -> (local var0, local var1, center var0, center var1); docs/algorithms.md,
# section "AGN".
SEED_REFERENCE = {
    1: (0.1, 0.6, 0.0, 0.5),
    3: (0.3, 0.8, 0.0, 0.5),
    4: (0.1, 0.6, 0.1, 0.6),
    8: (0.2, 0.7, 0.2, 0.7),
}


def _check_seed_reference(record):
    for step, expected in SEED_REFERENCE.items():
        np.testing.assert_allclose(
            record[step], expected, atol=1e-6, err_msg=f"step {step}"
        )


@pytest.mark.parametrize("inner", sorted(SEED_INNER))
@pytest.mark.parametrize("mode", ["eager", "function", "jit"])
def test_seed_reference_values_custom_loop(inner, mode):
    var0 = keras.Variable(0.0)
    var1 = keras.Variable(0.5)
    opt = tf_lars.AGN(SEED_INNER[inner](), communication_period=4)
    opt.build([var0, var1])
    grads = [tf.constant(-1.0), tf.constant(-1.0)]

    def step():
        opt.apply(grads, [var0, var1])

    if mode != "eager":
        step = tf.function(step, jit_compile=mode == "jit")
    record = {}
    for i in range(1, 9):
        step()
        center0, center1 = opt.center_variables
        record[i] = [float(var0.numpy()), float(var1.numpy())] + [
            float(center0.numpy()),
            float(center1.numpy()),
        ]
    _check_seed_reference(record)
    assert int(opt.commits.numpy()) == 2
    assert int(opt.local_steps.numpy()) == 8
    # The inner optimizer took 8 local steps; its center copy took 2 commits.
    assert int(opt.iterations.numpy()) == 8
    assert int(opt.center_optimizer.iterations.numpy()) == 2
    for accumulator in opt.accumulators:
        assert float(accumulator.numpy()) == 0.0


class _TwoWeights(keras.layers.Layer):
    """Outputs w0 + w1 for every example; with loss -mean(y_pred) both
    gradients are exactly -1, as in the seed's test."""

    def build(self, input_shape):
        self.w0 = self.add_weight(
            shape=(), initializer=keras.initializers.Constant(0.0)
        )
        self.w1 = self.add_weight(
            shape=(), initializer=keras.initializers.Constant(0.5)
        )

    def call(self, x):
        return tf.zeros_like(x) + self.w0 + self.w1


def _negative_mean(y_true, y_pred):
    del y_true
    return -tf.reduce_mean(y_pred, axis=-1)


class _Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.record = {}

    def on_train_batch_end(self, batch, logs=None):
        opt = self.model.optimizer
        layer = self.model.layers[-1]
        centers = opt.center_variables
        self.record[batch + 1] = [
            float(layer.w0.numpy()),
            float(layer.w1.numpy()),
            float(centers[0].numpy()),
            float(centers[1].numpy()),
        ]


@pytest.mark.parametrize("inner", sorted(SEED_INNER))
@pytest.mark.parametrize("jit_compile", ["auto", True])
def test_seed_reference_values_model_fit(inner, jit_compile):
    model = keras.Sequential([keras.Input((1,)), _TwoWeights()])
    model.compile(
        optimizer=tf_lars.AGN(SEED_INNER[inner](), communication_period=4),
        loss=_negative_mean,
        jit_compile=jit_compile,
    )
    # "auto" means XLA on accelerators and no XLA on a CPU-only machine;
    # True forces the XLA-compiled step, where the commit must be an
    # on-device conditional.
    if jit_compile is True:
        assert model.jit_compile is True
    recorder = _Recorder()
    x = np.ones((8, 1), np.float32)
    model.fit(
        x, x, batch_size=1, epochs=1, shuffle=False, verbose=0, callbacks=[recorder]
    )
    _check_seed_reference(recorder.record)
    assert int(model.optimizer.commits.numpy()) == 2


# ----------------------------------------------------------- NumPy reference
def _f32(x):
    return float(np.float32(x))


def _np_sgd(lr, momentum):
    # Keras keeps the learning rate in float32 and casts `momentum` through a
    # float32 constant: mirror both roundings so float64 agrees to 1e-12.
    lr, momentum = _f32(lr), _f32(momentum)

    def init(shape):
        return {"m": np.zeros(shape), "t": 0}

    def update(var, grad, state):
        state["m"] = state["m"] * momentum - grad * lr
        state["t"] += 1
        return var + state["m"]

    return init, update


def _np_adam(lr, beta_1, beta_2, epsilon):
    # As Keras: float32 learning rate, float32-rounded betas in the bias
    # correction, exact `1 - beta` in the moment updates.
    lr = _f32(lr)

    def init(shape):
        return {"m": np.zeros(shape), "v": np.zeros(shape), "t": 0}

    def update(var, grad, state):
        t = state["t"] + 1
        alpha = lr * np.sqrt(1 - _f32(beta_2) ** t) / (1 - _f32(beta_1) ** t)
        state["m"] += (grad - state["m"]) * (1 - beta_1)
        state["v"] += (grad**2 - state["v"]) * (1 - beta_2)
        state["t"] = t
        return var - state["m"] * alpha / (np.sqrt(state["v"]) + epsilon)

    return init, update


def _agn_numpy(weights, grads, period, make_rule):
    """The seed's algorithm, one worker, float64. Yields the state per step."""
    init, update = make_rule
    local = [np.array(w, np.float64) for w in weights]
    center = [w.copy() for w in local]
    acc = [np.zeros_like(w) for w in local]
    local_state = [init(w.shape) for w in local]
    center_state = [init(w.shape) for w in local]
    commits = 0
    for step, step_grads in enumerate(grads, start=1):
        for i, g in enumerate(step_grads):
            local[i] = update(local[i], g, local_state[i])
            acc[i] = acc[i] + g
        if step % period == 0:
            for i in range(len(local)):
                center[i] = update(center[i], acc[i] / period, center_state[i])
                local[i] = center[i].copy()
                acc[i] = np.zeros_like(acc[i])
            commits += 1
        yield (
            [x.copy() for x in local],
            [x.copy() for x in center],
            [x.copy() for x in acc],
            commits,
        )


SHAPES = [(), (5,), (3, 4)]
RULES = {
    "sgd_momentum": (
        lambda: keras.optimizers.SGD(0.05, momentum=0.9),
        lambda: _np_sgd(0.05, 0.9),
    ),
    "adam": (
        lambda: keras.optimizers.Adam(0.01, beta_1=0.8, beta_2=0.95, epsilon=1e-3),
        lambda: _np_adam(0.01, 0.8, 0.95, 1e-3),
    ),
}
# float16: SGD only (Adam's epsilon and moments are not meaningful in half
# precision); tolerance 2e-3 absolute for values of order 1.
CASES = [
    ("sgd_momentum", "float32", "eager", 1e-5),
    ("sgd_momentum", "float64", "eager", 1e-12),
    ("sgd_momentum", "float16", "eager", 2e-3),
    ("adam", "float32", "eager", 1e-5),
    ("adam", "float64", "eager", 1e-12),
    ("sgd_momentum", "float32", "function", 1e-5),
    ("adam", "float32", "jit", 1e-5),
]


@pytest.mark.parametrize("rule,dtype,mode,atol", CASES)
def test_matches_numpy_reference(rule, dtype, mode, atol):
    period, steps = 3, 10
    rng = np.random.default_rng(7)
    weights = [rng.normal(size=s) for s in SHAPES]
    grads = [[rng.normal(scale=0.5, size=s) for s in SHAPES] for _ in range(steps)]
    make_inner, make_rule = RULES[rule]
    variables = [keras.Variable(w.astype(dtype), dtype=dtype) for w in weights]
    opt = AGN(make_inner(), communication_period=period)
    opt.build(variables)

    def step(step_grads):
        opt.apply(step_grads, variables)

    if mode != "eager":
        step = tf.function(step, jit_compile=mode == "jit")
    reference = _agn_numpy(weights, grads, period, make_rule())
    for step_grads, (local, center, acc, commits) in zip(grads, reference, strict=True):
        step([tf.constant(g, dtype) for g in step_grads])
        for got, want in (
            (variables, local),
            (opt.center_variables, center),
            (opt.accumulators, acc),
        ):
            for g, w in zip(got, want, strict=True):
                assert g.dtype == dtype
                np.testing.assert_allclose(
                    np.asarray(g.numpy(), np.float64), w, atol=atol, rtol=atol
                )
        assert int(opt.commits.numpy()) == commits


def test_sparse_gradient_accumulates_touched_rows():
    table = keras.Variable(np.zeros((5, 2), np.float32))
    opt = AGN(keras.optimizers.SGD(0.1), communication_period=2)
    opt.build([table])
    rows = tf.IndexedSlices(
        tf.constant([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]),
        tf.constant([1, 3, 1]),
        tf.constant([5, 2]),
    )
    opt.apply([rows], [table])
    expected_acc = np.zeros((5, 2))
    expected_acc[1] = 4.0
    expected_acc[3] = 2.0
    np.testing.assert_allclose(opt.accumulators[0].numpy(), expected_acc)
    np.testing.assert_allclose(table.numpy(), -0.1 * expected_acc, atol=1e-7)
    opt.apply([rows], [table])
    # Commit: center -= 0.1 * (2 * acc_one_step) / 2; local = center.
    np.testing.assert_allclose(
        opt.center_variables[0].numpy(), -0.1 * expected_acc, atol=1e-6
    )
    np.testing.assert_allclose(table.numpy(), -0.1 * expected_acc, atol=1e-6)
    np.testing.assert_allclose(opt.accumulators[0].numpy(), 0.0)


@pytest.mark.parametrize(
    "make_loss_scale",
    [
        lambda inner: keras.optimizers.LossScaleOptimizer(inner, initial_scale=8.0),
        lambda inner: tf_lars.LossScaleOptimizer(inner, initial_scale=8.0),
    ],
    ids=["keras", "tf_lars"],
)
def test_loss_scale_inner_accumulates_unscaled_and_skips_non_finite(make_loss_scale):
    var = keras.Variable([1.0, 2.0])
    opt = AGN(make_loss_scale(keras.optimizers.SGD(0.5)), communication_period=2)
    opt.build([var])
    g1 = np.array([1.0, -1.0], np.float32)
    g3 = np.array([3.0, 5.0], np.float32)

    def scaled(g):
        return [tf.constant(g) * opt.scale_loss(tf.constant(1.0))]

    opt.apply(scaled(g1), [var])
    np.testing.assert_allclose(opt.accumulators[0].numpy(), g1)
    np.testing.assert_allclose(var.numpy(), [0.5, 2.5])
    opt.apply([tf.constant([np.inf, 1.0])], [var])  # skipped by the loss scaler
    np.testing.assert_allclose(var.numpy(), [0.5, 2.5])
    np.testing.assert_allclose(opt.accumulators[0].numpy(), g1)
    assert int(opt.local_steps.numpy()) == 1
    assert int(opt.commits.numpy()) == 0
    assert float(opt.scale_loss(tf.constant(1.0))) == 4.0  # halved
    opt.apply(scaled(g3), [var])
    # Commit of the two finite, unscaled gradients; the center is updated by
    # a plain SGD(0.5), not by a second loss scaler.
    center = np.array([1.0, 2.0]) - 0.5 * (g1 + g3) / 2
    np.testing.assert_allclose(opt.center_variables[0].numpy(), center, atol=1e-6)
    np.testing.assert_allclose(var.numpy(), center, atol=1e-6)
    assert int(opt.commits.numpy()) == 1
    assert not isinstance(opt.center_optimizer, keras.optimizers.LossScaleOptimizer)


def test_lars_inner_trains_and_round_trips():
    var = keras.Variable(np.full((3,), 2.0, np.float32))
    opt = AGN(tf_lars.LARS(learning_rate=0.5, momentum=0.0, weight_decay=0.0), 2)
    for _ in range(4):
        opt.apply([tf.constant([1.0, 1.0, 1.0])], [var])
    assert int(opt.commits.numpy()) == 2
    # LARS with trust 0.001 * |w| / |g| moves each step by lr * T * g.
    assert np.all(var.numpy() < 2.0)
    assert isinstance(opt.center_optimizer, tf_lars.LARS)
    clone = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(opt)
    )
    assert isinstance(clone.inner_optimizer, tf_lars.LARS)
    assert clone.inner_optimizer.get_config() == opt.inner_optimizer.get_config()


# --------------------------------------------------------------- serialization
def _small_model():
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=AGN(keras.optimizers.Adam(0.05), 3), loss="mse")
    return model


def test_model_save_and_load_keeps_agn_state(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4)).astype(np.float32)
    y = rng.normal(size=(40, 1)).astype(np.float32)
    model = _small_model()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)  # 5 steps
    assert int(model.optimizer.commits.numpy()) == 1  # mid-round: 2 of 3 steps
    path = str(tmp_path / "agn.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is AGN
    assert int(loaded.optimizer.commits.numpy()) == 1
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-7)
    for m in (model, loaded):
        m.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), loaded.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert int(loaded.optimizer.commits.numpy()) == 3


def test_tf_train_checkpoint_restores_center_and_accumulators(tmp_path):
    var = keras.Variable([0.0, 0.5])
    opt = AGN(keras.optimizers.SGD(0.1, momentum=0.9), communication_period=4)
    for _ in range(6):
        opt.apply([tf.constant([-1.0, 2.0])], [var])
    path = tf.train.Checkpoint(var=var, optimizer=opt).save(str(tmp_path / "ckpt"))
    var2 = keras.Variable([9.0, 9.0])
    opt2 = AGN(keras.optimizers.SGD(0.1, momentum=0.9), communication_period=4)
    opt2.build([var2])
    tf.train.Checkpoint(var=var2, optimizer=opt2).restore(path).assert_consumed()
    np.testing.assert_allclose(var2.numpy(), var.numpy())
    for a, b in zip(opt.variables, opt2.variables, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy())
    for o, v in ((opt, var), (opt2, var2)):
        for _ in range(2):
            o.apply([tf.constant([-1.0, 2.0])], [v])
    np.testing.assert_allclose(var2.numpy(), var.numpy())
    assert int(opt2.commits.numpy()) == 2


def test_learning_rate_and_iterations_delegate_to_inner():
    inner = keras.optimizers.SGD(0.25)
    opt = AGN(inner, communication_period=2)
    var = keras.Variable([1.0])
    opt.build([var])
    assert float(opt.learning_rate.numpy()) == 0.25
    opt.learning_rate = 0.125
    assert float(inner.learning_rate.numpy()) == 0.125
    assert float(opt.center_optimizer.learning_rate.numpy()) == 0.125
    opt.apply([tf.constant([1.0])], [var])
    assert int(opt.iterations.numpy()) == int(inner.iterations.numpy()) == 1


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize("period", [0, -3, 2.5, True, "4", None])
def test_rejects_bad_communication_period(period):
    with pytest.raises(ValueError) as info:
        AGN(keras.optimizers.SGD(), communication_period=period)
    assert str(info.value) == (
        "`communication_period` must be an int >= 1. "
        f"Received: communication_period={period!r}"
    )


@pytest.mark.parametrize("inner", ["sgd", None, 0.1])
def test_rejects_non_optimizer_inner(inner):
    with pytest.raises(
        ValueError,
        match=r"`inner_optimizer` must be a `keras.optimizers.Optimizer` instance\. "
        r"Received: inner_optimizer=",
    ):
        AGN(inner)


def test_rejects_agn_inner_and_base_arguments():
    message = "`inner_optimizer` must not be an AGN or a DiLoCo: each takes outer"
    with pytest.raises(ValueError, match=message):
        AGN(AGN(keras.optimizers.SGD()))
    with pytest.raises(ValueError, match=message):
        AGN(tf_lars.DiLoCo(keras.optimizers.SGD()))
    with pytest.raises(ValueError, match="`inner_optimizer` must not be a DiLoCo"):
        tf_lars.DiLoCo(AGN(keras.optimizers.SGD()))
    with pytest.raises(
        ValueError,
        match=r"`clipnorm` is not supported by AGN; set it on `inner_optimizer`\. "
        r"Received: clipnorm=1\.0",
    ):
        AGN(keras.optimizers.SGD(), clipnorm=1.0)
    with pytest.raises(ValueError, match="not recognized"):
        AGN(keras.optimizers.SGD(), period=3)
    # Defaults of the base arguments are accepted (configs written elsewhere).
    assert (
        AGN(keras.optimizers.SGD(), use_ema=False, clipnorm=None).communication_period
        == 10
    )


def test_rejects_mirrored_strategy():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        var = keras.Variable([1.0])
        opt = AGN(keras.optimizers.SGD(0.1))
    with pytest.raises(
        ValueError,
        match="default strategy .* or with `tf.distribute.ParameterServerStrategy`",
    ):
        opt.build([var])


def test_state_needs_build():
    opt = AGN(keras.optimizers.SGD())
    with pytest.raises(
        ValueError, match="`commits` exists once the optimizer is built"
    ):
        opt.commits  # noqa: B018


def test_inner_lars_exclusions_reach_the_center_optimizer():
    # The center optimizer is built on AGN's own copies; LARS's path-based
    # exclusions must still resolve against the model variables' paths.
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(2, name="dense")], name="net"
    )
    inner = tf_lars.LARS(
        learning_rate=0.1,
        weight_decay=0.1,
        exclude_from_weight_decay=["dense/bias"],
        exclude_from_layer_adaptation=[r"^net/dense/bias$"],
    )
    agn = tf_lars.AGN(inner, communication_period=2)
    agn.build(model.trainable_variables)
    center = agn.center_optimizer
    assert inner._variable_weight_decay == [0.1, 0.0]
    assert center._variable_weight_decay == [0.1, 0.0]
    assert center._variable_adapted == inner._variable_adapted == [True, False]
    assert center.trust_ratio_paths == ["net/dense/kernel", "net/dense/bias"]


# ------------------------------------------------------------ Keras contract
def test_python_list_gradients_do_not_retrace_the_compiled_inner_step():
    var = keras.Variable([1.0, 2.0])
    opt = AGN(tf_lars.LARS(learning_rate=0.1), communication_period=2)
    opt.build([var])
    for i in range(4):
        opt.apply([[0.1 * (i + 1), 0.2]], [var])
    assert int(opt.commits.numpy()) == 2
    compiled = list(opt.inner_optimizer._compiled_apply.values())
    assert compiled, "LARS did not compile its eager apply"
    assert [f.experimental_get_tracing_count() for f in compiled] == [1]


def test_counters_are_written_through_the_optimizer(monkeypatch):
    # Keras's contract: optimizer variables change through `assign*`.
    var = keras.Variable([1.0])
    opt = AGN(keras.optimizers.SGD(0.1), communication_period=2)
    opt.build([var])
    written = []
    assign_add = opt.assign_add

    def recording(variable, value):
        written.append(variable)
        assign_add(variable, value)

    monkeypatch.setattr(opt, "assign_add", recording)
    for _ in range(2):
        opt.apply([tf.constant([1.0])], [var])
    assert any(v is opt.commits for v in written)
    assert any(v is opt.local_steps for v in written)
    assert int(opt.commits.numpy()) == 1 and int(opt.local_steps.numpy()) == 2


# Unknown config keys and numbers beyond float32, refused for every class
# (this file's tests of them are there): tests/contract_test.py,
# `test_from_config_refuses_an_unknown_key`,
# `test_numbers_beyond_float32_are_refused`,
# `test_an_inner_learning_rate_beyond_float32_is_refused`.
