"""Writes the tests/data/v0_1_0_* files with tf_lars 0.1.0.

Run once, from a checkout of the 0.1.0 release (commit f716556), with that
checkout first on `PYTHONPATH`:

    git worktree add /tmp/v010 f716556
    PYTHONPATH=/tmp/v010 python tests/data/make_v0_1_0.py tests/data

`tests/saved_v0_1_0_test.py` loads what it wrote with the current code and
checks that training continues exactly as it did under 0.1.0.
"""

import os
import sys

import keras
import numpy as np
import tensorflow as tf

import tf_lars

out = sys.argv[1]
assert tf_lars.__version__ == "0.1.0"


def model_fn():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(5, activation="tanh", name="hidden"),
            keras.layers.Dense(3, name="out"),
        ]
    )


rng = np.random.default_rng(0)
x = rng.normal(size=(32, 6)).astype("float32")
y = rng.integers(0, 3, size=32)
np.savez(os.path.join(out, "v0_1_0_data.npz"), x=x, y=y)
# .keras file: LARS inside the loss-scale wrapper, with a schedule
sched = tf_lars.WarmupPolynomialDecay(0.5, warmup_steps=2, decay_steps=10)
lars = tf_lars.LARS(
    learning_rate=sched,
    momentum=0.9,
    weight_decay=1e-3,
    trust_coefficient=0.02,
    exclude_from_weight_decay=["<1d>"],
    nesterov=True,
)
opt = tf_lars.LossScaleOptimizer(lars, initial_scale=128.0, dynamic_growth_steps=3)
m = model_fn()
m.compile(
    optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
)
m.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
m.save(os.path.join(out, "v0_1_0_lars.keras"))
m.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
np.savez(os.path.join(out, "v0_1_0_lars_expected.npz"), *[w.numpy() for w in m.weights])
# checkpoint: LARS in a custom loop, and AGN
m2 = model_fn()
opt2 = tf_lars.AGN(
    tf_lars.LARS(learning_rate=0.3, momentum=0.9, weight_decay=1e-3),
    communication_period=3,
)


def step(model, optimizer, xb, yb):
    with tf.GradientTape() as tape:
        loss = keras.losses.sparse_categorical_crossentropy(
            yb, model(xb), from_logits=True
        )
        loss = tf.reduce_mean(loss)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply(grads, model.trainable_variables)


for i in range(4):
    step(m2, opt2, x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8])
ckpt = tf.train.Checkpoint(model=m2, optimizer=opt2)
ckpt.write(os.path.join(out, "v0_1_0_agn_ckpt"))
for i in range(4):
    step(m2, opt2, x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8])
np.savez(os.path.join(out, "v0_1_0_agn_expected.npz"), *[w.numpy() for w in m2.weights])
print("commits", int(opt2.commits.numpy()), "iters", int(opt2.iterations.numpy()))
