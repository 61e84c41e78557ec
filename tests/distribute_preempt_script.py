"""One worker of a 2-worker MWMS job that trains with `BackupAndRestore`.

    distribute_preempt_script.py OUT BACKUP_DIR [--kill EPOCH:BATCH] [--batch-norm]

With `--kill`, worker 1 SIGKILLs itself after that batch on the job's first
run (`TF_LARS_RESTART` unset or 0), so the launcher restarts the whole job,
which resumes from worker 0's backup. With `--batch-norm`, the model has two
`BatchNormalization` layers, `bn_synchronized` (`synchronized=True`) and
`bn_local` (the default, each worker's own statistics). Writes under OUT,
each `.npz` holding the model's weights and every optimizer variable by path:

- `restart<R>-worker<I>-begin.npz`: the state once `fit` has restored it,
  with `restored_epoch`;
- `restart<R>-epoch<E>.npz` (worker 0): the state after E epochs;
- `worker<I>-end.npz`: the final state, the per-epoch losses of the last
  run, `restart` and `restored_epoch`.
"""

import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_lars  # noqa: E402
from tests.distribute_launch_helpers import exit_together  # noqa: E402
from tf_lars import distribute  # noqa: E402
from tf_lars.distribute.multi_worker import BackupAndRestore  # noqa: E402

GLOBAL_BATCH = 16
STEPS = 4
EPOCHS = 4

rng = np.random.default_rng(0)
X = rng.normal(size=(GLOBAL_BATCH * STEPS, 6)).astype("float32")
Y = (X @ rng.normal(size=(6, 1))).astype("float32")
# Overflows float16 once per epoch: a step is skipped and the loss scale
# halved every epoch, so the scale and both counters move.
Y[37] = 6e4


def dataset():
    # The same order in every epoch and every process: a restarted process
    # must see in epoch E what the first one saw there.
    data = (
        tf.data.Dataset.from_tensor_slices((X, Y))
        .shuffle(len(X), seed=7, reshuffle_each_iteration=False)
        .batch(GLOBAL_BATCH)
    )
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    return data.with_options(options)


def make_model(batch_norm=False):
    keras.utils.set_random_seed(5)
    hidden = [keras.layers.Dense(8, activation="tanh")]
    if batch_norm:
        hidden = [
            keras.layers.Dense(8),
            keras.layers.BatchNormalization(
                momentum=0.5, synchronized=True, name="bn_synchronized"
            ),
            keras.layers.Activation("tanh"),
            keras.layers.Dense(4),
            keras.layers.BatchNormalization(momentum=0.5, name="bn_local"),
            keras.layers.Activation("tanh"),
        ]
    model = keras.Sequential(
        [keras.Input((6,)), *hidden, keras.layers.Dense(1, dtype="float32")]
    )
    schedule = tf_lars.WarmupPolynomialDecay(
        peak_learning_rate=0.5, warmup_steps=3, decay_steps=10
    )
    lars = tf_lars.LARS(
        schedule, momentum=0.9, weight_decay=1e-3, trust_coefficient=0.02
    )
    optimizer = tf_lars.LossScaleOptimizer(
        lars, initial_scale=256.0, dynamic_growth_steps=4
    )
    model.compile(optimizer, "mse")
    return model


def state(model):
    values = {}
    for variable in [*model.weights, *model.optimizer.variables]:
        values.setdefault(variable.path.replace("/", "|"), variable.numpy())
    return values


class Record(keras.callbacks.Callback):
    def __init__(self, out, backup, worker, restart, kill):
        super().__init__()
        self.out, self.backup = out, backup
        self.worker, self.restart, self.kill = worker, restart, kill
        self.epoch = None

    def _save(self, name, **extra):
        path = os.path.join(self.out, f"{name}.npz")
        np.savez(path, **state(self.model), **extra)

    def on_train_begin(self, logs=None):
        # Runs after BackupAndRestore's (callbacks run in list order).
        self._save(
            f"restart{self.restart}-worker{self.worker}-begin",
            restored_epoch=self.backup.restored_epoch,
        )

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.kill == (self.epoch, batch):
            print(f"[worker {self.worker}] SIGKILL", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def on_epoch_end(self, epoch, logs=None):
        if self.worker == 0:
            self._save(f"restart{self.restart}-epoch{epoch + 1}")


def main(out, backup_dir, kill, batch_norm):
    restart = int(os.environ.get("TF_LARS_RESTART", "0"))
    config = distribute.parse_tf_config(mode="sync")
    strategy = distribute.multi_worker_strategy(config, communication_timeout=60)
    keras.config.set_dtype_policy("mixed_float16")
    with strategy.scope():
        model = make_model(batch_norm)
    distribute.enable_multi_worker_fit(model)
    backup = BackupAndRestore(backup_dir)
    kill_here = kill if restart == 0 and config.task_index == 1 else None
    record = Record(out, backup, config.task_index, restart, kill_here)
    history = model.fit(
        dataset(),
        epochs=EPOCHS,
        verbose=0,
        shuffle=False,
        callbacks=[backup, record],
    )
    np.savez(
        os.path.join(out, f"worker{config.task_index}-end.npz"),
        **state(model),
        loss=np.asarray(history.history["loss"]),
        restart=restart,
        restored_epoch=backup.restored_epoch,
    )
    exit_together(strategy)
    print(f"[worker {config.task_index}] done, restart {restart}", flush=True)


if __name__ == "__main__":
    arguments = sys.argv[1:]
    batch_norm = "--batch-norm" in arguments
    if batch_norm:
        arguments.remove("--batch-norm")
    kill = None
    if "--kill" in arguments:
        at = arguments.index("--kill")
        kill = tuple(int(part) for part in arguments[at + 1].split(":"))
        del arguments[at : at + 2]
    main(*arguments, kill, batch_norm)
    sys.stdout.flush()
    os._exit(0)
