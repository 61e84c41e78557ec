"""`tf-lars lowcomm`: how much each way of training across workers
communicates, and what it costs in accuracy.

M workers are simulated in one process, each with its own copy of the
model, its own shard of the training set and its own inner optimizer; every
method takes the same number of inner steps per worker, on the same batches:

- `dp`: synchronous data parallel: the workers' gradients averaged at every
  step, one optimizer on the mean (what `MultiWorkerMirroredStrategy` does).
- `diloco`: synchronous DiLoCo (`tf_lars.DiLoCo` and `simulate_sync`): H
  inner steps, then the mean pseudo-gradient through the outer optimizer.
- `agn`: AGN's commit (the accumulated gradient / H through a copy of the
  inner optimizer), asynchronous: in each round every worker pulls the
  center and takes H steps, and the commits reach the center one after
  another (worker m's commit is m commits stale).
- `async_diloco`: the same rounds with AGN's outer optimizer: each commit's
  pseudo-gradient `pulled - local`, at the outer learning rate / M (a round
  of M commits then moves the center as far as one synchronous outer step).

Where H does not divide the steps, the last, shorter round is exchanged
too, so that every inner step reaches the evaluated model.

Bytes are counted per worker from the tensors exchanged: a synchronous
exchange sends the worker's payload and receives the other M - 1 workers'
(the all-gather of `tf_lars.distribute.synchronize`); an asynchronous round
pushes one commit and pulls the center back. Wall time is the simulation's
own (M workers on one machine, one after another), for comparing methods.
The rules and the measured table: docs/guides/low-communication.md.
"""

import json
import os
import time

import keras
import numpy as np
import tensorflow as tf

from tf_lars.agn import local_step, normalized, pseudo_gradients, reset
from tf_lars.diloco import DiLoCo, simulate_sync

METHODS = ("dp", "agn", "async_diloco", "diloco")
LABELS = {
    "dp": "sync data parallel",
    "agn": "AGN",
    "async_diloco": "async DiLoCo",
    "diloco": "sync DiLoCo",
}


def _model(input_shape, num_classes, model_config, seed):
    from tf_lars.cli.train import build_model

    keras.utils.set_random_seed(seed)
    return build_model(model_config, input_shape, num_classes)


def _optimizer(block, key, divide_rate_by=1):
    from tf_lars.cli.config import ConfigError, build_optimizer, optimizer_spec

    spec = optimizer_spec(block, key)
    if divide_rate_by == 1:
        return build_optimizer(spec)
    if not isinstance(spec.learning_rate, int | float):
        raise ConfigError(
            f"`{key}.config.learning_rate` must be a number: it is divided by M. "
            f"Received: {key}.config.learning_rate={spec.learning_rate!r}",
            key=f"{key}.config.learning_rate",
        )
    return build_optimizer(spec, spec.learning_rate / divide_rate_by)


def optimizers(method, workers, sync_every, settings, copies=None):
    """What `run_one` trains `method` with, built (`copies` worker
    optimizers, default `workers`): data parallel's one optimizer; DiLoCo's
    workers; or the workers' inner optimizers and then the center's (AGN's:
    the inner one; async DiLoCo's: `async_outer` at its learning rate / M).
    """
    from tf_lars.cli.config import ConfigError, one_line

    copies = workers if copies is None else copies
    inner = lambda: _optimizer(settings["inner"], "inner_optimizer")  # noqa: E731
    if method == "dp":
        return [inner()]
    if method == "diloco":
        try:
            return [
                DiLoCo(
                    inner(),
                    _optimizer(settings["outer"], "outer_optimizer"),
                    sync_every=sync_every,
                    exchange="external",  # `simulate_sync` takes the outer steps
                )
                for _ in range(copies)
            ]
        except ConfigError:
            raise
        except ValueError as error:
            raise ConfigError(
                f"the run {LABELS[method]}, M={workers}, H={sync_every} is refused, "
                f"so no run started: {one_line(error)}",
                key="outer_optimizer",
            ) from None
    if method == "agn":
        center = inner()
    else:
        center = _optimizer(settings["async_outer"], "async_outer_optimizer", workers)
    return [inner() for _ in range(copies)] + [center]


def _batches(data, workers, settings):
    """Each step's batch for every worker: `(x, y)` of shape `(M, B, ...)`,
    every worker drawing from its own shard, reshuffled per pass."""
    rng = np.random.default_rng(settings["seed"])
    shards = np.array_split(rng.permutation(len(data.y_train)), workers)
    size = settings["batch_size"]
    orders = [rng.permutation(s) for s in shards]
    at = 0
    for _ in range(settings["steps"]):
        if at + size > min(len(s) for s in shards):
            orders, at = [rng.permutation(s) for s in shards], 0
        rows = np.stack([order[at : at + size] for order in orders])
        at += size
        yield tf.constant(data.x_train[rows]), tf.constant(data.y_train[rows])


