"""What every tf_lars optimizer owes, on the current Keras backend.

One parametrized suite over the table of optimizers under test
(tests/optimizer_table.py): the NumPy reference through `apply` with
and without compilation (TensorFlow: op by op, the optimizer's compiled
eager apply, `tf.function`, `tf.function(jit_compile=True)`; JAX: `apply`,
`stateless_apply`, `stateless_apply` under `jax.jit`; PyTorch: `apply`),
through `model.fit(jit_compile=...)` (and LARS's momentum slots and trust
ratios beside the weights), half-precision variables, the config and
`.keras` round trips, default names, tuples, Python lists and NumPy arrays
for gradients (the compiled eager apply traced once), writes through the
optimizer's `assign*`, sparse gradients and `tf.train.Checkpoint`
(TensorFlow), and, for every class, the refusal of an unknown config key
and of numbers beyond float32. Run it under each backend:

    KERAS_BACKEND=jax python -m pytest tests/contract_test.py
"""

import inspect
import json
from unittest import mock

import keras
import numpy as np
import pytest

import tf_lars
from tests import harness
from tests import optimizer_table as under_test
from tf_lars.lars import ALL_1D

BACKEND = keras.backend.backend()
ROWS = under_test.under_test(BACKEND)
SHAPES = [(), (5,), (4, 3), (2, 3, 2, 3)]
STEPS = 4

#: How `apply` is run, per backend (see the module docstring).
MODES = {
    "tensorflow": ["eager", "default", "function", "jit"],
    "jax": ["eager", "stateless", "jit"],
    "torch": ["eager"],
}[BACKEND]
#: (dtype, mode) of the reference test: float32 in every mode; float64 op
#: by op and compiled, on TensorFlow (JAX keeps float64 off unless asked,
#: `jax_enable_x64`).
REFERENCE_CASES = [("float32", mode) for mode in MODES]
if BACKEND == "tensorflow":  # torch's Adam rounds float64 steps to ~3e-7
    REFERENCE_CASES += [("float64", "eager"), ("float64", "default")]
#: `model.fit(jit_compile=...)` for every row; on torch `jit_compile=True` is
#: `torch.compile` (about a minute a model on 2 cores), so one row per
#: optimizer there.
TORCH_COMPILED_ROWS = ("lars_paper", "lamb", "trust_ratio_adam", "loss_scale_fixed_sgd")
FIT_CASES = [
    (name, jit_compile)
    for name in sorted(ROWS)
    for jit_compile in (False, True)
    if not (jit_compile and BACKEND == "torch" and name not in TORCH_COMPILED_ROWS)
]
TOLERANCE = {
    "float32": dict(rtol=2e-5, atol=2e-6),
    # float64: the rules hold a few constants (Keras's learning rate, some
    # betas) in float32; a row that holds none says its own, tighter one
    # (`UnderTest.tolerance`), and the per-optimizer files hold theirs.
    "float64": dict(rtol=1e-8, atol=1e-8),
    # One rounding per step of an 8- or 11-bit significand, values of order 1.
    "float16": dict(rtol=8e-3, atol=8e-3),
    "bfloat16": dict(rtol=6e-2, atol=6e-2),
}


def _problem(dtype, seed=0, shapes=SHAPES, steps=STEPS, scale=0.1):
    return harness.random_problem(dtype, shapes, steps, seed, scale)


def _run(row, weights, grads, dtype, mode):
    optimizer = row.make()
    variables = [keras.Variable(w, dtype=dtype) for w in weights]
    step = harness.step_function(optimizer, variables, mode)
    for step_grads in grads:
        scaled = [np.asarray(g, np.float64) * row.gradient_scale for g in step_grads]
        step([harness.tensor(g, dtype) for g in scaled])
    return optimizer, variables


def _reference(row, weights, grads, sparse=False):
    step = row.reference(weights, sparse=sparse)
    for step_grads in grads:
        expected = step([np.asarray(g, np.float64) for g in step_grads])
    return expected


