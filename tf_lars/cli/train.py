"""`tf-lars train`, and the one training run it shares with `tf-lars study`.

`tf-lars train` and every trial of `tf-lars study` go through
`trial_from_config` (seed, model, the optimizer built once from its checked
block, its learning rate resolved for the global batch) and `fit_once`, so
the two commands train exactly the same way (`fit_config` is the study's
call). `run` is the `train` command, one pass: distribution and batch,
`trial_from_config`, `fit_once`, then the run folder's files.

`train` also runs distributed (the `distribute` block): `make_distribution`
creates the strategy, `training.batch_size` is per replica, and the global
batch (per-replica batch x replicas) is what the dataset is batched at, what
sets the steps per epoch and what the learning rate is linearly scaled by.
Only the chief writes the run folder. On parameter servers the chief trains
alone (`_train_parameter_server`: AGN rounds on the workers, an epoch at a
time) and the other tasks serve.
"""

import collections
import contextlib
import json
import math
import os
import time

import keras
import numpy as np
import tensorflow as tf

import tf_lars
from tf_lars.callbacks import TrustRatioMonitor
from tf_lars.cli.config import (
    ConfigError,
    build_optimizer,
    constructor_parameters,
    default_config,
    dump_config,
    one_line,
    optimizer_spec,
)
from tf_lars.cli.main import deferred, pending_signal, raise_pending, run_finished
from tf_lars.cli.preflight import (
    INTERRUPTED_NOTE,
    check_distribute,
    check_model_input,
    check_warmup,
    claim_run_dir,
    interruption_name,
    open_run_dir,
    resolve_batch_size,
    strict_json,
    write_file,
    write_text,
)
from tf_lars.distribute.launch import RESTART_ENV
from tf_lars.schedules import WarmupPolynomialDecay, linear_scaled_learning_rate


def global_batch_size(batch_size, num_train, replicas, key="training.batch_size"):
    """The per-replica and global batch sizes of a run on `replicas` replicas.

    `batch_size` is per replica; the global batch is `batch_size * replicas`
    and must fit in the training set. `"full"` makes the whole training set
    the global batch, which must then divide by `replicas`.
    """
    if replicas == 1:
        size = resolve_batch_size(batch_size, num_train, key)
        return size, size
    if batch_size == "full":
        if num_train % replicas:
            raise ConfigError(
                f"`{key}`=full makes the whole training set ({num_train} examples) "
                f"the global batch, which must divide by the {replicas} replicas; "
                f"give the batch per replica as an int instead. Received: "
                f"{key}='full'"
            )
        return num_train // replicas, num_train
    if batch_size * replicas > num_train:
        raise ConfigError(
            f"`{key}` is per replica: the global batch {batch_size} x {replicas} "
            f"replicas must be at most the training set size ({num_train}), so "
            f"`{key}` at most {num_train // replicas} or 'full'. "
            f"Received: {key}={batch_size!r}"
        )
    return batch_size, batch_size * replicas


def describe_batches(per_replica, global_batch, replicas, num_train):
    """One line: steps per epoch, the batch split, the examples dropped."""
    steps = num_train // global_batch
    dropped = num_train - steps * global_batch
    line = (
        f"Batches: {steps} step{'s' if steps != 1 else ''} per epoch of "
        f"{global_batch} examples"
    )
    if replicas > 1:
        line += f" ({per_replica} per replica x {replicas} replicas)"
    if dropped:
        line += (
            f"; {dropped} of the {num_train} training examples do not fill a "
            "batch and are dropped each epoch (different ones each epoch: the "
            "data is reshuffled)"
        )
    return line


# ------------------------------------------------------------ distribution
Distribution = collections.namedtuple(
    "Distribution",
    "strategy name replicas workers chief task exchange rank coordinator",
    defaults=(None, 0, None),
)
Distribution.__doc__ = """The strategy of a run and this process's place in it.

`strategy` is None for `none` and `diloco` (whose model is each worker's
own); `workers` counts processes (1 unless `multi_worker` or `diloco`);
`chief` says whether this process writes the run folder; `task` is this
process's task (e.g. "worker 1") in a cluster, else None; `exchange` is
`diloco`'s `MultiWorkerMirroredStrategy` (it carries the outer exchange
only) and `rank` this worker's place in it (its shard); `coordinator` is
`parameter_server`'s `ClusterCoordinator` (on the chief, the one process
that trains there: `replicas` and `workers` count the cluster's workers).
"""


