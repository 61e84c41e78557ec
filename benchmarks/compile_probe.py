"""What LARS's compile time is made of: `python benchmarks/compile_probe.py [--help]`.

Not part of the installed package: run it from a source checkout (it puts
the checkout first on the import path, so it probes the checkout's tf_lars).

`benchmarks/compile_bench.py` times whole optimizers; this script times the
shapes of program they compile, over N float32 variables of shapes (4,) and
(3, 3), each case the first call of one `tf.function(jit_compile=True)` in a
fresh process (docs/guides/benchmarks.md, "Compile time"):

- `updates`: each variable updated in place from its gradient alone
  (`w <- w - g / |w|`, one reduction per variable), as Keras's optimizers do;
- `gradient-norms`: the norms of all gradients in one `tf_lars` norm pass
  (`tf_lars._tf_fast.norms`, stacked by shape, one range check), each entry
  read at a position that is an input of the program (so that the updates
  of variables of one shape stay identical kernels), then every variable
  updated in place with its entry;
- `weight-norms`: the same with the norms of the variables, which the same
  program then updates in place: LARS's trust ratio needs `|w|` before `w`
  is written.

Timings vary with the machine and its load; compare the cases of one run.
"""

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

CASES = ("updates", "gradient-norms", "weight-norms")
SHAPES = ((4,), (3, 3))


def build_step(case, count):
    """The variables, gradients and compiled step of `case` over `count` variables."""
    import numpy as np
    import tensorflow as tf

    from tf_lars import _tf_fast

    variables = [
        tf.Variable(np.full(SHAPES[i % 2], 1.0 + i, "float32")) for i in range(count)
    ]
    grads = [tf.constant(np.full(SHAPES[i % 2], 0.1, "float32")) for i in range(count)]
    # Eager scalars, captured as inputs of the compiled program: `norms[k]`
    # would put each offset k into its update's kernel (one compile each).
    positions = [tf.constant(k, tf.int64) for k in range(count)]

    def step(*gradients):
        if case == "updates":
            for variable, gradient in zip(variables, gradients, strict=True):
                norm = tf.sqrt(tf.reduce_sum(tf.square(variable)))
                variable.assign_sub(gradient / norm)
            return
        if case == "gradient-norms":
            norms = _tf_fast.norms(list(gradients))
        else:
            norms = _tf_fast.norms([tf.convert_to_tensor(v) for v in variables])
        entries = [tf.gather(norms, position) for position in positions]
        for variable, gradient, norm in zip(variables, gradients, entries, strict=True):
            variable.assign_sub(gradient / norm)

    compiled = tf.function(step, jit_compile=True, autograph=False)
    return variables, grads, compiled


def measure(case, count):
    """Seconds of the first call of `case`'s compiled step (in this process)."""
    variables, grads, compiled = build_step(case, count)
    start = time.perf_counter()
    compiled(*grads)
    seconds = time.perf_counter() - start
    del variables  # kept alive until the step has run
    return {"seconds": seconds}


def run_case(case, count, timeout):
    """Runs one case in a fresh process; its result, or None past `timeout`."""
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    command = [sys.executable, os.path.abspath(__file__), "--child", case, str(count)]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return None
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"case {case} {count} failed:\n{done.stderr}")
    return json.loads(lines[-1])


def parse_arguments(argv=None):
    """The parsed arguments; a bad one exits with status 2 (argparse)."""
    parser = argparse.ArgumentParser(
        prog="compile_probe.py",
        description="Compile time of the program shapes behind LARS's compile time.",
    )
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[200, 2000],
        help="variable counts N (default: 200 2000)",
    )
    parser.add_argument(
        "--only",
        choices=CASES,
        action="append",
        help="probe only these cases (repeatable; default: all three)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds allowed per case (its process is stopped past it)",
    )
    arguments = parser.parse_args(argv)
    if any(size < 1 for size in arguments.sizes):
        parser.error(f"--sizes must be at least 1. Received: {arguments.sizes}")
    if arguments.timeout <= 0:
        parser.error(f"--timeout must be positive. Received: {arguments.timeout}")
    return arguments


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        print(json.dumps(measure(argv[1], int(argv[2]))))
        return 0
    arguments = parse_arguments(argv)
    cases = arguments.only or list(CASES)
    print(f"compile_probe: {os.cpu_count()} CPU cores, one process per case")
    print(f"{'N':>6}  {'case':16}{'compile s':>11}")
    for count in arguments.sizes:
        for case in cases:
            row = run_case(case, count, arguments.timeout)
            seconds = (
                f"> {arguments.timeout:.0f}" if row is None else f"{row['seconds']:.2f}"
            )
            print(f"{count:>6}  {case:16}{seconds:>11}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