def _assert_close(variables, expected, dtype, what="", row=None):
    tolerance = (row.tolerance if row else {}).get(dtype, TOLERANCE[dtype])
    for index, (variable, want) in enumerate(zip(variables, expected, strict=True)):
        actual = keras.ops.convert_to_numpy(keras.ops.cast(variable, "float64"))
        np.testing.assert_allclose(
            actual, want, **tolerance, err_msg=f"{what} variable {index}"
        )


# ------------------------------------------------------------ the references
@pytest.mark.parametrize("dtype, mode", REFERENCE_CASES)
@pytest.mark.parametrize("name", sorted(ROWS))
def test_apply_follows_the_numpy_reference(name, dtype, mode):
    row = ROWS[name]
    weights, grads = _problem(dtype)
    optimizer, variables = _run(row, weights, grads, dtype, mode)
    reference = row.reference(weights)
    for step_grads in grads:
        expected = reference([np.asarray(g, np.float64) for g in step_grads])
    _assert_close(variables, expected, dtype, mode, row)
    for variable in variables:
        assert keras.backend.standardize_dtype(variable.dtype) == dtype
    assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == STEPS
    # LARS's momentum slots, and every adaptive optimizer's trust ratios of
    # the last step.
    for lars in under_test.inner_chain(optimizer):
        if isinstance(lars, tf_lars.LARS) and lars.momentum:
            what = f"{mode} momentum"
            _assert_close(lars.momentums, reference.velocities, dtype, what, row)
    _assert_ratios(optimizer, reference)


#: Where a variable of no entries went through the norms op by op (JAX also
#: compiled): TensorFlow's compiled eager apply and XLA took it already.
ZERO_SIZE_MODES = {"jax": ["eager", "jit"]}.get(BACKEND, ["eager"])
#: Keras's own RMSprop fails on TensorFlow there (`BiasAdd`: "Biases must be 1D").
ZERO_SIZE_ROWS = [
    name
    for name in sorted(ROWS)
    if not (BACKEND == "tensorflow" and name == "trust_ratio_rmsprop")
]


@pytest.mark.parametrize("mode", ZERO_SIZE_MODES)
@pytest.mark.parametrize("name", ZERO_SIZE_ROWS)
def test_a_variable_of_no_entries_steps_with_the_others(name, mode):
    # A layer pruned to 0 units: its norm's range check took the max of no
    # entries and failed (TensorFlow op by op, JAX and PyTorch; 0.2.x).
    row = ROWS[name]
    shapes = [(3,), (0, 4), (2, 3)]
    weights, grads = _problem("float32", seed=3, shapes=shapes, steps=2)
    _, variables = _run(row, weights, grads, "float32", mode)
    _assert_close(variables, _reference(row, weights, grads), "float32", mode, row)


def _assert_ratios(optimizer, reference):
    """The trust ratios each adaptive optimizer in the chain recorded equal
    the reference's of the last step (rows with `EXCLUDE`: 1 for the
    excluded variables)."""
    adaptive = [
        o for o in under_test.inner_chain(optimizer) if hasattr(o, "trust_ratios")
    ]
    for one in adaptive:
        ratios = keras.ops.convert_to_numpy(one.trust_ratios)
        np.testing.assert_allclose(ratios, reference.ratios, rtol=1e-5, atol=0)


#: Keras's Adam holds beta_2 = 0.999 in bfloat16 as 1 (no bias correction),
#: so TrustRatio around it is not a bfloat16 optimizer (LAMB is).
HALF_CASES = [
    (name, dtype)
    for name in sorted(ROWS)
    for dtype in ("float16", "bfloat16")
    if (name, dtype) != ("trust_ratio_adam", "bfloat16")
]


