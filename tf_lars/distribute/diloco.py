"""Synchronous DiLoCo across the workers of `MultiWorkerMirroredStrategy`.

Each worker trains its own copy of the model (created *outside*
`strategy.scope()`, so nothing is all-reduced per step) with a
`tf_lars.DiLoCo` optimizer; the strategy only carries the outer exchange.
Every `sync_every` inner steps (per fragment, with streaming) each worker
encodes its pseudo-gradient (`DiLoCo.encode`: as it is, bfloat16, or 8/4-bit
codes and scales), the workers exchange them with the collective that fits
the payload, and every worker applies the same outer step with the mean:

- Uncompressed (`compression=None`, the variables' dtype) and `"bfloat16"`:
  one SUM all-reduce per fragment (its tensors flattened into one vector),
  which `MultiWorkerMirroredStrategy` runs as a ring on CPU, then `/ M`.
  TensorFlow's CPU collectives all-reduce bfloat16 (checked on TensorFlow
  2.21 with two and four worker processes), so bfloat16 values are summed
  as bfloat16: 2 bytes a value on the wire, and every addition of the ring
  rounds to bfloat16 as well (8 significant bits). Chosen over an
  all-gather of the bfloat16 values (which would keep `simulate_sync`'s
  float32 sum) because each worker receives `M / 2` times fewer bytes
  (the same at M = 2); the price is the sum's rounding, below.
- `"int8"` and `"int4"`: codes with their scales cannot be summed; the
  payloads are all-gathered (as their bytes in int32 words, int4 codes two
  to a byte), and every worker decodes them and averages in worker order.

What the mean equals, against `tf_lars.diloco.simulate_sync` (the same
rule in one process: each payload decoded to the variable's dtype, summed
in worker order, `/ M`): every worker gets the same bits, from either
collective. int8/int4: `simulate_sync`'s mean bit for bit, for every M.
Uncompressed: bit for bit at M = 2 (the ring's one addition is `a + b`);
at M > 2 the ring adds each chunk in its own order, so the mean equals it
to float rounding (about `(M - 1) * eps * sum_m |delta_m|` an entry,
`eps = 2**-24` in float32).
bfloat16: the sum rounded to bfloat16, `bf16(a + b) / 2` at M = 2, within
bfloat16 rounding of `simulate_sync`'s float32 sum (half a bfloat16 ulp of
the sum at M = 2, `eps = 2**-8` in the bound above at M > 2); with
`error_feedback`, each worker's own rounding is carried to the next round,
the sum's is not.

- `synchronize(diloco, variables, strategy)`: the exchange, for a custom
  loop; a no-op at steps where nothing is due.
- `DiLoCoSync(strategy)`: the same after each `model.fit` batch.
- `DiLoCoBackup(backup_dir)`: each worker's whole state at each epoch end;
  a restarted job resumes at the newest epoch every worker saved.
- `Traffic`: the bytes each worker sent and received, counted from the
  collective each exchange uses (`exchange_bytes`: `all_reduce_bytes`'s
  ring, `all_gather_bytes`).

The rules, and when to choose this over an all-reduce every step or AGN:
docs/guides/low-communication.md.
"""

import os

import keras
import numpy as np
import tensorflow as tf

from tf_lars.diloco import COMPRESSIONS, DiLoCo, decode
from tf_lars.distribute import _internals
from tf_lars.distribute.multi_worker import (
    BackupAndRestore,
    _broadcast_from_first_replica,
    _optimizer_record,
    _settle,
)

__all__ = [
    "DiLoCoBackup",
    "DiLoCoSync",
    "Traffic",
    "all_gather_bytes",
    "all_reduce_bytes",
    "exchange_bytes",
    "synchronize",
]

# TensorFlow's collectives gather float16/32/64 and int32/64 only: other
# payloads (int8 codes, bfloat16) travel as their bytes in int32 words.
_GATHERED_AS_IS = (tf.float16, tf.float32, tf.float64, tf.int32, tf.int64)
# What the CPU collectives all-reduce (SUM) among the payloads `encode`
# makes (int32/64 too, but no payload is one): a one-tensor payload of these
# is summed; a payload of codes and a scale is all-gathered.
_SUMMED = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


