"""Saved files move across the supported TensorFlow / Keras range.

tests/data/make_across_versions.py wrote, once with the oldest supported
pair (TensorFlow 2.16 + Keras 3.8) and once with the newest (2.21 + 3.15), a
`.keras` file (LARS with a schedule inside the loss-scale wrapper, after one
epoch of `fit`) and a `tf.train.Checkpoint` (LAMB in a custom loop), plus
every model and optimizer value at the save and the weights the writer
reached when it continued. Whatever pair runs this test loads both pairs'
files and requires:

- every saved value back exactly (nothing lost or mismatched in loading);
- continuing from the loaded state is bit-identical to continuing the same
  state built in memory in this process (same hyperparameters, schedule
  position, step counts and slots);
- the continued weights equal the writer's within a few ulps (CPUs and
  TensorFlow releases may round differently, so stored numbers are not held
  bit-exact).
"""

import json
import pathlib
import re
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lars

DATA = pathlib.Path(__file__).resolve().parent / "data"
#: The pairs that wrote files (tag: TensorFlow and Keras major.minor), with
#: the Keras release that wrote them.
WRITERS = {"tf216_keras38": (3, 8), "tf221_keras315": (3, 15)}
KERAS = tuple(int(part) for part in keras.__version__.split(".")[:2])
#: A `.keras` file loads in its own Keras or a newer one: Keras 3.5 cannot
#: read the Dense layers Keras 3.15 writes ("Unrecognized keyword arguments
#: passed to Dense: {'quantization_config': None}"). In an older Keras only
#: tf_lars's part of a newer file is checked: its optimizer config.
LOADABLE = [writer for writer, version in WRITERS.items() if version <= KERAS]
NEWER = [writer for writer, version in WRITERS.items() if version > KERAS]
#: Largest difference between this process's continued weights and the
#: writer's, in ulps of each array's largest entry (4 more float32 steps).
MAX_ULP = 16


def data():
    with np.load(DATA / "v0_1_0_data.npz") as arrays:
        return arrays["x"], arrays["y"]


def make_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(5, activation="tanh", name="hidden"),
            keras.layers.Dense(3, name="out"),
        ]
    )


def make_keras_file_optimizer():
    """The `.keras` files' optimizer (these and 0.1.0's, saved_v0_1_0_test.py):
    LossScale(LARS(schedule))."""
    schedule = tf_lars.WarmupPolynomialDecay(0.5, warmup_steps=2, decay_steps=10)
    lars = tf_lars.LARS(
        learning_rate=schedule,
        momentum=0.9,
        weight_decay=1e-3,
        trust_coefficient=0.02,
        exclude_from_weight_decay=["<1d>"],
        nesterov=True,
    )
    return tf_lars.LossScaleOptimizer(lars, initial_scale=128.0, dynamic_growth_steps=3)


def make_keras_file_model():
    """The `.keras` file's model, compiled with `make_keras_file_optimizer()`."""
    model = make_model()
    model.compile(
        optimizer=make_keras_file_optimizer(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def fit_epoch(model):
    x, y = data()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)


def make_lamb():
    return tf_lars.LAMB(learning_rate=0.05, weight_decay=0.01)


def loop_epoch(model, optimizer):
    """Four custom-loop steps (`optimizer.apply`) over the data."""
    x, y = data()
    for i in range(4):
        with tf.GradientTape() as tape:
            logits = model(x[8 * i : 8 * i + 8])
            loss = tf.reduce_mean(
                keras.losses.sparse_categorical_crossentropy(
                    y[8 * i : 8 * i + 8], logits, from_logits=True
                )
            )
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)


def state(model, optimizer):
    """Every model and optimizer value, in a fixed order."""
    return [v.numpy() for v in model.weights] + [v.numpy() for v in optimizer.variables]


def named_state(model, optimizer):
    """`state` by name: model weights by position, optimizer variables by role.

    Optimizer variables are named `outer/<name>` or `inner/<name>` (the
    wrapped optimizer's): their paths are not stable (a loaded optimizer
    builds under another name scope; LAMB's inner Adam is `adam` in Keras
    3.5, `lamb_adam` in 3.15), and slot names embed the model's name, which
    depends on how many models the process made before.
    """
    named = {f"model/{i}": v.numpy() for i, v in enumerate(model.weights)}
    inner = optimizer.inner_optimizer.variables
    inner_ids = {id(v) for v in inner}
    outer = [v for v in optimizer.variables if id(v) not in inner_ids]
    for role, variables in (("outer", outer), ("inner", inner)):
        for v in variables:
            name = re.sub(r"^sequential(_\d+)?_", "", v.name)
            named[f"{role}/{name}"] = v.numpy()
    return named


