"""The documentation site covers the public API, and the README stays short.

Reads the Markdown sources only: no MkDocs needed (CI builds the site itself,
strictly, in .ci/run).
"""

import ast
import pathlib
import re

import tf_lars
import tf_lars.distribute

ROOT = pathlib.Path(__file__).resolve().parent.parent
API_PAGES = ROOT / "docs" / "api"
# `::: dotted.path` at the start of a line: one mkdocstrings entry.
_DIRECTIVE = re.compile(r"^:::\s+([\w.]+)\s*$", re.MULTILINE)


def _documented_names():
    """The last component of every `:::` path on the API pages."""
    names = set()
    for page in API_PAGES.glob("*.md"):
        for path in _DIRECTIVE.findall(page.read_text(encoding="utf-8")):
            names.add(path.rsplit(".", 1)[-1])
    return names


def _module_all(relative_path):
    """A module's `__all__`, read from its source, or its public top-level defs."""
    tree = ast.parse((ROOT / relative_path).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "__all__"
            for target in node.targets
        ):
            return set(ast.literal_eval(node.value))
    return {
        node.name
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.ClassDef))
        and not node.name.startswith("_")
    }


def test_directive_parser_reads_entries_and_nothing_else():
    text = "# t\n\n::: tf_lars.LARS\n    options:\n      x: 1\n\nsee ::: a.B\n"
    assert _DIRECTIVE.findall(text) == ["tf_lars.LARS"]


def test_every_public_name_has_an_api_entry():
    public = (
        set(tf_lars.__all__)
        | _module_all("tf_lars/callbacks.py")
        | _module_all("tf_lars/schedules.py")
        | set(tf_lars.distribute.__all__)
    )
    assert {"TrustRatioMonitor", "LossScaleMonitor"} <= public
    assert "linear_scaled_learning_rate" in public
    missing = sorted(public - _documented_names())
    assert not missing, f"public names with no `:::` entry under docs/api: {missing}"


def test_every_api_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = sorted(page.name for page in API_PAGES.glob("*.md"))
    assert len(pages) >= 9
    assert [page for page in pages if f"api/{page}" not in nav] == []


def test_readme_is_at_most_250_lines():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines"


def test_readme_keeps_the_quickstart_commands_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert 'pip install ".[cli]" && tf-lars train' in readme
    assert 'pip install ".[test]" && python -m pytest -q' in readme
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert 'pip install ".[test]" && python -m pytest -q' in ci
    assert "mkdocs build --strict" in ci
