"""Synchronous multi-worker training: `MultiWorkerMirroredStrategy` (MWMS).

- `enable_multi_worker_fit(model)`: makes `model.fit` / `evaluate` work
  under MWMS on Keras 3.15 (the workaround for two upstream failures; see
  docs/guides/multi-worker.md, "The Keras workaround and when to remove it").
- `multi_worker_strategy(config=None)`: validates `TF_CONFIG` for the
  synchronous mode (workers only, optionally one chief; no `ps`) before any
  server starts, then creates the strategy.
- `is_chief(config)`: whether this task writes files (worker 0, or the chief).
- `BackupAndRestore(backup_dir)`: `keras.callbacks.BackupAndRestore` made
  safe for a cluster (the chief writes, atomically; every worker resumes
  from the chief's backup) and exact (optimizer state included).
"""

import contextlib
import json
import os
import re
import signal
import sys
import tempfile
import threading
import warnings

import keras
import tensorflow as tf

from tf_lars._wrapper import backing_variable
from tf_lars.distribute import _internals, _process
from tf_lars.distribute import tf_config as tf_config_lib
from tf_lars.distribute.logs import log_tensorflow_records_once


def _with_leading_axis(value):
    if isinstance(value, tf.Tensor) and value.shape.rank == 0:
        return tf.reshape(value, [1])
    return value


