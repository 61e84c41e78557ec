"""Start-up cost of a process: `python benchmarks/start_cost.py [--help]`.

Not part of the installed package: run it from a source checkout.

Most of the test suite's time goes to starting Python processes that import
TensorFlow (the launcher's clusters, the command line's runs, the docs
blocks, each in a fresh interpreter). This measures what one such start
costs, in CPU seconds (user + system, of the child process alone), for each
case in a fresh interpreter:

- `python`: an interpreter that imports nothing (the floor);
- `tensorflow`: `import tensorflow`, which also imports Keras 3 (`tf.keras`),
  and Keras imports matplotlib and scikit-learn when they are installed (the
  `cli` extra installs both);
- `tensorflow_alone`: the same with matplotlib, scikit-learn, JAX and
  PyTorch made unimportable (`sys.modules[name] = None`), so the difference
  to `tensorflow` is what those optional imports cost;
- `tf_lars`: `import tf_lars` and the first use of `tf_lars.LARS` (which
  loads Keras and, on the TensorFlow backend, TensorFlow).

The cases run interleaved (case by case within each repeat), and the table
gives the median and the spread (min to max) over the repeats. CPU seconds
rather than wall-clock ones: the machine's other load changes them less.
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_HIDDEN = ("matplotlib", "sklearn", "jax", "torch")
CASES = {
    "python": "pass",
    "tensorflow": "import tensorflow",
    "tensorflow_alone": (
        f"import sys\nfor name in {_HIDDEN!r}:\n    sys.modules[name] = None\n"
        "import tensorflow"
    ),
    "tf_lars": "import tf_lars\ntf_lars.LARS",
}


def cpu_seconds(code):
    """CPU seconds (user + system) that `python -c code` took, in a fresh
    process; raises `RuntimeError` with its stderr if it fails."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    process = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if process.returncode != 0:
        raise RuntimeError(process.stderr.strip().splitlines()[-1])
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure(names, repeats, progress=None):
    """name -> list of `repeats` CPU seconds, the cases interleaved."""
    samples = {name: [] for name in names}
    for repeat in range(repeats):
        for name in names:
            samples[name].append(cpu_seconds(CASES[name]))
        if progress is not None:
            progress(repeat + 1, repeats)
    return samples


def table(samples):
    """A Markdown table: each case's median and spread, in CPU seconds."""
    lines = [
        "| case | median CPU s | min | max | runs |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, values in samples.items():
        lines.append(
            f"| {name} | {statistics.median(values):.2f} | {min(values):.2f} "
            f"| {max(values):.2f} | {len(values)} |"
        )
    return "\n".join(lines)


def _positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=f"cases: {', '.join(CASES)}",
    )
    parser.add_argument("--repeats", type=_positive, default=5)
    parser.add_argument(
        "--cases", nargs="+", choices=sorted(CASES), default=list(CASES)
    )
    args = parser.parse_args(argv)

    def progress(done, total):
        print(f"[{done}/{total}] repeats done", file=sys.stderr, flush=True)

    try:
        samples = measure(args.cases, args.repeats, progress)
    except RuntimeError as error:
        parser.exit(2, f"start_cost.py: error: a case failed: {error}\n")
    print(table(samples))
    return 0


if __name__ == "__main__":
    sys.exit(main())
