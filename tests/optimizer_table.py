"""The optimizers every contract test runs (tests/contract_test.py), each with
an independent NumPy reference of its update.

One row per optimizer under test, in the manner of optax's
`_OPTIMIZERS_UNDER_TEST`: how to build it, the reference rule it must follow
(tests/lars_reference.py, tests/lamb_reference.py), and how it is named and
scaled. A row's `reference(weights, sparse=False)` returns a stateful step
`step(grads) -> weights` in float64; with `sparse=True` it is the row's
update without trust ratio and weight decay, which is what every optimizer
here does with a sparse gradient (docs/algorithms.md) when the same rows are
touched at every step.
"""

import dataclasses
from collections.abc import Callable

import keras
import numpy as np

from tests import lamb_reference as lamb_ref
from tests import lars_reference as lars_ref

# Exact in float32, so that Keras's float32 learning-rate variable holds it.
LR = 2.0**-3
# Loss scales are powers of two: unscaling is exact.
SCALE = 2.0**10

LARS_BASE = {
    "momentum": 0.9,
    "weight_decay": 0.01,
    "trust_coefficient": 0.02,
    "epsilon": 1e-5,
}
#: `EXCLUDE` in a row: tensors of at most one dimension (the scalar and the
#: vector of the reference problem, a Dense layer's bias) take no weight
#: decay and no trust ratio ("<1d>": LARS's and TrustRatio's adaptation
#: follows the decay's list by default).
EXCLUDE = {"exclude_from_weight_decay": ["<1d>"]}
LARS_VARIANTS = {
    "lars_paper": {},
    "lars_decayed": {"trust_ratio": "decayed", "nesterov": True, **EXCLUDE},
    "lars_clip": {"trust_clip": True, "epsilon": 1e-8, **EXCLUDE},
    "lars_contrib": {"classic_momentum": False, "decay_in_gradient": False},
    "lars_nesterov": {"nesterov": True},
    "lars_contrib_nesterov": {
        "classic_momentum": False,
        "decay_in_gradient": False,
        "nesterov": True,
        **EXCLUDE,
    },
}


def _included(config, weight, sparse):
    """Whether `weight` takes decay and the trust ratio under `config`."""
    excluded = "exclude_from_weight_decay" in config and np.ndim(weight) <= 1
    return not (sparse or excluded)


def _lars_reference(config):
    rule = {k: v for k, v in config.items() if k != "exclude_from_weight_decay"}

    def make(weights, sparse=False):
        w = [np.array(x, np.float64) for x in weights]
        v = [np.zeros_like(x) for x in w]
        ratios = [1.0] * len(w)

        def step(grads):
            for i, g in enumerate(grads):
                included = _included(config, w[i], sparse)
                w[i], v[i], ratios[i] = lars_ref.dense_step(
                    w[i], g, v[i], LR, decayed=included, adapted=included, **rule
                )
            return [x.copy() for x in w]

        # The momentum slots and the last step's trust ratios, which the
        # reference and sparse tests compare with LARS's `momentums` and
        # `trust_ratios`.
        step.velocities = v
        step.ratios = ratios
        return step

    return make


def _ratio_reference(
    direction,
    weight_decay=0.0,
    trust_coefficient=1.0,
    epsilon=0.0,
    trust_clip=False,
    adapted=True,
    **exclude,
):
    """`w <- w - LR * T * (d + weight_decay * w)` around an inner direction
    (tests/lamb_reference.py, `wrapped_run`); `adapted=False` is plain `d`;
    `exclude` is a row's `EXCLUDE` or nothing."""

    def make(weights, sparse=False):
        w = [np.array(x, np.float64) for x in weights]
        state, count = {}, [0]
        inner = direction()
        ratios = [1.0] * len(w)

        def step(grads):
            count[0] += 1
            for i, g in enumerate(grads):
                included = _included(exclude, w[i], sparse)
                d = inner(state, i, np.asarray(g, np.float64), count[0])
                u = d + (weight_decay if included else 0.0) * w[i]
                ratios[i] = 1.0
                if adapted and included:
                    ratios[i] = lamb_ref.trust_ratio(
                        w[i], u, trust_coefficient, epsilon, trust_clip
                    )
                w[i] = w[i] - LR * ratios[i] * u
            return [x.copy() for x in w]

        # The last step's trust ratios (TrustRatio's and LAMB's
        # `trust_ratios`; 1 for every variable where `adapted=False`).
        step.ratios = ratios
        return step

    return make


def _agn_reference(period):
    """AGN around `SGD(LR)` in one process (docs/algorithms.md, "AGN")."""

    def make(weights, sparse=False):
        local = [np.array(x, np.float64) for x in weights]
        center = [x.copy() for x in local]
        accumulated = [np.zeros_like(x) for x in local]
        count = [0]

        def step(grads):
            count[0] += 1
            for i, g in enumerate(grads):
                local[i] = local[i] - LR * g
                accumulated[i] = accumulated[i] + g
            if count[0] % period == 0:
                for i in range(len(local)):
                    center[i] = center[i] - LR * accumulated[i] / period
                    local[i] = center[i].copy()
                    accumulated[i] = np.zeros_like(local[i])
            return [x.copy() for x in local]

        return step

    return make


