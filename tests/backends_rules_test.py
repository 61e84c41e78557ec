"""LARS, TrustRatio and LAMB on whichever Keras backend runs the tests.

Run under any `KERAS_BACKEND` (tensorflow, jax, torch): every check uses
`keras.ops` and the NumPy references (tests/lars_reference.py,
tests/lamb_reference.py), never a backend's own API, except the JAX-only
`stateless_apply` under `jax.jit` and the TensorFlow-only comparison of each
override of the TensorFlow subclasses (tf_lars/backend/tensorflow.py) with
the portable rule it overrides (tf_lars/lars.py, trust_ratio.py, lamb.py,
_trust.py): the norms' range, the compiled backends' recomputed LAMB norm,
TrustRatio around every Keras optimizer, and `model.fit` under torch.compile
within Dynamo's recompile limit. Each rule's reference values in
every mode and `model.fit`, with and without the "<1d>" exclusions, are the
contract table's (tests/contract_test.py, tests/optimizer_table.py).
"""

import contextlib
import functools
import inspect
import re

import keras
import numpy as np
import pytest
from keras import ops

import tf_lars
from tests import benchmark_scripts
from tests import lamb_reference as ref
from tests import lars_reference as lars_ref
from tf_lars import _internals, _trust, lamb, lars, trust_ratio
from tf_lars.backend import _compiled

BACKEND = keras.backend.backend()
STEPS = 3
ONLY_JAX = pytest.mark.skipif(BACKEND != "jax", reason="JAX only")
ONLY_TENSORFLOW = pytest.mark.skipif(
    BACKEND != "tensorflow", reason="TensorFlow's fast kernels: TensorFlow only"
)
# XLA compiles the steps on JAX and TensorFlow (PyTorch runs op by op).
ONLY_COMPILED = pytest.mark.skipif(
    BACKEND not in ("jax", "tensorflow"), reason="XLA: JAX and TensorFlow only"
)
if BACKEND == "tensorflow":  # the fast kernels' tests (ONLY_TENSORFLOW)
    import tensorflow as tf

    from tf_lars.backend import tensorflow as tf_backend

# ------------------------------------------------------------------ drivers

RNG = np.random.default_rng(7)
START = [
    RNG.normal(size=(4, 3)).astype("float32"),
    RNG.normal(size=3).astype("float32") * 0.1,
]
GRADS = [[RNG.normal(size=w.shape).astype("float32") for w in START] for _ in range(3)]


def run_apply(optimizer, grads):
    variables = [keras.Variable(w) for w in START]
    for step_grads in grads:
        optimizer.apply([ops.convert_to_tensor(g) for g in step_grads], variables)
    return [ops.convert_to_numpy(v) for v in variables], optimizer.trust_ratios


def run_stateless_jit(optimizer, grads, start=START):
    import jax

    variables = [keras.Variable(w) for w in start]
    optimizer.build(variables)
    trainable = [v.value for v in variables]
    state = [v.value for v in optimizer.variables]
    step = jax.jit(optimizer.stateless_apply)
    for step_grads in grads:
        trainable, state = step(
            state, [ops.convert_to_tensor(g) for g in step_grads], trainable
        )
    position = [id(v) for v in optimizer.variables].index(id(optimizer.trust_ratios))
    return [np.asarray(t) for t in trainable], state[position]


# Each rule's reference values through `apply` in every mode (JAX:
# `stateless_apply` under `jax.jit`) and through `model.fit` with and
# without `jit_compile`, the trust ratios beside the weights, with and
# without the "<1d>" exclusions: tests/contract_test.py,
# `test_apply_follows_the_numpy_reference` and
# `test_fit_follows_the_numpy_reference` (rows `lars_*`, `trust_ratio_*`,
# `lamb`), where this file's `test_every_mode_gives_the_reference_numbers`
# was. LAMB against optax.lamb on every backend: below, and
# tests/lamb_test.py, `test_row_optax_lamb`.


@pytest.mark.parametrize("scale", lars_ref.MAGNITUDES)
@pytest.mark.parametrize("which", ["lars", "lars_decayed", "lamb"])
def test_norms_keep_their_range(which, scale):
    # Entries of 1e19 and up overflow float32 squares, 1e-30 underflow them.
    weights = lars_ref.extreme_values(scale)
    grads = lars_ref.extreme_values(1.0, seed=1)
    want_norms = [np.linalg.norm(w.astype(np.float64)) for w in weights + grads]
    got = _trust.norms([ops.convert_to_tensor(x) for x in weights + grads])
    np.testing.assert_allclose(ops.convert_to_numpy(got), want_norms, rtol=1e-5)
    if which.startswith("lars"):
        # "decayed": the norm of g + wd w, a function (on JAX of barrier
        # values, `tf_lars.backend.jax.apart`) the range check's branch calls again.
        trust_ratio = "decayed" if which == "lars_decayed" else "paper"
        optimizer = tf_lars.LARS(
            0.1, momentum=0.0, weight_decay=0.01, trust_ratio=trust_ratio
        )
        want = []
        for w, g in zip(weights, grads, strict=True):
            w, _, _ = lars_ref.dense_step(
                w,
                g,
                0.0,
                0.1,
                momentum=0.0,
                weight_decay=0.01,
                trust_ratio=trust_ratio,
            )
            want.append(w)
    else:
        optimizer = tf_lars.LAMB(learning_rate=0.1, weight_decay=0.01)
        want = ref.optax_lamb(weights, [grads], 0.1, weight_decay=0.01)
    variables = [keras.Variable(w) for w in weights]
    optimizer.apply([ops.convert_to_tensor(g) for g in grads], variables)
    for variable, expected in zip(variables, want, strict=True):
        value = ops.convert_to_numpy(variable)
        assert np.all(np.isfinite(value))
        np.testing.assert_allclose(value, expected, rtol=2e-5)


