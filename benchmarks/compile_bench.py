"""Compile-time benchmark: `python benchmarks/compile_bench.py [--help]`.

Not part of the installed package: run it from a source checkout (it puts
the checkout first on the import path, so it measures the checkout's tf_lars).

How long the first update over N tiny variables (shapes (4,) and (3, 3),
alternating, float32) takes to compile, and the memory it takes, for
`tf_lars.LARS` against `keras.optimizers.SGD(momentum=0.9)` and
`tf_lars.LAMB` against `keras.optimizers.Adam`. Each case runs in a fresh
process, so its peak memory (`ru_maxrss`, TensorFlow's import included) is
its own. Two modes on TensorFlow:

- `jit`: the first call of the user's own `tf.function(jit_compile=True)`
  of `optimizer.apply` (the optimizer is built outside it);
- `eager`: the first eager `optimizer.apply` of a tf_lars optimizer, which
  runs as one compiled function (`jit_compile=True`, the default); Keras's
  optimizers run it op by op, so its ratio is to the baseline's `jit` row.

Each `jit` row also counts the instructions of the program TensorFlow hands
XLA (`experimental_get_compiler_ir(...)(stage="hlo")`, before XLA's own
passes): the count grows with N, and its slope, per variable, is what the
compile time follows. `--backend torch` instead trains a model holding the
N variables with `model.fit` under `torch.compile` (Keras's
`jit_compile=True`) and counts Dynamo's recompilations and its
recompile-limit warnings; `--shapes K` gives the variables K distinct shapes
(more than Dynamo's limit of 8 shows whether a step recompiles per shape).
Timings vary with the machine and its load.
"""

import argparse
import json
import logging
import os
import re
import resource
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

#: Optimizers measured, each with the Keras optimizer it is compared with.
BASELINES = {"sgd": "sgd", "lars": "sgd", "adam": "adam", "lamb": "adam"}
LABELS = {
    "sgd": "Keras SGD(momentum=0.9)",
    "lars": "tf_lars.LARS()",
    "adam": "Keras Adam()",
    "lamb": "tf_lars.LAMB()",
}
SHAPES = ((4,), (3, 3))
# `%name = <shape> opcode(`; a tuple's shape holds spaces but no `word(`.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(")


def compiling_environment(**extra):
    """`os.environ` plus `extra`, without TensorFlow's persistent XLA cache.

    A compile-time benchmark has to compile: with the cache set (the test
    suite sets one, docs/guides/development.md), a program compiled before
    would be read back instead.
    """
    env = dict(os.environ, **extra)
    flags = re.sub(
        r"--tf_xla_persistent_cache_directory=\S*", "", env.get("TF_XLA_FLAGS", "")
    ).split()
    if flags:
        env["TF_XLA_FLAGS"] = " ".join(flags)
    else:
        env.pop("TF_XLA_FLAGS", None)
    return env


def make_optimizer(name):
    """The optimizer of `name` (a key of `BASELINES`), default arguments."""
    import keras

    import tf_lars

    makers = {
        "sgd": lambda: keras.optimizers.SGD(momentum=0.9),
        "lars": tf_lars.LARS,
        "adam": keras.optimizers.Adam,
        "lamb": tf_lars.LAMB,
    }
    return makers[name]()


def tiny_variables(count):
    """`count` float32 variables of shapes (4,) and (3, 3), alternating."""
    import keras
    import numpy as np

    return [
        keras.Variable(
            np.full(SHAPES[i % 2], 1.0 + i, "float32"), name=f"w{i}", dtype="float32"
        )
        for i in range(count)
    ]


def hlo_instructions(hlo_text):
    """Opcode of every instruction in an HLO module's text (all computations)."""
    return [
        match.group(1)
        for match in map(_INSTRUCTION.match, hlo_text.splitlines())
        if match
    ]


def update_hlo(optimizer, variables):
    """The HLO TensorFlow hands XLA for one `apply` of `optimizer` (built first)."""
    import tensorflow as tf

    grads = [tf.fill(v.shape, 0.1) for v in variables]
    optimizer.build(variables)
    step = tf.function(
        lambda g: optimizer.apply(g, variables), jit_compile=True, autograph=False
    )
    return step.experimental_get_compiler_ir(grads)(stage="hlo")