def split_cpu(count):
    """Splits the CPU into `count` logical devices; returns their names."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * count
        )
    except RuntimeError:
        have = len(tf.config.list_logical_devices("CPU"))
        raise ConfigError(
            "`distribute.logical_cpus` must be set before TensorFlow initializes "
            f"its devices, and this process already has {have} CPU device(s); run "
            f"`tf-lars train` in a new process. Received: distribute.logical_cpus="
            f"{count}"
        ) from None
    return [device.name for device in tf.config.list_logical_devices("CPU")]


def make_distribution(distribute_config):
    """Creates the strategy of a `distribute` block.

    Call it before anything else uses TensorFlow devices: `logical_cpus`
    can only split the CPU before TensorFlow initializes it.

    - none: no strategy (one device, as without the block).
    - mirrored: `tf.distribute.MirroredStrategy` over every local GPU (the
      CPU when there is none), or over `logical_cpus` CPU devices.
    - multi_worker: `tf_lars.distribute.multi_worker_strategy()`, which
      validates `TF_CONFIG` before any server starts and waits for every
      worker; the chief is `tf_lars.distribute.is_chief`'s.
    - diloco: the same cluster; the strategy carries the outer exchange.
    - parameter_server: `ParameterServerStrategy` on the chief; a worker or
      parameter-server task serves here until it is stopped (never returns).
    """
    check_distribute(distribute_config)
    name = distribute_config["strategy"]
    if name == "none":
        return Distribution(None, name, 1, 1, True, None)
    if name == "mirrored":
        devices = None
        if distribute_config["logical_cpus"] is not None:
            devices = split_cpu(distribute_config["logical_cpus"])
        strategy = tf.distribute.MirroredStrategy(devices)
        return Distribution(
            strategy, name, strategy.num_replicas_in_sync, 1, True, None
        )
    from tf_lars import distribute

    if name == "parameter_server":
        tf_config = distribute.parse_tf_config(mode="ps")
        if tf_config.task_type != "chief":
            distribute.serve(tf_config)  # until the launcher stops the task
        strategy, coordinator = distribute.connect(tf_config)
        workers = tf_config.num_workers
        return Distribution(
            strategy, name, workers, workers, True, "chief 0", coordinator=coordinator
        )
    tf_config = distribute.parse_tf_config(mode="sync")
    strategy = distribute.multi_worker_strategy(tf_config)
    chiefs = len(tf_config.cluster.get("chief", []))
    workers = chiefs + tf_config.num_workers
    chief = distribute.is_chief(tf_config)
    task = f"{tf_config.task_type} {tf_config.task_index}"
    if name == "diloco":
        rank = 0 if tf_config.task_type == "chief" else chiefs + tf_config.task_index
        return Distribution(None, name, 1, workers, chief, task, strategy, rank)
    replicas = strategy.num_replicas_in_sync
    return Distribution(strategy, name, replicas, workers, chief, task)


def _scope(strategy):
    return contextlib.nullcontext() if strategy is None else strategy.scope()


def build_model(model_config, input_shape, num_classes):
    """The CLI's model: a small CNN for images, or an MLP for anything.

    `cnn`: conv(w) -> conv(w) -> max-pool -> conv(2w) -> global average pool
    -> dense logits, ReLU, `same` padding; it takes `(H, W)` or `(H, W, C)`
    examples. `mlp`: flatten -> dense(w) -> dense(w) -> dense logits. The
    logits layer computes in float32 under a mixed-precision policy.
    """
    check_model_input(model_config, input_shape)
    width = model_config["width"]
    inputs = keras.Input(shape=input_shape, name="inputs")
    x = inputs
    if model_config["name"] == "cnn":
        if len(input_shape) == 2:
            x = keras.layers.Reshape((*input_shape, 1), name="add_channel")(x)
        for index, filters in enumerate((width, width, 2 * width), 1):
            if index == 3:
                x = keras.layers.MaxPooling2D(2, name="pool")(x)
            x = keras.layers.Conv2D(
                filters, 3, padding="same", activation="relu", name=f"conv{index}"
            )(x)
        x = keras.layers.GlobalAveragePooling2D(name="global_pool")(x)
    else:
        x = keras.layers.Flatten(name="flatten")(x)
        for index in (1, 2):
            x = keras.layers.Dense(width, activation="relu", name=f"dense{index}")(x)
    outputs = keras.layers.Dense(num_classes, dtype="float32", name="logits")(x)
    return keras.Model(inputs, outputs, name=model_config["name"])


def _shard_by_data(dataset):
    # Under a strategy each replica takes its slice of every global batch
    # (files cannot be sharded: the data is in memory).
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    return dataset.with_options(options)


def _without_autotuning(dataset):
    """`dataset` with tf.data's autotuning off.

    An autotuned iterator runs a tuning thread that its destructor waits
    for. A `fit` or `evaluate` that ends leaves its iterator to Python's
    collector, which frees it at some later allocation, and there the wait
    took 20 to 80 s of no CPU (seen in `tf-lars study`'s worker processes
    with py-spy: ~RootDataset::Iterator waiting on its thread, under the
    collector, in the middle of the next trial's tracing). Arrays in memory
    need no tuning: a fixed prefetch of 2 batches, and `evaluate` reads a
    dataset built here rather than one Keras builds, autotuned, from arrays.
    """
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def make_dataset(x, y, batch_size, seed):
    """Shuffled every epoch, fixed batch size (the remainder is dropped)."""
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    dataset = dataset.shuffle(len(x), seed=seed, reshuffle_each_iteration=True)
    dataset = dataset.batch(batch_size, drop_remainder=True).prefetch(2)
    return _without_autotuning(dataset)


# Keras 3.15's `fit` makes two iterators of a dataset of known length per
# epoch: one that the epoch trains on and, when the epoch ends, one that the
# next epoch does not use. `make_dataset` shuffles anew for each iterator, so
# epoch k trains on its (2k - 1)-th shuffle.
# `tests/cli_distribute_test.py` checks this against `fit`.
ITERATORS_PER_EPOCH = 2


def epoch_orders(num_examples, epochs, seed):
    """The example order of each epoch `fit` takes from `make_dataset`.

    The same shuffles as `make_dataset`'s, drawn in advance.
    """
    order = tf.data.Dataset.range(num_examples)
    order = order.shuffle(num_examples, seed=seed, reshuffle_each_iteration=True)
    order = order.batch(num_examples)
    shuffles = [next(iter(order)).numpy() for _ in range(epochs * ITERATORS_PER_EPOCH)]
    return np.stack(shuffles[::ITERATORS_PER_EPOCH])


def make_distributed_dataset(x, y, global_batch, seed, epochs):
    """`make_dataset`'s batches for a strategy: every epoch in one stream.

    Under a strategy Keras's `fit` first takes a batch from an iterator of
    its own (to build the model), so with `make_dataset` every epoch would
    train on a later shuffle than in one process. Here the orders are drawn
    up front (`epoch_orders`): the batches are those of a one-process run
    whatever iterators Keras makes, and `fit` reads them with
    `steps_per_epoch`. Each replica takes its slice of every global batch.
    """
    steps = len(x) // global_batch
    orders = epoch_orders(len(x), epochs, seed)[:, : steps * global_batch]
    orders = orders.astype(np.int32)
    features, labels = tf.constant(x), tf.constant(y)
    dataset = tf.data.Dataset.from_tensor_slices(orders.reshape(-1))
    dataset = dataset.batch(global_batch, drop_remainder=True).map(
        lambda index: (tf.gather(features, index), tf.gather(labels, index))
    )
    return _shard_by_data(dataset).prefetch(tf.data.AUTOTUNE), steps


EVALUATION_BATCH_SIZE = 1024


def evaluation_batch_size(num_examples, replicas, name="data"):
    """The batch size `evaluate` takes under a strategy of `replicas` replicas.

    At most `EVALUATION_BATCH_SIZE`, and a multiple of `replicas`: Keras
    averages the replicas' slices of the first batch to learn its shapes
    (`MirroredStrategy`), so that batch must split evenly. The last batch may
    split unevenly but must give every replica an example: TensorFlow's CPU
    convolutions fail on an empty slice.
    """
    if num_examples < replicas:
        raise ConfigError(
            f"`distribute`: evaluating on {replicas} replicas needs at least one "
            f"example per replica; the {name} has {num_examples}"
        )
    size = min(EVALUATION_BATCH_SIZE, num_examples)
    size -= size % replicas
    while size > replicas and 0 < num_examples % size < replicas:
        size -= replicas
    return size


def _evaluation_data(x, y, strategy):
    """`evaluate` arguments: a dataset of the arrays in batches of
    `EVALUATION_BATCH_SIZE` (split between the replicas under a strategy)."""
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    if strategy is None:
        return {"x": _without_autotuning(dataset.batch(EVALUATION_BATCH_SIZE))}
    batch_size = evaluation_batch_size(len(x), strategy.num_replicas_in_sync)
    return {"x": _shard_by_data(dataset.batch(batch_size))}


def build_schedule(schedule_config, peak_learning_rate, steps_per_epoch, epochs):
    """`WarmupPolynomialDecay` over the whole run, and its step counts."""
    warmup_steps = check_warmup(schedule_config, steps_per_epoch, epochs)
    decay_steps = steps_per_epoch * epochs - warmup_steps
    try:
        schedule = WarmupPolynomialDecay(
            peak_learning_rate=peak_learning_rate,
            warmup_steps=warmup_steps,
            decay_steps=decay_steps,
            end_learning_rate=schedule_config["end_learning_rate"],
            power=schedule_config["power"],
        )
    except ValueError as error:
        raise ConfigError(f"schedule: {one_line(error)}") from None
    return schedule


def wrap_loss_scale(optimizer, loss_scale_config):
    """Wraps `optimizer` in `tf_lars.LossScaleOptimizer` as configured."""
    try:
        return tf_lars.LossScaleOptimizer(
            optimizer,
            initial_scale=loss_scale_config["initial_scale"],
            dynamic=loss_scale_config["dynamic"],
            dynamic_growth_steps=loss_scale_config["dynamic_growth_steps"],
        )
    except ValueError as error:
        raise ConfigError(f"loss_scale: {one_line(error)}") from None


class _StopOnNonFinite(keras.callbacks.Callback):
    """Stops at the first non-finite training loss and remembers the epoch.

    Not `keras.callbacks.TerminateOnNaN`, which stops the same way but
    prints a line at every stop (into `tf-lars study`'s progress, from its
    workers) and keeps no epoch.
    """

    def __init__(self):
        super().__init__()
        self.diverged_epoch = None

    def on_train_batch_end(self, batch, logs=None):
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(float(loss)):
            self.diverged_epoch = self._epoch
            self.model.stop_training = True

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch


class _RaiseInterrupts(keras.callbacks.Callback):
    """Raises a Ctrl-C or SIGTERM that came during a step, between steps.

    Inside `fit_once` the command line holds signals back
    (`tf_lars.cli.main.deferred`); this is the safe point where they are
    raised, out of `fit` as from any callback.

    On a cluster (`cluster`: `multi_worker`'s strategy or `diloco`'s
    exchange) a worker that stopped alone would leave the others waiting in
    their next collective, so the workers agree first: every `every`
    batches and at each epoch end one all-reduce of each worker's pending
    signal (two integers), and a signal any worker holds is raised on every
    worker at that step. `multi_worker` agrees at every step (it all-reduces
    the gradients at every step anyway); `diloco` once per `sync_every`
    steps, so that its workers still meet only about once per outer step.
    Validation batches are not checked on a cluster (the epoch end is).
    """

    def __init__(self, cluster=None, every=1):
        super().__init__()
        self.every, self._batches = every, 0
        self.agree = None if cluster is None else _signal_agreement(cluster)

    def _check(self):
        if self.agree is None:
            raise_pending()
        else:
            # Never this worker's signal alone: one that came after the
            # all-reduce read it waits for the next agreement.
            signum = self.agree(pending_signal())
            if signum:
                raise_pending(signum)

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        if self._batches % self.every == 0:
            self._check()

    def on_test_batch_end(self, batch, logs=None):
        if self.agree is None:
            raise_pending()

    on_predict_batch_end = on_test_batch_end

    def on_epoch_end(self, epoch, logs=None):
        self._check()


def _signal_agreement(strategy):
    """`agree(signum)`: the signal any worker of `strategy`'s cluster holds
    (SIGTERM first, then SIGINT), given this worker's (or None); the same on
    every worker, which must all call it at the same step."""
    import signal

    from tf_lars.distribute.multi_worker import _settle

    @tf.function
    def summed(flags):
        return strategy.reduce("SUM", strategy.run(lambda: flags), axis=None)

    def agree(signum):
        flags = [int(signum == signal.SIGTERM), int(signum == signal.SIGINT)]
        term, interrupt = summed(tf.constant(flags, tf.int64)).numpy()
        if term or interrupt:  # every worker stops: one collective more first
            _settle(lambda: summed(tf.zeros([2], tf.int64)))
        return signal.SIGTERM if term else signal.SIGINT if interrupt else None

    return agree


@contextlib.contextmanager
def _dtype_policy(precision):
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(precision)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def build_trial(
    data,
    *,
    model_config,
    optimizer,
    learning_rate,
    batch_size,
    seed,
    precision="float32",
    loss_scale_config=None,
    strategy=None,
):
    """Seeds Keras, then builds the model and the optimizer of one run."""
    keras.utils.set_random_seed(seed)
    scaled = loss_scale_config is not None and loss_scale_config["enabled"]
    with _dtype_policy(precision), _scope(strategy):
        model = build_model(model_config, data.x_train.shape[1:], data.num_classes)
        built = build_optimizer(optimizer, learning_rate)
        if scaled:
            built = wrap_loss_scale(built, loss_scale_config)
    return {
        "model": model,
        "optimizer": built,
        "learning_rate": learning_rate,
        "batch_size": batch_size,
        "steps_per_epoch": len(data.x_train) // batch_size,
        "precision": precision,
        "loss_scaled": scaled,
        "seed": seed,
    }


def _fit_inputs(data, trial, batch_size, epochs, strategy):
    """What `fit` and `evaluate` read: `(batches, steps, train, test)`.

    `steps` is `fit`'s `steps_per_epoch` (None: the dataset's length);
    `train` and `test` are `evaluate` arguments (`test["x"]` is `fit`'s
    validation data too).
    """
    test = _evaluation_data(data.x_test, data.y_test, strategy)
    train = _evaluation_data(data.x_train, data.y_train, strategy)
    seed = trial["seed"]
    if strategy is None:
        batches = make_dataset(data.x_train, data.y_train, batch_size, seed)
        return batches, None, train, test
    batches, steps = make_distributed_dataset(
        data.x_train, data.y_train, batch_size, seed, epochs
    )
    return batches, steps, train, test


def _compile(trial, jit_compile, strategy):
    """Compiles the trial's model with its optimizer (in the strategy's scope)."""
    model = trial["model"]
    with _scope(strategy):
        model.compile(
            optimizer=trial["optimizer"],
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            jit_compile=jit_compile,
            # The loss scale, if any, is the `loss_scale` block's, already
            # in the optimizer (inside DiLoCo's): never a second one.
            auto_scale_loss=False,
        )
    if strategy is not None:
        from tf_lars.distribute import enable_multi_worker_fit

        # Needed under MultiWorkerMirroredStrategy; a no-op otherwise.
        enable_multi_worker_fit(model)


def fit_once(
    data,
    trial,
    *,
    batch_size,
    epochs,
    jit_compile="auto",
    callbacks=(),
    verbose=0,
    validation=False,
    strategy=None,
):
    """Trains a `build_trial` model once."""
    model = trial["model"]
    with deferred(), _dtype_policy(trial["precision"]):
        _compile(trial, jit_compile, strategy)
        batches, steps, train_data, test_data = _fit_inputs(
            data, trial, batch_size, epochs, strategy
        )
        stopper = _StopOnNonFinite()
        if not any(isinstance(c, _RaiseInterrupts) for c in callbacks):
            callbacks = [*callbacks, _RaiseInterrupts()]  # else a cluster's
        started = time.perf_counter()
        history = model.fit(
            batches,
            epochs=epochs,
            steps_per_epoch=steps,
            validation_data=test_data["x"] if validation else None,
            callbacks=[stopper, *callbacks],
            verbose=verbose,
            shuffle=False,  # the dataset shuffles itself, every epoch
        )
        seconds = time.perf_counter() - started
        scores = _scores(model, train_data, test_data)
    return {
        "model": model,
        "optimizer": trial["optimizer"],
        "history": dict(history.history),
        "learning_rate": trial["learning_rate"],
        "steps_per_epoch": trial["steps_per_epoch"],
        "diverged": (
            stopper.diverged_epoch is not None
            or not math.isfinite(scores["train_loss"])
        ),
        "diverged_epoch": stopper.diverged_epoch,
        **scores,
        "seconds": seconds,
    }


def _scores(model, train_data, test_data):
    """Loss and accuracy on the training and test sets, as floats."""
    scores = {}
    for name, data in (("train", train_data), ("test", test_data)):
        loss, accuracy = model.evaluate(**data, verbose=0)
        scores |= {f"{name}_loss": float(loss), f"{name}_accuracy": float(accuracy)}
    return scores


def learning_rate_for(config, learning_rate, batch_size, steps_per_epoch):
    """The learning rate a `train` run's optimizer gets, from the block's.

    A float is scaled linearly from `schedule.base_batch_size` to
    `batch_size` (the global batch) when that is set, then becomes the peak
    of a warm-up + polynomial decay over the run unless `schedule.name` is
    none. A serialized schedule is used as it is (then `schedule.name` must
    be none and `schedule.base_batch_size` null).
    """
    schedule_config = config["schedule"]
    base_batch_size = schedule_config["base_batch_size"]
    if isinstance(learning_rate, dict):
        if schedule_config["name"] != "none" or base_batch_size is not None:
            raise ConfigError(
                "`optimizer.config.learning_rate` is a serialized schedule; set "
                "`schedule.name` to none and `schedule.base_batch_size` to null to "
                "use it as is"
            )
        try:
            return keras.optimizers.schedules.deserialize(learning_rate)
        except Exception as error:  # noqa: BLE001 - reported to the user
            raise ConfigError(
                "`optimizer.config.learning_rate` is not a loadable learning-rate "
                f"schedule: {one_line(error)}"
            ) from None
    if base_batch_size is not None:
        learning_rate = (
            linear_scaled_learning_rate(learning_rate, batch_size, base_batch_size)
            if learning_rate > 0
            else 0.0
        )
    if schedule_config["name"] == "none":
        return float(learning_rate)
    if learning_rate <= 0:
        raise ConfigError(
            "`optimizer.config.learning_rate` is the schedule's peak and must be "
            f"> 0. Received: optimizer.config.learning_rate={learning_rate!r}"
        )
    epochs = config["training"]["epochs"]
    return build_schedule(schedule_config, learning_rate, steps_per_epoch, epochs)


def trial_from_config(config, data, global_batch, strategy=None):
    """`build_trial` of a `train` config: the optimizer block checked, its
    learning rate resolved for `global_batch` (`learning_rate_for`)."""
    spec = optimizer_spec(config["optimizer"])
    return build_trial(
        data,
        model_config=config["model"],
        optimizer=spec,
        learning_rate=learning_rate_for(
            config, spec.learning_rate, global_batch, len(data.x_train) // global_batch
        ),
        batch_size=global_batch,
        seed=config["seed"],
        precision=config["training"]["precision"],
        loss_scale_config=config["loss_scale"],
        strategy=strategy,
    )


def fit_config(config, data, callbacks=(), noise_scale=False):
    """One run of a `train` config on one device, silently: the training
    `tf-lars train` runs (`trial_from_config`, `fit_once`), which `tf-lars
    study` runs for each trial. `fit_once`'s result.

    With `noise_scale` (an even batch), the optimizer is wrapped in
    `tf_lars.GradientNoiseScale` over two micro-batches of half the batch:
    the same updates (their mean gradient is the batch's), and the result's
    `optimizer.b_simple` is the gradient noise scale at the end.
    """
    training = config["training"]
    batch = global_batch_size(training["batch_size"], len(data.x_train), 1)[1]
    trial = trial_from_config(config, data, batch)
    if noise_scale:
        batch //= 2
        trial["optimizer"] = tf_lars.GradientNoiseScale(
            trial["optimizer"], batch_size=batch, gradient_accumulation_steps=2
        )
    return fit_once(
        data,
        trial,
        batch_size=batch,
        epochs=training["epochs"],
        jit_compile=training["jit_compile"],
        callbacks=callbacks,
    )


# ------------------------------------------------------------ the command
def _describe_distribution(distribution):
    if distribution.name == "mirrored":
        return f"Strategy: mirrored over {distribution.replicas} replica(s)"
    if distribution.name == "diloco":
        return (
            f"Strategy: diloco, {distribution.workers} workers, each training its "
            "own copy on its own shard"
        )
    if distribution.name == "parameter_server":
        return (
            f"Strategy: parameter_server, {distribution.workers} workers running "
            "AGN rounds against the parameter servers"
        )
    return (
        f"Strategy: multi_worker, {distribution.workers} workers, "
        f"{distribution.replicas} replicas"
    )


def _history_json(history, **extra):
    """`history.json`: `{"epoch": [1, ...], **history, **extra}`, inf/NaN as null."""
    epochs = len(history.get("loss", []))
    history = {key: [strict_json(float(v)) for v in vs] for key, vs in history.items()}
    return json.dumps(
        {"epoch": list(range(1, epochs + 1)), **history, **extra}, indent=1
    )


class _HistoryWriter(keras.callbacks.History):
    """Keras's `History` (which `fit` then returns), also written to
    `history.json` at every epoch end, so a Ctrl-C keeps it."""

    def __init__(self, folder, earlier=None):
        super().__init__()
        self.folder, self.earlier = folder, earlier

    def on_epoch_begin(self, epoch, logs=None):
        # A resumed `fit` starts at its backup's epoch: the history of the
        # epochs before it is the earlier start's.
        if self.earlier is not None and epoch and not self.epoch:
            self.history = {k: v[:epoch] for k, v in self.earlier.items()}
            self.epoch = list(range(epoch))
            print(f"Resumed from the backup after epoch {epoch}", flush=True)
        self.earlier = None

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        write_text(self.folder, "history.json", _history_json(self.history))


def _unwrapped(optimizer):
    """The configured optimizer: inside `diloco`'s, `parameter_server`'s and
    the `loss_scale` block's wrappers, if any (LAMB's own inner Adam is part
    of LAMB, never unwrapped)."""
    if isinstance(optimizer, (tf_lars.DiLoCo, tf_lars.AGN)):
        optimizer = optimizer.inner_optimizer
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


def _resolved_config(config, optimizer):
    """The config with the optimizer block filled from its `get_config()`.

    The block's own values stand (its learning rate is the one the user
    gave, not the schedule built from it); one it leaves out takes the
    optimizer's, but for the learning rate, which stays out.
    """
    block = config["optimizer"]
    arguments = {**_unwrapped(optimizer).get_config(), **block["config"]}
    if "learning_rate" not in block["config"]:
        del arguments["learning_rate"]
    return {
        **config,
        "optimizer": {"class_name": block["class_name"], "config": arguments},
    }


def _interrupted(folder, epochs_done, epochs, interrupt=None, lost=None):
    """Leaves a note in the run folder; the exception `main` reports.

    `interrupt` is the `KeyboardInterrupt` caught: Ctrl-C's, or
    `tf_lars.cli.main.Terminated` for a SIGTERM; `lost` instead, the error a
    collective raised when a worker of the cluster was lost.
    """
    from tf_lars.cli.preflight import Interrupted

    if folder is None:
        return Interrupted("")
    if lost is None:
        stopped = f"Interrupted ({interruption_name(interrupt)})"
    else:
        kind = type(lost).__name__
        who = "a parameter server" if kind == "ParameterServerFailure" else "a worker"
        stopped = f"Stopped ({who} of the cluster was lost: {kind})"
    note = (
        f"{stopped} after {epochs_done} of {epochs} epochs. "
        "config.yaml and history.json hold what finished; the model, summary "
        "and plots were not written."
    )
    if lost is not None:
        note += (
            " TensorFlow's error is on the chief's stderr (its log under the launcher)."
        )
    note += "\n"
    with contextlib.suppress(OSError):
        write_text(folder, INTERRUPTED_NOTE, note)
    kept = ", ".join(sorted(os.listdir(folder)))
    return Interrupted(
        f"the run folder {folder} keeps {kept} ({epochs_done} of {epochs} epochs)"
    )


def run(config, data=None, folder=None, overwrite=False):
    """`tf-lars train`: one training run, written to the run folder.

    One pass: the distribution and the batch, the optimizer block checked
    and its learning rate resolved for the global batch, the model and the
    optimizer built once (before any file is written, so a bad setting
    leaves nothing behind), training, the files. Under a strategy every
    process trains in lockstep and only the chief writes the run folder and
    prints the progress. The resolved config is written before training and
    `history.json` after every epoch, so a Ctrl-C keeps both (and an
    `INTERRUPTED` note).
    """
    from tf_lars.cli.preflight import preflight

    if data is None:
        data, folder = preflight("train", config, overwrite)
    distribution = make_distribution(config["distribute"])
    if distribution.exchange is not None:  # diloco: this worker's shard
        rows = slice(distribution.rank, None, distribution.workers)
        data = data._replace(x_train=data.x_train[rows], y_train=data.y_train[rows])
    num_train, replicas = len(data.x_train), distribution.replicas
    sizes = global_batch_size(config["training"]["batch_size"], num_train, replicas)
    if distribution.strategy is not None and distribution.coordinator is None:
        evaluation_batch_size(len(data.x_test), replicas, "test set")
    trial = trial_from_config(config, data, sizes[1], distribution.strategy)
    if distribution.exchange is not None:
        block = _strategy_block(config, "diloco")
        epochs = config["training"]["epochs"]
        trial["optimizer"] = _diloco(block, trial, epochs)
    if distribution.coordinator is not None:
        trial["optimizer"] = _agn(_strategy_block(config, "agn"), trial, distribution)
    if not distribution.chief:
        # Keras needs no file to train, and TensorBoard is the chief's.
        print(
            f"{distribution.task}: {_describe_distribution(distribution)}; the "
            "chief writes the run folder and the progress"
        )
        result, _ = _train(config, data, distribution, trial, None)
        print(
            f"{distribution.task}: done; final test accuracy "
            f"{100 * result['test_accuracy']:.2f}%"
        )
        return 0
    restarted = False
    if folder is None:
        # A restarted job takes its earlier run folder as --overwrite would;
        # `_open_run_folder` resumes it only if it is the same run.
        restarted = os.environ.get(RESTART_ENV, "0").strip() not in ("", "0")
        folder = claim_run_dir(config, "train", overwrite or restarted)
    earlier = _open_run_folder(
        folder, config, data, distribution, sizes, trial["optimizer"],
        restarted=restarted, overwrite=overwrite,
    )  # fmt: skip
    result, monitor = _train(config, data, distribution, trial, folder, earlier)
    try:
        # The scores before the files: a full disk (one line, status 2) keeps them.
        _print_scores(result)
        learning_rates, epochs_run = _learning_rates(result)
        files = _write_run_files(folder, result, learning_rates, epochs_run)
        files += _write_trust_ratio_files(folder, config, monitor, result)
        # Last: a summary.json says that every other file is whole. The run
        # is then complete, and a signal from then on ends it with status 0
        # (held back while the file is written: it is not half an end).
        summary = _summary(data, distribution, sizes, result, learning_rates)
        with deferred():
            write_text(
                folder, "summary.json", json.dumps(summary, indent=1, default=str)
            )
            run_finished(folder)
        files.insert(2, "summary.json")
    except KeyboardInterrupt as interrupt:
        epochs_run = len(result["history"].get("loss", []))
        epochs = config["training"]["epochs"]
        raise _interrupted(folder, epochs_run, epochs, interrupt) from None
    print(f"Wrote {folder}/: {', '.join(files)}")
    return 0


def _open_run_folder(
    folder, config, data, distribution, sizes, optimizer, restarted, overwrite
):
    """Creates the run folder, writes the resolved config, prints the setup.

    A restarted cluster job (`restarted`: `TF_LARS_RESTART` > 0) resumes
    the folder if its config.yaml is this run's resolved config, and refuses
    any other existing run without `overwrite`. Returns the history a
    resumed run goes on from (None: a new run).
    """
    text = dump_config(_resolved_config(config, optimizer))
    earlier = _own_run(folder, text, overwrite) if restarted else None
    if earlier is None:
        open_run_dir(folder, "train")
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(folder, INTERRUPTED_NOTE))  # it goes on
    # The resolved config first, so an interrupted run still has it.
    write_text(folder, "config.yaml", text)
    num_train = len(data.x_train)
    print(
        f"Data: {num_train} training / {len(data.x_test)} test examples, "
        f"{data.num_classes} classes ({data.source})"
    )
    if distribution.name != "none":
        print(_describe_distribution(distribution))
    print(describe_batches(*sizes, distribution.replicas, num_train))
    print(f"Run folder: {folder}", flush=True)
    if earlier is not None:
        print(
            "Restarted: this run goes on from its backup, if one was written (else "
            "from the start)",
            flush=True,
        )
    return earlier


def _own_run(folder, config_text, overwrite):
    """The history in `folder` if it is this restarted job's run, else None."""
    try:
        with open(os.path.join(folder, "config.yaml"), encoding="utf-8") as handle:
            same = handle.read() == config_text
    except FileNotFoundError:
        same = False
    if not same:
        if overwrite or not os.listdir(folder):
            return None
        raise ConfigError(
            f"the run folder {folder} exists and holds another run (its "
            "config.yaml is not this restarted job's); choose another "
            "`run_name`, or give --overwrite to replace its files. Received: "
            f"run_name={os.path.basename(folder)!r}"
        )
    try:
        with open(os.path.join(folder, "history.json"), encoding="utf-8") as handle:
            history = json.load(handle)
    except (FileNotFoundError, ValueError):
        return {}
    for key in ("epoch", "learning_rate_at_epoch_end"):
        history.pop(key, None)
    return {k: [math.nan if v is None else v for v in vs] for k, vs in history.items()}


