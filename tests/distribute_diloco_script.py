"""One worker of a 2-worker synchronous DiLoCo job on MWMS.

    distribute_diloco_script.py OUT BACKUP_DIR fit [--kill EPOCH:BATCH]
    distribute_diloco_script.py OUT BACKUP_DIR all
    distribute_diloco_script.py OUT BACKUP_DIR four

`fit`: `model.fit` with `DiLoCoSync` and `DiLoCoBackup` (4 epochs of 4
steps, sync_every=3: outer steps fall inside epochs); with `--kill`, worker 1
SIGKILLs itself after that batch on the job's first run, and the launcher
restarts the whole job; then a `fit` whose worker 1 refuses its backup
(`refusal-worker<I>.txt`). `all`: the same `fit`, then in the same processes
custom loops with `synchronize`: int4 codes with error feedback and two
streaming fragments (all-gathered), bfloat16 with error feedback
(all-reduced in bfloat16), and H = 1 with outer SGD(1.0) (data-parallel SGD,
all-reduced in float32). Each worker writes `.npz` files under OUT
(`fit-worker<I>.npz`, `loop-worker<I>.npz`, `bf16-worker<I>.npz`,
`dp-worker<I>.npz`) with its weights, optimizer state and byte counts; the
test compares them with a one-process simulation
(tests/distribute_diloco_test.py). `four`, on a 4-worker job: the custom
loop uncompressed (all-reduced in float32, `f32x4-worker<I>.npz`) and with
int8 codes (all-gathered, `int8x4-worker<I>.npz`).
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
from tf_lars.distribute.diloco import (  # noqa: E402
    DiLoCoBackup,
    DiLoCoSync,
    Traffic,
    synchronize,
)

BATCH, STEPS, EPOCHS, WORKERS = 8, 4, 4, 2


def shard(worker, workers=WORKERS):
    """Worker `worker`'s examples (of `workers`): a fixed regression problem."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(workers * BATCH * STEPS, 5)).astype("float32")
    y = np.tanh(x @ rng.normal(size=(5, 2))).astype("float32")
    part = slice(worker * BATCH * STEPS, (worker + 1) * BATCH * STEPS)
    return x[part], y[part]


def make_model(seed):
    keras.utils.set_random_seed(seed)
    # Fixed names: the variables' paths are the saved keys in every run.
    return keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(6, activation="tanh", name="hidden"),
            keras.layers.Dense(2, name="out"),
        ],
        name="net",
    )


def fit_optimizer(sync_every=3):
    return tf_lars.DiLoCo(
        keras.optimizers.SGD(0.05, momentum=0.9, name="inner"),
        keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True, name="outer"),
        sync_every=sync_every,
        exchange="external",  # DiLoCoSync, synchronize or simulate_sync
    )


def loop_optimizer():
    return tf_lars.DiLoCo(
        keras.optimizers.Adam(0.01, name="inner"),
        keras.optimizers.SGD(0.5, momentum=0.9, nesterov=True, name="outer"),
        sync_every=4,
        compression="int4",
        granularity="row",
        error_feedback=True,
        num_fragments=2,
        exchange="external",  # DiLoCoSync, synchronize or simulate_sync
    )


def bfloat16_optimizer():
    return tf_lars.DiLoCo(
        keras.optimizers.Adam(0.01, name="inner"),
        keras.optimizers.SGD(0.5, momentum=0.9, nesterov=True, name="outer"),
        sync_every=2,
        compression="bfloat16",
        error_feedback=True,
        exchange="external",  # DiLoCoSync, synchronize or simulate_sync
    )


def four_optimizer(compression=None):
    return tf_lars.DiLoCo(
        keras.optimizers.Adam(0.01, name="inner"),
        keras.optimizers.SGD(0.5, momentum=0.9, nesterov=True, name="outer"),
        sync_every=2,
        compression=compression,
        granularity="row",
        exchange="external",  # DiLoCoSync, synchronize or simulate_sync
    )


def int8_optimizer():
    return four_optimizer("int8")


def dp_optimizer():
    return tf_lars.DiLoCo(
        keras.optimizers.SGD(0.1, name="inner"),
        keras.optimizers.SGD(1.0, name="outer"),
        sync_every=1,
        exchange="external",  # DiLoCoSync, synchronize or simulate_sync
    )


def batches(worker, workers=WORKERS):
    x, y = shard(worker, workers)
    for step in range(STEPS * EPOCHS):
        at = (step % STEPS) * BATCH
        yield x[at : at + BATCH], y[at : at + BATCH]


