"""Optimizer step benchmarks: `python benchmarks/bench.py [--help]`.

Not part of the installed package: run it from a source checkout (it puts
the checkout first on the import path, so it times the checkout's tf_lars).

Measures, in one process, the median step time of `tf_lars.LARS` against
`keras.optimizers.SGD(momentum=0.9)` on ResNet-50's trainable variable shapes
(both as `tf.function(jit_compile=True)` of `optimizer.apply`), an eager
`optimizer.apply` against the compiled one, and the sparse path on a large
embedding. Prints a table. Timings vary with the machine and its load; the
ratios printed are the figures to compare.
"""

import argparse
import functools
import math
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def _median_seconds(step, repeats, warmup):
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def resnet50_shapes():
    """Trainable variable shapes of `keras.applications.ResNet50(weights=None)`."""
    import keras

    model = keras.applications.ResNet50(weights=None)
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    del model
    keras.backend.clear_session()
    return shapes


TINY_SHAPES = [(3, 3, 8, 16), (16,), (64, 10), (10,)]


def _dense_problem(shapes, seed=0):
    import keras
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    variables = [
        keras.Variable(rng.normal(scale=0.05, size=s).astype("float32"), name=f"w{i}")
        for i, s in enumerate(shapes)
    ]
    grads = [
        tf.constant(rng.normal(scale=1e-3, size=s).astype("float32")) for s in shapes
    ]
    return variables, grads


def _compiled_apply(optimizer, variables):
    import tensorflow as tf

    optimizer.build(variables)

    @tf.function(jit_compile=True)
    def step(grads):
        optimizer.apply(grads, variables)
        return optimizer.iterations

    return step


def _compiled_apply_to(optimizer, variables, grads, jit_compile=True):
    import tensorflow as tf

    @tf.function(jit_compile=jit_compile)
    def step():
        optimizer.apply(grads, variables)
        return optimizer.iterations

    return step


def _done(result):
    # Fetching the step's small output waits for the step, and nothing more:
    # reading a large variable back could copy it (copy-on-read after scatters).
    return result.numpy()