def _accuracy(model, weights, x, y):
    for variable, value in zip(model.trainable_variables, weights, strict=True):
        variable.assign(value)
    logits = model(x, training=False)
    return float(np.mean(np.argmax(logits, axis=-1) == y))


class _Simulation:
    """M models from one initialization, and their gradients in one call."""

    def __init__(self, data, workers, settings):
        shape = data.x_train.shape[1:]
        self.models = [
            _model(shape, data.num_classes, settings["model"], settings["seed"])
            for _ in range(workers)
        ]
        self.variables = [m.trainable_variables for m in self.models]
        self.loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.payload = sum(int(np.prod(v.shape)) * 4 for v in self.variables[0])

    def gradients(self, x, y):
        grads = []
        for m, model in enumerate(self.models):
            with tf.GradientTape() as tape:
                loss = self.loss(y[m], model(x[m], training=True))
            grads.append(tape.gradient(loss, model.trainable_variables))
        return grads


def run_one(method, data, workers, sync_every, settings):
    """Trains with `method` on `workers` simulated workers; returns its row."""
    sim = _Simulation(data, workers, settings)
    variables, payload = sim.variables, sim.payload
    built = optimizers(method, workers, sync_every, settings)
    batches = _batches(data, workers, settings)
    if method == "dp":
        sync_every = 1
        (optimizer,) = built
        optimizer.build(variables[0])

        @tf.function
        def step(x, y):
            grads = sim.gradients(x, y)
            mean = [tf.add_n(list(g)) / workers for g in zip(*grads, strict=True)]
            optimizer.apply(mean, variables[0])
            for others in variables[1:]:
                for target, value in zip(others, variables[0], strict=True):
                    target.assign(value)

        def exchange():
            pass  # inside `step`: the mean gradient

    elif method == "diloco":
        for optimizer, vs in zip(built, variables, strict=True):
            optimizer.build(vs)

        @tf.function
        def step(x, y):
            for optimizer, grads, vs in zip(
                built, sim.gradients(x, y), variables, strict=True
            ):
                optimizer.apply(grads, vs)

        exchange = tf.function(lambda: simulate_sync(built, variables))

    else:
        center = [tf.Variable(v) for v in variables[0]]
        *local, center_optimizer = built
        for optimizer, vs in zip(local, variables, strict=True):
            optimizer.build(vs)
        accumulators = [[tf.Variable(tf.zeros_like(v)) for v in vs] for vs in variables]
        center_optimizer.build(center)

        @tf.function
        def step(x, y):
            for optimizer, grads, vs, acc in zip(
                local, sim.gradients(x, y), variables, accumulators, strict=True
            ):
                local_step(optimizer, optimizer, vs, acc, grads)

        @tf.function
        def exchange():
            pulled = [tf.convert_to_tensor(c) for c in center]
            # The commits reach the center one after another, each computed
            # from the center as it was pulled at the round's start. AGN
            # divides by H in a last, shorter round too, as in every round
            # (with inner SGD its commit stays async DiLoCo's at rate M / H).
            for vs, acc in zip(variables, accumulators, strict=True):
                if method == "agn":
                    grads = normalized(acc, sync_every)
                else:
                    grads = pseudo_gradients(pulled, vs)
                center_optimizer.apply(grads, center)
            for optimizer, vs, acc in zip(local, variables, accumulators, strict=True):
                reset(optimizer, vs, center, acc)

    exchanges = 0
    start = time.perf_counter()
    for number, (x, y) in enumerate(batches, start=1):
        step(x, y)
        if number % sync_every == 0:
            exchange()
            exchanges += 1
    if settings["steps"] % sync_every:
        # The last round, shorter than H: exchanged, so that its steps reach
        # the evaluated model as every other round's do.
        exchange()
        exchanges += 1
    wall = time.perf_counter() - start
    if method == "dp":
        final, received = variables[0], payload * (workers - 1) * exchanges
    elif method == "diloco":
        final = built[0].global_variables
        received = payload * (workers - 1) * exchanges
    else:
        final, received = center, payload * exchanges  # one pull per round
    final = [v.numpy() for v in final]
    row = {
        "method": method,
        "label": LABELS[method],
        "workers": workers,
        "sync_every": 1 if method == "dp" else sync_every,
        "test_accuracy": _accuracy(sim.models[0], final, data.x_test, data.y_test),
        "wall_seconds": wall,
        "exchanges": exchanges,
        "bytes_sent": payload * exchanges,
        "bytes_received": received,
    }
    return row, final


def plan(config):
    """The runs, in order: per M, data parallel, then each H's three."""
    runs = []
    for workers in config["workers"]:
        runs.append(("dp", workers, 1))
        for sync_every in config["sync_every"]:
            runs.extend((m, workers, sync_every) for m in METHODS[1:])
    return runs


