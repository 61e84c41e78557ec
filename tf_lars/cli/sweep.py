"""`tf-lars sweep`: accuracy against batch size, one column pair per optimizer.

For every batch size and every configured optimizer, the learning rate is
scaled linearly from `sweep.base_batch_size` (`base_learning_rate * batch /
base_batch_size`), then multiplied by each of `sweep.grid_factors` (the
factor 1 is always run: it is the "linear" result). Each grid point is one
`build_trial` + `fit_once` run with the same model, seed, epochs and
warm-up + polynomial decay schedule. Grid points run in parallel worker
processes (spawned, so each has its own TensorFlow runtime, pinned to
`cores // workers` threads); they inherit the parent's
`TF_CPP_MIN_LOG_LEVEL` and import TensorFlow as quietly
(`tf_lars.cli.import_tensorflow`).

Every grid point's schedule and optimizer are built before the first
training, so a learning rate out of range refuses the whole sweep at once. A
worker that dies (SIGKILL, the out-of-memory killer) ends the sweep:
`WorkerLost`, with the finished trainings written.
"""

import concurrent.futures
import json
import math
import multiprocessing
import os
import signal
import sys
import time

from tf_lars.cli.config import ConfigError, dump_config
from tf_lars.cli.preflight import (
    INTERRUPTED_NOTE,
    Interrupted,
    interruption_name,
    open_run_dir,
    write_file,
    write_text,
)

_WORKER_DATA = {}


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
    """The grid points a validated sweep config asks for.

    Returns:
        `(batch_sizes, factors, tasks)`: sorted batch sizes (`full` resolved
        to `num_train`), sorted learning-rate factors (1 included) and one
        dict per training run.

    Raises:
        ConfigError: a batch size larger than the training set.
    """
    # Imported here: this module loads in fresh worker processes before
    # `_init_worker` imports TensorFlow (quietly).
    from tf_lars.schedules import linear_scaled_learning_rate

    batch_sizes = []
    for index, batch_size in enumerate(config["sweep"]["batch_sizes"]):
        if batch_size == "full":
            batch_size = num_train
        elif batch_size > num_train:
            key = f"sweep.batch_sizes.{index}"
            raise ConfigError(
                f"`{key}` must be at most the training set size ({num_train}) or "
                f"'full'. Received: {key}={batch_size!r}"
            )
        if batch_size not in batch_sizes:
            batch_sizes.append(batch_size)
    batch_sizes.sort()
    factors = sorted(set(config["sweep"]["grid_factors"]) | {1.0})
    base_batch_size = config["sweep"]["base_batch_size"]
    tasks = []
    for batch_size in batch_sizes:
        for entry in config["optimizers"]:
            linear = linear_scaled_learning_rate(
                entry["base_learning_rate"], batch_size, base_batch_size
            )
            for factor in factors:
                tasks.append(
                    {
                        "batch_size": batch_size,
                        "label": entry["label"],
                        "factor": factor,
                        "learning_rate": linear * factor,
                        "optimizer": entry["optimizer"],
                    }
                )
    return batch_sizes, factors, tasks


def _init_worker(threads):
    from tf_lars.cli import import_tensorflow

    tf = import_tensorflow()
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    from tf_lars.cli import quiet_python_logs

    quiet_python_logs()


