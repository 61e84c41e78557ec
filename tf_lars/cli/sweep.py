"""`tf-lars sweep`: accuracy against batch size, one column pair per optimizer.

For every batch size and every configured optimizer, the learning rate is
scaled linearly from `sweep.base_batch_size` (`base_learning_rate * batch /
base_batch_size`), then multiplied by each of `sweep.grid_factors` (the
factor 1 is always run: it is the "linear" result). Each grid point is one
`build_trial` + `fit_once` run with the same model, seed, epochs and
warm-up + polynomial decay schedule, in a `ProcessPoolExecutor` of spawned
workers (each its own TensorFlow, imported quietly, pinned to `cores //
workers` threads). A line is printed per finished training, under a `rich`
progress bar on a terminal; the table is Markdown (`rich`'s Markdown box).

Every grid point's schedule and optimizer are built before the first
training, so a learning rate out of range refuses the whole sweep at once. A
worker that dies (SIGKILL, the out-of-memory killer) ends the sweep:
`WorkerLost`, with the finished trainings written.
"""

import concurrent.futures
import contextlib
import io
import itertools
import json
import math
import multiprocessing
import os
import signal
import time

from rich import box
from rich.console import Console
from rich.progress import MofNCompleteColumn, Progress, TimeElapsedColumn
from rich.table import Table

from tf_lars.cli import preflight
from tf_lars.cli.config import ConfigError, dump_config

_WORKER_DATA = {}
_CHOICES = {"linear": "linear LR", "best": "best of grid"}


class WorkerLost(ConfigError):
    """A worker process ended without its training's result (a signal, e.g.
    the out-of-memory killer's SIGKILL). A `ConfigError`, so that `tf-lars`
    reports it as one line and exit status 2; the message says what the run
    folder keeps."""


def available_cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def plan(config, num_train):
    """The grid points a validated sweep config asks for."""
    # Imported here: the workers import this module before TensorFlow.
    from tf_lars.schedules import linear_scaled_learning_rate as linear

    sweep = config["sweep"]
    batch_sizes = sorted(
        {
            preflight.resolve_batch_size(size, num_train, f"sweep.batch_sizes.{i}")
            for i, size in enumerate(sweep["batch_sizes"])
        }
    )
    factors = sorted(set(sweep["grid_factors"]) | {1.0})
    tasks, optimizers = [], config["optimizers"]
    for size, entry, factor in itertools.product(batch_sizes, optimizers, factors):
        rate = linear(entry["base_learning_rate"], size, sweep["base_batch_size"])
        task = {"batch_size": size, "label": entry["label"], "factor": factor}
        task.update(learning_rate=rate * factor, optimizer=entry["optimizer"])
        tasks.append(task)
    return batch_sizes, factors, tasks


def _init_worker(threads):
    from tf_lars.cli import import_tensorflow, quiet_python_logs

    tf = import_tensorflow()
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    quiet_python_logs()


def _schedule(config, task, num_train):
    from tf_lars.cli.train import build_schedule

    steps_per_epoch = num_train // task["batch_size"]
    epochs = config["training"]["epochs"]
    return build_schedule(
        config["schedule"], task["learning_rate"], steps_per_epoch, epochs
    )


def run_task(config, task):
    """Trains one grid point; returns a JSON-able result dict."""
    from tf_lars.cli.config import optimizer_spec
    from tf_lars.cli.data import load_data
    from tf_lars.cli.train import build_trial, fit_once

    key = json.dumps(config["data"], sort_keys=True)
    if key not in _WORKER_DATA:
        _WORKER_DATA[key] = load_data(config["data"])
    data = _WORKER_DATA[key]
    trial = build_trial(
        data,
        model_config=config["model"],
        optimizer=optimizer_spec(task["optimizer"]),
        learning_rate=_schedule(config, task, len(data.x_train)),
        batch_size=task["batch_size"],
        seed=config["seed"],
    )
    training = config["training"]
    result = fit_once(
        data,
        trial,
        batch_size=task["batch_size"],
        epochs=training["epochs"],
        jit_compile=training["jit_compile"],
        verbose=0,
    )
    loss = result["train_loss"]
    # A run that ends with a finite loss still at chance level (every logit
    # constant: typically all ReLUs switched off by too large early steps).
    collapsed = (
        not result["diverged"]
        and loss >= 0.95 * math.log(data.num_classes)
        and result["train_accuracy"] < 1.5 / data.num_classes
    )
    return {
        **{name: value for name, value in task.items() if name != "optimizer"},
        "test_accuracy": result["test_accuracy"],
        "train_accuracy": result["train_accuracy"],
        "train_loss": loss if loss is not None and math.isfinite(loss) else None,
        "diverged": result["diverged"],
        "diverged_epoch": result["diverged_epoch"],
        "collapsed": collapsed,
        "epochs_run": len(result["history"].get("loss", [])),
        "steps_per_epoch": result["steps_per_epoch"],
        "seconds": result["seconds"],
    }


