"""Train a digits classifier with AGN on a parameter-server cluster.

The same entry point runs on every task: `TF_CONFIG` decides whether this
process serves (worker, ps) or coordinates (chief). Locally:

    python -m tf_lars.distribute.launch --workers 2 --ps 1 -- \\
        tf_lars.distribute.train_example --steps-per-worker 300

On a real cluster, set `TF_CONFIG` on each machine and run
`python -m tf_lars.distribute.train_example ...` there.

The data is scikit-learn's `load_digits` (8x8 images, 10 classes, shipped
with scikit-learn): 1437 training and 360 test images, a fixed split.
"""

import argparse
import json
import os
import re
import subprocess
import sys

from tf_lars.distribute import tf_config as tf_config_lib


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m tf_lars.distribute.train_example",
        description="AGN on ParameterServerStrategy: a digits classifier.",
    )
    parser.add_argument("--period", type=int, default=10, help="communication_period")
    parser.add_argument(
        "--steps-per-worker", type=int, default=300, help="local steps per worker"
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--optimizer", choices=("sgd", "momentum", "adam", "lars"), default="sgd"
    )
    parser.add_argument("--learning-rate", type=float, default=0.5)
    parser.add_argument("--hidden", type=int, default=64, help="hidden units")
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument(
        "--checkpoint-every", type=int, default=10, help="commits between checkpoints"
    )
    parser.add_argument(
        "--input-delay-ms",
        type=float,
        default=0.0,
        help="sleep per input batch on the workers (simulates a slow input pipeline)",
    )
    parser.add_argument("--no-jit", action="store_true", help="do not compile with XLA")
    parser.add_argument("--seed", type=int, default=0, help="model initialization seed")
    parser.add_argument("--result-json", default=None, help="write final metrics here")
    return parser


def load_digits_split():
    """Standardized digits: `(x_train, y_train, x_test, y_test)`, float32/int32."""
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    mean = x[:split].mean(axis=0)
    std = x[:split].std(axis=0) + 1e-3
    x = (x - mean) / std
    return x[:split], y[:split], x[split:], y[split:]


def _ss(*args):
    return subprocess.run(
        ["ss", *args], capture_output=True, text=True, timeout=10, check=True
    ).stdout


def ps_bytes_received(cluster):
    """Bytes received so far by the parameter-server processes over TCP.

    Sums the kernel's `bytes_received` over every established socket of each
    parameter-server process (found by its listening port with `ss -p`): the
    gRPC connections other tasks open to it and the ones it opens to the
    workers to fetch tensors (TensorFlow's receiver pulls). Needs the
    processes to be in this network namespace and readable by this user;
    returns None when `ss` cannot tell.
    """
    total = 0
    try:
        for address in cluster["ps"]:
            port = address.rsplit(":", 1)[1]
            listening = _ss("-tlnpH", f"( sport = :{port} )")
            pids = set(re.findall(r"pid=(\d+)", listening))
            if not pids:
                return None
            owner = set()
            # `ss -i` prints a socket's line, then its TCP info indented.
            for line in _ss("-tinpH", "state", "established").splitlines():
                if line and not line[0].isspace():
                    owner = set(re.findall(r"pid=(\d+)", line))
                if owner & pids:
                    total += sum(
                        int(n) for n in re.findall(r"bytes_received:(\d+)", line)
                    )
    except (OSError, subprocess.SubprocessError):
        return None
    return total


def _make_inner(args):
    import keras

    import tf_lars

    if args.optimizer == "sgd":
        return keras.optimizers.SGD(args.learning_rate)
    if args.optimizer == "momentum":
        return keras.optimizers.SGD(args.learning_rate, momentum=0.9)
    if args.optimizer == "adam":
        return keras.optimizers.Adam(args.learning_rate)
    return tf_lars.LARS(learning_rate=args.learning_rate, momentum=0.9)


def train(args, config, strategy, coordinator):
    """The chief's work. Returns the process exit status."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_lars
    from tf_lars.distribute.trainer import (
        ParameterServerFailure,
        ParameterServerTrainer,
    )

    x_train, y_train, x_test, y_test = load_digits_split()
    keras.utils.set_random_seed(args.seed)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(args.hidden, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        optimizer = tf_lars.AGN(_make_inner(args), communication_period=args.period)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    batch_size = args.batch_size
    delay_us = int(args.input_delay_ms * 1000)

    def dataset_fn(input_context):
        del input_context
        dataset = (
            tf.data.Dataset.from_tensor_slices((x_train, y_train))
            .shuffle(len(x_train))
            .batch(batch_size, drop_remainder=True)
        )
        if delay_us:
            from tensorflow.python.data.experimental.ops import testing

            dataset = dataset.apply(testing.sleep(delay_us))
        return dataset

    try:
        trainer = ParameterServerTrainer(
            model,
            loss,
            optimizer,
            dataset_fn,
            strategy,
            coordinator=coordinator,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_every=args.checkpoint_every,
            jit_compile=not args.no_jit,
        )
        bytes_before = ps_bytes_received(config.cluster)
        history = trainer.fit(steps_per_worker=args.steps_per_worker)
        bytes_after = ps_bytes_received(config.cluster)
        metrics = trainer.evaluate(x_test, y_test)
    except ParameterServerFailure as failure:
        print(f"error: {failure}", file=sys.stderr, flush=True)
        return 3
    param_bytes = int(
        sum(
            np.prod(v.shape) * np.dtype(v.dtype).itemsize
            for v in model.trainable_variables
        )
    )
    run_commits = history["commits"] - history["restored_commits"]
    result = {
        "period": args.period,
        "num_workers": config.num_workers,
        "num_ps": config.num_ps,
        "steps_per_worker": args.steps_per_worker,
        "commits": history["commits"],
        "target_commits": history["target_commits"],
        "restored_commits": history["restored_commits"],
        "local_steps": history["local_steps"],
        "seconds": history["seconds"],
        "commits_per_second": history["commits_per_second"],
        "param_bytes": param_bytes,
        "pushed_payload_bytes": run_commits * param_bytes,
        "ps_bytes_received": (
            None
            if bytes_before is None or bytes_after is None
            else bytes_after - bytes_before
        ),
        "test_loss": metrics["loss"],
        "test_accuracy": metrics["accuracy"],
        "losses": history["losses"],
    }
    print(
        f"[agn] test accuracy {metrics['accuracy']:.4f} on {len(x_test)} digits "
        f"(loss {metrics['loss']:.4f}); {history['commits']} commits, "
        f"{history['local_steps']} local steps",
        flush=True,
    )
    if args.result_json:
        with open(args.result_json, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.period < 1 or args.steps_per_worker < args.period:
        print(
            "error: --period must be >= 1 and --steps-per-worker >= --period",
            file=sys.stderr,
        )
        return 2
    # Before TensorFlow is imported: a bad TF_CONFIG fails in milliseconds.
    try:
        config = tf_config_lib.parse_tf_config()
    except tf_config_lib.TFConfigError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2

    from tf_lars.distribute import cluster

    if config.task_type in ("worker", "ps"):
        cluster.serve(config)
        return 0
    strategy, coordinator = cluster.connect(config)
    return train(args, config, strategy, coordinator)


if __name__ == "__main__":
    try:
        status = main()
    except SystemExit as exit_request:
        status = exit_request.code if isinstance(exit_request.code, int) else 2
    except BaseException:  # noqa: BLE001 - reported, then a clean exit status
        import traceback

        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # TensorFlow's remote eager context can block interpreter shutdown when a
    # task of the cluster is gone; the work is done, so leave at once.
    os._exit(status)