@pytest.mark.skipif(BACKEND != "torch", reason="torch.compile: PyTorch only")
@pytest.mark.parametrize("scale", [1.0, *lars_ref.MAGNITUDES])
def test_torch_norms_compile_whole_and_keep_their_range(scale):
    # The PyTorch subclasses' range check is a `torch.cond`: the norms
    # compile with no graph break (`fullgraph=True` raises at one; Keras's
    # `ops.cond` is one), with both branches (1.0 takes the plain norms, the
    # others the rescaled ones), equal to float64 NumPy norms and to the
    # portable op-by-op norms.
    import torch

    from tf_lars.backend import torch as torch_backend

    tensors = [
        ops.convert_to_tensor(x)
        for x in lars_ref.extreme_values(scale) + lars_ref.extreme_values(1.0, seed=1)
    ]
    tensors += [ops.zeros((3,)), ops.zeros((64, 128))]  # |w| = 0: rescaled too
    want = [np.linalg.norm(ops.convert_to_numpy(x).astype(np.float64)) for x in tensors]
    compiled = torch.compile(
        lambda *xs: _trust.norms(list(xs), cond=torch_backend.cond), fullgraph=True
    )
    got = ops.convert_to_numpy(compiled(*tensors))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    portable = ops.convert_to_numpy(_trust.norms(tensors))
    np.testing.assert_allclose(got, portable, rtol=1e-6)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(lambda *xs: _trust.norms(list(xs)), fullgraph=True)(*tensors)


@pytest.mark.skipif(BACKEND != "torch", reason="torch.compile: PyTorch only")
def test_torch_compiled_fit_takes_the_rescaled_branch_as_op_by_op():
    # Keras's zero biases (|w| = 0) take the range check's rescaled branch
    # at the first step, inside torch.compile's `fit` (a constant made in
    # that branch once reached inductor's compiled branch as a non-tensor).
    def fit(jit_compile):
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((64,))]
            + [keras.layers.Dense(64, activation="relu") for _ in range(3)]
            + [keras.layers.Dense(10)]
        )  # the biases' norms stacked, the kernels' each alone: out of order
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(tf_lars.LARS(0.1), loss, jit_compile=jit_compile)
        x = np.random.default_rng(0).normal(size=(32, 64)).astype("float32")
        y = np.arange(32) % 10
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        return [ops.convert_to_numpy(w) for w in model.weights]

    for compiled, eager in zip(fit(True), fit(False), strict=True):
        np.testing.assert_allclose(compiled, eager, rtol=1e-5, atol=1e-7)


@ONLY_JAX
def test_apart_keeps_the_values_and_is_a_barrier(monkeypatch):
    import jax

    from tf_lars.backend import jax as jax_backend

    a = ops.convert_to_tensor([1.0, -2.0])
    b = ops.convert_to_tensor([[3.0]])
    got = jax_backend.apart([a, b])
    assert len(got) == 2
    np.testing.assert_array_equal(ops.convert_to_numpy(got[0]), [1.0, -2.0])
    np.testing.assert_array_equal(ops.convert_to_numpy(got[1]), [[3.0]])

    def traced_step(optimizer, shape=(4, 3)):
        variable = keras.Variable(np.ones(shape, "float32"))
        optimizer.build([variable])
        return str(
            jax.make_jaxpr(optimizer.stateless_apply)(
                [v.value for v in optimizer.variables],
                [ops.ones(shape)],
                [variable.value],
            )
        )

    def lars_step(decay):
        # LARS's decayed norm reads g and w through the barrier (weight
        # decay 0 has no g + wd w to keep apart).
        return traced_step(tf_lars.LARS(0.1, weight_decay=decay, trust_ratio="decayed"))

    assert "optimization_barrier" in lars_step(0.01)
    assert "optimization_barrier" not in lars_step(0.0)
    # LAMB's recomputed direction (sized as a large model) reads its scalars
    # through the barrier; a small direction is stacked for its norm and read
    # as stored (`LAMB.update_step`), so it has nothing to keep apart.
    monkeypatch.setattr(_compiled, "RECOMPUTED_FROM", 0)
    assert "optimization_barrier" in traced_step(tf_lars.LAMB(0.1), (64, 128))
    assert "optimization_barrier" not in traced_step(tf_lars.LAMB(0.1), (4, 3))


