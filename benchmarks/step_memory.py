"""Peak memory of one optimizer step without XLA, each optimizer in its own process.

`python benchmarks/step_memory.py` builds each optimizer on the trainable
shapes of `keras.applications.ResNet50(weights=None)` (random weights and
gradients, as `benchmarks/bench.py` does), traces `tf.function(apply)`
without XLA (what `model.fit` runs on a CPU by default), then runs five
steps and prints how far the process's peak resident memory grew over
them: what the step itself takes beyond the variables and the slots.
"""

import argparse
import os
import resource
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MAKERS = (
    "Adam",
    "tf_lars.LAMB(weight_decay=0.01)",
    "SGD(momentum=0.9)",
    "LARS(weight_decay=1e-4)",
)


def measure(name, steps):
    """Peak growth (MiB) over `steps` steps of optimizer row `name`."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.path.insert(0, os.path.dirname(HERE))
    import keras
    import numpy as np
    import tensorflow as tf

    from benchmarks import bench

    shapes = bench.resnet50_shapes()
    rng = np.random.default_rng(0)
    variables = [
        keras.Variable(rng.normal(size=s).astype("float32") * 0.01) for s in shapes
    ]
    grads = [tf.constant(rng.normal(size=s).astype("float32") * 0.01) for s in shapes]
    optimizer = bench.make_optimizer(name)
    optimizer.build(variables)
    step = tf.function(lambda g: optimizer.apply(g, variables))
    step.get_concrete_function(grads)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(steps):
        step(grads)
    optimizer.iterations.numpy()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    parameters = sum(int(np.prod(s)) for s in shapes)
    return (after - before) / 1024, 4 * parameters / 2**20


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="steps measured")
    parser.add_argument("--rounds", type=int, default=2, help="processes per optimizer")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        growth, size = measure(args.one, args.steps)
        print(f"{growth:.1f} {size:.1f}")
        return 0
    print(f"Peak memory growth over {args.steps} steps, no XLA, ResNet-50 shapes (MiB)")
    print(f"{'optimizer':<36}{'rounds':>20}{'params':>10}")
    for name in MAKERS:
        results = []
        for _ in range(args.rounds):
            out = subprocess.run(
                [sys.executable, __file__, "--one", name, "--steps", str(args.steps)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            results.append(out)
        growths = ", ".join(r[0] for r in results)
        print(f"{name:<36}{growths:>20}{results[0][1]:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
