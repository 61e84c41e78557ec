"""Preemption: `tf_lars.distribute.multi_worker.BackupAndRestore`.

A 2-worker MWMS job (through `python -m tf_lars.distribute.launch --mode
sync --restart-job 1`) whose worker 1 SIGKILLs itself mid-epoch resumes from
worker 0's backup and ends bit for bit where an uninterrupted job ends; the
same in one process; the backup's file handling; Keras's own callback
repeating batches with `save_freq=<int>`.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lars
from tests import distribute_preempt_script as script
from tests.distribute_launch_helpers import run_sync_jobs, worker_logs
from tf_lars.distribute.multi_worker import (
    BackupAndRestore,
    _as_bits,
    _from_bits,
    _unsynchronized_batch_norm_layers,
)

SCRIPT = os.path.join("tests", "distribute_preempt_script.py")
KILL = "2:1"  # worker 1, third epoch, after its second batch
TIMEOUT = 300


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The interrupted job and an uninterrupted one, run side by side."""
    return _run_jobs(tmp_path_factory)


@pytest.fixture(scope="module")
def batch_norm_jobs(tmp_path_factory):
    """The same pair with two BatchNormalization layers in the model."""
    return _run_jobs(tmp_path_factory, "--batch-norm")


def _run_jobs(tmp_path_factory, *program_args):
    return run_sync_jobs(
        {
            "interrupted": (
                str(tmp_path_factory.mktemp("interrupted")),
                SCRIPT,
                ("--kill", KILL, *program_args),
            ),
            "uninterrupted": (
                str(tmp_path_factory.mktemp("uninterrupted")),
                SCRIPT,
                program_args,
            ),
        },
        TIMEOUT,
    )


def _load(job, name):
    with np.load(os.path.join(job["out"], f"{name}.npz")) as data:
        return dict(data)


def _assert_same_state(actual, expected):
    state_keys = [k for k in expected if "|" in k]
    assert sorted(k for k in actual if "|" in k) == sorted(state_keys)
    for key in state_keys:
        np.testing.assert_array_equal(actual[key], expected[key], err_msg=key)


@pytest.mark.slow
def test_worker_killed_the_job_restarted_and_resumed_at_the_backup(jobs):
    run = jobs["interrupted"]
    files = sorted(os.listdir(run["out"]))
    # First run: epochs 1 and 2 done, killed in the third; the restart
    # resumes at epoch 2 and runs only epochs 3 and 4.
    assert files == [
        "restart0-epoch1.npz",
        "restart0-epoch2.npz",
        "restart0-worker0-begin.npz",
        "restart0-worker1-begin.npz",
        "restart1-epoch3.npz",
        "restart1-epoch4.npz",
        "restart1-worker0-begin.npz",
        "restart1-worker1-begin.npz",
        "worker0-end.npz",
        "worker1-end.npz",
    ]
    for worker in (0, 1):
        assert int(_load(run, f"restart0-worker{worker}-begin")["restored_epoch"]) == 0
        assert int(_load(run, f"restart1-worker{worker}-begin")["restored_epoch"]) == 2
        end = _load(run, f"worker{worker}-end")
        assert (int(end["restart"]), int(end["restored_epoch"])) == (1, 2)
    assert "[worker 1] SIGKILL" in worker_logs(run["root"])
    # The uninterrupted job ran once, from the start.
    end = _load(jobs["uninterrupted"], "worker0-end")
    assert (int(end["restart"]), int(end["restored_epoch"])) == (0, 0)


@pytest.mark.slow
def test_every_worker_restores_every_variable_bit_for_bit(jobs):
    backed_up = _load(jobs["interrupted"], "restart0-epoch2")
    # The backup holds a state that a fresh start would not have: two steps
    # skipped (one float16 overflow per epoch), the scale halved twice, three
    # finite steps since, and six LARS steps into the schedule.
    assert float(backed_up["loss_scale_optimizer|dynamic_scale"]) == 64.0
    assert int(backed_up["loss_scale_optimizer|step_counter"]) == 3
    assert int(backed_up["loss_scale_optimizer|skipped_step_counter"]) == 2
    assert int(backed_up["lars|iteration"]) == 6
    assert np.all(backed_up["lars|sequential_dense_kernel_momentum"] != 0)
    _assert_same_state(backed_up, _load(jobs["uninterrupted"], "restart0-epoch2"))
    for worker in (0, 1):
        restored = _load(jobs["interrupted"], f"restart1-worker{worker}-begin")
        _assert_same_state(restored, backed_up)