def _train(config, data, distribution, trial, folder, earlier=None):
    """`fit_once` with the trust-ratio monitor; the result and the monitor.

    The chief (a `folder`) also shows the progress and writes
    `history.json` at every epoch end; a worker other than the chief
    (`folder` None) trains in lockstep, silently. On a cluster
    (`multi_worker`, `diloco`) the workers stop together on a signal
    (`_RaiseInterrupts`), a named run keeps a backup that a restarted job
    resumes from (`_backup`; `earlier`: the history it resumes), and a
    worker lost mid-run leaves a note in the run folder.
    """
    if distribution.coordinator is not None:
        return _train_parameter_server(config, data, distribution, trial, folder), None
    training, epochs = config["training"], config["training"]["epochs"]
    monitor = _trust_ratio_monitor(config, trial["optimizer"], folder)
    writer = None if folder is None else _HistoryWriter(folder, earlier)
    sync, cluster, every = None, None, 1
    if distribution.exchange is not None:
        from tf_lars.distribute import DiLoCoSync

        sync, cluster = DiLoCoSync(distribution.exchange), distribution.exchange
        every = _strategy_block(config, "diloco")["sync_every"]
    elif distribution.task is not None:
        cluster = distribution.strategy  # multi_worker
    backup = _backup(config, distribution, folder)
    # The backup restores before DiLoCoSync starts (which shares worker 0's
    # weights on a new run only) and saves after the history is written.
    callbacks = [monitor, writer, backup, sync, sync and _TakeTheta()]
    stop = _RaiseInterrupts(cluster, every)
    lost = _LOST_WORKER if cluster else ()
    try:
        result = fit_once(
            data,
            trial,
            batch_size=trial["batch_size"],
            epochs=epochs,
            jit_compile=training["jit_compile"],
            callbacks=[c for c in callbacks if c is not None] + [stop],
            verbose=0 if folder is None else training["verbose"],
            validation=True,
            strategy=distribution.strategy,
        )
    except KeyboardInterrupt as interrupt:
        done = len(writer.history.get("loss", [])) if writer else 0
        raise _interrupted(folder, done, epochs, interrupt) from None
    except lost as error:
        done = len(writer.history.get("loss", [])) if writer else 0
        kept = str(_interrupted(folder, done, epochs, lost=error))
        print(
            f"{distribution.task}: stopped, a worker of the cluster was lost "
            f"({type(error).__name__})" + (f"; {kept}" if kept else ""),
            flush=True,
        )
        raise  # its traceback (and status) as before: the log has it
    if backup is not None and sync is not None:
        # Each worker's own files, then, once every worker's are gone, the
        # folder (BackupAndRestore deletes its own at the end of `fit`).
        import shutil

        shutil.rmtree(backup.backup_dir, ignore_errors=True)
        stop.agree(None)
        if folder is not None:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(backup.backup_dir))
    if sync is not None:
        result["communication"] = sync.traffic.as_dict()
    return result, monitor


