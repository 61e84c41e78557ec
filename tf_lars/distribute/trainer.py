"""Train a Keras model with AGN on `ParameterServerStrategy`.

Keras 3 `model.fit` does not support `ParameterServerStrategy`, so this is
the training loop: it runs on the chief, schedules AGN rounds on the workers
through `tf.distribute.coordinator.ClusterCoordinator`, reports progress,
checkpoints, evaluates, and turns a lost parameter server into a clear error.
The AGN itself keeps the checkpointed center side; the trainer wraps it in a
`ParameterServerAGN` for the worker side.
"""

import contextlib
import os
import re
import socket
import time

import keras
import numpy as np
import tensorflow as tf

from tf_lars.distribute import _internals
from tf_lars.distribute.logs import log_tensorflow_records_once, write_lines
from tf_lars.distribute.ps_agn import ParameterServerAGN, check_strategy_and_agn
from tf_lars.distribute.tf_config import split_address


class ParameterServerFailure(RuntimeError):
    """A parameter-server task became unavailable; training cannot go on.

    Attributes:
        task: str, the task, e.g. `"/job:ps/replica:0/task:0"`.
        address: str or None, its `"host:port"`.
        checkpoint: str or None, the last checkpoint a rerun resumes from.
        checkpoint_commits: int or None, the commit count in that checkpoint.
        summary: str, the message without TensorFlow's error.
    """

    def __init__(self, task, address, checkpoint, checkpoint_commits, cause):
        self.task = task
        self.address = address
        self.checkpoint = checkpoint
        self.checkpoint_commits = checkpoint_commits
        where = f"{task} ({address})" if address else task
        if checkpoint:
            resume = (
                f"Restart the parameter servers and rerun: training resumes from "
                f"{checkpoint} (commit {checkpoint_commits})."
            )
        else:
            resume = (
                "No checkpoint was written yet (pass `checkpoint_dir`); a rerun "
                "starts from scratch."
            )
        self.summary = (
            f"parameter server {where} is unavailable; training stopped. {resume}"
        )
        cause_line = str(cause).strip().splitlines()
        cause_line = cause_line[-1] if cause_line else type(cause).__name__
        super().__init__(f"{self.summary} [{type(cause).__name__}: {cause_line[:300]}]")


# Where TensorFlow's errors leave no choice but their text. A lost task is
# recognized by the error's type (its status code), as TensorFlow's own
# coordinator does; only the message says *which* task was lost: the task name
# when the error was raised by the remote task, else the address it could not
# reach (read from TensorFlow 2.21).
_PS_TASK = re.compile(r"/job:ps/replica:\d+/task:(\d+)")


def _error_chain(error):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = (
            getattr(error, "original_exception", None)
            or error.__cause__
            or error.__context__
        )


def _is_connection_error(error):
    if isinstance(error, tf.errors.UnavailableError | tf.errors.AbortedError):
        return True
    # INVALID_ARGUMENT is also a plain bug; TensorFlow's coordinator counts
    # these two messages of it as a lost task (a remote device or tensor gone).
    text = str(error)
    return isinstance(error, tf.errors.InvalidArgumentError) and (
        "unknown device" in text.lower()
        or "Unable to find the relevant tensor remote_handle" in text
    )


def _failed_ps_task(error, cluster):
    """`(task, address)` of the parameter server a connection error names.

    None when the error is not a lost connection (a bug in the model, an XLA
    compilation error, ...) or names no parameter server.
    """
    chain = list(_error_chain(error))
    if not any(_is_connection_error(e) for e in chain):
        return None
    text = "\n".join(str(e) for e in chain)
    addresses = cluster.get("ps", [])
    match = _PS_TASK.search(text)
    if match:
        index = int(match.group(1))
    else:
        ports = [a.rsplit(":", 1)[-1] for a in addresses]
        index = next(
            (i for i, p in enumerate(ports) if re.search(rf"[:\]]{p}\b", text)),
            None,
        )
        if index is None:
            return None
    address = addresses[index] if index < len(addresses) else None
    return f"/job:ps/replica:0/task:{index}", address


def _unreachable_ps_task(cluster, timeout=2.0):
    """`(task, address)` of the first parameter server whose port does not
    answer, or None.

    A lost parameter server does not always surface as a connection error:
    the coordinator may take the failure for its worker's, rebuild the
    worker's dataset iterator and then end with `OutOfRangeError` ("End of
    sequence"). Whether the server still answers settles it.
    """
    for index, address in enumerate(cluster.get("ps", [])):
        host, port = split_address(address)
        try:
            socket.create_connection((host.strip("[]"), port), timeout=timeout).close()
        except OSError:
            return f"/job:ps/replica:0/task:{index}", address
    return None


