"""Tests for tf_lars.TrustRatio against the NumPy rule of docs/algorithms.md
("TrustRatio and LAMB", tests/lamb_reference.py), around Keras optimizers."""

import pathlib
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lars
from tests import harness
from tests import lamb_reference as ref
from tests import lars_reference as lars_ref
from tf_lars.lars import ALL_1D

SHAPES = [(), (5,), (4, 3), (2, 3, 2, 3)]
PATHS = ["gain", "bias", "dense_kernel", "conv_kernel"]
STEPS = 4
LR = 2.0**-3

# Every flag of the rule, around SGD (plain, momentum, Nesterov) and Adam.
FLAGS = {
    "defaults": {},
    "decay": {"weight_decay": 0.1},
    "coefficient_epsilon": {"trust_coefficient": 0.3, "epsilon": 0.05},
    "clip": {"trust_clip": True, "weight_decay": 0.01},
    "exclusions": {
        "weight_decay": 0.1,
        "exclude_from_weight_decay": [ALL_1D, "conv"],
        "exclude_from_layer_adaptation": ["bias"],
    },
}
INNER = {
    "sgd": (lambda: keras.optimizers.SGD(LR), lambda: ref.keras_sgd_direction(LR)),
    "momentum": (
        lambda: keras.optimizers.SGD(LR, momentum=0.9),
        lambda: ref.keras_sgd_direction(LR, 0.9),
    ),
    "nesterov": (
        lambda: keras.optimizers.SGD(LR, momentum=0.8, nesterov=True),
        lambda: ref.keras_sgd_direction(LR, 0.8, nesterov=True),
    ),
    "adam": (
        lambda: keras.optimizers.Adam(LR, epsilon=1e-3),
        lambda: ref.keras_adam_direction(epsilon=1e-3),
    ),
}


def _problem(dtype, seed=0):
    return harness.random_problem(dtype, SHAPES, STEPS, seed)


def _run(optimizer, weights, grads, dtype, mode="default"):
    return harness.run_steps(optimizer, weights, grads, dtype, mode, PATHS)


def _close(actual, expected, dtype):
    tol = {"float32": 3e-5, "float64": 1e-11}[dtype]
    for a, b in zip(actual, expected, strict=True):
        np.testing.assert_allclose(np.asarray(a), b, rtol=tol, atol=tol)


def _masks(flags):
    decay = flags.get("exclude_from_weight_decay") or []
    adapt = flags.get("exclude_from_layer_adaptation", None)
    adapt = decay if adapt is None else adapt

    def excluded(patterns, shape, path):
        return any(
            (p == ALL_1D and len(shape) <= 1) or (p != ALL_1D and p in path)
            for p in patterns
        )

    decayed = [not excluded(decay, s, p) for s, p in zip(SHAPES, PATHS, strict=True)]
    adapted = [not excluded(adapt, s, p) for s, p in zip(SHAPES, PATHS, strict=True)]
    return decayed, adapted


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("inner", sorted(INNER))
@pytest.mark.parametrize("flags", sorted(FLAGS))
def test_matches_numpy_reference(flags, inner, dtype):
    config = FLAGS[flags]
    make_inner, make_direction = INNER[inner]
    weights, grads = _problem(dtype)
    optimizer = tf_lars.TrustRatio(make_inner(), **config)
    mode = harness.FLAG_MATRIX_MODE[dtype]
    variables = _run(optimizer, weights, grads, dtype, mode)
    decayed, adapted = _masks(config)
    expected, ratios = ref.wrapped_run(
        weights,
        grads,
        LR,
        make_direction(),
        weight_decay=config.get("weight_decay", 0.0),
        trust_coefficient=config.get("trust_coefficient", 1.0),
        epsilon=config.get("epsilon", 0.0),
        trust_clip=config.get("trust_clip", False),
        decayed=decayed,
        adapted=adapted,
    )
    _close([v.numpy() for v in variables], expected, dtype)
    np.testing.assert_allclose(optimizer.trust_ratios.numpy(), ratios, rtol=2e-5)
    assert optimizer.trust_ratio_paths == PATHS