# What the next collective raises on every other worker when one is gone
# (a connection reset, an aborted or timed-out collective).
_LOST_WORKER = (
    tf.errors.UnavailableError,
    tf.errors.AbortedError,
    tf.errors.DeadlineExceededError,
    tf.errors.CancelledError,
)


def _backup(config, distribution, folder):
    """The backup callback of a `multi_worker` or `diloco` run, or None.

    Only a named run (`run_name`) has one, in `<run folder>/backup`: every
    worker knows that folder without the chief (diloco's workers each write
    their own part of it), and a restarted job finds its run folder again,
    which an unnamed run's (named by the time it started) is not.
    """
    if distribution.task is None or config["run_name"] is None:
        return None
    from tf_lars import distribute
    from tf_lars.cli.config import run_dir

    backup_dir = os.path.join(folder or run_dir(config, "train"), "backup")
    if distribution.exchange is not None:
        return distribute.DiLoCoBackup(
            backup_dir, distribution.exchange, distribution.rank
        )
    return distribute.BackupAndRestore(backup_dir)


def _strategy_block(config, name):
    """`distribute.<name>`, or the default config's where a `distribute`
    block written before that key existed leaves it out."""
    block = config["distribute"].get(name)
    return default_config("train")["distribute"][name] if block is None else block