@dataclasses.dataclass(frozen=True)
class UnderTest:
    """One optimizer under test.

    make: builds a fresh optimizer.
    reference: `reference(weights, sparse=False)` -> `step(grads) -> weights`.
    default_name: the name Keras numbers (`lars`, then `lars_1`, ...).
    gradient_scale: what the loss scale multiplies gradients by (1 without).
    backends: the Keras backends it runs on.
    tolerance: per dtype, a tighter tolerance than the contract's own
        (tests/contract_test.py, `TOLERANCE`) where the row holds one.
    """

    make: Callable
    reference: Callable
    default_name: str
    gradient_scale: float = 1.0
    backends: tuple = ("tensorflow", "jax", "torch")
    tolerance: dict = dataclasses.field(default_factory=dict)


def _lars(config):
    import tf_lars

    return lambda: tf_lars.LARS(learning_rate=LR, **config)


def _trust_ratio(make_inner, **config):
    import tf_lars

    return lambda: tf_lars.TrustRatio(make_inner(), **config)


def _loss_scale(make_inner, dynamic):
    import tf_lars

    return lambda: tf_lars.LossScaleOptimizer(
        make_inner(), initial_scale=SCALE, dynamic=dynamic
    )


def _rows():
    import tf_lars

    rows = {}
    for name, variant in LARS_VARIANTS.items():
        config = dict(LARS_BASE, **variant)
        rows[name] = UnderTest(
            _lars(config),
            _lars_reference(config),
            "lars",
            # LARS holds no constant in float32 but its learning rate (exact
            # here): its float64 steps follow the reference to 1e-10.
            tolerance={"float64": dict(rtol=1e-10, atol=1e-10)},
        )
    rows["lamb"] = UnderTest(
        lambda: tf_lars.LAMB(
            learning_rate=LR,
            beta_1=0.8,
            beta_2=0.95,
            epsilon=1e-3,
            weight_decay=0.1,
            trust_clip=True,
        ),
        _ratio_reference(
            lambda: lamb_ref.optax_adam_direction(0.8, 0.95, 1e-3),
            weight_decay=0.1,
            trust_clip=True,
        ),
        "lamb",
        # Its betas and epsilon are Python floats: float64 steps follow the
        # reference to 1e-10 of each value.
        tolerance={"float64": dict(rtol=1e-10, atol=0)},
    )
    momentum = (
        lambda: keras.optimizers.SGD(LR, momentum=0.9),
        lambda: lamb_ref.keras_sgd_direction(LR, 0.9),
    )
    adam = (
        lambda: keras.optimizers.Adam(LR, epsilon=1e-3),
        lambda: lamb_ref.keras_adam_direction(epsilon=1e-3),
    )
    rmsprop = (
        lambda: keras.optimizers.RMSprop(LR, rho=0.9, epsilon=1e-3),
        lambda: lamb_ref.keras_rmsprop_direction(0.9, 1e-3),
    )
    ratio_flags = {"weight_decay": 0.1, "trust_clip": True, "epsilon": 1e-3}
    for name, (make_inner, direction), exclude in (
        ("trust_ratio_momentum", momentum, EXCLUDE),
        ("trust_ratio_adam", adam, {}),
        ("trust_ratio_rmsprop", rmsprop, EXCLUDE),
    ):
        rows[name] = UnderTest(
            _trust_ratio(make_inner, **ratio_flags, **exclude),
            _ratio_reference(direction, **ratio_flags, **exclude),
            "trust_ratio",
        )
    lars = dict(LARS_BASE, **LARS_VARIANTS["lars_paper"])
    for kind, dynamic in (("fixed", False), ("dynamic", True)):
        rows[f"loss_scale_{kind}_sgd"] = UnderTest(
            _loss_scale(momentum[0], dynamic),
            _ratio_reference(momentum[1], adapted=False),
            "loss_scale_optimizer",
            gradient_scale=SCALE,
        )
        rows[f"loss_scale_{kind}_lars"] = UnderTest(
            _loss_scale(_lars(lars), dynamic),
            _lars_reference(lars),
            "loss_scale_optimizer",
            gradient_scale=SCALE,
        )
    rows["agn"] = UnderTest(
        lambda: tf_lars.AGN(keras.optimizers.SGD(LR), communication_period=2),
        _agn_reference(2),
        "agn",
        backends=("tensorflow",),
    )
    return rows


def _lars_inner():
    import tf_lars

    return tf_lars.LARS(learning_rate=0.1)


#: AGN's inner optimizers in the config round trip (TensorFlow).
AGN_INNERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.5),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "lars": _lars_inner,
    "loss_scale_lars": lambda: _loss_scale(_lars_inner, True)(),
}


def under_test(backend=None):
    """The rows that run on `backend` (default: Keras's current backend)."""
    backend = backend or keras.backend.backend()
    return {n: r for n, r in _rows().items() if backend in r.backends}


def inner_chain(optimizer):
    """The optimizer and every optimizer it wraps, outermost first."""
    chain = [optimizer]
    while getattr(chain[-1], "inner_optimizer", None) is not None:
        chain.append(chain[-1].inner_optimizer)
    return chain
