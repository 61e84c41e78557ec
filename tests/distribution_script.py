"""keras.distribution over two host devices equals one device (JAX).

Run by tests/backends_test.py with KERAS_BACKEND=jax and
XLA_FLAGS=--xla_force_host_platform_device_count=2:

    python tests/distribution_script.py data_parallel|model_parallel|noise_scale

`data_parallel`: `DataParallel(devices=jax.devices())`, LARS and LAMB in
`model.fit`. `model_parallel`: `ModelParallel` whose `LayoutMap` shards the
first Dense kernel's columns over the two devices; the trust ratios LARS
records are those of the whole kernel, as on one device. `noise_scale`
(run by tests/noise_scale_test.py): `GradientNoiseScale` with gradient
accumulation under `DataParallel` measures what one device measures, and
without accumulation is refused (the optimizer sees the global gradient
only). Prints "<case> OK".
"""

import pathlib
import sys

import jax
import keras
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import tf_lars  # noqa: E402

OPTIMIZERS = {
    "lars": lambda: tf_lars.LARS(
        learning_rate=0.5, weight_decay=1e-3, trust_coefficient=0.02
    ),
    "lamb": lambda: tf_lars.LAMB(learning_rate=0.01, weight_decay=0.01),
}


def _fit(make_optimizer, distribution):
    keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh", name="wide"),
            keras.layers.Dense(2, name="out"),
        ]
    )
    kernel_shards = model.get_layer("wide").kernel.value.addressable_shards
    model.compile(optimizer=make_optimizer(), loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = np.stack([x.sum(1), x[:, 0] - x[:, 2]], axis=1).astype("float32")
    model.fit(x, y, epochs=2, batch_size=16, verbose=0, shuffle=False)
    weights = [np.asarray(w) for w in model.get_weights()]
    ratios = np.asarray(model.optimizer.trust_ratios)
    keras.distribution.set_distribution(None)
    return weights, ratios, kernel_shards


def _compare(one, two, name):
    for a, b in zip(one[0], two[0], strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(two[1], one[1], rtol=1e-5, err_msg=name)
    assert np.all(one[1][[0, 2]] != 1.0), one[1]  # the kernels are adapted


def _noise_scale(distribution, steps):
    keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    optimizer = tf_lars.GradientNoiseScale(
        keras.optimizers.SGD(0.01), batch_size=8, gradient_accumulation_steps=steps
    )
    model.compile(optimizer=optimizer, loss="mse")
    x = np.random.default_rng(0).normal(size=(256, 6)).astype("float32")
    y = (x @ np.arange(6.0) + 1.0)[:, None].astype("float32")
    try:
        model.fit(x, y, epochs=2, batch_size=8, verbose=0, shuffle=False)
    finally:
        keras.distribution.set_distribution(None)
    return optimizer.b_simple, [np.asarray(w) for w in model.get_weights()]


def noise_scale(devices):
    one = _noise_scale(None, 2)
    two = _noise_scale(keras.distribution.DataParallel(devices=devices), 2)
    assert np.isfinite(one[0]) and one[0] > 0, one[0]
    np.testing.assert_allclose(two[0], one[0], rtol=1e-4)
    for a, b in zip(one[1], two[1], strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    try:
        _noise_scale(keras.distribution.DataParallel(devices=devices), None)
    except ValueError as error:
        assert "keras.distribution" in str(error), error
    else:
        raise AssertionError("no accumulation under DataParallel was not refused")


def main(case):
    devices = jax.devices()
    assert len(devices) == 2, devices
    if case == "noise_scale":
        noise_scale(devices)
        print(f"{case} OK")
        return
    for name, make in OPTIMIZERS.items():
        one = _fit(make, None)
        if case == "data_parallel":
            two = _fit(make, keras.distribution.DataParallel(devices=devices))
        else:
            mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices)
            layout_map = keras.distribution.LayoutMap(mesh)
            layout_map[".*wide/kernel"] = (None, "model")  # keys fullmatch paths
            two = _fit(make, keras.distribution.ModelParallel(layout_map=layout_map))
            shards = two[2]
            assert len(shards) == 2 and shards[0].data.shape == (6, 4), shards
        _compare(one, two, name)
    print(f"{case} OK")


if __name__ == "__main__":
    main(sys.argv[1])