def _diloco(block, trial, epochs):
    """`tf_lars.DiLoCo` around the trial's optimizer, from `distribute.diloco`."""
    from tf_lars.cli.config import optimizer_from_block

    steps, period = trial["steps_per_epoch"], block["sync_every"]
    if period > steps * epochs:
        # No outer step would run: the model would end where it started.
        raise ConfigError(
            "`distribute.diloco.sync_every` must be at most the steps each worker "
            f"runs ({steps} per epoch x {epochs} epochs), or no outer step runs. "
            f"Received: distribute.diloco.sync_every={period}",
            key="distribute.diloco.sync_every",
        )
    inner = trial["optimizer"]
    outer = optimizer_from_block(
        block["outer_optimizer"], key="distribute.diloco.outer_optimizer"
    )
    compression = None if block["compression"] == "none" else block["compression"]
    try:
        return tf_lars.DiLoCo(
            inner, outer, sync_every=block["sync_every"], compression=compression
        )
    except ValueError as error:
        raise ConfigError(f"distribute.diloco: {error}") from None


def _agn(block, trial, distribution):
    """`tf_lars.AGN` around the configured optimizer, from `distribute.agn`,
    built in the strategy's scope (its center state on the parameter servers)."""
    from tf_lars.cli.config import optimizer_from_block

    steps = trial["steps_per_epoch"]
    period = block["communication_period"]
    if period > steps:
        raise ConfigError(
            "`distribute.agn.communication_period` must be at most each worker's "
            f"steps per epoch ({steps}). Received: "
            f"distribute.agn.communication_period={period}",
            key="distribute.agn.communication_period",
        )
    with distribution.strategy.scope():
        outer = block["outer_optimizer"]
        if outer is not None:
            outer = optimizer_from_block(outer, key="distribute.agn.outer_optimizer")
        try:
            return tf_lars.AGN(
                trial["optimizer"], communication_period=period, outer_optimizer=outer
            )
        except ValueError as error:
            raise ConfigError(f"distribute.agn: {error}") from None


