"""Where XLA compile time goes: `python benchmarks/compile_profile.py [--help]`.

Not part of the installed package: run it from a source checkout (it puts
the checkout first on the import path, so it measures the checkout's tf_lars).

Two measurements behind docs/guides/benchmarks.md, "Compile time", each case
in a fresh process:

- `phases`: for an optimizer over N tiny variables (`compile_bench`'s), the
  Python trace of `tf.function(jit_compile=True)` of `apply`, then the
  compile of its first call, apart; with `--stacked-rows`, once for each
  cap on the tensors in one norm stack (`tf_lars._trust.STACKED_ROWS`), and
  with `--kernels` also the number of compiled kernels and the largest
  kernel's LLVM IR (from XLA's dump);
- `ops`: TensorFlow's lowering of one op type to XLA, `--count` copies of
  it on separate (4,)-shaped inputs in one `tf.function(jit_compile=True)`,
  first call after the trace: what each op instance costs the compile.

Timings vary with the machine and its load.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
# compile_bench.py, beside this script: its optimizers, variables and
# environment.
HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import compile_bench  # noqa: E402

#: One op on a (4,) float32 tensor, by the TensorFlow op name it creates.
OPS = {
    "Mul": lambda tf, x: x * 2.0,
    "Square": lambda tf, x: tf.square(x),
    "Sqrt": lambda tf, x: tf.sqrt(x),
    "Abs": lambda tf, x: tf.abs(x),
    "Rsqrt": lambda tf, x: tf.math.rsqrt(x),
    "Sum": lambda tf, x: tf.reduce_sum(x),
    "RealDiv": lambda tf, x: x / 3.0,
}


def _kernel_stats(dump):
    """(kernels, largest kernel's LLVM IR in bytes) in an XLA dump folder."""
    files = [f for f in os.listdir(dump) if f.endswith(".ir-no-opt.ll")]
    sizes = [os.path.getsize(os.path.join(dump, f)) for f in files]
    return len(files), max(sizes, default=0)


def measure_phases(name, count, stacked_rows=None, kernels=False):
    """Trace and compile seconds of one `apply` of optimizer `name`."""
    dump = tempfile.mkdtemp(prefix="compile_profile_") if kernels else None
    if dump:
        os.environ["XLA_FLAGS"] = f"--xla_dump_to={dump} --xla_dump_hlo_as_text"
    import tensorflow as tf

    from tf_lars import _trust

    if stacked_rows is not None:
        _trust.STACKED_ROWS = stacked_rows
    optimizer = compile_bench.make_optimizer(name)
    variables = compile_bench.tiny_variables(count)
    optimizer.build(variables)
    grads = [tf.ones_like(v) for v in variables]
    step = tf.function(
        lambda g: optimizer.apply(g, variables), jit_compile=True, autograph=False
    )
    start = time.perf_counter()
    step.get_concrete_function(grads)
    traced = time.perf_counter() - start
    start = time.perf_counter()
    step(grads)
    result = {"trace_s": traced, "compile_s": time.perf_counter() - start}
    if dump:
        result["kernels"], result["largest_ir_bytes"] = _kernel_stats(dump)
        shutil.rmtree(dump)  # about 1 MB of XLA's files a case
    return result


def measure_op(op, count):
    """Trace and compile seconds of `count` copies of op `op`."""
    import numpy as np
    import tensorflow as tf

    inputs = [tf.constant(np.full((4,), 1.0 + i, "float32")) for i in range(count)]
    make = OPS[op]
    step = tf.function(
        lambda xs: [make(tf, x) for x in xs], jit_compile=True, autograph=False
    )
    start = time.perf_counter()
    step.get_concrete_function(inputs)
    traced = time.perf_counter() - start
    start = time.perf_counter()
    step(inputs)
    return {"trace_s": traced, "compile_s": time.perf_counter() - start}


def run_case(argv, timeout):
    """One case in a fresh process (`--case`); its JSON result, or None."""
    command = [sys.executable, os.path.abspath(__file__), "--case", json.dumps(argv)]
    environment = compile_bench.compiling_environment(TF_CPP_MIN_LOG_LEVEL="3")
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env=environment
        )
    except subprocess.TimeoutExpired:
        return None
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    sys.stderr.write(done.stderr[-2000:])
    return None


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(
        description="Where XLA compile time goes (trace, compile, kernels, ops)."
    )
    parser.add_argument(
        "part", choices=["phases", "ops"], help="what to measure (see the module)"
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=["sgd", "lars", "adam", "lamb"],
        help="phases: optimizers (repeatable; default: lars and sgd)",
    )
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[1000], help="phases: variables N"
    )
    parser.add_argument(
        "--stacked-rows",
        type=int,
        nargs="+",
        help="phases: caps on the tensors in one norm stack to try (default: "
        "the library's own)",
    )
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="phases: also count compiled kernels and the largest one's LLVM IR",
    )
    parser.add_argument(
        "--ops",
        nargs="+",
        choices=sorted(OPS),
        default=["Mul", "Square", "Sqrt", "Abs"],
        help="ops: op types",
    )
    parser.add_argument("--count", type=int, default=2000, help="ops: copies")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds allowed per case"
    )
    arguments = parser.parse_args(argv)
    for name in ("sizes", "stacked_rows"):
        for value in getattr(arguments, name) or []:
            if value < 1:
                parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if arguments.count < 1:
        parser.error(f"--count must be >= 1, got {arguments.count}")
    return arguments


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--case"]:
        case = json.loads(argv[1])
        if case["part"] == "ops":
            result = measure_op(case["op"], case["count"])
        else:
            result = measure_phases(
                case["name"], case["count"], case["stacked_rows"], case["kernels"]
            )
        print(json.dumps(result))
        return 0
    arguments = parse_arguments(argv)
    print(f"compile_profile: {os.cpu_count()} CPU cores, one process per case")
    if arguments.part == "ops":
        print(f"{'op':>8}  {'count':>6}  {'trace s':>8}  {'compile s':>9}  ms/op")
        for op in arguments.ops:
            case = {"part": "ops", "op": op, "count": arguments.count}
            result = run_case(case, arguments.timeout)
            if result is None:
                print(f"{op:>8}  {arguments.count:>6}  (failed or timed out)")
                continue
            per_op = 1000 * result["compile_s"] / arguments.count
            print(
                f"{op:>8}  {arguments.count:>6}  {result['trace_s']:8.2f}  "
                f"{result['compile_s']:9.2f}  {per_op:5.2f}",
                flush=True,
            )
        return 0
    names = arguments.only or ["sgd", "lars"]
    caps = arguments.stacked_rows or [None]
    print(
        f"{'N':>6}  {'optimizer':>9}  {'stack cap':>9}  {'trace s':>8}  "
        f"{'compile s':>9}  kernels  largest IR KB"
    )
    for count in arguments.sizes:
        for name in names:
            for cap in caps if name in ("lars", "lamb") else [None]:
                case = {
                    "part": "phases",
                    "name": name,
                    "count": count,
                    "stacked_rows": cap,
                    "kernels": arguments.kernels,
                }
                result = run_case(case, arguments.timeout)
                label = "default" if cap is None else str(cap)
                if result is None:
                    print(f"{count:>6}  {name:>9}  {label:>9}  (failed or timed out)")
                    continue
                kernels = result.get("kernels", "")
                largest = result.get("largest_ir_bytes")
                largest = "" if largest is None else f"{largest / 1024:.0f}"
                print(
                    f"{count:>6}  {name:>9}  {label:>9}  {result['trace_s']:8.2f}  "
                    f"{result['compile_s']:9.2f}  {kernels!s:>7}  {largest:>13}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