def _settings(config):
    return {
        "seed": config["seed"],
        "steps": config["training"]["steps"],
        "batch_size": config["training"]["batch_size"],
        "model": config["model"],
        "inner": config["inner_optimizer"],
        "outer": config["outer_optimizer"],
        "async_outer": config["async_outer_optimizer"],
    }


def format_table(rows):
    """The Markdown table: one row per run, DP first in each M."""
    dp = {r["workers"]: r for r in rows if r["method"] == "dp"}
    lines = [
        "| method | M | H | test accuracy (%) | vs DP (points) | bytes per worker "
        "(sent + received) | fewer bytes than DP | wall (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        base = dp.get(r["workers"])
        total = r["bytes_sent"] + r["bytes_received"]
        versus = ratio = "-"  # no data parallel run to compare with
        if base is not None:
            versus = f"{100 * (r['test_accuracy'] - base['test_accuracy']):+.2f}"
            base_total = base["bytes_sent"] + base["bytes_received"]
            if total and base_total:  # no ratio of nothing
                ratio = f"{base_total / total:.0f}x"
        lines.append(
            f"| {r['label']} | {r['workers']} | {r['sync_every']} | "
            f"{100 * r['test_accuracy']:.2f} | {versus} | {total:,} | {ratio} | "
            f"{r['wall_seconds']:.1f} |"
        )
    return "\n".join(lines)


def _write_results(folder, data, rows, wall=None, **extra):
    """results.json and table.md of the finished runs; the table."""
    from tf_lars.cli import preflight

    table = format_table(rows)
    record = {"source": data.source, "wall_seconds": wall, "runs": rows, **extra}
    preflight.write_text(folder, "results.json", json.dumps(record, indent=1))
    preflight.write_text(folder, "table.md", table + "\n")
    return table


def _interrupted(folder, data, rows, planned, interrupt):
    """Writes the finished runs and a note; the exception `main` reports."""
    from tf_lars.cli import preflight

    _write_results(folder, data, rows, interrupted=True, runs_planned=planned)
    preflight.write_text(
        folder,
        preflight.INTERRUPTED_NOTE,
        f"Interrupted ({preflight.interruption_name(interrupt)}) after "
        f"{len(rows)} of {planned} runs. results.json and table.md hold the "
        "finished ones; lowcomm.png was not drawn.\n",
    )
    return preflight.Interrupted(
        f"the run folder {folder} keeps config.yaml, results.json and table.md of "
        f"the {len(rows)} of {planned} runs that finished, and "
        f"{preflight.INTERRUPTED_NOTE}"
    )


def run(config, data, folder, overwrite=False, out=print):
    """`tf-lars lowcomm`: every run of `plan(config)`, the table and the plot.

    Writes config.yaml, results.json, table.md and lowcomm.png to `folder`;
    prints one line per finished run, then the table.
    """
    from tf_lars.cli import preflight
    from tf_lars.cli.config import dump_config
    from tf_lars.cli.main import deferred
    from tf_lars.cli.plots import plot_communication

    settings = _settings(config)
    runs, rows = plan(config), []
    for method, workers, sync_every in runs:
        # What each run builds, built now: a block that one run refuses is one
        # line before any run, not a traceback after the others.
        optimizers(method, workers, sync_every, settings, copies=1)
    preflight.open_run_dir(folder, "lowcomm")
    preflight.write_text(folder, "config.yaml", dump_config(config))
    started = time.perf_counter()
    for number, (method, workers, sync_every) in enumerate(runs, start=1):
        try:
            with deferred():
                row, _ = run_one(method, data, workers, sync_every, settings)
            rows.append(row)
            # Kept as each run finishes: a later failure loses none of them.
            _write_results(folder, data, rows, runs_planned=len(runs))
            out(
                f"[{number}/{len(runs)}] {row['label']}, M={workers}, "
                f"H={row['sync_every']}: test accuracy "
                f"{100 * row['test_accuracy']:.2f}%, "
                f"{row['bytes_sent'] + row['bytes_received']:,} bytes per worker, "
                f"{row['wall_seconds']:.1f}s",
                flush=True,
            )
        except KeyboardInterrupt as interrupt:
            raise _interrupted(folder, data, rows, len(runs), interrupt) from None
    wall = time.perf_counter() - started
    table = _write_results(folder, data, rows, wall, runs_planned=len(runs))
    plot_communication(rows, os.path.join(folder, "lowcomm.png"))
    out(
        f"\nTest accuracy after {settings['steps']} inner steps per worker, "
        f"{data.source}:\n{table}\n\nWall time {wall:.0f}s. Results in {folder}/ "
        "(results.json, table.md, lowcomm.png, config.yaml)"
    )
    return 0
