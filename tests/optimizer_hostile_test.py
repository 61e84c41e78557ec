"""Bad input and edge cases of the optimizers, on every Keras backend.

Each test here failed before the fix it names: non-finite weights from the
loss scale at its floor, wrong-shaped gradients broadcast, integer gradients
zeroed, a second trust ratio stacked on Keras's `Lamb`, LAMB's 0 / 0 at
`epsilon=0`, and optax's masks and `eps_root` (docs/algorithms.md, "Porting
from optax").
"""

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
from keras import ops

import tf_lars
from tests import lamb_reference

ON_TENSORFLOW = keras.backend.backend() == "tensorflow"
# JAX without its 64-bit mode computes float64 variables in float32.
DTYPE, TOLERANCE = (
    ("float32", 3e-5) if keras.backend.backend() == "jax" else ("float64", 1e-9)
)
INF = float("inf")


def _tensor(values, dtype="float32"):
    return ops.convert_to_tensor(np.asarray(values, dtype))


# --------------------------------------------------------------- loss scale
@pytest.mark.parametrize(
    "inner",
    [
        lambda: keras.optimizers.SGD(0.01),
        lambda: tf_lars.LARS(0.01, weight_decay=1e-4),
    ],
    ids=["sgd", "lars"],
)
def test_loss_scale_at_its_floor_never_writes_a_non_finite_weight(inner):
    variable = keras.Variable(np.ones(4, "float32"))
    optimizer = tf_lars.LossScaleOptimizer(inner(), initial_scale=2.0**-110)
    # The scale halves down to the smallest normal float32 (2**-126) in 16
    # steps and stays there for the other 24.
    for _ in range(40):
        optimizer.apply([_tensor(np.full(4, INF))], [variable])
    assert float(optimizer.loss_scale) == pytest.approx(np.finfo("float32").tiny)
    # 10 / 1.2e-38 overflows: the step is skipped, not applied as -inf.
    optimizer.apply([_tensor(np.full(4, 10.0))], [variable])
    np.testing.assert_array_equal(variable.numpy(), np.ones(4, "float32"))
    assert int(optimizer.skipped_steps) == 41
    assert int(optimizer.iterations) == 0


def test_loss_scale_below_one_skips_what_overflows_float16():
    variable = keras.Variable(np.ones(4, "float16"))
    optimizer = tf_lars.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=0.5
    )
    # 60000 is finite in float16; 60000 / 0.5 is not.
    optimizer.apply([_tensor(np.full(4, 60000.0), "float16")], [variable])
    np.testing.assert_array_equal(variable.numpy(), np.ones(4, "float16"))
    assert int(optimizer.skipped_steps) == 1
    assert float(optimizer.loss_scale) == 0.25
    # A gradient that stays in range after unscaling is applied.
    optimizer.apply([_tensor(np.full(4, 2.0), "float16")], [variable])
    np.testing.assert_allclose(variable.numpy(), np.full(4, 1 - 0.01 * 8.0), rtol=1e-3)


def test_loss_scale_refuses_integer_gradients():
    variable = keras.Variable(np.ones(4, "float32"))
    optimizer = tf_lars.LossScaleOptimizer(keras.optimizers.SGD(0.01))
    with pytest.raises(ValueError, match="must be floating-point.*dtype int32"):
        optimizer.apply([_tensor([1, 1, 1, 1], "int32")], [variable])
    np.testing.assert_array_equal(variable.numpy(), np.ones(4, "float32"))


# ------------------------------------------------------------------ shapes
SHAPE_CHECKED = {
    "lars": lambda steps: tf_lars.LARS(0.1, gradient_accumulation_steps=steps),
    "lamb": lambda steps: tf_lars.LAMB(0.1, gradient_accumulation_steps=steps),
    "trust_ratio": lambda steps: tf_lars.TrustRatio(
        keras.optimizers.SGD(0.1), gradient_accumulation_steps=steps
    ),
    "loss_scale_lars": lambda steps: tf_lars.LossScaleOptimizer(
        tf_lars.LARS(0.1, gradient_accumulation_steps=steps)
    ),
}


@pytest.mark.parametrize("steps", [None, 2])
@pytest.mark.parametrize("name", sorted(SHAPE_CHECKED))
def test_a_gradient_of_another_shape_is_refused(name, steps):
    variable = keras.Variable(np.ones((3, 3), "float32"), name="kernel")
    optimizer = SHAPE_CHECKED[name](steps)
    with pytest.raises(ValueError, match=r"shape \(3,\) for the variable .*kernel"):
        optimizer.apply([ops.ones((3,))], [variable])
    np.testing.assert_array_equal(variable.numpy(), np.ones((3, 3), "float32"))
    # Once built, a list of gradients alone is checked too.
    optimizer.apply([ops.zeros((3, 3))], [variable])
    with pytest.raises(ValueError, match=r"shape \(3, 1\)"):
        optimizer.apply([ops.ones((3, 1))])


