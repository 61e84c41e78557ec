"""Runs in its own process: LossScaleOptimizer under MirroredStrategy, 2 CPUs.

Invoked by `tests/loss_scale_test.py::test_mirrored_strategy_replicas_agree`
with the path of a JSON file to write; the test holds the assertions and the
NumPy reference. Device setup is fixed when TensorFlow starts, hence the
separate process.
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


def main(out_path):
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    report = {"num_replicas": strategy.num_replicas_in_sync, "custom_loop": {}}
    for mode in ["eager", "function"]:
        report["custom_loop"][mode] = custom_loop(strategy, mode)
    report["fit"] = mixed_precision_fit(strategy)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
