"""Across Keras backends: saved files and, on JAX, keras.distribution.

Saved files: tests/data/make_across_backends.py wrote, on each backend, a
`.keras` file per optimizer (a model after one epoch of `fit`) and the
weights its own backend reached after one more epoch. Whatever backend runs
this loads the other backends' files and requires its next epoch to reach
those weights (to float32 rounding: backends order a matmul's sums
differently).

keras.distribution (JAX): `DataParallel` over two host devices and
`ModelParallel` with a Dense kernel sharded over them give one device's
numbers; under sharding the trust ratio is still the norm of the whole
variable (tests/distribution_script.py, in its own process because
`XLA_FLAGS` must be set before JAX starts).
"""

import importlib
import os
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest

import tf_lars
from tests.data import make_across_backends as writer

DATA = pathlib.Path(__file__).resolve().parent / "data"
BACKEND = keras.backend.backend()
WRITERS = [b for b in ("tensorflow", "jax", "torch") if b != BACKEND]


@pytest.mark.parametrize("name", writer.OPTIMIZERS)
@pytest.mark.parametrize("written_on", WRITERS)
def test_saved_file_continues_as_on_the_backend_that_wrote_it(written_on, name):
    stem = DATA / f"across_{written_on}_{name}"
    model = keras.models.load_model(f"{stem}.keras")
    if BACKEND == "torch" and written_on == "jax" and name != "loss_scale":
        # JAX saves its "auto" as `jit_compile=True`, which PyTorch runs as
        # torch.compile: 25 to 40 s a file on 2 cores. Each rule's compiled
        # `fit` is a contract-table row (tests/contract_test.py's
        # TORCH_COMPILED_ROWS); the loss scale around LARS, which no row
        # compiles, continues compiled here.
        assert model.jit_compile is True
        model.jit_compile = False
    expected = writer.make_optimizer(name)
    assert type(model.optimizer) is type(expected)
    assert model.optimizer.get_config()["name"] == expected.get_config()["name"]
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 5
    writer.epoch(model)
    continued = np.load(f"{stem}_continued.npz")
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 10
    for key, actual in writer.weights(model).items():
        np.testing.assert_allclose(
            actual, continued[key], rtol=1e-5, atol=1e-6, err_msg=key
        )
    if isinstance(model.optimizer, tf_lars.LossScaleOptimizer):
        # 10 finite steps, growth every 3: the scale doubled 3 times.
        assert float(keras.ops.convert_to_numpy(model.optimizer.loss_scale)) == 2**13


def _backend_subclasses():
    """{public class: its subclass} of the running backend."""
    return importlib.import_module(f"tf_lars.backend.{BACKEND}").SUBCLASSES


@pytest.mark.parametrize("public", ["LARS", "LAMB", "TrustRatio"])
def test_the_backend_subclass_reads_as_the_public_class(public):
    # `tf_lars.LARS(...)` constructs its backend's subclass (on TensorFlow
    # `tf_lars.backend.tensorflow.LARS`, on JAX `tf_lars.backend.jax.LARS`,
    # on PyTorch `tf_lars.backend.torch.LARS`),
    # which serializes under the public class's module, name and registered
    # name, and deserializes to itself.
    cls = getattr(tf_lars, public)
    made = cls(keras.optimizers.SGD()) if public == "TrustRatio" else cls()
    assert isinstance(made, cls)
    assert type(made) is _backend_subclasses().get(cls, cls)
    if BACKEND == "jax" and public == "TrustRatio":
        assert type(made) is cls  # no JAX override: the portable rule
    else:
        assert type(made) is not cls
    config = keras.saving.serialize_keras_object(made)
    assert config["module"] == cls.__module__ == type(made).__module__
    assert config["class_name"] == public
    assert config["registered_name"] == f"tf_lars>{public}"
    again = keras.saving.deserialize_keras_object(config)
    assert type(again) is type(made) and again.get_config() == made.get_config()


@keras.saving.register_keras_serializable(package="tests")
class HalvedLARS(tf_lars.LARS):
    """A user's subclass: LARS at half the learning rate."""

    def update_step(self, gradient, variable, learning_rate, ratio=None):
        super().update_step(gradient, variable, learning_rate * 0.5, ratio=ratio)


def test_a_users_subclass_keeps_its_own_methods_and_the_backend_s():
    made = HalvedLARS(learning_rate=1.0, momentum=0.0)
    assert isinstance(made, HalvedLARS) and type(made).__name__ == "HalvedLARS"
    assert isinstance(made, _backend_subclasses()[tf_lars.LARS])
    variable = keras.Variable(np.full((2, 2), 2.0, "float32"))
    made.apply([np.ones((2, 2), "float32")], [variable])
    # T = 0.001 * |w| / |g| = 0.002; lr 0.5 after the subclass's halving.
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(variable), np.full((2, 2), 2.0 - 0.001), rtol=1e-6
    )
    config = keras.saving.serialize_keras_object(made)
    assert config["registered_name"] == "tests>HalvedLARS"
    again = keras.saving.deserialize_keras_object(config)
    assert type(again) is type(made)


def _distribution(case):
    script = pathlib.Path(__file__).resolve().parent / "distribution_script.py"
    env = dict(
        os.environ,
        KERAS_BACKEND="jax",
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
    )
    result = subprocess.run(
        [sys.executable, str(script), case],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{case} OK" in result.stdout, result.stdout + result.stderr


@pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution runs on JAX only")
@pytest.mark.parametrize("case", ["data_parallel", "model_parallel"])
def test_keras_distribution_equals_one_device(case):
    _distribution(case)


def test_another_backends_subclass_does_not_take_the_registered_name():
    # Importing another backend's module (mkdocstrings, a test that imports
    # every module) names its subclasses as the public class, but a saved
    # "tf_lars>LARS" still loads the public class, which constructs the
    # running backend's subclass.
    from tf_lars import backend

    other = backend.with_name_of(tf_lars.LARS, type("Other", (tf_lars.LARS,), {}))
    assert keras.saving.get_registered_name(other) == "tf_lars>LARS"
    assert keras.saving.get_custom_objects()["tf_lars>LARS"] is tf_lars.LARS
    made = tf_lars.LARS(0.1)
    again = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(made)
    )
    assert (
        type(again)
        is type(made)
        is _backend_subclasses().get(tf_lars.LARS, tf_lars.LARS)
    )