@pytest.mark.parametrize("name, dtype", HALF_CASES)
def test_half_precision_variables_follow_the_reference(name, dtype):
    row = ROWS[name]
    # Gradients of order 1: Adam's second moment of a 0.1 gradient is near
    # float16's smallest normal number.
    weights, grads = _problem("float32", seed=5, steps=1, scale=1.0)
    # The reference starts from the half-precision values the variables hold.
    held = [
        keras.ops.convert_to_numpy(keras.ops.cast(harness.tensor(w, dtype), "float32"))
        for w in weights
    ]
    rounded = [
        [
            keras.ops.convert_to_numpy(
                keras.ops.cast(harness.tensor(g, dtype), "float32")
            )
            for g in step_grads
        ]
        for step_grads in grads
    ]
    _, variables = _run(row, held, rounded, dtype, MODES[-1])
    for variable in variables:
        assert keras.backend.standardize_dtype(variable.dtype) == dtype
    _assert_close(variables, _reference(row, held, rounded), dtype)


def _regression_data(samples=32):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, 3)).astype("float32")
    y = np.stack([x.sum(1), x[:, 0] - x[:, 2]], axis=1).astype("float32")
    return x, y


def _linear_model():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])


def _mse_gradients(kernel, bias, x, y):
    """Gradients of Keras's "mse" (mean over all entries) of `x @ kernel + bias`."""
    residual = 2 * (x @ kernel + bias - y) / y.size
    return [x.T @ residual, residual.sum(0)]


@pytest.mark.parametrize("name, jit_compile", FIT_CASES)
def test_fit_follows_the_numpy_reference(name, jit_compile):
    row = ROWS[name]
    model = _linear_model()
    model.compile(optimizer=row.make(), loss="mse", jit_compile=jit_compile)
    start = [np.asarray(w, np.float64) for w in model.get_weights()]
    x, y = _regression_data()
    history = model.fit(x, y, epochs=1, batch_size=8, verbose=0, shuffle=False)
    step = row.reference(start)
    weights = start
    for batch in range(4):
        rows = slice(8 * batch, 8 * batch + 8)
        x64, y64 = x[rows].astype(np.float64), y[rows].astype(np.float64)
        weights = step(_mse_gradients(*weights, x64, y64))
    _assert_close(model.weights, weights, "float32", f"jit_compile={jit_compile}")
    _assert_ratios(model.optimizer, step)
    assert np.isfinite(history.history["loss"][-1])


# ---------------------------------------------------------- serialization
def _configured():
    """Per class, the constructor arguments, each set away from its default."""
    lars = dict(
        learning_rate=0.25,
        momentum=0.8,
        weight_decay=1e-4,
        trust_coefficient=0.02,
        epsilon=1e-6,
        nesterov=True,
        classic_momentum=False,
        trust_ratio="decayed",
        decay_in_gradient=False,
        trust_clip=True,
        exclude_from_weight_decay=["bias"],
        exclude_from_layer_adaptation=[ALL_1D],
        clipnorm=1.0,
        name="my_lars",
    )
    configured = {
        "lars": (tf_lars.LARS, lambda: lars),
        "lamb": (
            tf_lars.LAMB,
            lambda: dict(
                learning_rate=2.0**-7,  # exact in the float32 variable
                beta_1=0.8,
                beta_2=0.99,
                epsilon=1e-3,
                weight_decay=0.1,
                trust_clip=True,
                exclude_from_weight_decay=["bias"],
                exclude_from_layer_adaptation=[],
                clipnorm=1.0,
                name="my_lamb",
            ),
        ),
        "trust_ratio_adam": (
            tf_lars.TrustRatio,
            lambda: dict(
                inner_optimizer=keras.optimizers.Adam(0.01),
                weight_decay=0.1,
                trust_coefficient=0.5,
                epsilon=1e-3,
                trust_clip=True,
                exclude_from_weight_decay=["bias"],
                exclude_from_layer_adaptation=[],
                name="my_ratio",
            ),
        ),
    }
    inners = {
        "sgd": lambda: keras.optimizers.SGD(0.3, momentum=0.7, nesterov=True),
        "adam": lambda: keras.optimizers.Adam(1e-3, beta_1=0.8, clipnorm=1.5),
        "lars": lambda: tf_lars.LARS(**lars),
    }
    for inner_name, make in inners.items():
        configured[f"loss_scale_{inner_name}"] = (
            tf_lars.LossScaleOptimizer,
            lambda make=make: dict(
                inner_optimizer=make(),
                initial_scale=128.0,
                dynamic=False,
                dynamic_growth_steps=7,
                name="ls",
            ),
        )
    if BACKEND == "tensorflow":
        for inner_name, make in under_test.AGN_INNERS.items():
            configured[f"agn_{inner_name}"] = (
                tf_lars.AGN,
                lambda make=make: dict(
                    inner_optimizer=make(), communication_period=7, name="my_agn"
                ),
            )
    return configured


