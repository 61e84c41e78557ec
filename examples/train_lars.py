"""Trains a small Keras classifier with tf_lars.LARS on data it makes itself.

    python examples/train_lars.py [--epochs 20] [--batch-size 512]

A two-moons-style problem in 8 dimensions (generated with NumPy, no
download), a two-hidden-layer MLP, and LARS with linear warm-up, linear
learning-rate scaling and biases excluded from weight decay and layer
adaptation. Prints the test accuracy before training (chance: about 0.5), the
loss falling epoch by epoch, and the final test accuracy.
"""

import argparse

import quiet_tensorflow  # noqa: F401 - first: no TensorFlow C++ start-up lines

# isort: split
import keras
import numpy as np

import tf_lars


def make_data(samples, seed=0):
    rng = np.random.default_rng(seed)
    angle = rng.uniform(0, np.pi, size=samples)
    label = rng.integers(0, 2, size=samples)
    x = np.stack(
        [np.cos(angle) + label * 1.0, np.sin(angle) * (1 - 2 * label) + label * 0.4],
        axis=1,
    )
    x = x + rng.normal(scale=0.15, size=x.shape)
    noise = rng.normal(size=(samples, 6))  # distractor features
    return np.concatenate([x, noise], axis=1).astype("float32"), label


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--samples", type=int, default=8192)
    args = parser.parse_args(argv)

    keras.utils.set_random_seed(0)
    x, y = make_data(args.samples)
    split = int(0.8 * len(x))
    steps_per_epoch = -(-split // args.batch_size)
    # Linear scaling from 0.1 at batch 256, a 2-epoch linear warm-up, then
    # polynomial (power 2) decay to 0: the large-batch LARS recipe.
    peak = tf_lars.schedules.linear_scaled_learning_rate(0.1, args.batch_size, 256)
    warmup_steps = 2 * steps_per_epoch
    schedule = tf_lars.WarmupPolynomialDecay(
        peak_learning_rate=peak,
        warmup_steps=warmup_steps,
        decay_steps=args.epochs * steps_per_epoch - warmup_steps,
        power=2.0,
    )
    optimizer = tf_lars.LARS(
        learning_rate=schedule,
        momentum=0.9,
        weight_decay=5e-4,
        trust_coefficient=0.02,
        exclude_from_weight_decay=[tf_lars.lars.ALL_1D],
    )
    model = keras.Sequential(
        [
            keras.Input((x.shape[1],)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(2),
        ]
    )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    _, before = model.evaluate(x[split:], y[split:], verbose=0)
    print(f"test accuracy before training: {before:.3f}", flush=True)
    history = model.fit(
        x[:split],
        y[:split],
        batch_size=args.batch_size,
        epochs=args.epochs,
        validation_data=(x[split:], y[split:]),
        verbose=0,
        callbacks=[
            keras.callbacks.LambdaCallback(
                on_epoch_end=lambda epoch, logs: print(
                    f"epoch {epoch + 1:3d}  loss {logs['loss']:.4f}  "
                    f"val_accuracy {logs['val_accuracy']:.3f}",
                    flush=True,
                )
            )
        ],
    )
    losses = history.history["loss"]
    print(
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
        f"test accuracy {history.history['val_accuracy'][-1]:.3f}"
    )
    return 0 if losses[-1] < losses[0] else 1


if __name__ == "__main__":
    raise SystemExit(main())
