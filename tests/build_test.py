"""Keeps the Bazel BUILD file true to the tree (Starlark parses as Python)."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _rules():
    tree = ast.parse((ROOT / "BUILD").read_text(encoding="utf-8"))
    rules = []
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            call = node.value
            kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
            rules.append((call.func.id, kwargs))
    return rules


def test_build_parses_and_declares_the_library():
    libraries = [kw for kind, kw in _rules() if kind == "py_library"]
    names = {kw["name"] for kw in libraries}
    assert "tf_lars" in names


LIBRARY_OF_PART = {"cli": "tf_lars_cli", "distribute": "tf_lars_distribute"}


def _library_for(module):
    """The py_library a module belongs in: one per part of the package."""
    parts = pathlib.PurePath(module).parts
    return LIBRARY_OF_PART.get(parts[1], "tf_lars") if len(parts) > 2 else "tf_lars"


def test_every_package_module_is_in_its_part_s_library():
    libraries = {kw["name"]: kw for kind, kw in _rules() if kind == "py_library"}
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "tf_lars").rglob("*.py")}
    assert modules, "no modules found"
    declared = set()
    for name in ("tf_lars", "tf_lars_distribute", "tf_lars_cli"):
        srcs = set(libraries[name]["srcs"])
        assert {_library_for(m) for m in srcs} <= {name}, (name, sorted(srcs))
        declared |= srcs
    assert modules - declared == set(), (
        f"missing from BUILD: {sorted(modules - declared)}"
    )
    assert declared - modules == set(), (
        f"in BUILD but not on disk: {sorted(declared - modules)}"
    )


def test_libraries_depend_only_downward():
    libraries = {kw["name"]: kw for kind, kw in _rules() if kind == "py_library"}
    assert libraries["tf_lars"].get("deps", []) == []
    assert libraries["tf_lars_distribute"]["deps"] == [":tf_lars"]
    assert libraries["tf_lars_cli"]["deps"] == [":tf_lars_distribute"]
    configs = {str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("*.yaml")}
    assert set(libraries["tf_lars_cli"]["data"]) == configs


def test_every_test_file_has_a_py_test():
    tests = {kw["name"]: kw for kind, kw in _rules() if kind == "py_test"}
    files = {p.name for p in (ROOT / "tests").glob("*_test.py")}
    assert "build_test.py" in files
    declared = {
        src for kw in tests.values() for src in kw["srcs"] if src.endswith("_test.py")
    }
    declared = {pathlib.PurePath(src).name for src in declared}
    assert files - declared == set(), (
        f"tests missing from BUILD: {sorted(files - declared)}"
    )
    assert declared - files == set(), (
        f"py_test for missing files: {sorted(declared - files)}"
    )
    for name, kw in tests.items():
        assert ":tf_lars" in kw.get("deps", []) or "//:tf_lars" in kw.get("deps", []), (
            name
        )


def test_test_helpers_are_declared():
    helpers = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").glob("*.py")
        if not p.name.endswith("_test.py")
    }
    declared = set()
    for _kind, kw in _rules():
        declared |= set(kw.get("srcs", [])) | set(kw.get("data", []))
    assert helpers - declared == set(), (
        f"helpers missing from BUILD: {sorted(helpers - declared)}"
    )


def test_benchmark_scripts_a_test_loads_are_its_data():
    """A test that loads `benchmarks/<name>.py` declares it as data (the sandbox)."""
    tests = {kw["main"]: kw for kind, kw in _rules() if kind == "py_test"}
    checked = 0
    for main, kw in tests.items():
        tree = ast.parse((ROOT / main).read_text(encoding="utf-8"))
        loaded = {
            f"benchmarks/{node.args[0].value}.py"
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "load"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "benchmark_scripts"
        }
        checked += len(loaded)
        missing = loaded - set(kw.get("data", []))
        assert missing == set(), (main, sorted(missing))
    assert checked >= 4, checked


def test_every_test_file_is_in_exactly_one_part():
    # tests/conftest.py's PARTS marks each test (`pytest -m optimizers`);
    # a file in no part stops collection, a stale or repeated name is here.
    from tests import conftest

    files = sorted(path.name for path in (ROOT / "tests").glob("*_test.py"))
    named = [f"{name}_test.py" for names in conftest.PARTS.values() for name in names]
    assert sorted(named) == files
    assert set(conftest.PARTS) == {"optimizers", "distribute", "cli", "project"}


def test_every_second_tier_name_is_a_test_of_its_file():
    # A renamed test would fall back into the first tier unseen.
    from tests import conftest

    tables = [conftest.SECOND_TIER, conftest.SECOND_TIER_TESTS]
    for file, names in [item for table in tables for item in table.items()]:
        tree = ast.parse((ROOT / "tests" / file).read_text())
        tests = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert {name.partition("[")[0] for name in names} <= tests, file
    assert not set(conftest.SECOND_TIER) & set(conftest.SECOND_TIER_TESTS)


def _imported_modules(path):
    """The `tf_lars` modules a file imports (`from tf_lars import x`, `import
    tf_lars.x`, `from tf_lars.x import y`), anywhere in the file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "tf_lars":
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "tf_lars."
        ):
            names.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            names.update(
                alias.name.split(".")[1]
                for alias in node.names
                if alias.name.startswith("tf_lars.")
            )
    return names


RULE_FILES = ("lars.py", "lamb.py", "trust_ratio.py", "_trust.py")


def test_the_rules_import_no_backend_fast_path():
    # The portable rules are `keras.ops`; TensorFlow's fast path is the
    # subclasses of tf_lars/backend/tensorflow.py, which import the rules
    # (never the reverse).
    package = ROOT / "tf_lars"
    for name in RULE_FILES:
        for node in ast.walk(ast.parse((package / name).read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [getattr(node, "module", None) or ""]
                names += [alias.name for alias in node.names]
                assert not any("tensorflow" in n for n in names), (name, names)
    assert {"lars", "lamb", "trust_ratio", "_trust"} <= _imported_modules(
        package / "backend" / "tensorflow.py"
    )


def test_the_rules_hold_no_switch_for_a_benchmark():
    # A benchmark row's variant swaps a kernel itself (benchmarks/bench.py,
    # `with_kernel`); the optimizers have no attribute that exists for it.
    package = ROOT / "tf_lars"
    for name in RULE_FILES:
        tree = ast.parse((package / name).read_text())
        assigned = {
            target.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        assert not assigned & {"_norms", "_recomputes_for_norm"}, name
