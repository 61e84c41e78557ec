"""Keras callbacks that expose tf_lars optimizer state during `model.fit`.

Each writes their values into the epoch `logs`, so that Keras's `History`,
`CSVLogger` and `TensorBoard` (placed after them) carry them too.
"""

import keras
import numpy as np


def _write_scalars(writer, values, step):
    """`tf.summary.scalar` for each `{tag: value}`, without the `tensorboard`
    package (whose absence makes `tf.summary.scalar` raise): the same record,
    a float32 tensor tagged for the "scalars" plugin. TensorFlow is imported
    here, so that the callbacks load without it on the other backends."""
    import tensorflow as tf

    plugin = tf.compat.v1.SummaryMetadata.PluginData(plugin_name="scalars")
    metadata = tf.compat.v1.SummaryMetadata(plugin_data=plugin)
    with writer.as_default():
        for tag, value in values.items():
            tf.summary.write(tag, tf.constant(value, tf.float32), step, metadata)
    writer.flush()


def _loss_scale_of(optimizer):
    """The current scale of a loss-scale optimizer, as a Python float."""
    scale = getattr(optimizer, "loss_scale", None)  # Keras's has none
    if scale is None:
        built = optimizer.built
        scale = optimizer.dynamic_scale.value if built else optimizer.initial_scale
    return float(keras.ops.convert_to_numpy(scale))


class _ScalarLogger(keras.callbacks.Callback):
    """Validated `log_dir` / `writer` / `prefix`; TensorBoard scalar output."""

    def __init__(self, log_dir, writer, prefix):
        super().__init__()
        if log_dir is not None and writer is not None:
            raise ValueError(
                "Give at most one of `log_dir` and `writer`. Received: "
                f"log_dir={log_dir!r}, writer={writer!r}"
            )
        if not isinstance(prefix, str):
            raise ValueError(f"`prefix` must be a str. Received: prefix={prefix!r}")
        self.log_dir, self.writer, self.prefix = log_dir, writer, prefix
        self._owns_writer = False

    def on_train_begin(self, logs=None):
        self._optimizers()  # refuses a model it cannot read before training
        if self.writer is None and self.log_dir is not None:
            import tensorflow as tf

            self.writer = tf.summary.create_file_writer(self.log_dir)
            self._owns_writer = True

    def _write_scalars(self, values, step):
        if self.writer is not None:
            _write_scalars(self.writer, values, step)

    def on_train_end(self, logs=None):
        if self._owns_writer:
            self.writer.close()
            self.writer, self._owns_writer = None, False


class _EpochEndLogger(_ScalarLogger):
    """Writes `current_values()` into `logs` (and TensorBoard) at each epoch end."""

    def __init__(self, log_dir=None, writer=None, prefix=""):
        super().__init__(log_dir, writer, prefix)

    def on_epoch_end(self, epoch, logs=None):
        values = self.current_values()
        if logs is not None:
            logs.update(values)
        self._write_scalars(values, epoch)

    def get_config(self):
        return {"log_dir": self.log_dir, "prefix": self.prefix}


@keras.saving.register_keras_serializable(package="tf_lars")
class LossScaleMonitor(_EpochEndLogger):
    """Logs the loss scale and the count of skipped steps at each epoch end.

    Adds `logs[prefix + "loss_scale"]` (the current loss scale, a float) and
    `logs[prefix + "skipped_steps"]` (steps skipped so far for a non-finite
    gradient, an int) to the epoch logs, so they land in `history.history`
    and in any callback placed after this one (`CSVLogger`, `TensorBoard`).
    A rising `skipped_steps` or a falling `loss_scale` shows when float16
    overflowed. With `log_dir` (or a `writer`) both are also written as
    TensorBoard scalars at step = epoch. With a plain
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

    def _optimizers(self):
        optimizer = getattr(self.model, "optimizer", None)
        if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise ValueError(
                "`LossScaleMonitor` needs a model compiled with a loss-scale "
                "optimizer (`tf_lars.LossScaleOptimizer`). Received: "
                f"optimizer={optimizer!r}"
            )
        return optimizer

    def current_values(self):
        """`{key: value}` for the model's optimizer as it is now."""
        optimizer = self._optimizers()
        values = {self.prefix + "loss_scale": _loss_scale_of(optimizer)}
        if hasattr(optimizer, "skipped_steps"):
            values[self.prefix + "skipped_steps"] = int(optimizer.skipped_steps)
        return values