def _peak_rss_bytes():
    # Linux reports ru_maxrss in KiB, macOS in bytes.
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def measure_tensorflow(name, mode, count):
    """One case, in this process: seconds of the first update, peak RSS, HLO."""
    import tensorflow as tf

    variables = tiny_variables(count)
    grads = [tf.fill(v.shape, 0.1) for v in variables]
    optimizer = make_optimizer(name)
    optimizer.build(variables)
    if mode == "jit":
        step = tf.function(
            lambda g: optimizer.apply(g, variables), jit_compile=True, autograph=False
        )
    else:
        step = lambda g: optimizer.apply(g, variables)  # noqa: E731
    start = time.perf_counter()
    step(grads)
    seconds = time.perf_counter() - start
    result = {"seconds": seconds, "peak_bytes": _peak_rss_bytes()}
    if mode == "jit":
        ir = step.experimental_get_compiler_ir(grads)(stage="hlo")
        result["instructions"] = len(hlo_instructions(ir))
    return result


class _RecompileLog(logging.Handler):
    """Counts Dynamo's recompile and recompile-limit messages."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.limit_warnings = []

    def emit(self, record):
        message = record.getMessage()
        if "recompile_limit" in message or "cache_size_limit" in message:
            self.limit_warnings.append(message.splitlines()[0])


def variable_shape(position, shapes):
    """The shape of variable `position`: `SHAPES` alternating, or with
    `shapes` > 2 the vectors (2,), (3,), ... (shapes + 1,) in turn."""
    if shapes <= 2:
        return SHAPES[position % 2]
    return (position % shapes + 2,)


def measure_torch(name, count, shapes=2, epochs=2):
    """`model.fit` under `torch.compile`: seconds, recompiles, limit warnings.

    The `count` variables take `shapes` distinct shapes (`variable_shape`):
    a step compiled once per shape would recompile past Dynamo's limit of 8
    when there are more shapes than that.
    """
    import keras
    import numpy as np
    import torch._dynamo

    class ManyWeights(keras.layers.Layer):
        def build(self, input_shape):
            self.many = [
                self.add_weight(
                    shape=variable_shape(i, shapes), initializer="ones", name=f"w{i}"
                )
                for i in range(count)
            ]

        def call(self, inputs):
            total = sum(keras.ops.sum(w) for w in self.many)
            return inputs * total

    log = _RecompileLog()
    logging.getLogger("torch._dynamo").addHandler(log)
    torch._dynamo.utils.counters.clear()
    model = keras.Sequential([keras.Input((1,)), ManyWeights()])
    model.compile(optimizer=make_optimizer(name), loss="mse", jit_compile=True)
    data = np.ones((8, 1), "float32")
    start = time.perf_counter()
    model.fit(data, data, batch_size=4, epochs=epochs, verbose=0)
    seconds = time.perf_counter() - start
    counters = torch._dynamo.utils.counters
    return {
        "seconds": seconds,
        "peak_bytes": _peak_rss_bytes(),
        "recompiles": sum(counters["recompiles"].values()),
        "graph_breaks": sum(counters["graph_break"].values()),
        "limit_warnings": len(log.limit_warnings),
    }


def run_case(backend, name, mode, count, timeout, shapes=2):
    """Runs one case in a fresh process; its result, or None past `timeout`."""
    env = compiling_environment(KERAS_BACKEND=backend)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    command = [sys.executable, os.path.abspath(__file__), "--child"]
    command += [backend, name, mode, str(count), str(shapes)]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return None
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"case {name} {mode} {count} failed:\n{done.stderr}")
    return json.loads(lines[-1])


def _ratio(row, base, key):
    return "" if base is None else f"{row[key] / base[key]:.2f}x"


def print_tensorflow_table(results, sizes, names, timeout):
    """The TensorFlow table; ratios to the baseline's `jit` row of the same N."""
    print(
        f"{'N':>6}  {'optimizer':24}{'mode':>6}{'compile s':>11}{'x base':>8}"
        f"{'peak MB':>9}{'x base':>8}{'HLO/var':>9}"
    )
    for count in sizes:
        for name in names:
            for mode in ("jit", "eager"):
                if (name, mode, count) not in results:
                    continue
                row = results[(name, mode, count)]
                line = f"{count:>6}  {LABELS[name]:24}{mode:>6}"
                if row is None:
                    print(line + f"{'> ' + format(timeout, '.0f'):>11}")
                    continue
                base = results.get((BASELINES[name], "jit", count))
                if name == BASELINES[name]:
                    base = None
                per_variable = row.get("instructions", "")
                if per_variable != "":
                    per_variable = f"{per_variable / count:.1f}"
                print(
                    line + f"{row['seconds']:>11.2f}{_ratio(row, base, 'seconds'):>8}"
                    f"{row['peak_bytes'] / 2**20:>9.0f}"
                    f"{_ratio(row, base, 'peak_bytes'):>8}{per_variable:>9}"
                )


