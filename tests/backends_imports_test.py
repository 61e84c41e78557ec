"""What `import tf_lars` imports on whichever Keras backend runs the suite.

On JAX and PyTorch nothing from TensorFlow may load: not at `import tf_lars`,
not when the four optimizers are built and take a step. AGN and
`tf_lars.distribute` need TensorFlow and say so in one error there.
"""

import os
import pathlib
import subprocess
import sys
import textwrap

import keras
import pytest

BACKEND = keras.backend.backend()
ROOT = pathlib.Path(__file__).resolve().parent.parent

PROBE = textwrap.dedent(
    """
    import sys

    def loaded():
        return sorted(
            m for m in sys.modules if m.split(".")[0] in ("tensorflow", "keras")
        )

    import tf_lars
    print("IMPORT", loaded()[:3])
    import keras
    import numpy as np

    def step(optimizer):
        variable = keras.Variable(np.ones((2, 2), "float32"))
        optimizer.apply([np.full((2, 2), 0.5, "float32")], [variable])
        value = keras.ops.convert_to_numpy(variable).astype("float64")
        return value.round(6).tolist()

    steps = {
        "LARS": step(tf_lars.LARS(0.1, momentum=0.9)),
        "LAMB": step(tf_lars.LAMB(0.1)),
        "TrustRatio": step(tf_lars.TrustRatio(keras.optimizers.SGD(0.1))),
        "LossScaleOptimizer": step(
            tf_lars.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=1.0)
        ),
    }
    tf_lars.load_public_names()  # off TensorFlow: all but AGN
    print("LSO", steps["LossScaleOptimizer"][0])
    print("TENSORFLOW", [m for m in loaded() if m.startswith("tensorflow")][:3])
    for name in ("tf_lars.AGN", "tf_lars.distribute"):
        try:
            tf_lars.AGN if name == "tf_lars.AGN" else __import__(name)
        except ImportError as error:
            print("ERROR", error)
        else:
            print("LOADED", name)
    """
)


def _probe():
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3")
    env["KERAS_BACKEND"] = BACKEND
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.splitlines()


def test_tensorflow_loads_only_where_keras_runs_on_it():
    lines = _probe()
    # `import tf_lars` alone imports neither Keras nor TensorFlow, anywhere.
    assert lines[0] == "IMPORT []"
    # SGD(0.1) on the unscaled gradient 0.5 from 1: 0.95.
    assert lines[1] == "LSO [0.95, 0.95]"
    if BACKEND == "tensorflow":
        assert lines[2].startswith("TENSORFLOW ['tensorflow")
        assert lines[3:] == ["LOADED tf_lars.AGN", "LOADED tf_lars.distribute"]
        return
    assert lines[2] == "TENSORFLOW []"
    assert lines[3:] == [
        f"ERROR {name} needs TensorFlow: it runs only on Keras's TensorFlow "
        f"backend, and Keras is set to the {BACKEND!r} backend. Set "
        "KERAS_BACKEND=tensorflow to use it."
        for name in ("tf_lars.AGN", "tf_lars.distribute")
    ]


def test_the_version_guard_checks_tensorflow_only_on_its_backend():
    from tf_lars import _internals

    expected = {"keras": keras.__version__}
    if BACKEND == "tensorflow":
        import tensorflow as tf

        expected = {"tensorflow": tf.__version__, **expected}
    assert _internals._installed() == expected
    assert _internals.installed_versions() == ", ".join(
        f"{name} {version}" for name, version in expected.items()
    )
    # Without TensorFlow in the picture only the Keras floor applies.
    (floor_major, floor_minor), (top_major, top_minor) = _internals.SUPPORTED["keras"]
    _internals.check_versions({"keras": f"{floor_major}.{floor_minor}.0"})
    below = f"{floor_major}.{floor_minor - 1}.0"
    with pytest.raises(_internals.UnsupportedVersionError) as error:
        _internals.check_versions({"keras": below})
    assert str(error.value) == (
        f"tf_lars keras version too old: installed keras {below}; tf_lars "
        f"supports keras>={floor_major}.{floor_minor} (tested through "
        f"{top_major}.{top_minor}). Upgrade, or set TF_LARS_SKIP_VERSION_CHECK=1 "
        "to try at your own risk."
    )
