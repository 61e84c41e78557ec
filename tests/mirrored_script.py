"""Runs in its own process: LARS, LAMB and TrustRatio under MirroredStrategy
on two logical CPUs.

The trust ratios must come from the all-reduced gradient, so a two-replica run
on a split batch equals a one-device run on the whole batch. Arguments: the
names of the optimizers to check (keys of `OPTIMIZERS`; default all).
"""

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


def check(make_optimizer, kernel_ratio_ok):
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


strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
for label in sys.argv[1:] or list(OPTIMIZERS):
    check(*OPTIMIZERS[label])
    print(label, "ok")
print("MIRRORED OK")
