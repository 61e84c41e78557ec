"""Runs as one worker of a 2-worker MWMS cluster, or alone (no TF_CONFIG).

Writes `<out>/<mode>.npz` with the final weights of each case (the same
global batches in both modes) and, under MWMS, the text of the upstream
Keras failure that `enable_multi_worker_fit` works around.
"""

import contextlib
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

if __name__ == "__main__" and sys.argv[1] in ("run_main", "start_timeout"):
    # `run_main`'s statuses for TF_CONFIG's task, or the start-up watchdog
    # (`start_timeout` seconds): before the cases below import TensorFlow.
    from tf_lars import distribute

    def _start(mode, *arguments):
        if mode == "run_main":
            distribute.parse_tf_config(mode="sync")
        else:
            distribute.multi_worker_strategy(start_timeout=float(arguments[0]))
        print("started")

    distribute.run_main(_start, *sys.argv[1:])

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_lars  # noqa: E402
from tests.distribute_launch_helpers import exit_together  # noqa: E402
from tf_lars import distribute  # noqa: E402

GLOBAL_BATCH = 16
STEPS = 4


def lars():
    return tf_lars.LARS(
        learning_rate=0.5, momentum=0.9, weight_decay=1e-3, trust_coefficient=0.02
    )


def dense_model():
    keras.utils.set_random_seed(3)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )


def embedding_model():
    keras.utils.set_random_seed(4)
    return keras.Sequential(
        [
            keras.Input((3,), dtype="int32"),
            keras.layers.Embedding(20, 4),
            keras.layers.Flatten(),
            keras.layers.Dense(1),
        ]
    )


rng = np.random.default_rng(0)
X = rng.normal(size=(GLOBAL_BATCH * STEPS, 6)).astype("float32")
Y = (X @ rng.normal(size=(6, 1))).astype("float32")
IDS = rng.integers(0, 20, size=(GLOBAL_BATCH * STEPS, 3)).astype("int32")
YE = rng.normal(size=(GLOBAL_BATCH * STEPS, 1)).astype("float32")


def dataset(x, y):
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    return data.with_options(options)


# Mixed precision: one target of the third batch makes the scaled loss's
# gradient overflow float16. It sits
# in one half of that global batch, which one worker receives, so only that
# worker computes a non-finite gradient; both must skip that step.
YM = Y.copy()
YM[2 * GLOBAL_BATCH + 12] = 6e4


def mixed_model():
    keras.utils.set_random_seed(5)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(8),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )


@contextlib.contextmanager
def mixed_precision():
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def loss_scale_state(optimizer):
    return np.asarray(
        [float(optimizer.loss_scale), float(optimizer.skipped_steps)], "float64"
    )


def mixed_fit_case(strategy):
    with mixed_precision():
        with strategy.scope():
            model = mixed_model()
            optimizer = tf_lars.LossScaleOptimizer(lars(), initial_scale=256.0)
            model.compile(optimizer, "mse")
        distribute.enable_multi_worker_fit(model)
        model.fit(dataset(X, YM), epochs=1, verbose=0, shuffle=False)
    return weights(model).astype("float32"), loss_scale_state(optimizer)


def mixed_loop_case(strategy):
    """The mixed-precision case through a custom loop (`strategy.run`)."""
    with mixed_precision():
        with strategy.scope():
            model = mixed_model()
            optimizer = tf_lars.LossScaleOptimizer(lars(), initial_scale=256.0)
        run_loop(strategy, model, optimizer, X, YM)
    return weights(model).astype("float32"), loss_scale_state(optimizer)


def weights(model):
    return np.concatenate([np.ravel(v.numpy()) for v in model.weights])


def fit_case(strategy, make_model, x, y, workaround=True):
    with strategy.scope():
        model = make_model()
        model.compile(lars(), "mse", metrics=["mean_absolute_error"])
    if workaround:
        distribute.enable_multi_worker_fit(model)
    history = model.fit(dataset(x, y), epochs=2, verbose=0, shuffle=False)
    logged = [history.history[name] for name in ("loss", "mean_absolute_error")]
    return weights(model), np.asarray(logged)


def run_loop(strategy, model, optimizer, x, y):
    """`STEPS` steps of `strategy.run` + `apply_gradients`; the first step's
    gradient kinds (True: `IndexedSlices`). `scale_loss` is the identity for
    plain optimizers, the loss scale for a `LossScaleOptimizer`."""
    with strategy.scope():
        optimizer.build(model.trainable_variables)
    sparse = []

    def step(xb, yb):
        with tf.GradientTape() as tape:
            prediction = tf.cast(model(xb), tf.float32)
            per_example = tf.reduce_mean(tf.square(prediction - yb), axis=1)
            loss = tf.nn.compute_average_loss(
                per_example, global_batch_size=GLOBAL_BATCH
            )
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        sparse.append([isinstance(g, tf.IndexedSlices) for g in grads])
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def train(iterator):
        xb, yb = next(iterator)
        strategy.run(step, args=(xb, yb))

    iterator = iter(strategy.experimental_distribute_dataset(dataset(x, y)))
    for _ in range(STEPS):
        train(iterator)
    return np.asarray(sparse[0])


