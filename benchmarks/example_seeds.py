"""The seeded examples' figures: `python benchmarks/example_seeds.py`.

Not part of the installed package: run it from a source checkout.

Each Python block of the README and docs/ that calls
`keras.utils.set_random_seed(0)` and prints `... before training: X` and
`... after training: Y` is run as pasted, then with seeds 1 to `--seeds - 1`
in that call; the values and their range per printed line are what the
block's comments quote ("0.28 (seeds 0-4: 0.14-0.33)"). `--replace OLD NEW`
runs the blocks with a text swapped (docs/guides/large-batch.md's paper
coefficient: `--only large-batch --replace trust_coefficient=0.02,
trust_coefficient=0.001,`).
"""

import argparse
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SEED = "keras.utils.set_random_seed(0)"
PRINTED = re.compile(r"^(\w+ (?:before|after) training): (\S+)$", re.M)


def blocks(only):
    """(file, block) for each seeded Python block whose file name has `only`."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for path in files:
        if only and only not in path.name:
            continue
        for block in re.findall(r"```python\n(.*?)```", path.read_text(), re.S):
            if SEED in block and "after training" in block:
                yield path.relative_to(ROOT), block


def run(block, seed):
    """The `... training: value` lines `block` prints with `seed`."""
    code = block.replace(SEED, f"keras.utils.set_random_seed({seed})")
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT
    )
    if done.returncode != 0:
        raise SystemExit(f"seed {seed} failed:\n{done.stderr[-2000:]}")
    return dict(PRINTED.findall(done.stdout))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0 to N - 1")
    parser.add_argument("--only", help="only the files whose name has this text")
    parser.add_argument("--replace", nargs=2, metavar=("OLD", "NEW"))
    args = parser.parse_args(argv)
    for path, block in blocks(args.only):
        if args.replace:
            block = block.replace(*args.replace)
        runs = [run(block, seed) for seed in range(args.seeds)]
        print(f"{path}:")
        for line in runs[0]:
            values = [float(printed[line]) for printed in runs]
            print(
                f"  {line}: {runs[0][line]} (seeds 0-{args.seeds - 1}: "
                f"{min(values):g}-{max(values):g}); all: {values}"
            )


if __name__ == "__main__":
    main()
