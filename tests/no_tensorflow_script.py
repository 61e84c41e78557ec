"""tf_lars without TensorFlow: what a JAX user gets from `pip install tf_lars jax`.

Run by `.ci/run` in a fresh virtual environment holding the package without
extras and `jax[cpu]`, so with Keras, NumPy and JAX but no TensorFlow:

    KERAS_BACKEND=jax python tests/no_tensorflow_script.py

Checks that TensorFlow cannot be found; trains a small classifier with
`model.fit` under LARS, LAMB, TrustRatio and LossScaleOptimizer on generated
data (the loss must fall to below half its first epoch's); saves and loads
each model as a `.keras` file (same class, config, weights and predictions);
checks that `tf_lars.AGN` and `import tf_lars.distribute` each raise one
`ModuleNotFoundError` naming the `tensorflow` extra; and that TensorFlow was
never imported. Runs the installed `tf_lars` (not the checkout's). Prints one
line, "no-tensorflow OK: ..." (exit 0) or "no-tensorflow FAILED: ..." (exit 1).
"""

import importlib.util
import pathlib
import sys
import tempfile

if __name__ == "__main__" and sys.argv[1:2] == ["--hide-tensorflow"]:
    # tests/no_tensorflow_test.py, in any environment: TensorFlow hidden (an
    # import of it raises ModuleNotFoundError), one way of loading a
    # TensorFlow-only feature; prints its ImportError and what got loaded.
    sys.modules["tensorflow"] = None
    import tf_lars

    try:
        if sys.argv[2] == "tf_lars.AGN":
            tf_lars.AGN  # noqa: B018 - the lazy attribute is the import
        else:
            importlib.import_module(sys.argv[2])
    except ImportError as error:
        print(type(error).__name__, error)
    loaded = {m.split(".")[0] for m, v in sys.modules.items() if v is not None}
    print(sorted(loaded & {"keras", "tensorflow"}))
    sys.exit(0)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_lars  # noqa: E402

EXTRA = 'pip install "tf_lars[tensorflow]"'

OPTIMIZERS = {
    "LARS": lambda: tf_lars.LARS(
        learning_rate=0.5, momentum=0.9, weight_decay=1e-4, trust_coefficient=0.02
    ),
    "LAMB": lambda: tf_lars.LAMB(learning_rate=0.02, weight_decay=0.01),
    "TrustRatio": lambda: tf_lars.TrustRatio(
        keras.optimizers.SGD(0.5, momentum=0.9), trust_coefficient=0.02
    ),
    "LossScaleOptimizer": lambda: tf_lars.LossScaleOptimizer(
        tf_lars.LARS(learning_rate=0.5, momentum=0.9, trust_coefficient=0.02),
        initial_scale=2.0**10,
    ),
}


def _data():
    """Three classes, linearly separable, from a fixed seed."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype("float32")
    y = np.argmax(x @ rng.normal(size=(8, 3)), axis=1).astype("int32")
    return x, y


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )


def _train_save_load(name, folder, failures):
    """Trains with optimizer `name`; returns its first and last epoch loss."""
    x, y = _data()
    model = _model()
    model.compile(optimizer=OPTIMIZERS[name](), loss="sparse_categorical_crossentropy")
    losses = model.fit(x, y, batch_size=64, epochs=8, verbose=0).history["loss"]
    if not losses[-1] < 0.5 * losses[0]:
        failures.append(f"{name}: loss {losses[0]:.3f} -> {losses[-1]:.3f}")

    path = folder / f"{name}.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    if type(loaded.optimizer) is not type(model.optimizer):
        failures.append(f"{name}: loaded as {type(loaded.optimizer).__name__}")
    elif loaded.optimizer.get_config() != model.optimizer.get_config():
        failures.append(f"{name}: the loaded optimizer's config differs")
    saved = [np.asarray(v) for v in model.optimizer.variables]
    restored = [np.asarray(v) for v in loaded.optimizer.variables]
    if len(saved) != len(restored) or not all(
        np.array_equal(a, b) for a, b in zip(saved, restored)
    ):
        failures.append(f"{name}: the loaded optimizer's variables differ")
    if not np.array_equal(model.predict(x, verbose=0), loaded.predict(x, verbose=0)):
        failures.append(f"{name}: the loaded model predicts otherwise")
    return losses[0], losses[-1]


def _import_error(load):
    """The error `load()` raises, as "Type: message", or None."""
    try:
        load()
    except ImportError as error:
        return f"{type(error).__name__}: {error}"
    return None


def _check_tensorflow_only_features(failures):
    loads = {
        "tf_lars.AGN": lambda: tf_lars.AGN,
        "tf_lars.distribute": lambda: importlib.import_module("tf_lars.distribute"),
    }
    for feature, load in loads.items():
        error = _import_error(load)
        if error is None:
            failures.append(f"{feature} loaded without TensorFlow")
        elif not error.startswith("ModuleNotFoundError: ") or EXTRA not in error:
            failures.append(f"{feature} raised {error!r}, not naming {EXTRA}")


def main():
    failures = []
    if importlib.util.find_spec("tensorflow") is not None:
        failures.append("TensorFlow is installed")
    if keras.backend.backend() == "tensorflow":
        failures.append("Keras runs on TensorFlow (set KERAS_BACKEND=jax)")
    if failures:
        print(f"no-tensorflow FAILED: {'; '.join(failures)}")
        return 1

    trained = []
    with tempfile.TemporaryDirectory() as folder:
        for name in OPTIMIZERS:
            first, last = _train_save_load(name, pathlib.Path(folder), failures)
            trained.append(f"{name} {first:.3f}->{last:.3f}")
    _check_tensorflow_only_features(failures)
    if "tensorflow" in sys.modules:
        failures.append("TensorFlow was imported")

    if failures:
        print(f"no-tensorflow FAILED: {'; '.join(failures)}")
        return 1
    print(
        f"no-tensorflow OK: keras {keras.__version__} on "
        f"{keras.backend.backend()}, losses {', '.join(trained)}; saved and "
        f"loaded; AGN and tf_lars.distribute name the tensorflow extra"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
