"""One worker of a synchronous job that `tests/distribute_launch_sync_test.py`
starts with `python -m tf_lars.distribute.launch --mode sync`.

    python tests/distribute_launch_sync_script.py OUT [--kill-worker I]
        [--exit-worker I --exit-status N] [--fail-noisily]

Each run writes `OUT/worker-<index>-run-<TF_LARS_RESTART>.json`: what the
worker saw (TF_CONFIG, TF_LARS_RESTART), the all-reduced sum of
`index + 1` over the workers and the weights after three LARS steps on
the worker's half of each global batch (a custom loop under
`MultiWorkerMirroredStrategy`).

- `--kill-worker I`: worker I SIGKILLs itself after the cluster has
  started, in the first run only (`TF_LARS_RESTART` == 0);
- `--exit-worker I --exit-status N`: worker I prints `error: ...` and exits
  with status N at once, before importing TensorFlow;
- `--fail-noisily`: worker 0 logs a TensorFlow op error through TensorFlow's
  logger (traceback included), then prints one `error:` line, exits 1.
"""

import argparse
import json
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

GLOBAL_BATCH = 8
STEPS = 3


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--kill-worker", type=int, default=None)
    parser.add_argument("--exit-worker", type=int, default=None)
    parser.add_argument("--exit-status", type=int, default=2)
    parser.add_argument("--fail-noisily", action="store_true")
    return parser.parse_args()


def write(out, index, run, record):
    path = os.path.join(out, f"worker-{index}-run-{run}.json")
    with open(path + ".tmp", "w") as handle:
        json.dump(record, handle)
    os.replace(path + ".tmp", path)


def fail_noisily(tf):
    @tf.function
    def check(value):
        return tf.debugging.check_numerics(value, "loss")

    try:
        check(tf.constant(float("nan")))
    except tf.errors.InvalidArgumentError:
        tf.get_logger().error("step 3 failed", exc_info=True)
    print("error: the loss is NaN at step 3", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


def main():
    args = parse_args()
    raw_config = os.environ["TF_CONFIG"]
    index = json.loads(raw_config)["task"]["index"]
    run = int(os.environ["TF_LARS_RESTART"])
    if index == args.exit_worker:
        print("error: simulated bad configuration", file=sys.stderr, flush=True)
        sys.exit(args.exit_status)

    import keras
    import numpy as np
    import tensorflow as tf

    import tf_lars
    from tf_lars import distribute

    config = distribute.parse_tf_config(mode="sync")
    strategy = distribute.multi_worker_strategy(config, communication_timeout=60)
    record = {"tf_config": raw_config, "restart": run, "index": index}
    write(args.out, index, run, dict(record, stage="started"))

    @tf.function
    def sum_over_workers(value):
        return strategy.reduce("SUM", strategy.run(lambda: value), axis=None)

    # A barrier: every worker has written its "started" record.
    sum_over_workers(tf.constant(0.0))
    if index == args.kill_worker and run == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    if args.fail_noisily and index == 0:
        fail_noisily(tf)

    total = sum_over_workers(tf.constant(float(index + 1)))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH * STEPS, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1))).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    dataset = dataset.with_options(options)
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        optimizer = tf_lars.LARS(learning_rate=0.5, momentum=0.9)
        optimizer.build(model.trainable_variables)
    initial = np.concatenate([np.ravel(v.numpy()) for v in model.weights])

    def step(xb, yb):
        with tf.GradientTape() as tape:
            per_example = tf.reduce_mean(tf.square(model(xb) - yb), axis=1)
            loss = tf.nn.compute_average_loss(
                per_example, global_batch_size=GLOBAL_BATCH
            )
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def train(iterator):
        xb, yb = next(iterator)
        strategy.run(step, args=(xb, yb))

    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    for _ in range(STEPS):
        train(iterator)
    weights = np.concatenate([np.ravel(v.numpy()) for v in model.weights])
    record.update(
        stage="done",
        total=float(total),
        initial=initial.tolist(),
        weights=weights.tolist(),
    )
    write(args.out, index, run, record)
    from tests.distribute_launch_helpers import exit_together

    exit_together(strategy)
    print(f"[script] worker {index} done (run {run})", flush=True)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    # MWMS can block interpreter shutdown on its collective threads.
    os._exit(0)