def run_task(config, task):
    """Trains one grid point; returns a JSON-able result dict."""
    from tf_lars.cli.config import optimizer_spec
    from tf_lars.cli.data import load_data
    from tf_lars.cli.train import build_schedule, build_trial, fit_once

    key = json.dumps(config["data"], sort_keys=True)
    if key not in _WORKER_DATA:
        _WORKER_DATA[key] = load_data(config["data"])
    data = _WORKER_DATA[key]
    epochs = config["training"]["epochs"]
    steps_per_epoch = len(data.x_train) // task["batch_size"]
    trial = build_trial(
        data,
        model_config=config["model"],
        optimizer=optimizer_spec(task["optimizer"]),
        learning_rate=build_schedule(
            config["schedule"], task["learning_rate"], steps_per_epoch, epochs
        ),
        batch_size=task["batch_size"],
        seed=config["seed"],
    )
    result = fit_once(
        data,
        trial,
        batch_size=task["batch_size"],
        epochs=epochs,
        jit_compile=config["training"]["jit_compile"],
        verbose=0,
    )
    losses = result["history"].get("loss", [])
    # A run that ends with a finite loss still at chance level (every logit
    # constant: typically all ReLUs switched off by too large early steps).
    chance_loss = math.log(data.num_classes)
    collapsed = (
        not result["diverged"]
        and result["train_loss"] >= 0.95 * chance_loss
        and result["train_accuracy"] < 1.5 / data.num_classes
    )
    return {
        **{name: value for name, value in task.items() if name != "optimizer"},
        "test_accuracy": result["test_accuracy"],
        "train_accuracy": result["train_accuracy"],
        "train_loss": _finite_or_none(result["train_loss"]),
        "diverged": result["diverged"],
        "diverged_epoch": result["diverged_epoch"],
        "collapsed": collapsed,
        "epochs_run": len(losses),
        "steps_per_epoch": result["steps_per_epoch"],
        "seconds": result["seconds"],
    }


def _finite_or_none(value):
    return value if value is not None and math.isfinite(value) else None


def _describe(task):
    choice = "linear" if task["factor"] == 1.0 else f"x{task['factor']:g}"
    return (
        f"{task['label']:<14} batch {task['batch_size']:>5}  "
        f"lr {task['learning_rate']:<8.4g} {'(' + choice + ')':<11}"
    )


def execute(config, tasks, workers, out=print, results=None):
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
    started = time.perf_counter()
    results = [None] * total if results is None else results

    def report(done, index, result):
        # Kept before it is printed: a Ctrl-C right after the line shows a
        # training as finished must find it in `results`.
        results[index] = result
        elapsed = time.perf_counter() - started
        remaining = elapsed / done * (total - done)
        status = (
            "DIVERGED (NaN loss)"
            if result["diverged"]
            else "COLLAPSED (loss stuck at chance)"
            if result.get("collapsed")
            else ""
        )
        out(
            f"[{done:>{len(str(total))}}/{total}] {_describe(result)}  "
            f"test acc {100 * result['test_accuracy']:6.2f}%  "
            f"{result['seconds']:5.1f}s  elapsed {elapsed:5.0f}s  "
            f"eta {remaining:4.0f}s {status}".rstrip()
        )
        sys.stdout.flush()  # progress, live through a pipe too

    # Most expensive first (smallest batches take the most steps), so the
    # last process to finish is not left alone with a long run.
    order = sorted(range(total), key=lambda i: tasks[i]["batch_size"])
    if workers == 1:
        for done, index in enumerate(order, start=1):
            report(done, index, run_task(config, tasks[index]))
        return results
    _run_in_pool(config, tasks, order, workers, threads, report)
    return results


