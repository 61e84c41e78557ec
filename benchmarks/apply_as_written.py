"""The XLA step as a user writes it, against `benchmarks/bench.py`'s.

    python benchmarks/apply_as_written.py [--repeats 30]

`benchmarks/bench.py` times `optimizer.apply` under
`tf.function(jit_compile=True)` on variables it makes itself, with the
optimizer built before the trace and the gradients passed as arguments.
A user more often writes

    step = tf.function(lambda: optimizer.apply(grads, model.trainable_variables),
                       jit_compile=True)

on a model's own variables, with the optimizer built inside the first
trace and the gradients captured. This script times that, on
`keras.applications.ResNet50(weights=None)`'s trainable variables, for
Keras `SGD(momentum=0.9)` and `tf_lars.LARS`, and Keras `Adam`, Keras
`Lamb` and `tf_lars.LAMB`, timed and printed as `benchmarks/bench.py` times
and prints its XLA tables (its `_turns` and `_print_paired_table`): one
step of each optimizer in turn, `--repeats` times, the median step, and the
median of the step-by-step ratios to the group's first row. A benchmark,
not a test: numbers depend on the machine.
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# This checkout's tf_lars, as benchmarks/bench.py times it.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_lars  # noqa: E402
from benchmarks import bench  # noqa: E402

GROUPS = {
    "LARS": {
        "keras SGD(momentum=0.9)": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        "tf_lars LARS(weight_decay=1e-4)": lambda: tf_lars.LARS(
            0.1, momentum=0.9, weight_decay=1e-4
        ),
    },
    "LAMB": {
        "keras Adam": lambda: keras.optimizers.Adam(1e-3),
        "keras Lamb": lambda: keras.optimizers.Lamb(1e-3),
        "tf_lars LAMB(weight_decay=0.01)": lambda: tf_lars.LAMB(
            1e-3, weight_decay=0.01
        ),
    },
}


def _step_as_written(make, model):
    """A fresh model's variables, its gradients captured, the optimizer
    built inside the first trace: the user's one-liner. The step fetches
    the optimizer's step count, as `benchmarks/bench.py`'s do."""
    variables = model.trainable_variables
    grads = [
        tf.random.normal(v.shape, stddev=1e-3, seed=i) for i, v in enumerate(variables)
    ]
    optimizer = make()
    as_written = tf.function(
        lambda: optimizer.apply(grads, variables), jit_compile=True
    )
    as_written()  # traced, built and compiled here

    def step():
        as_written()
        return optimizer.iterations.numpy()

    return step


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30, help="timed turns")
    args = parser.parse_args(argv)
    print(f"tensorflow {tf.__version__}, keras {keras.__version__}")
    for group, contenders in GROUPS.items():
        print(f"{group}: timing {', '.join(contenders)} ...", flush=True)
        steps = {
            name: _step_as_written(make, keras.applications.ResNet50(weights=None))
            for name, make in contenders.items()
        }
        rows = bench._turns(steps, args.repeats, 1)
        bench._print_paired_table(
            f"{group} group, ResNet-50 trainable variables, XLA, as written",
            rows,
            ((next(iter(rows)), tuple(rows)[1:]),),
        )


if __name__ == "__main__":
    main()