CONFIGURED = _configured()


def _check_round_trip(optimizer, arguments):
    cls = type(optimizer)
    config = optimizer.get_config()
    parameters = set(inspect.signature(cls.__init__).parameters)
    assert set(config) == parameters - {"self", "kwargs"}
    json.dumps(config)  # A .keras file stores it as JSON.
    restored = cls.from_config(config)
    assert type(restored) is cls and restored.get_config() == config
    serialized = keras.saving.serialize_keras_object(optimizer)
    assert serialized["registered_name"] == f"tf_lars>{cls.__name__}"
    assert keras.saving.get_registered_name(cls) == f"tf_lars>{cls.__name__}"
    again = keras.saving.deserialize_keras_object(json.loads(json.dumps(serialized)))
    assert type(again) is cls and again.get_config() == config
    chains = under_test.inner_chain(optimizer), under_test.inner_chain(again)
    assert [type(o) for o in chains[0]] == [type(o) for o in chains[1]]
    for argument, value in arguments.items():
        if isinstance(value, keras.optimizers.Optimizer):
            expected = keras.saving.serialize_keras_object(value)
            if expected["module"].startswith("keras.src.backend.torch."):
                # Recorded as Keras's public class, so that the file loads
                # without PyTorch (_internals.portable_optimizer_config).
                expected = {
                    **expected,
                    "module": "keras.optimizers",
                    "registered_name": None,
                }
            assert config[argument] == expected
            assert config[argument]["config"] == value.get_config()
            continue
        assert config[argument] == value, argument
        attribute = getattr(again, argument, None)
        if argument != "learning_rate" and not callable(attribute):
            assert attribute in (None, value), argument


@pytest.mark.parametrize("name", sorted(ROWS))
def test_config_round_trip(name):
    _check_round_trip(ROWS[name].make(), {})


@pytest.mark.parametrize("name", sorted(CONFIGURED))
def test_config_holds_every_argument_set_away_from_its_default(name):
    cls, make_arguments = CONFIGURED[name]
    arguments = make_arguments()
    _check_round_trip(cls(**arguments), arguments)


def _two_layer_model():
    return keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, activation="tanh"),
            keras.layers.Dense(2),
        ]
    )


def _fitted(row, x, y):
    model = _two_layer_model()
    model.compile(optimizer=row.make(), loss="mse")
    model.fit(x, y, epochs=1, batch_size=8, verbose=0, shuffle=False)
    return model


def _numpy(variable):
    return keras.ops.convert_to_numpy(variable)


