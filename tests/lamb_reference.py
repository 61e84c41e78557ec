"""NumPy transcriptions of the trust-ratio rule and of published LAMB updates.

Independent of tf_lars: each function follows one source's update as that
project states it (docs/algorithms.md, "TrustRatio and LAMB", lists them),
written here in float64 over a list of variables.
"""

import numpy as np


def _norm(x):
    return float(np.sqrt(np.sum(np.square(x))))


def trust_ratio(w, u, eta=1.0, eps=0.0, clip=False):
    """docs/algorithms.md: T = eta |w| / (|u| + eps), 1 on a zero norm."""
    w_norm, u_norm = _norm(w), _norm(u)
    if w_norm == 0 or u_norm == 0:
        ratio = 1.0
    else:
        ratio = eta * w_norm / (u_norm + eps)
    return min(ratio, 1.0) if clip else ratio


def wrapped_run(
    weights,
    grads,
    lr,
    direction,
    *,
    weight_decay=0.0,
    trust_coefficient=1.0,
    epsilon=0.0,
    trust_clip=False,
    decayed=None,
    adapted=None,
):
    """The TrustRatio rule around an inner optimizer given as `direction`.

    `direction(state, i, g, t)` returns the inner optimizer's unit-rate
    direction `d` for variable `i` at step `t` (1-based), updating `state`.
    Returns the final weights and the last step's ratios.
    """
    w = [np.array(x, np.float64) for x in weights]
    state = {}
    ratios = []
    for t, step_grads in enumerate(grads, 1):
        ratios = []
        for i, g in enumerate(step_grads):
            d = direction(state, i, np.asarray(g, np.float64), t)
            wd = weight_decay if decayed is None or decayed[i] else 0.0
            u = d + wd * w[i]
            if adapted is None or adapted[i]:
                ratio = trust_ratio(w[i], u, trust_coefficient, epsilon, trust_clip)
            else:
                ratio = 1.0
            ratios.append(ratio)
            w[i] = w[i] - lr * ratio * u
    return w, ratios


def as_keras_constant(x):
    """A Python float as Keras makes it a tensor: rounded to float32 first."""
    return float(np.float32(x))


def keras_sgd_direction(lr, momentum=0.0, nesterov=False):
    """Keras SGD's step over lr: m <- mu m - lr g; w <- w + m (or Nesterov).

    Keras casts `momentum` from a float32 tensor.
    """
    momentum = as_keras_constant(momentum)

    def direction(state, i, g, t):
        if momentum == 0:
            return g
        m = state.get(i, np.zeros_like(g))
        m = momentum * m - lr * g
        state[i] = m
        step = momentum * m - lr * g if nesterov else m
        return -step / lr

    return direction


def keras_adam_direction(beta_1=0.9, beta_2=0.999, epsilon=1e-7):
    """Keras Adam: epsilon added to sqrt(v) before v's bias correction.

    The bias corrections use the betas cast from float32 tensors, the moment
    updates the Python floats (as Keras 3.15 does).
    """

    def direction(state, i, g, t):
        m, v = state.get(i, (np.zeros_like(g), np.zeros_like(g)))
        m = m + (g - m) * (1 - beta_1)
        v = v + (g * g - v) * (1 - beta_2)
        state[i] = (m, v)
        b1, b2 = as_keras_constant(beta_1), as_keras_constant(beta_2)
        alpha = np.sqrt(1 - b2**t) / (1 - b1**t)
        return alpha * m / (np.sqrt(v) + epsilon)

    return direction


def adam_moments(state, i, g, b1, b2):
    m, v = state.get(i, (np.zeros_like(g), np.zeros_like(g)))
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    state[i] = (m, v)
    return m, v


# ---------------------------------------------------------------- LAMB family
def optax_lamb(
    weights,
    grads,
    lr,
    b1=0.9,
    b2=0.999,
    eps=1e-6,
    weight_decay=0.0,
    eps_root=0.0,
    mask=None,
):
    """optax.lamb: scale_by_adam (eps after sqrt(nu_hat + eps_root)), then
    add_decayed_weights (only where `mask[i]`, all when None), then
    scale_by_trust_ratio on every variable (ratio 1 where either norm is 0),
    then scale by -lr."""
    w = [np.array(x, np.float64) for x in weights]
    mu = [np.zeros_like(x) for x in w]
    nu = [np.zeros_like(x) for x in w]
    for count, step_grads in enumerate(grads, 1):
        for i, g in enumerate(step_grads):
            mu[i] = b1 * mu[i] + (1 - b1) * g
            nu[i] = b2 * nu[i] + (1 - b2) * np.square(g)
            mu_hat = mu[i] / (1 - b1**count)
            nu_hat = nu[i] / (1 - b2**count)
            update = mu_hat / (np.sqrt(nu_hat + eps_root) + eps)
            if mask is None or mask[i]:
                update = update + weight_decay * w[i]
            param_norm, update_norm = _norm(w[i]), _norm(update)
            zero = param_norm == 0.0 or update_norm == 0.0
            update = update * (1.0 if zero else param_norm / update_norm)
            w[i] = w[i] + (-lr) * update
    return w