@pytest.mark.parametrize("inner", ["momentum", "adam"])
def test_inner_state_evolves_exactly_as_without_the_wrapper(inner):
    weights, grads = _problem("float64", seed=1)
    wrapped = tf_lars.TrustRatio(INNER[inner][0](), weight_decay=0.1)
    _run(wrapped, weights, grads, "float64")
    alone = INNER[inner][0]()
    _run(alone, weights, grads, "float64")
    assert wrapped.inner_optimizer.iterations.numpy() == STEPS
    # Equal up to XLA's fused multiply-adds (the wrapped run is compiled).
    for a, b in zip(wrapped.inner_optimizer.variables, alone.variables, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-14, atol=1e-17)


def test_lion_and_adamw_inner_optimizers():
    weights, grads = _problem("float64", seed=3)
    for inner in (
        keras.optimizers.Lion(LR),
        keras.optimizers.AdamW(LR, weight_decay=0.0),
    ):
        optimizer = tf_lars.TrustRatio(inner, weight_decay=0.1)
        variables = _run(optimizer, weights, grads, "float64")
        assert all(np.all(np.isfinite(v.numpy())) for v in variables)
        assert np.all(optimizer.trust_ratios.numpy() != 1.0)


def test_zero_norms_give_ratio_one():
    optimizer = tf_lars.TrustRatio(keras.optimizers.SGD(0.5))
    zero_w = keras.Variable(np.zeros((3,), "float32"))
    zero_g = keras.Variable(np.ones((2,), "float32"))
    optimizer.apply([tf.ones((3,)), tf.zeros((2,))], [zero_w, zero_g])
    np.testing.assert_array_equal(optimizer.trust_ratios.numpy(), [1.0, 1.0])
    np.testing.assert_array_equal(zero_w.numpy(), -0.5)
    np.testing.assert_array_equal(zero_g.numpy(), 1.0)


def test_zero_learning_rate_moves_nothing_and_reports_one():
    optimizer = tf_lars.TrustRatio(keras.optimizers.Adam(0.0), weight_decay=0.1)
    variable = keras.Variable(np.ones((2, 2), "float32"))
    optimizer.apply([tf.ones((2, 2))], [variable])
    np.testing.assert_array_equal(variable.numpy(), 1.0)
    np.testing.assert_array_equal(optimizer.trust_ratios.numpy(), [1.0])


@pytest.mark.parametrize("compiled", [True, False])
def test_sparse_rows_take_the_inner_update_without_ratio(compiled):
    rng = np.random.default_rng(4)
    weight = rng.normal(size=(6, 3)).astype("float32")
    optimizer = tf_lars.TrustRatio(
        keras.optimizers.SGD(0.1, momentum=0.9), weight_decay=0.5
    )
    optimizer.jit_compile = compiled
    alone = keras.optimizers.SGD(0.1, momentum=0.9)
    ours, theirs = keras.Variable(weight), keras.Variable(weight)
    for _ in range(3):
        values = tf.constant(rng.normal(size=(4, 3)).astype("float32"))
        grad = tf.IndexedSlices(values, tf.constant([0, 4, 0, 2]), (6, 3))
        optimizer.apply([grad], [ours])
        alone.apply([grad], [theirs])
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-6)
    assert optimizer.trust_ratios.numpy()[0] == 1.0


# TrustRatio(Adam) inside tf_lars's loss scale fits as without one:
# tests/loss_scale_test.py, `test_one_loss_scale_around_the_adaptive_optimizers`
# (`[mixed_bfloat16-TrustRatio_Adam]`).


def _refused_inner_optimizers():
    makers = {
        "LARS": lambda: tf_lars.LARS(),
        "LAMB": lambda: tf_lars.LAMB(),
        "TrustRatio": lambda: tf_lars.TrustRatio(keras.optimizers.SGD()),
        "tf_lars.LossScaleOptimizer": lambda: tf_lars.LossScaleOptimizer(
            keras.optimizers.SGD()
        ),
        "keras.LossScaleOptimizer": lambda: keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD()
        ),
        "keras.Lamb": lambda: keras.optimizers.Lamb(),
    }
    if keras.backend.backend() == "tensorflow":
        makers["AGN"] = lambda: tf_lars.AGN(keras.optimizers.SGD())
    return makers


