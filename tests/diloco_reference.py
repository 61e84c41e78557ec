"""A NumPy transcription of DiLoCo, independent of tf_lars.

The rules of docs/guides/low-communication.md, written out: Keras's SGD and
Adam/AdamW updates (the inner and outer optimizers), synchronous DiLoCo for
M workers with optional streaming fragments, bfloat16 rounding, absmax
quantization and error feedback.
"""

import numpy as np


def _as_keras_holds_it(value):
    """A hyperparameter as Keras's step uses it: rounded to float32.

    Keras keeps the learning rate in a float32 variable, and `ops.cast` of a
    Python float makes a float32 tensor first, so a float64 step sees every
    hyperparameter at float32 precision.
    """
    return float(np.float32(value))


class SGD:
    """Keras's `SGD`: `m = mu m - lr g`; `w += m` (`w += mu m - lr g` Nesterov)."""

    def __init__(self, learning_rate, momentum=0.0, nesterov=False):
        self.learning_rate = _as_keras_holds_it(learning_rate)
        self.momentum = _as_keras_holds_it(momentum)
        self.nesterov = nesterov
        self.slots = {}

    def step(self, index, gradient, weight):
        lr, mu = self.learning_rate, self.momentum
        if mu == 0:
            return weight - lr * gradient
        m = mu * self.slots.get(index, np.zeros_like(weight)) - lr * gradient
        self.slots[index] = m
        return weight + (mu * m - lr * gradient if self.nesterov else m)

    def apply(self, grads, weights, indices=None):
        indices = range(len(weights)) if indices is None else indices
        return [self.step(i, g, w) for i, g, w in zip(indices, grads, weights)]


class AdamW:
    """Keras's `AdamW` (`Adam` with `weight_decay=0`): decay, then Adam."""

    def __init__(self, learning_rate, weight_decay=0.0, beta_1=0.9, beta_2=0.999):
        held = _as_keras_holds_it
        self.learning_rate, self.weight_decay = held(learning_rate), held(weight_decay)
        # Cast for the powers; `1 - beta` and epsilon enter as Python floats,
        # which a binary op takes at the tensor's precision.
        self.beta_1, self.beta_2, self.epsilon = held(beta_1), held(beta_2), 1e-7
        self.one_minus = (1 - beta_1, 1 - beta_2)
        self.slots, self.iterations = {}, 0

    def apply(self, grads, weights, indices=None):
        indices = range(len(weights)) if indices is None else indices
        t = self.iterations + 1
        lr = self.learning_rate
        alpha = lr * np.sqrt(1 - self.beta_2**t) / (1 - self.beta_1**t)
        updated = []
        for i, g, w in zip(indices, grads, weights):
            w = w - w * self.weight_decay * lr
            m, v = self.slots.get(i, (np.zeros_like(w), np.zeros_like(w)))
            m = m + (g - m) * self.one_minus[0]
            v = v + (g * g - v) * self.one_minus[1]
            self.slots[i] = (m, v)
            updated.append(w - m * alpha / (np.sqrt(v) + self.epsilon))
        self.iterations = t
        return updated


def bfloat16_round(x):
    """`x` rounded to bfloat16 (nearest, ties to even), via float32."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    # NumPy constants: NumPy 1.x casts uint64 with a Python int to float64.
    one, half = np.uint64(1), np.uint64(0x7FFF)
    bits = (bits + half + ((bits >> np.uint64(16)) & one)) & np.uint64(0xFFFF0000)
    return bits.astype(np.uint32).view(np.float32).astype(np.asarray(x).dtype)


def quantize(x, bits, granularity="tensor"):
    levels = 2 ** (bits - 1) - 1
    if granularity == "row" and x.ndim >= 2:
        absmax = np.max(np.abs(x), axis=tuple(range(1, x.ndim)), keepdims=True)
    else:
        absmax = np.max(np.abs(x))
    scale = (absmax * x.dtype.type(1 / levels)).astype(x.dtype)
    codes = np.round(x / np.where(scale > 0, scale, 1)).clip(-levels, levels)
    return codes.astype(np.int8), scale


def round_trip(x, compression, granularity="tensor"):
    if compression is None:
        return x
    if compression == "bfloat16":
        return bfloat16_round(x)
    codes, scale = quantize(x, {"int8": 8, "int4": 4}[compression], granularity)
    return codes.astype(x.dtype) * scale


def fragments(num_variables, num_fragments):
    return [list(range(f, num_variables, num_fragments)) for f in range(num_fragments)]


def due(step, num_fragments, sync_every):
    offsets = [f * sync_every // num_fragments for f in range(num_fragments)]
    return [
        f
        for f, o in enumerate(offsets)
        if step >= 1 and step >= o and (step - o) % sync_every == 0
    ]


def diloco(
    initial,
    gradient_fn,
    make_inner,
    outer,
    num_workers,
    sync_every,
    steps,
    compression=None,
    granularity="tensor",
    error_feedback=False,
    num_fragments=1,
):
    """Runs M workers for `steps` inner steps; returns theta and the workers.

    `gradient_fn(worker, step, weights)` gives worker `worker`'s gradients at
    inner step `step` (0-based); `make_inner()` a fresh inner optimizer.
    """
    theta = [np.array(w) for w in initial]
    workers = [[np.array(w) for w in initial] for _ in range(num_workers)]
    inners = [make_inner() for _ in range(num_workers)]
    errors = [[np.zeros_like(w) for w in initial] for _ in range(num_workers)]
    parts = fragments(len(initial), num_fragments)
    for step in range(steps):
        for m in range(num_workers):
            grads = gradient_fn(m, step, workers[m])
            workers[m] = inners[m].apply(grads, workers[m])
        for f in due(step + 1, num_fragments, sync_every):
            indices = parts[f]
            sent = []
            for m in range(num_workers):
                deltas = []
                for i in indices:
                    delta = theta[i] - workers[m][i] + errors[m][i]
                    received = round_trip(delta, compression, granularity)
                    if error_feedback:
                        errors[m][i] = delta - received
                    deltas.append(received)
                sent.append(deltas)
            mean = [sum(d[k] for d in sent) / num_workers for k in range(len(indices))]
            new = outer.apply(mean, [theta[i] for i in indices], indices)
            for i, value in zip(indices, new):
                theta[i] = value
                for m in range(num_workers):
                    workers[m][i] = value.copy()
    return theta, workers
