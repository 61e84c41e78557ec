"""One training run for the `tf-lars` CLI (private): model, optimizer, fit.

`tf-lars train` and every grid point of `tf-lars sweep` go through
`fit_once`, so the two commands train exactly the same way.
"""

import math
import time

import keras
import numpy as np
import tensorflow as tf

from tf_lars._config import (
    ConfigError,
    constructor_parameters,
    optimizer_from_block,
    resolve_optimizer_class,
)
from tf_lars.schedules import WarmupPolynomialDecay, linear_scaled_learning_rate


def resolve_batch_size(batch_size, num_train, key):
    """An int batch size; `"full"` is the whole training set."""
    if batch_size == "full":
        return num_train
    if batch_size > num_train:
        raise ConfigError(
            f"`{key}` must be at most the training set size ({num_train}) or "
            f"'full'. Received: {key}={batch_size!r}"
        )
    return batch_size


def build_model(model_config, input_shape, num_classes):
    """The CLI's model: a small CNN for images, or an MLP for anything.

    `cnn`: conv(w) -> conv(w) -> max-pool -> conv(2w) -> global average pool
    -> dense logits, ReLU, `same` padding; it takes `(H, W)` or `(H, W, C)`
    examples. `mlp`: flatten -> dense(w) -> dense(w) -> dense logits. The
    logits layer computes in float32 under a mixed-precision policy.
    """
    width = model_config["width"]
    inputs = keras.Input(shape=input_shape, name="inputs")
    if model_config["name"] == "cnn":
        if len(input_shape) not in (2, 3) or min(input_shape[:2]) < 2:
            raise ConfigError(
                "`model.name`=cnn needs image examples of shape (H, W) or "
                f"(H, W, C) with H, W >= 2; the data has examples of shape "
                f"{tuple(input_shape)}. Use --set model.name=mlp"
            )
        x = inputs
        if len(input_shape) == 2:
            x = keras.layers.Reshape((*input_shape, 1), name="add_channel")(x)
        x = keras.layers.Conv2D(
            width, 3, padding="same", activation="relu", name="conv1"
        )(x)
        x = keras.layers.Conv2D(
            width, 3, padding="same", activation="relu", name="conv2"
        )(x)
        x = keras.layers.MaxPooling2D(2, name="pool")(x)
        x = keras.layers.Conv2D(
            2 * width, 3, padding="same", activation="relu", name="conv3"
        )(x)
        x = keras.layers.GlobalAveragePooling2D(name="global_pool")(x)
    else:
        x = keras.layers.Flatten(name="flatten")(inputs)
        x = keras.layers.Dense(width, activation="relu", name="dense1")(x)
        x = keras.layers.Dense(width, activation="relu", name="dense2")(x)
    outputs = keras.layers.Dense(num_classes, dtype="float32", name="logits")(x)
    return keras.Model(inputs, outputs, name=model_config["name"])


def make_dataset(x, y, batch_size, seed):
    """Shuffled every epoch, fixed batch size (the remainder is dropped)."""
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    dataset = dataset.shuffle(len(x), seed=seed, reshuffle_each_iteration=True)
    return dataset.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)


def build_schedule(schedule_config, peak_learning_rate, steps_per_epoch, epochs):
    """`WarmupPolynomialDecay` over the whole run, and its step counts."""
    total_steps = steps_per_epoch * epochs
    warmup_steps = int(round(schedule_config["warmup_epochs"] * steps_per_epoch))
    decay_steps = total_steps - warmup_steps
    if decay_steps < 1:
        raise ConfigError(
            "`schedule.warmup_epochs` must be less than the number of epochs "
            f"({epochs}). Received: schedule.warmup_epochs="
            f"{schedule_config['warmup_epochs']!r}"
        )
    try:
        schedule = WarmupPolynomialDecay(
            peak_learning_rate=peak_learning_rate,
            warmup_steps=warmup_steps,
            decay_steps=decay_steps,
            end_learning_rate=schedule_config["end_learning_rate"],
            power=schedule_config["power"],
        )
    except ValueError as error:
        raise ConfigError(f"schedule: {' '.join(str(error).split())}") from None
    return schedule


def learning_rate_curve(learning_rate, total_steps):
    """The learning rate of each of `total_steps` steps, as a NumPy array."""
    if isinstance(learning_rate, keras.optimizers.schedules.LearningRateSchedule):
        steps = tf.range(total_steps, dtype=tf.int64)
        return np.asarray(learning_rate(steps), dtype=np.float64) * np.ones(total_steps)
    return np.full(total_steps, float(learning_rate))


def wrap_loss_scale(optimizer, loss_scale_config):
    """Wraps `optimizer` in `tf_lars.LossScaleOptimizer` as configured."""
    import tf_lars

    try:
        return tf_lars.LossScaleOptimizer(
            optimizer,
            initial_scale=loss_scale_config["initial_scale"],
            dynamic=loss_scale_config["dynamic"],
            dynamic_growth_steps=loss_scale_config["dynamic_growth_steps"],
        )
    except ValueError as error:
        raise ConfigError(f"loss_scale: {' '.join(str(error).split())}") from None


