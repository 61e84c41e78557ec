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

import contextlib
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
    return free_ports(1, host)[0]


def free_ports(count, host="localhost"):
    """`count` distinct TCP ports that were free a moment ago.

    The sockets are bound together (to port 0) and then released, so the
    kernel hands out distinct ports.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with contextlib.ExitStack() as stack:
        sockets = [
            stack.enter_context(socket.socket(family, socket.SOCK_STREAM))
            for _ in range(count)
        ]
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]


def bind_host(host):
    """The address to bind for a cluster host name (`localhost`: 127.0.0.1,
    an IPv6 literal without its brackets)."""
    return "127.0.0.1" if host == "localhost" else host.strip("[]")


def local_cluster(num_workers, num_ps, host="localhost", mode="ps"):
    """A cluster dict with free ports on `host`.

    Args:
        num_workers: int >= 1, worker tasks.
        num_ps: int, parameter-server tasks (>= 1 in ps mode, 0 in sync mode).
        host: str, the host name in the addresses (an IPv6 literal, with or
            without brackets, is written in brackets). Defaults to "localhost".
        mode: "ps" (1 chief, workers, ps) or "sync" (workers only, for
            `MultiWorkerMirroredStrategy`). Defaults to "ps".

    Returns:
        dict from task type to a list of `"host:port"` addresses.

    Examples:
        ```python
        local_cluster(2, 0, mode="sync")
        # {'worker': ['localhost:41029', 'localhost:48881']}
        ```
    """
    if mode not in ("ps", "sync"):
        raise ValueError(f"`mode` must be 'ps' or 'sync'. Received: mode={mode!r}")
    if mode == "sync" and num_ps:
        raise ValueError(
            "`num_ps` must be 0 in sync mode (workers only). "
            f"Received: num_ps={num_ps!r}"
        )
    counts = (
        {"worker": num_workers}
        if mode == "sync"
        else {"chief": 1, "worker": num_workers, "ps": num_ps}
    )
    ports = iter(free_ports(sum(counts.values()), bind_host(host)))
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return {
        task_type: [f"{host}:{next(ports)}" for _ in range(count)]
        for task_type, count in counts.items()
    }


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

    cluster = local_cluster(num_workers, num_ps)
    base = tf_config_lib.TFConfig(cluster, "chief", 0)
    for task_type in ("worker", "ps"):
        for index in range(len(cluster[task_type])):
            start_server(base.for_task(task_type, index), inter_op_threads)
    return connect(base, inter_op_threads)