def build_from_local_batch(model):
    """Makes `model` build its state from a local batch, not a reduced one.

    Replaces Keras's `_maybe_symbolic_build` for this model only
    (`_internals.replace_symbolic_build`, which says why): the first batch
    of the distributed iterator is taken, each `DistributedValues` replaced
    by this worker's first local value (only shapes and dtypes matter), and
    Keras's own `_symbolic_build` runs on it in the strategy's scope. The
    class and other models are unchanged. Where Keras writes metric
    variables through on every replica (3.8; `_metrics_sync_on_write`), the
    loss tracker and the compiled metrics are made to sum on read instead,
    so that `fit` logs the loss of the global batch.
    """
    strategy = model.distribute_strategy
    on_write = _metrics_sync_on_write(model)

    def first_local(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return strategy.experimental_local_results(value)[0]
        return value

    def local_symbolic_build(iterator=None, data_batch=None):
        if iterator is not None:
            # Keras's epoch iterator yields (begin, end, tf iterator) from
            # Keras 3.11 on and (step, tf iterator) in 3.8: the last item.
            for item in iterator:
                data_batch = next(item[-1])
                break
        if data_batch is not None:
            data_batch = tf.nest.map_structure(first_local, data_batch)
        with contextlib.ExitStack() as stack:
            stack.enter_context(strategy.scope())
            if on_write:
                stack.enter_context(tf.variable_creator_scope(_sum_on_read))
            symbolic_build(data_batch=data_batch)

    symbolic_build = _internals.replace_symbolic_build(model, local_symbolic_build)
    if on_write:
        # The loss tracker `compile` made, replaced by one whose variables
        # sum on read; `_symbolic_build` creates the compiled metrics so too.
        with strategy.scope(), tf.variable_creator_scope(_sum_on_read):
            _internals.set_loss_tracker(model, lambda: keras.metrics.Mean(name="loss"))
    return model


def _sum_on_read(next_creator, **kwargs):
    """Variable creator: a `"sum"` variable with no synchronization set is
    created `ON_READ` (each replica keeps its own part; a read sums them).
    Only Keras metrics create `"sum"` variables."""
    if (
        kwargs.get("aggregation") == tf.VariableAggregation.SUM
        and kwargs.get("synchronization", tf.VariableSynchronization.AUTO)
        == tf.VariableSynchronization.AUTO
    ):
        kwargs["synchronization"] = tf.VariableSynchronization.ON_READ
    return next_creator(**kwargs)


def _metrics_sync_on_write(model):
    """Whether this Keras writes metric variables through on every replica.

    Keras 3.8 creates a metric's `"sum"` variables as mirrored (`ON_WRITE`)
    variables, and a metric updates them with `assign(total + value)`: under
    a strategy with several replicas each write is summed over the replicas,
    so the running totals double at each step and `fit` logs a wrong loss
    (tests/distribute_multi_worker_test.py, on the oldest pair). Keras
    creates them `ON_READ` since keras-team/keras#21072 (March 2025; 3.11
    does); the weights were never affected.
    """
    tracker = _internals.loss_tracker_of(model)
    if tracker is None or not tracker.variables:
        return False
    value = backing_variable(tracker.variables[0])
    return (
        isinstance(value, tf.distribute.DistributedValues)
        and value.synchronization != tf.VariableSynchronization.ON_READ
    )


def enable_multi_worker_fit(model):
    """Lets `model.fit` and `model.evaluate` run under MWMS (Keras 3.15).

    Call it after `model.compile` (under `strategy.scope()`), before `fit`.
    Under any other strategy (or none) it returns the model unchanged, so
    the same program runs in one process and on a cluster.

    Keras 3.15 fails twice under `MultiWorkerMirroredStrategy`: its
    `_maybe_symbolic_build` reduces a tuple of `PerReplica` batches, and its
    steps reduce scalar logs along axis 0. The model is built from this
    worker's local batch instead (`build_from_local_batch`), and the instance's
    `train_step` / `test_step` return scalars with a leading axis of 1.
    Gradients and the update are untouched. Why, and when to remove it:
    docs/guides/multi-worker.md, "The Keras workaround and when to remove it".

    Args:
        model: a compiled `keras.Model` created under the strategy's scope.

    Returns:
        The same model.

    Examples:
        ```python
        strategy = tf_lars.distribute.multi_worker_strategy()
        with strategy.scope():
            model = make_model()
            model.compile(tf_lars.LARS(1.0), "sparse_categorical_crossentropy")
        tf_lars.distribute.enable_multi_worker_fit(model)
        model.fit(dataset, epochs=2)
        ```
    """
    if not isinstance(model, keras.Model):
        raise ValueError(f"`model` must be a keras.Model. Received: model={model!r}")
    strategy = model.distribute_strategy
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return model
    build_from_local_batch(model)
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
    return _is_chief_task(config.cluster, config.task_type, config.task_index)


def _is_chief_task(cluster, task_type, task_index):
    if "chief" in cluster:
        return task_type == "chief"
    return task_type == "worker" and task_index == 0


def _start_watchdog(config, start_timeout):
    """A separate process that ends this one if the cluster does not start.

    TensorFlow waits at its start-up barrier in C++ holding the GIL, so no
    thread of this process can run meanwhile: a small Python process watches
    instead, names the tasks whose ports do not answer, and sends SIGTERM
    (then SIGKILL: TensorFlow's servers may keep SIGTERM from ending it).
    Returns the pipe's write end: write a byte once every task has joined.
    """
    import subprocess

    read_fd, write_fd = os.pipe()
    others = {
        address: f"{task_type} {index} ({address})"
        for task_type, addresses in config.cluster.items()
        for index, address in enumerate(addresses)
        if address != config.address
    }
    message = (
        f"error: {config.task_type} {config.task_index}: %s did not start within "
        f"{start_timeout:g}s; the cluster needs every worker "
        "(MultiWorkerMirroredStrategy). Start it, or fix TF_CONFIG."
    )
    subprocess.Popen(
        [sys.executable, _process.__file__, str(read_fd), str(os.getpid())]
        + [str(start_timeout), message, json.dumps(others)],
        pass_fds=(read_fd,),
        stdin=subprocess.DEVNULL,
        preexec_fn=_process.die_with_parent,
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

    Creating the strategy starts TensorFlow's coordination service, which
    takes SIGTERM from Python; this gives it back (`_keep_python_sigterm`),
    so a SIGTERM ends the program, or runs its handler, as without the
    strategy.

    Returns:
        A `tf.distribute.MultiWorkerMirroredStrategy`.

    Raises:
        TFConfigError: a malformed `TF_CONFIG`, or one with `ps` tasks.

    Examples:
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
    _keep_python_sigterm()
    # TensorFlow's Python log records would otherwise print twice from here.
    log_tensorflow_records_once()
    _join(strategy, started)
    return strategy


def _keep_python_sigterm():
    """Gives SIGTERM back to the handler Python had before the strategy.

    The strategy starts TensorFlow's coordination service, whose preemption
    notifier (TensorFlow 2.21's `SigtermNotifier`) installs a C handler for
    SIGTERM that only records it: the program's own handler (`tf-lars
    train`'s INTERRUPTED note) never ran, and without one a SIGTERM no longer
    ended the process. Setting Python's handler again puts its C handler
    back; only the main thread may (None: a handler Python did not set).
    """
    handler = signal.getsignal(signal.SIGTERM)
    if handler is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def _join(strategy, started):
    """Returns once every worker has joined; tells the watchdog, if any.

    One all-reduce across the cluster shows it, run inside a `tf.function`
    (eagerly, the strategy warns about eager collectives).
    """

    @tf.function
    def join():
        return strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), None)

    join()
    if started is not None:
        os.write(started, b"1")
        os.close(started)


