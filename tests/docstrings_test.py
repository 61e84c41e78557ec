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


# -------------------------------------------------- as the site renders them
# The API pages read the docstrings with griffe's Google-style parser (what
# mkdocstrings uses; no translation layer in between) and render their text
# as Markdown. Each public docstring is rendered here the same way: a raw
# ``` fence, a `>>>` prompt outside a code block or a blockquote (a line
# starting with `>`) means the page shows it wrongly.
def _site_objects():
    import griffe

    package = griffe.load(
        "tf_lars",
        docstring_parser="google",
        search_paths=[str(pathlib.Path(tf_lars.__file__).parents[1])],
    )

    def walk(obj):
        for name, member in obj.members.items():
            if name.startswith("_") or member.is_alias:
                continue
            yield member
            if member.is_class or member.is_module:
                yield from walk(member)

    return [obj for obj in walk(package) if obj.docstring]


def _rendered(obj):
    import markdown

    def html(text):
        return markdown.markdown(text, extensions=["fenced_code"])

    parts = []
    # As mkdocs.yml configures the parser: types are given in prose.
    for section in obj.docstring.parse("google", warn_missing_types=False):
        value = section.value
        if section.kind.value == "examples":
            parts += [
                f"<pre>{text}</pre>" if kind.value == "examples" else html(text)
                for kind, text in value
            ]
        elif section.kind.value == "admonition":
            parts.append(html(value.contents))
        elif isinstance(value, str):
            parts.append(html(value))
        else:
            parts += [html(item.description) for item in value]
    return "\n".join(parts)


def _misrendered(html):
    outside_code = re.sub(r"<pre>.*?</pre>|<code>.*?</code>", "", html, flags=re.S)
    return [
        problem
        for problem, found in (
            ("a raw ``` fence", "```" in html),
            ("a >>> prompt outside a code block", "&gt;&gt;&gt;" in outside_code),
            ("quoted text (a blockquote)", "<blockquote>" in html),
        )
        if found
    ]


def test_every_public_docstring_renders_its_code_as_code(caplog):
    objects = _site_objects()
    assert len(objects) > 150
    with caplog.at_level("WARNING", logger="griffe"):
        found = {obj.path: _misrendered(_rendered(obj)) for obj in objects}
    assert {path: problems for path, problems in found.items() if problems} == {}
    assert [r.getMessage() for r in caplog.records] == []


def test_the_render_check_finds_what_it_forbids():
    import griffe

    def problems(text):
        function = griffe.Function("f", docstring=griffe.Docstring(text))
        return _misrendered(_rendered(function))

    # A fence indented under a paragraph is shown as it is in a code box.
    assert problems("Runs.\nLike this:\n\n    ```python\n    f()\n    ```\n") == [
        "a raw ``` fence"
    ]
    # Keras's form: `>>>` lines right after `Example:` become nested quotes
    # (the prompts lost); a prompt inside a paragraph stays text.
    assert problems("Runs.\n\nExample:\n\n>>> f()\n1\n") == [
        "quoted text (a blockquote)"
    ]
    assert problems("Runs.\nAs in:\n    >>> f()\n") == [
        "a >>> prompt outside a code block"
    ]
    assert problems("Runs.\n\n> 0. Defaults to 1.\n") == ["quoted text (a blockquote)"]
    google = (
        "Runs.\n\nExamples:\n    >>> f()\n    1\n\n    ```python\n    f()\n    ```\n"
    )
    assert problems(google) == []
