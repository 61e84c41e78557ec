"""`tf-lars study`: steps to a target against batch size, per optimizer, on Optuna.

The protocol (Shallue et al. 2019, arXiv 1811.03600; Nado et al. 2021;
McCandlish et al. 2018; Zhang et al. 2024) is `REPORT`'s and docs/guides/cli.md's.
A *unit* (an optimizer at a batch size) is two Optuna studies (tuning and
reruns) in one storage, named with a hash of the config: a rerun resumes,
several processes share the work, and a unit's budget holds whichever process
asks (`_claimed`). Worker processes each run many trials (one TensorFlow start).
"""

import concurrent.futures
import contextlib
import csv
import functools
import hashlib
import importlib
import io
import json
import math
import multiprocessing
import os
import signal
import sqlite3
import time
import warnings

import numpy as np

from tf_lars.cli import STARTED, nqm, preflight
from tf_lars.cli.config import ConfigError, dump_config

_CONTEXT = {}  # a worker's config, data, validation split and storage URL
_STOP = []  # the signal the parent sent this worker, once it came
SCALING_SLACK = 1.2  # Zhang et al. 2024: 20% above perfect scaling


def config_key(config, block, also=()):
    """A hash of what a command's trials depend on (not `output_dir`,
    `run_name`, the keys `also`, nor `block`'s storage, workers and interval
    settings): the Optuna studies' names carry it."""
    skip = ("output_dir", "run_name", *also)
    kept = {k: v for k, v in config.items() if k not in skip}
    changes = preflight.MAY_CHANGE
    kept[block] = {k: v for k, v in config[block].items() if k not in changes}
    text = json.dumps(kept, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def study_key(config):
    """`config_key` of a study."""
    return config_key(config, "study")


def units(config):
    """`(optimizer entry, batch size)` of every unit, smallest batches first."""
    batches = sorted(set(config["study"]["batch_sizes"]))
    return [(entry, batch) for batch in batches for entry in config["optimizers"]]


# What the shared runner below (`advance`, `work`, `count_trials`, `execute`,
# `finished`) asks of a command's module: the config block with `trials` and
# `seeds`, Optuna's direction, its units, a unit's Optuna study names, and
# `evaluate` (one trial's result and objective value).
BLOCK, DIRECTION = "study", "minimize"


def unit_name(config, unit, part):
    """The Optuna study of a unit's `part` ("tuning" or "reruns")."""
    entry, batch = unit
    return f"{entry['label']} B={batch} {part} [{study_key(config)}]"


def open_storage(url):
    """Optuna's RDB storage; a trial whose process died is failed after
    its heartbeat stops (2 min, by `advance`) and queued again with its
    hyperparameters (Optuna's `RetryFailedTrialCallback`), as a stopped one
    is (`_objective`): the sampler's next point is the one it would have
    been, so a resumed study measures the trials an unstopped one does."""
    import optuna
    import sqlalchemy

    sqlite = url.startswith("sqlite")
    # Optuna 4.9 renamed the argument and the callback.
    retry = {"failed_trial_callback": optuna.storages.RetryFailedTrialCallback}
    if hasattr(optuna.storages, "RetryHeartbeatStaleTrialCallback"):
        retry = {"heartbeat_stale_trial_callback": (
            optuna.storages.RetryHeartbeatStaleTrialCallback)}  # fmt: skip
    for attempt in range(10):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                storage = optuna.storages.RDBStorage(
                    url, heartbeat_interval=30, grace_period=120,
                    engine_kwargs={"connect_args": {"timeout": 60}} if sqlite else {},
                    **{name: kind(max_retry=None) for name, kind in retry.items()},
                )  # fmt: skip
            break
        except sqlalchemy.exc.SQLAlchemyError:
            if attempt == 9:  # two processes creating one storage: one wins
                raise
            time.sleep(0.2 * (attempt + 1))
    if sqlite:  # write-ahead logging: a commit need not wait for the disk

        def connected(connection, _):
            connection.isolation_level = None  # SQLAlchemy's `begin` begins
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=NORMAL")

        def begin(connection):
            # SQLite ignores SELECT ... FOR UPDATE, so Optuna's read-then-write
            # (a queued trial taken from WAITING to RUNNING) is atomic only if
            # each transaction holds the write lock from its start: else two
            # processes take the same rerun (tests/cli_study_test.py).
            connection.exec_driver_sql("BEGIN IMMEDIATE")

        sqlalchemy.event.listen(storage.engine, "connect", connected)
        sqlalchemy.event.listen(storage.engine, "begin", begin)
        storage.engine.dispose()  # the connections made before it
    return storage


@contextlib.contextmanager
def storage_errors(url):
    """A storage that cannot be written (a full disk) as one line: Optuna's
    error (or its assertion after a failed commit) has the database's in its
    chain. In each worker, where the chain is whole (a pool's pickling loses
    it)."""
    import sqlalchemy

    try:
        yield
    except Exception as error:
        cause = None if isinstance(error, ConfigError) else error
        while cause is not None and not isinstance(
            cause, sqlalchemy.exc.OperationalError
        ):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        raise ConfigError(f"cannot write the trials in {url}: {cause.orig}") from None


def checkpoint(url):
    """Moves a SQLite storage's write-ahead log into its file, so that the
    file alone holds every trial (copied, or read by another program). Best
    effort: the trials are in the log meanwhile, and a reader finds them."""
    if url.startswith("sqlite:///"):
        path = url.removeprefix("sqlite:///")
        with contextlib.suppress(sqlite3.Error):
            with contextlib.closing(sqlite3.connect(path, timeout=60)) as database:
                database.execute("PRAGMA wal_checkpoint(TRUNCATE)")


# ------------------------------------------------------------------ trials
def _suggest(trial, config, entry):
    """The trial's hyperparameters: `{name: value}` of the search space."""
    rate = trial.suggest_float("learning_rate", *entry["learning_rate"], log=True)
    params = {"learning_rate": rate}
    for name in ("one_minus_momentum", "warmup_share", "weight_decay"):
        if config["search"][name] is not None:
            log = name != "warmup_share"
            params[name] = trial.suggest_float(name, *config["search"][name], log=log)
    return params


def optimizer_arguments(entry, params):
    """The optimizer block's config with the trial's hyperparameters in it:
    1 - momentum becomes `beta_1` (Adam-like) or `momentum`."""
    from tf_lars.cli.config import constructor_parameters, optimizer_spec

    arguments = dict(entry["optimizer"]["config"])
    arguments["learning_rate"] = params["learning_rate"]
    if "one_minus_momentum" in params:
        key = "momentum"  # SGD and LARS known without Keras (the NQM has none)
        if entry["optimizer"]["class_name"] not in ("SGD", "LARS"):
            names = constructor_parameters(optimizer_spec(entry["optimizer"]).cls)
            key = "beta_1" if "beta_1" in names else key
        arguments[key] = 1.0 - params["one_minus_momentum"]
    if "weight_decay" in params:
        arguments["weight_decay"] = params["weight_decay"]
    return arguments


def cap(config, batch, num_train):
    """The step cap of a trial at `batch`: `study.max_steps` (NQM:
    `nqm.max_steps`), rounded to whole epochs (at least one), so a trial
    that never reaches the target trains as `tf-lars train` would."""
    if config["workload"] == "nqm":
        return config["nqm"]["max_steps"]
    per_epoch = num_train // batch
    return max(1, round(config["study"]["max_steps"] / per_epoch)) * per_epoch


def run_trial(
    config, data, validation, entry, batch, params, seed, test=False, noise=False,
    incumbent=None,
):  # fmt: skip
    """Trains one configuration until the target or the cap (a tuning trial:
    or, not at the target, past `incumbent`, the unit's fewest steps so far:
    it can no longer be selected, and counts as not reached).

    Returns `{"steps", "cap", "curve", "b_simple", "test", "seconds",
    "cpu_seconds"}`:
    the first evaluated step that reached the target (None: not reached),
    the validation metric every `eval_every` steps, the gradient noise scale
    at the end (neural workloads: when `noise`, an even batch; else None)
    and the test metric when `test` (else None).
    """
    started, cpu = time.perf_counter(), time.process_time()
    if config["workload"] == "nqm":
        result = _nqm_trial(config, entry, batch, params)
        result["test"] = result["curve"][-1][1] if test else None
    else:
        result = _neural_trial(
            config, data, validation, entry, batch, params, seed, test, noise,
            incumbent,
        )  # fmt: skip
    # A worker runs one trial at a time: its CPU time is the trial's, what
    # the trial would take alone on an idle core.
    result["seconds"] = time.perf_counter() - started
    result["cpu_seconds"] = time.process_time() - cpu
    return result


def _nqm_trial(config, entry, batch, params):
    steps = config["nqm"]["max_steps"]
    warmup = round(params.get("warmup_share", 0.0) * steps)
    decay = config["study"]["schedule"] == "linear_decay"
    rates = nqm.learning_rates(params["learning_rate"], warmup, steps, decay)
    arguments = optimizer_arguments(entry, params)
    result = nqm.run(
        nqm.make_nqm(config["nqm"]["dimensions"]), rates, batch,
        config["study"]["target"], momentum=arguments.get("momentum", 0.0),
        nesterov=arguments.get("nesterov", False),
        weight_decay=arguments.get("weight_decay") or 0.0,
        record_every=config["study"]["eval_every"],
    )  # fmt: skip
    return {**result, "cap": steps}


def trial_config(config, entry, batch, params, seed, num_train):
    """The `tf-lars train` config of one trial: what it trains, exactly."""
    from tf_lars.cli.config import default_config

    train = default_config("train")
    per_epoch = num_train // batch
    epochs = cap(config, batch, num_train) // per_epoch
    train.update(seed=seed, data=config["data"], model=config["model"])
    train["training"].update(epochs=epochs, batch_size=batch, verbose=0,
                             jit_compile=config["training"]["jit_compile"])  # fmt: skip
    decay = config["study"]["schedule"] == "linear_decay"
    warmup = params.get("warmup_share", 0.0) * epochs
    if round(warmup * per_epoch) >= epochs * per_epoch:  # a cap of a few steps
        warmup = (epochs * per_epoch - 1) / per_epoch  # one step left to decay
    train["schedule"] = {
        "name": "warmup_polynomial_decay", "power": 1.0, "base_batch_size": None,
        "warmup_epochs": warmup,
        "end_learning_rate": 0.0 if decay else params["learning_rate"],
    }  # fmt: skip
    arguments = optimizer_arguments(entry, params)
    train["optimizer"] = {"class_name": entry["optimizer"]["class_name"],
                          "config": arguments}  # fmt: skip
    return train


def _neural_trial(
    config, data, validation, entry, batch, params, seed, test, noise, incumbent
):
    from tf_lars.cli.train import fit_config

    study = config["study"]
    limit = cap(config, batch, len(data.x_train))
    watch = _steps_to_target(
        validation, study["target"], study["eval_every"], limit, incumbent
    )
    if not test:  # tuning and reruns never see the test set
        data = data._replace(x_test=validation[0], y_test=validation[1])
    train = trial_config(config, entry, batch, params, seed, len(data.x_train))
    noise = noise and batch % 2 == 0  # two micro-batches of half the batch
    result = fit_config(train, data, [watch], noise_scale=noise)
    return {
        "steps": watch.steps, "cap": limit, "curve": watch.curve,
        "overtaken": watch.steps is None and watch.step < limit,
        "diverged": result["diverged"],
        "b_simple": gradient_noise_scale(result["optimizer"]),
        "test": result["test_accuracy"] if test else None,
        "train_loss": [float(v) for v in result["history"]["loss"]],
    }  # fmt: skip


def gradient_noise_scale(optimizer):
    """`B_simple` at the end of a neural trial: its bias-corrected moving
    average (`tf_lars.GradientNoiseScale`, decay 0.99: about the last 100
    updates, all of a shorter rerun's), or None when the trial did not
    measure it."""
    value = getattr(optimizer, "b_simple", None)
    return float(value) if value is not None and math.isfinite(value) else None


def _steps_to_target(validation, target, every, limit, incumbent=None):
    """A Keras callback: validation accuracy every `every` steps (updates);
    stops training at the first evaluation that reaches `target`, at
    `limit` (micro-batches of an odd count per epoch run past it), or past
    `incumbent` steps without reaching it (a tuning trial that can no longer
    have the fewest steps: how a unit's budget of trials is run in time)."""
    import keras

    x, y = validation

    class StepsToTarget(keras.callbacks.Callback):
        steps, curve, step = None, [], 0

        def on_train_batch_end(self, batch, logs=None):
            _stop_point()  # steps are updates: micro-batches are not counted
            step = int(self.model.optimizer.iterations)
            if step == self.step or (step % every and step != limit):
                return
            self.step = step
            logits = self.model.predict_on_batch(x)
            accuracy = float(np.mean(np.argmax(logits, axis=-1) == y))
            self.curve = [*self.curve, (self.step, accuracy)]
            if accuracy >= target:
                self.steps = self.step
            overtaken = incumbent is not None and step >= incumbent
            stop = accuracy >= target or step >= limit or overtaken
            # `or`: a non-finite loss (train.py's stopper) may have stopped it.
            self.model.stop_training = self.model.stop_training or stop

    return StepsToTarget()


def _stop_point():
    """Raises a pending stop here, where no trial is half recorded: a
    signal raised while Optuna writes to its storage would leave a trial
    RUNNING. In a worker, the parent's SIGTERM; in the command's own
    process, a Ctrl-C or SIGTERM held back by `tf_lars.cli.main.deferred`."""
    if _STOP:
        raise KeyboardInterrupt("stopped by the parent")
    from tf_lars.cli.main import raise_pending

    raise_pending()


def _value(config, result):
    """The trial's objective: its steps, or past the cap by how far it
    stayed from the target (diverged: 10 caps)."""
    if result["steps"] is not None:
        return float(result["steps"])
    # A non-finite loss may stop a neural trial before its first evaluation.
    curve = result["curve"]
    if result.get("diverged") or not curve or not math.isfinite(curve[-1][1]):
        return 10.0 * result["cap"]
    final, target = curve[-1][1], config["study"]["target"]
    nqm_loss = config["workload"] == "nqm"
    gap = math.log(max(final, target) / target) if nqm_loss else 1 - final / target
    return result["cap"] * (1.0 + min(max(gap, 0.0), 8.0))


# ------------------------------------------------------------------ workers
def _trials(study, *states):
    """A study's trials in `states` (names: "COMPLETE", ...), by number."""
    found = [t for t in study.get_trials(deepcopy=False) if t.state.name in states]
    return sorted(found, key=lambda t: t.number)


def _complete(study, limit=None):
    """The first `limit` complete trials of a study, by number."""
    return _trials(study, "COMPLETE")[:limit]


def _claimed(study, trial, budget, seed=None):
    """Whether `trial` is within the study's budget: fewer than `budget`
    complete or running trials numbered below it (of its seed, for a
    rerun). A shared study so never runs more than its budget."""
    earlier = [t for t in _trials(study, "COMPLETE", "RUNNING")
               if t.number < trial.number
               and (seed is None or t.user_attrs.get("seed") == seed)]  # fmt: skip
    return len(earlier) < (1 if seed is not None else budget)


def evaluate(config, unit, trial, seed, rerun):
    """One trial of a unit: its result (the curve kept at ~200 points) and
    its objective, `_value`. The first rerun's seed also takes the test set."""
    entry, batch = unit
    params = _suggest(trial, config, entry)
    steps = [] if rerun else [t.user_attrs["result"]["steps"]
                              for t in _complete(trial.study)]  # fmt: skip
    reached = [s for s in steps if s is not None]
    test = rerun and seed == config["seed"] + 1
    result = run_trial(
        config, _CONTEXT["data"], _CONTEXT["validation"], entry, batch, params, seed,
        test, rerun, min(reached, default=None),  # the incumbent: a tuning trial's stop
    )  # fmt: skip
    curve = result["curve"]
    every = max(1, len(curve) // 200)
    kept = list(range(0, len(curve), every))  # at most ~200 points, the last
    kept += [len(curve) - 1] if kept and kept[-1] != len(curve) - 1 else []
    result["curve"] = [list(curve[i]) for i in kept]
    return result, _value(config, result)


def _objective(plan, config, unit, budget, rerun):
    import optuna

    def objective(trial):
        try:
            _stop_point()  # inside the trial: Optuna records it as failed
            tuning, seed = trial.study, trial.user_attrs.get("seed")
            if (rerun and seed is None) or not _claimed(tuning, trial, budget, seed):
                tuning.stop()  # the budget is spent (or running elsewhere)
                raise optuna.TrialPruned("over budget")
            seed = config["seed"] if seed is None else seed
            result, value = plan.evaluate(config, unit, trial, seed, rerun)
        except KeyboardInterrupt:
            # A stop, not a failure: Optuna would log the trial's traceback.
            optuna.logging.set_verbosity(optuna.logging.ERROR)
            if trial.params and not rerun:
                # Its point is spent from the sampler's sequence: queued, the
                # same trial runs on resuming (a rerun is queued by `advance`).
                trial.study.enqueue_trial(trial.params)
            raise
        trial.set_user_attr("result", result)  # one write
        return value

    return objective


def selected(plan, trials):
    """The trial `plan` selects: the best value in its `DIRECTION`, the
    first of equals."""
    sign = 1.0 if plan.DIRECTION == "minimize" else -1.0
    return min(trials, key=lambda t: (sign * t.value, t.number))


def _fail_stale_trials(study):
    """Fails a trial whose process died once its heartbeat is stale (Optuna
    runs this only in `optimize`), queued again by the storage's callback."""
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)


def advance(plan, storage, config, unit, progress):
    """Runs what a unit of `plan` still needs (its tuning trials, then the
    selected trial rerun on new seeds); whether it is complete."""
    import optuna

    budget, seeds = config[plan.BLOCK]["trials"], config[plan.BLOCK]["seeds"]
    stop = optuna.study.MaxTrialsCallback
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = optuna.samplers.QMCSampler(
            scramble=True, seed=config["seed"], warn_independent_sampling=False
        )
    tuning = optuna.create_study(
        study_name=plan.unit_name(config, unit, "tuning"), storage=storage,
        sampler=sampler, load_if_exists=True, direction=plan.DIRECTION,
    )  # fmt: skip
    _fail_stale_trials(tuning)
    if len(_complete(tuning)) < budget:
        if len(_trials(tuning, "COMPLETE", "RUNNING")) >= budget:
            return False  # the rest runs in another worker: no trial to ask for
        objective = _objective(plan, config, unit, budget, rerun=False)
        tuning.optimize(objective, callbacks=[stop(budget), progress])
        if len(_complete(tuning)) < budget:
            return False  # the rest runs in another worker
    best = selected(plan, _complete(tuning, budget))
    reruns = optuna.create_study(
        study_name=plan.unit_name(config, unit, "reruns"), storage=storage,
        load_if_exists=True, direction=plan.DIRECTION,
    )  # fmt: skip
    _fail_stale_trials(reruns)
    have = {t.user_attrs.get("seed")
            for t in _trials(reruns, "COMPLETE", "RUNNING", "WAITING")}  # fmt: skip
    for seed in range(config["seed"] + 1, config["seed"] + 1 + seeds):
        if seed not in have:
            reruns.enqueue_trial(best.params, user_attrs={"seed": seed})
    if _trials(reruns, "WAITING"):
        objective = _objective(plan, config, unit, seeds, rerun=True)
        reruns.optimize(objective, callbacks=[stop(seeds), progress])
    return len(_complete(reruns)) >= seeds


def finished(storage, config, unit, command=__name__):
    """`(trials, best, runs)` of a complete unit of `command`: its budget of
    tuning trials, the selected one, and its reruns' results by seed; None
    while the unit is not complete."""
    import optuna

    plan = importlib.import_module(command)
    block = config[plan.BLOCK]
    try:
        tuning, reruns = (optuna.load_study(study_name=plan.unit_name(config, unit, p),
                                            storage=storage)
                          for p in ("tuning", "reruns"))  # fmt: skip
    except KeyError:
        return None
    trials, seeds = _complete(tuning, block["trials"]), {}
    for trial in _complete(reruns):
        seeds.setdefault(trial.user_attrs["seed"], trial)
    if len(trials) < block["trials"] or len(seeds) < block["seeds"]:
        return None
    runs = [seeds[s].user_attrs["result"] for s in sorted(seeds)][: block["seeds"]]
    return trials, selected(plan, trials), runs


def work(command, offset, progress=None):
    """A worker: every unit of `command` (`tf_lars.cli.study` or `.lowcomm`),
    starting at `offset`, until all are complete."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    plan, config = importlib.import_module(command), _CONTEXT["config"]
    reported = progress or (lambda study, trial: None)

    def progress(study, trial):
        reported(study, trial)
        _stop_point()  # between trials

    with storage_errors(_CONTEXT["url"]):
        storage, todo = open_storage(_CONTEXT["url"]), plan.units(config)
        todo = todo[offset:] + todo[:offset]
        while todo:
            todo = [u for u in todo if not advance(plan, storage, config, u, progress)]
            if todo:
                time.sleep(1.0)  # their trials run in other workers
                _stop_point()
    return offset


def _init_worker(config, data, validation, url, threads):
    _CONTEXT.update(config=config, data=data, validation=validation, url=url)
    # The parent stops a worker with SIGTERM, raised at the next stop point.
    signal.signal(signal.SIGTERM, lambda signum, frame: _STOP.append(signum))
    if config.get("workload") != "nqm":  # lowcomm's config has none
        from tf_lars.cli import import_tensorflow, quiet_python_logs

        tf = import_tensorflow()
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
        quiet_python_logs()


def count_trials(storage, config, command=__name__):
    """Complete trials so far (at most each study's budget), and the total."""
    import optuna

    plan = importlib.import_module(command)
    block, done = config[plan.BLOCK], 0
    budgets = (("tuning", block["trials"]), ("reruns", block["seeds"]))
    states = (optuna.trial.TrialState.COMPLETE,)
    for unit in plan.units(config):
        for part, budget in budgets:
            try:
                found = storage.get_study_id_from_name(
                    plan.unit_name(config, unit, part)
                )
            except KeyError:
                continue
            done += min(budget, len(storage.get_all_trials(found, False, states)))
    return done, len(plan.units(config)) * (block["trials"] + block["seeds"])


def execute(config, data, validation, url, workers, command=__name__):
    """Runs every unit's trials of `command` in `workers` processes (in this
    one for 1), under a `rich` progress bar with an ETA."""
    from rich.progress import MofNCompleteColumn, Progress, TimeRemainingColumn

    storage = open_storage(url)
    done, total = count_trials(storage, config, command)
    columns = [*Progress.get_default_columns(), MofNCompleteColumn()]
    with Progress(*columns, TimeRemainingColumn(elapsed_when_finished=True)) as bar:
        task = bar.add_task(command.rsplit(".", 1)[-1], total=total, completed=done)

        last = [0.0]

        def refresh(*_, every=10.0):
            # Counting queries every study: every second took 12 CPU minutes
            # of the default study's 56 (docs/guides/cli.md).
            if time.perf_counter() - last[0] >= every:
                bar.update(task, completed=count_trials(storage, config, command)[0])
                last[0] = time.perf_counter()

        if workers == 1:
            from tf_lars.cli.main import deferred

            _CONTEXT.update(config=config, data=data, validation=validation, url=url)
            with deferred():
                work(command, 0, refresh)
        else:
            arguments = (config, data, validation, url)
            count = len(importlib.import_module(command).units(config))
            run_pool(
                functools.partial(work, command), arguments, workers, count, refresh
            )
        refresh(every=0)


def run_pool(work, arguments, workers, count, refresh):
    """`work(offset)` in `workers` spawned processes, each starting at its
    share of the `count` units (`_init_worker(*arguments, threads)` first);
    a Ctrl-C or error stops each at its next stop point (SIGTERM), then
    kills what still runs after 60 s. `tf-lars lowcomm` runs its units here too."""
    threads = max(1, preflight.available_cores() // workers)
    context = multiprocessing.get_context("spawn")
    executor = concurrent.futures.ProcessPoolExecutor(
        workers, context, initializer=_init_worker, initargs=(*arguments, threads)
    )
    step = max(1, count // workers)
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's alone
    try:
        futures = [executor.submit(work, i * step) for i in range(workers)]
    finally:
        signal.signal(signal.SIGINT, handler)
    processes = list(executor._processes.values())  # noqa: SLF001 - to stop them
    try:
        pending = set(futures)
        while pending:
            _, pending = concurrent.futures.wait(pending, timeout=1.0)
            refresh()
        for future in futures:
            future.result()  # a worker's error, raised here
    except BaseException:
        for process in processes:  # each stops at its next stop point
            if process.exitcode is None:
                os.kill(process.pid, signal.SIGTERM)
        _, running = concurrent.futures.wait(futures, timeout=60)
        for process in processes if running else ():
            if process.exitcode is None:
                process.kill()
        raise
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


# ------------------------------------------------------------------ results
def bootstrap_interval(values, confidence=0.95, resamples=2000, seed=0):
    """The percentile bootstrap interval of the mean of `values`; `(None,
    None)` for one value, which has no spread to resample. At few values it
    covers the mean less often than `confidence` says (0.95: about 0.76 at
    3 values; `python benchmarks/interval_coverage.py`)."""
    values = np.asarray(values, dtype=np.float64)
    if len(values) < 2:
        return None, None
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), (resamples, len(values)))].mean(1)
    low, high = np.quantile(means, [(1 - confidence) / 2, (1 + confidence) / 2])
    return float(low), float(high)


def fit_scaling(batches, steps):
    """`(S_min, E_min)` of `S(B) = S_min + E_min / B`: least squares on the
    relative error, both non-negative; NaNs with fewer than 2 points."""
    from scipy.optimize import nnls

    batches, steps = np.asarray(batches, float), np.asarray(steps, float)
    if len(batches) < 2:
        return math.nan, math.nan
    design = np.stack([np.ones_like(batches), 1.0 / batches], 1) / steps[:, None]
    (s_min, e_min), _ = nnls(design, np.ones_like(steps))
    return float(s_min), float(e_min)


def critical_batch(batches, steps, slack=SCALING_SLACK):
    """The largest batch whose steps stay within `slack` of perfect scaling
    from the smallest batch (Zhang et al. 2024), or None."""
    if not len(batches):
        return None
    perfect = steps[0] * batches[0] / np.asarray(batches, float)
    within = np.asarray(steps) <= slack * perfect
    count = len(within) if within.all() else int(np.argmin(within))
    return int(batches[count - 1]) if count else None


def summarize(config, storage):
    """`(rows, fits)`: a row per finished unit, a fit per optimizer."""
    rows, study = [], config["study"]
    for entry, batch in units(config):
        found = finished(storage, config, (entry, batch))
        if found is None:
            continue
        trials, best, runs = found
        chosen = best.user_attrs["result"]
        steps = [r["steps"] or r["cap"] for r in runs]
        noise = [r["b_simple"] for r in runs if r["b_simple"]]
        rows.append({
            "optimizer": entry["label"], "batch_size": batch, "trials": len(trials),
            "trials_reached": sum(t.user_attrs["result"]["steps"] is not None
                                  for t in trials),
            "selected_trial": best.number, "params": best.params,
            "tuning_steps": chosen["steps"], "cap": chosen["cap"],
            "seed_steps": [r["steps"] for r in runs], "steps": float(np.mean(steps)),
            "steps_interval": bootstrap_interval(
                steps, study["confidence"], study["resamples"]),
            "reached": all(r["steps"] is not None for r in runs),
            "test": runs[0]["test"], "curve": chosen["curve"],
            "b_simple": float(np.mean(noise)) if noise else None,
            "tuning_seconds": sum(t.user_attrs["result"]["seconds"] for t in trials),
            "rerun_seconds": sum(r["seconds"] for r in runs),
            "cpu_seconds": sum(r.get("cpu_seconds", 0.0) for r in
                               [*runs, *(t.user_attrs["result"] for t in trials)]),
        })  # fmt: skip
    labels = [entry["label"] for entry in config["optimizers"]]
    fits = {x: _fit(config, [r for r in rows if r["optimizer"] == x]) for x in labels}
    return rows, fits


def _fit(config, rows):
    """The fit, B_crit and the critical batch, each with a bootstrap
    interval from resampling every batch size's seeds; the median B_simple."""
    noise = [r["b_simple"] for r in rows if r["b_simple"]]
    rows, study = [r for r in rows if r["reached"]], config["study"]
    batches = np.array([r["batch_size"] for r in rows], float)
    seeds = [np.array(r["seed_steps"], float) for r in rows]

    def numbers(steps):
        # Fewer than 2 batch sizes fit nothing (NaN); S_min = 0 scales
        # perfectly over them all (B_crit beyond the largest: infinite).
        s_min, e_min = fit_scaling(batches, steps)
        b_crit = e_min / s_min if s_min > 0 else math.inf if s_min == 0 else math.nan
        largest = critical_batch(batches, steps) if len(batches) > 1 else None
        return s_min, e_min, b_crit, largest or math.nan

    rng = np.random.default_rng(0)
    count = study["resamples"] // 10 if rows else 0
    draws = np.array([numbers([rng.choice(s, len(s)).mean() for s in seeds])
                      for _ in range(count)])  # fmt: skip
    draws = draws.reshape(-1, 4) if len(draws) else np.full((1, 4), math.nan)
    quantiles = [(1 - study["confidence"]) / 2, (1 + study["confidence"]) / 2]
    fit = {"batch_sizes": batches.astype(int).tolist()}
    for name, point, column in zip(FIT_NAMES, numbers([s.mean() for s in seeds]),
                                   draws.T, strict=True):  # fmt: skip
        finite = np.isfinite(column).any()
        interval = np.nanquantile(column, quantiles) if finite else [math.nan] * 2
        fit[name], fit[f"{name}_interval"] = point, [float(v) for v in interval]
    fit["b_simple"] = float(np.median(noise)) if noise else None
    ratio = fit["b_simple"] and 0 < fit["b_crit"] < math.inf
    fit["b_simple_over_b_crit"] = fit["b_simple"] / fit["b_crit"] if ratio else None
    return fit


FIT_NAMES = ("s_min", "e_min", "b_crit", "critical_batch")
COLUMNS = ("optimizer batch_size steps steps_low steps_high reached trials "
           "trials_reached tuning_steps cap test b_simple tuning_seconds "
           "rerun_seconds cpu_seconds params").split()  # fmt: skip
REPORT = """\
# Steps to result against batch size

Workload: {workload}. Target: {metric} {sign} {study[target]:g} on {split}.

Protocol: per optimizer and batch size, {study[trials]} quasi-random trials (Optuna
QMCSampler, scrambled Sobol, seed {seed}) over: learning rate (log-uniform, per
optimizer){space}. A trial's steps: {first_at} at the target, capped at {cap}; one that
never reaches it counts as not reached,
and a trial stops once it passes the unit's fewest steps so far without reaching it (it
can no longer be selected; trials_reached counts the trials that reached first).
Schedule: linear warm-up, then {schedule}. The trial with the fewest steps is rerun on
{study[seeds]} new seeds ({first} to {last}); steps are their mean (a rerun that did not
reach counts as the cap) with a {study[confidence]:.0%} percentile bootstrap interval
({study[resamples]} resamples; none for one seed: over few seeds it holds the mean less
often than {study[confidence]:.0%}, about 75% at 3 seeds for 95%: read it as the seeds'
spread). The test set is evaluated once, on the first rerun.

Fit per optimizer, over the batch sizes whose every rerun reached the target:
S(B) = S_min + E_min / B (least squares on relative error), B_crit = E_min / S_min; the
critical batch is the largest within {slack:.0%} of perfect scaling from the smallest of
them. B_simple: the gradient noise scale measured in the reruns
(tf_lars.GradientNoiseScale over two micro-batches of half the batch: its moving average
at a rerun's end; per unit the mean over the seeds, per optimizer the median over the
batch sizes), beside B_crit. Intervals: bootstrap over the seeds ({fit_resamples}
resamples: each one fits again). Trials: {url}.

Time: {prepare:.0f} s preparing (the data, the checks, TensorFlow's start), {wall:.0f} s
running the trials on {workers} worker process(es): {tuning:.0f} s in tuning trials and
{reruns:.0f} s in reruns, summed over the trials ({cpu:.0f} s of CPU time; the time
columns below are per unit).

{units}

{fits}
"""


def _number(value, digits=3):
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def _cells(row):
    """A unit's row as the CSV's columns."""
    low, high = row["steps_interval"]
    return {**row, "steps_low": low, "steps_high": high}


def _markdown(header, lines):
    rows = [header, ["---"] * len(header), *lines]
    return "\n".join("| " + " | ".join(map(str, r)) + " |" for r in rows)


def report(config, rows, fits, url, times):
    """report.md: the protocol, the budget and every number with its interval."""
    study, nqm_workload = config["study"], config["workload"] == "nqm"
    params = lambda p: ", ".join(f"{k}={v:.3g}" for k, v in p.items())  # noqa: E731
    units = [[_number(_cells(r)[c]) if c != "params" else params(r["params"])
              for c in COLUMNS] for r in rows]  # fmt: skip
    fit_rows = [[label] + [f"{_number(fit[n])} [{_number(fit[f'{n}_interval'][0])}, "
                           f"{_number(fit[f'{n}_interval'][1])}]" for n in FIT_NAMES]
                + [_number(fit["b_simple"]), _number(fit["b_simple_over_b_crit"])]
                for label, fit in fits.items()]  # fmt: skip
    fit_header = ["optimizer", "S_min", "E_min", "B_crit", "critical batch",
                  "B_simple (median)", "B_simple / B_crit"]  # fmt: skip
    return REPORT.format(
        workload=_workload(config), metric=_metric(config), study=study,
        sign="<=" if nqm_workload else ">=", seed=config["seed"],
        split="its expectation (the NQM has no split)" if nqm_workload else
        f"the validation split ({config['validation_fraction']:g} of the training set)",
        space="".join(f", {k} {v}" for k, v in config["search"].items() if v),
        first_at="the first step" if nqm_workload else  # the NQM's loss is exact
        f"the first evaluation (every {study['eval_every']} steps)",
        fit_resamples=study["resamples"] // 10,
        cap="nqm.max_steps" if nqm_workload else "study.max_steps (whole epochs)",
        schedule=study["schedule"].replace("_", " "), first=config["seed"] + 1,
        last=config["seed"] + study["seeds"], slack=SCALING_SLACK - 1, url=url,
        **times, tuning=sum(r["tuning_seconds"] for r in rows),
        reruns=sum(r["rerun_seconds"] for r in rows),
        cpu=sum(r["cpu_seconds"] for r in rows),
        units=_markdown(COLUMNS, units),
        fits=_markdown(fit_header, fit_rows),
    )  # fmt: skip


def _metric(config):
    return "expected loss" if config["workload"] == "nqm" else "validation accuracy"


def _workload(config):
    model = "{name} width {width}".format(**config["model"])
    if config["workload"] == "nqm":
        return f"noisy quadratic model, {config['nqm']['dimensions']} dimensions"
    if config["workload"] == "mnist1d":
        return f"mnist1d ({config['mnist1d']['num_samples']} examples), {model}"
    return f"{config['data']['path'] or 'scikit-learn digits'}, {model}"


def _write_results(folder, config, rows, fits, url, times):
    from tf_lars.cli.plots import plot_selected_curves, plot_steps_to_result

    record = {"key": study_key(config), "storage": url, "times": times,
              "rows": rows, "fits": fits}  # fmt: skip
    text = json.dumps(
        preflight.strict_json(record), indent=1, default=str, allow_nan=False
    )
    preflight.write_text(folder, "results.json", text)
    table = io.StringIO()
    writer = csv.DictWriter(table, COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(_cells(r) | {"params": json.dumps(r["params"])} for r in rows)
    preflight.write_text(folder, "results.csv", table.getvalue())
    preflight.write_text(folder, "report.md", report(config, rows, fits, url, times))
    target, metric = config["study"]["target"], _metric(config)
    for name, plot in (
        ("steps.png", lambda to: plot_steps_to_result(rows, fits, to)),
        ("curves.png", lambda to: plot_selected_curves(rows, target, metric, to)),
    ):
        preflight.write_file(os.path.join(folder, name), plot)


def _check(config):
    """Builds every optimizer once with its range's ends (neural workloads)."""
    if config["workload"] == "nqm":
        return
    from tf_lars.cli.config import ConfigError, build_optimizer, optimizer_spec

    others = {"one_minus_momentum": 0.1, "weight_decay": 1e-4}
    others = {k: v for k, v in others.items() if config["search"][k]}
    for index, entry in enumerate(config["optimizers"]):
        spec = optimizer_spec(entry["optimizer"], f"optimizers.{index}.optimizer")
        for end in entry["learning_rate"]:
            arguments = optimizer_arguments(entry, {"learning_rate": end, **others})
            try:
                build_optimizer(spec._replace(arguments=arguments), end)
            except ConfigError as error:
                raise ConfigError(f"`optimizers.{index}`: {error}") from None


def run(config, data=None, folder=None, overwrite=False, out=print):
    """`tf-lars study`: every unit's trials, then the results, in the run
    folder (after a Ctrl-C: the finished units')."""
    if folder is None:
        data, folder = preflight.preflight("study", config, overwrite)
    _check(config)
    what = f"Study {study_key(config)}: {_workload(config)}"
    limit = len(units(config)) * config["study"]["trials"]
    data = (None, None) if data is None else data  # the NQM has none

    def write(url, times):
        rows, fits = summarize(config, open_storage(url))
        _write_results(folder, config, rows, fits, url, times)
        return rows, fits

    url, times = run_units(
        __name__, config, data, folder, limit, what, out,
        keep=lambda url, times: f" and the {len(write(url, times)[0])} finished "
        "rows in results.csv",
    )  # fmt: skip
    rows, fits = summarize(config, open_storage(url))
    # The report before the files: a full disk (one line, status 2) keeps it.
    out(report(config, rows, fits, url, times))
    _write_results(folder, config, rows, fits, url, times)
    out(f"Results in {folder}/ (report.md, results.csv, results.json, steps.png, "
        "curves.png, config.yaml)")  # fmt: skip
    return 0


def run_units(command, config, data, folder, limit, what, out, keep):
    """Runs every unit of `command` into the run folder; `(url, times)`.

    config.yaml is written first, the trials go to the folder's study.db (or
    the block's `storage`), in the block's `workers` processes (all cores
    for "auto"; at most `limit`). `data` is `(training, validation)`. A
    Ctrl-C or SIGTERM leaves an INTERRUPTED note and raises
    `preflight.Interrupted`, once `keep(url, times)` has written the
    finished units' results (it returns what the folder then keeps, as
    words); the same command resumes.
    """
    plan = importlib.import_module(command)
    block, count = config[plan.BLOCK], len(plan.units(config))
    cores = preflight.available_cores()
    workers = min(cores if block["workers"] == "auto" else block["workers"], limit)
    url = block["storage"] or f"sqlite:///{os.path.abspath(folder)}/study.db"
    preflight.write_text(folder, "config.yaml", dump_config(config))
    note = os.path.join(folder, preflight.INTERRUPTED_NOTE)
    if os.path.exists(note):
        os.remove(note)
    out(f"{what}; {count} units x ({block['trials']} trials + {block['seeds']} "
        f"reruns) on {workers} worker process(es); trials in {url}")  # fmt: skip
    started = time.perf_counter()
    times = lambda: {"prepare": started - STARTED, "workers": workers,  # noqa: E731
                     "wall": time.perf_counter() - started}  # fmt: skip
    try:
        with storage_errors(url):
            execute(config, *data, url, workers, command)
    except KeyboardInterrupt as interrupt:
        done, total = count_trials(open_storage(url), config, command)
        # The note first: a second Ctrl-C while the results are written
        # (each file whole or not at all) leaves it.
        preflight.write_text(
            folder, preflight.INTERRUPTED_NOTE,
            f"Interrupted ({preflight.interruption_name(interrupt)}) after {done} of "
            f"{total} trials; they are kept in {url}: run the same command again "
            "to resume.\n",
        )  # fmt: skip
        kept = keep(url, times())
        raise preflight.Interrupted(
            f"the run folder {folder} keeps {done} of {total} finished trials in "
            f"{url}{kept}; the same command resumes"
        ) from None
    finally:
        checkpoint(url)  # at the end and at a stop
    return url, times()
