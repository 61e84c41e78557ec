"""Synchronous DiLoCo across the workers of `MultiWorkerMirroredStrategy`.

Each worker trains its own copy of the model (created *outside*
`strategy.scope()`, so nothing is all-reduced per step) with a
`tf_lars.DiLoCo` optimizer; the strategy only carries the outer exchange.
Every `sync_every` inner steps (per fragment, with streaming) each worker
encodes its pseudo-gradient (`DiLoCo.encode`: as it is, bfloat16, or 8/4-bit
codes and scales), the payloads are all-gathered, every worker decodes them
and averages in worker order, and applies the same outer step. The
all-gather makes the mean the one `tf_lars.diloco.simulate_sync` computes,
bit for bit, and lets compressed codes travel as they are.

- `synchronize(diloco, variables, strategy)`: the exchange, for a custom
  loop; a no-op at steps where nothing is due.
- `DiLoCoSync(strategy)`: the same after each `model.fit` batch.
- `DiLoCoBackup(backup_dir)`: each worker's whole state at each epoch end;
  a restarted job resumes at the newest epoch every worker saved.
- `Traffic`: the bytes each worker sent and received, counted from the
  tensors handed to the collective.

The rules, and when to choose this over an all-reduce every step or AGN:
docs/guides/low-communication.md.
"""

import os
import re

import keras
import numpy as np
import tensorflow as tf

from tf_lars.diloco import DiLoCo, decode
from tf_lars.distribute import _internals

__all__ = ["DiLoCoBackup", "DiLoCoSync", "Traffic", "synchronize"]

# TensorFlow's collectives gather float16/32/64 and int32/64 only: other
# payloads (int8 codes, bfloat16) travel as their bytes in int32 words.
_GATHERED_AS_IS = (tf.float16, tf.float32, tf.float64, tf.int32, tf.int64)


class Traffic:
    """Bytes one worker sent to and received from the other workers.

    Counted from the tensors each exchange hands to the collective: a worker
    sends its payload (the encoded pseudo-gradient, 4-bit codes packed two
    to a byte, padded to whole 4-byte words) and receives the other `M - 1`
    workers' payloads. The transport's own overhead (gRPC framing, the
    collective's relaying) is not included.

    Attributes:
        outer_steps: int. Exchanges so far (one per fragment synced).
        bytes_sent: int. Bytes this worker sent.
        bytes_received: int. Bytes this worker received.
    """

    def __init__(self):
        self.outer_steps = 0
        self.bytes_sent = 0
        self.bytes_received = 0

    def add(self, sent, received):
        self.outer_steps += 1
        self.bytes_sent += int(sent)
        self.bytes_received += int(received)

    def as_dict(self):
        return {
            "outer_steps": self.outer_steps,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
        }


def _check_diloco(diloco, argument="diloco"):
    if not isinstance(diloco, DiLoCo):
        raise ValueError(
            f"`{argument}` must be a `tf_lars.DiLoCo`. Received: {argument}={diloco!r}"
        )


def _workers(strategy):
    if strategy is None:
        return 1
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        raise ValueError(
            "`strategy` must be a `tf.distribute.MultiWorkerMirroredStrategy` "
            f"(or None: one worker). Received: strategy={strategy!r}"
        )
    devices = strategy.extended.worker_devices
    if len(devices) != 1:
        raise ValueError(
            "DiLoCo runs one replica per worker process; this worker has "
            f"{len(devices)} devices in the strategy. Received: {devices!r}"
        )
    return strategy.num_replicas_in_sync


def _pack_nibbles(codes):
    """int4 codes in [-7, 7] (int8), two to a byte."""
    flat = tf.reshape(codes, [-1])
    flat = tf.pad(flat, [[0, tf.size(flat) % 2]])
    nibbles = tf.bitwise.bitwise_and(tf.cast(flat, tf.uint8), 0x0F)
    pairs = tf.reshape(nibbles, [-1, 2])
    return tf.bitwise.bitwise_or(pairs[:, 0], tf.bitwise.left_shift(pairs[:, 1], 4))


def _unpack_nibbles(packed, shape):
    low = tf.bitwise.bitwise_and(packed, 0x0F)
    high = tf.bitwise.right_shift(packed, 4)
    nibbles = tf.cast(tf.reshape(tf.stack([low, high], axis=1), [-1]), tf.int8)
    values = tf.where(nibbles > 7, nibbles - 16, nibbles)
    return tf.reshape(values[: int(np.prod(shape, dtype=np.int64))], shape)


def _to_words(tensor):
    """`tensor`'s bytes as int32 words (zero-padded)."""
    data = tf.reshape(tf.bitcast(tensor, tf.uint8), [-1])
    data = tf.pad(data, [[0, (-tf.size(data)) % 4]])
    return tf.bitcast(tf.reshape(data, [-1, 4]), tf.int32)


def _from_words(words, dtype, shape):
    data = tf.reshape(tf.bitcast(words, tf.uint8), [-1])
    count = int(np.prod(shape, dtype=np.int64)) * dtype.size
    data = data[:count]
    if dtype.size > 1:
        data = tf.reshape(data, [-1, dtype.size])
    return tf.reshape(tf.bitcast(data, dtype), shape)