def _turns(steps, repeats, warmup):
    """Times `{name: step}` (callables) one step of each in turn, `repeats`
    times, after `warmup` untimed turns, so that drifting machine load hits
    neighbours alike. Returns `{name: [seconds, one per turn]}`, for
    `_print_paired_table`'s paired ratios."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    samples = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            samples[name].append(time.perf_counter() - start)
    return samples


def _compiled_steps(contenders, shapes):
    steps = {}
    for name, make in contenders.items():
        variables, grads = _dense_problem(shapes)
        step = _compiled_apply(make(), variables)
        _done(step(grads))  # traced and compiled here, with the norms as set
        steps[name] = lambda s=step, g=grads: _done(s(g))
    return steps


# Every benchmark row's optimizer, by row name; a row named
# "<name>, reduce_sum norms" is <name> with the portable norms
# (`tf_lars._trust.norms`) in place of TensorFlow's folded ones.
REFERENCE_NORMS = ", reduce_sum norms"
# "<name>, direction stored for its norm": a LAMB row whose norm under XLA
# reads the stored direction (`tf_lars.LAMB.update_step` says why it
# does not).
STORED_DIRECTION = ", direction stored for its norm"


def make_optimizer(name):
    """A fresh optimizer for the benchmark row `name`."""
    import keras

    import tf_lars

    makers = {
        "SGD(momentum=0.9)": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        "LARS(weight_decay=1e-4)": lambda: tf_lars.LARS(
            0.1, momentum=0.9, weight_decay=1e-4
        ),
        "LARS(weight_decay=0)": lambda: tf_lars.LARS(0.1, momentum=0.9),
        "LARS(trust_ratio='decayed', weight_decay=1e-4)": lambda: tf_lars.LARS(
            0.1, momentum=0.9, weight_decay=1e-4, trust_ratio="decayed"
        ),
        "Adam": lambda: keras.optimizers.Adam(1e-3),
        "keras Lamb": lambda: keras.optimizers.Lamb(1e-3),
        "tf_lars.LAMB(weight_decay=0.01)": lambda: tf_lars.LAMB(
            1e-3, weight_decay=0.01
        ),
        "tf_lars.LAMB(weight_decay=0)": lambda: tf_lars.LAMB(1e-3),
        NOISE_SCALE_BASELINE: lambda: keras.optimizers.SGD(
            0.1, momentum=0.9, gradient_accumulation_steps=NOISE_SCALE_STEPS
        ),
        NOISE_SCALE_ROW: lambda: tf_lars.GradientNoiseScale(
            keras.optimizers.SGD(0.1, momentum=0.9),
            batch_size=32,
            gradient_accumulation_steps=NOISE_SCALE_STEPS,
        ),
    }
    base = name.removesuffix(REFERENCE_NORMS).removesuffix(STORED_DIRECTION)
    optimizer = makers[base]()
    if name.endswith(REFERENCE_NORMS):
        from tf_lars import _trust

        with_method(optimizer, "_norms", _trust.norms)
    if name.endswith(STORED_DIRECTION):
        with_method(optimizer, "_recomputes_for_norms", lambda direction: False)
    return optimizer


def with_method(optimizer, name, replacement):
    """`optimizer` with its method `name` replaced by `replacement`.

    A benchmark row's variant (the portable norms, the stored direction):
    the library has no switch for it, so the benchmark overrides the
    method on this optimizer alone (an instance attribute).
    """
    object.__setattr__(optimizer, name, replacement)
    return optimizer


def _makers(names):
    return {name: functools.partial(make_optimizer, name) for name in names}


#: The XLA tables' rows: (baseline, contenders) per group.
DENSE_GROUPS = (
    (
        "SGD(momentum=0.9)",
        (
            "LARS(weight_decay=1e-4)",
            "LARS(weight_decay=0)",
            "LARS(trust_ratio='decayed', weight_decay=1e-4)",
            "LARS(weight_decay=1e-4)" + REFERENCE_NORMS,
        ),
    ),
)
ADAPTIVE_GROUPS = (
    (
        "Adam",
        (
            "keras Lamb",
            "tf_lars.LAMB(weight_decay=0.01)",
            "tf_lars.LAMB(weight_decay=0)",
            "tf_lars.LAMB(weight_decay=0.01)" + STORED_DIRECTION,
        ),
    ),
)


def bench_xla(groups, shapes, repeats, warmup):
    """`groups`' rows as `tf.function(jit_compile=True)` of `apply` on
    `shapes`, timed in turns (`_turns`): `{name: [seconds per turn]}`.

    A "reduce_sum norms" row is LARS with each norm as one
    `reduce_sum(square(x))`: what `tf_lars.backend.tensorflow` replaces (its
    docstring says why); a "direction stored" row is LAMB whose norm reads
    its stored direction.
    """
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")  # the same Python step traced per row
    names = [name for baseline, group in groups for name in (baseline, *group)]
    return _turns(_compiled_steps(_makers(names), shapes), repeats, warmup)


NO_XLA_GROUPS = (
    (
        "SGD(momentum=0.9)",
        ("LARS(weight_decay=1e-4)", "LARS(weight_decay=1e-4)" + REFERENCE_NORMS),
    ),
    (
        "Adam",
        (
            "keras Lamb",
            "tf_lars.LAMB(weight_decay=0.01)",
            "tf_lars.LAMB(weight_decay=0)",
        ),
    ),
)


def bench_no_xla(shapes, repeats, warmup):
    """The dense steps as `tf.function` without XLA (`model.fit` on a CPU).

    One step of each contender in turn, `repeats` times, so that machine
    load hits neighbours alike. Returns `{name: [seconds, one per turn]}`.
    """
    names = [name for baseline, group in NO_XLA_GROUPS for name in (baseline, *group)]
    # Seven functions of the same Python code traced in a row: TensorFlow
    # warns about retracing, which is expected here.
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    steps = {}
    for name in names:
        variables, grads = _dense_problem(shapes)
        optimizer = make_optimizer(name)
        optimizer.build(variables)
        step = _compiled_apply_to(optimizer, variables, grads, jit_compile=False)
        for _ in range(max(1, warmup)):  # the first call traces
            _done(step())
        steps[name] = lambda s=step: _done(s())
    return _turns(steps, repeats, warmup=0)


TRAFFIC_GROUPS = (
    (
        "SGD(momentum=0.9)",
        (
            "LARS(weight_decay=1e-4)",
            "LARS(weight_decay=0)",
            "LARS(trust_ratio='decayed', weight_decay=1e-4)",
        ),
    ),
    (
        "Adam",
        (
            "keras Lamb",
            "tf_lars.LAMB(weight_decay=0.01)",
            "tf_lars.LAMB(weight_decay=0)",
            "tf_lars.LAMB(weight_decay=0.01)" + STORED_DIRECTION,
        ),
    ),
)


def bench_traffic(shapes):
    """Bytes each XLA-compiled dense step moves (`benchmarks/hlo_traffic.py`).

    Compiles `tf.function(jit_compile=True)` of `apply` for each row of
    `TRAFFIC_GROUPS` and counts the optimized HLO; nothing is timed.
    Returns `{name: hlo_traffic.Traffic}`.
    """
    from benchmarks import hlo_traffic

    rows = {}
    for baseline, group in TRAFFIC_GROUPS:
        for name in (baseline, *group):
            variables, grads = _dense_problem(shapes)
            step = _compiled_apply(make_optimizer(name), variables)
            text = step.experimental_get_compiler_ir(grads)(stage="optimized_hlo")
            rows[name] = hlo_traffic.traffic(text)
    return rows


def print_traffic_table(title, rows, groups, parameters):
    """Bytes read, written and in all per parameter, and the ratio of the
    total to the group's baseline (the first row of each group)."""
    print(f"\n{title}")
    width = max(len(name) for name in rows) + 2
    header = f"{'read':>8}{'written':>9}{'total':>8}{'ratio':>9}"
    print(f"{'bytes per parameter':{width}}{header}")
    for baseline, group in groups:
        base = rows[baseline].total
        for name in (baseline, *group):
            row = rows[name]
            print(
                f"{name:{width}}{row.read / parameters:>8.2f}"
                f"{row.written / parameters:>9.2f}{row.total / parameters:>8.2f}"
                f"{row.total / base:>8.2f}x"
            )


