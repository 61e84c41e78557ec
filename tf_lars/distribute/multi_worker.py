"""Synchronous multi-worker training: `MultiWorkerMirroredStrategy` (MWMS).

- `enable_multi_worker_fit(model)`: makes `model.fit` / `evaluate` work
  under MWMS on Keras 3.15 (the workaround for two upstream failures; see
  the README, "Synchronous multi-worker training").
- `multi_worker_strategy(config=None)`: validates `TF_CONFIG` for the
  synchronous mode (workers only, optionally one chief; no `ps`) before any
  server starts, then creates the strategy.
- `is_chief(config)`: whether this task writes files (worker 0, or the chief).
"""

import json
import os
import sys

import tensorflow as tf

from tf_lars import _internals
from tf_lars.distribute import tf_config as tf_config_lib


def _with_leading_axis(value):
    if isinstance(value, tf.Tensor) and value.shape.rank == 0:
        return tf.reshape(value, [1])
    return value


def enable_multi_worker_fit(model):
    """Lets `model.fit` and `model.evaluate` run under MWMS (Keras 3.15).

    Call it after `model.compile` (under `strategy.scope()`), before `fit`.
    Under any other strategy (or none) it returns the model unchanged, so
    the same program runs in one process and on a cluster.

    Keras 3.15 fails twice under `MultiWorkerMirroredStrategy`:

    1. before the first step, `_maybe_symbolic_build` reduces a tuple of
       `PerReplica` batches with `strategy.reduce("MEAN", ...)` only to learn
       their shapes, which the collective ops refuse ("Attempt to convert a
       value (PerReplica...) to a Tensor"). The model is built from this
       worker's local batch instead (`tf_lars._internals`, access 7).
    2. the train and test functions reduce each scalar log with
       `strategy.reduce("MEAN", value, axis=0)`, which fails on a scalar
       ("Invalid reduction dimension 0 for input with 0 dimensions"). The
       instance's `train_step` / `test_step` (public, overridable) are wrapped
       to return scalars with a leading axis of 1, so the reduction is the
       mean over replicas.

    Neither changes the training: gradients are all-reduced by the strategy
    as before. `tests/distribute_multi_worker_test.py` runs `fit` without
    this function and expects the failure, so it notices when Keras fixes it.

    Args:
        model: a compiled `keras.Model` created under the strategy's scope.

    Returns:
        The same model.

    Example:

    ```python
    strategy = tf_lars.distribute.multi_worker_strategy()
    with strategy.scope():
        model = make_model()
        model.compile(tf_lars.LARS(1.0), "sparse_categorical_crossentropy")
    tf_lars.distribute.enable_multi_worker_fit(model)
    model.fit(dataset, epochs=2)
    ```
    """
    import keras

    if not isinstance(model, keras.Model):
        raise ValueError(f"`model` must be a keras.Model. Received: model={model!r}")
    strategy = model.distribute_strategy
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return model
    _internals.build_from_local_batch(model)
    for name in ("train_step", "test_step"):
        step = getattr(model, name)

        def wrapped(data, _step=step):
            return tf.nest.map_structure(_with_leading_axis, _step(data))

        setattr(model, name, wrapped)
    return model


def is_chief(config):
    """Whether this task is the one that writes files.

    Args:
        config: a `TFConfig` of a synchronous cluster, or None (one process).

    Returns:
        True for one process, the `chief` task, or worker 0 of a cluster
        without a chief (MWMS's convention).
    """
    if config is None:
        return True
    if "chief" in config.cluster:
        return config.task_type == "chief"
    return config.task_type == "worker" and config.task_index == 0