@pytest.mark.parametrize("name", sorted(_refused_inner_optimizers()))
def test_refuses_wrappers_and_layerwise_optimizers_as_inner(name):
    inner = _refused_inner_optimizers()[name]()
    with pytest.raises(ValueError, match="must be a plain Keras optimizer") as error:
        tf_lars.TrustRatio(inner)
    assert f"Received: inner_optimizer={inner!r}" in str(error.value)


def test_refusals_go_by_a_marker_not_by_importing_the_classes():
    import ast

    source = pathlib.Path(tf_lars.trust_ratio.__file__).read_text(encoding="utf-8")
    imported = {
        node.module
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom)
    }
    assert not imported & {"tf_lars.lars", "tf_lars.agn", "tf_lars.loss_scale"}

    # A foreign optimizer that sets the marker is refused; without it, taken.
    class Marked(keras.optimizers.SGD):
        takes_no_trust_ratio = True

    with pytest.raises(ValueError, match="must be a plain Keras optimizer"):
        tf_lars.TrustRatio(Marked())
    assert tf_lars.TrustRatio(keras.optimizers.SGD()).inner_optimizer


def test_learning_rate_is_the_inner_optimizers():
    optimizer = tf_lars.TrustRatio(keras.optimizers.SGD(0.25))
    assert float(optimizer.learning_rate) == 0.25
    optimizer.learning_rate = 0.5
    assert float(optimizer.inner_optimizer.learning_rate) == 0.5


class _DecaysOutsideItsStep(keras.optimizers.SGD):
    adam_weight_decay = 0.004  # Muon's default, applied in `_apply_weight_decay`


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda: tf_lars.TrustRatio("adam"), "inner_optimizer='adam'"),
        (lambda: tf_lars.TrustRatio(tf_lars.LARS()), "Received: inner_optimizer="),
        (
            lambda: tf_lars.TrustRatio(keras.optimizers.AdamW(weight_decay=0.1)),
            "`inner_optimizer.weight_decay` must be unset: set `weight_decay` on the "
            "TrustRatio (its weight decay sits inside the ratio). Received: "
            "inner_optimizer.weight_decay=0.1",
        ),
        (  # not the weight decay's reason (given for every argument before)
            lambda: tf_lars.TrustRatio(keras.optimizers.SGD(clipnorm=1.0)),
            "`inner_optimizer.clipnorm` must be unset: set `clipnorm` on the "
            "TrustRatio (it applies it around the whole step, the ratio included). "
            "Received: inner_optimizer.clipnorm=1.0",
        ),
        (  # Muon (Keras 3.10+) decays outside `update_step`: it was dropped
            lambda: tf_lars.TrustRatio(_DecaysOutsideItsStep()),
            "`inner_optimizer.adam_weight_decay` must be 0: set `weight_decay` on "
            "the TrustRatio (its weight decay sits inside the ratio). Received: "
            "inner_optimizer.adam_weight_decay=0.004",
        ),
        (  # it was accepted, and climbed the loss with T = 1
            lambda: tf_lars.TrustRatio(keras.optimizers.Adam(-0.1)),
            "`inner_optimizer.learning_rate` must be >= 0: the trust ratio is 1 at "
            "a rate of 0 and not defined below it. Received: inner_optimizer=Adam "
            "with learning_rate=-0.1",
        ),
        (
            lambda: tf_lars.TrustRatio(keras.optimizers.SGD(), weight_decay=-1.0),
            "weight_decay=-1.0",
        ),
        (
            lambda: tf_lars.TrustRatio(keras.optimizers.SGD(), trust_coefficient=0),
            "trust_coefficient=0",
        ),
        (
            lambda: tf_lars.TrustRatio(keras.optimizers.SGD(), epsilon=float("inf")),
            "epsilon=inf",
        ),
        (
            lambda: tf_lars.TrustRatio(keras.optimizers.SGD(), trust_clip=1),
            "trust_clip=1",
        ),
        (  # the inner optimizer's (was a TypeError from Keras's base class)
            lambda: tf_lars.TrustRatio(keras.optimizers.SGD(), learning_rate=0.1),
            "`learning_rate` is not supported by TrustRatio; set it on "
            "`inner_optimizer`. Received: learning_rate=0.1",
        ),
        (
            lambda: tf_lars.TrustRatio(
                keras.optimizers.SGD(), exclude_from_weight_decay=["[x"]
            ),
            "exclude_from_weight_decay=['[x']",
        ),
    ],
)
def test_bad_arguments_raise_naming_the_argument(make, fragment):
    with pytest.raises(ValueError) as error:
        make()
    assert fragment in str(error.value), str(error.value)