def stored(name):
    with np.load(DATA / name) as arrays:
        return {key: arrays[key] for key in arrays.files}


def assert_state_is(model, optimizer, saved):
    """Every saved value is back, under its name, exactly."""
    got = named_state(model, optimizer)
    assert sorted(got) == sorted(saved)
    for key, value in saved.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)


def copy_state(source_model, source_optimizer, model, optimizer):
    for target, value in zip(
        model.weights + optimizer.variables,
        state(source_model, source_optimizer),
        strict=True,
    ):
        target.assign(value)


def assert_all_equal(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def assert_within_ulps(model, continued):
    weights = [continued[f"model/{i}"] for i in range(len(model.weights))]
    assert len(continued) == len(weights)
    for got, want in zip(model.weights, weights, strict=True):
        # Ulps of the array's largest entry: near-zero entries may differ by
        # more of their own ulps after a few steps of different rounding.
        tolerance = MAX_ULP * np.spacing(np.max(np.abs(want)))
        np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=tolerance)


@pytest.mark.parametrize("writer", LOADABLE)
def test_keras_file_loads_and_continues_bit_identically(writer):
    loaded = keras.models.load_model(DATA / f"{writer}_lars.keras")
    assert isinstance(loaded.optimizer, tf_lars.LossScaleOptimizer)
    assert isinstance(loaded.optimizer.inner_optimizer, tf_lars.LARS)
    assert int(loaded.optimizer.iterations.numpy()) == 4
    assert_state_is(loaded, loaded.optimizer, stored(f"{writer}_lars_saved.npz"))

    in_memory = make_keras_file_model()
    fit_epoch(in_memory)  # builds the same objects the writer saved
    copy_state(loaded, loaded.optimizer, in_memory, in_memory.optimizer)
    fit_epoch(loaded)
    fit_epoch(in_memory)
    assert int(loaded.optimizer.iterations.numpy()) == 8
    assert_all_equal(
        state(loaded, loaded.optimizer), state(in_memory, in_memory.optimizer)
    )
    assert_within_ulps(loaded, stored(f"{writer}_lars_continued.npz"))


@pytest.mark.parametrize("writer", list(WRITERS))
def test_checkpoint_loads_and_continues_bit_identically(writer):
    model, optimizer = make_model(), make_lamb()
    optimizer.build(model.trainable_variables)
    status = tf.train.Checkpoint(model=model, optimizer=optimizer).read(
        str(DATA / f"{writer}_lamb_ckpt")
    )
    status.assert_existing_objects_matched()
    assert int(optimizer.iterations.numpy()) == 4
    assert_state_is(model, optimizer, stored(f"{writer}_lamb_saved.npz"))

    in_memory, in_memory_optimizer = make_model(), make_lamb()
    in_memory_optimizer.build(in_memory.trainable_variables)
    copy_state(model, optimizer, in_memory, in_memory_optimizer)
    loop_epoch(model, optimizer)
    loop_epoch(in_memory, in_memory_optimizer)
    assert int(optimizer.iterations.numpy()) == 8
    assert_all_equal(state(model, optimizer), state(in_memory, in_memory_optimizer))
    assert_within_ulps(model, stored(f"{writer}_lamb_continued.npz"))


@pytest.mark.parametrize("writer", NEWER or ["none newer than this Keras"])
def test_optimizer_config_of_a_newer_keras_file_loads(writer):
    in_memory = make_keras_file_model().optimizer.get_config()
    if writer not in WRITERS:  # the newest pair: every file is loadable
        assert LOADABLE == list(WRITERS)
        return
    with zipfile.ZipFile(DATA / f"{writer}_lars.keras") as archive:
        config = json.loads(archive.read("config.json"))
    optimizer = keras.saving.deserialize_keras_object(
        config["compile_config"]["optimizer"]
    )
    assert isinstance(optimizer, tf_lars.LossScaleOptimizer)
    assert optimizer.get_config() == in_memory
