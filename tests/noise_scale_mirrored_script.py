"""Runs in its own process: `tf_lars.GradientNoiseScale` under MirroredStrategy
on two logical CPUs (tests/noise_scale_test.py).

Each replica's batch is the small batch and the inner optimizer's
all-reduced gradient the big one: on the noisy quadratic model at fixed
weights, `B_simple` must come within 10% of `tr(Σ) / |G|²`; the weights after
a few steps must equal the inner optimizer's alone under the same strategy;
`model.fit` must log the measurement. Prints `MIRRORED NOISE SCALE OK`.
"""

import os

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


def run(strategy, optimizer, variable, per_replica_grads):
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


def main():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert strategy.num_replicas_in_sync == REPLICAS
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
    run(strategy, optimizer, variable, grads)
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
        run(strategy, optimizer, variable, grads[:5])
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


if __name__ == "__main__":
    main()