@pytest.mark.parametrize("name", sorted(ROWS))
def test_keras_save_load_continues_bit_identically(name, tmp_path):
    row = ROWS[name]
    x, y = _regression_data(40)  # 5 steps: AGN (period 2) stops mid-round
    model = _fitted(row, x, y)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is type(model.optimizer)
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    saved = model.optimizer.variables
    assert len(loaded.optimizer.variables) == len(saved)
    for a, b in zip(saved, loaded.optimizer.variables, strict=True):
        np.testing.assert_array_equal(_numpy(a), _numpy(b), err_msg=a.path)
    # Some state besides the step counter, or the round trip proves little.
    state = [v for v in saved if "iteration" not in v.path]
    assert any(np.any(_numpy(v) != 0) for v in state)
    for m in (model, loaded):
        m.fit(x, y, epochs=1, batch_size=8, verbose=0, shuffle=False)
    for a, b in zip(model.weights, loaded.weights, strict=True):
        np.testing.assert_array_equal(_numpy(a), _numpy(b), err_msg=a.path)
    for a, b in zip(saved, loaded.optimizer.variables, strict=True):
        np.testing.assert_array_equal(_numpy(a), _numpy(b), err_msg=a.path)


@pytest.mark.skipif(
    BACKEND != "tensorflow", reason="tf.train.Checkpoint: TensorFlow only"
)
@pytest.mark.parametrize("name", sorted(ROWS))
def test_checkpoint_restores_and_continues_bit_identically(name, tmp_path):
    import tensorflow as tf

    row = ROWS[name]
    x, y = _regression_data(40)  # 5 steps: AGN (period 2) stops mid-round
    model = _fitted(row, x, y)
    saved = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    prefix = saved.save(str(tmp_path / "ckpt"))
    model.fit(x, y, epochs=1, batch_size=8, verbose=0, shuffle=False)
    keras.utils.set_random_seed(99)  # another start, which the restore replaces
    fresh = _two_layer_model()
    optimizer = type(model.optimizer).from_config(model.optimizer.get_config())
    fresh.compile(optimizer=optimizer, loss="mse")
    optimizer.build(fresh.trainable_variables)
    restored = tf.train.Checkpoint(model=fresh, optimizer=optimizer).restore(prefix)
    restored.assert_existing_objects_matched()
    assert int(_numpy(optimizer.iterations)) == 5
    fresh.fit(x, y, epochs=1, batch_size=8, verbose=0, shuffle=False)
    for a, b in zip(model.weights, fresh.weights, strict=True):
        np.testing.assert_array_equal(_numpy(a), _numpy(b), err_msg=a.path)
    for a, b in zip(model.optimizer.variables, optimizer.variables, strict=True):
        np.testing.assert_array_equal(_numpy(a), _numpy(b), err_msg=a.path)


# ------------------------------------------------ a callable learning rate
_ONE_STEP = {"exclude_from_layer_adaptation": ["."]}  # T = 1
#: Each class with a plain callable learning rate, built so that a step is
#: `lr * g` (LAMB's with b1 = b2 = 0 and no epsilon: `lr * sign(g)`).
CALLABLE_RATE = {
    "LARS": lambda lr: tf_lars.LARS(lr, momentum=0.0, **_ONE_STEP),
    "TrustRatio": lambda lr: tf_lars.TrustRatio(keras.optimizers.SGD(lr), **_ONE_STEP),
    "LAMB": lambda lr: tf_lars.LAMB(
        lr, beta_1=0.0, beta_2=0.0, epsilon=0.0, **_ONE_STEP
    ),
    "LossScaleOptimizer": lambda lr: tf_lars.LossScaleOptimizer(
        tf_lars.TrustRatio(keras.optimizers.SGD(lr), **_ONE_STEP), dynamic=False
    ),
}


@pytest.mark.parametrize("name", sorted(CALLABLE_RATE))
def test_a_callable_learning_rate_is_read_at_every_eager_step(name):
    # TensorFlow's compiled eager apply would freeze the value it returned
    # when traced: TrustRatio, LAMB and a loss scale around them kept
    # stepping at the first rate (the wrapper's own rate was checked, not
    # the inner optimizer's).
    rates = iter([1.0, 0.0, 0.5])
    current = {"lr": next(rates)}
    optimizer = CALLABLE_RATE[name](lambda: current["lr"])
    variable = keras.Variable(np.zeros(3), dtype="float32")
    grad = np.array([1.0, 2.0, 4.0], "float32")
    scale = getattr(optimizer, "initial_scale", 1.0)  # the fixed loss scale
    step = np.sign(grad) if name == "LAMB" else grad
    expected = np.zeros(3)
    for _ in range(3):
        optimizer.apply([keras.ops.convert_to_tensor(grad * scale)], [variable])
        expected -= current["lr"] * step
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(variable), expected, rtol=1e-6
        )
        current["lr"] = next(rates, 0.0)