def _train_parameter_server(config, data, distribution, trial, folder):
    """AGN rounds on the workers, an epoch at a time; `fit_once`'s result.

    An epoch is each worker's `steps_per_epoch` local steps on average (the
    workers run asynchronously): the chief schedules rounds until the
    center has `workers * steps_per_epoch * epochs_done / period` commits
    (rounded), then evaluates the center on the training and test sets:
    the epoch's `loss`/`accuracy` and `val_loss`/`val_accuracy`.
    """
    from tf_lars import distribute

    training, model, optimizer = config["training"], trial["model"], trial["optimizer"]
    x, y, batch = data.x_train, data.y_train, training["batch_size"]

    def dataset_fn(input_context):
        del input_context  # each worker reads every example, in its own order
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x))
        return dataset.batch(batch, drop_remainder=True)

    verbose = 0 if folder is None else training["verbose"]
    with deferred():
        trainer = distribute.ParameterServerTrainer(
            model,
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            optimizer,
            dataset_fn,
            distribution.strategy,
            coordinator=distribution.coordinator,
            jit_compile=training["jit_compile"] is not False,
            log=print if verbose == 2 else (lambda line: None),
        )
    epochs, diverged_epoch = training["epochs"], None
    writer = keras.callbacks.History() if folder is None else _HistoryWriter(folder)
    writer.set_model(model)
    writer.on_train_begin()
    history = writer.history
    per_epoch = distribution.workers * trial["steps_per_epoch"]
    per_epoch /= optimizer.communication_period
    started = time.perf_counter()
    try:
        for epoch in range(epochs):
            with deferred():
                fitted = trainer.fit(rounds=max(1, round(per_epoch * (epoch + 1))))
                train = trainer.evaluate(x, y)
                test = trainer.evaluate(data.x_test, data.y_test)
            logs = {"loss": train["loss"], "accuracy": train["accuracy"]}
            logs |= {"val_loss": test["loss"], "val_accuracy": test["accuracy"]}
            writer.on_epoch_end(epoch, logs)  # history.json on the chief
            if verbose:
                print(
                    f"Epoch {epoch + 1}/{epochs}: {fitted['commits']} commits, loss "
                    f"{train['loss']:.4f}, accuracy {train['accuracy']:.4f}, "
                    f"val_loss {test['loss']:.4f}, val_accuracy "
                    f"{test['accuracy']:.4f}",
                    flush=True,
                )
            if not math.isfinite(train["loss"]):
                diverged_epoch = epoch
                break
    except KeyboardInterrupt as interrupt:
        done = len(history.get("loss", []))
        raise _interrupted(folder, done, epochs, interrupt) from None
    except distribute.ParameterServerFailure as error:
        # `tf_lars.cli.main` ends it in one line, status 3 (never restarted).
        error.kept = str(
            _interrupted(folder, len(history.get("loss", [])), epochs, lost=error)
        )
        raise
    payload, commits = fitted["bytes_per_commit"], fitted["commits"]
    return {
        "model": model,
        "optimizer": optimizer,
        "history": history,
        "learning_rate": trial["learning_rate"],
        "steps_per_epoch": trial["steps_per_epoch"],
        "diverged": diverged_epoch is not None,
        "diverged_epoch": diverged_epoch,
        "train_loss": train["loss"],
        "train_accuracy": train["accuracy"],
        "test_loss": test["loss"],
        "test_accuracy": test["accuracy"],
        "seconds": time.perf_counter() - started,
        # Each commit pushes the payload once and its round pulled it once.
        "communication": {
            "commits": commits,
            "bytes_per_commit": payload,
            "bytes_sent": commits * payload,
            "bytes_received": commits * payload,
            "worker_bytes_sent": fitted["worker_bytes_sent"],
            "worker_bytes_received": fitted["worker_bytes_received"],
        },
    }