# ---------------------------------------------------------- backup and restore
_BACKUP_NAME = re.compile(r"(epoch|partial)-(\d+)\.weights\.h5")
# The root attribute of a backup file that says which training wrote it.
_RECORD_ATTRIBUTE = "tf_lars_backup"
# What a worker that is not the chief receives when the chief refused a backup.
_REFUSED = -1


def _without_names(value):
    """`value` without the "name" keys (auto-numbered: "sgd_1" in a new process)."""
    if isinstance(value, dict):
        return {k: _without_names(v) for k, v in value.items() if k != "name"}
    if isinstance(value, list | tuple):
        return [_without_names(v) for v in value]
    return value


def _auto_number_free(name):
    # "sequential_1_dense_1_kernel_momentum" and "sequential_dense_kernel_momentum"
    # are one slot: layers and models are numbered in creation order.
    return re.sub(r"_\d+(?=_|$)", "", name)


def _optimizer_record(optimizer):
    """What a backup must match: class, config and variables of `optimizer`."""
    if optimizer is None:
        return {"class": None, "config": None, "variables": []}
    try:
        config = keras.saving.serialize_keras_object(optimizer)["config"]
        config = json.loads(json.dumps(_without_names(config)))
    except (TypeError, ValueError, KeyError, AttributeError, NotImplementedError):
        config = None  # no JSON config: compared by class and variables only
    variables = [
        [_auto_number_free(v.name), list(v.shape), str(v.dtype)]
        for v in optimizer.variables
    ]
    return {
        "class": keras.saving.get_registered_name(type(optimizer)),
        "config": config,
        "variables": variables,
    }


def _flat(config, prefix=""):
    if not isinstance(config, dict):
        return {prefix: config}
    flat = {}
    for key, value in config.items():
        flat.update(_flat(value, f"{prefix}{key}."))
    return {k.rstrip("."): v for k, v in flat.items()}


def _record_difference(saved, current):
    """What differs between a backup's record and this training's, or None."""
    if saved["class"] != current["class"]:
        return (
            f"the optimizer class is {saved['class']} in the backup and "
            f"{current['class']} here"
        )
    if saved["config"] is not None and current["config"] is not None:
        before, now = _flat(saved["config"]), _flat(current["config"])
        keys = sorted(
            k for k in before.keys() | now.keys() if before.get(k) != now.get(k)
        )
        if keys:
            shown = "; ".join(
                f"{k}={before.get(k)!r} in the backup, {now.get(k)!r} here"
                for k in keys[:3]
            )
            more = f" (and {len(keys) - 3} more)" if len(keys) > 3 else ""
            return f"the optimizer config differs: {shown}{more}"
    before, now = saved["variables"], current["variables"]
    if len(before) != len(now):
        return (
            f"the optimizer has {len(before)} variables in the backup and "
            f"{len(now)} here"
        )
    for index, (old, new) in enumerate(zip(before, now, strict=True)):
        if old != new:
            return (
                f"optimizer variable {index} is {old[0]} {tuple(old[1])} {old[2]} "
                f"in the backup and {new[0]} {tuple(new[1])} {new[2]} here"
            )
    return None


