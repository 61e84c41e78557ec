"""Writes the tests/data/<tag>_* files that cross TensorFlow / Keras versions.

Run once in the oldest and once in the newest supported environment (the
tag names the pair, e.g. `tf216_keras35`), from the repository root:

    .nox/oldest/bin/python tests/data/make_across_versions.py tests/data
    .nox/newest/bin/python tests/data/make_across_versions.py tests/data

(`nox -s oldest` / `nox -s newest` create those environments.) It writes a
`.keras` file and a `tf.train.Checkpoint`, every model and optimizer value
at the save (`*_saved.npz`) and the values after one more epoch
(`*_continued.npz`); `tests/saved_across_versions_test.py` loads them with
whatever pair it runs on.
"""

import os
import pathlib
import sys

import keras
import numpy as np
import tensorflow as tf

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from tests import saved_across_versions_test as across  # noqa: E402


def tag():
    def major_minor(version):
        return "".join(version.split(".")[:2])

    return f"tf{major_minor(tf.__version__)}_keras{major_minor(keras.__version__)}"


def save_named(path, named):
    np.savez(path, **named)


def write_keras_file(out, name):
    model = across.make_keras_file_model()
    across.fit_epoch(model)
    model.save(os.path.join(out, f"{name}_lars.keras"))
    save_named(
        os.path.join(out, f"{name}_lars_saved.npz"),
        across.named_state(model, model.optimizer),
    )
    across.fit_epoch(model)
    save_named(
        os.path.join(out, f"{name}_lars_continued.npz"),
        {f"model/{i}": v.numpy() for i, v in enumerate(model.weights)},
    )


def write_checkpoint(out, name):
    model, optimizer = across.make_model(), across.make_lamb()
    across.loop_epoch(model, optimizer)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    checkpoint.write(os.path.join(out, f"{name}_lamb_ckpt"))
    save_named(
        os.path.join(out, f"{name}_lamb_saved.npz"),
        across.named_state(model, optimizer),
    )
    across.loop_epoch(model, optimizer)
    save_named(
        os.path.join(out, f"{name}_lamb_continued.npz"),
        {f"model/{i}": v.numpy() for i, v in enumerate(model.weights)},
    )


if __name__ == "__main__":
    out = sys.argv[1]
    name = tag()
    write_keras_file(out, name)
    write_checkpoint(out, name)
    print("wrote", name)