def _print_paired_table(title, rows, groups, unpaired=None):
    """Median step per row and the median of its paired ratios to the baseline.

    `unpaired` (`{name: (seconds, baseline)}`), if given, is printed after,
    with the ratio of its median to the baseline's (timed apart: not paired).
    """
    print(f"\n{title}")
    width = max(len(name) for name in [*rows, *(unpaired or ())]) + 2
    print(f"{'':{width}}{'median step (ms)':>18}{'ratio':>10}{'ratio IQR':>16}")
    for baseline, group in groups:
        for name in (baseline, *group):
            ratios = sorted(
                c / b for b, c in zip(rows[baseline], rows[name], strict=True)
            )
            # Inclusive quartiles stay within the data; the default
            # ("exclusive") extrapolates beyond it for few samples.
            quartiles = (
                statistics.quantiles(ratios, n=4, method="inclusive")
                if len(ratios) > 1
                else ratios * 3
            )
            print(
                f"{name:{width}}{statistics.median(rows[name]) * 1e3:>18.2f}"
                f"{statistics.median(ratios):>9.2f}x"
                f"{f'{quartiles[0]:.2f}-{quartiles[-1]:.2f}':>16}"
            )
    for name, (seconds, baseline) in (unpaired or {}).items():
        ratio = seconds / statistics.median(rows[baseline])
        print(f"{name:{width}}{seconds * 1e3:>18.2f}{ratio:>9.2f}x{'not paired':>16}")