@ONLY_JAX
@pytest.mark.parametrize("scale", [1.0, *lars_ref.MAGNITUDES])
def test_jax_jit_lamb_norm_recomputes_the_stored_direction(scale, monkeypatch):
    # Under jax.jit LAMB's norm computes the direction again from m, v and
    # w (`LAMB.update_step`'s `for_norm`, also inside the range check's branch
    # at the extreme scales); eagerly it reads the stored direction. Both
    # give the reference's steps and the same ratios (sized as a large
    # model, where it recomputes).
    from tf_lars.backend import jax as jax_backend

    traced = jax_backend.LAMB._recomputes_for_norms  # before the spy replaces it
    monkeypatch.setattr(_compiled, "RECOMPUTED_FROM", 0)
    start = lars_ref.extreme_values(scale)
    grads = [lars_ref.extreme_values(1.0, seed=1 + i) for i in range(STEPS)]
    results, asked = [], {}
    for recompute in (True, False):
        optimizer = tf_lars.LAMB(learning_rate=0.1, weight_decay=0.01)

        def spy(direction, recompute=recompute):
            decided = traced(None, direction)
            asked.setdefault(recompute, []).append(decided)
            return decided and recompute

        monkeypatch.setattr(
            type(optimizer), "_recomputes_for_norms", lambda self, d, s=spy: s(d)
        )
        trainable, ratios = run_stateless_jit(optimizer, grads, start)
        results.append((trainable, np.asarray(ratios)))
    assert asked[True] and all(asked[True])  # traced: every variable recomputes
    (fast, fast_ratios), (stored, stored_ratios) = results
    np.testing.assert_allclose(fast_ratios, stored_ratios, rtol=1e-6)
    want = ref.optax_lamb(start, grads, 0.1, weight_decay=0.01)
    for a, b, expected in zip(fast, stored, want, strict=True):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, rtol=1e-6)
        np.testing.assert_allclose(a, expected, rtol=2e-5)


def _compiled_step_hlo(optimizer, variables, grads):
    """XLA's optimized HLO of one step: `stateless_apply` under `jax.jit`
    (JAX), `apply` under `tf.function(jit_compile=True)` (TensorFlow)."""
    optimizer.build(variables)
    if BACKEND == "jax":
        import jax

        lowered = jax.jit(optimizer.stateless_apply).lower(
            [v.value for v in optimizer.variables],
            grads,
            [v.value for v in variables],
        )
        return lowered.compile().as_text()
    import tensorflow as tf

    @tf.function(jit_compile=True)
    def step(grads):
        optimizer.apply(grads, variables)
        return optimizer.iterations

    return step.experimental_get_compiler_ir(grads)(stage="optimized_hlo")


# XLA compiles the steps on JAX and TensorFlow (PyTorch runs op by op).


@ONLY_COMPILED
@pytest.mark.parametrize(
    "make",
    [
        lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        lambda: tf_lars.LARS(0.1, weight_decay=0.01),
        lambda: tf_lars.LARS(0.1, weight_decay=0.01, trust_ratio="decayed"),
        lambda: tf_lars.LAMB(0.1, weight_decay=0.01),
        lambda: tf_lars.LAMB(0.1),
    ],
    ids=["sgd", "lars", "lars_decayed", "lamb", "lamb_no_decay"],
)
def test_compiled_step_writes_no_variable_sized_temporary(make, monkeypatch):
    # XLA's optimized program of the compiled step writes nothing as large
    # as a variable except the new weights and slots: no broadcast of a
    # scalar (LARS's decay, LAMB's epsilon and decay factor), no stored
    # direction, no `g + wd w` (docs/guides/backends.md, "What the JAX step
    # costs"). Two variables of one shape, as in a model, where XLA would
    # share a broadcast between them; LAMB sized as a large model (it
    # stores its direction in small ones: the test below).
    monkeypatch.setattr(_compiled, "RECOMPUTED_FROM", 0)
    hlo_traffic = benchmark_scripts.load("hlo_traffic")
    optimizer = make()
    variables = [keras.Variable(np.full((256, 64), 0.01, "float32")) for _ in "ab"]
    grads = [ops.full((256, 64), 1e-3) for _ in variables]
    text = _compiled_step_hlo(optimizer, variables, grads)
    size = 256 * 64 * 4
    assert hlo_traffic.temporaries(text, at_least=size) == []
    # And it does write every weight and slot (the count sees them).
    slots = sum(1 for v in optimizer.variables if tuple(v.shape) == (256, 64))
    assert hlo_traffic.traffic(text).written >= size * (len(variables) + slots)


@ONLY_COMPILED
@pytest.mark.parametrize("rows", [1024, 4096])
def test_lamb_recomputes_its_direction_only_in_large_models(rows):
    # Under XLA LAMB's norm computes the direction again only in models of
    # at least `_compiled.RECOMPUTED_FROM` parameters; in a smaller one it
    # stores the direction (a temporary as large as the variable), which measured
    # faster while the tensors stay in the CPU's caches.
    hlo_traffic = benchmark_scripts.load("hlo_traffic")
    optimizer = tf_lars.LAMB(0.1, weight_decay=0.01)
    variables = [keras.Variable(np.full((rows, 1024), 0.01, "float32"))]
    grads = [ops.full((rows, 1024), 1e-3)]
    text = _compiled_step_hlo(optimizer, variables, grads)
    large = rows * 1024 >= _compiled.RECOMPUTED_FROM
    assert large == (rows == 4096)
    stored = hlo_traffic.temporaries(text, at_least=rows * 1024 * 4)
    assert (stored == []) == large, stored


def test_lamb_recomputes_its_direction_only_where_a_compiler_sees_the_step():
    # Eager steps (PyTorch, eager JAX) read the stored direction; a traced
    # JAX step recomputes it (the TensorFlow subclass's: under XLA). The
    # portable LAMB never does: its norm reads `u` as computed.
    eager = ops.convert_to_tensor([1.0, 2.0])
    optimizer = tf_lars.LAMB(0.1)
    assert not hasattr(lamb.LAMB, "_recomputes_for_norms")
    assert lamb.LAMB._for_norm(optimizer, eager, *[None] * 6) is eager
    if BACKEND == "jax":
        import jax

        assert optimizer._recomputes_for_norms(eager) is False
        seen = []
        jax.jit(lambda x: seen.append(optimizer._recomputes_for_norms(x)) or x)(eager)
        assert seen == [True]


