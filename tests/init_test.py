"""Tests for the package layout (tf_lars/__init__.py): public names, imports."""

import ast
import os
import pathlib
import re
import subprocess
import sys

import keras
import numpy as np
import pytest

import tf_lars

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tf_lars"


def _run(code, argv0=None, args=()):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3")
    if argv0:
        code = f"import sys; sys.argv[0] = {argv0!r}\n" + code
    return subprocess.run(
        [sys.executable, "-c", code, *args],
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
        "DiLoCo",
        "GradientNoiseScale",
        "LAMB",
        "LARS",
        "LossScaleOptimizer",
        "MissingInternalError",
        "TrustRatio",
        "UnsupportedVersionError",
        "WarmupPolynomialDecay",
    ]
    errors = {"MissingInternalError", "UnsupportedVersionError"}
    for name in errors:
        assert issubclass(getattr(tf_lars, name), Exception)
    for name in sorted(set(tf_lars.__all__) - errors):
        cls = getattr(tf_lars, name)
        assert keras.saving.get_registered_name(cls) == f"tf_lars>{name}"
    assert tf_lars.callbacks.TrustRatioMonitor
    assert tf_lars.schedules.linear_scaled_learning_rate


@pytest.mark.parametrize("name", ["x.y", "keras.optimizers.SGD", "lars.x", "", "a-b"])
def test_a_name_that_is_no_identifier_is_an_attribute_error(name):
    # A module `__getattr__` answers AttributeError, so `hasattr` and
    # `getattr(tf_lars, name, None)` work (the command line looks class
    # names up that way); `find_spec("tf_lars.x.y")` raised
    # ModuleNotFoundError.
    assert not hasattr(tf_lars, name)
    with pytest.raises(AttributeError, match="has no attribute"):
        getattr(tf_lars, name)
    assert tf_lars.lars.__name__ == "tf_lars.lars"  # a submodule still


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


@pytest.mark.parametrize("argv0", ["/usr/local/bin/tf-lars", "train.py"])
def test_every_process_defers_tensorflow_until_asked(argv0):
    # One rule, whatever the process is called: `import tf_lars` imports
    # neither Keras nor TensorFlow; the names load on first use.
    result = _run(
        "import sys\n"
        "import tf_lars\n"
        "before = sorted({m.split('.')[0] for m in sys.modules} & "
        "{'tensorflow', 'keras'})\n"
        "tf_lars.load_public_names()\n"
        "import keras\n"
        "registered = keras.saving.get_registered_object('tf_lars>LARS')\n"
        "print(before, 'tensorflow' in sys.modules, registered.__name__)\n",
        argv0=argv0,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[] True LARS"


def test_the_package_does_not_read_the_command_line():
    source = (PACKAGE / "__init__.py").read_text()
    assert "argv" not in source
    assert not hasattr(tf_lars, "_started_as_command")


def test_a_saved_file_loads_in_a_process_that_only_imported_tf_lars(tmp_path):
    # Keras finds saved classes only in its registry: the stand-ins that
    # `import tf_lars` registers when Keras loads make the file load, and the
    # loaded optimizer continues exactly (its state came back).
    path = tmp_path / "model.keras"
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2, name="dense")(inputs))
    schedule = tf_lars.WarmupPolynomialDecay(0.5, warmup_steps=2, decay_steps=10)
    model.compile(
        optimizer=tf_lars.LossScaleOptimizer(
            tf_lars.LARS(schedule, momentum=0.9), initial_scale=64.0
        ),
        loss="mse",
    )
    x = np.linspace(-1.0, 1.0, 12, dtype="float32").reshape(4, 3)
    y = np.ones((4, 2), "float32")
    model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    model.save(path)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    expected = keras.ops.convert_to_numpy(model.get_layer("dense").kernel)
    result = _run(
        "import sys\n"
        "import numpy as np\n"
        "import tf_lars\n"
        "import keras\n"
        f"model = keras.models.load_model({str(path)!r})\n"
        "opt = model.optimizer\n"
        "x = np.linspace(-1.0, 1.0, 12, dtype='float32').reshape(4, 3)\n"
        "model.fit(x, np.ones((4, 2), 'float32'), batch_size=4, verbose=0)\n"
        "print(type(opt).__module__, type(opt.inner_optimizer).__name__,\n"
        "      opt.inner_optimizer.get_config()['learning_rate']['class_name'],\n"
        "      int(opt.iterations))\n"
        "np.save(sys.argv[1], keras.ops.convert_to_numpy(\n"
        "    model.get_layer('dense').kernel))\n",
        args=[str(tmp_path / "kernel.npy")],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == [
        "tf_lars.loss_scale",
        "LARS",
        "WarmupPolynomialDecay",
        "3",
    ]
    np.testing.assert_allclose(
        np.load(tmp_path / "kernel.npy"), expected, rtol=1e-6, atol=1e-7
    )


def test_every_registered_name_has_a_stand_in_that_loads_it():
    # `_REGISTERED` is complete: it names exactly what the modules register.
    tf_lars.load_public_names()
    registered = {
        name.split(">", 1)[1]
        for name in keras.saving.get_custom_objects()
        if name.startswith("tf_lars>")
    }
    assert registered == set(tf_lars._REGISTERED)
    for name, module in tf_lars._REGISTERED.items():
        cls = keras.saving.get_registered_object(f"tf_lars>{name}")
        assert cls.__module__ == module and cls.__name__ == name
    # A stand-in hands the config to the real class.
    config = tf_lars.LARS(0.25, momentum=0.5).get_config()
    rebuilt = tf_lars._RegisteredStandIn("LARS").from_config(config)
    assert type(rebuilt) is type(tf_lars.LARS()) and isinstance(rebuilt, tf_lars.LARS)
    assert rebuilt.momentum == 0.5
    assert float(keras.ops.convert_to_numpy(rebuilt.learning_rate)) == 0.25


def test_version_is_the_newest_changelog_entry():
    # One source for the version (`tf_lars.__version__`); the changelog's
    # newest entry names it, so a release cannot ship without its notes.
    changelog = (ROOT / "CHANGELOG.md").read_text()
    newest = re.search(r"^## (\S+) \(\d{4}-\d{2}-\d{2}\)$", changelog, re.M)
    assert newest is not None
    assert newest.group(1) == tf_lars.__version__
    assert tf_lars.__version__ != "0.1.0"


def test_distribute_names_the_configured_backend_without_importing_keras(tmp_path):
    # The backend comes from Keras's own settings (here `keras.json` in
    # KERAS_HOME), read without importing Keras, so that the launcher stays
    # light on TensorFlow and fails at once elsewhere.
    (tmp_path / "keras.json").write_text('{"backend": "jax"}')
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    env.update(PYTHONPATH=str(ROOT), KERAS_HOME=str(tmp_path))
    code = (
        "import sys\n"
        "try:\n"
        "    import tf_lars.distribute\n"
        "except ImportError as error:\n"
        "    print(error)\n"
        "loaded = {m.split('.')[0] for m in sys.modules}\n"
        "print(sorted(loaded & {'keras', 'tensorflow'}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "tf_lars.distribute needs TensorFlow: it runs only on Keras's TensorFlow "
        "backend, and Keras is set to the 'jax' backend. Set "
        "KERAS_BACKEND=tensorflow to use it.",
        "[]",
    ]