# ---------------------------------------------------------- naming, tuples
@pytest.mark.parametrize("name", sorted(ROWS))
def test_default_name_is_numbered_like_keras_optimizers(name):
    row = ROWS[name]
    first, second = row.make(), row.make()
    cls = type(first)
    assert inspect.signature(cls.__init__).parameters["name"].default is None
    assert first.name == row.default_name
    assert second.name == f"{row.default_name}_1"
    # Keras numbers its own optimizers' default names only on newer releases
    # (3.8 names both "sgd"); tf_lars's are numbered on every release.
    keras_numbers = keras.optimizers.SGD().name != keras.optimizers.SGD().name
    for a, b in zip(
        under_test.inner_chain(first), under_test.inner_chain(second), strict=True
    ):
        ours = type(a).__module__.startswith("tf_lars.")
        assert a.name != b.name or not (ours or keras_numbers)
    variable = keras.Variable(np.ones((2, 3), "float32"))
    for optimizer in (first, second):
        optimizer.build([variable])
    # Paths follow the names: a Keras inner optimizer's variables share
    # their path on releases that do not number its name.
    chain = under_test.inner_chain(first)
    if keras_numbers or all(type(o).__module__.startswith("tf_lars.") for o in chain):
        assert first.iterations.path != second.iterations.path
        paths = {v.path for v in first.variables}
        assert not paths & {v.path for v in second.variables}
    mine = cls.from_config(dict(first.get_config(), name="mine"))
    assert mine.name == "mine"


@pytest.mark.parametrize(
    "mode", ["eager", "default"] if BACKEND == "tensorflow" else ["eager"]
)
@pytest.mark.parametrize("name", sorted(ROWS))
def test_tuples_and_python_lists_are_accepted(name, mode):
    row = ROWS[name]
    weights, grads = _problem("float32", seed=2, shapes=[(3,), (2, 3)], steps=3)
    optimizer = row.make()
    if mode == "eager":
        optimizer.jit_compile = False  # op by op, not the compiled eager apply
    variables = tuple(keras.Variable(w) for w in weights)
    scale = row.gradient_scale
    optimizer.apply(
        tuple(harness.tensor(g * scale, "float32") for g in grads[0]), variables
    )
    # Python lists as gradients; (gradient, variable) tuples; then NumPy.
    pairs = tuple(
        ((g * scale).tolist(), v) for g, v in zip(grads[1], variables, strict=True)
    )
    optimizer.apply_gradients(pairs)
    optimizer.apply([np.float32(g * scale) for g in grads[2]], list(variables))
    _assert_close(variables, _reference(row, weights, grads), "float32")
    # TensorFlow's compiled eager apply is traced once for the three kinds
    # of gradients (each optimizer in the chain that has one).
    compiled = [
        f
        for one in under_test.inner_chain(optimizer)
        for f in vars(one).get("_compiled_apply", {}).values()
    ]
    if mode == "default" and isinstance(optimizer, tf_lars.LARS | tf_lars.TrustRatio):
        assert compiled, "no compiled eager apply"
    assert [f.experimental_get_tracing_count() for f in compiled] == [1] * len(compiled)