def _write_record(path, record):
    import h5py

    with h5py.File(path, "r+") as handle:
        handle.attrs[_RECORD_ATTRIBUTE] = json.dumps(record)


def _read_record(path):
    """The record of a backup file, or None (written by tf_lars 0.x)."""
    import h5py

    with tf.io.gfile.GFile(path, "rb") as raw, h5py.File(raw, "r") as handle:
        text = handle.attrs.get(_RECORD_ATTRIBUTE)
    return None if text is None else json.loads(text)


def _as_bits(value):
    """An int64 tensor that holds `value`'s bits (floats bit-cast).

    int64 for every dtype: one all-reduce, and not int32, which TensorFlow
    keeps in host memory on GPUs.
    """
    dtype = value.dtype
    if dtype.is_floating:
        value = tf.bitcast(value, {2: tf.int16, 4: tf.int32, 8: tf.int64}[dtype.size])
    return tf.cast(value, tf.int64)


def _from_bits(bits, dtype):
    if dtype.is_floating:
        narrow = {2: tf.int16, 4: tf.int32, 8: tf.int64}[dtype.size]
        return tf.bitcast(tf.cast(bits, narrow), dtype)
    return tf.cast(bits, dtype)


def _settle(collective):
    """Runs `collective()`, one collective more, after an agreement every
    worker acts on by stopping (a refused backup, a signal): a worker past it
    knows that every other holds the agreement, so its program may end at
    once without cutting another's read of it short (which then failed with
    `Socket closed` instead). A peer lost in this one changes nothing: the
    agreement stands."""
    with contextlib.suppress(tf.errors.OpError):
        collective()


def _broadcast_from_first_replica(strategy, values):
    """`values` as replica 0 (on the chief) holds them, on every worker.

    MWMS has no public broadcast. Replica 0 contributes the values' bits and
    every other replica zeros to one SUM all-reduce, which is exact for
    integers, so floats arrive bit for bit (-0.0 and NaN payloads included).
    """
    dtypes = [tf.as_dtype(value.dtype) for value in values]

    def contribute():
        context = tf.distribute.get_replica_context()
        first = tf.equal(context.replica_id_in_sync_group, 0)
        bits = [_as_bits(tf.convert_to_tensor(value)) for value in values]
        bits = [tf.where(first, b, tf.zeros_like(b)) for b in bits]
        return context.all_reduce(tf.distribute.ReduceOp.SUM, bits)

    summed = strategy.run(contribute)
    return [
        _from_bits(strategy.experimental_local_results(bits)[0], dtype)
        for bits, dtype in zip(summed, dtypes, strict=True)
    ]


def _unsynchronized_batch_norm_layers(model):
    """Names of the `BatchNormalization` layers without `synchronized=True`.

    Searches `model.layers`, nested models included. Under
    `MultiWorkerMirroredStrategy` each worker updates such a layer's moving
    statistics from its own part of the batch, so they differ between
    workers (the trainable weights do not).

    Args:
        model: a `keras.Model`.

    Returns:
        list of str, in layer order.
    """
    names = []
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            if not layer.synchronized:
                names.append(layer.name)
        elif isinstance(layer, keras.Model):
            names += _unsynchronized_batch_norm_layers(layer)
    return names