def _bench_optax(shapes, repeats, warmup, lamb=False):
    try:
        import jax
        import jax.numpy as jnp
        import optax
    except ImportError:
        return None
    import numpy as np

    rng = np.random.default_rng(0)
    params = [jnp.asarray(rng.normal(scale=0.05, size=s), jnp.float32) for s in shapes]
    grads = [jnp.asarray(rng.normal(scale=1e-3, size=s), jnp.float32) for s in shapes]
    if lamb:
        optimizer = optax.lamb(1e-3, weight_decay=0.01)
    else:
        optimizer = optax.lars(0.1, weight_decay=1e-4, momentum=0.9)
    state = optimizer.init(params)

    @jax.jit
    def step(params, state, grads):
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    holder = {"params": params, "state": state}

    def run():
        holder["params"], holder["state"] = step(
            holder["params"], holder["state"], grads
        )
        jax.block_until_ready(holder["params"])

    return _median_seconds(run, repeats, warmup)


def bench_eager_vs_compiled(shapes, repeats, warmup):
    import tf_lars

    results = {}
    for label, compiled in (
        ("LARS eager apply (op by op)", False),
        ("LARS eager apply (compiled)", True),
    ):
        variables, grads = _dense_problem(shapes)
        optimizer = tf_lars.LARS(0.1, momentum=0.9, weight_decay=1e-4)
        optimizer.jit_compile = compiled
        results[label] = _median_seconds(
            lambda o=optimizer, g=grads, v=variables: (
                o.apply(g, v),
                _done(o.iterations),
            ),
            repeats,
            warmup,
        )
    return results


def bench_sparse(rows, width, touched, repeats, warmup, jit_compile):
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_lars

    rng = np.random.default_rng(0)
    indices = tf.constant(rng.integers(0, rows, size=touched), tf.int32)
    values = tf.constant(rng.normal(size=(touched, width)).astype("float32"))
    grad = tf.IndexedSlices(values, indices, tf.constant([rows, width]))
    results = {}
    for name, make in (
        ("SGD(momentum=0.9) sparse", lambda: keras.optimizers.SGD(0.1, momentum=0.9)),
        ("LARS sparse", lambda: tf_lars.LARS(0.1, momentum=0.9)),
    ):
        table = keras.Variable(tf.zeros((rows, width)), name="embedding")
        optimizer = make()
        optimizer.build([table])
        step = _compiled_apply_to(optimizer, [table], [grad], jit_compile)
        results[name] = _median_seconds(lambda s=step: _done(s()), repeats, warmup)
        del table, optimizer, step
    return results


FIT_CONTENDERS = (
    "SGD(momentum=0.9)",
    "LARS(weight_decay=1e-4)",
    "Adam",
    "keras Lamb",
    "tf_lars.LAMB(weight_decay=0.01)",
)


# The `noise-scale` part: training steps with gradient accumulation, the same
# SGD-momentum alone and inside `tf_lars.GradientNoiseScale` (what measuring
# costs a step).
NOISE_SCALE_STEPS = 4
NOISE_SCALE_BASELINE = f"SGD(momentum=0.9), {NOISE_SCALE_STEPS} micro-batches"
NOISE_SCALE_ROW = (
    f"GradientNoiseScale(SGD(momentum=0.9)), {NOISE_SCALE_STEPS} micro-batches"
)


def _fit_model(model, size):
    import keras

    if model == "resnet50":
        return keras.applications.ResNet50(
            weights=None,
            input_shape=(size, size, 3),
            classes=10,
            classifier_activation=None,
        )
    return keras.Sequential(
        [
            keras.Input((size, size, 3)),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ]
    )


