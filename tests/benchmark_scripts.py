"""The scripts of `benchmarks/`, loaded from their paths for the tests.

They are scripts of the source checkout, not modules of the package; each
is loaded once per test process (`load("bench")`, `load("jax_bench")`).
"""

import functools
import importlib.util
import pathlib

DIRECTORY = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@functools.cache
def load(name):
    """The module of `benchmarks/<name>.py`."""
    spec = importlib.util.spec_from_file_location(name, DIRECTORY / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