@keras.saving.register_keras_serializable(package="tf_lars")
class TrustRatioMonitor(_ScalarLogger):
    """Records LARS's per-variable trust ratios (and the loss scale) in `fit`.

    Reads `optimizer.trust_ratios` (the trust ratio each trainable variable
    got in the latest step; 1 for variables excluded from layer adaptation
    and for sparse gradients) at every epoch end, and also every
    `log_every_n_batches` training batches when that is set. When the
    optimizer is a loss-scale wrapper, its `inner_optimizer` is read and the
    current loss scale is recorded too (the key `LossScaleMonitor` writes).

    ```
    logs[prefix + variable.path]  the epoch's last ratio (so history.history)
    logs["loss_scale"]            the loss scale (wrapped only)
    monitor.trust_ratios          array [records, variables]
    monitor.paths, monitor.steps, monitor.epochs, monitor.loss_scales
    ```

    With `log_dir` (or a `writer`) every record is also written as a
    TensorBoard scalar (`prefix + path`, and `loss_scale`) at step =
    `optimizer.iterations`.

    Args:
        log_every_n_batches: int >= 1 or `None`. Also record every this many
            training batches (reading the variable synchronizes with the
            device, so keep it coarse). Defaults to `None` (epoch ends only).
        log_dir: str or `None`. Directory for a TensorBoard summary writer.
            Defaults to `None` (no TensorBoard output).
        writer: `tf.summary.SummaryWriter` or `None`. A writer to use instead
            of creating one from `log_dir`; give at most one of the two.
            Defaults to `None`.
        prefix: str. Prepended to each variable path to form the log and
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
        self.paths, self.steps, self.epochs, self.loss_scales = [], [], [], []
        self._ratios, self._epoch = [], 0

    def on_train_begin(self, logs=None):
        self._reset()
        super().on_train_begin(logs)

    @property
    def trust_ratios(self):
        """Recorded trust ratios, a float32 array of shape [records, variables]."""
        return np.asarray(self._ratios, dtype=np.float32).reshape(
            len(self._ratios), len(self.paths)
        )

    def _optimizers(self, built=False):
        """`(lars, wrapper)`: the optimizer holding trust ratios, and the
        loss-scale wrapper around it (or `None`).

        `fit` may build the optimizer only in its first step, after
        `on_train_begin`: an unbuilt one is given the benefit of the doubt
        until the first record (`built=True`).
        """
        optimizer, wrapper = getattr(self.model, "optimizer", None), None
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            wrapper, optimizer = optimizer, optimizer.inner_optimizer
        unbuilt = isinstance(optimizer, keras.optimizers.Optimizer) and not (
            built or optimizer.built
        )
        if not (hasattr(optimizer, "trust_ratios") or unbuilt):
            raise ValueError(
                "`TrustRatioMonitor` needs a model compiled with `tf_lars.LARS` "
                "(or a loss-scale optimizer wrapping it), whose `trust_ratios` "
                f"it reads. Received: optimizer={optimizer!r}"
            )
        return optimizer, wrapper

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.log_every_n_batches and (batch + 1) % self.log_every_n_batches == 0:
            self._record()

    def _record(self):
        """Appends the current values (once per optimizer step) and returns
        them as `{key: value}`."""
        optimizer, wrapper = self._optimizers(built=True)
        step = int(keras.ops.convert_to_numpy(optimizer.iterations))
        if not self.steps or self.steps[-1] != step:
            ratios = keras.ops.convert_to_numpy(optimizer.trust_ratios)
            self.paths = self.paths or list(optimizer.trust_ratio_paths)
            self.steps.append(step)
            self.epochs.append(self._epoch)
            self._ratios.append(np.asarray(ratios, dtype=np.float32))
            self.loss_scales.append(
                None if wrapper is None else _loss_scale_of(wrapper)
            )
            self._write_scalars(self._latest_values(), step)
        return self._latest_values()

    def _latest_values(self):
        paths = [self.prefix + path for path in self.paths]
        values = dict(zip(paths, map(float, self._ratios[-1]), strict=True))
        if self.loss_scales[-1] is not None:
            values["loss_scale"] = self.loss_scales[-1]
        return values

    def on_epoch_end(self, epoch, logs=None):
        values = self._record()
        if logs is not None:
            logs.update(values)

    def get_config(self):
        return {
            "log_every_n_batches": self.log_every_n_batches,
            "log_dir": self.log_dir,
            "prefix": self.prefix,
        }


@keras.saving.register_keras_serializable(package="tf_lars")
class GradientNoiseScaleMonitor(_EpochEndLogger):
    """Logs `tf_lars.GradientNoiseScale`'s measurement at each epoch end.

    Adds `logs[prefix + "gradient_noise_scale"]` (`B_simple`, in examples),
    `logs[prefix + "gradient_norm_squared"]` and `logs[prefix +
    "trace_covariance"]` (its two moving averages; all floats, NaN before the
    first update) to the epoch logs, so they land in `history.history` and in
    any callback placed after this one (`CSVLogger`, `TensorBoard`). The
    optimizer is the model's, or the one a loss-scale optimizer wraps. With
    `log_dir` (or a `writer`) the three are also written as TensorBoard
    scalars at step = epoch. docs/guides/noise-scale.md says how to read them.

    Args:
        log_dir: str or `None`. Directory for a TensorBoard summary writer.
            Defaults to `None` (no TensorBoard output).
        writer: `tf.summary.SummaryWriter` or `None`. A writer to use instead
            of creating one from `log_dir`; give at most one of the two.
            Defaults to `None`.
        prefix: str. Prepended to the three log keys. Defaults to `""`.

    Examples:
        ```python
        optimizer = tf_lars.GradientNoiseScale(
            keras.optimizers.SGD(0.1), batch_size=32, gradient_accumulation_steps=4
        )
        model.compile(optimizer=optimizer, loss="mse")
        history = model.fit(x, y, batch_size=32, epochs=3,
                            callbacks=[tf_lars.callbacks.GradientNoiseScaleMonitor()])
        history.history["gradient_noise_scale"]   # three values, in examples
        ```
    """

    def _optimizers(self):
        from tf_lars.noise_scale import GradientNoiseScale

        optimizer = getattr(self.model, "optimizer", None)
        while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            optimizer = optimizer.inner_optimizer
        if not isinstance(optimizer, GradientNoiseScale):
            raise ValueError(
                "`GradientNoiseScaleMonitor` needs a model compiled with "
                "`tf_lars.GradientNoiseScale` (or a loss-scale optimizer "
                "wrapping it). Received: "
                f"optimizer={getattr(self.model, 'optimizer', None)!r}"
            )
        return optimizer

    def current_values(self):
        """`{key: value}` for the model's optimizer as it is now."""
        optimizer = self._optimizers()
        return {
            self.prefix + "gradient_noise_scale": optimizer.b_simple,
            self.prefix + "gradient_norm_squared": optimizer.gradient_norm_squared,
            self.prefix + "trace_covariance": optimizer.trace_covariance,
        }