def _run_in_pool(config, tasks, order, workers, threads, report):
    """Runs `tasks` in `order` on spawned processes; reports each result.

    Raises:
        WorkerLost: a worker process died; the others are stopped.
    """
    # A `ProcessPoolExecutor`, not a `multiprocessing.Pool`: when a worker
    # dies, the pool replaces it and waits for its result for ever; the
    # executor fails every unfinished future with `BrokenProcessPool`.
    executor = concurrent.futures.ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker,
        initargs=(threads,),
    )
    processes = []
    try:
        # The workers ignore SIGINT (a Ctrl-C reaches the terminal's whole
        # process group): this process handles it and stops them. An ignored
        # signal stays ignored in a spawned child, and the executor starts
        # its workers in `submit`, so the handler is swapped around it.
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            futures = {
                executor.submit(run_task, config, tasks[index]): index
                for index in order
            }
        finally:
            signal.signal(signal.SIGINT, handler)
        processes = list(executor._processes.values())  # noqa: SLF001 - see _stop
        finished = concurrent.futures.as_completed(futures)
        for done, future in enumerate(finished, start=1):
            report(done, futures[future], future.result())
    except concurrent.futures.process.BrokenProcessPool:
        _stop(executor, processes)
        raise WorkerLost(f"a worker process {_how_it_ended(processes)}") from None
    finally:
        # On Ctrl-C or an error, the running trainings are stopped at once.
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
    for process in processes:
        code = process.exitcode
        # The executor ends the other workers with SIGTERM.
        if code is not None and code < 0 and code != -signal.SIGTERM:
            return f"was killed by {signal.Signals(-code).name}"
        if code is not None and code > 0:
            return f"exited with status {code}"
    return "ended abruptly"


def summarize(batch_sizes, labels, results):
    """`{label: {batch_size: {"linear": result, "best": result}}}`.

    "best" is the grid point with the highest test accuracy (ties go to the
    factor closest to 1, then the smaller learning rate; diverged runs last).
    Of an interrupted sweep, `results` holds the finished runs only; a
    choice with no finished run is None.
    """
    summary = {label: {} for label in labels}
    for label in labels:
        for batch_size in batch_sizes:
            runs = [
                r
                for r in results
                if r["label"] == label and r["batch_size"] == batch_size
            ]
            if not runs:  # an interrupted sweep: not trained
                summary[label][batch_size] = {"linear": None, "best": None}
                continue
            linear = next((r for r in runs if r["factor"] == 1.0), None)
            best = max(
                runs,
                key=lambda r: (
                    _score(r),
                    -abs(math.log(r["factor"])),
                    -r["learning_rate"],
                ),
            )
            factors = [r["factor"] for r in runs]
            summary[label][batch_size] = {
                "linear": linear,
                "best": best,
                # The best point is the grid's smallest or largest rate: the
                # grid may not reach this optimizer's best rate.
                "edge": len(factors) > 1
                and best["factor"] in (min(factors), max(factors)),
            }
    return summary


def _score(result):
    """Test accuracy for ranking; a diverged run ranks last."""
    accuracy = result["test_accuracy"]
    if result["diverged"] or accuracy is None or not math.isfinite(accuracy):
        return -1.0
    return accuracy


def _cell(result):
    if result is None:
        return "not run"
    if result["diverged"]:
        accuracy = "diverged"
    else:
        accuracy = f"{100 * result['test_accuracy']:.1f}"
        if result.get("collapsed"):
            accuracy += " collapsed"
    return f"{accuracy} (lr {result['learning_rate']:.3g})"


def format_table(batch_sizes, labels, summary, epochs):
    """A Markdown table: rows batch size, columns optimizer x LR choice."""
    header = ["batch size", "steps"]
    for label in labels:
        header += [f"{label} linear LR", f"{label} best of grid"]
    rows = []
    for batch_size in batch_sizes:
        trained = [
            cell[choice]
            for cell in (summary[label][batch_size] for label in labels)
            for choice in ("linear", "best")
            if cell[choice] is not None
        ]
        steps = str(trained[0]["steps_per_epoch"] * epochs) if trained else "-"
        row = [str(batch_size), steps]
        for label in labels:
            cell = summary[label][batch_size]
            best = _cell(cell["best"]) + (" EDGE" if cell.get("edge") else "")
            row += [_cell(cell["linear"]), best]
        rows.append(row)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells):
        return (
            "| "
            + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))
            + " |"
        )

    separator = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), separator, *(line(r) for r in rows)])