class ParameterServerTrainer:
    """Trains a Keras model with `tf_lars.AGN` on `ParameterServerStrategy`.

    Each scheduled closure is one AGN round on whichever worker is free:

    ```
    pull:     local <- center;  a <- 0                  (reads the parameter servers)
    repeat communication_period times, in one XLA-compiled tf.function:
              g = grad of loss(model(local; x_i), y_i)
              local <- inner_local.update(local, g);  a <- a + g
    commit:   center <- inner_center.update(center, a / period)  (one push)
    ```

    The center and the optimizer state are checkpointed every
    `checkpoint_every` commits; a trainer on the same directory resumes.
    Failures and how the rounds map onto TensorFlow:
    docs/guides/parameter-servers.md.

    Args:
        model: `keras.Model` created under `strategy.scope()` (its variables
            are the center). Non-trainable variables (e.g. BatchNorm moving
            statistics) are read from the parameter servers and not updated.
        loss: str, `keras.losses.Loss` or callable `loss(y_true, y_pred)`.
        optimizer: `tf_lars.AGN` created under `strategy.scope()`.
        dataset_fn: callable `dataset_fn(input_context) -> tf.data.Dataset`
            of `(x, y)` batches of a fixed size (`drop_remainder=True`). It
            runs on each worker; shuffle without a fixed seed so that workers
            see different orders. The trainer repeats it and groups
            `communication_period` batches per round.
        strategy: `tf.distribute.ParameterServerStrategy`.
        coordinator: `ClusterCoordinator` or None (created if None).
            Defaults to None.
        checkpoint_dir: str or None. Where checkpoints go; None disables
            checkpointing. Defaults to None.
        checkpoint_every: int >= 1. Commits between checkpoints (also the
            progress-report interval). Defaults to `100`.
        max_to_keep: int >= 1. Checkpoints kept. Defaults to `3`.
        jit_compile: bool. Compile the local steps of a round with XLA.
            Defaults to `True`; set False for models XLA cannot compile.
        log: callable taking a str, for progress lines. Defaults to writing
            each as one line on stdout.
        status: callable taking a str, for the status lines, as they happen:
            a worker lost or rejoined (from the coordinator's own failure
            and recovery handling, on its threads), a parameter server
            unavailable (the `ParameterServerFailure` about to be raised),
            a checkpoint saved or restored. Defaults to writing each as one
            whole line on stdout (`logs.write_lines`), whatever `log` is.

    Examples:
        ```python
        strategy, coordinator = tf_lars.distribute.connect(config)
        with strategy.scope():
            model = make_model()
            optimizer = tf_lars.AGN(keras.optimizers.SGD(0.1), communication_period=10)
        trainer = tf_lars.distribute.ParameterServerTrainer(
            model, "sparse_categorical_crossentropy", optimizer, dataset_fn,
            strategy, coordinator=coordinator, checkpoint_dir="/tmp/ckpt")
        trainer.fit(steps_per_worker=1000)
        print(trainer.evaluate(x_test, y_test))
        ```
    """

    def __init__(
        self,
        model,
        loss,
        optimizer,
        dataset_fn,
        strategy,
        coordinator=None,
        checkpoint_dir=None,
        checkpoint_every=100,
        max_to_keep=3,
        jit_compile=True,
        log=None,
        status=None,
    ):
        check_strategy_and_agn(strategy, optimizer, "optimizer")
        if not callable(dataset_fn):
            raise ValueError(
                f"`dataset_fn` must be callable. Received: dataset_fn={dataset_fn!r}"
            )
        for name, value in {
            "checkpoint_every": checkpoint_every,
            "max_to_keep": max_to_keep,
        }.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"`{name}` must be an int >= 1. Received: {name}={value!r}"
                )
        self.model = model
        self.optimizer = optimizer
        self.strategy = strategy
        self.coordinator = coordinator or tf.distribute.coordinator.ClusterCoordinator(
            strategy
        )
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_every = checkpoint_every
        self.jit_compile = bool(jit_compile)
        # Whole lines, one writer at a time: status lines come from the
        # coordinator's threads.
        self._log = log or (lambda line: write_lines([line]))
        self._status = status or (lambda line: write_lines([line]))
        self._loss = keras.losses.get(loss) if isinstance(loss, str) else loss
        self._dataset_fn = dataset_fn
        resolver = _internals.cluster_resolver_of(strategy)
        self._cluster = resolver.cluster_spec().as_dict()
        self.num_workers = len(self._cluster.get("worker", []))
        log_tensorflow_records_once()
        self._lost_workers = set()
        _internals.watch_workers(
            self.coordinator, self._worker_lost, self._worker_rejoined
        )

        #: The worker side of `optimizer` (`ParameterServerAGN`).
        self.ps_agn = ParameterServerAGN(
            optimizer, strategy, model_variables=model.trainable_variables
        )
        self.checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
        self.manager = None
        self.restored_commits = 0
        if checkpoint_dir:
            self.manager = tf.train.CheckpointManager(
                self.checkpoint, checkpoint_dir, max_to_keep=max_to_keep
            )
            self._restore()
        self._round = self._trace_round()

    def _restore(self):
        """Restores the latest checkpoint, if any."""
        latest = self.manager.latest_checkpoint
        if not latest:
            return
        with self._ps_failures():
            self.checkpoint.restore(latest).assert_existing_objects_matched()
            self.restored_commits = int(self.optimizer.commits.numpy())
        self._status(f"[agn] restored {latest} (commit {self.restored_commits})")

    def _worker_label(self, index):
        addresses = self._cluster.get("worker", [])
        return f"worker {index} ({addresses[index] if index < len(addresses) else '?'})"

    def _worker_lost(self, index, error):
        # The coordinator may report one loss from more than one closure.
        if index not in self._lost_workers:
            self._lost_workers.add(index)
            self._status(
                f"[agn] {self._worker_label(index)} lost ({type(error).__name__}); "
                "the other workers take its rounds"
            )

    def _worker_rejoined(self, index):
        if index in self._lost_workers:
            self._lost_workers.discard(index)
            self._status(
                f"[agn] {self._worker_label(index)} rejoined, with new worker-local "
                "state"
            )

    # ------------------------------------------------------------- the round
    def _round_dataset(self, input_context):
        period = self.optimizer.communication_period
        dataset = self._dataset_fn(input_context)
        return dataset.repeat().batch(period, drop_remainder=True).prefetch(2)

    def _trace_round(self):
        agn = self.ps_agn
        model = self.model
        loss_fn = self._loss
        period = agn.communication_period
        local_variables = agn.local_variables
        non_trainable = list(model.non_trainable_variables)
        input_context = tf.distribute.InputContext(
            num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1
        )

        element_spec = _fixed_batches(self._round_dataset(input_context).element_spec)

        def local_round(xs, ys, non_trainable_values):
            total = tf.constant(0.0, tf.float32)
            for i in tf.range(period):
                x = tf.nest.map_structure(lambda t, i=i: t[i], xs)
                y = tf.nest.map_structure(lambda t, i=i: t[i], ys)
                values = [tf.convert_to_tensor(v) for v in local_variables]
                with tf.GradientTape() as tape:
                    tape.watch(values)
                    y_pred, _, losses = model.stateless_call(
                        values,
                        non_trainable_values,
                        x,
                        training=True,
                        return_losses=True,
                    )
                    loss = tf.reduce_mean(loss_fn(y, y_pred))
                    if losses:
                        loss = loss + tf.add_n([tf.cast(x, loss.dtype) for x in losses])
                    scaled = agn.scale_loss(loss)
                grads = tape.gradient(scaled, values)
                agn.local_update(list(grads))
                total += tf.cast(loss, tf.float32)
            return total / period

        local_round_fn = tf.function(local_round, jit_compile=self.jit_compile)

        def round_fn(iterator):
            xs, ys = next(iterator)
            agn.pull()
            non_trainable_values = [tf.convert_to_tensor(v) for v in non_trainable]
            loss = local_round_fn(xs, ys, non_trainable_values)
            with tf.control_dependencies([loss]):
                commits = agn.commit()
            return loss, commits

        per_worker_dataset = self.coordinator.create_per_worker_dataset(
            lambda: self._round_dataset(input_context)
        )
        self._iterator = iter(per_worker_dataset)
        # Traced here, outside `strategy.scope()`: the worker-local optimizer
        # then updates its variables in place, without cross-replica merges.
        return tf.function(round_fn).get_concrete_function(
            tf.data.IteratorSpec(element_spec)
        )

    # ---------------------------------------------------------------- errors
    @contextlib.contextmanager
    def _ps_failures(self):
        try:
            yield
        except ParameterServerFailure:
            raise
        except Exception as error:  # noqa: BLE001 - classified, then re-raised
            failed = _failed_ps_task(error, self._cluster)
            if failed is None and any(
                isinstance(e, tf.errors.OpError) for e in _error_chain(error)
            ):
                failed = _unreachable_ps_task(self._cluster)
            if failed is None:
                raise
            checkpoint, commits = self._last_checkpoint()
            failure = ParameterServerFailure(
                failed[0], failed[1], checkpoint, commits, error
            )
            self._status(f"[agn] error: {failure.summary}")
            raise failure from error

    def _last_checkpoint(self):
        """`(path, commits)` of the latest checkpoint, or `(None, None)`."""
        if self.manager is None or not self.manager.latest_checkpoint:
            return None, None
        path = self.manager.latest_checkpoint
        return path, checkpoint_commits(path)

    # ------------------------------------------------------------------- fit
    def fit(self, steps_per_worker=None, rounds=None):
        """Trains until `rounds` commits have reached the center.

        Args:
            steps_per_worker: int or None. Local steps each worker takes in
                the whole run (a multiple of `communication_period`); the
                target is `num_workers * steps_per_worker / period` commits.
            rounds: int or None. The target number of commits, instead.

        Returns:
            dict with `commits`, `local_steps`, `target_commits`,
            `restored_commits`, `losses` (mean loss of each report interval),
            `seconds` and `commits_per_second` (of this run),
            `worker_local_steps`, `bytes_per_commit`, and `worker_bytes_sent`
            / `worker_bytes_received` (each worker's commits and pulls since
            its (re)start, `bytes_per_commit` each; None for a worker that is
            down).

        Raises:
            ParameterServerFailure: a parameter server became unavailable.
        """
        target = self._target_commits(steps_per_worker, rounds)
        period = self.optimizer.communication_period
        with self._ps_failures():
            commits = int(self.optimizer.commits.numpy())
        history = {"losses": [], "target_commits": target, "restored_commits": commits}
        start_commits, start = commits, time.perf_counter()
        self._log(
            f"[agn] training to {target} commits ({target * period} local steps, "
            f"period {period}, {self.num_workers} workers); "
            f"starting at commit {commits}"
        )
        with self._ps_failures():
            while commits < target:
                last_saved = commits
                count = min(self.checkpoint_every, target - commits)
                commits = self._train_interval(count)
                elapsed = time.perf_counter() - start
                history["losses"].append(self._last_loss)
                rate = (commits - start_commits) / max(elapsed, 1e-9)
                self._log(
                    f"[agn] commits {commits}/{target} | local steps "
                    f"{self._last_steps} | loss {self._last_loss:.4f} | "
                    f"{rate:.1f} commits/s | {elapsed:.1f}s"
                )
                self._maybe_save(last_saved, commits, target)
            steps = int(self.optimizer.local_steps.numpy())
        seconds = time.perf_counter() - start
        per_worker = self.worker_local_steps()
        payload = self.bytes_per_commit()
        # Each round pulls the center (payload bytes in) and commits once
        # (payload bytes out), per worker since its (re)start.
        worker_bytes = [
            None if steps_done is None else steps_done // period * payload
            for steps_done in per_worker
        ]
        self._log(
            f"[agn] done: {commits} commits, {steps} local steps; local steps per "
            f"worker since its (re)start: {per_worker}; bytes sent (and received) "
            f"per worker: {worker_bytes}, {payload} per commit"
        )
        history.update(
            worker_local_steps=per_worker,
            commits=commits,
            local_steps=steps,
            seconds=seconds,
            commits_per_second=(commits - start_commits) / max(seconds, 1e-9),
            bytes_per_commit=payload,
            worker_bytes_sent=worker_bytes,
            worker_bytes_received=worker_bytes,
        )
        return history

    def bytes_per_commit(self):
        """Bytes one commit sends to the parameter servers, and one pull
        receives: one tensor per trainable variable, in its dtype."""
        return sum(
            int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size
            for v in self.ps_agn.center_variables
        )

    def _target_commits(self, steps_per_worker, rounds):
        period = self.optimizer.communication_period
        if (steps_per_worker is None) == (rounds is None):
            raise ValueError(
                "Pass exactly one of `steps_per_worker` and `rounds`. Received: "
                f"steps_per_worker={steps_per_worker!r}, rounds={rounds!r}"
            )
        if rounds is not None:
            if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
                raise ValueError(
                    f"`rounds` must be an int >= 1. Received: rounds={rounds!r}"
                )
            return rounds
        if (
            isinstance(steps_per_worker, bool)
            or not isinstance(steps_per_worker, int)
            or steps_per_worker < period
            or steps_per_worker % period
        ):
            raise ValueError(
                "`steps_per_worker` must be a positive multiple of "
                f"`communication_period` ({period}). "
                f"Received: steps_per_worker={steps_per_worker!r}"
            )
        return self.num_workers * steps_per_worker // period

    def _train_interval(self, count):
        """Schedules `count` rounds and waits for them; the commits after."""
        results = [
            self.coordinator.schedule(self._round, args=(self._iterator,))
            for _ in range(count)
        ]
        self.coordinator.join()
        self._last_loss = float(np.mean([float(r.fetch()[0]) for r in results]))
        self._last_steps = int(self.optimizer.local_steps.numpy())
        return int(self.optimizer.commits.numpy())

    def _maybe_save(self, last_saved, commits, target):
        """Saves a checkpoint when `commits` crossed a multiple of
        `checkpoint_every` since `last_saved`, or reached the target."""
        every = self.checkpoint_every
        if self.manager is not None and (
            commits // every > last_saved // every or commits >= target
        ):
            path = self.manager.save(checkpoint_number=commits)
            self._status(f"[agn] checkpoint saved: {path} (commit {commits})")

    def worker_local_steps(self):
        """Local steps each worker has taken since its variables were created.

        A restarted worker starts again from 0 (worker-local state is not
        checkpointed); a worker that is down reads as None.

        Returns:
            list of int or None, one per worker.
        """
        iterations = self.ps_agn.local_optimizer.iterations.value
        return [
            None if value is None else int(value)
            for value in iterations.read_each_worker()
        ]

    # -------------------------------------------------------------- evaluate
    def evaluate(self, x, y, batch_size=256):
        """Evaluates the center variables on the chief.

        Returns:
            dict with `loss` and, for integer labels and a class axis,
            `accuracy`.
        """
        loss_fn = self._loss
        model = self.model

        @tf.function
        def batch_metrics(xb, yb):
            y_pred = model(xb, training=False)
            batch = tf.cast(tf.shape(y_pred)[0], tf.float64)
            loss = tf.cast(tf.reduce_mean(loss_fn(yb, y_pred)), tf.float64) * batch
            if y_pred.shape.rank == 2 and y_pred.shape[-1] and y_pred.shape[-1] > 1:
                labels = tf.cast(tf.reshape(yb, [-1]), tf.int64)
                correct = tf.reduce_sum(
                    tf.cast(tf.equal(tf.argmax(y_pred, axis=-1), labels), tf.float64)
                )
            else:
                correct = tf.constant(np.nan, tf.float64)
            return loss, correct

        total_loss = 0.0
        total_correct = 0.0
        count = 0
        with self._ps_failures():
            for begin in range(0, len(x), batch_size):
                xb = x[begin : begin + batch_size]
                yb = y[begin : begin + batch_size]
                loss, correct = batch_metrics(xb, yb)
                total_loss += float(loss)
                total_correct += float(correct)
                count += len(xb)
        metrics = {"loss": total_loss / count}
        if not np.isnan(total_correct):
            metrics["accuracy"] = total_correct / count
        return metrics


def _fixed_batches(element_spec):
    """`element_spec` of a round's dataset, checked for a fixed batch size."""
    for spec in tf.nest.flatten(element_spec):
        if spec.shape.rank is None or spec.shape.rank < 2 or spec.shape[1] is None:
            raise ValueError(
                "`dataset_fn` must yield batches of a fixed size (use "
                "`dataset.batch(batch_size, drop_remainder=True)`). "
                f"Received element_spec={element_spec}"
            )
    return element_spec


def checkpoint_commits(path):
    """The commit count of a trainer's checkpoint, from its path.

    The trainer saves with `CheckpointManager.save(checkpoint_number=commits)`,
    so the path ends in `-<commits>` (e.g. `/ckpt/ckpt-20`).

    Returns:
        int, or None for a path without that suffix.
    """
    _, _, number = os.path.basename(path).rpartition("-")
    return int(number) if number.isdigit() else None
