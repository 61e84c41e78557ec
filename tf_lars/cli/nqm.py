"""The noisy quadratic model (NQM) of Zhang et al. 2019 (arXiv 1907.04164).

The loss is `½ Σ_i h_i θ_i²`; a stochastic gradient of a batch of `B`
examples is `h_i θ_i` plus noise of variance `c_i / B` per dimension. Here
`h_i = 1 / i` and `c_i = h_i` (the paper's choice), every `θ_i` starting with
`E[θ_i²] = 1`. The expected loss of SGD, heavy-ball and Nesterov momentum
follows from second moments alone: with `θ_{t+1} = a θ_t + b θ_{t-1} − α ξ_t`
(SGD: `a = 1 − αh`, `b = 0`; heavy ball: `a = 1 − αh + μ`, `b = −μ`;
Nesterov: `a = (1 − αh)(1 + μ)`, `b = −(1 − αh)μ`; decoupled or coupled
weight decay `λ` adds `λ` to `h` in the update, not in the loss), the
moments `E[θ_t²]`, `E[θ_t θ_{t−1}]` evolve by one linear map per dimension
(SGD: `E[θ_i²]_{t+1} = (1 − αh_i)² E[θ_i²]_t + α² c_i / B`). No sampling: a
run is its expectation, so every seed gives the same numbers.

At the weights of step `t` the gradient noise scale is exact:
`|G|² = Σ h_i² E[θ_i²]` and `tr Σ = Σ c_i`, so `B_simple = tr Σ / |G|²`
(McCandlish et al. 2018). NumPy only.
"""

import math

import numpy as np

#: A run whose expected loss grows this many times its start diverged.
DIVERGED = 1e6


def make_nqm(dimensions):
    """`(h, c, m0)`: curvatures `1/i`, noise `c_i = h_i`, `E[θ_i²]_0 = 1`."""
    curvature = 1.0 / np.arange(1, dimensions + 1, dtype=np.float64)
    return curvature, curvature.copy(), np.ones(dimensions)


def learning_rates(peak, warmup_steps, steps, decay=True):
    """The learning rate of steps `0 .. steps-1`: linear warm-up from 0 over
    `warmup_steps`, then linear decay to 0 at `steps` (or constant): the
    numbers of `tf_lars.schedules.WarmupPolynomialDecay` with `power=1`."""
    step = np.arange(steps, dtype=np.float64)
    rate = np.full(steps, float(peak))
    if warmup_steps:
        rate = np.where(step <= warmup_steps, peak * step / warmup_steps, rate)
    if decay:
        after = np.clip(step - warmup_steps, 0, None) / max(steps - warmup_steps, 1)
        rate = np.where(step > warmup_steps, peak * (1 - after), rate)
    return rate


def run(
    nqm,
    rates,
    batch_size,
    target,
    *,
    momentum=0.0,
    nesterov=False,
    weight_decay=0.0,
    record_every=1,
):
    """Iterates the expected loss until it reaches `target` or `rates` ends.

    Returns `{"steps": int or None, "curve": [(step, loss), ...],
    "b_simple": float}`: the first step whose expected loss is at most
    `target` (None if none), the loss every `record_every` steps, and
    `B_simple` at the last step run.
    """
    curvature, noise, start = nqm
    moment, cross, previous = start.copy(), start.copy(), start.copy()
    first = 0.5 * float(curvature @ start)
    curve, steps = [(0, first)], None
    for step, rate in enumerate(rates, start=1):
        shrink = 1.0 - rate * (curvature + weight_decay)
        if nesterov:
            a, b = shrink * (1.0 + momentum), -shrink * momentum
        else:
            a, b = shrink + momentum, -momentum
        moment, cross, previous = (
            a * a * moment + 2 * a * b * cross + b * b * previous
            + rate * rate * noise / batch_size,
            a * moment + b * cross,
            moment,
        )  # fmt: skip
        loss = 0.5 * float(curvature @ moment)
        if step % record_every == 0:
            curve.append((step, loss))
        if loss <= target:
            steps = step
            break
        if not math.isfinite(loss) or loss > DIVERGED * first:
            break
    if curve[-1][0] != step:
        curve.append((step, loss))
    gradient = float(curvature**2 @ moment)
    b_simple = float(noise.sum()) / gradient if gradient > 0 else math.inf
    return {"steps": steps, "curve": curve, "b_simple": b_simple}