@pytest.mark.slow
def test_resumed_job_ends_exactly_where_the_uninterrupted_one_does(jobs):
    expected = _load(jobs["uninterrupted"], "worker0-end")
    assert int(expected["lars|iteration"]) == 12
    assert int(expected["loss_scale_optimizer|skipped_step_counter"]) == 4
    for worker in (0, 1):
        actual = _load(jobs["interrupted"], f"worker{worker}-end")
        # Exact: the restored state is the saved bits, and the remaining
        # steps run the same operations on the same batches.
        _assert_same_state(actual, expected)
        np.testing.assert_array_equal(actual["loss"], expected["loss"][2:])


@pytest.mark.slow
def test_batch_norm_resume_what_is_equal(batch_norm_jobs):
    # Keys of the moving statistics of the two layers (`bn_local` keeps each
    # worker's own, `bn_synchronized` those of the global batch).
    run, alone = batch_norm_jobs["interrupted"], batch_norm_jobs["uninterrupted"]
    moving = {
        layer: [f"sequential|{layer}|moving_{s}" for s in ("mean", "variance")]
        for layer in ("bn_local", "bn_synchronized")
    }
    alone_ends = [_load(alone, f"worker{worker}-end") for worker in (0, 1)]
    for key in moving["bn_synchronized"]:
        np.testing.assert_array_equal(alone_ends[1][key], alone_ends[0][key])
    for key in moving["bn_local"]:
        assert np.max(np.abs(alone_ends[1][key] - alone_ends[0][key])) > 1e-3
    ends = [_load(run, f"worker{worker}-end") for worker in (0, 1)]
    assert [int(end["restored_epoch"]) for end in ends] == [2, 2]
    # Worker 0 (which wrote the backup) ends exactly as uninterrupted.
    _assert_same_state(ends[0], alone_ends[0])
    # Worker 1: everything but `bn_local`'s statistics exactly as
    # uninterrupted; those started from worker 0's at the restore.
    local = set(moving["bn_local"])
    _assert_same_state(
        {k: v for k, v in ends[1].items() if k not in local},
        {k: v for k, v in alone_ends[1].items() if k not in local},
    )
    restored, backed_up = (
        _load(run, "restart1-worker1-begin"),
        _load(run, "restart0-epoch2"),
    )
    for key in local:
        np.testing.assert_array_equal(restored[key], backed_up[key])
        assert np.max(np.abs(ends[1][key] - alone_ends[1][key])) > 0
    # Every worker of both jobs was warned, naming only the local layer.
    for job in (run, alone):
        for worker in (0, 1):
            path = os.path.join(job["root"], "logs", f"worker-{worker}.log")
            with open(path) as handle:
                assert (
                    "UserWarning: BatchNormalization layer(s) ['bn_local'] are not "
                    "synchronized"
                ) in handle.read()


@pytest.mark.slow
def test_backup_is_deleted_when_fit_completes(jobs):
    for job in jobs.values():
        assert not os.path.exists(job["backup"])


# ------------------------------------------------------------- one process
class _Interrupt(keras.callbacks.Callback):
    def __init__(self, epoch, batch):
        super().__init__()
        self.at, self.epoch = (epoch, batch), None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError("interrupted")


def _fit(callbacks, epochs=script.EPOCHS):
    """The script's model and data in this process (mixed_float16)."""
    keras.config.set_dtype_policy("mixed_float16")
    try:
        keras.backend.clear_session()
        model = script.make_model()
        history = model.fit(
            script.dataset(),
            epochs=epochs,
            verbose=0,
            shuffle=False,
            callbacks=callbacks,
        )
    finally:
        keras.config.set_dtype_policy("float32")
    return model, history


def test_one_process_resume_equals_uninterrupted(tmp_path):
    expected, expected_history = _fit([BackupAndRestore(str(tmp_path / "a"))])
    backup_dir = str(tmp_path / "b")
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit([BackupAndRestore(backup_dir), _Interrupt(2, 1)])
    assert os.listdir(backup_dir) == ["epoch-2.weights.h5"]
    backup = BackupAndRestore(backup_dir)
    model, history = _fit([backup])
    assert backup.restored_epoch == 2
    assert history.epoch == [2, 3]
    np.testing.assert_array_equal(
        history.history["loss"], expected_history.history["loss"][2:]
    )
    _assert_same_state(script.state(model), script.state(expected))
    assert not os.path.exists(backup_dir)
    # Keras never resets the start epoch it was given; the callback does.
    assert model.fit(script.dataset(), epochs=1, verbose=0, shuffle=False).epoch == [0]