class _TakeTheta(keras.callbacks.Callback):
    """At the end of `fit`, the model takes DiLoCo's global parameters (the
    same on every worker): the run's result, evaluated and saved."""

    def on_train_end(self, logs=None):
        optimizer = self.model.optimizer
        for variable, theta in zip(
            self.model.trainable_variables, optimizer.global_variables, strict=True
        ):
            variable.assign(theta)


def _print_scores(result):
    print()
    if result["diverged"]:
        print(
            "Training DIVERGED: the loss became NaN/inf in epoch "
            f"{(result['diverged_epoch'] or 0) + 1}; stopped there."
        )
    print(f"Final train accuracy: {100 * result['train_accuracy']:.2f}%")
    print(f"Final test accuracy:  {100 * result['test_accuracy']:.2f}%")
    sent = result.get("communication")
    if sent is not None and "commits" in sent:
        print(
            f"Communicated: {sent['commits']} commits of {sent['bytes_per_commit']:,} "
            f"bytes, {sent['bytes_sent']:,} bytes sent to the parameter servers and "
            f"{sent['bytes_received']:,} received from them (all workers)"
        )
    elif sent is not None:
        print(
            f"Communicated (this worker): {sent['outer_steps']} outer steps, "
            f"{sent['bytes_sent']:,} bytes sent, {sent['bytes_received']:,} received"
        )


