"""Keras callbacks that expose tf_lars optimizer state during `model.fit`."""

import keras
import numpy as np


def _write_scalar(tag, value, step):
    """`tf.summary.scalar` without the `tensorboard` package.

    The same record TensorBoard's scalar summary writes: a float32 tensor
    tagged for the "scalars" plugin. `tf.summary.scalar` itself raises
    `TBNotInstalledError` when `tensorboard` is not installed. TensorFlow is
    imported here, where a summary is written, so that the callbacks load
    without it on the other backends.
    """
    import tensorflow as tf

    metadata = tf.compat.v1.SummaryMetadata(
        plugin_data=tf.compat.v1.SummaryMetadata.PluginData(plugin_name="scalars")
    )
    tf.summary.write(tag, tf.constant(value, tf.float32), step=step, metadata=metadata)


def _find_loss_scale_optimizer(optimizer):
    """`optimizer` if it is a loss-scale optimizer, else `None`."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer
    return None


def _loss_scale_of(optimizer):
    """The current scale of a loss-scale optimizer, as a Python float."""
    if hasattr(optimizer, "loss_scale"):
        scale = optimizer.loss_scale
    elif optimizer.built:
        scale = optimizer.dynamic_scale.value
    else:
        scale = optimizer.initial_scale
    return float(keras.ops.convert_to_numpy(scale))


class _ScalarLogger(keras.callbacks.Callback):
    """Validated `log_dir` / `writer` / `prefix`, and TensorBoard scalar output."""

    def __init__(self, log_dir, writer, prefix):
        super().__init__()
        if log_dir is not None and writer is not None:
            raise ValueError(
                "Give at most one of `log_dir` and `writer`. Received: "
                f"log_dir={log_dir!r}, writer={writer!r}"
            )
        if not isinstance(prefix, str):
            raise ValueError(f"`prefix` must be a str. Received: prefix={prefix!r}")
        self.log_dir = log_dir
        self.writer = writer
        self.prefix = prefix
        self._owns_writer = False

    def _open_writer(self):
        if self.writer is None and self.log_dir is not None:
            import tensorflow as tf

            self.writer = tf.summary.create_file_writer(self.log_dir)
            self._owns_writer = True

    def _write_scalars(self, values, step):
        """Writes `{tag: value}` at `step` when there is a writer."""
        if self.writer is None:
            return
        with self.writer.as_default():
            for tag, value in values.items():
                _write_scalar(tag, value, step)
        self.writer.flush()

    def on_train_end(self, logs=None):
        if self._owns_writer:
            self.writer.close()
            self.writer = None
            self._owns_writer = False


@keras.saving.register_keras_serializable(package="tf_lars")
class LossScaleMonitor(_ScalarLogger):
    """Logs the loss scale and the count of skipped steps at each epoch end.

    Adds two entries to the epoch logs, so they land in `history.history`
    (and in any callback placed after this one, such as `CSVLogger`):

    ```
    logs["loss_scale"]    = the current loss scale (float)
    logs["skipped_steps"] = steps skipped so far for a non-finite gradient (int)
    ```

    A rising `skipped_steps` or a falling `loss_scale` shows when float16
    overflowed. With `log_dir` (or a `writer`) both values are also written
    as TensorBoard scalars, at step = epoch. Works with
    `tf_lars.LossScaleOptimizer`; with a plain
    `keras.optimizers.LossScaleOptimizer` (which keeps no count) only the
    scale is logged.

    Args:
        log_dir: str or `None`. Directory for a TensorBoard summary writer.
            Defaults to `None` (no TensorBoard output).
        writer: `tf.summary.SummaryWriter` or `None`. A writer to use instead
            of creating one from `log_dir`; give at most one of the two.
            Defaults to `None`.
        prefix: str. Prepended to both log keys (e.g. `"opt/"`). Defaults to
            `""`.

    Examples:
        ```python
        model.compile(optimizer=tf_lars.LossScaleOptimizer(keras.optimizers.SGD()),
                      loss="mse")
        history = model.fit(x, y, epochs=3,
                            callbacks=[tf_lars.callbacks.LossScaleMonitor()])
        history.history["loss_scale"]      # [32768.0, 32768.0, 16384.0]
        history.history["skipped_steps"]   # [0, 0, 1]
        ```
    """

    def __init__(self, log_dir=None, writer=None, prefix=""):
        super().__init__(log_dir, writer, prefix)

    def _optimizer(self):
        optimizer = _find_loss_scale_optimizer(getattr(self.model, "optimizer", None))
        if optimizer is None:
            raise ValueError(
                "`LossScaleMonitor` needs a model compiled with a loss-scale "
                "optimizer (`tf_lars.LossScaleOptimizer`). Received: "
                f"optimizer={getattr(self.model, 'optimizer', None)!r}"
            )
        return optimizer

    def on_train_begin(self, logs=None):
        self._optimizer()
        self._open_writer()

    def current_values(self):
        """`{key: value}` for the model's optimizer as it is now."""
        optimizer = self._optimizer()
        values = {self.prefix + "loss_scale": _loss_scale_of(optimizer)}
        if hasattr(optimizer, "skipped_steps"):
            values[self.prefix + "skipped_steps"] = int(optimizer.skipped_steps)
        return values

    def on_epoch_end(self, epoch, logs=None):
        values = self.current_values()
        if logs is not None:
            logs.update(values)
        self._write_scalars(values, epoch)

    def get_config(self):
        return {"log_dir": self.log_dir, "prefix": self.prefix}


