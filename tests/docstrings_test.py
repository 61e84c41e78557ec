"""The `Example:` blocks in public docstrings run and print what they say."""

import ast
import doctest
import pathlib
import re

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


# A speed or memory figure in a docstring goes stale as the code changes;
# figures live in docs/guides/benchmarks.md beside the commands that made them.
_FIGURE = re.compile(
    r"\b\d+(?:\.\d+)?\s?(?:ms|µs|us|GB|MB|GiB|MiB)\b"  # a time or a size
    r"|\b\d+\.\d+x\b"  # a measured ratio ("1.46x")
    r"|\b\d+(?:\.\d+)?% of\b"  # a share ("45% of the parameters")
)


def _docstrings(tree):
    for node in ast.walk(tree):
        if isinstance(
            node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        ):
            text = ast.get_docstring(node)
            if text:
                yield getattr(node, "name", "<module>"), text


def test_no_docstring_holds_a_measured_figure():
    root = pathlib.Path(tf_lars.__file__).parent
    sources = sorted(root.rglob("*.py"))
    assert len(sources) > 20
    found = [
        f"{path.relative_to(root.parent)}: {name}: {match.group(0)!r}"
        for path in sources
        for name, text in _docstrings(ast.parse(path.read_text(encoding="utf-8")))
        for match in _FIGURE.finditer(text)
    ]
    assert not found, "\n".join(found)


def test_the_figure_check_finds_the_figures_it_forbids():
    stale = ast.parse(
        '"""About 2.5 ms a kernel; 1.46x SGD; 28 buffers, 45% of the parameters."""'
    )
    texts = [text for _, text in _docstrings(stale)]
    assert [m.group(0) for m in _FIGURE.finditer(texts[0])] == [
        "2.5 ms",
        "1.46x",
        "45% of",
    ]