def test_newest_complete_backup_is_loaded_and_a_cut_off_write_ignored(tmp_path):
    backup_dir = str(tmp_path)
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit([BackupAndRestore(backup_dir, delete_checkpoint=False), _Interrupt(1, 0)])
    assert os.listdir(backup_dir) == ["epoch-1.weights.h5"]
    # A chief killed while writing the next backup leaves a partial file.
    with open(os.path.join(backup_dir, "partial-2.weights.h5"), "wb") as handle:
        handle.write(b"\x89HDF\r\n")
    backup = BackupAndRestore(backup_dir, delete_checkpoint=False)
    model, history = _fit([backup], epochs=2)
    assert backup.restored_epoch == 1
    assert history.epoch == [1]
    # Kept (delete_checkpoint=False): only the newest, complete backup.
    assert os.listdir(backup_dir) == ["epoch-2.weights.h5"]
    # The optimizer went on from the backup's 4 steps (no step overflows in
    # one process, where each loss is a mean over 16 examples).
    assert int(model.optimizer.iterations.numpy()) == 8


def test_a_fit_without_backup_starts_at_0_after_a_resumed_fit_raised(tmp_path):
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    model.compile(tf_lars.LARS(0.1), "mse")

    def fit(backup_dir, *callbacks):
        backup = BackupAndRestore(str(tmp_path / backup_dir))
        history = model.fit(
            script.dataset(),
            epochs=3,
            verbose=0,
            shuffle=False,
            callbacks=[backup, *callbacks],
        )
        return backup.restored_epoch, history.epoch

    with pytest.raises(RuntimeError, match="interrupted"):
        fit("a", _Interrupt(1, 0))
    # Resumed at epoch 1, then interrupted again: no `on_train_end`.
    with pytest.raises(RuntimeError, match="interrupted"):
        fit("a", _Interrupt(2, 0))
    assert fit("b") == (0, [0, 1, 2])


def test_keras_save_freq_int_repeats_the_batches_of_the_interrupted_epoch(tmp_path):
    # Why the callback backs up at epoch ends only. Keras 3.15's own
    # callback with save_freq=2 saves after batch 1 of epoch 2 (10 steps
    # done) but records epoch 2, so the resumed fit runs all of epoch 2
    # again: 18 optimizer steps instead of 16.
    backup_dir = str(tmp_path)
    x = np.linspace(-1, 1, 32 * 3, dtype="float32").reshape(32, 3)
    y = x.sum(axis=1, keepdims=True)

    def fit(callbacks):
        keras.backend.clear_session()
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(tf_lars.LARS(0.1), "mse")
        model.fit(
            x, y, batch_size=8, epochs=4, shuffle=False, verbose=0, callbacks=callbacks
        )
        return int(model.optimizer.iterations.numpy())

    with pytest.raises(RuntimeError, match="interrupted"):
        fit(
            [
                keras.callbacks.BackupAndRestore(backup_dir, save_freq=2),
                _Interrupt(2, 2),
            ]
        )
    assert fit([keras.callbacks.BackupAndRestore(backup_dir, save_freq=2)]) == 18


@pytest.mark.parametrize(
    "dtype, values",
    [
        (tf.float16, [-0.0, 0.0, 6e-8, 65504.0, float("inf"), float("nan")]),
        (tf.bfloat16, [-0.0, 1e-38, 3e38, float("-inf"), float("nan")]),
        (tf.float32, [-0.0, 1e-45, 3.4e38, float("inf"), float("nan")]),
        (tf.float64, [-0.0, 5e-324, 1.7e308, float("nan")]),
        (tf.int32, [-(2**31), 0, 2**31 - 1]),
        (tf.int64, [-(2**63), 0, 2**63 - 1]),
        (tf.bool, [True, False]),
    ],
)
def test_broadcast_bits_round_trip_exactly(dtype, values):
    value = tf.constant(values, dtype)
    bits = _as_bits(value)
    assert bits.dtype == tf.int64
    # The broadcast adds the other replicas' zeros to these bits.
    back = _from_bits(bits + tf.zeros_like(bits), dtype)
    assert back.dtype == dtype
    np.testing.assert_array_equal(
        tf.bitcast(back, tf.uint8).numpy() if dtype.is_floating else back.numpy(),
        tf.bitcast(value, tf.uint8).numpy() if dtype.is_floating else value.numpy(),
    )


def test_unsynchronized_batch_norm_layers_are_found_in_nested_models():
    inner = keras.Sequential(
        [keras.Input((3,)), keras.layers.BatchNormalization(name="inner_local")]
    )
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.BatchNormalization(synchronized=True, name="synced"),
            inner,
            keras.layers.BatchNormalization(name="outer_local"),
        ]
    )
    assert _unsynchronized_batch_norm_layers(model) == ["inner_local", "outer_local"]


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="`backup_dir` must be a non-empty str"):
        BackupAndRestore("")
    with pytest.raises(ValueError, match="`delete_checkpoint` must be a bool"):
        BackupAndRestore("dir", delete_checkpoint=1)
