"""Writes the saved files of tests/backends_test.py, on one Keras backend.

    KERAS_BACKEND=tensorflow python tests/data/make_across_backends.py
    KERAS_BACKEND=jax python tests/data/make_across_backends.py
    KERAS_BACKEND=torch python tests/data/make_across_backends.py

For each optimizer in `OPTIMIZERS`: a small model trained one epoch is saved
as `across_<backend>_<optimizer>.keras`; the weights after one more epoch on
the same backend go to `across_<backend>_<optimizer>_continued.npz`. A test
on another backend loads the file and checks that its next epoch gives
those weights.
"""

import os
import pathlib
import sys

import keras
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import tf_lars  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent


def make_optimizer(name):
    """The four optimizers that run on every backend."""
    return {
        "lars": lambda: tf_lars.LARS(
            learning_rate=0.5, weight_decay=1e-3, trust_coefficient=0.02
        ),
        "lamb": lambda: tf_lars.LAMB(learning_rate=0.01, weight_decay=0.01),
        "trust_ratio": lambda: tf_lars.TrustRatio(
            keras.optimizers.SGD(0.05, momentum=0.9), weight_decay=1e-3
        ),
        "loss_scale": lambda: tf_lars.LossScaleOptimizer(
            tf_lars.LARS(learning_rate=0.5, trust_coefficient=0.02),
            initial_scale=2.0**10,
            dynamic_growth_steps=3,
        ),
    }[name]()


OPTIMIZERS = ["lamb", "lars", "loss_scale", "trust_ratio"]


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 3)).astype("float32")
    y = np.stack([x.sum(1), x[:, 0] - x[:, 2]], axis=1).astype("float32")
    return x, y


def epoch(model):
    x, y = data()
    model.fit(x, y, epochs=1, batch_size=8, verbose=0, shuffle=False)


def weights(model):
    return {f"w{i}": np.asarray(w) for i, w in enumerate(model.get_weights())}


def main():
    backend = keras.backend.backend()
    for name in OPTIMIZERS:
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((3,)),
                keras.layers.Dense(4, activation="tanh"),
                keras.layers.Dense(2),
            ]
        )
        model.compile(optimizer=make_optimizer(name), loss="mse")
        epoch(model)
        stem = HERE / f"across_{backend}_{name}"
        model.save(f"{stem}.keras")
        epoch(model)
        np.savez(f"{stem}_continued.npz", **weights(model))
        print("wrote", os.path.basename(stem))


if __name__ == "__main__":
    main()