def bench_fit(model, size, batch, steps, rounds, jit_compile):
    """`model.fit` throughput (examples/s) per optimizer, interleaved rounds.

    Every optimizer trains its own copy of the same model (same seed) on the
    same random data; each round runs one `fit` of `steps` batches per
    optimizer, in turn (the order rotates from round to round, so no
    optimizer always runs first or last), and keeps the median time between
    consecutive batch starts (the first batch of a `fit`, which also sets up
    the input, is left out). Returns `{name: [seconds per step, one per
    round]}`: a contender and its baseline of the same round ran seconds
    apart, so their ratio is the figure that machine load disturbs least.
    """
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * steps, size, size, 3)).astype("float32")
    y = rng.integers(0, 10, size=batch * steps)

    class Timer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.starts = []

        def on_train_batch_begin(self, batch, logs=None):
            self.starts.append(time.perf_counter())

        def on_train_end(self, logs=None):
            self.starts.append(time.perf_counter())

    models = {}
    for name in FIT_CONTENDERS:
        keras.utils.set_random_seed(0)
        network = _fit_model(model, size)
        network.compile(
            optimizer=make_optimizer(name),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=jit_compile,
        )
        # Traces (and with XLA compiles) the train step.
        network.fit(x[: 2 * batch], y[: 2 * batch], batch_size=batch, verbose=0)
        models[name] = network
    samples = {name: [] for name in models}
    names = list(models)
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            network = models[name]
            timer = Timer()
            network.fit(
                x,
                y,
                batch_size=batch,
                epochs=1,
                verbose=0,
                shuffle=False,
                callbacks=[timer],
            )
            gaps = [b - a for a, b in zip(timer.starts[1:], timer.starts[2:])]
            samples[name].append(statistics.median(gaps))
    return samples


def bench_noise_scale(model, size, batch, cycles):
    """Training steps (`train_on_batch`, no XLA) with and without the wrapper.

    Each model trains on the same random batches; one accumulation cycle
    (`NOISE_SCALE_STEPS` steps, one update) of each in turn, so that machine
    load hits both alike. Returns `{name: [seconds per step, one per cycle]}`.
    """
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, size, size, 3)).astype("float32")
    y = rng.integers(0, 10, size=batch)
    models = {}
    for name in (NOISE_SCALE_BASELINE, NOISE_SCALE_ROW):
        keras.utils.set_random_seed(0)
        network = _fit_model(model, size)
        network.compile(
            optimizer=make_optimizer(name),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=False,
        )
        for _ in range(NOISE_SCALE_STEPS):  # traces the train step
            network.train_on_batch(x, y)
        models[name] = network
    samples = {name: [] for name in models}
    for _ in range(cycles):
        for name, network in models.items():
            start = time.perf_counter()
            for _ in range(NOISE_SCALE_STEPS):
                network.train_on_batch(x, y)
            seconds = time.perf_counter() - start
            samples[name].append(seconds / NOISE_SCALE_STEPS)
    return samples


def _seconds(value):
    """`(median, low, high)` from a row: a tuple, or one sequential median."""
    if isinstance(value, tuple):
        return value
    return value, None, None


def _print_table(title, rows, baseline):
    print(f"\n{title}")
    width = max(len(name) for name in rows) + 2
    print(f"{'':{width}}{'median step (ms)':>18}{'ratio':>10}{'spread (ms)':>22}")
    base = _seconds(rows[baseline])[0]
    for name, value in rows.items():
        seconds, low, high = _seconds(value)
        spread = "" if low is None else f"{low * 1e3:.2f}-{high * 1e3:.2f}"
        print(
            f"{name:{width}}{seconds * 1e3:>18.2f}{seconds / base:>10.2f}x{spread:>22}"
        )


def _print_fit_table(title, rows, batch):
    """Throughput per optimizer and its ratio to the group's baseline.

    `rows` is `{name: [seconds per step, one per round]}`. The ratio is the
    median over rounds of the baseline's step time over the contender's in
    the same round (paired), with the lowest and highest round's ratio.
    """
    print(f"\n{title}")
    width = max(len(name) for name in rows) + 2
    print(
        f"{'':{width}}{'examples/s':>12}{'step (ms)':>12}"
        f"{'vs baseline':>13}{'ratio range':>16}"
    )
    for baseline, group in (
        ("SGD(momentum=0.9)", FIT_CONTENDERS[:2]),
        ("Adam", FIT_CONTENDERS[2:]),
    ):
        for name in group:
            seconds = statistics.median(rows[name])
            ratios = [b / c for b, c in zip(rows[baseline], rows[name], strict=True)]
            spread = f"{min(ratios):.3f}-{max(ratios):.3f}"
            print(
                f"{name:{width}}{batch / seconds:>12.1f}{seconds * 1e3:>12.1f}"
                f"{statistics.median(ratios):>12.3f}x{spread:>16}"
            )


