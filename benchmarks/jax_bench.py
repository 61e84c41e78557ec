"""tf_lars on the JAX backend against Keras's and optax's optimizers.

    KERAS_BACKEND=jax python benchmarks/jax_bench.py [--repeats 15] [--fit-steps 40]
        [--fit-rounds 9] [--fit-model mlp|resnet50] [--only step|fit|traffic]

Step rows: one jitted optimizer step on ResNet-50's trainable shapes
(float32; the run prints their count), timed interleaved in one process
(one step of every candidate in turn, `--repeats` times), reported as the
median step and the median of the step-by-step ratios to the row's
baseline, with their interquartile range, in `benchmarks/bench.py`'s
paired table:

- tf_lars.LARS vs Keras `SGD(momentum=0.9)` vs `optax.lars` with the same
  flags (trust_ratio="decayed", nesterov off, weight decay 1e-4, eta 1e-3),
  and tf_lars.LARS with its default ratio ("paper");
- tf_lars.LAMB vs `optax.lamb`, both with weight decay 0.01, and without
  weight decay vs Keras `Lamb` (which has none in its rule), baseline Keras
  `Adam`; and tf_lars.LAMB with its norm reading the stored direction (as
  outside `jit`), to show what `tf_lars.LAMB.update_step`'s
  recomputation saves.

Keras optimizers run as the JAX trainer runs them: `stateless_apply` under
`jax.jit`, state donated in the order it is returned (weights, then the
optimizer's variables), so that each donated buffer is written in place.
Fit rows: `model.fit` throughput (samples per second) of a small MLP (or,
with `--fit-model resnet50`, `benchmarks/bench.py`'s ResNet-50 at 64x64),
LARS vs SGD, LAMB with and without weight decay vs Adam and, for
comparison, Keras `Lamb` vs Adam. Each model is compiled once; each round fits every
model one epoch in turn, and a row's ratio is the median of the rounds'
ratios (contender over baseline in the same round), with their min-max.
Traffic rows (`--only traffic`): the bytes each step row's compiled
program reads and writes per parameter, counted from its optimized HLO
(`benchmarks/hlo_traffic.py`). A benchmark, not a test: the timed numbers
depend on the machine.
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
# This checkout's tf_lars, as benchmarks/bench.py times it.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_lars  # noqa: E402
from benchmarks import bench, hlo_traffic  # noqa: E402


def resnet50_shapes():
    """ResNet-50's trainable variable shapes (keras.applications, no weights)."""
    model = keras.applications.ResNet50(weights=None)
    return [tuple(v.shape) for v in model.trainable_variables]


def _keras_step(optimizer, shapes):
    variables = [keras.Variable(np.full(s, 0.01, "float32")) for s in shapes]
    optimizer.build(variables)
    grads = [jnp.full(s, 1e-3, jnp.float32) for s in shapes]

    # The donated arguments come in the order `stateless_apply` returns
    # them, as in the JAX trainer's `train_step(state, data)`: JAX pairs a
    # donated buffer with the next output of its shape, so the order
    # `stateless_apply(opt, grads, train)` takes would pair a weight with a
    # moment and copy every tensor once more (measured: Keras Adam's step
    # over ResNet-50's large kernels 83 ms with the copies).
    def apply(train, opt, grads):
        return optimizer.stateless_apply(opt, grads, train)

    apply = jax.jit(apply, donate_argnums=(0, 1))
    state = {
        "opt": [v.value for v in optimizer.variables],
        "train": [v.value for v in variables],
    }

    def step():
        state["train"], state["opt"] = apply(state["train"], state["opt"], grads)
        jax.block_until_ready(state["train"])

    step.hlo = lambda: _optimized_hlo(apply, state["train"], state["opt"], grads)
    return step


def _optax():
    """optax, imported where a row needs it (the fit part runs without it)."""
    import optax

    return optax


def _optax_step(transform, shapes):
    optax = _optax()
    params = [jnp.full(s, 0.01, jnp.float32) for s in shapes]
    grads = [jnp.full(s, 1e-3, jnp.float32) for s in shapes]
    state = {"params": params, "opt": transform.init(params)}

    def update(params, opt_state, grads):
        updates, opt_state = transform.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    update = jax.jit(update, donate_argnums=(0, 1))

    def step():
        state["params"], state["opt"] = update(state["params"], state["opt"], grads)
        jax.block_until_ready(state["params"])

    step.hlo = lambda: _optimized_hlo(update, state["params"], state["opt"], grads)
    return step


def _optimized_hlo(jitted, *args):
    """The optimized HLO text XLA compiles `jitted(*args)` to."""
    return jitted.lower(*args).compile().as_text()


def _report(title, times):
    """`benchmarks/bench.py`'s paired table; the first row is the baseline."""
    names = tuple(times)
    bench._print_paired_table(title, times, ((names[0], names[1:]),))


