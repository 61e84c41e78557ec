"""Tests for `tf_lars.AGN(..., outer_optimizer=...)` in one process
(asynchronous DiLoCo's commit): a NumPy reference with DiLoCo's outer
Nesterov step, AGN's own commit taken by `SGD(1 / period)`, saving,
checkpoints and validation. The parameter-server side is in
distribute_ps_test.py."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lars
from tests import diloco_reference as ref
from tf_lars.agn import AGN

SHAPES = [(), (5,), (3, 4)]


def _outer():
    return keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)


def _agn_outer_numpy(weights, grads, period, inner, outer):
    """AGN with an outer optimizer, one worker, float64: local steps with
    `inner`; every `period` steps `outer` applies `center - local` to the
    center and the local copy is reset to it. Yields (local, center)."""
    local = [np.array(w, np.float64) for w in weights]
    center = [w.copy() for w in local]
    for step, step_grads in enumerate(grads, start=1):
        local = inner.apply(step_grads, local)
        if step % period == 0:
            delta = [c - x for c, x in zip(center, local, strict=True)]
            center = outer.apply(delta, center)
            local = [c.copy() for c in center]
        yield [x.copy() for x in local], [c.copy() for c in center]


INNER = {
    "sgd_momentum": (
        lambda: keras.optimizers.SGD(0.05, momentum=0.9),
        lambda: ref.SGD(0.05, momentum=0.9),
    ),
    "adamw": (
        lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
        lambda: ref.AdamW(0.01, weight_decay=0.1),
    ),
}
CASES = [
    ("sgd_momentum", "float32", "eager", 1e-5),
    ("sgd_momentum", "float64", "eager", 1e-12),
    ("adamw", "float64", "eager", 1e-12),
    ("adamw", "float32", "function", 1e-5),
    ("sgd_momentum", "float32", "jit", 1e-5),
]


@pytest.mark.parametrize("inner,dtype,mode,atol", CASES)
def test_matches_numpy_reference_with_outer_nesterov(inner, dtype, mode, atol):
    period, steps = 3, 10
    rng = np.random.default_rng(11)
    weights = [rng.normal(size=s) for s in SHAPES]
    grads = [[rng.normal(scale=0.5, size=s) for s in SHAPES] for _ in range(steps)]
    make_inner, make_reference = INNER[inner]
    variables = [keras.Variable(w.astype(dtype), dtype=dtype) for w in weights]
    opt = AGN(make_inner(), communication_period=period, outer_optimizer=_outer())
    opt.build(variables)
    assert opt.accumulators == []  # nothing accumulated with an outer step
    assert opt.center_optimizer is opt.outer_optimizer

    def step(step_grads):
        opt.apply(step_grads, variables)

    if mode != "eager":
        step = tf.function(step, jit_compile=mode == "jit")
    reference = _agn_outer_numpy(
        weights, grads, period, make_reference(), ref.SGD(0.7, 0.9, nesterov=True)
    )
    for number, (step_grads, (local, center)) in enumerate(
        zip(grads, reference, strict=True), start=1
    ):
        step([tf.constant(g, dtype) for g in step_grads])
        for got, want in ((variables, local), (opt.center_variables, center)):
            for g, w in zip(got, want, strict=True):
                assert g.dtype == dtype
                np.testing.assert_allclose(
                    np.asarray(g.numpy(), np.float64), w, atol=atol, rtol=atol
                )
        assert int(opt.commits.numpy()) == number // period
        assert int(opt.outer_optimizer.iterations.numpy()) == number // period


def test_outer_sgd_one_over_period_is_agns_own_commit():
    # With a plain-SGD inner step, `center - local` after a round is
    # lr * sum(grads); AGN's own commit applies lr * sum(grads) / period.
    period, steps = 4, 12
    rng = np.random.default_rng(5)
    weights = [rng.normal(size=s) for s in SHAPES]
    grads = [[rng.normal(size=s) for s in SHAPES] for _ in range(steps)]
    plain_vars = [keras.Variable(w, dtype="float64") for w in weights]
    outer_vars = [keras.Variable(w, dtype="float64") for w in weights]
    plain = AGN(keras.optimizers.SGD(0.1), communication_period=period)
    outer = AGN(
        keras.optimizers.SGD(0.1),
        communication_period=period,
        outer_optimizer=keras.optimizers.SGD(1 / period),
    )
    for step_grads in grads:
        tensors = [tf.constant(g, "float64") for g in step_grads]
        plain.apply(tensors, plain_vars)
        outer.apply(tensors, outer_vars)
    assert int(outer.commits.numpy()) == int(plain.commits.numpy()) == 3
    for a, b, w in zip(plain.center_variables, outer.center_variables, weights):
        assert np.abs(a.numpy() - w).max() > 1e-3  # the commits moved it
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12, atol=1e-12)


def test_model_fit_save_and_load_keep_the_outer_state(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4)).astype(np.float32)
    y = rng.normal(size=(40, 1)).astype(np.float32)

    def make():
        keras.utils.set_random_seed(3)
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(3, "tanh"), keras.layers.Dense(1)]
        )
        model.compile(
            optimizer=AGN(keras.optimizers.Adam(0.05), 3, outer_optimizer=_outer()),
            loss="mse",
        )
        return model

    model = make()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)  # 5 steps
    momenta = model.optimizer.outer_optimizer.variables
    assert any(np.abs(v.numpy()).max() > 0 for v in momenta[2:])  # slots moved
    path = str(tmp_path / "agn_outer.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is AGN
    assert isinstance(loaded.optimizer.outer_optimizer, keras.optimizers.SGD)
    assert loaded.optimizer.outer_optimizer.nesterov
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-7)
    for m in (model, loaded):
        m.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), loaded.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert int(loaded.optimizer.commits.numpy()) == 3


def test_checkpoint_restores_the_outer_momentum(tmp_path):
    def make():
        return AGN(
            keras.optimizers.SGD(0.1),
            communication_period=2,
            outer_optimizer=keras.optimizers.SGD(0.5, momentum=0.9),
        )

    var, opt = keras.Variable([0.0, 0.5]), make()
    for _ in range(5):
        opt.apply([tf.constant([-1.0, 2.0])], [var])
    path = tf.train.Checkpoint(var=var, optimizer=opt).save(str(tmp_path / "ckpt"))
    var2, opt2 = keras.Variable([9.0, 9.0]), make()
    opt2.build([var2])
    tf.train.Checkpoint(var=var2, optimizer=opt2).restore(path).assert_consumed()
    for a, b in zip(opt.variables, opt2.variables, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy())
    for o, v in ((opt, var), (opt2, var2)):
        for _ in range(3):
            o.apply([tf.constant([-1.0, 2.0])], [v])
    np.testing.assert_allclose(var2.numpy(), var.numpy())
    np.testing.assert_allclose(
        opt2.center_variables[0].numpy(), opt.center_variables[0].numpy()
    )
    assert int(opt2.commits.numpy()) == 4


def test_config_round_trip_with_and_without_an_outer_optimizer():
    plain = AGN(keras.optimizers.SGD(0.1), 4)
    assert plain.get_config()["outer_optimizer"] is None
    assert AGN.from_config(plain.get_config()).outer_optimizer is None
    opt = AGN(tf_lars.LARS(learning_rate=1.0), 4, outer_optimizer=_outer())
    clone = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(opt)
    )
    assert clone.get_config() == opt.get_config()
    assert clone.outer_optimizer.get_config() == opt.outer_optimizer.get_config()
    assert isinstance(clone.inner_optimizer, tf_lars.LARS)


def test_learning_rate_setter_leaves_the_outer_rate():
    opt = AGN(keras.optimizers.SGD(0.25), 2, outer_optimizer=_outer())
    opt.build([keras.Variable([1.0])])
    opt.learning_rate = 0.125
    assert float(opt.inner_optimizer.learning_rate.numpy()) == 0.125
    assert float(opt.outer_optimizer.learning_rate.numpy()) == pytest.approx(0.7)


@pytest.mark.parametrize(
    "outer,message",
    [
        (
            "sgd",
            "`outer_optimizer` must be a `keras.optimizers.Optimizer` instance. "
            "Received: outer_optimizer='sgd'",
        ),
        (
            keras.optimizers.SGD(0.0),
            "`outer_optimizer.learning_rate` must be a "
            "finite number > 0. Received: outer_optimizer=SGD with learning_rate=0.0",
        ),
        (
            keras.optimizers.SGD(float("nan")),
            "`outer_optimizer.learning_rate` must "
            "be a finite number > 0. Received: outer_optimizer=SGD with "
            "learning_rate=nan",
        ),
    ],
)
def test_rejects_bad_outer_optimizer(outer, message):
    with pytest.raises(ValueError) as info:
        AGN(keras.optimizers.SGD(0.1), outer_optimizer=outer)
    assert str(info.value) == message


def test_rejects_the_inner_loss_scale_and_agn_as_outer():
    inner = keras.optimizers.SGD(0.1)
    with pytest.raises(ValueError, match="must be another optimizer than"):
        AGN(inner, outer_optimizer=inner)
    for outer in (
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.7)),
        tf_lars.LossScaleOptimizer(keras.optimizers.SGD(0.7)),
    ):
        with pytest.raises(ValueError, match="must not be a loss-scale optimizer"):
            AGN(inner, outer_optimizer=outer)
    for outer in (
        AGN(keras.optimizers.SGD(0.5)),
        tf_lars.DiLoCo(keras.optimizers.SGD(0.5)),
    ):
        with pytest.raises(ValueError, match="`outer_optimizer` must not be an AGN"):
            AGN(inner, outer_optimizer=outer)
    with pytest.raises(ValueError, match="`outer_optimizer` must not be a DiLoCo"):
        tf_lars.DiLoCo(inner, AGN(keras.optimizers.SGD(0.5)))