class _StopOnNonFinite(keras.callbacks.Callback):
    """Stops at the first non-finite training loss and remembers the epoch."""

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


def fit_once(
    data,
    *,
    model_config,
    optimizer_block,
    learning_rate,
    schedule_config,
    batch_size,
    epochs,
    seed,
    jit_compile="auto",
    precision="float32",
    loss_scale_config=None,
    callbacks=(),
    verbose=0,
    validation=False,
):
    """Builds a model and an optimizer and trains once.

    Args:
        data: a `Dataset`.
        model_config: the `model` block.
        optimizer_block: a validated optimizer block.
        learning_rate: float peak learning rate, or `None` to keep the
            block's own `learning_rate` (float or schedule).
        schedule_config: the `schedule` block; with `name` "none" (or
            `learning_rate=None`) no schedule is added.
        batch_size: int.
        epochs: int.
        seed: int, seeds weights and shuffling.
        jit_compile: "auto" or bool, for `model.compile`.
        precision: a Keras dtype policy name.
        loss_scale_config: the `loss_scale` block or `None`.
        callbacks: extra Keras callbacks.
        verbose: `model.fit` verbosity.
        validation: evaluate on the test set after every epoch.

    Returns:
        A dict: model, optimizer (as compiled), history dict, learning_rate
        (float or schedule), steps_per_epoch, diverged (bool), diverged_epoch,
        train/test loss and accuracy after training, seconds.
    """
    keras.utils.set_random_seed(seed)
    steps_per_epoch = len(data.x_train) // batch_size
    if (
        learning_rate is not None
        and schedule_config.get("name", "warmup_polynomial_decay")
        == "warmup_polynomial_decay"
    ):
        learning_rate = build_schedule(
            schedule_config, learning_rate, steps_per_epoch, epochs
        )
    previous_policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy(precision)
    try:
        model = build_model(model_config, data.x_train.shape[1:], data.num_classes)
        optimizer = optimizer_from_block(optimizer_block, learning_rate=learning_rate)
        scaled = loss_scale_config is not None and loss_scale_config["enabled"]
        if scaled:
            optimizer = wrap_loss_scale(optimizer, loss_scale_config)
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            jit_compile=jit_compile,
            auto_scale_loss=scaled,
        )
        stopper = _StopOnNonFinite()
        started = time.perf_counter()
        history = model.fit(
            make_dataset(data.x_train, data.y_train, batch_size, seed),
            epochs=epochs,
            validation_data=(data.x_test, data.y_test) if validation else None,
            validation_batch_size=1024,
            callbacks=[stopper, *callbacks],
            verbose=verbose,
            shuffle=False,  # the dataset shuffles itself, every epoch
        )
        seconds = time.perf_counter() - started
        train_loss, train_accuracy = model.evaluate(
            data.x_train, data.y_train, batch_size=1024, verbose=0
        )
        test_loss, test_accuracy = model.evaluate(
            data.x_test, data.y_test, batch_size=1024, verbose=0
        )
    finally:
        keras.config.set_dtype_policy(previous_policy)
    if learning_rate is None:
        learning_rate = optimizer_block["config"]["learning_rate"]
        if isinstance(learning_rate, dict):
            learning_rate = keras.optimizers.schedules.deserialize(learning_rate)
    diverged = stopper.diverged_epoch is not None or not math.isfinite(train_loss)
    return {
        "model": model,
        "optimizer": optimizer,
        "history": dict(history.history),
        "learning_rate": learning_rate,
        "steps_per_epoch": steps_per_epoch,
        "diverged": diverged,
        "diverged_epoch": stopper.diverged_epoch,
        "train_loss": float(train_loss),
        "train_accuracy": float(train_accuracy),
        "test_loss": float(test_loss),
        "test_accuracy": float(test_accuracy),
        "seconds": seconds,
    }


def peak_learning_rate(optimizer_block, schedule_config, batch_size):
    """The peak learning rate of a train run, or `None` to keep the block's."""
    learning_rate = optimizer_block["config"].get("learning_rate")
    base_batch_size = schedule_config["base_batch_size"]
    if isinstance(learning_rate, dict):
        if schedule_config["name"] != "none" or base_batch_size is not None:
            raise ConfigError(
                "`optimizer.config.learning_rate` is a serialized schedule; set "
                "`schedule.name` to none and `schedule.base_batch_size` to null to "
                "use it as is"
            )
        return None
    if learning_rate is None:
        learning_rate = constructor_parameters(
            resolve_optimizer_class(optimizer_block)
        )["learning_rate"]
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
    return float(learning_rate)