def all_reduce_bytes(payload, workers):
    """`(sent, received)` per worker of a ring all-reduce of `payload` bytes.

    The ring's reduce-scatter and all-gather each pass `M - 1` chunks of
    `payload / M` through every worker, so each sends and receives
    `2 (M - 1) / M * payload` (what `MultiWorkerMirroredStrategy`'s ring
    all-reduce does; one worker sends nothing).

    Examples:
        >>> all_reduce_bytes(1000, 4)
        (1500.0, 1500.0)
    """
    each = 2 * (workers - 1) * payload / workers
    return each, each


def all_gather_bytes(payload, workers):
    """`(sent, received)` per worker of an all-gather of `payload` bytes
    from each worker: it sends its payload once and receives the other
    `M - 1` workers'.

    Examples:
        >>> all_gather_bytes(1000, 4)
        (1000, 3000)
    """
    return (payload if workers > 1 else 0), (workers - 1) * payload


def exchange_bytes(payloads, compression, workers):
    """The collective one exchange uses, and the bytes it moves per worker.

    The payloads of one fragment are summed with a ring all-reduce when
    each is one float tensor (`compression=None` or `"bfloat16"`): all of
    them flattened into one vector per dtype, `P` its bytes, each worker
    sends and receives `all_reduce_bytes(P, M)`, rounded to the nearest
    byte (halves up). Codes with their scales (`"int8"`, `"int4"`) are
    all-gathered: `P` is what this worker hands to the all-gather (4-bit
    codes packed two to a byte; a tensor that is not float16/32/64 or
    int32/64 travels as its bytes in int32 words, zero-padded to 4 bytes),
    and it sends and receives `all_gather_bytes(P, M)`.

    Args:
        payloads: list of payloads, one per variable of the fragment, as
            `DiLoCo.encode` returns them (each a tuple of tensors); only
            their shapes and dtypes are read.
        compression: the `DiLoCo`'s `compression`: None, `"bfloat16"`,
            `"int8"` or `"int4"` (int4 codes are int8 tensors packed two to
            a byte on the wire).
        workers: int >= 1. The number of workers M.

    Returns:
        `(collective, sent, received)`: `"all_reduce"` or `"all_gather"`,
        and this worker's bytes sent and received (ints).

    Examples:
        >>> exchange_bytes([(tf.zeros([10, 10]),), (tf.zeros([10]),)], None, 2)
        ('all_reduce', 440, 440)
        >>> exchange_bytes([(tf.zeros([100], tf.bfloat16),)], "bfloat16", 8)
        ('all_reduce', 350, 350)
        >>> codes, scale = tf_lars.diloco.quantize(tf.ones([10, 10]), 4)
        >>> exchange_bytes([(codes, scale)], "int4", 4)
        ('all_gather', 56, 168)
    """
    if compression not in COMPRESSIONS:
        raise ValueError(
            f"`compression` must be one of {list(COMPRESSIONS)}. "
            f"Received: compression={compression!r}"
        )
    if (
        not isinstance(workers, int | np.integer)
        or isinstance(workers, bool)
        or workers < 1
    ):
        raise ValueError(
            f"`workers` must be an int >= 1. Received: workers={workers!r}"
        )
    payloads = [tuple(payload) for payload in payloads]
    if _summed(payloads):
        sizes = {}
        for (tensor,) in payloads:
            dtype = tf.as_dtype(tensor.dtype)
            sizes[dtype] = sizes.get(dtype, 0) + _count(tensor.shape) * dtype.size
        sent = received = 0
        for size in sizes.values():  # one all-reduce per dtype
            out, back = all_reduce_bytes(size, int(workers))
            sent, received = sent + int(out + 0.5), received + int(back + 0.5)
        return "all_reduce", sent, received
    size = sum(
        _wire_bytes(tensor, compression == "int4" and index == 0)
        for payload in payloads
        for index, tensor in enumerate(payload)
    )
    sent, received = all_gather_bytes(size, int(workers))
    return "all_gather", int(sent), int(received)


def _summed(payloads):
    """Whether `synchronize` all-reduces these payloads (else it gathers them)."""
    return all(
        len(payload) == 1 and tf.as_dtype(payload[0].dtype) in _SUMMED
        for payload in payloads
    )


def _count(shape):
    return int(np.prod(tuple(shape), dtype=np.int64))