def run(config, data=None, folder=None, overwrite=False):
    """`tf-lars sweep`: the whole sweep, into its run folder.

    Args:
        config: a validated sweep config (`tf_lars.cli.config.load_config`).
        data: the `Dataset` and `folder` the run folder from
            `tf_lars.cli.preflight.preflight`; both found here when None.
        overwrite: bool, `--overwrite`: an existing run folder may be reused.

    Returns:
        The exit status, 0.

    Raises:
        ConfigError: a bad config, before any file is written or process
            started (a grid point whose learning rate is out of range
            included).
        DataError: unusable data, before any file is written or process
            started.
        tf_lars.cli.preflight.Interrupted: on Ctrl-C, after writing the
            finished trainings and their table.
        WorkerLost: a worker process died (killed); the same files written.
    """
    from tf_lars.cli.preflight import preflight

    if data is None:
        data, folder = preflight("sweep", config, overwrite)
    run_sweep(config, folder, data=data)
    return 0


def _write_results(run_dir, config, plan_, workers, results, wall):
    """results.json and table.md of the finished runs; returns the table."""
    batch_sizes, factors, labels = plan_
    finished = [result for result in results if result is not None]
    summary = summarize(batch_sizes, labels, finished)
    table = format_table(batch_sizes, labels, summary, config["training"]["epochs"])
    record = {
        "batch_sizes": batch_sizes,
        "factors": factors,
        "labels": labels,
        "workers": workers,
        "wall_seconds": wall,
        "runs": finished,
    }
    if len(finished) < len(results):
        record["interrupted"] = True
        record["runs_planned"] = len(results)
    write_text(run_dir, "results.json", json.dumps(record, indent=1))
    write_text(run_dir, "table.md", table + "\n")
    return summary, table


def _interrupted(
    run_dir, config, plan_, workers, results, wall, lost=None, interrupt=None
):
    """Writes what finished and a note; the exception `main` reports.

    `lost`, a `WorkerLost`, when a dead worker (not a Ctrl-C) ended the sweep;
    `interrupt`, the `KeyboardInterrupt` (Ctrl-C or SIGTERM) otherwise.
    """
    summary, table = _write_results(run_dir, config, plan_, workers, results, wall)
    done = sum(result is not None for result in results)
    if lost is None:
        cause = f"Interrupted ({interruption_name(interrupt)})"
    else:
        cause = f"Stopped: {lost}"
    write_text(
        run_dir,
        INTERRUPTED_NOTE,
        f"{cause} after {done} of {len(results)} trainings. "
        "results.json and table.md hold the finished ones; sweep.png was not "
        "drawn.\n",
    )
    kept = (
        f"the run folder {run_dir} keeps config.yaml, results.json and table.md "
        f"of the {done} of {len(results)} trainings that finished, and "
        f"{INTERRUPTED_NOTE}"
    )
    return Interrupted(kept) if lost is None else WorkerLost(f"{lost}; {kept}")


def run_sweep(config, run_dir, out=print, data=None):
    """The whole sweep; writes results.json, table.md, sweep.png, config.yaml.

    Args:
        config: a validated sweep config.
        run_dir: str, the folder to write.
        out: callable printing one line.
        data: the loaded `Dataset`, or None to load it here.

    Returns:
        A dict: summary, results (one dict per run), table (Markdown), wall
        (seconds).
    """
    from tf_lars.cli.data import load_data
    from tf_lars.cli.plots import plot_sweep
    from tf_lars.cli.preflight import check_sweep

    if data is None:
        data = load_data(config["data"])
    check_sweep(config, data)
    batch_sizes, factors, tasks = plan(config, len(data.x_train))
    labels = [entry["label"] for entry in config["optimizers"]]
    _check_optimizers(config)
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
    open_run_dir(run_dir, "sweep")
    write_text(run_dir, "config.yaml", dump_config(config))
    started = time.perf_counter()
    results = [None] * len(tasks)
    plan_ = (batch_sizes, factors, labels)
    try:
        execute(config, tasks, workers, out=out, results=results)
    except KeyboardInterrupt as interrupt:
        wall = time.perf_counter() - started
        raise _interrupted(
            run_dir, config, plan_, workers, results, wall, interrupt=interrupt
        ) from None
    except WorkerLost as lost:
        wall = time.perf_counter() - started
        stopped = _interrupted(run_dir, config, plan_, workers, results, wall, lost)
        raise stopped from None
    wall = time.perf_counter() - started
    summary, table = _write_results(run_dir, config, plan_, workers, results, wall)
    _plot(run_dir, config, data, batch_sizes, labels, summary, plot_sweep)
    _print_table(out, run_dir, epochs, table, wall)
    return {"summary": summary, "results": results, "table": table, "wall": wall}