def _warn_unsynchronized_batch_norm(model, strategy):
    names = _unsynchronized_batch_norm_layers(model)
    if names and strategy.num_replicas_in_sync > 1:
        warnings.warn(
            f"BatchNormalization layer(s) {names} are not synchronized: each "
            "worker keeps its own moving statistics, and a restore by "
            "BackupAndRestore gives every worker the chief's. Pass "
            "`synchronized=True` so that every worker has the same statistics "
            "and a resumed job ends where an uninterrupted one does.",
            UserWarning,
            stacklevel=2,
        )


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """Backs up the training state after each epoch; resumes `fit` from it.

    A subclass of `keras.callbacks.BackupAndRestore` made safe for
    `MultiWorkerMirroredStrategy` (and usable in one process). Keras's
    callback calls `_load_model` when `fit` starts and `_save_model` after
    each epoch; this one overrides those two, and what `fit`'s end deletes:

    ```
    _save_model, chief:  model.save_weights(partial-<E>.weights.h5)  # E = epochs done
                         rename to epoch-<E>.weights.h5               # atomic
                         delete older epoch-*.weights.h5
                 others: write nothing
    _load_model:         the chief loads the newest epoch-<E> (or refuses it),
                         every worker receives its values bit for bit
                         (an all-reduce), and `fit` continues at epoch E
    ```

    What is restored (weights and every optimizer variable, not metrics or
    random state), BatchNormalization (`synchronized=True`), the data order
    an exact resume needs, and what Keras's own `_load_model` and
    `_save_model` do under MWMS: docs/guides/multi-worker.md, "Preemption:
    `BackupAndRestore`". The tests that resume and refuse backups
    (tests/distribute_preempt_test.py, tests/distribute_hostile_test.py)
    fail if a Keras release stops calling the two methods.

    Args:
        backup_dir: str. Directory of the backup, local or any path
            `tf.io.gfile` handles (`gs://...`); used by this callback only.
        delete_checkpoint: bool. Whether the chief deletes the backup when
            `fit` completes. Defaults to `True`.

    Attributes:
        restored_epoch: int. The epoch the last `fit` resumed at (0: it
            found no backup and started from the beginning).

    Examples:
        ```python
        strategy = tf_lars.distribute.multi_worker_strategy()
        with strategy.scope():
            model = make_model()
            model.compile(tf_lars.LARS(schedule), "sparse_categorical_crossentropy")
        tf_lars.distribute.enable_multi_worker_fit(model)
        backup = tf_lars.distribute.BackupAndRestore("/shared/run1/backup")
        model.fit(dataset, epochs=90, callbacks=[backup])
        ```
    """

    def __init__(self, backup_dir, delete_checkpoint=True):
        if not isinstance(backup_dir, str) or not backup_dir:
            raise ValueError(
                "`backup_dir` must be a non-empty str. "
                f"Received: backup_dir={backup_dir!r}"
            )
        if not isinstance(delete_checkpoint, bool):
            raise ValueError(
                "`delete_checkpoint` must be a bool. "
                f"Received: delete_checkpoint={delete_checkpoint!r}"
            )
        _internals.check_backup_hooks()
        super().__init__(backup_dir, delete_checkpoint=delete_checkpoint)
        self.restored_epoch = 0
        self._writes = True
        self._record = None

    def _files(self):
        """{"epoch"|"partial": [(number, path), ...] oldest first}."""
        files = {"epoch": [], "partial": []}
        if tf.io.gfile.isdir(self.backup_dir):
            for name in tf.io.gfile.listdir(self.backup_dir):
                match = _BACKUP_NAME.fullmatch(name)
                if match:
                    path = os.path.join(self.backup_dir, name)
                    files[match.group(1)].append((int(match.group(2)), path))
        return {kind: sorted(found) for kind, found in files.items()}

    def _state(self):
        variables, seen = [], set()
        optimizer = self.model.optimizer
        extra = [] if optimizer is None else optimizer.variables
        for variable in [*self.model.weights, *extra]:
            if id(variable) not in seen:
                seen.add(id(variable))
                variables.append(variable)
        return variables

    def _load_model(self):
        model = self.model
        if not model.built:
            raise ValueError(
                "BackupAndRestore needs a built model before `fit`: call it on "
                f"a batch or `build()` it first. Received: model={model!r}"
            )
        strategy = model.distribute_strategy
        if model.optimizer is not None and not model.optimizer.built:
            with strategy.scope():
                model.optimizer.build(model.trainable_variables)
        multi_worker = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        if multi_worker:
            _warn_unsynchronized_batch_norm(model, strategy)
            resolver = strategy.cluster_resolver
            cluster = resolver.cluster_spec().as_dict()
            self._writes = not cluster or _is_chief_task(
                cluster, resolver.task_type, resolver.task_id
            )
        # Taken before a backup is loaded: loading replaces the learning rate.
        self._record = _optimizer_record(model.optimizer)
        epoch, refusal = 0, None
        if self._writes:
            files = self._files()
            for _, path in files["partial"]:
                tf.io.gfile.remove(path)  # a write that was cut off
            if files["epoch"]:
                epoch, path = files["epoch"][-1]
                refusal = self._refusal(epoch, path)
                if refusal is None:
                    model.load_weights(path)
        if multi_worker:
            (epoch,) = _broadcast_from_first_replica(
                strategy, [tf.constant(_REFUSED if refusal else epoch, tf.int64)]
            )
            epoch = int(epoch)
            if epoch == _REFUSED and refusal is None:
                refusal = (
                    f"BackupAndRestore: the chief refused the backup in "
                    f"{self.backup_dir} (its error says what differs); this "
                    "worker stops too."
                )
            if epoch > 0:
                state = self._state()
                received = _broadcast_from_first_replica(strategy, state)
                for variable, value in zip(state, received, strict=True):
                    variable.assign(value)
        if refusal:
            if multi_worker:
                zero = [tf.constant(0, tf.int64)]
                _settle(lambda: _broadcast_from_first_replica(strategy, zero))
            self.restored_epoch = 0
            _internals.start_fit_at_epoch(model, None)
            raise ValueError(refusal)
        self.restored_epoch = epoch
        # Also when 0: a `fit` that raised never reached `on_train_end`.
        _internals.start_fit_at_epoch(model, epoch or None)

    def _refusal(self, epoch, path):
        """Why the backup `epoch`, `path` must not be resumed from, or None."""
        epochs = (self.params or {}).get("epochs")
        if epochs is not None and epoch > epochs:
            what = f"it is of epoch {epoch}, after this fit's last (epochs={epochs})"
        else:
            saved = _read_record(path)
            what = saved and _record_difference(saved["optimizer"], self._record)
        if not what:
            return None
        return (
            f"{type(self).__name__}: the backup {path} does not match this training: "
            f"{what}. It was not loaded and is kept; delete it (or pass another "
            "`backup_dir`) to start from the beginning."
        )

    def _save(self, partial, epochs_done):
        record = {"format": 1, "epoch": epochs_done, "optimizer": self._record}
        if "://" not in partial:
            self.model.save_weights(partial, overwrite=True)
            _write_record(partial, record)
            return
        # h5py writes local files only; Keras copies remote ones the same way.
        with tempfile.TemporaryDirectory() as local:
            path = os.path.join(local, os.path.basename(partial))
            self.model.save_weights(path)
            _write_record(path, record)
            tf.io.gfile.copy(path, partial, overwrite=True)

    def _save_model(self):
        if not self._writes:
            return
        done = _internals.epochs_done(self)
        tf.io.gfile.makedirs(self.backup_dir)
        partial = os.path.join(self.backup_dir, f"partial-{done}.weights.h5")
        final = os.path.join(self.backup_dir, f"epoch-{done}.weights.h5")
        self._save(partial, done)
        # Killed at any point, the chief leaves the previous backup or this
        # one complete, never a mix.
        tf.io.gfile.rename(partial, final, overwrite=True)
        self._written(done)
        for number, path in self._files()["epoch"]:
            if number < done:
                tf.io.gfile.remove(path)

    def _written(self, epochs_done):
        """Returns once the backup of `epochs_done` may replace the older
        ones: at once here (the chief alone writes; `DiLoCoBackup` waits for
        every worker's)."""

    def on_train_end(self, logs=None):
        # Not Keras's, which deletes all of `backup_dir`: only the backups.
        if self.restored_epoch:
            # Keras never resets it: a later `fit` would start there too.
            _internals.start_fit_at_epoch(self.model, None)
        if self._writes and self.delete_checkpoint:
            for found in self._files().values():
                for _, path in found:
                    tf.io.gfile.remove(path)
            if tf.io.gfile.isdir(self.backup_dir) and not tf.io.gfile.listdir(
                self.backup_dir
            ):
                tf.io.gfile.rmtree(self.backup_dir)