def _trust_ratio_monitor(config, optimizer, folder):
    """A `TrustRatioMonitor` for optimizers that expose trust ratios, else None
    (and None under `diloco` and `parameter_server`, whose ratios are each
    worker's own)."""
    if isinstance(optimizer, (tf_lars.DiLoCo, tf_lars.AGN)):
        return None
    if "trust_coefficient" not in constructor_parameters(type(_unwrapped(optimizer))):
        return None
    tensorboard = config["monitor"]["tensorboard"] and folder is not None
    return TrustRatioMonitor(
        log_every_n_batches=config["monitor"]["log_every_n_batches"],
        log_dir=os.path.join(folder, "tensorboard") if tensorboard else None,
    )


def _learning_rates(result):
    """The learning rate of every step run (a NumPy array), the epochs run."""
    epochs_run = len(result["history"].get("loss", []))
    steps = max(result["steps_per_epoch"] * epochs_run, 1)
    learning_rate = result["learning_rate"]
    if isinstance(learning_rate, keras.optimizers.schedules.LearningRateSchedule):
        rates = np.asarray(learning_rate(tf.range(steps, dtype=tf.int64)), np.float64)
        return rates * np.ones(steps), epochs_run
    return np.full(steps, float(learning_rate)), epochs_run


def _summary(data, distribution, sizes, result, learning_rates):
    """summary.json's record of a finished run."""
    optimizer, learning_rate = result["optimizer"], result["learning_rate"]
    outer = getattr(optimizer, "outer_optimizer", None)  # DiLoCo's, AGN's
    outer = None if outer is None else keras.optimizers.serialize(outer)
    if not isinstance(learning_rate, float):
        learning_rate = keras.saving.serialize_keras_object(learning_rate)
    scores = ("train_accuracy", "test_accuracy", "train_loss", "test_loss")
    return {
        **{key: strict_json(result[key]) for key in scores},
        "diverged": result["diverged"],
        # 1-based, as history.json's `epoch` and the printed line.
        "diverged_epoch": (
            None if result["diverged_epoch"] is None else result["diverged_epoch"] + 1
        ),
        "epochs_run": len(result["history"].get("loss", [])),
        "batch_size": sizes[0],
        "global_batch_size": sizes[1],
        "replicas": distribution.replicas,
        "workers": distribution.workers,
        "strategy": distribution.name,
        "examples_dropped_per_epoch": len(data.x_train) % sizes[1],
        "steps_per_epoch": result["steps_per_epoch"],
        "peak_learning_rate": float(np.max(learning_rates)),
        "learning_rate_schedule": learning_rate,
        "optimizer": type(optimizer).__name__,
        "inner_optimizer": type(_unwrapped(optimizer)).__name__,
        "outer_optimizer": outer,
        "train_seconds": result["seconds"],
        "data": data.source,
        **{key: result[key] for key in ("communication",) if key in result},
    }


def _write_run_files(folder, result, learning_rates, epochs_run):
    """history.json, the model and the curves, each whole; their names."""
    from tf_lars.cli.plots import plot_curves, plot_learning_rate

    steps_per_epoch = result["steps_per_epoch"]
    at_epoch_end = learning_rates[steps_per_epoch - 1 :: steps_per_epoch][:epochs_run]
    history = _history_json(
        result["history"], learning_rate_at_epoch_end=at_epoch_end.tolist()
    )
    write_text(folder, "history.json", history)
    write_file(os.path.join(folder, "model.keras"), result["model"].save)
    write_file(
        os.path.join(folder, "curves.png"),
        lambda path: plot_curves(result["history"], path),
    )
    write_file(
        os.path.join(folder, "learning_rate.png"),
        lambda path: plot_learning_rate(learning_rates, steps_per_epoch, path),
    )
    return [
        "config.yaml",
        "history.json",
        "model.keras",
        "curves.png",
        "learning_rate.png",
    ]


def trust_ratio_records(monitor, history, steps_per_epoch):
    """`(ratios, steps, epochs)`: the monitor's records, after, for a run
    resumed from its backup, one per epoch the earlier start ran (its
    epoch-end ratios, kept in `history.json`; the monitor starts empty)."""
    ratios, steps, epochs = monitor.trust_ratios, list(monitor.steps), monitor.epochs
    first = epochs[0] if epochs else 0
    keys = [f"trust_ratio/{path}" for path in monitor.paths]
    if first and all(len(history.get(key, ())) >= first for key in keys):
        earlier = np.array([[history[key][e] for key in keys] for e in range(first)])
        ratios = np.concatenate([earlier.astype(ratios.dtype), ratios])
        steps = [steps_per_epoch * (e + 1) for e in range(first)] + steps
        epochs = list(range(first)) + list(epochs)
    return ratios, steps, list(epochs)


def _write_trust_ratio_files(folder, config, monitor, result):
    """The trust-ratio plot and arrays (LARS-like optimizers); their names."""
    from tf_lars.cli.plots import plot_trust_ratios

    files = []
    if monitor is not None and len(monitor.trust_ratios):
        ratios, steps, epochs = trust_ratio_records(
            monitor, result["history"], result["steps_per_epoch"]
        )
        # The last record of each epoch.
        rows = [i for i, epoch in enumerate(epochs) if epochs[i + 1 : i + 2] != [epoch]]
        write_file(
            os.path.join(folder, "trust_ratio.png"),
            lambda path: plot_trust_ratios(
                monitor.paths, [epochs[i] + 1 for i in rows], ratios[rows], path
            ),
        )
        write_file(
            os.path.join(folder, "trust_ratios.npz"),
            lambda path: np.savez(
                path,
                trust_ratios=ratios,
                steps=np.asarray(steps),
                epochs=np.asarray(epochs),
                paths=np.asarray(monitor.paths),
            ),
        )
        files += ["trust_ratio.png", "trust_ratios.npz"]
    if config["monitor"]["tensorboard"] and monitor is not None:
        files.append("tensorboard/")
    return files
