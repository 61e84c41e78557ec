"""`tf-lars train`, and the one training run it shares with `tf-lars sweep`.

`tf-lars train` and every grid point of `tf-lars sweep` go through
`build_trial` (seed, model, optimizer: built once, which is also the check of
the optimizer block) and `fit_once`, so the two commands train exactly the
same way. `run` is the `train` command: it writes the run folder.
"""

import contextlib
import json
import math
import os
import time

import keras
import numpy as np
import tensorflow as tf

from tf_lars._validation import is_real
from tf_lars.callbacks import TrustRatioMonitor
from tf_lars.cli.config import (
    ConfigError,
    constructor_parameters,
    dump_config,
    learning_rate_schedule,
    optimizer_from_block,
    resolve_optimizer_class,
    run_dir,
)
from tf_lars.cli.data import load_data
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
    check_model_input(model_config, input_shape)
    width = model_config["width"]
    inputs = keras.Input(shape=input_shape, name="inputs")
    if model_config["name"] == "cnn":
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


def check_model_input(model_config, input_shape):
    """Refuses a CNN for examples that are not images (no Keras needed)."""
    if model_config["name"] == "cnn" and (
        len(input_shape) not in (2, 3) or min(input_shape[:2]) < 2
    ):
        raise ConfigError(
            "`model.name`=cnn needs image examples of shape (H, W) or "
            f"(H, W, C) with H, W >= 2; the data has examples of shape "
            f"{tuple(input_shape)}. Use --set model.name=mlp"
        )


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
    optimizer_block,
    learning_rate,
    schedule_config,
    batch_size,
    epochs,
    seed,
    precision="float32",
    loss_scale_config=None,
    key="optimizer",
):
    """Seeds Keras, then builds the model and the optimizer of one run.

    Building the optimizer is the one check of the optimizer block: a bad
    block raises `ConfigError` here, before anything is written.

    Args:
        data: a `Dataset`.
        model_config: the `model` block.
        optimizer_block: a validated optimizer block.
        learning_rate: float peak learning rate, a schedule, or `None` to
            keep the block's own `learning_rate`.
        schedule_config: the `schedule` block; with a float `learning_rate`
            and `name` "warmup_polynomial_decay" (or no name) the peak gets
            a warm-up + polynomial-decay schedule over the run.
        batch_size: int.
        epochs: int.
        seed: int, seeds the weights (and, in `fit_once`, shuffling).
        precision: a Keras dtype policy name.
        loss_scale_config: the `loss_scale` block or `None`.
        key: str, the optimizer block's dotted key, for error messages.

    Returns:
        A dict: model, optimizer (wrapped when loss-scaled), learning_rate
        (float or schedule, as the optimizer got it), steps_per_epoch,
        precision, loss_scaled (bool), seed.

    Raises:
        ConfigError: a bad schedule, optimizer or loss-scale setting.
    """
    keras.utils.set_random_seed(seed)
    steps_per_epoch = len(data.x_train) // batch_size
    if learning_rate is None and isinstance(
        optimizer_block["config"].get("learning_rate"), dict
    ):
        learning_rate = learning_rate_schedule(
            optimizer_block["config"]["learning_rate"], f"{key}.config.learning_rate"
        )
    if (
        is_real(learning_rate)
        and schedule_config.get("name", "warmup_polynomial_decay")
        == "warmup_polynomial_decay"
    ):
        learning_rate = build_schedule(
            schedule_config, learning_rate, steps_per_epoch, epochs
        )
    with _dtype_policy(precision):
        model = build_model(model_config, data.x_train.shape[1:], data.num_classes)
        optimizer = optimizer_from_block(
            optimizer_block, learning_rate=learning_rate, key=key
        )
        scaled = loss_scale_config is not None and loss_scale_config["enabled"]
        if scaled:
            optimizer = wrap_loss_scale(optimizer, loss_scale_config)
    if learning_rate is None:
        learning_rate = optimizer_block["config"].get("learning_rate")
        if learning_rate is None:
            inner = getattr(optimizer, "inner_optimizer", optimizer)
            learning_rate = constructor_parameters(type(inner))["learning_rate"]
    return {
        "model": model,
        "optimizer": optimizer,
        "learning_rate": learning_rate,
        "steps_per_epoch": steps_per_epoch,
        "precision": precision,
        "loss_scaled": scaled,
        "seed": seed,
    }


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
):
    """Trains a `build_trial` model once.

    Args:
        data: a `Dataset`.
        trial: the dict `build_trial` returned.
        batch_size: int.
        epochs: int.
        jit_compile: "auto" or bool, for `model.compile`.
        callbacks: extra Keras callbacks.
        verbose: `model.fit` verbosity.
        validation: evaluate on the test set after every epoch.

    Returns:
        A dict: model, optimizer (as compiled), history dict, learning_rate
        (float or schedule), steps_per_epoch, diverged (bool), diverged_epoch,
        train/test loss and accuracy after training, seconds.
    """
    model = trial["model"]
    optimizer = trial["optimizer"]
    with _dtype_policy(trial["precision"]):
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            jit_compile=jit_compile,
            auto_scale_loss=trial["loss_scaled"],
        )
        stopper = _StopOnNonFinite()
        started = time.perf_counter()
        history = model.fit(
            make_dataset(data.x_train, data.y_train, batch_size, trial["seed"]),
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
    diverged = stopper.diverged_epoch is not None or not math.isfinite(train_loss)
    return {
        "model": model,
        "optimizer": optimizer,
        "history": dict(history.history),
        "learning_rate": trial["learning_rate"],
        "steps_per_epoch": trial["steps_per_epoch"],
        "diverged": diverged,
        "diverged_epoch": stopper.diverged_epoch,
        "train_loss": float(train_loss),
        "train_accuracy": float(train_accuracy),
        "test_loss": float(test_loss),
        "test_accuracy": float(test_accuracy),
        "seconds": seconds,
    }


def peak_learning_rate(optimizer_block, schedule_config, batch_size):
    """The learning rate of a train run: its float peak, or a saved schedule.

    Returns:
        A float, or the deserialized schedule when the block's
        `learning_rate` is one (then `schedule.name` must be none and
        `schedule.base_batch_size` null).

    Raises:
        ConfigError: a schedule with a schedule, or a peak <= 0.
    """
    learning_rate = optimizer_block["config"].get("learning_rate")
    base_batch_size = schedule_config["base_batch_size"]
    if isinstance(learning_rate, dict):
        if schedule_config["name"] != "none" or base_batch_size is not None:
            raise ConfigError(
                "`optimizer.config.learning_rate` is a serialized schedule; set "
                "`schedule.name` to none and `schedule.base_batch_size` to null to "
                "use it as is"
            )
        return learning_rate_schedule(learning_rate)
    if learning_rate is None:
        learning_rate = constructor_parameters(
            resolve_optimizer_class(optimizer_block)
        )["learning_rate"]
    if not (is_real(learning_rate) and math.isfinite(learning_rate)):
        raise ConfigError(
            "`optimizer.config.learning_rate` must be a finite number or a "
            "serialized learning-rate schedule. "
            f"Received: optimizer.config.learning_rate={learning_rate!r}"
        )
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


# ------------------------------------------------------------ the command
def _json_number(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def run(config):
    """`tf-lars train`: one training run, written to the run folder.

    Args:
        config: a validated train config (`tf_lars.cli.config.load_config`).

    Returns:
        The exit status, 0 (a diverged run included).

    Raises:
        ConfigError, DataError: before any file is written.
    """
    from tf_lars.cli.plots import plot_curves, plot_learning_rate, plot_trust_ratios

    data = load_data(config["data"])
    training = config["training"]
    batch_size = resolve_batch_size(
        training["batch_size"], len(data.x_train), "training.batch_size"
    )
    learning_rate = peak_learning_rate(
        config["optimizer"], config["schedule"], batch_size
    )
    # Model, schedule, optimizer and loss scale: built once, before any file
    # is written, so a bad setting leaves nothing behind.
    trial = build_trial(
        data,
        model_config=config["model"],
        optimizer_block=config["optimizer"],
        learning_rate=learning_rate,
        schedule_config=config["schedule"],
        batch_size=batch_size,
        epochs=training["epochs"],
        seed=config["seed"],
        precision=training["precision"],
        loss_scale_config=config["loss_scale"],
    )
    folder = run_dir(config, "train")
    os.makedirs(folder, exist_ok=True)
    print(
        f"Data: {len(data.x_train)} training / {len(data.x_test)} test examples, "
        f"{data.num_classes} classes ({data.source})"
    )
    print(f"Run folder: {folder}")

    callbacks = []
    monitor = None
    # Only optimizers that expose trust ratios (LARS) get the monitor.
    inner = getattr(trial["optimizer"], "inner_optimizer", trial["optimizer"])
    if "trust_coefficient" in constructor_parameters(type(inner)):
        monitor = TrustRatioMonitor(
            log_every_n_batches=config["monitor"]["log_every_n_batches"],
            log_dir=(
                os.path.join(folder, "tensorboard")
                if config["monitor"]["tensorboard"]
                else None
            ),
        )
        callbacks.append(monitor)
    result = fit_once(
        data,
        trial,
        batch_size=batch_size,
        epochs=training["epochs"],
        jit_compile=training["jit_compile"],
        callbacks=callbacks,
        verbose=training["verbose"],
        validation=True,
    )
    steps_per_epoch = result["steps_per_epoch"]
    epochs_run = len(result["history"].get("loss", []))
    total_steps = steps_per_epoch * epochs_run

    # Files: the resolved config first, so a crash below still leaves it.
    resolved = dict(config)
    optimizer = result["optimizer"]
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    inner_config = inner.get_config()
    block_learning_rate = config["optimizer"]["config"].get("learning_rate")
    if block_learning_rate is None:
        inner_config.pop("learning_rate", None)
    else:
        inner_config["learning_rate"] = block_learning_rate
    resolved["optimizer"] = {
        "class_name": config["optimizer"]["class_name"],
        "config": inner_config,
    }
    with open(os.path.join(folder, "config.yaml"), "w", encoding="utf-8") as handle:
        handle.write(dump_config(resolved))
    history = {
        key: [_json_number(float(v)) for v in values]
        for key, values in result["history"].items()
    }
    learning_rates = learning_rate_curve(result["learning_rate"], max(total_steps, 1))
    history["learning_rate_at_epoch_end"] = [
        float(learning_rates[min((epoch + 1) * steps_per_epoch, total_steps) - 1])
        for epoch in range(epochs_run)
    ]
    with open(os.path.join(folder, "history.json"), "w", encoding="utf-8") as handle:
        json.dump(
            {"epoch": list(range(1, epochs_run + 1)), **history}, handle, indent=1
        )
    summary = {
        "train_accuracy": result["train_accuracy"],
        "test_accuracy": result["test_accuracy"],
        "train_loss": _json_number(result["train_loss"]),
        "test_loss": _json_number(result["test_loss"]),
        "diverged": result["diverged"],
        "diverged_epoch": result["diverged_epoch"],
        "epochs_run": epochs_run,
        "batch_size": batch_size,
        "steps_per_epoch": steps_per_epoch,
        "peak_learning_rate": float(np.max(learning_rates)),
        "learning_rate_schedule": (
            keras.saving.serialize_keras_object(result["learning_rate"])
            if not isinstance(result["learning_rate"], float)
            else result["learning_rate"]
        ),
        "optimizer": type(optimizer).__name__,
        "inner_optimizer": type(inner).__name__,
        "train_seconds": result["seconds"],
        "data": data.source,
    }
    with open(os.path.join(folder, "summary.json"), "w", encoding="utf-8") as handle:
        json.dump(summary, handle, indent=1, default=str)
    result["model"].save(os.path.join(folder, "model.keras"))
    plot_curves(result["history"], os.path.join(folder, "curves.png"))
    plot_learning_rate(
        learning_rates, steps_per_epoch, os.path.join(folder, "learning_rate.png")
    )
    files = [
        "config.yaml",
        "history.json",
        "summary.json",
        "model.keras",
        "curves.png",
        "learning_rate.png",
    ]
    if monitor is not None and len(monitor.trust_ratios):
        epoch_rows = [
            i
            for i, epoch in enumerate(monitor.epochs)
            if i + 1 == len(monitor.epochs) or monitor.epochs[i + 1] != epoch
        ]
        plot_trust_ratios(
            monitor.paths,
            [monitor.epochs[i] + 1 for i in epoch_rows],
            monitor.trust_ratios[epoch_rows],
            os.path.join(folder, "trust_ratio.png"),
        )
        np.savez(
            os.path.join(folder, "trust_ratios.npz"),
            trust_ratios=monitor.trust_ratios,
            steps=np.asarray(monitor.steps),
            epochs=np.asarray(monitor.epochs),
            paths=np.asarray(monitor.paths),
        )
        files += ["trust_ratio.png", "trust_ratios.npz"]
    if config["monitor"]["tensorboard"] and monitor is not None:
        files.append("tensorboard/")

    print()
    if result["diverged"]:
        print(
            "Training DIVERGED: the loss became NaN/inf in epoch "
            f"{(result['diverged_epoch'] or 0) + 1}; stopped there."
        )
    print(f"Final train accuracy: {100 * result['train_accuracy']:.2f}%")
    print(f"Final test accuracy:  {100 * result['test_accuracy']:.2f}%")
    print(f"Wrote {folder}/: {', '.join(files)}")
    return 0