def lars_steps(shapes):
    """The LARS rows' steps, baseline first (see the module docstring)."""
    lr, wd = 0.1, 1e-4
    return {
        "keras SGD(momentum)": _keras_step(
            keras.optimizers.SGD(lr, momentum=0.9), shapes
        ),
        "tf_lars LARS (decayed)": _keras_step(
            tf_lars.LARS(lr, momentum=0.9, weight_decay=wd, trust_ratio="decayed"),
            shapes,
        ),
        "tf_lars LARS (paper, default)": _keras_step(
            tf_lars.LARS(lr, momentum=0.9, weight_decay=wd), shapes
        ),
        "optax lars": _optax_step(
            _optax().lars(lr, weight_decay=wd, trust_coefficient=0.001, momentum=0.9),
            shapes,
        ),
    }


def lamb_steps(shapes):
    """The LAMB rows' steps, baseline first (see the module docstring)."""
    stored = tf_lars.LAMB(1e-3, weight_decay=0.01)
    # The norm reads the stored direction, as outside `jit` (the row shows
    # what LAMB's recomputation for its norm saves).
    bench.with_method(stored, "_recomputes_for_norms", lambda direction: False)
    return {
        "keras Adam": _keras_step(keras.optimizers.Adam(1e-3), shapes),
        "tf_lars LAMB (wd 0.01)": _keras_step(
            tf_lars.LAMB(1e-3, weight_decay=0.01), shapes
        ),
        "tf_lars LAMB (wd 0.01, stored)": _keras_step(stored, shapes),
        "optax lamb (wd 0.01)": _optax_step(
            _optax().lamb(1e-3, weight_decay=0.01), shapes
        ),
        "tf_lars LAMB (wd 0)": _keras_step(tf_lars.LAMB(1e-3), shapes),
        "keras Lamb (no wd)": _keras_step(keras.optimizers.Lamb(1e-3), shapes),
    }


def _shapes():
    shapes = resnet50_shapes()
    size = sum(int(np.prod(s)) for s in shapes)
    print(f"{len(shapes)} trainable tensors, {size / 1e6:.1f}M parameters")
    return shapes, size


def step_rows(repeats):
    shapes, _ = _shapes()
    _report(
        "LARS step, ResNet-50 shapes, jit",
        bench._turns(lars_steps(shapes), repeats, warmup=2),
    )
    _report(
        "LAMB step, ResNet-50 shapes, jit",
        bench._turns(lamb_steps(shapes), repeats, warmup=2),
    )


def traffic_rows():
    """Bytes each row's jitted step moves per parameter, counted from its
    optimized HLO (`benchmarks/hlo_traffic.py`); nothing is timed."""
    shapes, size = _shapes()
    rows, groups = {}, []
    for steps in (lars_steps(shapes), lamb_steps(shapes)):
        names = list(steps)
        groups.append((names[0], tuple(names[1:])))
        for name, step in steps.items():
            rows[name] = hlo_traffic.traffic(step.hlo())
    bench.print_traffic_table(
        "Bytes each jitted step moves, ResNet-50 shapes (optimized HLO)",
        rows,
        groups,
        size,
    )


#: The fit part's models (`--fit-model`): name -> (batch size, description).
FIT_MODELS = {
    # Dense layers only: the optimizer's share of a step is large here.
    "mlp": (256, "MLP 512-1024-1024-10, mean squared error, batch 256"),
    # benchmarks/bench.py's TensorFlow fit model, so the backends compare
    # like for like.
    "resnet50": (
        32,
        "keras.applications.ResNet50(weights=None) at 64x64, 10 classes, batch 32",
    ),
}


def _fit_data(kind, steps):
    """`(x, y)`: `steps` batches of random data for the fit model `kind`."""
    rng = np.random.default_rng(0)
    size = FIT_MODELS[kind][0] * steps
    if kind == "mlp":
        x = rng.normal(size=(size, 512)).astype("float32")
        return x, rng.normal(size=(size, 10)).astype("float32")
    x = rng.normal(size=(size, 64, 64, 3)).astype("float32")
    return x, rng.integers(0, 10, size=size)