# Python lists (and NumPy arrays, tensors) as gradients, the compiled eager
# apply traced once: tests/contract_test.py,
# `test_tuples_and_python_lists_are_accepted[default-...]` (every row).


# Unknown config keys and numbers beyond float32, refused for every class
# (this file's tests of them are there): tests/contract_test.py,
# `test_from_config_refuses_an_unknown_key`,
# `test_numbers_beyond_float32_are_refused`,
# `test_an_inner_learning_rate_beyond_float32_is_refused`.


# TrustRatio around every optimizer Keras exports: tests/backends_rules_test.py
# (one test for every backend).


@pytest.mark.parametrize("compiled", ["eager", "jit"])
@pytest.mark.parametrize("which", ["sgd", "adam", "lamb"])
@pytest.mark.parametrize("scale", lars_ref.MAGNITUDES)
def test_extreme_magnitudes_give_finite_reference_steps(scale, which, compiled):
    # Weights of 1e19 and up used to become -inf (|w| overflowed), 1e-30 to
    # move by a whole step (|w| underflowed to 0, T = 1).
    weights = lars_ref.extreme_values(scale)
    grads = lars_ref.extreme_values(1.0, seed=1)
    if which == "sgd":
        optimizer = tf_lars.TrustRatio(keras.optimizers.SGD(0.1), weight_decay=0.01)
        want, ratios = ref.wrapped_run(
            weights, [grads], 0.1, lambda state, i, g, t: g, weight_decay=0.01
        )
    elif which == "adam":
        optimizer = tf_lars.TrustRatio(keras.optimizers.Adam(0.1))
        want, ratios = ref.wrapped_run(
            weights, [grads], 0.1, ref.keras_adam_direction()
        )
    else:
        optimizer = tf_lars.LAMB(learning_rate=0.1, weight_decay=0.01)
        want = ref.optax_lamb(weights, [grads], 0.1, weight_decay=0.01)
        ratios = None
    variables = lars_ref.apply_once(optimizer, weights, grads, compiled)
    for variable, expected in zip(variables, want, strict=True):
        assert np.all(np.isfinite(variable.numpy()))
        np.testing.assert_allclose(variable.numpy(), expected, rtol=2e-5)
    if ratios is not None:
        np.testing.assert_allclose(optimizer.trust_ratios.numpy(), ratios, rtol=2e-5)


@pytest.mark.parametrize(
    "wrap",
    [
        tf_lars.TrustRatio,
        lambda inner: tf_lars.GradientNoiseScale(inner, batch_size=4),
    ],
    ids=["TrustRatio", "GradientNoiseScale"],
)
def test_an_inner_optimizer_built_on_other_variables_is_refused(wrap):
    # Its first step failed in Keras's words (a `KeyError`, a `Cond.call()`
    # error); built on the very variables it steps, it steps on.
    mine = keras.Variable(np.ones(3, "float32"), name="mine")
    used = keras.optimizers.Adam(0.1)
    used.build([keras.Variable(np.ones(3, "float32"), name="elsewhere")])
    with pytest.raises(ValueError, match=re.escape(
        "`inner_optimizer` was built on other variables than the ones it is asked "
        "to step: give the wrapper a new one. Received: variable 'mine', unknown "
        "to Adam"
    )):  # fmt: skip
        wrap(used).build([mine])
    same = keras.optimizers.Adam(0.1)
    same.build([mine])
    wrapper = wrap(same)
    wrapper.build([mine])
    assert wrapper.built