@keras.saving.register_keras_serializable(package="tf_lars")
class TrustRatioMonitor(_ScalarLogger):
    """Records LARS's per-variable trust ratios (and the loss scale) in `fit`.

    Reads `optimizer.trust_ratios` (the trust ratio each trainable variable
    got in the latest step; 1 for variables excluded from layer adaptation
    and for sparse gradients) at every epoch end, and also every
    `log_every_n_batches` training batches when that is set. When the
    optimizer is a loss-scale wrapper, the wrapped `inner_optimizer` is read
    and the current loss scale is recorded too.

    ```
    history.history[prefix + variable.path]  one value per epoch (epoch end)
    history.history["loss_scale"]            one value per epoch (wrapped only)
    monitor.trust_ratios                     array [records, variables]
    monitor.paths, monitor.steps, monitor.epochs, monitor.loss_scales
    ```

    The per-variable values are appended to the `History` object directly
    rather than to the epoch `logs`, so that they do not flood the progress
    bar; `loss_scale` goes into the `logs` (so it also shows in the bar and
    agrees with `LossScaleMonitor`, which writes the same key). With `log_dir`
    (or a `writer`) every record is also written as a TensorBoard scalar
    (`prefix + path`, and `loss_scale`) at step = `optimizer.iterations`.

    Args:
        log_every_n_batches: int >= 1 or `None`. Also record every this many
            training batches (reading the variable synchronizes with the
            device, so keep it coarse). Defaults to `None` (epoch ends only).
        log_dir: str or `None`. Directory for a TensorBoard summary writer.
            Defaults to `None` (no TensorBoard output).
        writer: `tf.summary.SummaryWriter` or `None`. A writer to use instead
            of creating one from `log_dir`; give at most one of the two.
            Defaults to `None`.
        prefix: str. Prepended to each variable path to form the history and
            TensorBoard keys. Defaults to `"trust_ratio/"`.

    Examples:
        ```python
        model.compile(optimizer=tf_lars.LARS(1.0, trust_coefficient=0.02),
                      loss="sparse_categorical_crossentropy")
        monitor = tf_lars.callbacks.TrustRatioMonitor(log_every_n_batches=10)
        history = model.fit(x, y, epochs=3, callbacks=[monitor])
        history.history["trust_ratio/sequential/dense/kernel"]  # 3 values
        monitor.trust_ratios.shape  # (records, number of trainable variables)
        ```
    """

    def __init__(
        self, log_every_n_batches=None, log_dir=None, writer=None, prefix="trust_ratio/"
    ):
        if log_every_n_batches is not None and (
            isinstance(log_every_n_batches, bool)
            or not isinstance(log_every_n_batches, int)
            or log_every_n_batches < 1
        ):
            raise ValueError(
                "`log_every_n_batches` must be None or an int >= 1. "
                f"Received: log_every_n_batches={log_every_n_batches!r}"
            )
        super().__init__(log_dir, writer, prefix)
        self.log_every_n_batches = log_every_n_batches
        self._reset()

    def _reset(self):
        self.paths = []
        self.steps = []
        self.epochs = []
        self.loss_scales = []
        self._ratios = []
        self._epoch = 0

    @property
    def trust_ratios(self):
        """Recorded trust ratios, a float32 array of shape [records, variables]."""
        return np.asarray(self._ratios, dtype=np.float32).reshape(
            len(self._ratios), len(self.paths)
        )

    def _optimizers(self):
        """`(lars, wrapper)`: the optimizer holding trust ratios, and the
        loss-scale wrapper around it (or `None`)."""
        optimizer = getattr(self.model, "optimizer", None)
        wrapper = None
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            wrapper, optimizer = optimizer, optimizer.inner_optimizer
        # A LARS has `trust_ratios` once built; `fit` may build it only in its
        # first step, after `on_train_begin`, so an unbuilt one is given the
        # benefit of the doubt until the first record.
        unbuilt = not getattr(optimizer, "built", True)
        if not hasattr(optimizer, "trust_ratios") and not (
            unbuilt and isinstance(optimizer, keras.optimizers.Optimizer)
        ):
            raise ValueError(
                "`TrustRatioMonitor` needs a model compiled with `tf_lars.LARS` "
                "(or a loss-scale optimizer wrapping it), whose `trust_ratios` "
                f"it reads. Received: optimizer={optimizer!r}"
            )
        return optimizer, wrapper

    def on_train_begin(self, logs=None):
        self._optimizers()
        self._reset()
        self._open_writer()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.log_every_n_batches and (batch + 1) % self.log_every_n_batches == 0:
            self._record()

    def _record(self):
        """Appends the current values; returns `(ratios, loss_scale)`."""
        optimizer, wrapper = self._optimizers()
        if not hasattr(optimizer, "trust_ratios"):
            # Still unbuilt after a step: it never made any.
            raise ValueError(
                "`TrustRatioMonitor` needs a model compiled with `tf_lars.LARS` "
                "(or a loss-scale optimizer wrapping it), whose `trust_ratios` "
                f"it reads. Received: optimizer={optimizer!r}"
            )
        step = int(keras.ops.convert_to_numpy(optimizer.iterations))
        if self.steps and self.steps[-1] == step:
            # Already recorded at this step (a batch record on the epoch's
            # last batch): do not store it twice.
            return self._ratios[-1], self.loss_scales[-1]
        ratios = np.asarray(
            keras.ops.convert_to_numpy(optimizer.trust_ratios), dtype=np.float32
        )
        if not self.paths:
            self.paths = list(optimizer.trust_ratio_paths)
        loss_scale = None
        if wrapper is not None:
            loss_scale = _loss_scale_of(wrapper)
        self.steps.append(step)
        self.epochs.append(self._epoch)
        self._ratios.append(ratios)
        self.loss_scales.append(loss_scale)
        scalars = {
            self.prefix + p: float(r) for p, r in zip(self.paths, ratios, strict=True)
        }
        if loss_scale is not None:
            scalars["loss_scale"] = loss_scale
        self._write_scalars(scalars, step)
        return ratios, loss_scale

    def on_epoch_end(self, epoch, logs=None):
        ratios, loss_scale = self._record()
        history = getattr(self.model, "history", None)
        if isinstance(history, keras.callbacks.History):
            for path, ratio in zip(self.paths, ratios, strict=True):
                key = self.prefix + path
                history.history.setdefault(key, []).append(float(ratio))
        if loss_scale is not None and logs is not None:
            logs["loss_scale"] = loss_scale

    def get_config(self):
        return {
            "log_every_n_batches": self.log_every_n_batches,
            "log_dir": self.log_dir,
            "prefix": self.prefix,
        }
