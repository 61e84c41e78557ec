"""Problems whose gradient noise is known in closed form, in NumPy.

The known answers of tests/noise_scale_test.py and
tests/noise_scale_mirrored_script.py: `B_simple = tr(Σ) / |G|²`
(docs/algorithms.md, "Gradient noise scale") of the noisy quadratic model and
of linear regression at fixed weights, and small-batch gradients drawn from
each.
"""

import numpy as np


class NoisyQuadratic:
    """Loss `½ Σ h_i θ_i²` at fixed `θ`; a per-example gradient is
    `h_i θ_i + noise` of variance `c_i` (Zhang et al. 2019 take `c_i = h_i`),
    so `|G|² = Σ h_i² θ_i²` and `tr(Σ) = Σ c_i`."""

    def __init__(self, dimensions=32, scale=0.3, seed=0):
        rng = np.random.default_rng(seed)
        self.curvature = 1.0 / np.arange(1, dimensions + 1)
        self.noise_variance = self.curvature
        self.theta = (scale * rng.normal(size=dimensions)).astype("float32")

    def norm_squared(self):
        return float(np.sum((self.curvature * self.theta) ** 2))

    def trace(self):
        return float(np.sum(self.noise_variance))

    def b_simple(self):
        return self.trace() / self.norm_squared()

    def batch_gradients(self, batch, steps, seed):
        """`steps` gradients of batches of `batch` examples, float32 `[steps, d]`:
        the mean gradient plus noise of variance `c_i / batch`."""
        rng = np.random.default_rng(seed)
        noise = rng.normal(size=(steps, self.theta.size))
        mean = self.curvature * self.theta
        return (mean + noise * np.sqrt(self.noise_variance / batch)).astype("float32")


def regression_data(examples, features, seed=0, noise=0.5):
    """`(x, y)`, float32: `y = x·w* + noise`, `x` standard normal."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, features))
    y = x @ rng.normal(size=features) + noise * rng.normal(size=examples)
    return x.astype("float32"), y[:, None].astype("float32")


def regression_b_simple(x, y, kernel, bias):
    """`B_simple` of the mean squared error `(x·w + b - y)²` over the
    examples `(x, y)` at the weights `(kernel, bias)`: per-example gradients
    `2 r_j (x_j, 1)`, their mean `G` and covariance `Σ` over the examples."""
    x, y = np.asarray(x, "float64"), np.asarray(y, "float64")[:, 0]
    residual = x @ np.asarray(kernel, "float64")[:, 0] + float(bias[0]) - y
    per_example = 2 * residual[:, None] * np.hstack([x, np.ones((len(x), 1))])
    mean = per_example.mean(axis=0)
    trace = per_example.var(axis=0).sum()
    return trace / (mean @ mean)