def loop_step(model, optimizer, x, y):
    with tf.GradientTape() as tape:
        loss = keras.losses.mean_squared_error(y, model(x, training=True))
        loss = tf.reduce_mean(loss)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply(grads, model.trainable_variables)


def state(model, traffic, **extra):
    values = {}
    for variable in [*model.weights, *model.optimizer.variables]:
        values.setdefault(variable.path.replace("/", "|"), variable.numpy())
    return {
        **values,
        **{k: np.asarray(v) for k, v in traffic.as_dict().items()},
        **extra,
    }


def run_loop(out, worker, strategy, make_optimizer, name):
    model = make_model(1 + worker)  # different seeds: worker 0's weights win
    optimizer = make_optimizer()
    model.compile(optimizer, "mse")
    optimizer.build(model.trainable_variables)
    sync = DiLoCoSync(strategy)
    sync.set_model(model)
    sync.on_train_begin()  # worker 0's initial weights everywhere
    traffic = Traffic()
    for x, y in batches(worker, strategy.num_replicas_in_sync):
        loop_step(model, optimizer, tf.constant(x), tf.constant(y))
        synchronize(optimizer, model.trainable_variables, strategy, traffic)
    np.savez(os.path.join(out, f"{name}-worker{worker}.npz"), **state(model, traffic))


class Kill(keras.callbacks.Callback):
    def __init__(self, at):
        super().__init__()
        self.at, self.epoch = at, None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.at == (self.epoch, batch):
            print("[worker 1] SIGKILL", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def run_fit(out, backup_dir, worker, strategy, kill):
    restart = int(os.environ.get("TF_LARS_RESTART", "0"))
    model = make_model(1 + worker)
    model.compile(fit_optimizer(), "mse")
    backup = DiLoCoBackup(backup_dir, strategy)
    sync = DiLoCoSync(strategy)
    callbacks = [backup, sync]
    if kill is not None and restart == 0 and worker == 1:
        callbacks.append(Kill(kill))
    x, y = shard(worker)
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )
    np.savez(
        os.path.join(out, f"fit-worker{worker}.npz"),
        **state(model, sync.traffic),
        loss=np.asarray(history.history["loss"]),
        restart=restart,
        restored_epoch=backup.restored_epoch,
    )


def run_refusal(out, backup_dir, worker, strategy):
    """After `fit`, in the same processes: worker 1 resumes with another
    DiLoCo (sync_every=4) and refuses its backup; worker 0, whose backup
    matches, stops too. Each writes its error to `refusal-worker<I>.txt`."""
    model = make_model(1 + worker)
    model.compile(fit_optimizer(sync_every=4 if worker == 1 else 3), "mse")
    callbacks = [DiLoCoBackup(backup_dir, strategy), DiLoCoSync(strategy)]
    try:
        model.fit(*shard(worker), batch_size=BATCH, epochs=EPOCHS, verbose=0,
                  callbacks=callbacks)  # fmt: skip
        message = "fit ran"
    except ValueError as error:
        message = str(error)
    with open(os.path.join(out, f"refusal-worker{worker}.txt"), "w") as handle:
        handle.write(message)


def main(out, backup_dir, mode, kill):
    config = distribute.parse_tf_config(mode="sync")
    strategy = distribute.multi_worker_strategy(config, communication_timeout=60)
    worker = config.task_index
    if mode == "four":
        run_loop(out, worker, strategy, four_optimizer, "f32x4")
        run_loop(out, worker, strategy, int8_optimizer, "int8x4")
        exit_together(strategy)
        print(f"[worker {worker}] done", flush=True)
        return
    run_fit(out, backup_dir, worker, strategy, kill)
    if mode == "fit":
        run_refusal(out, backup_dir, worker, strategy)
    if mode == "all":  # the same processes go on with the custom loops
        run_loop(out, worker, strategy, loop_optimizer, "loop")
        run_loop(out, worker, strategy, bfloat16_optimizer, "bf16")
        run_loop(out, worker, strategy, dp_optimizer, "dp")
    exit_together(strategy)
    print(f"[worker {worker}] done", flush=True)


if __name__ == "__main__":
    arguments = sys.argv[1:]
    kill = None
    if "--kill" in arguments:
        at = arguments.index("--kill")
        kill = tuple(int(part) for part in arguments[at + 1].split(":"))
        del arguments[at : at + 2]
    main(*arguments, kill)
    sys.stdout.flush()
    os._exit(0)