def _wire_bytes(tensor, packed_int4):
    """The bytes `_wire(tensor, packed_int4)` hands to the all-gather."""
    count, dtype = _count(tensor.shape), tf.as_dtype(tensor.dtype)
    if packed_int4:
        return -(-((count + 1) // 2) // 4) * 4
    if dtype in _GATHERED_AS_IS:
        return count * dtype.size
    return -(-(count * dtype.size) // 4) * 4


class Traffic:
    """Bytes one worker sent to and received from the other workers.

    Counted at each exchange from the collective it uses, on the tensors
    handed to it (`exchange_bytes`), with `P` the bytes of this worker's
    payload for the fragment and `M` the workers:

    - uncompressed and bfloat16 payloads, summed by a ring all-reduce:
      `2 (M - 1) / M * P` sent and as many received (`all_reduce_bytes`;
      `P` at 4 bytes a float32 value, 2 a bfloat16 one), rounded to the
      nearest byte;
    - int8/int4 codes with their scales, all-gathered: `P` sent (4-bit codes
      packed two to a byte, each tensor padded to whole 4-byte words) and
      the other `M - 1` workers' `(M - 1) * P` received
      (`all_gather_bytes`).

    One worker (`M = 1`) sends and receives nothing. The transport's own
    overhead (gRPC framing, headers) is not included, nor does the
    all-gather's count include the payloads a ring all-gather relays for
    other workers.

    Attributes:
        outer_steps: int. Exchanges so far (one per fragment synced).
        bytes_sent: int. Bytes this worker sent.
        bytes_received: int. Bytes this worker received.

    Examples:
        >>> traffic = Traffic()
        >>> traffic.add(*exchange_bytes([(tf.zeros([250]),)], None, 4)[1:])
        >>> traffic.as_dict()
        {'outer_steps': 1, 'bytes_sent': 1500, 'bytes_received': 1500}
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


def _all_reduce_sum(strategy, tensors):
    """Each tensor summed over the workers: one SUM all-reduce per dtype, of
    the tensors flattened into one vector (MWMS would send eager tensors
    one collective each)."""
    groups = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault(tensor.dtype, []).append(index)
    vectors = [
        tf.concat([tf.reshape(tensors[i], [-1]) for i in indices], axis=0)
        for indices in groups.values()
    ]

    def reduce(*values):
        context = tf.distribute.get_replica_context()
        return context.all_reduce(tf.distribute.ReduceOp.SUM, list(values))

    reduced = strategy.run(reduce, args=tuple(vectors))
    summed = [None] * len(tensors)
    for indices, vector in zip(groups.values(), reduced, strict=True):
        vector = strategy.experimental_local_results(vector)[0]
        parts = tf.split(vector, [_count(tensors[i].shape) for i in indices])
        for i, part in zip(indices, parts, strict=True):
            summed[i] = tf.reshape(part, tensors[i].shape)
    return summed


def _summed_mean(strategy, payloads, variables, workers):
    """The mean of one-tensor payloads: their all-reduced sum, decoded, / M."""
    totals = [tf.convert_to_tensor(payload[0]) for payload in payloads]
    if workers > 1 and totals:
        totals = _all_reduce_sum(strategy, totals)
    return [
        decode((total,), variable.dtype) / workers
        for total, variable in zip(totals, variables, strict=True)
    ]


def _gathered_mean(strategy, payloads, variables, workers, packed_int4):
    """The mean of payloads all-gathered: each worker's decoded, summed in
    worker order, / M."""
    flat, restore = [], []
    for payload in payloads:
        for index, tensor in enumerate(payload):
            wire, back = _wire(tensor, packed_int4 and index == 0)
            flat.append(wire)
            restore.append(back)
    if workers == 1:
        gathered = [w[tf.newaxis] for w in flat]
    else:
        gathered = _all_gather(strategy, flat)
    mean, position = [], 0
    for payload, variable in zip(payloads, variables, strict=True):
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
    return mean


def synchronize(diloco, variables, strategy=None, traffic=None):
    """Runs the outer exchange of every fragment due at this inner step.

    Call it after each `diloco.apply` in a custom loop (eagerly). Every
    worker must call it at the same steps (they do: the schedule depends on
    the inner-step count only). Uncompressed and bfloat16 pseudo-gradients
    are summed with one all-reduce per fragment, then divided by M; int8 and
    int4 codes are all-gathered with their scales, decoded and averaged in
    worker order (what each mean equals: the module's docstring).

    Args:
        diloco: `tf_lars.DiLoCo`, built over `variables`.
        variables: list of this worker's variables (the model's trainable
            variables, as passed to `apply`).
        strategy: `tf.distribute.MultiWorkerMirroredStrategy` with one
            replica per worker, or None (one worker: the outer step alone).
        traffic: `Traffic` or None. Adds each exchange's bytes
            (`exchange_bytes`).

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
        targets = _fragment(diloco, variables, fragment)
        collective, sent, received = exchange_bytes(
            payloads, diloco.compression, workers
        )
        if collective == "all_reduce":
            mean = _summed_mean(strategy, payloads, targets, workers)
        else:
            packed_int4 = diloco.compression == "int4"
            mean = _gathered_mean(strategy, payloads, targets, workers, packed_int4)
        diloco.outer_step(mean, variables, fragment)
        if traffic is not None:
            traffic.add(sent, received)
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
            values = _broadcast_from_first_replica(self.strategy, state)
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


class DiLoCoBackup(BackupAndRestore):
    """Each worker's whole DiLoCo state at each epoch end; resumes a restarted
    job exactly.

    A subclass of `tf_lars.distribute.BackupAndRestore` (so of Keras's),
    overriding what it loads and when an older backup may go (it saves as
    its parent does, on every worker). Each worker's state differs between
    outer steps (its own weights and inner-optimizer slots), so each writes
    its own file, `<backup_dir>/worker-<I>/epoch-<E>.weights.h5` (the model's
    weights and every optimizer variable: `theta`, the outer slots, the error
    buffers, the step count), written under another name and renamed. An
    older file is deleted only once every worker has written the new one, so
    when `fit` starts the workers agree (a MIN over them) on the newest epoch
    all of them hold, load it, and `fit` continues there. With
    `steps_per_epoch` a multiple of `sync_every`, that is the last outer step.
    As its parent, it refuses (a `ValueError` on every worker) a backup of
    another optimizer or of an epoch after the `fit`'s last, and keeps it.
    The backups are kept when `fit` ends.

    Args:
        backup_dir: str. The job's backup directory (shared or not: each
            worker uses its own subdirectory, its `backup_dir` attribute).
        strategy: `tf.distribute.MultiWorkerMirroredStrategy` or None (one
            worker).
        worker_index: int. This worker's index. Defaults to the strategy's
            task index (0 without one).

    Attributes:
        restored_epoch: int. The epoch the last `fit` resumed at (0: none).
    """

    def __init__(self, backup_dir, strategy=None, worker_index=None):
        super().__init__(backup_dir, delete_checkpoint=False)
        _workers(strategy)
        if worker_index is None:
            resolver = strategy.cluster_resolver if strategy is not None else None
            worker_index = int(resolver.task_id or 0) if resolver else 0
        self.strategy = strategy
        self.backup_dir = os.path.join(backup_dir, f"worker-{worker_index}")

    def _agreed(self, value):
        """The MIN of `value` over the workers."""
        if self.strategy is None:
            return value

        (values,) = _all_gather(self.strategy, [tf.constant(value, tf.int64)])
        return int(tf.reduce_min(values))  # no MIN among MWMS's reductions

    def _load_model(self):
        model = self.model
        _check_diloco(model.optimizer, "model.optimizer")
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        # Taken before a backup is loaded: loading replaces the learning rate.
        self._record = _optimizer_record(model.optimizer)
        epochs = dict(self._files()["epoch"])
        epoch = self._agreed(max(epochs, default=0))
        if epoch and epoch not in epochs:
            raise ValueError(
                f"DiLoCoBackup: the workers agreed on epoch {epoch}, which "
                f"{self.backup_dir} does not hold (it has {sorted(epochs)})."
            )
        if epoch:
            # The parent's refusal (another optimizer, a later epoch), agreed:
            # a worker that raised alone would leave the others waiting.
            refusal = self._refusal(epoch, epochs[epoch])
            if not self._agreed(int(refusal is None)):
                _settle(lambda: self._agreed(0))
                _internals.start_fit_at_epoch(model, None)
                raise ValueError(
                    refusal
                    or f"DiLoCoBackup: another worker refused its backup of epoch "
                    f"{epoch} (its error says what differs); this worker stops too."
                )
            model.load_weights(epochs[epoch])
        self.restored_epoch = epoch
        _internals.start_fit_at_epoch(model, epoch or None)

    def _written(self, epochs_done):
        # The parent's `_save_model` (every worker writes its own file) keeps
        # the older backups until every worker has written this one.
        self._agreed(epochs_done)
