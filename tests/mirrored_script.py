"""Runs in its own process: the MirroredStrategy scenarios on two logical CPUs.

TensorFlow fixes its devices when it starts, hence a process of its own.
`python tests/mirrored_script.py SCENARIO [ARGUMENTS]` (tests/harness.py,
`run_mirrored`), SCENARIO one of:

- `optimizers [NAME ...]` (tests/lars_test.py): LARS, LAMB and TrustRatio
  take their trust ratios from the all-reduced gradient, so a two-replica run
  on a split batch equals a one-device run on the whole batch (NAME: keys of
  `OPTIMIZERS`, default all). Prints `MIRRORED OK`.
- `loss_scale OUT` (tests/loss_scale_test.py): LossScaleOptimizer in a custom
  loop and in `fit`; writes a JSON report to OUT, and the test holds the
  assertions and the NumPy reference.
- `noise_scale` (tests/noise_scale_test.py): `tf_lars.GradientNoiseScale`.
  Each replica's batch is the small batch and the inner optimizer's
  all-reduced gradient the big one: on the noisy quadratic model at fixed
  weights, `B_simple` must come within 10% of `tr(Σ) / |G|²`; the weights
  after a few steps must equal the inner optimizer's alone under the same
  strategy; `model.fit` must log the measurement. Prints
  `MIRRORED NOISE SCALE OK`.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2
)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_lars  # noqa: E402
from tests import noise_scale_problems as problems  # noqa: E402

REPLICAS = 2

# ------------------------------------------------------------ optimizers
STEPS = 5
GLOBAL_BATCH = 32


def make_model():
    keras.utils.set_random_seed(3)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )


def _lars_kernel_ratio(ratio):
    return 0 < ratio < 1


def _adapted_kernel_ratio(ratio):
    return np.isfinite(ratio) and ratio != 1.0


# name: (make the optimizer, what the first kernel's trust ratio must satisfy)
OPTIMIZERS = {
    "LARS": (
        lambda: tf_lars.LARS(
            learning_rate=0.5,
            weight_decay=1e-3,
            trust_coefficient=0.02,
            nesterov=True,
            exclude_from_weight_decay=[tf_lars.lars.ALL_1D],
        ),
        _lars_kernel_ratio,
    ),
    "LAMB": (
        lambda: tf_lars.LAMB(
            learning_rate=0.01,
            weight_decay=1e-2,
            exclude_from_weight_decay=[tf_lars.lars.ALL_1D],
        ),
        _adapted_kernel_ratio,
    ),
    "TrustRatio(SGD)": (
        lambda: tf_lars.TrustRatio(
            keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
            weight_decay=1e-3,
            trust_coefficient=0.5,
            trust_clip=True,
        ),
        _adapted_kernel_ratio,
    ),
}


rng = np.random.default_rng(0)
x = rng.normal(size=(GLOBAL_BATCH * STEPS, 6)).astype("float32")
y = (x @ rng.normal(size=(6, 1))).astype("float32")


def loss_fn(model, xb, yb):
    per_example = tf.reduce_sum(tf.square(model(xb) - yb), axis=1)
    return tf.reduce_sum(per_example) / GLOBAL_BATCH


def check(strategy, make_optimizer, kernel_ratio_ok):
    # One device, whole batch.
    single = make_model()
    single_opt = make_optimizer()
    single_ratios = []
    for step in range(STEPS):
        xb = x[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]
        yb = y[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]
        with tf.GradientTape() as tape:
            loss = loss_fn(single, xb, yb)
        single_opt.apply(
            tape.gradient(loss, single.trainable_variables), single.trainable_variables
        )
        single_ratios.append(single_opt.trust_ratios.numpy().copy())

    # Two replicas, half a batch each, custom loop under tf.function.
    assert strategy.num_replicas_in_sync == 2
    with strategy.scope():
        mirrored = make_model()
        mirrored_opt = make_optimizer()
        mirrored_opt.build(mirrored.trainable_variables)

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)

    @tf.function
    def train_step(batch):
        def replica_step(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(mirrored, xb, yb)
            grads = tape.gradient(loss, mirrored.trainable_variables)
            mirrored_opt.apply(grads, mirrored.trainable_variables)
            return loss

        return strategy.run(replica_step, args=batch)

    for batch in dist_dataset:
        train_step(batch)

    for a, b in zip(single.weights, mirrored.weights, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(
        mirrored_opt.trust_ratios.numpy(), single_ratios[-1], rtol=2e-5
    )
    assert mirrored_opt.iterations.numpy() == STEPS
    kernel_ratio = single_ratios[-1][0]
    assert kernel_ratio_ok(kernel_ratio), single_ratios[-1]
    copies = [r.numpy() for r in mirrored_opt.trust_ratios.value.values]
    np.testing.assert_array_equal(copies[0], copies[1])

    # model.fit under the strategy trains and keeps replicas identical.
    with strategy.scope():
        fit_model = make_model()
        fit_model.compile(optimizer=make_optimizer(), loss="mse")
    history = fit_model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=4, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0], history.history
    kernel = fit_model.trainable_variables[0].value
    replica_values = [v.numpy() for v in kernel.values]
    np.testing.assert_array_equal(replica_values[0], replica_values[1])


# ------------------------------------------------------------ loss scale
EMBEDDING_ROWS = [1, 3, 1]
FIT_INITIAL_SCALE = 2.0**24


def local_values(strategy, variable):
    """The value held on each replica, as nested lists."""
    distributed = variable.value if isinstance(variable, keras.Variable) else variable
    return [
        np.asarray(v.numpy()).tolist()
        for v in strategy.experimental_local_results(distributed)
    ]


def custom_loop(strategy, mode):
    rng = np.random.default_rng(21)
    kernel_init = rng.normal(size=(3, 2))
    embedding_init = rng.normal(size=(5, 2))
    with strategy.scope():
        kernel = keras.Variable(kernel_init.astype(np.float32))
        embedding = keras.Variable(embedding_init.astype(np.float32))
        optimizer = tf_lars.LossScaleOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.9),
            initial_scale=8.0,
            dynamic_growth_steps=2,
        )
        optimizer.build([kernel, embedding])

    def replica_step(c_kernel, c_rows):
        with tf.GradientTape() as tape:
            rows = tf.gather(embedding, EMBEDDING_ROWS)
            loss = tf.reduce_sum(kernel * c_kernel) + tf.reduce_sum(rows * c_rows)
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, [kernel, embedding])
        optimizer.apply(grads, [kernel, embedding])

    def step(c_kernel, c_rows):
        strategy.run(replica_step, args=(c_kernel, c_rows))

    if mode == "function":
        step = tf.function(step)

    # (replica, what) made non-finite at each step; one replica only.
    plan = [None, (1, "kernel_nan"), (0, "rows_inf"), None, None]
    steps = []
    for bad in plan:
        coefficients = []
        for replica in range(2):
            c_kernel = rng.uniform(-1, 1, size=(3, 2))
            c_rows = rng.uniform(-1, 1, size=(3, 2))
            if bad == (replica, "kernel_nan"):
                c_kernel[0, 1] = np.nan
            if bad == (replica, "rows_inf"):
                c_rows[1, 1] = np.inf
            coefficients.append((c_kernel, c_rows))

        def per_replica(index, coefficients=coefficients):
            return strategy.experimental_distribute_values_from_function(
                lambda context: tf.constant(
                    coefficients[context.replica_id_in_sync_group][index], tf.float32
                )
            )

        step(per_replica(0), per_replica(1))
        steps.append(
            {
                "coefficients": [
                    [c_kernel.tolist(), c_rows.tolist()]
                    for c_kernel, c_rows in coefficients
                ],
                "kernel": local_values(strategy, kernel),
                "embedding": local_values(strategy, embedding),
                "scale": local_values(strategy, optimizer.dynamic_scale),
                "skipped": local_values(strategy, optimizer.skipped_step_counter),
                "iterations": int(optimizer.iterations.numpy()),
            }
        )
    return {
        "kernel_init": kernel_init.tolist(),
        "embedding_init": embedding_init.tolist(),
        "steps": steps,
    }


def mixed_precision_fit(strategy):
    keras.mixed_precision.set_global_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype(np.float32)
    y = (x @ rng.normal(size=(8, 1)) / 3).astype(np.float32)
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(16, activation="tanh"),
                keras.layers.Dense(1, dtype="float32"),
            ]
        )
        optimizer = tf_lars.LossScaleOptimizer(
            tf_lars.LARS(
                learning_rate=0.5,
                momentum=0.9,
                weight_decay=1e-3,
                trust_coefficient=0.02,
            ),
            initial_scale=FIT_INITIAL_SCALE,
            dynamic_growth_steps=10**6,
        )
        model.compile(optimizer=optimizer, loss="mse")
    history = model.fit(
        x,
        y,
        batch_size=32,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[tf_lars.callbacks.LossScaleMonitor()],
    )
    keras.mixed_precision.set_global_policy("float32")
    replicas_equal = True
    all_finite = True
    checked = 0
    for variable in model.trainable_variables + optimizer.variables:
        values = [np.asarray(v) for v in local_values(strategy, variable)]
        checked += len(values) == 2
        replicas_equal &= all(np.array_equal(values[0], v) for v in values[1:])
        all_finite &= bool(np.all(np.isfinite(values[0])))
    return {
        "loss": history.history["loss"],
        "loss_scale": history.history["loss_scale"],
        "skipped_steps": history.history["skipped_steps"],
        "initial_scale": FIT_INITIAL_SCALE,
        "replicas_equal": bool(replicas_equal),
        "variables_checked_on_two_replicas": checked,
        "all_finite": bool(all_finite),
    }


# ----------------------------------------------------------- noise scale
def apply_per_replica(strategy, optimizer, variable, per_replica_grads):
    """`optimizer.apply` in each replica, replica r given `grads[r] / R` (the
    gradient of its loss divided by the replica count, as `fit` makes it)."""

    @tf.function
    def step(grads):
        def apply(gradient):
            optimizer.apply([gradient], [variable])

        strategy.run(apply, args=(grads,))

    for grads in per_replica_grads:
        values = strategy.experimental_distribute_values_from_function(
            lambda context, g=grads: tf.constant(
                g[context.replica_id_in_sync_group] / REPLICAS
            )
        )
        step(values)


def noise_scale(strategy):
    problem = problems.NoisyQuadratic(scale=2.0)
    batch = 8
    grads = problem.batch_gradients(batch, steps=300 * REPLICAS, seed=1)
    grads = grads.reshape(300, REPLICAS, -1)
    with strategy.scope():
        variable = keras.Variable(problem.theta)
        optimizer = tf_lars.GradientNoiseScale(
            keras.optimizers.SGD(0.0), batch_size=batch, beta=0.999
        )
        optimizer.build([variable])
    apply_per_replica(strategy, optimizer, variable, grads)
    exact = problem.b_simple()
    measured = optimizer.b_simple
    assert abs(measured / exact - 1) < 0.1, (measured, exact)
    assert abs(optimizer.trace_covariance / problem.trace() - 1) < 0.1
    norm_squared = optimizer.gradient_norm_squared
    assert abs(norm_squared / problem.norm_squared() - 1) < 0.1
    np.testing.assert_array_equal(variable.numpy(), problem.theta)
    print(f"B_simple {measured:.3f}, exact {exact:.3f}")

    # The inner update unchanged: the same steps with and without the wrapper.
    weights = {}
    for wrapped in (False, True):
        with strategy.scope():
            variable = keras.Variable(problem.theta)
            inner = keras.optimizers.SGD(0.05, momentum=0.9)
            optimizer = (
                tf_lars.GradientNoiseScale(inner, batch_size=batch)
                if wrapped
                else inner
            )
            optimizer.build([variable])
        apply_per_replica(strategy, optimizer, variable, grads[:5])
        weights[wrapped] = variable.numpy()
    np.testing.assert_allclose(weights[True], weights[False], rtol=1e-6)
    assert not np.allclose(weights[True], problem.theta)

    # `model.fit`: the per-replica batch is the small batch.
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        optimizer = tf_lars.GradientNoiseScale(keras.optimizers.SGD(0.05), 16)
        model.compile(optimizer=optimizer, loss="mse")
    x, y = problems.regression_data(512, 4, seed=2)
    history = model.fit(
        x,
        y,
        batch_size=16 * REPLICAS,
        epochs=2,
        verbose=0,
        callbacks=[tf_lars.callbacks.GradientNoiseScaleMonitor()],
    )
    scales = history.history["gradient_noise_scale"]
    assert len(scales) == 2 and all(np.isfinite(scales)) and scales[-1] > 0, scales
    print("MIRRORED NOISE SCALE OK")


def optimizers(strategy, *names):
    for name in names or list(OPTIMIZERS):
        check(strategy, *OPTIMIZERS[name])
        print(name, "ok")
    print("MIRRORED OK")


def loss_scale(strategy, out_path):
    report = {"num_replicas": strategy.num_replicas_in_sync, "custom_loop": {}}
    for mode in ["eager", "function"]:
        report["custom_loop"][mode] = custom_loop(strategy, mode)
    report["fit"] = mixed_precision_fit(strategy)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(report, f)


SCENARIOS = {
    "optimizers": optimizers,
    "loss_scale": loss_scale,
    "noise_scale": noise_scale,
}

if __name__ == "__main__":
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    assert strategy.num_replicas_in_sync == REPLICAS
    SCENARIOS[sys.argv[1]](strategy, *sys.argv[2:])