@pytest.mark.skipif(BACKEND != "torch", reason="Dynamo's recompilations: PyTorch only")
@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_torch_compile_never_hits_the_recompile_limit(name):
    # `model.fit` under torch.compile over 9 variables of 9 shapes, more
    # than Dynamo's limit of 8 recompilations: a write compiled apart for
    # each variable recompiled per shape and hit the limit (LAMB's
    # `scaled_step`; the norm groups' size test while `np.prod` broke the
    # graph in their loop); the norm groups also broke it with a NumPy
    # index.
    compile_bench = benchmark_scripts.load("compile_bench")
    result = compile_bench.measure_torch(name, 9, shapes=9)
    assert result["limit_warnings"] == 0, result
    assert result["recompiles"] == 0, result


def test_one_trust_ratio_rule():
    # T = eta |w| / (|u| + eps); 1 where |w| or |u| is 0, or where the
    # caller says the ratio is undefined.
    weight = ops.convert_to_tensor([3.0, 0.0, 2.0, 2.0])
    update = ops.convert_to_tensor([4.0, 1.0, 0.0, 1.0])
    got = _trust.trust_ratio(weight, update, 0.5, 1.0)
    np.testing.assert_allclose(ops.convert_to_numpy(got), [0.3, 1.0, 1.0, 0.5])
    defined = ops.convert_to_tensor([True, True, True, False])
    got = _trust.trust_ratio(weight, update, 0.5, 1.0, defined)
    np.testing.assert_allclose(ops.convert_to_numpy(got), [0.3, 0.0, 1.0, 1.0])


# ------------------------------------------- TrustRatio around every optimizer


def _keras_optimizer_classes():
    """Every optimizer class the installed Keras exports, found, not listed."""
    base = keras.optimizers.Optimizer
    return [
        obj
        for name in sorted(dir(keras.optimizers))
        if inspect.isclass(obj := getattr(keras.optimizers, name))
        and issubclass(obj, base)
        and obj not in (base, keras.optimizers.LossScaleOptimizer)
    ]


# Optimizers that take no per-variable step of their own and are refused.
_UNWRAPPABLE = ("MultiOptimizer",)
# Optimizers with a trust ratio of their own, refused: a second ratio on top
# is no published rule (docs/guides/large-batch.md).
_OWN_TRUST_RATIO = ("Lamb",)


def _make_keras_optimizer(cls):
    """`cls` with a fixed rate and every weight decay it has at 0."""
    if cls.__name__ == "MultiOptimizer":
        return cls(lambda variable: keras.optimizers.SGD())
    parameters = inspect.signature(cls.__init__).parameters
    arguments = {"learning_rate": 0.1}
    arguments.update({p: 0.0 for p in parameters if "weight_decay" in p})
    return cls(**arguments)


def _reference_dtype(cls):
    """float64 if `cls` steps a float64 variable, else float32."""
    variable = keras.Variable(np.ones((2, 2)), dtype="float64")
    try:
        _make_keras_optimizer(cls).apply([ops.ones((2, 2), "float64")], [variable])
    except Exception:  # each backend refuses float64 in its own way
        return "float32"
    return "float64"


def _float64_enabled():
    """JAX keeps float64 only with x64 on (else it is float32 silently)."""
    if BACKEND == "jax":
        import jax

        return jax.enable_x64(True)
    return contextlib.nullcontext()


def test_discovery_finds_keras_optimizers():
    names = {cls.__name__ for cls in _keras_optimizer_classes()}
    assert {"SGD", "Adam", "Nadam", "Lion", "Adafactor", "Ftrl"} <= names
    assert "LossScaleOptimizer" not in names and "Optimizer" not in names


@pytest.mark.parametrize(
    "cls",
    [c for c in _keras_optimizer_classes() if c.__name__ not in _UNWRAPPABLE],
    ids=lambda c: c.__name__,
)
def test_every_keras_optimizer_writes_its_variable_only_through_assign(cls):
    # TrustRatio reads a foreign optimizer's step by capturing its writes
    # (`trust_ratio.captured_step`), which holds only while Keras optimizers
    # write a variable through `assign`, `assign_add` and `assign_sub`: the
    # captured step leaves the variable as it was, and is the step an
    # identical optimizer takes, its slots updated the same way.
    rng = np.random.default_rng(4)
    start = rng.normal(size=(4, 3)).astype("float32")
    gradient = ops.convert_to_tensor(rng.normal(size=(4, 3)).astype("float32"))
    rate = ops.convert_to_tensor(0.1)
    variables = [keras.Variable(start), keras.Variable(start)]
    captured, plain = _make_keras_optimizer(cls), _make_keras_optimizer(cls)
    for optimizer, variable in zip((captured, plain), variables, strict=True):
        optimizer.build([variable])
    step = trust_ratio.captured_step(captured, gradient, variables[0], rate)
    type(plain).update_step(plain, gradient, variables[1], rate)
    np.testing.assert_array_equal(ops.convert_to_numpy(variables[0]), start)
    moved = start - ops.convert_to_numpy(variables[1])
    assert np.any(moved != 0)
    np.testing.assert_allclose(ops.convert_to_numpy(step), moved, rtol=1e-6, atol=1e-7)
    for a, b in zip(captured.variables, plain.variables, strict=True):
        np.testing.assert_array_equal(ops.convert_to_numpy(a), ops.convert_to_numpy(b))