def print_torch_table(results, sizes, names):
    """The PyTorch table: fit seconds, Dynamo's recompiles and limit warnings."""
    print(
        f"{'N':>6}  {'optimizer':26}{'fit s':>10}{'peak MB':>10}{'recompiles':>12}"
        f"{'breaks':>8}{'limit hits':>12}"
    )
    for count in sizes:
        for name in names:
            row = results[(name, "fit", count)]
            if row is None:
                print(f"{count:>6}  {LABELS[name]:26}{'> timeout':>10}")
                continue
            print(
                f"{count:>6}  {LABELS[name]:26}{row['seconds']:>10.1f}"
                f"{row['peak_bytes'] / 2**20:>10.0f}{row['recompiles']:>12}"
                f"{row['graph_breaks']:>8}{row['limit_warnings']:>12}"
            )


def parse_arguments(argv=None):
    """The parsed arguments; a bad one exits with status 2 (argparse)."""
    parser = argparse.ArgumentParser(
        prog="compile_bench.py",
        description="Compile time and memory of one update over N tiny variables.",
    )
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[50, 200, 2000],
        help="variable counts N (default: 50 200 2000)",
    )
    parser.add_argument(
        "--only",
        choices=sorted(BASELINES),
        action="append",
        help="measure only these optimizers (repeatable; default: all four)",
    )
    parser.add_argument(
        "--modes",
        choices=["jit", "eager"],
        action="append",
        help="TensorFlow: only these modes (repeatable; default: both)",
    )
    parser.add_argument(
        "--backend",
        choices=["tensorflow", "torch"],
        default="tensorflow",
        help="tensorflow: XLA compile; torch: model.fit under torch.compile",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds allowed per case (its process is stopped past it)",
    )
    parser.add_argument(
        "--shapes",
        type=int,
        default=2,
        help="torch: distinct variable shapes (default 2: (4,) and (3, 3); more: "
        "the vectors (2,), (3,), ...)",
    )
    args = parser.parse_args(argv)
    if args.shapes < 1:
        parser.error(f"--shapes must be >= 1. Received: --shapes {args.shapes}")
    if min(args.sizes) < 1 or args.timeout <= 0:
        parser.error(
            "--sizes must be >= 1 and --timeout > 0. "
            f"Received: --sizes {' '.join(map(str, args.sizes))} "
            f"--timeout {args.timeout}"
        )
    return args


def main(argv=None):
    """Measures every case in its own process and prints the table.

    Args:
        argv: list of str, the arguments (see `--help`). Defaults to
            `sys.argv[1:]`.

    Returns:
        The exit status, 0. A bad argument exits with status 2 (argparse).
    """
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        backend, name, mode, count, shapes = argv[1:]
        if backend == "torch":
            result = measure_torch(name, int(count), int(shapes))
        else:
            result = measure_tensorflow(name, mode, int(count))
        print(json.dumps(result), flush=True)
        return 0
    args = parse_arguments(argv)
    names = [n for n in BASELINES if args.only is None or n in args.only]
    modes = ["fit"] if args.backend == "torch" else (args.modes or ["jit", "eager"])
    print(
        f"compile_bench: backend {args.backend}, {os.cpu_count()} CPU cores, "
        f"N = {' '.join(map(str, args.sizes))}, one process per case",
        flush=True,
    )
    results = {}
    for count in args.sizes:
        for name in names:
            for mode in modes:
                if mode == "eager" and name == BASELINES[name]:
                    continue  # Keras's eager apply is not compiled
                results[(name, mode, count)] = run_case(
                    args.backend, name, mode, count, args.timeout, args.shapes
                )
    if args.backend == "torch":
        print_torch_table(results, args.sizes, names)
    else:
        print_tensorflow_table(results, args.sizes, names, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
