"""Train a digits classifier with AGN on a parameter-server cluster.

The same entry point runs on every task: `TF_CONFIG` decides whether this
process serves (worker, ps) or coordinates (chief). Locally, from the
repository root:

    python -m tf_lars.distribute.launch --workers 2 --ps 1 -- \\
        examples/agn_digits.py --steps-per-worker 300

On a real cluster, set `TF_CONFIG` on each machine and run
`python examples/agn_digits.py ...` there.

The data is scikit-learn's `load_digits` (8x8 images, 10 classes, shipped
with scikit-learn): 1437 training and 360 test images, a fixed split.
"""

import argparse
import contextlib
import json
import os
import socket
import struct
import sys

import quiet_tensorflow  # noqa: F401 - first: no TensorFlow C++ start-up lines

# isort: split
from tf_lars.distribute import tf_config as tf_config_lib


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python examples/agn_digits.py",
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
    parser.add_argument(
        "--outer-learning-rate",
        type=float,
        default=None,
        help="asynchronous DiLoCo: an outer SGD at this rate applies each commit's "
        "pseudo-gradient (default: AGN's own commit)",
    )
    parser.add_argument(
        "--outer-momentum",
        type=float,
        default=0.0,
        help="the outer SGD's Nesterov momentum (with --outer-learning-rate)",
    )
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


# Linux sock_diag (netlink): the kernel's per-socket TCP counters, which is
# what `ss -i` shows, read without running and parsing `ss`.
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST_DUMP = 0x1 | 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_INET_DIAG_INFO = 2
_TCP_ESTABLISHED, _TCP_LISTEN = 1, 10
_TCPI_BYTES_RECEIVED = 128  # offset of tcpi_bytes_received in struct tcp_info
_HEADER = "=IHHII"  # struct nlmsghdr


def _tcp_sockets(family):
    """Yields `(state, local port, inode, bytes received or None)` for every
    TCP socket of `family` in this network namespace."""
    request = struct.pack(
        "=BBBBI",
        family,
        socket.IPPROTO_TCP,
        1 << (_INET_DIAG_INFO - 1),
        0,
        ~0 & 0xFFFFFFFF,
    ) + bytes(48)  # struct inet_diag_req_v2 with an empty inet_diag_sockid
    header = struct.pack(
        _HEADER, 16 + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST_DUMP, 1, 0
    )
    with socket.socket(
        socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG
    ) as sock:
        sock.sendto(header + request, (0, 0))
        while True:
            data = sock.recv(1 << 16)
            offset = 0
            while offset + 16 <= len(data):
                length, kind = struct.unpack_from(_HEADER, data, offset)[:2]
                if kind == _NLMSG_DONE:
                    return
                if kind == _NLMSG_ERROR or length < 16 + 72:
                    raise OSError("sock_diag request failed")
                body = offset + 16  # struct inet_diag_msg, 72 bytes
                state = data[body + 1]
                (port,) = struct.unpack_from("!H", data, body + 4)
                (inode,) = struct.unpack_from("=I", data, body + 68)
                received = None
                attribute = body + 72
                while attribute + 4 <= offset + length:
                    size, kind = struct.unpack_from("=HH", data, attribute)
                    if size < 4:
                        break
                    if kind == _INET_DIAG_INFO and size >= 4 + _TCPI_BYTES_RECEIVED + 8:
                        (received,) = struct.unpack_from(
                            "=Q", data, attribute + 4 + _TCPI_BYTES_RECEIVED
                        )
                    attribute += (size + 3) & ~3
                yield state, port, inode, received
                offset += (length + 3) & ~3


def _socket_inodes(pid):
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def ps_bytes_received(cluster):
    """Bytes received so far by the parameter-server processes over TCP.

    Sums the kernel's `bytes_received` over every established socket of each
    parameter-server process (found by its listening port): the gRPC
    connections other tasks open to it and the ones it opens to the workers
    to fetch tensors (TensorFlow's receiver pulls). Needs Linux, the
    processes in this network namespace and readable by this user; returns
    None otherwise.
    """
    try:
        sockets = [
            s for f in (socket.AF_INET, socket.AF_INET6) for s in _tcp_sockets(f)
        ]
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
        total = 0
        for address in cluster["ps"]:
            port = int(address.rsplit(":", 1)[1])
            listening = {
                i for st, p, i, _ in sockets if st == _TCP_LISTEN and p == port
            }
            owner = next((p for p in pids if listening & _socket_inodes(p)), None)
            if owner is None:
                return None
            owned = _socket_inodes(owner)
            total += sum(
                received or 0
                for state, _, inode, received in sockets
                if state == _TCP_ESTABLISHED and inode in owned
            )
    except (OSError, AttributeError, struct.error):
        return None
    return total


def sleep_per_element(dataset, microseconds):
    """`dataset`, sleeping `microseconds` before each element (no CPU spent).

    The workers run the dataset as a graph, without this Python process, so
    the sleep is TensorFlow's `SleepDataset` op (`tf.raw_ops`), wrapped
    through the public `tf.data.experimental.to_variant` / `from_variant`.
    """
    import tensorflow as tf

    spec = dataset.element_spec
    variant = tf.raw_ops.SleepDataset(
        input_dataset=tf.data.experimental.to_variant(dataset),
        sleep_microseconds=tf.constant(microseconds, tf.int64),
        output_types=[s.dtype for s in tf.nest.flatten(spec)],
        output_shapes=[s.shape for s in tf.nest.flatten(spec)],
    )
    return tf.data.experimental.from_variant(variant, spec)


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
        outer = None
        if args.outer_learning_rate is not None:
            outer = keras.optimizers.SGD(
                args.outer_learning_rate,
                momentum=args.outer_momentum,
                nesterov=args.outer_momentum > 0,
            )
        optimizer = tf_lars.AGN(
            _make_inner(args), communication_period=args.period, outer_optimizer=outer
        )
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
            dataset = sleep_per_element(dataset, delay_us)
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