@pytest.mark.parametrize("cls", _keras_optimizer_classes(), ids=lambda c: c.__name__)
def test_trust_ratio_around_every_keras_optimizer(cls):
    if cls.__name__ in _UNWRAPPABLE:
        with pytest.raises(ValueError, match=f"{cls.__name__} steps only in its"):
            tf_lars.TrustRatio(_make_keras_optimizer(cls))
        return
    if cls.__name__ in _OWN_TRUST_RATIO:
        with pytest.raises(ValueError, match="has its own trust ratio"):
            tf_lars.TrustRatio(_make_keras_optimizer(cls))
        return
    with _float64_enabled():
        _check_trust_ratio_around(cls)


def _check_trust_ratio_around(cls):
    # Each step: w <- w - T * s, s the inner optimizer's own step on a copy
    # (a second instance given the same weights), T = |w| / (|s| / lr) in
    # NumPy. Nadam used to give NaN from the first step. On torch, Keras
    # swaps in its own subclasses (SGD, Adam, ...) that step every variable
    # at once: the wrapper must still see their step. The copy runs in
    # float64 where the optimizer can: a difference of float32 weights loses
    # the digits of small steps (Adadelta's) that T then multiplies.
    # Tolerances: the float32 rounding of the wrapper's step (float64 copy;
    # the float32 Adam of JAX and torch rounds a little more than
    # TensorFlow's: 1.02e-5 measured on JAX),
    # or of the copy's step too (float32 copy: Muon computes in float32).
    rng = np.random.default_rng(3)
    start = rng.normal(size=(4, 3)).astype("float32")
    dtype = _reference_dtype(cls)
    if dtype == "float64":
        ratio_rtol = 1e-5 if BACKEND == "tensorflow" else 2e-5
    else:
        ratio_rtol = 1e-4
    weight = keras.Variable(start)
    shadow = keras.Variable(start.astype(dtype), dtype=dtype)
    optimizer = tf_lars.TrustRatio(_make_keras_optimizer(cls))
    reference = _make_keras_optimizer(cls)
    for _ in range(4):
        gradient = rng.normal(size=(4, 3)).astype("float32")
        before = ops.convert_to_numpy(shadow)
        reference.apply([ops.convert_to_tensor(gradient, dtype)], [shadow])
        step = (before - ops.convert_to_numpy(shadow)).astype("float64")
        ratio = np.linalg.norm(before) / (np.linalg.norm(step) / 0.1)
        want = before - ratio * step
        shadow.assign(want.astype(dtype))
        optimizer.apply([ops.convert_to_tensor(gradient)], [weight])
        value = ops.convert_to_numpy(weight)
        assert np.all(np.isfinite(value))
        np.testing.assert_allclose(value, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(
            ops.convert_to_numpy(optimizer.trust_ratios)[0], ratio, rtol=ratio_rtol
        )


# ------------------------------- TensorFlow: each fast kernel = portable rule

# (3, 3, 64, 64) folds under XLA and is one MatMul without; (5, 7) is
# below the size where a plain reduction is used.
KERNEL_SHAPES = [(3, 3, 64, 64), (5, 7), (4096 + 3,)]
TRACERS = ["eager", "graph", "xla"]


def _traced(tracer, function):
    if tracer == "eager":
        return function
    return tf.function(function, jit_compile=tracer == "xla")


@ONLY_TENSORFLOW
@pytest.mark.parametrize("tracer", TRACERS)
@pytest.mark.parametrize("scale", [1.0, *lars_ref.MAGNITUDES])
def test_tf_norms_equal_the_portable_norms(scale, tracer):
    rng = np.random.default_rng(5)
    tensors = [
        tf.constant(rng.uniform(-1, 1, size=s).astype("float32") * scale / 100)
        for s in KERNEL_SHAPES
    ] + [tf.zeros((3,))]
    fast = _traced(tracer, tf_backend.norms)(tensors)
    portable = _traced(tracer, _trust.norms)(tensors)
    want = [np.linalg.norm(t.numpy().astype(np.float64)) for t in tensors]
    np.testing.assert_allclose(fast.numpy(), want, rtol=2e-6)
    np.testing.assert_allclose(fast.numpy(), portable.numpy(), rtol=2e-6)


@ONLY_TENSORFLOW
@pytest.mark.parametrize("tracer", TRACERS)
def test_tf_entries_equal_the_portable_entries(tracer):
    # Under XLA the fast path reads the entry of a small tensor at a
    # position that is a runtime input of the program (the compiled
    # updates of small variables of one shape are then one kernel), and
    # of a large one at its fixed offset; the values are the same.
    vector = tf.constant([0.5, -2.0, 3.25, 1e-30, 7.0], "float32")
    tensors = [tf.zeros(s) for s in [(4,), (64, 128), (3, 3), (4,)]]

    def both(values):
        return (
            tf.stack(tf_backend.entries(values, tensors)),
            tf.stack(_trust.entries(values, tensors)),
        )

    fast, portable = _traced(tracer, both)(vector)
    np.testing.assert_array_equal(fast.numpy(), vector.numpy()[:4])
    np.testing.assert_array_equal(fast.numpy(), portable.numpy())


def _slot_pair():
    """Two (variable, slot) pairs holding the same values, and an optimizer."""
    rng = np.random.default_rng(6)
    start = rng.normal(size=(8, 5)).astype("float32")
    slot = rng.normal(size=(8, 5)).astype("float32")
    optimizer = tf_lars.LARS()
    variables = [keras.Variable(start) for _ in range(2)]
    slots = [keras.Variable(slot) for _ in range(2)]
    gradient = tf.constant(rng.normal(size=(8, 5)).astype("float32"))
    return optimizer, variables, slots, gradient


@ONLY_TENSORFLOW
@pytest.mark.parametrize("tracer", TRACERS)
@pytest.mark.parametrize("nesterov", [False, True])
def test_tf_momentum_step_equals_the_portable_step(nesterov, tracer):
    optimizer, variables, slots, gradient = _slot_pair()
    rate = tf.constant(0.3)
    optimizer.nesterov = nesterov
    assert type(optimizer) is tf_backend.LARS
    for rule, variable, slot in zip(
        (tf_backend.LARS, lars.LARS), variables, slots, strict=True
    ):
        step = functools.partial(
            rule._momentum_step, optimizer, variable, slot, gradient, rate
        )
        _traced(tracer, step)()
    np.testing.assert_allclose(slots[0].numpy(), slots[1].numpy(), rtol=1e-6)
    np.testing.assert_allclose(
        variables[0].numpy(), variables[1].numpy(), rtol=1e-6, atol=1e-7
    )


@ONLY_TENSORFLOW
@pytest.mark.parametrize("tracer", TRACERS)
def test_tf_scaled_step_equals_the_portable_step(tracer):
    optimizer, variables, _, step = _slot_pair()
    optimizer = tf_lars.TrustRatio(keras.optimizers.SGD())
    assert type(optimizer) is tf_backend.TrustRatio
    rules = (tf_backend.TrustRatio, trust_ratio.TrustRatio)
    for rule, variable in zip(rules, variables, strict=True):
        write = functools.partial(
            rule._scaled_step, optimizer, variable, tf.constant(0.7), step
        )
        _traced(tracer, write)()
    np.testing.assert_allclose(
        variables[0].numpy(), variables[1].numpy(), rtol=1e-6, atol=1e-7
    )


def _lamb_steps(rule, start, gradients, decay):
    """Two of LAMB's steps `lr * u` (as `rule.update_step` hands them to
    `_take_step`: `scale * direction`) and Adam's slots after."""
    optimizer = tf_lars.LAMB(learning_rate=0.01, weight_decay=decay)
    variable = keras.Variable(start)
    optimizer.build([variable])
    taken = []

    def take_step(index, target, scale, direction, *rest):
        taken.append(scale * direction)

    optimizer._take_step = take_step

    @tf.function
    def step(gradient):
        taken.clear()
        rule.update_step(optimizer, gradient, variable, tf.constant(0.01))
        optimizer.inner_optimizer.iterations.assign_add(1)
        return taken[0]

    steps = [step(gradient).numpy() for gradient in gradients]
    # The fast path took the fused kernel (its scratch buffer exists).
    fused = len(tf_backend.direction_buffers(optimizer))
    assert fused == (1 if rule is tf_backend.LAMB else 0)
    return steps + [v.numpy() for v in optimizer.inner_optimizer.variables[2:]]


@ONLY_TENSORFLOW
@pytest.mark.parametrize("decay", [0.0, 0.01])
def test_tf_fused_lamb_direction_equals_the_portable_direction(decay):
    # Graph without XLA, where LAMB takes the fused kernel.
    rng = np.random.default_rng(8)
    start = rng.normal(size=(6, 4)).astype("float32")
    gradients = [
        tf.constant(rng.normal(size=(6, 4)).astype("float32")) for _ in range(2)
    ]
    fast = _lamb_steps(tf_backend.LAMB, start, gradients, decay)
    portable = _lamb_steps(lamb.LAMB, start, gradients, decay)
    assert len(fast) == 4  # two steps, m and v
    # 2e-5: the kernel rounds `1 - beta_2` from float32 0.999 (1.3e-5 off
    # 0.001), the portable rule from the Python float.
    for a, b in zip(fast, portable, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-9)


def _xla_apply_steps(optimizer, start, grads):
    variables = [keras.Variable(w) for w in start]

    @tf.function(jit_compile=True)
    def step(step_grads):
        optimizer.apply(step_grads, variables)

    for step_grads in grads:
        step(step_grads)
    return [v.numpy() for v in variables], optimizer.trust_ratios.numpy()


@ONLY_TENSORFLOW
@pytest.mark.parametrize("scale", [1.0, *lars_ref.MAGNITUDES])
def test_tf_xla_lamb_norm_recomputes_the_stored_direction(scale, monkeypatch):
    # Under XLA, LAMB's norm computes the direction again from m, v and
    # w (`LAMB.update_step`'s `for_norm`, also inside the rescaling branch
    # at the extreme scales): the same steps and ratios as a LAMB whose
    # norm reads the stored direction, and as the reference (sized as a
    # large model, where it recomputes).
    monkeypatch.setattr(_compiled, "RECOMPUTED_FROM", 0)
    # (64, 128) folds under XLA; norms <= scale, so they are representable.
    start = lars_ref.extreme_values(scale)
    grads = [
        [tf.constant(g) for g in lars_ref.extreme_values(1.0, seed=1 + i)]
        for i in range(STEPS)
    ]
    results, recomputed = [], []
    for recompute in (True, False):
        optimizer = tf_lars.LAMB(learning_rate=0.1, weight_decay=0.01)
        if recompute:

            def spy(self, direction):
                recomputed.append(_internals.in_xla_context())
                return recomputed[-1]

            monkeypatch.setattr(tf_backend.LAMB, "_recomputes_for_norms", spy)
        else:
            monkeypatch.setattr(
                tf_backend.LAMB, "_recomputes_for_norms", lambda self, d: False
            )
        results.append(_xla_apply_steps(optimizer, start, grads))
    assert recomputed and all(recomputed)  # every variable, every trace
    (fast, fast_ratios), (stored, stored_ratios) = results
    np.testing.assert_allclose(fast_ratios, stored_ratios, rtol=1e-6)
    want = ref.optax_lamb(
        start, [[g.numpy() for g in gs] for gs in grads], 0.1, weight_decay=0.01
    )
    for a, b, expected in zip(fast, stored, want, strict=True):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, rtol=1e-6)
        np.testing.assert_allclose(a, expected, rtol=2e-5)