_WATCHDOG = """
import json, select, signal, socket, sys, os
fd, parent, timeout, who, cluster, me = (int(sys.argv[1]), int(sys.argv[2]),
    float(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5]), sys.argv[6])
ready, _, _ = select.select([fd], [], [], timeout)
if ready:
    sys.exit(0)  # a byte (started) or EOF (the parent ended)
missing = []
for address in cluster:
    if address == me:
        continue
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=2.0).close()
    except OSError:
        missing.append(address)
print(who % (", ".join(missing) or "some tasks (all ports answer)"),
      file=sys.stderr, flush=True)
import time
# TensorFlow's servers may keep a SIGTERM from ending the process.
for signum, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 0.0)):
    try:
        os.kill(parent, signum)
    except OSError:
        break
    time.sleep(wait)
"""


def _start_watchdog(config, start_timeout):
    """A separate process that ends this one if the cluster does not start.

    TensorFlow waits at its start-up barrier in C++ holding the GIL, so no
    thread of this process can run meanwhile: a small Python process watches
    instead, names the tasks whose ports do not answer, and sends SIGTERM
    (then SIGKILL: TensorFlow's servers may keep SIGTERM from ending it).
    """
    import subprocess

    read_fd, write_fd = os.pipe()
    labels = {}
    for task_type, addresses in config.cluster.items():
        for index, address in enumerate(addresses):
            labels[address] = f"{task_type} {index} ({address})"
    message = (
        f"error: {config.task_type} {config.task_index}: %s did not start within "
        f"{start_timeout:g}s; the cluster needs every worker "
        "(MultiWorkerMirroredStrategy). Start it, or fix TF_CONFIG."
    )
    # The watchdog reports addresses; name them as `type index (address)`.
    code = _WATCHDOG.replace(
        "missing.append(address)", "missing.append(LABELS[address])"
    ).replace("import json,", f"LABELS = {labels!r}\nimport json,")
    subprocess.Popen(
        [
            sys.executable,
            "-c",
            code,
            str(read_fd),
            str(os.getpid()),
            str(start_timeout),
            message,
            json.dumps([a for v in config.cluster.values() for a in v]),
            config.address,
        ],
        pass_fds=(read_fd,),
        stdin=subprocess.DEVNULL,
    )
    os.close(read_fd)
    return write_fd


def multi_worker_strategy(config=None, communication_timeout=None, start_timeout=300):
    """Validates `TF_CONFIG` for synchronous training and creates the strategy.

    Args:
        config: a `TFConfig`, or None to parse `TF_CONFIG` with
            `parse_tf_config(mode="sync")` (an error comes before any server
            starts).
        communication_timeout: float seconds or None: a collective that
            waits longer fails instead of hanging. Defaults to None.
        start_timeout: float seconds or None: if the other tasks have not
            all joined (one all-reduce across the cluster) by then, one
            line on stderr names the tasks whose ports do not answer and the
            process is ended by SIGTERM, then SIGKILL 3 s later (TensorFlow's
            servers may hold off SIGTERM). None waits as long as
            TensorFlow does. Defaults to 300.

    Returns:
        A `tf.distribute.MultiWorkerMirroredStrategy`.

    Raises:
        TFConfigError: a malformed `TF_CONFIG`, or one with `ps` tasks.

    Example:

    ```python
    strategy = tf_lars.distribute.multi_worker_strategy()  # reads TF_CONFIG
    ```
    """
    if config is None:
        config = tf_config_lib.parse_tf_config(mode="sync")
    for name, value in (
        ("communication_timeout", communication_timeout),
        ("start_timeout", start_timeout),
    ):
        if value is not None and not (
            isinstance(value, int | float) and not isinstance(value, bool) and value > 0
        ):
            raise ValueError(
                f"`{name}` must be a number > 0 or None. Received: {name}={value!r}"
            )
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(config.cluster),
        task_type=config.task_type,
        task_id=config.task_index,
        rpc_layer=config.rpc_layer,
    )
    options = tf.distribute.experimental.CommunicationOptions(
        timeout_seconds=communication_timeout
    )
    started = None if start_timeout is None else _start_watchdog(config, start_timeout)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=resolver, communication_options=options
    )
    # Every worker has joined once one all-reduce has gone through.
    strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)
    if started is not None:
        os.write(started, b"1")
        os.close(started)
    return strategy