# -------------------------------------------------------------- TrustRatio
@pytest.mark.skipif(
    not hasattr(keras.optimizers, "Lamb"), reason="this Keras has no Lamb"
)
def test_trust_ratio_refuses_keras_lamb():
    with pytest.raises(ValueError, match="Lamb optimizer.*tf_lars.LAMB"):
        tf_lars.TrustRatio(keras.optimizers.Lamb())


# -------------------------------------------------------------------- LAMB
def test_lamb_without_epsilon_leaves_a_zero_gradient_variable_still():
    variable = keras.Variable(np.ones(4, "float32"))
    optimizer = tf_lars.LAMB(0.1, epsilon=0.0)
    optimizer.apply([ops.zeros((4,))], [variable])
    np.testing.assert_array_equal(variable.numpy(), np.ones(4, "float32"))
    optimizer.apply([_tensor([1.0, -1.0, 0.0, 0.0])], [variable])
    # Adam's direction is sign-like: the nonzero entries move by lr * T * 1.
    moved = variable.numpy()
    assert np.all(np.isfinite(moved))
    np.testing.assert_array_equal(moved[2:], [1.0, 1.0])
    assert moved[0] < 1.0 < moved[1]


@keras.saving.register_keras_serializable(package="tf_lars_tests")
def is_bias(variable):
    """An optax-style mask turned into an exclusion: the biases."""
    return variable.path.endswith("bias")


@keras.saving.register_keras_serializable(package="tf_lars_tests")
def is_first_layer(variable):
    return variable.path.startswith("first/")


def _paths_and_problem(seed=0, steps=4):
    rng = np.random.default_rng(seed)
    shapes = {"first/kernel": (4, 3), "first/bias": (3,), "second/kernel": (3, 2)}
    weights = [rng.normal(size=s) for s in shapes.values()]
    grads = [
        [rng.normal(scale=0.1, size=s) for s in shapes.values()] for _ in range(steps)
    ]
    return list(shapes), weights, grads


def _variables(paths, weights, dtype=DTYPE):
    variables = []
    for path, weight in zip(paths, weights, strict=True):
        layer, leaf = path.split("/")
        with keras.name_scope(layer):
            variables.append(keras.Variable(weight, dtype=dtype, name=leaf))
    assert [v.path for v in variables] == paths
    return variables


def _apply(optimizer, variables, grads):
    for step in grads:
        optimizer.apply([_tensor(g, DTYPE) for g in step], variables)
    return [v.numpy() for v in variables]


@pytest.mark.parametrize("eps_root", [0.0, 1e-3])
def test_lamb_ports_optax_lamb_with_mask_and_eps_root(eps_root):
    """optax.lamb(mask=m, eps_root=r) is LAMB(exclude_from_weight_decay=not m,
    exclude_from_layer_adaptation=[], eps_root=r): optax's mask covers the
    decay only."""
    paths, weights, grads = _paths_and_problem()
    mask = [not p.endswith("bias") for p in paths]
    expected = lamb_reference.optax_lamb(
        weights, grads, 2.0**-6, weight_decay=0.1, eps_root=eps_root, mask=mask
    )
    optimizer = tf_lars.LAMB(
        2.0**-6,  # exact in the float32 learning-rate variable
        epsilon=1e-6,
        weight_decay=0.1,
        eps_root=eps_root,
        exclude_from_weight_decay=is_bias,
        exclude_from_layer_adaptation=[],
    )
    actual = _apply(optimizer, _variables(paths, weights), grads)
    for a, b in zip(actual, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=TOLERANCE, atol=TOLERANCE * 1e-3)
    # The default adaptation list follows the decay list (Model Garden and
    # tensorflow-addons), which is not optax's: the bias keeps T = 1.
    default = tf_lars.LAMB(
        0.01, weight_decay=0.1, eps_root=eps_root, exclude_from_weight_decay=is_bias
    )
    variables = _variables(paths, weights)
    _apply(default, variables, grads[:1])
    ratios = default.trust_ratios.numpy()
    assert ratios[1] == 1.0 and ratios[0] != 1.0


def _optax_lars(weights, grads, lr, momentum, wd, eta, eps, decay_mask, ratio_mask):
    """optax.lars: add_decayed_weights(mask=decay_mask), scale_by_trust_ratio
    masked by ratio_mask, scale by lr, trace(momentum); two independent masks."""
    w = [np.array(x, np.float64) for x in weights]
    trace = [np.zeros_like(x) for x in w]
    for step in grads:
        for i, g in enumerate(step):
            update = g + wd * w[i] if decay_mask[i] else np.array(g)
            if ratio_mask[i]:
                w_norm, u_norm = np.linalg.norm(w[i]), np.linalg.norm(update)
                if w_norm > 0 and u_norm > 0:
                    update = update * (eta * w_norm / (u_norm + eps))
            trace[i] = lr * update + momentum * trace[i]
            w[i] = w[i] - trace[i]
    return w