@ONLY_TENSORFLOW
def test_tf_compiled_apply_equals_the_portable_apply():
    got = []
    for jit_compile in (True, False):
        optimizer = tf_lars.LARS(
            learning_rate=0.5,
            momentum=0.9,
            trust_coefficient=0.02,
            weight_decay=0.01,
            nesterov=True,
            exclude_from_weight_decay=[tf_lars.lars.ALL_1D],
        )
        optimizer.jit_compile = jit_compile
        got.append(run_apply(optimizer, GRADS)[0])
    for a, b in zip(*got, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@ONLY_TENSORFLOW
@pytest.mark.parametrize("change", ["schedule", "trust_coefficient"])
def test_tf_compiled_apply_reads_settings_changed_between_steps(change):
    # The compiled eager apply kept the rate and the hyperparameters of its
    # first trace: a schedule set after step 1, or a new trust coefficient,
    # was ignored where op by op honoured it (0.2.x).
    schedule = keras.optimizers.schedules.ExponentialDecay(1.0, 1, 0.01)
    moved = []
    for jit_compile in (True, False):
        steps = []
        for make in (
            lambda: tf_lars.LARS(0.1, momentum=0.0),
            lambda: tf_lars.TrustRatio(keras.optimizers.SGD(0.1)),
        ):
            optimizer = make()
            optimizer.jit_compile = jit_compile
            variable = keras.Variable(np.ones(3, "float32"))
            optimizer.apply([ops.ones(3)], [variable])
            before = ops.convert_to_numpy(variable)
            if change == "schedule":
                optimizer.learning_rate = schedule  # 0.01 at step 1
            else:
                optimizer.trust_coefficient *= 10
            optimizer.apply([ops.ones(3)], [variable])
            steps.append(before - ops.convert_to_numpy(variable))
        moved.append(steps)
    np.testing.assert_allclose(moved[0], moved[1], rtol=1e-6)
    # LARS's second step: rate x eta |w| / |g|, with |w| / |g| = 0.9999.
    rate, eta = (0.01, 1e-3) if change == "schedule" else (0.1, 1e-2)
    # (float32 differences of weights near 1: 6e-8 absolute.)
    np.testing.assert_allclose(moved[0][0], [rate * eta * 0.9999] * 3, atol=1e-7)


@ONLY_JAX
def test_jax_bench_fit_ratio_is_the_median_of_paired_rounds(monkeypatch, capsys):
    # benchmarks/jax_bench.py's fit rows with known rates in place of
    # the timed epochs: every model fits one epoch per round, in turn,
    # and a row's ratio is the median of the rounds' ratios.
    jax_bench = benchmark_scripts.load("jax_bench")
    rates = {
        "SGD(momentum)": [100.0, 200.0, 100.0],
        "LARS": [90.0, 220.0, 95.0],  # 0.90, 1.10, 0.95
        "Adam": [100.0, 50.0, 200.0],
        "LAMB (wd 0.01)": [80.0, 45.0, 200.0],  # 0.80, 0.90, 1.00
        "LAMB (wd 0)": [70.0, 50.0, 120.0],  # 0.70, 1.00, 0.60
        "keras Lamb": [100.0, 40.0, 190.0],  # 1.00, 0.80, 0.95
    }
    pending = {name: list(values) for name, values in rates.items()}
    order = []
    kinds = []

    def rate(model, x, y, kind):
        order.append(model)
        kinds.append(kind)
        return pending[model].pop(0)

    monkeypatch.setattr(
        jax_bench,
        "_fit_optimizers",
        lambda: {name: (lambda name=name: name) for name in rates},
    )
    monkeypatch.setattr(jax_bench, "_fit_model", lambda make, x, y, kind: make())
    monkeypatch.setattr(jax_bench, "_fit_rate", rate)
    table = jax_bench.fit_rows(steps=1, rounds=3)
    assert order == list(rates) * 3
    assert set(kinds) == {"mlp"}
    expected = {
        "LARS vs SGD(momentum)": (100.0, 95.0, [0.90, 1.10, 0.95]),
        "LAMB (wd 0.01) vs Adam": (100.0, 80.0, [0.80, 0.90, 1.00]),
        "LAMB (wd 0) vs Adam": (100.0, 70.0, [0.70, 1.00, 0.60]),
        "keras Lamb vs Adam": (100.0, 100.0, [1.00, 0.80, 0.95]),
    }
    assert list(table) == list(expected)
    for row, (base, ours, ratios) in expected.items():
        assert table[row][:2] == (base, ours)
        np.testing.assert_allclose(table[row][2], ratios, rtol=1e-12)
    out = capsys.readouterr().out
    # Rates print with one decimal below 100 samples/s.
    for printed in [
        ("LARS vs SGD(momentum)", "100", "95.0", "0.95", "0.90-1.10"),
        ("LAMB (wd 0.01) vs Adam", "100", "80.0", "0.90", "0.80-1.00"),
        ("LAMB (wd 0) vs Adam", "100", "70.0", "0.70", "0.60-1.00"),
        ("keras Lamb vs Adam", "100", "100", "0.95", "0.80-1.00"),
    ]:
        pattern = r"\s+".join(re.escape(field) for field in printed)
        assert re.search(pattern + r"\n", out), (printed, out)


@ONLY_JAX
def test_jax_bench_fit_rows_on_resnet50(monkeypatch, capsys):
    # `--fit-model resnet50`: benchmarks/bench.py's fit model and data
    # reach every compiled model and every timed epoch.
    jax_bench = benchmark_scripts.load("jax_bench")
    seen = []

    def model(make, x, y, kind):
        seen.append(("compile", make(), x.shape, y.dtype.kind, kind))
        return make()

    def rate(model, x, y, kind):
        seen.append(("fit", model, len(x), kind))
        return 10.0

    monkeypatch.setattr(jax_bench, "_fit_model", model)
    monkeypatch.setattr(jax_bench, "_fit_rate", rate)
    monkeypatch.setattr(
        jax_bench,
        "_fit_optimizers",
        lambda: {"SGD(momentum)": lambda: "SGD(momentum)", "LARS": lambda: "LARS"},
    )
    monkeypatch.setattr(
        jax_bench, "FIT_PAIRS", {"LARS vs SGD(momentum)": ("SGD(momentum)", "LARS")}
    )
    jax_bench.fit_rows(steps=2, rounds=1, kind="resnet50")
    assert seen == [
        ("compile", "SGD(momentum)", (64, 64, 64, 3), "i", "resnet50"),
        ("compile", "LARS", (64, 64, 64, 3), "i", "resnet50"),
        ("fit", "SGD(momentum)", 64, "resnet50"),
        ("fit", "LARS", 64, "resnet50"),
    ]
    out = capsys.readouterr().out
    assert "ResNet50(weights=None) at 64x64, 10 classes, batch 32" in out
    assert re.search(
        r"LARS vs SGD\(momentum\)\s+10\.0\s+10\.0\s+1\.00\s+1\.00-1\.00", out
    )


@ONLY_JAX
def test_jax_bench_resnet50_fit_network_is_bench_s_model():
    jax_bench = benchmark_scripts.load("jax_bench")
    x, y = jax_bench._fit_data("resnet50", steps=1)
    assert x.shape == (32, 64, 64, 3) and x.dtype == np.float32
    assert y.shape == (32,) and set(np.unique(y)) <= set(range(10))
    network, loss = jax_bench._fit_network("resnet50")
    assert network.name == "resnet50"
    assert tuple(network.input_shape) == (None, 64, 64, 3)
    assert tuple(network.output_shape) == (None, 10)
    assert network.layers[-1].activation is keras.activations.linear
    assert isinstance(loss, keras.losses.SparseCategoricalCrossentropy)
    assert loss.get_config()["from_logits"] is True


@ONLY_JAX
@pytest.mark.parametrize(
    "argv", [["--fit-rounds", "0"], ["--fit-steps", "0"], ["--repeats", "-1"]]
)
def test_jax_bench_refuses_counts_below_one(argv, capsys):
    jax_bench = benchmark_scripts.load("jax_bench")
    with pytest.raises(SystemExit) as stopped:
        jax_bench.main(["--only", "fit", *argv])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "--repeats, --fit-steps and --fit-rounds must be >= 1" in err
    assert " ".join(argv) in err


@ONLY_JAX
def test_jax_bench_fit_model_trains_under_jit():
    # The fit part's model and timed epoch, for real: LAMB under the JAX
    # trainer's compiled step, a warm-up epoch and a timed one.
    jax_bench = benchmark_scripts.load("jax_bench")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 512)).astype("float32")
    y = rng.normal(size=(512, 10)).astype("float32")
    model = jax_bench._fit_model(lambda: tf_lars.LAMB(1e-3, weight_decay=0.01), x, y)
    assert int(model.optimizer.iterations) == 2  # 512 samples, batch 256
    assert jax_bench._fit_rate(model, x, y) > 0
    assert int(model.optimizer.iterations) == 4
    ratios = np.asarray(model.optimizer.trust_ratios)
    assert np.all(np.isfinite(ratios)) and np.all(ratios > 0)


