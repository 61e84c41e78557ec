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
    tf_lars.schedules, tf_lars.callbacks, tf_lars.WarmupPolynomialDecay
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