def test_lars_ports_optax_lars_two_independent_masks():
    paths, weights, grads = _paths_and_problem(seed=1)
    decay_mask = [not p.endswith("bias") for p in paths]
    ratio_mask = [not p.startswith("first/") for p in paths]
    expected = _optax_lars(
        weights, grads, 0.5, 0.9, 0.01, 0.02, 1e-9, decay_mask, ratio_mask
    )
    optimizer = tf_lars.LARS(
        0.5,
        momentum=0.9,
        weight_decay=0.01,
        trust_coefficient=0.02,
        epsilon=1e-9,
        trust_ratio="decayed",
        exclude_from_weight_decay=is_bias,
        exclude_from_layer_adaptation=is_first_layer,
    )
    actual = _apply(optimizer, _variables(paths, weights), grads)
    for a, b in zip(actual, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=TOLERANCE, atol=TOLERANCE * 1e-3)


def test_callable_exclusions_round_trip_and_must_return_bools():
    paths, weights, _ = _paths_and_problem()
    optimizer = tf_lars.LARS(
        0.1,
        weight_decay=0.01,
        exclude_from_weight_decay=is_bias,
        exclude_from_layer_adaptation=is_first_layer,
    )
    config = optimizer.get_config()
    assert config["exclude_from_weight_decay"]["config"] == "tf_lars_tests>is_bias"
    restored = tf_lars.LARS.from_config(config)
    restored.build(_variables(paths, weights))
    assert restored._variable_weight_decay == [0.01, 0.0, 0.01]
    assert restored._variable_adapted == [False, False, True]
    refusing = tf_lars.LARS(exclude_from_weight_decay=lambda variable: 1)
    with pytest.raises(ValueError, match="must return a bool.*Received: 1 for"):
        refusing.build(_variables(paths, weights))
    with pytest.raises(ValueError, match="or a callable of the variable"):
        tf_lars.LAMB(exclude_from_layer_adaptation=3)


# ------------------------------------------------------------ saved files
LOAD_SCRIPT = textwrap.dedent(
    """
    import sys
    import keras
    if sys.argv[2] == "import":
        import tf_lars  # noqa: F401  (registers the classes)
    try:
        model = keras.models.load_model(sys.argv[1])
    except Exception as error:
        print("FAILED", type(error).__name__, str(error).splitlines()[0])
    else:
        print("LOADED", type(model.optimizer).__name__)
    """
)


