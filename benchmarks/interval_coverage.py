"""How often `tf-lars study`'s and `lowcomm`'s intervals hold the mean:
`python benchmarks/interval_coverage.py`.

Not part of the installed package: run it from a source checkout.

The reports give each mean over `seeds` reruns a percentile bootstrap
interval (`tf_lars.cli.study.bootstrap_interval`). For `--draws` samples of
n values from a normal distribution, the share of intervals that hold the
true mean, against the nominal confidence; beside it Student's t interval
of the same samples. Seeded: the same numbers every run.
"""

import argparse
import pathlib
import sys

import numpy as np
from scipy import stats

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from tf_lars.cli.study import bootstrap_interval  # noqa: E402


def coverage(n, draws, confidence, resamples):
    """(bootstrap, t) coverage of the mean 0 over `draws` normal samples of n."""
    rng = np.random.default_rng(n)
    held = np.zeros(2)
    quantile = stats.t.ppf((1 + confidence) / 2, n - 1)
    for draw in range(draws):
        values = rng.normal(0.0, 1.0, n)
        low, high = bootstrap_interval(values, confidence, resamples, seed=draw)
        half = quantile * values.std(ddof=1) / np.sqrt(n)
        held += [low <= 0.0 <= high, abs(values.mean()) <= half]
    return held / draws


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 3, 5, 10, 30])
    parser.add_argument("--draws", type=int, default=2000)
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--resamples", type=int, default=2000)
    arguments = parser.parse_args()
    print("| seeds | percentile bootstrap | Student's t | nominal |")
    print("| ---: | ---: | ---: | ---: |")
    for n in arguments.sizes:
        boot, t = coverage(
            n, arguments.draws, arguments.confidence, arguments.resamples
        )
        print(f"| {n} | {boot:.3f} | {t:.3f} | {arguments.confidence:.2f} |")


if __name__ == "__main__":
    main()
