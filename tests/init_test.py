"""Tests for the package layout (tf_lars/__init__.py): public names, imports."""

import ast
import os
import pathlib
import re
import subprocess
import sys

import keras

import tf_lars

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tf_lars"


def _run(code, argv0=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3")
    if argv0:
        code = f"import sys; sys.argv[0] = {argv0!r}\n" + code
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )


def _imported_tf_lars_modules(path):
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n for n in names if n.startswith("tf_lars")}


def test_all_is_sorted_and_every_name_is_registered():
    assert tf_lars.__all__ == sorted(tf_lars.__all__)
    assert tf_lars.__all__ == [
        "AGN",
        "LAMB",
        "LARS",
        "LossScaleOptimizer",
        "TrustRatio",
        "WarmupPolynomialDecay",
    ]
    for name in tf_lars.__all__:
        cls = getattr(tf_lars, name)
        assert keras.saving.get_registered_name(cls) == f"tf_lars>{name}"
    assert tf_lars.callbacks.TrustRatioMonitor
    assert tf_lars.schedules.linear_scaled_learning_rate


def test_the_three_parts_import_only_downward():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        part = path.relative_to(PACKAGE).parts[0]
        for module in _imported_tf_lars_modules(path):
            if part not in ("cli", "distribute") and module.startswith(
                ("tf_lars.cli", "tf_lars.distribute")
            ):
                upward.append(f"{path.relative_to(ROOT)} imports {module}")
            if part == "distribute" and module.startswith("tf_lars.cli"):
                upward.append(f"{path.relative_to(ROOT)} imports {module}")
    assert upward == []


def test_core_imports_without_the_command_line_extras():
    # `sys.modules[name] = None` makes `import name` raise ImportError: the
    # state of an environment where the `cli` extra is not installed.
    result = _run(
        "import sys\n"
        "for name in ('yaml', 'matplotlib', 'sklearn', 'pydantic'):\n"
        "    sys.modules[name] = None\n"
        "import tf_lars, tf_lars.distribute\n"
        "from tf_lars.distribute import trainer\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('tf_lars.cli'))\n"
        "print(tf_lars.LARS.__name__, tf_lars.AGN.__name__, loaded)\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "LARS AGN []"


def test_the_command_process_defers_tensorflow_until_asked():
    result = _run(
        "import sys\n"
        "import tf_lars\n"
        "before = 'tensorflow' in sys.modules\n"
        "tf_lars.load_public_names()\n"
        "import keras\n"
        "registered = keras.saving.get_registered_object('tf_lars>LARS')\n"
        "print(before, 'tensorflow' in sys.modules, registered.__name__)\n",
        argv0="/usr/local/bin/tf-lars",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False True LARS"


def test_version_is_the_newest_changelog_entry():
    # One source for the version (`tf_lars.__version__`); the changelog's
    # newest entry names it, so a release cannot ship without its notes.
    changelog = (ROOT / "CHANGELOG.md").read_text()
    newest = re.search(r"^## (\S+) \(\d{4}-\d{2}-\d{2}\)$", changelog, re.M)
    assert newest is not None
    assert newest.group(1) == tf_lars.__version__
    assert tf_lars.__version__ != "0.1.0"