def _wire(tensor, packed_int4):
    """(what travels, how to get the tensor back from it)."""
    tensor = tf.convert_to_tensor(tensor)
    shape, dtype = tensor.shape, tensor.dtype
    if packed_int4:
        words = _to_words(_pack_nibbles(tensor))
        packed_shape = [(int(np.prod(shape, dtype=np.int64)) + 1) // 2]
        return words, lambda w: _unpack_nibbles(
            _from_words(w, tf.uint8, packed_shape), shape
        )
    if dtype in _GATHERED_AS_IS:
        return tensor, lambda w: w
    return _to_words(tensor), lambda w: _from_words(w, dtype, shape)


def _all_gather(strategy, tensors):
    """Each tensor stacked over the workers, in worker order: `(M, ...)`."""

    def gather(*values):
        context = tf.distribute.get_replica_context()
        return [context.all_gather(v[tf.newaxis], axis=0) for v in values]

    gathered = strategy.run(gather, args=tuple(tensors))
    return [strategy.experimental_local_results(g)[0] for g in gathered]


def synchronize(diloco, variables, strategy=None, traffic=None):
    """Runs the outer exchange of every fragment due at this inner step.

    Call it after each `diloco.apply` in a custom loop (eagerly). Every
    worker must call it at the same steps (they do: the schedule depends on
    the inner-step count only).

    Args:
        diloco: `tf_lars.DiLoCo`, built over `variables`.
        variables: list of this worker's variables (the model's trainable
            variables, as passed to `apply`).
        strategy: `tf.distribute.MultiWorkerMirroredStrategy` with one
            replica per worker, or None (one worker: the outer step alone).
        traffic: `Traffic` or None. Adds each exchange's bytes.

    Returns:
        The fragments synced (an empty list when none was due).

    Examples:
        ```python
        for x, y in dataset:                      # this worker's shard
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            diloco.apply(grads, model.trainable_variables)
            synchronize(diloco, model.trainable_variables, strategy, traffic)
        ```
    """
    _check_diloco(diloco)
    workers = _workers(strategy)
    diloco.take_over_exchange("synchronize")
    due = diloco.due_fragments()
    for fragment in due:
        payloads = diloco.encode(diloco.pseudo_gradient(variables, fragment), fragment)
        packed_int4 = diloco.compression == "int4"
        flat, restore = [], []
        for payload in payloads:
            for index, tensor in enumerate(payload):
                wire, back = _wire(tensor, packed_int4 and index == 0)
                flat.append(wire)
                restore.append(back)
        sent = sum(int(np.prod(w.shape)) * w.dtype.size for w in flat)
        if workers == 1:
            gathered = [w[tf.newaxis] for w in flat]
        else:
            gathered = _all_gather(strategy, flat)
        mean, position = [], 0
        for payload, variable in zip(payloads, _fragment(diloco, variables, fragment)):
            parts = gathered[position : position + len(payload)]
            backs = restore[position : position + len(payload)]
            position += len(payload)
            decoded = [
                decode(
                    [back(part[m]) for back, part in zip(backs, parts, strict=True)],
                    variable.dtype,
                )
                for m in range(workers)
            ]
            mean.append(tf.reduce_sum(tf.stack(decoded), axis=0) / workers)
        diloco.outer_step(mean, variables, fragment)
        if traffic is not None:
            traffic.add(sent, sent * (workers - 1))
    return due


def _fragment(diloco, variables, fragment):
    variables = list(variables)
    return [variables[i] for i in diloco._indices(fragment)]


class DiLoCoSync(keras.callbacks.Callback):
    """Runs `synchronize` after each `model.fit` batch.

    Compile each worker's model (built outside `strategy.scope()`) with a
    `tf_lars.DiLoCo`; feed each worker its own shard. When training begins
    from scratch (no inner step taken yet), every worker takes worker 0's
    initial weights, so all start from one `theta`.

    Args:
        strategy: `tf.distribute.MultiWorkerMirroredStrategy` (one replica
            per worker), or None for one worker.

    Attributes:
        traffic: `Traffic`, the bytes of this worker's exchanges.

    Examples:
        ```python
        strategy = tf_lars.distribute.multi_worker_strategy()
        model = make_model()                       # not under strategy.scope()
        model.compile(tf_lars.DiLoCo(keras.optimizers.AdamW(1e-3), sync_every=50),
                      "sparse_categorical_crossentropy")
        sync = tf_lars.distribute.DiLoCoSync(strategy)
        model.fit(this_workers_shard, epochs=10, callbacks=[sync])
        print(sync.traffic.as_dict())
        ```
    """

    def __init__(self, strategy=None):
        super().__init__()
        _workers(strategy)
        self.strategy = strategy
        self.traffic = Traffic()

    def on_train_begin(self, logs=None):
        model = self.model
        _check_diloco(model.optimizer, "model.optimizer")
        if int(getattr(model, "steps_per_execution", 1) or 1) != 1:
            raise ValueError(
                "DiLoCoSync needs `steps_per_execution=1` (it syncs between "
                "steps). Received: steps_per_execution="
                f"{model.steps_per_execution!r}"
            )
        optimizer = model.optimizer
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        # No step of this `fit` has run: every round of it is this
        # callback's (earlier ones, if any, were whoever's took them).
        self._exchange = optimizer.exchange
        if optimizer.exchange == "local":
            optimizer.exchange = "external"
            # A step traced by an earlier `fit` took the outer step itself.
            model.make_train_function(force=True)
        if self.strategy is not None and int(optimizer.iterations.numpy()) == 0:
            state = [*model.weights, *optimizer.global_variables]
            values = _from_first_worker(self.strategy, state)
            for variable, value in zip(state, values, strict=True):
                variable.assign(value)

    def on_train_end(self, logs=None):
        # A model saved after this `fit` and trained alone is one worker.
        if self._exchange != self.model.optimizer.exchange:
            self.model.optimizer.exchange = self._exchange
            self.model.make_train_function(force=True)

    def on_train_batch_end(self, batch, logs=None):
        synchronize(
            self.model.optimizer,
            self.model.trainable_variables,
            self.strategy,
            self.traffic,
        )


def _from_first_worker(strategy, variables):
    from tf_lars.distribute.multi_worker import _broadcast_from_first_replica

    return _broadcast_from_first_replica(strategy, variables)


_BACKUP = re.compile(r"(epoch|partial)-(\d+)\.weights\.h5")


class DiLoCoBackup(keras.callbacks.Callback):
    """Each worker's whole DiLoCo state at each epoch end; resumes a restarted
    job exactly.

    Each worker's state differs between outer steps (its own weights and
    inner-optimizer slots), so each writes its own file,
    `<backup_dir>/worker-<I>/epoch-<E>.weights.h5` (the model's weights and
    every optimizer variable: `theta`, the outer slots, the error buffers,
    the step count), written under another name and renamed. An older file
    is deleted only once every worker has written the new one, so when `fit`
    starts the workers agree (a MIN over them) on the newest epoch all of
    them hold, load it, and `fit` continues there. With `steps_per_epoch` a
    multiple of `sync_every`, that is the last outer step.

    Args:
        backup_dir: str. The job's backup directory (shared or not: each
            worker uses its own subdirectory).
        strategy: `tf.distribute.MultiWorkerMirroredStrategy` or None (one
            worker).
        worker_index: int. This worker's index. Defaults to the strategy's
            task index (0 without one).

    Attributes:
        restored_epoch: int. The epoch the last `fit` resumed at (0: none).
    """

    def __init__(self, backup_dir, strategy=None, worker_index=None):
        super().__init__()
        if not isinstance(backup_dir, str) or not backup_dir:
            raise ValueError(
                "`backup_dir` must be a non-empty str. "
                f"Received: backup_dir={backup_dir!r}"
            )
        _workers(strategy)
        if worker_index is None:
            resolver = strategy.cluster_resolver if strategy is not None else None
            worker_index = int(resolver.task_id or 0) if resolver else 0
        self.strategy = strategy
        self.folder = os.path.join(backup_dir, f"worker-{worker_index}")
        self.restored_epoch = 0

    def _epochs(self):
        found = {}
        if tf.io.gfile.isdir(self.folder):
            for name in tf.io.gfile.listdir(self.folder):
                match = _BACKUP.fullmatch(name)
                if match and match.group(1) == "epoch":
                    found[int(match.group(2))] = os.path.join(self.folder, name)
        return found

    def _agreed(self, value):
        """The MIN of `value` over the workers."""
        if self.strategy is None:
            return value

        (values,) = _all_gather(self.strategy, [tf.constant(value, tf.int64)])
        return int(tf.reduce_min(values))  # no MIN among MWMS's reductions

    def on_train_begin(self, logs=None):
        model = self.model
        _check_diloco(model.optimizer, "model.optimizer")
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        epochs = self._epochs()
        epoch = self._agreed(max(epochs, default=0))
        if epoch and epoch not in epochs:
            raise ValueError(
                f"DiLoCoBackup: the workers agreed on epoch {epoch}, which "
                f"{self.folder} does not hold (it has {sorted(epochs)})."
            )
        if epoch:
            model.load_weights(epochs[epoch])
        self.restored_epoch = epoch
        _internals.start_fit_at_epoch(model, epoch or None)

    def on_epoch_end(self, epoch, logs=None):
        done = epoch + 1
        tf.io.gfile.makedirs(self.folder)
        partial = os.path.join(self.folder, f"partial-{done}.weights.h5")
        self.model.save_weights(partial, overwrite=True)
        tf.io.gfile.rename(
            partial, os.path.join(self.folder, f"epoch-{done}.weights.h5"), True
        )
        self._agreed(done)  # every worker has written epoch `done`
        for number, path in self._epochs().items():
            if number < done:
                tf.io.gfile.remove(path)

    def on_train_end(self, logs=None):
        if self.restored_epoch:
            _internals.start_fit_at_epoch(self.model, None)