@pytest.mark.skipif(not ON_TENSORFLOW, reason="one backend is enough: a subprocess")
def test_loading_a_saved_model_needs_import_tf_lars(tmp_path):
    """The docs' statement: `import tf_lars` before `load_model`, no
    `custom_objects`. Without the import, Keras 3.15 cannot find the class;
    Keras 3.8 imports the module the file names (`tf_lars.lars`) itself."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=tf_lars.LARS(0.1), loss="mse")
    model.fit(np.ones((4, 3)), np.ones((4, 2)), verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    outputs = {}
    for mode in ("no-import", "import"):
        done = subprocess.run(
            [sys.executable, "-c", LOAD_SCRIPT, path, mode],
            capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
        outputs[mode] = done.stdout.strip().splitlines()[-1]
    assert outputs["import"] == "LOADED LARS"
    if outputs["no-import"] != "LOADED LARS":
        assert outputs["no-import"].startswith(
            "FAILED TypeError Could not locate class 'LARS'"
        ), outputs["no-import"]
    if keras.version() == "3.15.1":  # measured; the docs quote it
        assert outputs["no-import"].startswith("FAILED")


# ------------------------------------------------- apply(grads) unbuilt
WRAPPERS = {
    # Gradients of `scale_loss(loss)`: a scale of 1 keeps the numbers plain.
    "loss_scale": lambda: tf_lars.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=1.0
    ),
    "diloco": lambda: tf_lars.DiLoCo(keras.optimizers.SGD(0.1), sync_every=2),
    "agn": lambda: tf_lars.AGN(keras.optimizers.SGD(0.1), communication_period=2),
}


@pytest.mark.parametrize(
    "name",
    [
        "diloco",
        "loss_scale",
        pytest.param(
            "agn",
            marks=pytest.mark.skipif(not ON_TENSORFLOW, reason="AGN needs TensorFlow"),
        ),
    ],
)
def test_grads_alone_need_a_built_optimizer_then_step_its_variables(name):
    optimizer = WRAPPERS[name]()
    grads = [_tensor([1.0, 2.0])]
    with pytest.raises(ValueError, match=r"must already be built\. Call "):
        optimizer.apply(grads)
    assert not optimizer.built
    variable = keras.Variable(np.zeros(2, "float32"))
    optimizer.build([variable])
    optimizer.apply(grads)  # the variables it was built with
    np.testing.assert_allclose(ops.convert_to_numpy(variable), [-0.1, -0.2])


# ------------------------------------------- an inner optimizer's attributes
def _nadam(rate=0.05):
    return keras.optimizers.Nadam(rate)


def _fixed_scale(inner):
    return tf_lars.LossScaleOptimizer(inner, initial_scale=1.0, dynamic=False)


#: name -> (the optimizer, the one it must step as, or None).
NADAM_CHAINS = {
    "loss_scale": (lambda: _fixed_scale(_nadam()), _nadam),
    "loss_scale_trust_ratio": (
        lambda: _fixed_scale(tf_lars.TrustRatio(_nadam())),
        lambda: tf_lars.TrustRatio(_nadam()),
    ),
    "keras_loss_scale_trust_ratio": (
        lambda: keras.optimizers.LossScaleOptimizer(tf_lars.TrustRatio(_nadam())),
        None,
    ),
    "diloco_loss_scale": (
        lambda: tf_lars.DiLoCo(_fixed_scale(_nadam()), _nadam(0.5), sync_every=3),
        lambda: tf_lars.DiLoCo(_nadam(), _nadam(0.5), sync_every=3),
    ),
}
if ON_TENSORFLOW:
    NADAM_CHAINS["agn_outer"] = (
        lambda: tf_lars.AGN(
            _nadam(), communication_period=2, outer_optimizer=_nadam(0.5)
        ),
        None,
    )


def _nadams(optimizer):
    found = [optimizer] if isinstance(optimizer, keras.optimizers.Nadam) else []
    for name in ("inner_optimizer", "outer_optimizer", "center_optimizer"):
        held = getattr(optimizer, name, None)
        if held is not None and held is not optimizer:
            found += _nadams(held)
    return found


def _fit_nadam_chain(make, epochs, model=None):
    if model is None:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer=make(), loss="mse")
    x = np.random.default_rng(0).normal(size=(32, 3)).astype("float32")
    y = np.stack([x[:, 0] - x[:, 1], x[:, 2]], axis=1)
    model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize("name", sorted(NADAM_CHAINS))
def test_an_inner_nadams_attribute_state_is_saved_restored_and_stepped(name, tmp_path):
    # Keras's Nadam keeps `_u_product` in a plain attribute, tracked only
    # while Keras's automatic tracking is on, which Keras's loss scale and
    # AGN turn off while they build: it was left out of `variables`, so
    # reset by a `.keras` round trip (0.114 to 1.0) and, under JAX's
    # `stateless_apply`, never advanced.
    make, plain = NADAM_CHAINS[name]
    model = _fit_nadam_chain(make, 1)
    nadams = _nadams(model.optimizer)
    assert nadams
    for nadam in nadams:
        assert any(v is nadam._u_product for v in model.optimizer.variables)
        assert float(ops.convert_to_numpy(nadam._u_product)) < 0.99
    path = str(tmp_path / "model.keras")
    model.save(path)
    resumed = _fit_nadam_chain(make, 1, keras.models.load_model(path))
    whole = _fit_nadam_chain(make, 2)
    for got, want in zip(resumed.get_weights(), whole.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    if plain is not None:
        alone = _fit_nadam_chain(plain, 2)
        for got, want in zip(whole.get_weights(), alone.get_weights(), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_a_skipped_step_leaves_nadams_attribute_state_and_old_files_load():
    variable = keras.Variable(np.array([1.0, -2.0, 3.0], "float32"))
    optimizer = _fixed_scale(_nadam())
    optimizer.apply([_tensor([0.1, 0.2, INF])], [variable])
    nadam = optimizer.inner_optimizer
    assert int(optimizer.skipped_steps) == 1
    assert float(ops.convert_to_numpy(nadam._u_product)) == 1.0
    optimizer.apply([_tensor([0.1, 0.2, 0.3])], [variable])
    # A tf_lars 0.2.x file has every variable but `_u_product` (the last):
    # loaded by position, `_u_product` keeps its initial value, as then.
    saved = [ops.convert_to_numpy(v) for v in optimizer.variables]
    assert optimizer.variables[-1] is nadam._u_product
    fresh = _fixed_scale(_nadam())
    fresh.build([keras.Variable(np.zeros(3, "float32"))])
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not Keras's "Skipping variable loading"
        fresh.load_own_variables({str(i): w for i, w in enumerate(saved[:-1])})
    for got, want in zip(fresh.variables[:-1], saved[:-1], strict=True):
        np.testing.assert_array_equal(ops.convert_to_numpy(got), want)
    assert float(ops.convert_to_numpy(fresh.inner_optimizer._u_product)) == 1.0