def _describe(task):
    choice = "linear" if task["factor"] == 1.0 else f"x{task['factor']:g}"
    return (
        f"{task['label']:<14} batch {task['batch_size']:>5}  "
        f"lr {task['learning_rate']:<8.4g} {'(' + choice + ')':<11}"
    )


def _print(line):
    print(line, flush=True)  # progress, live through a pipe too


def execute(config, tasks, workers, out=_print, results=None):
    """Runs every task, in `workers` processes; prints a line per result.

    `results`, a list of `len(tasks)` Nones when given, is filled in place as
    the trainings finish, so a caller keeps the finished ones on Ctrl-C.
    """
    cores = available_cores()
    threads = max(1, cores // workers)
    total = len(tasks)
    out(
        f"Running {total} trainings on {workers} worker process(es) x "
        f"{threads} thread(s) ({cores} core(s) available)."
    )
    results = [None] * total if results is None else results
    # Most expensive first (smallest batches take the most steps), so the
    # last process to finish is not left alone with a long run.
    order = sorted(range(total), key=lambda i: tasks[i]["batch_size"])
    # Drawn on a terminal only (and erased at the end); a pipe gets the lines.
    columns = [*Progress.get_default_columns(), MofNCompleteColumn()]
    off = not Console().is_interactive
    bar = Progress(*columns, TimeElapsedColumn(), transient=True, disable=off)
    started = time.perf_counter()
    with bar, _finished(config, tasks, order, workers, threads) as finished:
        progress = bar.add_task("sweep", total=total)
        for done, (index, result) in enumerate(finished, start=1):
            # Kept before it is printed: a Ctrl-C right after the line shows a
            # training as finished must find it in `results`.
            results[index] = result
            elapsed = time.perf_counter() - started
            status = "DIVERGED (NaN loss)" if result["diverged"] else ""
            if result.get("collapsed"):
                status = "COLLAPSED (loss stuck at chance)"
            out(
                f"[{done:>{len(str(total))}}/{total}] {_describe(result)}  "
                f"test acc {100 * result['test_accuracy']:6.2f}%  "
                f"{result['seconds']:5.1f}s  elapsed {elapsed:5.0f}s  "
                f"eta {elapsed / done * (total - done):4.0f}s {status}".rstrip()
            )
            bar.advance(progress)
    return results


@contextlib.contextmanager
def _finished(config, tasks, order, workers, threads):
    """`(index, result)` of each task as it finishes, started in `order`.

    One worker trains in this process; more are spawned processes of a
    `ProcessPoolExecutor` (not a `multiprocessing.Pool`: when a worker dies,
    the pool waits for its result for ever; the executor fails every future
    with `BrokenProcessPool`), stopped at once on leaving (Ctrl-C included).
    """
    if workers == 1:
        yield ((index, run_task(config, tasks[index])) for index in order)
        return
    context = multiprocessing.get_context("spawn")
    executor = concurrent.futures.ProcessPoolExecutor(
        workers, context, initializer=_init_worker, initargs=(threads,)
    )
    processes = []
    try:
        # The workers ignore SIGINT (a Ctrl-C reaches the terminal's whole
        # process group): this process handles it and stops them. An ignored
        # signal stays ignored in a spawned child, and the executor starts
        # its workers in `submit`, so the handler is swapped around it.
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            futures = {executor.submit(run_task, config, tasks[i]): i for i in order}
        finally:
            signal.signal(signal.SIGINT, handler)
        processes = list(executor._processes.values())  # noqa: SLF001 - see below
        finished = concurrent.futures.as_completed(futures)
        yield ((futures[future], future.result()) for future in finished)
    except concurrent.futures.process.BrokenProcessPool:
        _stop(executor, processes)
        raise WorkerLost(f"a worker process {_how_it_ended(processes)}") from None
    finally:
        _stop(executor, processes)


def _stop(executor, processes):
    """Ends `executor` and its `processes` (running trainings too) at once.

    `ProcessPoolExecutor.shutdown` waits for the running calls; Python 3.14's
    `terminate_workers` does what this does.
    """
    for process in processes:
        if process.exitcode is None:
            process.terminate()
    executor.shutdown(wait=True, cancel_futures=True)


def _how_it_ended(processes):
    """'was killed by SIGKILL' (the lost worker's end), in words."""
    # The executor ends the other workers with SIGTERM.
    codes = [
        p.exitcode for p in processes if p.exitcode not in (None, 0, -signal.SIGTERM)
    ]
    if not codes:
        return "ended abruptly"
    if codes[0] < 0:
        return f"was killed by {signal.Signals(-codes[0]).name}"
    return f"exited with status {codes[0]}"


def summarize(batch_sizes, labels, results):
    """`{label: {batch_size: {"linear": result, "best": result, "edge": bool}}}`.

    "best" is the grid point with the highest test accuracy (ties go to the
    factor closest to 1, then the smaller learning rate; diverged runs last);
    "edge": it is the grid's smallest or largest rate (the grid may not reach
    the optimizer's best rate). Of an interrupted sweep, `results` holds the
    finished runs only; a choice with no finished run is None.
    """
    summary = {label: {} for label in labels}
    for label in labels:
        for size in batch_sizes:
            runs = [
                r for r in results if (r["label"], r["batch_size"]) == (label, size)
            ]
            factors = sorted(r["factor"] for r in runs)
            best = max(runs, key=_rank, default=None)
            summary[label][size] = {
                "linear": next((r for r in runs if r["factor"] == 1.0), None),
                "best": best,
                "edge": len(runs) > 1 and best["factor"] in (factors[0], factors[-1]),
            }
    return summary


def _rank(result):
    """The key of "best": test accuracy (diverged last), factor near 1, lower rate."""
    accuracy = result["test_accuracy"]
    if result["diverged"] or accuracy is None or not math.isfinite(accuracy):
        accuracy = -1.0
    return accuracy, -abs(math.log(result["factor"])), -result["learning_rate"]


def _cell(result, edge=False):
    if result is None:
        return "not run"
    if result["diverged"]:
        accuracy = "diverged"
    else:
        accuracy = f"{100 * result['test_accuracy']:.1f}"
        accuracy += " collapsed" * bool(result.get("collapsed"))
    return f"{accuracy} (lr {result['learning_rate']:.3g})" + " EDGE" * edge


def format_table(batch_sizes, labels, summary, epochs):
    """A Markdown table: rows batch size, columns optimizer x LR choice."""
    table = Table(box=box.MARKDOWN)
    for heading in ["batch size", "steps"]:
        table.add_column(heading, no_wrap=True)
    for label in labels:
        for name in _CHOICES.values():
            table.add_column(f"{label} {name}", no_wrap=True)
    for size in batch_sizes:
        cells = [summary[label][size] for label in labels]
        trained = [c[k] for c in cells for k in _CHOICES if c[k] is not None]
        steps = str(trained[0]["steps_per_epoch"] * epochs) if trained else "-"
        row = [(_cell(c["linear"]), _cell(c["best"], c.get("edge"))) for c in cells]
        table.add_row(str(size), steps, *(text for pair in row for text in pair))
    # Plain text at any width: no colour, markup or emoji codes, no wrapping.
    text = io.StringIO()
    console = Console(file=text, width=1 << 20, color_system=None, markup=False)
    console.print(table, emoji=False)
    return text.getvalue().strip()


def run(config, data=None, folder=None, overwrite=False, out=_print):
    """`tf-lars sweep`: the whole sweep, into its run folder."""
    if data is None:
        data, folder = preflight.preflight("sweep", config, overwrite)
    batch_sizes, factors, tasks = plan(config, len(data.x_train))
    labels = [entry["label"] for entry in config["optimizers"]]
    _check_grid_points(config, tasks, len(data.x_train))
    workers = config["sweep"]["workers"]
    if workers == "auto":
        workers = available_cores()
    workers = max(1, min(workers, len(tasks)))
    epochs = config["training"]["epochs"]
    out(
        f"Sweep: {len(data.x_train)} training / {len(data.x_test)} test examples "
        f"({data.source}); batch sizes {batch_sizes}; optimizers {labels}; "
        f"learning-rate factors {factors} around the linear rule "
        f"(base batch {config['sweep']['base_batch_size']}); {epochs} epochs each."
    )
    preflight.open_run_dir(folder, "sweep")
    preflight.write_text(folder, "config.yaml", dump_config(config))
    started = time.perf_counter()
    results = [None] * len(tasks)
    plan_ = (batch_sizes, factors, labels)
    try:
        execute(config, tasks, workers, out=out, results=results)
    except (KeyboardInterrupt, WorkerLost) as stop:
        wall = time.perf_counter() - started
        raise _interrupted(
            folder, config, plan_, workers, results, wall, stop
        ) from None
    wall = time.perf_counter() - started
    summary, table = _write_results(folder, config, plan_, workers, results, wall)
    _plot(folder, config, data, batch_sizes, labels, summary)
    out(
        f"\nTest accuracy (%) after {epochs} epochs; (lr) = peak learning rate "
        f"used:\n{table}\ncollapsed = training loss stuck at chance level "
        "(constant prediction); diverged = loss became NaN/inf. Best of grid = "
        "highest test accuracy among the grid points (an optimistic, oracle "
        "choice); EDGE = that point is the grid's smallest or largest rate.\n\n"
        f"Wall time {wall:.0f}s. Results in {folder}/ (results.json, table.md, "
        "sweep.png, config.yaml)"
    )
    return 0


def _write_results(run_dir, config, plan_, workers, results, wall):
    """results.json and table.md of the finished runs; `(summary, table)`."""
    batch_sizes, factors, labels = plan_
    finished = [result for result in results if result is not None]
    summary = summarize(batch_sizes, labels, finished)
    table = format_table(batch_sizes, labels, summary, config["training"]["epochs"])
    record = {"batch_sizes": batch_sizes, "factors": factors, "labels": labels}
    record.update(workers=workers, wall_seconds=wall, runs=finished)
    if len(finished) < len(results):
        record.update(interrupted=True, runs_planned=len(results))
    preflight.write_text(run_dir, "results.json", json.dumps(record, indent=1))
    preflight.write_text(run_dir, "table.md", table + "\n")
    return summary, table


def _interrupted(run_dir, config, plan_, workers, results, wall, interrupt):
    """Writes what finished and a note; returns the exception `main` reports.

    `interrupt` ended the sweep: a `KeyboardInterrupt` (Ctrl-C or SIGTERM),
    or the `WorkerLost` of a dead worker.
    """
    _write_results(run_dir, config, plan_, workers, results, wall)
    done = sum(result is not None for result in results)
    lost = isinstance(interrupt, WorkerLost)
    name = preflight.interruption_name(interrupt)
    preflight.write_text(
        run_dir,
        preflight.INTERRUPTED_NOTE,
        (f"Stopped: {interrupt}" if lost else f"Interrupted ({name})")
        + f" after {done} of {len(results)} trainings. results.json and "
        "table.md hold the finished ones; sweep.png was not drawn.\n",
    )
    kept = (
        f"the run folder {run_dir} keeps config.yaml, results.json and table.md "
        f"of the {done} of {len(results)} trainings that finished, and "
        f"{preflight.INTERRUPTED_NOTE}"
    )
    return WorkerLost(f"{interrupt}; {kept}") if lost else preflight.Interrupted(kept)


def _check_grid_points(config, tasks, num_train):
    """Builds every grid point's schedule and optimizer, as `run_task` will.

    Each optimizer block is built first, once (a bad one is refused with its
    own message). A learning rate out of range (beyond float32, below
    `schedule.end_learning_rate`) then refuses the whole sweep here, before
    any training, instead of when its point starts, after the earlier ones.
    """
    from tf_lars.cli.config import build_optimizer, optimizer_spec

    specs = {}
    for index, entry in enumerate(config["optimizers"]):
        spec = optimizer_spec(entry["optimizer"], f"optimizers.{index}.optimizer")
        build_optimizer(spec, entry["base_learning_rate"])
        specs[entry["label"]] = spec
    for task in tasks:
        try:
            build_optimizer(specs[task["label"]], _schedule(config, task, num_train))
        except ConfigError as error:
            raise ConfigError(
                f"the grid point {_describe(task)} is refused, so no training "
                f"started: {error}"
            ) from None


def _plot(run_dir, config, data, batch_sizes, labels, summary):
    from tf_lars.cli.plots import plot_sweep

    series = []
    for label in labels:
        for (choice, name), style in zip(_CHOICES.items(), ("--", "-"), strict=True):
            picked = [summary[label][size][choice] for size in batch_sizes]
            accuracies = [r["test_accuracy"] for r in picked]
            bad = [r["diverged"] or r.get("collapsed", False) for r in picked]
            series.append((f"{label}, {name}", accuracies, bad, style))
    schedule = config["schedule"]
    title = (
        f"Test accuracy after {config['training']['epochs']} epochs, warm-up "
        f"{schedule['warmup_epochs']:g} epochs + poly decay "
        f"(power {schedule['power']:g}); {data.source}"
    )
    # Whole or not at all, as every file of a run folder.
    path = os.path.join(run_dir, "sweep.png")
    preflight.write_file(
        path, lambda to: plot_sweep(batch_sizes, series, to, title=title)
    )