@ONLY_JAX
def test_jax_bench_builds_its_step_rows(monkeypatch):
    # benchmarks/jax_bench.py's step and traffic rows, built (not timed):
    # each row's optimizer as the bench makes it; the "stored" LAMB row's
    # norm reads the stored direction even where a compiler sees the step.
    import types

    jax_bench = benchmark_scripts.load("jax_bench")
    monkeypatch.setattr(jax_bench, "_keras_step", lambda optimizer, shapes: optimizer)
    monkeypatch.setattr(jax_bench, "_optax_step", lambda transform, shapes: transform)
    stub = types.SimpleNamespace(
        lars=lambda *a, **k: "lars", lamb=lambda *a, **k: "lamb"
    )
    monkeypatch.setattr(jax_bench, "_optax", lambda: stub)
    lars_rows = jax_bench.lars_steps([(2, 2)])
    lamb_rows = jax_bench.lamb_steps([(2, 2)])
    assert (
        lars_rows["optax lars"] == "lars"
        and lamb_rows["optax lamb (wd 0.01)"] == "lamb"
    )
    import jax

    traced = []
    for name in ("tf_lars LAMB (wd 0.01)", "tf_lars LAMB (wd 0.01, stored)"):
        optimizer = lamb_rows[name]
        jax.jit(lambda x, o=optimizer: traced.append(o._recomputes_for_norms(x)) or x)(
            ops.ones((2,))
        )
    assert traced == [True, False]
