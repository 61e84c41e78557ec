"""The `tf-lars` command line: `train`, `sweep` and `bench`.

```
tf-lars train [--config FILE] [--set key=value ...]
tf-lars sweep [--config FILE] [--set key=value ...]
tf-lars bench [bench arguments ...]
```

`train` runs one training from a YAML config (the embedded default trains a
small CNN with LARS on scikit-learn's digits in about 15 seconds on 2 CPU cores)
and writes a run folder. `sweep` trains SGD-with-momentum and LARS across
batch sizes and learning rates and prints a table of test accuracy. `bench`
runs `tf_lars.bench`, the optimizer step benchmarks.

Configuration or data problems print one line to stderr and exit with
status 2. See the README (section "The `tf-lars` command line") for every config key.
"""

import argparse
import datetime
import json
import math
import os
import sys

# Quiet TensorFlow's C++ INFO lines in this process and in the sweep's
# spawned workers (which inherit the environment). In this process it only
# helps if nothing imported TensorFlow yet.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

EXIT_USAGE = 2

_DESCRIPTION = (
    "Large-batch training experiments with tf_lars (LARS for Keras 3): "
    "train one model, sweep batch sizes, or benchmark optimizer steps."
)


def _parser():
    parser = argparse.ArgumentParser(prog="tf-lars", description=_DESCRIPTION)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    for name, help_text in (
        (
            "train",
            "train a Keras model with the configured optimizer and write a run "
            "folder (config, history, model, plots)",
        ),
        (
            "sweep",
            "train SGD-with-momentum and LARS across batch sizes and learning "
            "rates; print a table and save a plot",
        ),
    ):
        command = commands.add_parser(name, help=help_text, description=help_text)
        command.add_argument(
            "--config",
            metavar="FILE",
            help=f"YAML config merged over the embedded default "
            f"(tf_lars/configs/{name}.yaml)",
        )
        command.add_argument(
            "--set",
            dest="overrides",
            metavar="KEY=VALUE",
            action="append",
            default=[],
            help="override one config key, e.g. --set training.epochs=5 "
            "(value parsed as YAML; repeatable)",
        )
    commands.add_parser(
        "bench",
        help="optimizer step benchmarks (tf_lars.bench), printed as a table",
        add_help=False,
    )
    return parser