def _fit_network(kind):
    """The uncompiled fit model `kind` and its loss."""
    if kind == "mlp":
        network = keras.Sequential(
            [
                keras.Input((512,)),
                keras.layers.Dense(1024, activation="relu"),
                keras.layers.Dense(1024, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        return network, "mse"
    # The network benchmarks/bench.py fits on TensorFlow, from its own code.
    network = bench._fit_model("resnet50", 64)
    return network, keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _fit_model(make_optimizer, x, y, kind="mlp"):
    """The fit model `kind` compiled with `make_optimizer()` (the JAX
    trainer's jitted step), after one warm-up epoch."""
    keras.utils.set_random_seed(0)
    model, loss = _fit_network(kind)
    model.compile(optimizer=make_optimizer(), loss=loss, jit_compile=True)
    model.fit(x, y, batch_size=FIT_MODELS[kind][0], epochs=1, verbose=0)  # compile
    return model


def _fit_rate(model, x, y, kind="mlp"):
    """Samples per second of one `model.fit` epoch."""
    start = time.perf_counter()
    model.fit(x, y, batch_size=FIT_MODELS[kind][0], epochs=1, verbose=0)
    return len(x) / (time.perf_counter() - start)


#: The fit rows: row name -> (baseline, contender), keys of `_fit_optimizers()`.
FIT_PAIRS = {
    "LARS vs SGD(momentum)": ("SGD(momentum)", "LARS"),
    "LAMB (wd 0.01) vs Adam": ("Adam", "LAMB (wd 0.01)"),
    "LAMB (wd 0) vs Adam": ("Adam", "LAMB (wd 0)"),
    # Keras's own LAMB on the same model: what any LAMB costs here.
    "keras Lamb vs Adam": ("Adam", "keras Lamb"),
}


def _fit_optimizers():
    """Name -> factory of each optimizer the fit rows compare."""
    return {
        "SGD(momentum)": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        "LARS": lambda: tf_lars.LARS(0.1, momentum=0.9, weight_decay=1e-4),
        "Adam": lambda: keras.optimizers.Adam(1e-3),
        "LAMB (wd 0.01)": lambda: tf_lars.LAMB(1e-3, weight_decay=0.01),
        "LAMB (wd 0)": lambda: tf_lars.LAMB(1e-3),
        "keras Lamb": lambda: keras.optimizers.Lamb(1e-3),
    }


def _rate(samples_per_second):
    """A rate as the table prints it: one decimal below 100 samples/s."""
    digits = 1 if samples_per_second < 100 else 0
    return f"{samples_per_second:.{digits}f}"


def fit_rows(steps, rounds=9, kind="mlp"):
    """Prints the fit table of the model `kind` (a key of `FIT_MODELS`);
    returns `{row: (baseline, contender, ratios)}`:
    the baseline's and the contender's median samples per second, and the
    contender's rate over the baseline's in each round.

    Every model is built and compiled once; then each round fits every
    model one epoch of `steps` batches, in turn. A row's ratio is the
    median over rounds of the contender's rate over its baseline's in the
    same round (the two epochs seconds apart), with the rounds' min-max.
    """
    x, y = _fit_data(kind, steps)
    models = {}
    for name, make in _fit_optimizers().items():
        print(f"  compiling the fit model with {name}", file=sys.stderr)
        models[name] = _fit_model(make, x, y, kind)
    rates = {name: [] for name in models}
    for done in range(rounds):
        for name, model in models.items():
            rates[name].append(_fit_rate(model, x, y, kind))
        print(f"  fit round {done + 1}/{rounds}", file=sys.stderr)
    print(
        f"\nmodel.fit throughput, {FIT_MODELS[kind][1]}, jit, "
        f"{steps} steps an epoch, {rounds} rounds"
    )
    print(
        f"{'pair':<24}{'baseline samples/s':>20}{'contender samples/s':>20}"
        f"{'ratio':>8}{'rounds':>14}"
    )
    table = {}
    for row, (baseline, contender) in FIT_PAIRS.items():
        ratios = [
            ours / base
            for ours, base in zip(rates[contender], rates[baseline], strict=True)
        ]
        base, ours = (
            statistics.median(rates[baseline]),
            statistics.median(rates[contender]),
        )
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
        print(
            f"{row:<24}{_rate(base):>20}{_rate(ours):>20}"
            f"{statistics.median(ratios):>8.2f}{spread:>14}"
        )
        table[row] = (base, ours, ratios)
    return table


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--fit-steps", type=int, default=40, help="batches an epoch")
    parser.add_argument(
        "--fit-rounds",
        "--fit-epochs",  # the option's earlier name
        dest="fit_rounds",
        type=int,
        default=9,
        help="fit rounds: each fits every model one epoch, in turn",
    )
    parser.add_argument(
        "--fit-model",
        choices=list(FIT_MODELS),
        default="mlp",
        help="the fit rows' model: the MLP (default) or ResNet-50 at 64x64, "
        "benchmarks/bench.py's fit model",
    )
    parser.add_argument(
        "--only",
        choices=["step", "fit", "traffic"],
        help="only the step rows, the fit rows or the traffic rows (bytes moved)",
    )
    args = parser.parse_args(argv)
    if min(args.repeats, args.fit_steps, args.fit_rounds) < 1:
        parser.error(
            "--repeats, --fit-steps and --fit-rounds must be >= 1. Received: "
            f"--repeats {args.repeats} --fit-steps {args.fit_steps} "
            f"--fit-rounds {args.fit_rounds}"
        )
    try:
        optax_version = _optax().__version__
    except ImportError:
        if args.only != "fit":  # the step and traffic rows compare with optax
            parser.error("the step and traffic rows need optax: pip install optax")
        optax_version = "not installed"
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}, keras "
        f"{keras.__version__}, optax {optax_version}"
    )
    if args.only in (None, "step"):
        step_rows(args.repeats)
    if args.only in (None, "traffic"):
        traffic_rows()
    if args.only in (None, "fit"):
        fit_rows(args.fit_steps, args.fit_rounds, args.fit_model)


if __name__ == "__main__":
    main()