def _record_writes(optimizer, variable):
    """Patches every `assign*` so that writes outside an optimizer's own
    `assign*` are recorded; returns (patches, direct writes)."""
    direct, depth = [], [0]
    names = ("assign", "assign_add", "assign_sub")
    classes = {type(o) for o in under_test.inner_chain(optimizer)}

    def through(original):
        def write(self, target, value):
            depth[0] += 1
            try:
                return original(self, target, value)
            finally:
                depth[0] -= 1

        return write

    # The model's and the optimizer's variables; not scratch buffers (LAMB's
    # fused TensorFlow path keeps an unsaved one per shape).
    owned = [variable, *optimizer.variables]
    owned = {id(v) for v in owned} | {id(getattr(v, "value", v)) for v in owned}

    def refuse(name, original):
        def check(self, *args, **kwargs):
            if len(self.shape) and not depth[0] and id(self) in owned:
                direct.append(name)
            return original(self, *args, **kwargs)

        return check

    variable_classes = {type(variable)}
    if BACKEND == "tensorflow":
        variable_classes.add(type(variable.value))
    patches = [
        mock.patch.object(cls, n, through(getattr(cls, n)))
        for cls in classes
        for n in names
    ] + [
        mock.patch.object(cls, n, refuse(n, getattr(cls, n)))
        for cls in variable_classes
        for n in names
    ]
    return patches, direct


# Off TensorFlow, LossScaleOptimizer's eager `apply` writes the selected
# values with `variable.assign` (measured on JAX): checked only where it holds
# for every row.
@pytest.mark.skipif(
    BACKEND != "tensorflow",
    reason="off TensorFlow LossScaleOptimizer writes through variable.assign",
)
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("name", sorted(ROWS))
def test_variables_are_written_through_the_optimizers_assign(name, sparse):
    row = ROWS[name]
    variable = keras.Variable(np.ones((5, 4), "float32"))
    optimizer = row.make()
    optimizer.jit_compile = False
    optimizer.build([variable])
    before = [_numpy(v).copy() for v in optimizer.variables]
    grad = np.full((5, 4), 0.5 * row.gradient_scale, "float32")
    if sparse:
        import tensorflow as tf

        grad = tf.IndexedSlices(tf.constant(grad[:3]), tf.constant([0, 2, 4]), (5, 4))
    else:
        grad = harness.tensor(grad, "float32")
    patches, direct = _record_writes(optimizer, variable)
    for patch in patches:
        patch.start()
    try:
        optimizer.apply([grad], [variable])
    finally:
        for patch in patches:
            patch.stop()
    assert direct == []
    assert np.any(_numpy(variable) != 1.0)
    after = [_numpy(v) for v in optimizer.variables]
    assert any(np.any(a != b) for a, b in zip(before, after, strict=True))


# ------------------------------------------------------- sparse (TensorFlow)
SPARSE_INDICES = (0, 4, 0, 2)  # a tuple, with a duplicate


@pytest.mark.skipif(
    BACKEND != "tensorflow", reason="tf.IndexedSlices exist on TensorFlow only"
)
@pytest.mark.parametrize("mode", ["eager", "default"])
@pytest.mark.parametrize("name", sorted(ROWS))
def test_sparse_gradient_rows_follow_the_numpy_reference(name, mode):
    import tensorflow as tf

    row = ROWS[name]
    rng = np.random.default_rng(7)
    weight = rng.normal(size=(6, 3))
    values = [rng.normal(size=(4, 3)) for _ in range(3)]
    optimizer = row.make()
    variable = keras.Variable(weight, dtype="float64")
    step = harness.step_function(optimizer, [variable], mode)
    dense = []
    for value in values:
        scaled = tf.constant(value * row.gradient_scale)
        step([tf.IndexedSlices(scaled, SPARSE_INDICES, (6, 3))])
        summed = np.zeros_like(weight)
        np.add.at(summed, list(SPARSE_INDICES), value)
        dense.append([summed])
    reference = row.reference([weight], sparse=True)
    for step_grads in dense:
        expected = reference(step_grads)
    _assert_close([variable], expected, "float64", mode, row)
    if isinstance(optimizer, tf_lars.LARS) and optimizer.momentum:
        _assert_close(optimizer.momentums, reference.velocities, "float64", mode, row)
    untouched = [1, 3, 5]
    np.testing.assert_array_equal(_numpy(variable)[untouched], weight[untouched])
    # A sparse gradient takes no trust ratio: the record says 1.
    for adaptive in under_test.inner_chain(optimizer):
        if hasattr(adaptive, "trust_ratios"):
            np.testing.assert_array_equal(_numpy(adaptive.trust_ratios), [1.0])