def _error(command, message):
    print(f"tf-lars {command}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _run_dir(config, command):
    name = config["run_name"] or (
        f"{command}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    )
    return os.path.join(config["output_dir"], name)


def _json_number(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _quiet_python_logs():
    import logging

    import absl.logging

    absl.logging.set_verbosity(absl.logging.ERROR)
    logging.getLogger("tensorflow").setLevel(logging.ERROR)


def _train(config):
    import keras
    import numpy as np

    from tf_lars._cli_data import load_data
    from tf_lars._cli_plots import plot_curves, plot_learning_rate, plot_trust_ratios
    from tf_lars._cli_train import (
        build_model,
        build_schedule,
        fit_once,
        learning_rate_curve,
        peak_learning_rate,
        resolve_batch_size,
        wrap_loss_scale,
    )
    from tf_lars._config import dump_config, optimizer_from_block
    from tf_lars.callbacks import TrustRatioMonitor

    data = load_data(config["data"])
    training = config["training"]
    batch_size = resolve_batch_size(
        training["batch_size"], len(data.x_train), "training.batch_size"
    )
    learning_rate = peak_learning_rate(
        config["optimizer"], config["schedule"], batch_size
    )
    # Refuse a bad schedule, optimizer or loss-scale setting before any file
    # is written (fit_once builds them again from the same values).
    steps_per_epoch = len(data.x_train) // batch_size
    schedule = learning_rate
    if learning_rate is not None and config["schedule"]["name"] != "none":
        schedule = build_schedule(
            config["schedule"], learning_rate, steps_per_epoch, training["epochs"]
        )
    build_model(config["model"], data.x_train.shape[1:], data.num_classes)
    optimizer = optimizer_from_block(config["optimizer"], learning_rate=schedule)
    if config["loss_scale"]["enabled"]:
        wrap_loss_scale(optimizer, config["loss_scale"])
    run_dir = _run_dir(config, "train")
    os.makedirs(run_dir, exist_ok=True)
    print(
        f"Data: {len(data.x_train)} training / {len(data.x_test)} test examples, "
        f"{data.num_classes} classes ({data.source})"
    )
    print(f"Run folder: {run_dir}")

    callbacks = []
    monitor = None
    # Only optimizers that expose trust ratios (LARS) get the monitor.
    from tf_lars._config import resolve_optimizer_class

    optimizer_class = resolve_optimizer_class(config["optimizer"])
    if "trust_coefficient" in _constructor_arguments(optimizer_class):
        monitor = TrustRatioMonitor(
            log_every_n_batches=config["monitor"]["log_every_n_batches"],
            log_dir=(
                os.path.join(run_dir, "tensorboard")
                if config["monitor"]["tensorboard"]
                else None
            ),
        )
        callbacks.append(monitor)
    result = fit_once(
        data,
        model_config=config["model"],
        optimizer_block=config["optimizer"],
        learning_rate=learning_rate,
        schedule_config=config["schedule"],
        batch_size=batch_size,
        epochs=training["epochs"],
        seed=config["seed"],
        jit_compile=training["jit_compile"],
        precision=training["precision"],
        loss_scale_config=config["loss_scale"],
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
    with open(os.path.join(run_dir, "config.yaml"), "w", encoding="utf-8") as handle:
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
    with open(os.path.join(run_dir, "history.json"), "w", encoding="utf-8") as handle:
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
    with open(os.path.join(run_dir, "summary.json"), "w", encoding="utf-8") as handle:
        json.dump(summary, handle, indent=1, default=str)
    result["model"].save(os.path.join(run_dir, "model.keras"))
    plot_curves(result["history"], os.path.join(run_dir, "curves.png"))
    plot_learning_rate(
        learning_rates, steps_per_epoch, os.path.join(run_dir, "learning_rate.png")
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
            os.path.join(run_dir, "trust_ratio.png"),
        )
        np.savez(
            os.path.join(run_dir, "trust_ratios.npz"),
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
    print(f"Wrote {run_dir}/: {', '.join(files)}")
    return 0


def _constructor_arguments(cls):
    from tf_lars._config import constructor_parameters

    return constructor_parameters(cls)


def _sweep(config):
    from tf_lars._cli_sweep import run_sweep

    run_sweep(config, _run_dir(config, "sweep"))
    return 0


def _bench(argv):
    try:
        from tf_lars import bench
    except ModuleNotFoundError as error:
        if error.name not in ("tf_lars.bench",):
            raise
        return _error("bench", "tf_lars.bench is not part of this installation")
    return int(bench.main(list(argv)) or 0)


def main(argv=None):
    """Runs the `tf-lars` command line.

    Args:
        argv: list of str, the arguments after the program name. Defaults to
            `sys.argv[1:]`.

    Returns:
        The exit status: 0 on success, 2 for a bad command line, config or
        data (with a one-line message on stderr).

    Example:

    >>> from tf_lars import cli
    >>> cli.main(["train", "--set", "training.epochs=2"])  # doctest: +SKIP
    0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    try:
        arguments = parser.parse_args(argv)
    except SystemExit as exit_request:
        return int(exit_request.code or 0)
    from tf_lars._cli_data import DataError
    from tf_lars._config import ConfigError, load_config

    try:
        config = load_config(arguments.command, arguments.config, arguments.overrides)
        _quiet_python_logs()
        if arguments.command == "train":
            return _train(config)
        return _sweep(config)
    except (ConfigError, DataError) as error:
        return _error(arguments.command, str(error))


if __name__ == "__main__":
    sys.exit(main())
