"""Start parameter-server cluster tasks and connect the coordinator.

The same program runs on every task of a cluster; `TF_CONFIG` says which
task it is. Workers and parameter servers only serve (`serve`), the chief
builds the strategy and the coordinator (`connect`) and runs the training
loop (see `examples/agn_digits.py`).

TensorFlow's gRPC servers have no authentication and listen on every network
interface of their machine, whatever host name the cluster spec gives: anyone
who can reach a port can run ops in the task. Keep clusters on private
networks; `tf_lars.distribute.launch` runs local clusters in a private
network namespace where it can.
"""

import os
import socket

from tf_lars.distribute import tf_config as tf_config_lib
from tf_lars.distribute.logs import log_tensorflow_records_once

# Worker closures block on parameter-server reads while the servers run other
# closures' ops; TensorFlow's default pool (one thread per core) starves on
# small machines. Threads are cheap and mostly waiting.
DEFAULT_INTER_OP_THREADS = 16


def pick_free_port(host="localhost"):
    """A TCP port that was free a moment ago (bind to port 0 and release)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _server_config(inter_op_threads):
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto()
    config.inter_op_parallelism_threads = inter_op_threads
    return config


def cluster_spec(config):
    """The `tf.train.ClusterSpec` of a validated `TFConfig`."""
    import tensorflow as tf

    return tf.train.ClusterSpec(config.cluster)


def start_server(config, inter_op_threads=DEFAULT_INTER_OP_THREADS):
    """Starts this task's `tf.distribute.Server` and returns it."""
    import tensorflow as tf

    return tf.distribute.Server(
        cluster_spec(config),
        job_name=config.task_type,
        task_index=config.task_index,
        protocol=config.rpc_layer,
        config=_server_config(inter_op_threads),
        start=True,
    )


def serve(config, inter_op_threads=DEFAULT_INTER_OP_THREADS):
    """Runs a worker or parameter-server task until the process is killed."""
    if config.task_type not in ("worker", "ps"):
        raise ValueError(
            "`serve` runs 'worker' and 'ps' tasks. "
            f"Received: task_type={config.task_type!r}"
        )
    server = start_server(config, inter_op_threads)
    print(
        f"[tf_lars] {config.task_name} serving on {config.address} (pid {os.getpid()})",
        flush=True,
    )
    server.join()


def connect(config, inter_op_threads=DEFAULT_INTER_OP_THREADS):
    """Creates the strategy and coordinator on the chief.

    Returns:
        `(strategy, coordinator)`: a `tf.distribute.ParameterServerStrategy`
        and its `tf.distribute.coordinator.ClusterCoordinator`.
    """
    import tensorflow as tf

    if config.task_type != "chief":
        raise ValueError(
            "Only the 'chief' task runs the coordinator. "
            f"Received: task_type={config.task_type!r}"
        )
    tf.config.threading.set_inter_op_parallelism_threads(inter_op_threads)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        cluster_spec(config),
        task_type="chief",
        task_id=0,
        rpc_layer=config.rpc_layer,
    )
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    log_tensorflow_records_once()
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    return strategy, coordinator


def in_process_cluster(num_workers=2, num_ps=1, inter_op_threads=32):
    """A whole cluster inside this process, for tests and experiments.

    Every task is a `tf.distribute.Server` on a free localhost port. The
    servers cannot be shut down: use one cluster per process and end the
    process with `os._exit`.

    Returns:
        `(strategy, coordinator)` as `connect` returns them.
    """

    cluster = {
        "chief": [f"localhost:{pick_free_port()}"],
        "worker": [f"localhost:{pick_free_port()}" for _ in range(num_workers)],
        "ps": [f"localhost:{pick_free_port()}" for _ in range(num_ps)],
    }
    base = tf_config_lib.TFConfig(cluster, "chief", 0)
    for task_type in ("worker", "ps"):
        for index in range(len(cluster[task_type])):
            start_server(base.for_task(task_type, index), inter_op_threads)
    return connect(base, inter_op_threads)
