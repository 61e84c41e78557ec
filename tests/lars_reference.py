"""NumPy reference of the LARS rule in docs/algorithms.md, independent of tf_lars."""

import numpy as np


def dense_step(
    w,
    g,
    v,
    lr,
    *,
    momentum=0.9,
    weight_decay=0.0,
    trust_coefficient=0.001,
    epsilon=0.0,
    nesterov=False,
    classic_momentum=True,
    trust_ratio="paper",
    decay_in_gradient=True,
    trust_clip=False,
    decayed=True,
    adapted=True,
):
    """One LARS step on one variable in float64. Returns (w, v, T)."""
    w = np.asarray(w, np.float64)
    g = np.asarray(g, np.float64)
    v = np.asarray(v, np.float64)
    wd = weight_decay if decayed else 0.0
    g_applied = g + wd * w if decay_in_gradient else g
    w_norm = np.linalg.norm(w.ravel())
    if not adapted:
        ratio = 1.0
    elif trust_ratio == "paper":
        g_norm = np.linalg.norm(g.ravel())
        ratio = (
            trust_coefficient * w_norm / (g_norm + wd * w_norm + epsilon)
            if w_norm > 0 and g_norm > 0
            else 1.0
        )
    else:
        g_norm = np.linalg.norm(g_applied.ravel())
        ratio = (
            trust_coefficient * w_norm / (g_norm + epsilon)
            if w_norm > 0 and g_norm > 0
            else 1.0
        )
    rate = min(ratio, lr) if (trust_clip and adapted) else lr * ratio
    if momentum == 0:
        return w - rate * g_applied, v, ratio
    if classic_momentum:
        v = momentum * v + rate * g_applied
        step = momentum * v + rate * g_applied if nesterov else v
    else:
        v = momentum * v + g_applied
        step = rate * (g_applied + momentum * v) if nesterov else rate * v
    return w - step, v, ratio


def sparse_step(
    w,
    v,
    indices,
    values,
    lr,
    *,
    momentum=0.9,
    nesterov=False,
    classic_momentum=True,
    **unused,
):
    """Row-wise momentum on touched rows, duplicates summed first."""
    w = np.array(w, np.float64)
    v = np.array(v, np.float64)
    summed = {}
    for i, row in zip(indices, values):
        summed[int(i)] = summed.get(int(i), 0.0) + np.asarray(row, np.float64)
    for i, g in summed.items():
        if momentum == 0:
            w[i] -= lr * g
            continue
        if classic_momentum:
            v[i] = momentum * v[i] + lr * g
            w[i] -= momentum * v[i] + lr * g if nesterov else v[i]
        else:
            v[i] = momentum * v[i] + g
            w[i] -= lr * (g + momentum * v[i]) if nesterov else lr * v[i]
    return w, v


# Entry magnitudes whose squares overflow (1e19 and up) or underflow (1e-30)
# float32; each variable's norm stays representable. Norms used to be inf or
# 0: weights NaN (or moved by a whole step) while `trust_ratios` read 1.
MAGNITUDES = [1e19, 1e30, 3e38, 1e-30]


def extreme_values(scale, seed=0):
    """A (4,) and a (64, 128) tensor of entries near `scale`, norms <= scale."""
    rng = np.random.default_rng(seed)
    sign = lambda shape: np.where(rng.random(shape) < 0.5, -1.0, 1.0)  # noqa: E731
    small = sign(4) * rng.uniform(0.5, 1.0, 4) * scale / 2
    large = sign((64, 128)) * rng.uniform(0.5, 1.0, (64, 128)) * scale / 128
    return [small.astype("float32"), large.astype("float32")]


def apply_once(optimizer, weights, grads, compiled):
    """One `apply` of `grads` to new variables holding `weights`; returns them.

    `compiled="jit"` runs it in `tf.function(jit_compile=True)`; otherwise
    op by op (the optimizer's compiled eager apply switched off).
    """
    import keras
    import tensorflow as tf

    variables = [keras.Variable(w) for w in weights]
    optimizer.jit_compile = False
    optimizer.build(variables)
    apply = lambda gradients: optimizer.apply(gradients, variables)  # noqa: E731
    if compiled == "jit":
        apply = tf.function(apply, jit_compile=True)
    apply([tf.constant(g) for g in grads])
    return variables
