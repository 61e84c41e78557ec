"""TensorFlow is optional: what `pip install tf_lars` brings, and what needs more.

The install itself, without TensorFlow, is tested end to end by `.ci/run`
(tests/no_tensorflow_script.py in a fresh environment). Here, in any
environment, TensorFlow is hidden from a child process (`sys.modules` maps it
to None, so that `importlib.util.find_spec` finds nothing and importing it
raises `ModuleNotFoundError`, as when it is not installed).
"""

import os
import pathlib
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _without_tensorflow(load, backend, keras_home):
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    env.update(PYTHONPATH=str(ROOT), KERAS_HOME=str(keras_home))
    if backend is not None:
        env["KERAS_BACKEND"] = backend
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "no_tensorflow_script.py")]
        + ["--hide-tensorflow", load],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.splitlines()


@pytest.mark.parametrize("backend", [None, "jax", "torch"])
@pytest.mark.parametrize(
    "feature, load",
    [
        ("tf_lars.AGN", "tf_lars.AGN"),
        ("tf_lars.AGN", "tf_lars.agn"),
        ("tf_lars.distribute", "tf_lars.distribute"),
        ("tf_lars.distribute", "tf_lars.distribute.launch"),
    ],
)
def test_tensorflow_only_features_name_the_extra_without_tensorflow(
    feature, load, backend, tmp_path
):
    # One error, before Keras (whose TensorFlow backend, the default, would
    # fail on its own "No module named 'tensorflow'") or TensorFlow loads.
    assert _without_tensorflow(load, backend, tmp_path) == [
        f"ModuleNotFoundError {feature} needs TensorFlow, which is not installed: "
        'install it with `pip install "tf_lars[tensorflow]"` and run it on '
        "Keras's TensorFlow backend (KERAS_BACKEND=tensorflow).",
        "[]",
    ]


def test_the_missing_tensorflow_error_is_an_import_error_naming_the_module():
    from tf_lars import _require_tensorflow_backend

    saved = sys.modules.get("tensorflow")
    sys.modules["tensorflow"] = None
    try:
        with pytest.raises(ModuleNotFoundError) as raised:
            _require_tensorflow_backend("tf_lars.AGN")
    finally:
        if saved is None:
            del sys.modules["tensorflow"]
        else:
            sys.modules["tensorflow"] = saved
    assert isinstance(raised.value, ImportError)
    assert raised.value.name == "tensorflow"


def test_the_core_installs_without_tensorflow_and_its_extras_with_it():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = project["dependencies"]
    assert not [entry for entry in core if entry.startswith("tensorflow")], core
    assert "keras>=3.8" in core
    assert "numpy" in core
    extras = project["optional-dependencies"]
    assert "tensorflow>=2.16" in extras["tensorflow"]
    # The Quickstart's commands (`pip install ".[cli]"`, `".[test]"`) get it.
    assert "tf_lars[tensorflow]" in extras["cli"]
    assert "tf_lars[cli]" in extras["test"]


def test_no_tensorflow_script_refuses_an_environment_with_tensorflow(tmp_path):
    # The script .ci/run runs in a TensorFlow-free environment; where
    # TensorFlow is installed it must fail rather than pass unchecked.
    env = dict(os.environ, KERAS_HOME=str(tmp_path), KERAS_BACKEND="tensorflow")
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "no_tensorflow_script.py")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        "no-tensorflow FAILED: TensorFlow is installed; Keras runs on TensorFlow "
        "(set KERAS_BACKEND=jax)"
    ]