# ------------------------------------------------------------------ refusals
#: Every class, built around `inner` where it wraps one.
BUILDERS = {
    "LARS": lambda inner, **arguments: tf_lars.LARS(**arguments),
    "LAMB": lambda inner, **arguments: tf_lars.LAMB(**arguments),
    "TrustRatio": tf_lars.TrustRatio,
    "LossScaleOptimizer": tf_lars.LossScaleOptimizer,
    "DiLoCo": tf_lars.DiLoCo,
}
if BACKEND == "tensorflow":
    BUILDERS["AGN"] = tf_lars.AGN
#: What `from_config` says of a key the class does not have.
UNKNOWN_KEY = {
    "LARS": "Unknown key(s) in LARS config: ['bogus']",
    "LAMB": "Unknown key(s) in LAMB config: ['bogus']",
    "TrustRatio": "Unknown key(s) in TrustRatio config: ['bogus']",
    "DiLoCo": "Unknown key(s) in DiLoCo config: ['bogus']",
    "LossScaleOptimizer": "LossScaleOptimizer does not support arguments: `bogus`",
    "AGN": "Argument(s) not recognized by AGN: ['bogus']",
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_from_config_refuses_an_unknown_key(name):
    optimizer = BUILDERS[name](keras.optimizers.SGD(0.1))
    config = dict(optimizer.get_config(), bogus=1)
    with pytest.raises(ValueError) as error:
        type(optimizer).from_config(config)
    assert str(error.value).startswith(UNKNOWN_KEY[name])


#: The float arguments each rule keeps in float32 variables or steps.
FLOAT32_ARGUMENTS = [
    (name, argument)
    for name, arguments in {
        "LARS": ["learning_rate", "weight_decay", "trust_coefficient", "epsilon"],
        "LAMB": ["learning_rate", "weight_decay", "trust_coefficient", "epsilon"],
        "TrustRatio": ["weight_decay", "trust_coefficient", "epsilon"],
    }.items()
    for argument in arguments
]


@pytest.mark.parametrize("value", [1e300, 3.5e38])
@pytest.mark.parametrize("name, argument", FLOAT32_ARGUMENTS)
def test_numbers_beyond_float32_are_refused(name, argument, value):
    # Finite in Python, inf in the float32 variable or step (1e300 used to
    # make LARS's learning-rate variable inf and every weight NaN).
    build = BUILDERS[name]
    with pytest.raises(ValueError) as error:
        build(keras.optimizers.SGD(), **{argument: value})
    message = str(error.value)
    assert message.startswith(f"`{argument}` must be at most 3.4028235e+38")
    assert message.endswith(f"Received: {argument}={value!r}")
    build(keras.optimizers.SGD(), **{argument: 3.4e38})  # the largest are accepted


@pytest.mark.parametrize(
    "name",
    sorted(set(BUILDERS) - {"LARS", "LAMB"}),  # the wrappers
)
def test_an_inner_learning_rate_beyond_float32_is_refused(name):
    # Keras keeps 1e300 as inf in its float32 variable; every step was NaN.
    with pytest.raises(ValueError) as error:
        BUILDERS[name](keras.optimizers.SGD(learning_rate=1e300))
    assert str(error.value) == (
        "`inner_optimizer.learning_rate` must be finite in float32 (at most "
        "3.4028235e+38). Received: inner_optimizer=SGD with learning_rate=inf"
    )