def paper_lamb(weights, grads, lr, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.0):
    """You et al. 2019, Algorithm 2 with phi the identity (nonzero norms)."""
    x = [np.array(w, np.float64) for w in weights]
    m = [np.zeros_like(w) for w in x]
    v = [np.zeros_like(w) for w in x]
    for t, step_grads in enumerate(grads, 1):
        for i, g in enumerate(step_grads):
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            m_hat = m[i] / (1 - b1**t)
            v_hat = v[i] / (1 - b2**t)
            r = m_hat / (np.sqrt(v_hat) + eps)
            direction = r + weight_decay * x[i]
            x[i] = x[i] - lr * _norm(x[i]) / _norm(direction) * direction
    return x


def keras_lamb(weights, grads, lr, b1=0.9, b2=0.999, eps=1e-7):
    """keras.optimizers.Lamb with weight_decay=None (Keras 3.15's update).

    Its bias corrections use the betas cast from float32 tensors.
    """
    w = [np.array(x, np.float64) for x in weights]
    state = {}
    c1, c2 = as_keras_constant(b1), as_keras_constant(b2)
    for t, step_grads in enumerate(grads, 1):
        for i, g in enumerate(step_grads):
            m, v = state.get(i, (np.zeros_like(g), np.zeros_like(g)))
            m = m + (g - m) * (1 - b1)
            v = v + (g * g - v) * (1 - b2)
            state[i] = (m, v)
            update = (m / (1 - c1**t)) / (np.sqrt(v / (1 - c2**t)) + eps)
            w_norm, g_norm = _norm(w[i]), _norm(update)
            ratio = w_norm / g_norm if w_norm > 0 and g_norm > 0 else 1.0
            w[i] = w[i] - ratio * lr * update
    return w


def timm_lamb(
    weights,
    grads,
    lr,
    b1=0.9,
    b2=0.999,
    eps=1e-6,
    weight_decay=0.01,
    no_decay=None,
    max_grad_norm=1.0,
    trust_clip=False,
    always_adapt=False,
):
    """timm.optim.Lamb (bias_correction=True, grad_averaging=True).

    `no_decay[i]` puts variable i in a parameter group with weight decay 0
    (timm's usual group for biases and norms). Gradients are first divided
    by max(global_norm / max_grad_norm, 1); a group adapts when its decay is
    nonzero or `always_adapt`.
    """
    w = [np.array(x, np.float64) for x in weights]
    state = {}
    for t, step_grads in enumerate(grads, 1):
        global_norm = np.sqrt(sum(np.sum(np.square(g)) for g in step_grads))
        clip = max(global_norm / max_grad_norm, 1.0) if max_grad_norm else 1.0
        for i, g in enumerate(step_grads):
            g = g / clip
            m, v = adam_moments(state, i, g, b1, b2)
            denom = np.sqrt(v) / np.sqrt(1 - b2**t) + eps
            update = (m / (1 - b1**t)) / denom
            wd = 0.0 if no_decay is not None and no_decay[i] else weight_decay
            if wd != 0:
                update = update + wd * w[i]
            if wd != 0 or always_adapt:
                w_norm, g_norm = _norm(w[i]), _norm(update)
                ratio = w_norm / g_norm if w_norm > 0 and g_norm > 0 else 1.0
                if trust_clip:
                    ratio = min(ratio, 1.0)
                update = update * ratio
            w[i] = w[i] - lr * update
    return w


def tfa_lamb(
    weights,
    grads,
    lr,
    b1=0.9,
    b2=0.999,
    eps=1e-6,
    weight_decay_rate=0.0,
    do_decay=None,
    do_adapt=None,
):
    """tensorflow-addons LAMB (TF Model Garden's is the same update).

    `do_decay[i]` / `do_adapt[i]`: what its exclude lists leave on for
    variable i (the adaptation list defaults to the decay list).
    """
    w = [np.array(x, np.float64) for x in weights]
    state = {}
    for t, step_grads in enumerate(grads, 1):
        for i, g in enumerate(step_grads):
            m, v = adam_moments(state, i, g, b1, b2)
            m_hat = m / (1 - b1**t)
            v_sqrt = np.sqrt(v / (1 - b2**t))
            update = m_hat / (v_sqrt + eps)
            if do_decay is None or do_decay[i]:
                update = update + weight_decay_rate * w[i]
            ratio = 1.0
            if do_adapt is None or do_adapt[i]:
                w_norm, g_norm = _norm(w[i]), _norm(update)
                if w_norm > 0:
                    ratio = w_norm / g_norm if g_norm > 0 else 1.0
            w[i] = w[i] - ratio * lr * update
    return w


def keras_rmsprop_direction(rho=0.9, epsilon=1e-7):
    """Keras RMSprop (not centered, no momentum): v <- rho v + (1 - rho) g^2;
    the step over lr is g / sqrt(v + epsilon)."""

    def direction(state, i, g, t):
        v = rho * state.get(i, np.zeros_like(g)) + (1 - rho) * g * g
        state[i] = v
        return g / np.sqrt(v + epsilon)

    return direction


def optax_adam_direction(b1=0.9, b2=0.999, eps=1e-6):
    """optax `scale_by_adam` (eps after the square root of nu_hat, exact betas):
    the direction of `optax_lamb` before weight decay and the ratio."""

    def direction(state, i, g, t):
        m, v = adam_moments(state, i, g, b1, b2)
        return (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)

    return direction
