"""The optimizer tests' shared harness: a random problem and its steps.

Plain functions rather than fixtures: parametrizations and other helpers at
module level use them too, which fixtures cannot serve. The command line's
harness is in `tests/conftest.py` (`run_cli`, `one_line_error`).

Modes of `step_function` and `run_steps`:

- `"eager"`: `optimizer.apply` op by op (`jit_compile=False`);
- `"default"`: `optimizer.apply` as configured (XLA-compiled on TensorFlow,
  where `jit_compile` defaults to True);
- `"function"`: inside `tf.function`; `"jit"`: inside
  `tf.function(jit_compile=True)` on TensorFlow, `jax.jit` of
  `stateless_apply` on JAX;
- `"stateless"` (JAX): `stateless_apply`, as JAX's trainer calls it.
"""

import pathlib
import subprocess
import sys

import keras
import numpy as np

from tests.cli_helpers import process_env

BACKEND = keras.backend.backend()
#: The mode of a flag-matrix case by dtype: compiled (as users run it) in
#: float32, op by op in float64 at the tight float64 tolerance. An XLA
#: compile per case costs about seven times the eager steps, and the compiled
#: float64 path of every row is the contract table's
#: (tests/contract_test.py, `test_apply_follows_the_numpy_reference`).
FLAG_MATRIX_MODE = {"float32": "default", "float64": "eager"}


def random_problem(dtype, shapes, steps, seed=0, scale=0.1):
    """Weights drawn from N(0, 1) and `steps` gradients from N(0, scale**2).

    Returns:
        `(weights, grads)`: a list of arrays of `shapes`, and a list of
        `steps` such lists, in `dtype`.
    """
    rng = np.random.default_rng(seed)
    weights = [rng.normal(size=s).astype(dtype) for s in shapes]
    grads = [
        [rng.normal(scale=scale, size=s).astype(dtype) for s in shapes]
        for _ in range(steps)
    ]
    return weights, grads


def tensor(value, dtype):
    return keras.ops.convert_to_tensor(np.asarray(value), dtype=dtype)


def _stateless(optimizer, variables, jit):
    """`apply` through `stateless_apply` (what the JAX trainer calls)."""
    import jax

    apply = jax.jit(optimizer.stateless_apply) if jit else optimizer.stateless_apply

    def step(grads):
        new_train, new_state = apply(
            [v.value for v in optimizer.variables],
            grads,
            [v.value for v in variables],
        )
        for variable, value in zip(variables, new_train, strict=True):
            variable.assign(value)
        for variable, value in zip(optimizer.variables, new_state, strict=True):
            variable.assign(value)

    return step


def step_function(optimizer, variables, mode):
    """A function `step(grads)` that applies `grads` to `variables` in `mode`."""
    if mode not in ("eager", "default", "function", "jit", "stateless"):
        raise ValueError(f"unknown mode {mode!r}")
    optimizer.build(variables)
    if mode == "eager":
        optimizer.jit_compile = False
    if mode in ("stateless", "jit") and BACKEND == "jax":
        return _stateless(optimizer, variables, jit=mode == "jit")

    def step(grads):
        optimizer.apply(grads, variables)

    if mode in ("function", "jit"):
        import tensorflow as tf

        return tf.function(step, jit_compile=mode == "jit")
    return step


def run_steps(optimizer, weights, grads, dtype, mode="default", names=None):
    """New variables holding `weights`, stepped with each of `grads` in `mode`.

    Args:
        names: the variables' names (their paths), or None.

    Returns:
        The list of variables.
    """
    names = names or [None] * len(weights)
    variables = [
        keras.Variable(w, dtype=dtype, name=name)
        for w, name in zip(weights, names, strict=True)
    ]
    step = step_function(optimizer, variables, mode)
    for step_grads in grads:
        step([tensor(g, dtype) for g in step_grads])
    return variables


def run_mirrored(*arguments):
    """Runs `tests/mirrored_script.py ARGUMENTS` (a MirroredStrategy scenario
    on two logical CPUs) in a fresh process with the checkout on
    `PYTHONPATH`; fails the test unless it exits with status 0. Its stdout."""
    script = pathlib.Path(__file__).resolve().parent / "mirrored_script.py"
    result = subprocess.run(
        [sys.executable, str(script), *arguments],
        capture_output=True,
        text=True,
        env=process_env(TF_CPP_MIN_LOG_LEVEL="2"),
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-5000:]
    return result.stdout
