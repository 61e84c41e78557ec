"""k accumulated micro-batches take the step of one big batch, on every backend.

`gradient_accumulation_steps=k` is how a large batch is emulated: every
tf_lars optimizer must then equal the same optimizer on the big batch, its
learning-rate schedule (warm-up included), weight decay and loss scale
included (docs/algorithms.md, "Gradient accumulation"). LARS used to evaluate
its schedule at the micro-batch count, k times too fast.
"""

import keras
import numpy as np
import pytest
from keras import ops

import tf_lars

STEPS = 6  # updates
K = 2  # micro-batches per update
SCALE = 4.0  # the fixed loss scale of the wrapped rows


def _schedule():
    return tf_lars.WarmupPolynomialDecay(
        peak_learning_rate=0.5, warmup_steps=2, decay_steps=10
    )


def _lars(steps):
    return tf_lars.LARS(
        _schedule(), momentum=0.9, weight_decay=0.01, trust_coefficient=0.1,
        gradient_accumulation_steps=steps,
    )  # fmt: skip


def _lamb(steps):
    return tf_lars.LAMB(
        _schedule(), weight_decay=0.01, gradient_accumulation_steps=steps
    )


OPTIMIZERS = {
    "lars": _lars,
    "lamb": _lamb,
    "trust_ratio": lambda steps: tf_lars.TrustRatio(
        keras.optimizers.SGD(_schedule(), momentum=0.9),
        weight_decay=0.01,
        gradient_accumulation_steps=steps,
    ),
    "loss_scale_lars": lambda steps: tf_lars.LossScaleOptimizer(
        _lars(steps), initial_scale=SCALE, dynamic=False
    ),
    "loss_scale_lamb": lambda steps: tf_lars.LossScaleOptimizer(
        _lamb(steps), initial_scale=SCALE, dynamic=False
    ),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_accumulated_micro_batches_equal_one_big_batch(name):
    rng = np.random.default_rng(0)
    start = rng.normal(size=(3, 4)).astype("float32")
    grads = rng.normal(size=(STEPS, K, 3, 4)).astype("float32")
    scale = SCALE if name.startswith("loss_scale") else 1.0
    big, small = keras.Variable(start), keras.Variable(start)
    big_batch, accumulated = OPTIMIZERS[name](None), OPTIMIZERS[name](K)
    for step in range(STEPS):
        # The big batch's mean gradient is the mean of the micro-batches'.
        big_batch.apply([ops.convert_to_tensor(grads[step].mean(0) * scale)], [big])
        for micro in range(K):
            accumulated.apply(
                [ops.convert_to_tensor(grads[step, micro] * scale)], [small]
            )
        np.testing.assert_allclose(small.numpy(), big.numpy(), rtol=2e-6, atol=2e-7)
        assert int(accumulated.iterations) == step + 1
        # The schedule is at the update count, as for the big batch.
        np.testing.assert_allclose(
            float(accumulated.learning_rate), float(big_batch.learning_rate)
        )
    # Still in the decay (power 2): lr = schedule(6) = 0.5 * (1 - 4 / 10)**2.
    np.testing.assert_allclose(float(accumulated.learning_rate), 0.18, rtol=1e-6)


@pytest.mark.parametrize("name", ["lars", "lamb", "loss_scale_lars"])
def test_fit_with_accumulation_equals_fit_on_the_big_batch(name):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(48, 5)).astype("float32")
    y = rng.normal(size=(48, 2)).astype("float32")
    weights = []
    for batch_size, steps in ((16, None), (8, K)):
        keras.utils.set_random_seed(7)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])
        model.compile(optimizer=OPTIMIZERS[name](steps), loss="mse")
        model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
        assert int(model.optimizer.iterations) == 6
        weights.append([w.numpy() for w in model.weights])
    for big, accumulated in zip(*weights, strict=True):
        np.testing.assert_allclose(accumulated, big, rtol=2e-5, atol=2e-6)