def _check_optimizers(config):
    """Builds each optimizer block once, before any process starts.

    Its only check: a bad block fails here; the workers build one optimizer
    per grid point from the same block.
    """
    from tf_lars.cli.config import optimizer_from_block

    for index, entry in enumerate(config["optimizers"]):
        optimizer_from_block(
            entry["optimizer"],
            learning_rate=entry["base_learning_rate"],
            key=f"optimizers.{index}.optimizer",
        )


def _check_grid_points(config, tasks, num_train):
    """Builds every grid point's schedule and optimizer, as `run_task` will.

    A learning rate out of range (beyond float32, below
    `schedule.end_learning_rate`) refuses the whole sweep here, before any
    training, instead of when its point starts, after the earlier ones.
    """
    from tf_lars.cli.config import build_optimizer, optimizer_spec
    from tf_lars.cli.train import build_schedule

    specs = {
        entry["label"]: optimizer_spec(
            entry["optimizer"], f"optimizers.{index}.optimizer"
        )
        for index, entry in enumerate(config["optimizers"])
    }
    epochs = config["training"]["epochs"]
    for task in tasks:
        steps_per_epoch = num_train // task["batch_size"]
        try:
            schedule = build_schedule(
                config["schedule"], task["learning_rate"], steps_per_epoch, epochs
            )
            build_optimizer(specs[task["label"]], schedule)
        except ConfigError as error:
            raise ConfigError(
                f"the grid point {_describe(task)} is refused, so no training "
                f"started: {error}"
            ) from None


def _print_table(out, run_dir, epochs, table, wall):
    out("")
    out(f"Test accuracy (%) after {epochs} epochs; (lr) = peak learning rate used:")
    out(table)
    out(
        "collapsed = training loss stuck at chance level (constant prediction); "
        "diverged = loss became NaN/inf. Best of grid = highest test accuracy "
        "among the grid points (an optimistic, oracle choice); EDGE = that "
        "point is the grid's smallest or largest rate."
    )
    out("")
    out(
        f"Wall time {wall:.0f}s. Results in {run_dir}/ (results.json, table.md, "
        "sweep.png, config.yaml)"
    )
    sys.stdout.flush()


def _plot(run_dir, config, data, batch_sizes, labels, summary, plot_sweep):
    series = []
    for label in labels:
        for choice, style in (("linear", "--"), ("best", "-")):
            picked = [summary[label][b][choice] for b in batch_sizes]
            series.append(
                (
                    f"{label}, {'linear LR' if choice == 'linear' else 'best of grid'}",
                    [r["test_accuracy"] for r in picked],
                    [r["diverged"] or r.get("collapsed", False) for r in picked],
                    style,
                )
            )
    epochs = config["training"]["epochs"]
    title = (
        f"Test accuracy after {epochs} epochs, warm-up "
        f"{config['schedule']['warmup_epochs']:g} epochs + poly decay "
        f"(power {config['schedule']['power']:g}); {data.source}"
    )
    # Whole or not at all, as every file of a run folder.
    write_file(
        os.path.join(run_dir, "sweep.png"),
        lambda path: plot_sweep(batch_sizes, series, path, title=title),
    )
