"""The `Example:` blocks in public docstrings run and print what they say."""

import doctest

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lars


def _public_objects():
    for name in tf_lars.__all__:
        yield name, getattr(tf_lars, name)


@pytest.mark.parametrize("name, obj", list(_public_objects()))
def test_docstring_examples_run(name, obj):
    finder = doctest.DocTestFinder(recurse=False)
    tests = finder.find(
        obj, name, globs={"keras": keras, "tf": tf, "np": np, "tf_lars": tf_lars}
    )
    examples = sum(len(t.examples) for t in tests)
    assert examples > 0, f"{name} has no runnable example"
    runner = doctest.DocTestRunner(
        optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS
    )
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, (
        f"{result.failed} of {result.attempted} examples failed in {name}"
    )