def custom_loop_case(strategy, make_model, x, y):
    with strategy.scope():
        model = make_model()
        optimizer = lars()
    sparse = run_loop(strategy, model, optimizer, x, y)
    return weights(model), sparse


# ------------------------------------------------ LAMB files across modes
def lamb_model():
    keras.utils.set_random_seed(6)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh", name="hidden"),
            keras.layers.Dense(1, name="out"),
        ],
        name="lamb_net",
    )
    model.compile(tf_lars.LAMB(0.05, weight_decay=1e-2), "mse")
    return model


def lamb_state(model, prefix):
    """`{prefix}_paths` and `{prefix}_<i>`: every variable, in order."""
    variables = [*model.weights, *model.optimizer.variables]
    state = {f"{prefix}_{i}": v.numpy() for i, v in enumerate(variables)}
    state[f"{prefix}_paths"] = np.asarray([v.path for v in variables])
    return state


def lamb_fit(model, strategy):
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        distribute.enable_multi_worker_fit(model)
    model.fit(dataset(X, Y), epochs=1, verbose=0, shuffle=False)


def lamb_files_case(strategy, out, mode, load_from):
    """Trains LAMB 1 epoch, writes `<mode>-lamb.keras` and `<mode>-lamb-ckpt`
    (worker 1 to a scratch directory), trains 1 more; with `load_from`,
    loads the one process's files and trains 1 more epoch from each."""
    with strategy.scope():
        model = lamb_model()
    lamb_fit(model, strategy)
    results = lamb_state(model, "saved")
    where = out if mode in ("single", "worker0") else os.path.join(out, mode)
    os.makedirs(where, exist_ok=True)
    model.save(os.path.join(where, f"{mode}-lamb.keras"))
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    checkpoint.write(os.path.join(where, f"{mode}-lamb-ckpt"))
    lamb_fit(model, strategy)
    results.update(lamb_state(model, "continued"))
    if load_from:
        with strategy.scope():
            loaded = keras.saving.load_model(
                os.path.join(load_from, "single-lamb.keras")
            )
            restored = lamb_model()
            restored.optimizer.build(restored.trainable_variables)
        checkpoint = tf.train.Checkpoint(model=restored, optimizer=restored.optimizer)
        checkpoint.read(os.path.join(load_from, "single-lamb-ckpt")).assert_consumed()
        for name, loaded_model in (("keras", loaded), ("ckpt", restored)):
            results.update(lamb_state(loaded_model, f"loaded_{name}"))
            lamb_fit(loaded_model, strategy)
            results.update(lamb_state(loaded_model, f"loaded_{name}_continued"))
    return results


def main(out):
    multi = "TF_CONFIG" in os.environ
    if multi:
        config = distribute.parse_tf_config(mode="sync")
        strategy = distribute.multi_worker_strategy(config, communication_timeout=60)
        mode = f"worker{config.task_index}"
    else:
        strategy = tf.distribute.get_strategy()
        mode = "single"
    # First: the one process's LAMB is named `lamb` (auto names count up).
    results = lamb_files_case(strategy, out, mode, os.environ.get("LAMB_LOAD_FROM"))
    if multi:
        try:
            fit_case(strategy, dense_model, X, Y, workaround=False)
            results["upstream_error"] = np.asarray("")
        except Exception as error:  # noqa: BLE001 - recorded for the test
            results["upstream_error"] = np.asarray(f"{type(error).__name__}: {error}")
    results["dense"], results["dense_loss"] = fit_case(strategy, dense_model, X, Y)
    results["embedding"], results["embedding_loss"] = fit_case(
        strategy, embedding_model, IDS, YE
    )
    results["loop_dense"], _ = custom_loop_case(strategy, dense_model, X, Y)
    results["loop_embedding"], results["loop_sparse"] = custom_loop_case(
        strategy, embedding_model, IDS, YE
    )
    results["mixed"], results["mixed_state"] = mixed_fit_case(strategy)
    results["loop_mixed"], results["loop_mixed_state"] = mixed_loop_case(strategy)
    np.savez(os.path.join(out, f"{mode}.npz"), **results)
    if multi:
        exit_together(strategy)
    print(f"[script] {mode} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()
    os._exit(0)