def parse_arguments(argv=None):
    """The parsed benchmark arguments; a bad one exits with status 2."""
    parser = argparse.ArgumentParser(
        prog="bench.py", description="tf_lars optimizer step benchmarks."
    )
    parser.add_argument("--repeats", type=int, default=20, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument(
        "--only",
        choices=[
            "dense",
            "adaptive",
            "no-xla",
            "eager",
            "sparse",
            "traffic",
            "fit",
            "noise-scale",
        ],
        action="append",
        help="run only these parts (repeatable); default: all but fit and "
        "noise-scale (which take the --fit-* options)",
    )
    parser.add_argument(
        "--model",
        choices=["resnet50", "tiny"],
        default="resnet50",
        help="variable shapes for the dense parts (tiny: a smoke test)",
    )
    parser.add_argument(
        "--fit-model",
        choices=["resnet50", "tiny"],
        default="resnet50",
        help="fit: keras.applications.ResNet50(weights=None), or a tiny CNN",
    )
    parser.add_argument("--fit-size", type=int, default=64, help="fit: image side")
    parser.add_argument("--fit-batch", type=int, default=32, help="fit: batch size")
    parser.add_argument(
        "--fit-steps", type=int, default=8, help="fit: batches per fit (>= 3)"
    )
    parser.add_argument("--fit-rounds", type=int, default=3, help="fit: rounds")
    parser.add_argument(
        "--fit-jit",
        choices=["off", "on", "both"],
        default="off",
        help="fit: jit_compile=False (Keras's CPU default), True, or both",
    )
    parser.add_argument("--rows", type=int, default=1_000_000, help="embedding rows")
    parser.add_argument("--width", type=int, default=64, help="embedding width")
    parser.add_argument("--touched", type=int, default=4096, help="rows per step")
    parser.add_argument(
        "--no-optax", action="store_true", help="skip optax even if installed"
    )
    parser.add_argument(
        "--tf-log",
        action="store_true",
        help="leave TensorFlow's C++ logging on (by default TF_CPP_MIN_LOG_LEVEL=3 "
        "unless set in the environment)",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error(
            "--repeats must be >= 1 and --warmup >= 0. "
            f"Received: --repeats {args.repeats} --warmup {args.warmup}"
        )
    if args.fit_steps < 3 or args.fit_rounds < 1 or args.fit_batch < 1:
        parser.error(
            "--fit-steps must be >= 3, --fit-rounds >= 1 and --fit-batch >= 1. "
            f"Received: --fit-steps {args.fit_steps} --fit-rounds "
            f"{args.fit_rounds} --fit-batch {args.fit_batch}"
        )
    return args


def main(argv=None):
    """Runs the benchmarks and prints their tables.

    Args:
        argv: list of str, the arguments (see `--help`). Defaults to
            `sys.argv[1:]`.

    Returns:
        The exit status, 0. A bad argument exits with status 2 (argparse).
    """
    args = parse_arguments(argv)
    parts = args.only or ["dense", "adaptive", "no-xla", "eager", "sparse", "traffic"]

    from tf_lars.cli import import_tensorflow, set_tensorflow_log_level

    set_tensorflow_log_level(args.tf_log)
    tf = import_tensorflow()

    print(
        f"tf_lars bench: TensorFlow {tf.__version__}, {os.cpu_count()} CPU cores, "
        f"repeats={args.repeats}",
        flush=True,
    )
    shapes = None
    if any(
        part in parts for part in ("dense", "adaptive", "no-xla", "eager", "traffic")
    ):
        shapes = resnet50_shapes() if args.model == "resnet50" else TINY_SHAPES
        parameters = sum(math.prod(s) for s in shapes)
        print(
            f"{args.model} trainable variables: {len(shapes)} "
            f"({parameters:,} parameters)"
        )
    for part, groups, lamb in (
        ("dense", DENSE_GROUPS, False),
        ("adaptive", ADAPTIVE_GROUPS, True),
    ):
        if part not in parts:
            continue
        names = ", ".join(baseline for baseline, _ in groups)
        print(f"\n{part}: timing {names} and their contenders (XLA) ...", flush=True)
        rows = bench_xla(groups, shapes, args.repeats, args.warmup)
        optax_time = (
            None
            if args.no_optax
            else _bench_optax(shapes, args.repeats, args.warmup, lamb)
        )
        name = f"optax.{'lamb' if lamb else 'lars'} (JAX, jit)"
        _print_paired_table(
            f"{'Adaptive dense' if lamb else 'Dense'} step, {args.model} shapes, "
            f"tf.function(jit_compile=True) of apply, {args.repeats} interleaved "
            "steps each; ratio: median of step-by-step ratios to the group's first row",
            rows,
            groups,
            None if optax_time is None else {name: (optax_time, groups[0][0])},
        )
    if "no-xla" in parts:
        print("\nno-xla: timing the dense steps without XLA ...", flush=True)
        rows = bench_no_xla(shapes, args.repeats, args.warmup)
        _print_paired_table(
            f"Dense step, {args.model} shapes, tf.function without XLA "
            f"(model.fit's CPU default), {args.repeats} interleaved steps each; "
            "ratio: median of step-by-step ratios to the group's first row",
            rows,
            NO_XLA_GROUPS,
        )
    if "eager" in parts:
        print("\neager: timing eager apply, op by op and compiled ...", flush=True)
        rows = bench_eager_vs_compiled(shapes, max(3, args.repeats // 4), 2)
        _print_table(
            f"Eager optimizer.apply, {args.model} shapes",
            rows,
            "LARS eager apply (compiled)",
        )
    if "sparse" in parts:
        for jit_compile, mode in ((True, "XLA"), (False, "tf.function, no XLA")):
            print(f"\nsparse: timing the embedding update ({mode}) ...", flush=True)
            rows = bench_sparse(
                args.rows,
                args.width,
                args.touched,
                args.repeats,
                args.warmup,
                jit_compile,
            )
            _print_table(
                f"Sparse step, {args.rows:,} x {args.width} embedding, "
                f"{args.touched} touched rows, {mode}",
                rows,
                "LARS sparse",
            )
    if "traffic" in parts:
        print("\ntraffic: compiling the dense steps (nothing timed) ...", flush=True)
        print_traffic_table(
            f"Bytes each XLA-compiled step moves, {args.model} shapes "
            "(optimized HLO, benchmarks/hlo_traffic.py)",
            bench_traffic(shapes),
            TRAFFIC_GROUPS,
            parameters,
        )
    if "fit" in parts:
        modes = {"off": [False], "on": [True], "both": [False, True]}[args.fit_jit]
        for jit_compile in modes:
            print(
                f"\nfit: model.fit throughput, {args.fit_model} "
                f"{args.fit_size}x{args.fit_size}, batch {args.fit_batch}, "
                f"jit_compile={jit_compile} ...",
                flush=True,
            )
            rows = bench_fit(
                args.fit_model,
                args.fit_size,
                args.fit_batch,
                args.fit_steps,
                args.fit_rounds,
                jit_compile,
            )
            _print_fit_table(
                f"model.fit, {args.fit_model} {args.fit_size}x{args.fit_size}, "
                f"batch {args.fit_batch}, jit_compile={jit_compile}, "
                f"{args.fit_rounds} rounds of {args.fit_steps} steps",
                rows,
                args.fit_batch,
            )
    if "noise-scale" in parts:
        print(
            f"\nnoise-scale: training steps, {args.fit_model} {args.fit_size}x"
            f"{args.fit_size}, batch {args.fit_batch} ...",
            flush=True,
        )
        rows = bench_noise_scale(
            args.fit_model, args.fit_size, args.fit_batch, args.fit_rounds
        )
        _print_paired_table(
            f"Training step (train_on_batch, jit_compile=False), {args.fit_model} "
            f"{args.fit_size}x{args.fit_size}, batch {args.fit_batch}, "
            f"{args.fit_rounds} interleaved cycles of {NOISE_SCALE_STEPS} steps; "
            "ratio: median of cycle-by-cycle ratios",
            rows,
            ((NOISE_SCALE_BASELINE, (NOISE_SCALE_ROW,)),),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
