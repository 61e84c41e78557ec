"""Synchronous DiLoCo on MWMS with real processes (tests/distribute_diloco_script.py
through `python -m tf_lars.distribute.launch --mode sync`): `model.fit` with
`DiLoCoSync` equals the one-process simulation; a worker killed mid-epoch,
the job restarted, ends bit for bit where an uninterrupted job ends; a
custom loop with int4 codes, error feedback and streaming equals the
simulation; H = 1 with outer SGD(1.0) is data-parallel SGD; the bytes are
counted exactly. Bad arguments: tests/diloco_test.py and below."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import distribute_diloco_script as script
from tests.distribute_launch_helpers import run_sync_jobs, worker_logs
from tf_lars.diloco import simulate_sync
from tf_lars.distribute.diloco import DiLoCoBackup, DiLoCoSync, synchronize

SCRIPT = os.path.join("tests", "distribute_diloco_script.py")
TIMEOUT = 300
PARAMETERS = 5 * 6 + 6 + 6 * 2 + 2  # the model's trainable entries


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    return run_sync_jobs(
        {
            name: (str(tmp_path_factory.mktemp(name)), SCRIPT, arguments)
            for name, arguments in (
                ("uninterrupted", ("all",)),
                ("interrupted", ("fit", "--kill", "2:1")),
            )
        },
        TIMEOUT,
    )


def _load(job, name):
    with np.load(os.path.join(job["out"], f"{name}.npz")) as data:
        return dict(data)


def _weights(saved):
    return [saved[k] for k in sorted(saved) if k.startswith("net|")]


def _simulate(make_optimizer, steps):
    """The job in one process: both workers from worker 0's initial weights,
    the same batches, `simulate_sync` at each step."""
    models, optimizers = [], []
    for _ in range(2):
        model = script.make_model(1)
        optimizer = make_optimizer()
        optimizer.build(model.trainable_variables)
        models.append(model)
        optimizers.append(optimizer)
    streams = [script.batches(worker) for worker in range(2)]
    for _ in range(steps):
        for model, optimizer, stream in zip(models, optimizers, streams, strict=True):
            x, y = next(stream)
            script.loop_step(model, optimizer, tf.constant(x), tf.constant(y))
        for fragment in optimizers[0].due_fragments():
            simulate_sync(optimizers, [m.trainable_variables for m in models], fragment)
    return models


def _numbers(model):
    return [v.numpy() for v in sorted(model.trainable_variables, key=lambda v: v.path)]


@pytest.mark.slow
def test_fit_with_diloco_sync_equals_the_one_process_simulation(jobs):
    models = _simulate(script.fit_optimizer, script.STEPS * script.EPOCHS)
    for worker in range(2):
        saved = _load(jobs["uninterrupted"], f"fit-worker{worker}")
        assert int(saved["diloco|iteration"]) == 16
        for got, want in zip(_weights(saved), _numbers(models[worker]), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # After the last outer step (step 15) both workers took one more inner
    # step on their own shard: they differ, their theta does not.
    zero, one = (_load(jobs["uninterrupted"], f"fit-worker{w}") for w in range(2))
    assert not np.allclose(_weights(zero)[0], _weights(one)[0])
    for key in [k for k in zero if "|global_" in k]:
        np.testing.assert_array_equal(zero[key], one[key])


@pytest.mark.slow
def test_fit_bytes_are_counted_per_outer_step(jobs):
    # H = 3 over 16 steps: outer steps at 3, 6, 9, 12, 15; float32 payload.
    saved = _load(jobs["uninterrupted"], "fit-worker0")
    assert int(saved["outer_steps"]) == 5
    assert int(saved["bytes_sent"]) == 5 * 4 * PARAMETERS
    assert int(saved["bytes_received"]) == 5 * 4 * PARAMETERS  # one other worker


@pytest.mark.slow
def test_killed_worker_restarted_job_ends_bit_for_bit_as_uninterrupted(jobs):
    assert "[worker 1] SIGKILL" in worker_logs(jobs["interrupted"]["root"], tail=None)
    for worker in range(2):
        alone = _load(jobs["uninterrupted"], f"fit-worker{worker}")
        resumed = _load(jobs["interrupted"], f"fit-worker{worker}")
        assert (int(resumed["restart"]), int(resumed["restored_epoch"])) == (1, 2)
        assert (int(alone["restart"]), int(alone["restored_epoch"])) == (0, 0)
        keys = sorted(k for k in alone if "|" in k)
        assert keys == sorted(k for k in resumed if "|" in k)
        # Every variable: weights, theta, outer momentum, inner momentum, count.
        assert any("|global_" in k for k in keys)
        for key in keys:
            np.testing.assert_array_equal(resumed[key], alone[key], err_msg=key)
        np.testing.assert_array_equal(resumed["loss"], alone["loss"][2:])


@pytest.mark.slow
def test_custom_loop_int4_streaming_equals_the_simulation(jobs):
    models = _simulate(script.loop_optimizer, script.STEPS * script.EPOCHS)
    for worker in range(2):
        saved = _load(jobs["uninterrupted"], f"loop-worker{worker}")
        for got, want in zip(_weights(saved), _numbers(models[worker]), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # Fragment 0 (the kernels (5, 6) and (6, 2)) syncs at steps 4, 8, 12, 16,
    # fragment 1 (the biases) at 2, 6, 10, 14. int4 codes two to a byte,
    # padded to 4-byte words, one float32 scale per row (per tensor for the
    # biases): kernels 16 + 20 + 8 + 24 bytes, biases 4 + 4 + 4 + 4.
    saved = _load(jobs["uninterrupted"], "loop-worker1")
    assert int(saved["outer_steps"]) == 8
    assert int(saved["bytes_sent"]) == 4 * 68 + 4 * 16
    assert int(saved["bytes_received"]) == int(saved["bytes_sent"])


@pytest.mark.slow
def test_one_inner_step_and_outer_sgd_one_is_data_parallel_sgd(jobs):
    model = script.make_model(1)
    streams = [script.batches(worker) for worker in range(2)]
    for _ in range(script.STEPS * script.EPOCHS):
        grads = []
        for stream in streams:
            x, y = next(stream)
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(
                    keras.losses.mean_squared_error(y, model(x, training=True))
                )
            grads.append(tape.gradient(loss, model.trainable_variables))
        for variable, pair in zip(model.trainable_variables, zip(*grads), strict=True):
            variable.assign(variable - 0.1 * (pair[0] + pair[1]) / 2)
    for worker in range(2):
        saved = _load(jobs["uninterrupted"], f"dp-worker{worker}")
        for got, want in zip(_weights(saved), _numbers(model), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert int(saved["bytes_sent"]) == 16 * 4 * PARAMETERS


def test_one_worker_fit_and_backup_resume_in_one_process(tmp_path):
    # strategy=None: one worker, the outer step alone; a second fit resumes
    # from the backup of the first.
    x, y = script.shard(0)
    model = script.make_model(1)
    model.compile(script.fit_optimizer(), "mse")
    backup = DiLoCoBackup(str(tmp_path / "backup"))
    sync = DiLoCoSync()
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
              callbacks=[backup, sync])  # fmt: skip
    assert sync.traffic.as_dict() == {
        "outer_steps": 2, "bytes_sent": 2 * 4 * PARAMETERS, "bytes_received": 0
    }  # fmt: skip
    assert sorted(os.listdir(tmp_path / "backup" / "worker-0")) == [
        "epoch-2.weights.h5"
    ]
    again = script.make_model(7)
    again.compile(script.fit_optimizer(), "mse")
    backup = DiLoCoBackup(str(tmp_path / "backup"))
    again.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
              callbacks=[backup, DiLoCoSync()])  # fmt: skip
    assert backup.restored_epoch == 2
    for a, b in zip(model.optimizer.variables, again.optimizer.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_bad_arguments_are_refused_naming_them():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with pytest.raises(ValueError, match=r"`strategy` must be a .*Received: strategy="):
        DiLoCoSync(strategy)
    with pytest.raises(ValueError, match=r"`backup_dir` must be a non-empty str\. "):
        DiLoCoBackup("")
    with pytest.raises(ValueError, match=r"`diloco` must be a `tf_lars.DiLoCo`\. "):
        synchronize(keras.optimizers.SGD(), [])
    model = script.make_model(1)
    model.compile(keras.optimizers.SGD(), "mse")
    x, y = script.shard(0)
    with pytest.raises(ValueError, match=r"`model.optimizer` must be a"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[DiLoCoSync()])
    model.compile(script.fit_optimizer(), "mse", steps_per_execution=2)
    with pytest.raises(ValueError, match="steps_per_execution=1"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[DiLoCoSync()])
