"""`tf-lars study`: steps to a target against batch size, per optimizer, on Optuna.

The protocol (Shallue et al. 2019, arXiv 1811.03600; Nado et al. 2021): for
every optimizer and batch size (a *unit*), `study.trials` quasi-random trials
(`optuna.samplers.QMCSampler`, scrambled Sobol) of the same kinds of
hyperparameters (learning rate and 1 - momentum log-uniform, warm-up share,
weight decay), each trained until its validation metric reaches
`study.target` or the step cap; its value is the steps taken (a trial that
never reaches the target ranks after every one that does). The trial with
the fewest steps is rerun on `study.seeds` new seeds, the first of which
evaluates the test set, once. Then, per optimizer, the mean steps with a
bootstrap interval per batch size, the fit `S(B) = S_min + E_min / B`
(McCandlish et al. 2018) with `B_crit = E_min / S_min`, the largest batch
within `SCALING_SLACK` of perfect scaling (Zhang et al. 2024), and the gradient noise
scale `B_simple` of the reruns beside `B_crit`.

Every trial lives in an Optuna storage (a SQLite file in the run folder, or
`study.storage`): a unit is two Optuna studies (tuning and reruns), named
with a hash of the config, so a rerun of the same config resumes where it
stopped and several processes given one storage share the work. Worker
processes each run many trials (one TensorFlow start per process); a
unit's budget is strict (`_claimed`), whichever process asks.
"""

import concurrent.futures
import csv
import hashlib
import io
import json
import math
import multiprocessing
import os
import signal
import time
import warnings

import numpy as np

from tf_lars.cli import nqm, preflight
from tf_lars.cli.config import dump_config

_CONTEXT = {}  # a worker's config, data, validation split and storage URL
_STOP = []  # the signal the parent sent this worker, once it came
_NOT_HASHED = ("output_dir", "run_name")
_NOT_HASHED_STUDY = ("storage", "workers", "confidence", "resamples")
SCALING_SLACK = 1.2  # Zhang et al. 2024: 20% above perfect scaling


def study_key(config):
    """A hash of what the trials depend on: the studies' names carry it."""
    kept = {k: v for k, v in config.items() if k not in _NOT_HASHED}
    kept["study"] = {
        k: v for k, v in config["study"].items() if k not in _NOT_HASHED_STUDY
    }
    text = json.dumps(kept, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def units(config):
    """`(optimizer entry, batch size)` of every unit, smallest batches first."""
    batches = sorted(set(config["study"]["batch_sizes"]))
    return [(entry, batch) for batch in batches for entry in config["optimizers"]]


def _name(config, entry, batch, part):
    return f"{entry['label']} B={batch} {part} [{study_key(config)}]"


def storage_url(config, folder):
    return config["study"]["storage"] or f"sqlite:///{folder}/study.db"


def open_storage(url):
    """Optuna's RDB storage; a trial whose process died is failed after
    its heartbeat stops (2 min), and its slot run again."""
    import optuna

    sqlite = url.startswith("sqlite")
    engine = {"connect_args": {"timeout": 60}} if sqlite else {}
    import sqlalchemy

    for attempt in range(10):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                storage = optuna.storages.RDBStorage(
                    url, engine_kwargs=engine, heartbeat_interval=30, grace_period=120
                )
            break
        except sqlalchemy.exc.SQLAlchemyError:
            # Two processes creating one new storage's tables: one wins.
            if attempt == 9:
                raise
            time.sleep(0.2 * (attempt + 1))
    if sqlite:
        # Write-ahead logging: a commit appends to the log without waiting for
        # the disk (6 ms each otherwise, dozens per trial), still atomic.

        def pragmas(connection, _):
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=NORMAL")

        sqlalchemy.event.listen(storage.engine, "connect", pragmas)
        storage.engine.dispose()  # the connections made before it
    return storage


# ------------------------------------------------------------------ trials
def _momentum_key(entry):
    """The optimizer's momentum argument: beta_1 (Adam-like) or momentum."""
    if entry["optimizer"]["class_name"] in ("SGD", "LARS"):
        return "momentum"
    from tf_lars.cli.config import constructor_parameters, optimizer_spec

    names = constructor_parameters(optimizer_spec(entry["optimizer"]).cls)
    return "beta_1" if "beta_1" in names else "momentum"


def _suggest(trial, config, entry):
    """The trial's hyperparameters: `{name: value}` of the search space."""
    search = config["search"]
    rate = trial.suggest_float("learning_rate", *entry["learning_rate"], log=True)
    params = {"learning_rate": rate}
    for name, log in (
        ("one_minus_momentum", True),
        ("warmup_share", False),
        ("weight_decay", True),
    ):
        if search[name] is not None:
            params[name] = trial.suggest_float(name, *search[name], log=log)
    return params


def optimizer_arguments(entry, params):
    """The optimizer block's config with the trial's hyperparameters in it."""
    arguments = dict(entry["optimizer"]["config"])
    arguments["learning_rate"] = params["learning_rate"]
    if "one_minus_momentum" in params:
        arguments[_momentum_key(entry)] = 1.0 - params["one_minus_momentum"]
    if "weight_decay" in params:
        arguments["weight_decay"] = params["weight_decay"]
    return arguments


def cap(config, batch, num_train):
    """The step cap of a trial at `batch`."""
    if config["workload"] == "nqm":
        return config["nqm"]["max_steps"]
    return config["study"]["max_epochs"] * (num_train // batch)


def run_trial(config, data, validation, entry, batch, params, seed, test=False):
    """Trains one configuration until the target or the cap.

    Returns `{"steps", "cap", "curve", "b_simple", "test", "seconds"}`:
    the first evaluated step that reached the target (None: not reached),
    the validation metric every `eval_every` steps, the gradient noise scale
    at the end, and the test metric when `test` (else None).
    """
    started = time.perf_counter()
    if config["workload"] == "nqm":
        result = _nqm_trial(config, entry, batch, params)
        result["test"] = result["curve"][-1][1] if test else None
    else:
        result = _neural_trial(
            config, data, validation, entry, batch, params, seed, test
        )
    result["seconds"] = time.perf_counter() - started
    return result


def _nqm_trial(config, entry, batch, params):
    steps = config["nqm"]["max_steps"]
    warmup = round(params.get("warmup_share", 0.0) * steps)
    decay = config["study"]["schedule"] == "linear_decay"
    rates = nqm.learning_rates(params["learning_rate"], warmup, steps, decay)
    arguments = optimizer_arguments(entry, params)
    result = nqm.run(
        nqm.make_nqm(config["nqm"]["dimensions"]),
        rates,
        batch,
        config["study"]["target"],
        momentum=arguments.get("momentum", 0.0),
        nesterov=arguments.get("nesterov", False),
        weight_decay=arguments.get("weight_decay") or 0.0,
        record_every=config["study"]["eval_every"],
    )
    return {**result, "cap": steps}


def trial_config(config, entry, batch, params, seed):
    """The `tf-lars train` config of one trial: what it trains, exactly."""
    from tf_lars.cli.config import default_config

    train, epochs = default_config("train"), config["study"]["max_epochs"]
    train.update(seed=seed, data=config["data"], model=config["model"])
    train["training"].update(
        epochs=epochs, batch_size=batch, jit_compile=config["training"]["jit_compile"]
    )
    train["training"]["verbose"] = 0
    decay = config["study"]["schedule"] == "linear_decay"
    train["schedule"] = {
        "name": "warmup_polynomial_decay",
        "warmup_epochs": params.get("warmup_share", 0.0) * epochs,
        "end_learning_rate": 0.0 if decay else params["learning_rate"],
        "power": 1.0,
        "base_batch_size": None,
    }
    block = entry["optimizer"]
    arguments = optimizer_arguments(entry, params)
    train["optimizer"] = {"class_name": block["class_name"], "config": arguments}
    return train


def _neural_trial(config, data, validation, entry, batch, params, seed, test):
    from tf_lars.cli.train import fit_config

    study = config["study"]
    limit = cap(config, batch, len(data.x_train))
    watch = _steps_to_target(validation, study["target"], study["eval_every"], limit)
    if not test:  # tuning and reruns never see the test set
        data = data._replace(x_test=validation[0], y_test=validation[1])
    result = fit_config(trial_config(config, entry, batch, params, seed), data, [watch])
    return {
        "steps": watch.steps,
        "cap": limit,
        "curve": watch.curve,
        "b_simple": gradient_noise_scale(result["optimizer"]),
        "test": result["test_accuracy"] if test else None,
        "train_loss": [float(v) for v in result["history"]["loss"]],
    }


def gradient_noise_scale(optimizer):
    """`B_simple` measured during a neural trial, or None.

    The one place for `tf_lars.GradientNoiseScale` (McCandlish's two-batch
    estimator, `.b_simple`) once the library has it: wrap the trial's
    optimizer in `trial_config`, read it here.
    """
    value = getattr(optimizer, "b_simple", None)
    return None if value is None else float(value)


def _steps_to_target(validation, target, every, limit):
    """A Keras callback: validation accuracy every `every` steps; stops
    training at the first evaluation that reaches `target`."""
    import keras

    x, y = validation

    class StepsToTarget(keras.callbacks.Callback):
        steps, curve, step = None, [], 0

        def on_train_batch_end(self, batch, logs=None):
            _stop_point()
            self.step += 1
            if self.step % every and self.step != limit:
                return
            logits = self.model.predict_on_batch(x)
            accuracy = float(np.mean(np.argmax(logits, axis=-1) == y))
            self.curve = [*self.curve, (self.step, accuracy)]
            if accuracy >= target:
                self.steps = self.step
                self.model.stop_training = True

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
    final, target = result["curve"][-1][1], config["study"]["target"]
    if not math.isfinite(final):
        return 10.0 * result["cap"]
    if config["workload"] == "nqm":
        gap = math.log(max(final, target) / target)
    else:
        gap = (target - final) / target
    return result["cap"] * (1.0 + min(max(gap, 0.0), 8.0))


# ------------------------------------------------------------------ workers
def _complete(study, limit=None):
    """The first `limit` complete trials of a study, by number."""
    import optuna

    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    return sorted(done, key=lambda t: t.number)[:limit]


def _claimed(study, trial, budget, seed=None):
    """Whether `trial` is within the study's budget: fewer than `budget`
    complete or running trials numbered below it (of its seed, for a
    rerun). A shared study so never runs more than its budget."""
    import optuna

    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.RUNNING)
    earlier = [
        t
        for t in study.get_trials(deepcopy=False, states=states)
        if t.number < trial.number
        and (seed is None or t.user_attrs.get("seed") == seed)
    ]
    return len(earlier) < (1 if seed is not None else budget)


def _objective(config, entry, batch, budget, rerun):
    import optuna

    def objective(trial):
        _stop_point()  # inside the trial: Optuna records it as failed
        study, seed = trial.study, trial.user_attrs.get("seed")
        if (rerun and seed is None) or not _claimed(study, trial, budget, seed):
            study.stop()  # the budget is spent (or running elsewhere)
            raise optuna.TrialPruned("over budget")
        params = _suggest(trial, config, entry)
        seed = config["seed"] if seed is None else seed
        data, validation = _CONTEXT["data"], _CONTEXT["validation"]
        test = bool(trial.user_attrs.get("test"))
        result = run_trial(config, data, validation, entry, batch, params, seed, test)
        every = max(1, len(result["curve"]) // 200)  # at most ~200 points kept
        curve = result["curve"]
        result["curve"] = [list(p) for p in curve[::every]] + [list(curve[-1])]
        trial.set_user_attr("result", result)  # one write
        return _value(config, result)

    return objective


def _advance(storage, config, entry, batch, progress):
    """Runs what a unit still needs; whether it is complete."""
    import optuna

    budget, seeds = config["study"]["trials"], config["study"]["seeds"]
    stop = optuna.study.MaxTrialsCallback
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = optuna.samplers.QMCSampler(
            scramble=True, seed=config["seed"], warn_independent_sampling=False
        )
    tuning = optuna.create_study(
        study_name=_name(config, entry, batch, "tuning"),
        storage=storage, sampler=sampler, load_if_exists=True,
    )  # fmt: skip
    if len(_complete(tuning)) < budget:
        objective = _objective(config, entry, batch, budget, rerun=False)
        tuning.optimize(objective, callbacks=[stop(budget), progress])
        if len(_complete(tuning)) < budget:
            return False  # the rest runs in another worker
    best = min(_complete(tuning, budget), key=lambda t: (t.value, t.number))
    reruns = optuna.create_study(
        study_name=_name(config, entry, batch, "reruns"),
        storage=storage, load_if_exists=True,
    )  # fmt: skip
    have = {t.user_attrs.get("seed") for t in reruns.get_trials(deepcopy=False)
            if t.state.name in ("COMPLETE", "RUNNING", "WAITING")}  # fmt: skip
    for index in range(seeds):
        seed = config["seed"] + 1 + index
        if seed not in have:
            attributes = {"seed": seed, "test": index == 0}
            reruns.enqueue_trial(best.params, user_attrs=attributes)
    objective = _objective(config, entry, batch, seeds, rerun=True)
    reruns.optimize(objective, callbacks=[stop(seeds), progress])
    return len(_complete(reruns)) >= seeds


def _work(offset, progress=None):
    """A worker: every unit, starting at `offset`, until all are complete."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    config = _CONTEXT["config"]
    storage, todo = open_storage(_CONTEXT["url"]), units(config)
    todo = todo[offset:] + todo[:offset]
    reported = progress or (lambda study, trial: None)

    def progress(study, trial):
        reported(study, trial)
        _stop_point()  # between trials

    while todo:
        todo = [u for u in todo if not _advance(storage, config, *u, progress)]
        if todo:
            time.sleep(1.0)  # their trials run in other workers
            _stop_point()
    return offset


def _init_worker(config, data, validation, url, threads):
    _CONTEXT.update(config=config, data=data, validation=validation, url=url)
    # The parent stops a worker with SIGTERM, raised at the next stop point.
    signal.signal(signal.SIGTERM, lambda signum, frame: _STOP.append(signum))
    if config["workload"] != "nqm":
        from tf_lars.cli import import_tensorflow, quiet_python_logs

        tf = import_tensorflow()
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
        quiet_python_logs()


def _counts(storage, config):
    """Complete trials so far (at most each study's budget), and the total."""
    study, done = config["study"], 0
    for entry, batch in units(config):
        for part, budget in (("tuning", study["trials"]), ("reruns", study["seeds"])):
            try:
                found = storage.get_study_id_from_name(
                    _name(config, entry, batch, part)
                )
            except KeyError:
                continue
            states = (__import__("optuna").trial.TrialState.COMPLETE,)
            done += min(budget, len(storage.get_all_trials(found, False, states)))
    return done, len(units(config)) * (study["trials"] + study["seeds"])


def execute(config, data, validation, url, workers):
    """Runs every unit's trials in `workers` processes (in this one for 1),
    under a `rich` progress bar with an ETA."""
    from rich.progress import MofNCompleteColumn, Progress, TimeRemainingColumn

    storage = open_storage(url)
    done, total = _counts(storage, config)
    columns = [*Progress.get_default_columns(), MofNCompleteColumn()]
    with Progress(*columns, TimeRemainingColumn(elapsed_when_finished=True)) as bar:
        task = bar.add_task("study", total=total, completed=done)

        last = [0.0]

        def refresh(*_, every=1.0):
            if time.perf_counter() - last[0] >= every:  # a few queries a unit
                bar.update(task, completed=_counts(storage, config)[0])
                last[0] = time.perf_counter()

        if workers == 1:
            from tf_lars.cli.main import deferred

            _CONTEXT.update(config=config, data=data, validation=validation, url=url)
            with deferred():
                _work(0, refresh)
        else:
            _run_workers(config, data, validation, url, workers, refresh)
        refresh(every=0)


def _run_workers(config, data, validation, url, workers, refresh):
    threads = max(1, preflight.available_cores() // workers)
    context = multiprocessing.get_context("spawn")
    arguments = (config, data, validation, url, threads)
    executor = concurrent.futures.ProcessPoolExecutor(
        workers, context, initializer=_init_worker, initargs=arguments
    )
    step = max(1, len(units(config)) // workers)
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's alone
    try:
        futures = [executor.submit(_work, i * step) for i in range(workers)]
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
    """The percentile bootstrap interval of the mean of `values`."""
    values = np.asarray(values, dtype=np.float64)
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
    import optuna

    rows, study = [], config["study"]
    for entry, batch in units(config):
        names = [_name(config, entry, batch, part) for part in ("tuning", "reruns")]
        try:
            tuning, reruns = (
                optuna.load_study(study_name=name, storage=storage) for name in names
            )
        except KeyError:
            continue
        trials, seeds = _complete(tuning, study["trials"]), {}
        for trial in _complete(reruns):
            seeds.setdefault(trial.user_attrs["seed"], trial)
        if len(trials) < study["trials"] or len(seeds) < study["seeds"]:
            continue
        best = min(trials, key=lambda t: (t.value, t.number))
        runs = [seeds[s].user_attrs["result"] for s in sorted(seeds)][: study["seeds"]]
        chosen, tried = (
            best.user_attrs["result"],
            [t.user_attrs["result"] for t in trials],
        )
        steps = [r["steps"] or r["cap"] for r in runs]
        noise = [r["b_simple"] for r in runs if r["b_simple"]]
        interval = bootstrap_interval(steps, study["confidence"], study["resamples"])
        rows.append({
            "optimizer": entry["label"], "batch_size": batch, "trials": len(trials),
            "trials_reached": sum(r["steps"] is not None for r in tried),
            "selected_trial": best.number, "params": best.params,
            "tuning_steps": chosen["steps"], "cap": chosen["cap"],
            "seed_steps": [r["steps"] for r in runs], "steps": float(np.mean(steps)),
            "steps_interval": interval,
            "reached": all(r["steps"] is not None for r in runs),
            "test": runs[0]["test"],
            "b_simple": float(np.mean(noise)) if noise else None,
            "curve": chosen["curve"],
        })  # fmt: skip
    labels = [entry["label"] for entry in config["optimizers"]]
    fits = {x: _fit(config, [r for r in rows if r["optimizer"] == x]) for x in labels}
    return rows, fits


def _fit(config, rows):
    """The fit, B_crit and the critical batch, each with a bootstrap
    interval from resampling every batch size's seeds."""
    rows = [r for r in rows if r["reached"]]
    batches = np.array([r["batch_size"] for r in rows], float)
    seeds = [np.array(r["seed_steps"], float) for r in rows]
    study = config["study"]

    def numbers(steps):
        s_min, e_min = fit_scaling(batches, steps)
        b_crit = e_min / s_min if s_min > 0 else math.inf
        return s_min, e_min, b_crit, critical_batch(batches, steps) or math.nan

    point = numbers([s.mean() for s in seeds])
    rng = np.random.default_rng(0)
    draws = np.array([
        numbers([rng.choice(s, len(s)).mean() for s in seeds])
        for _ in range(study["resamples"] // 10 if rows else 0)
    ]).reshape(-1, 4)  # fmt: skip
    quantiles = [(1 - study["confidence"]) / 2, (1 + study["confidence"]) / 2]
    names = ("s_min", "e_min", "b_crit", "critical_batch")
    fit = {"batch_sizes": batches.astype(int).tolist()}
    for index, name in enumerate(names):
        column = draws[:, index] if len(draws) else np.array([math.nan])
        interval = (
            np.nanquantile(column, quantiles)
            if np.isfinite(column).any()
            else [math.nan] * 2
        )  # noqa: E501
        fit[name], fit[f"{name}_interval"] = point[index], [float(v) for v in interval]
    noise = [r["b_simple"] for r in rows if r["b_simple"]]
    fit["b_simple"] = float(np.median(noise)) if noise else None
    return fit


def _number(value, digits=3):
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}g}"


def _interval(values):
    return f"[{_number(values[0])}, {_number(values[1])}]"


def _table_csv(rows):
    columns = [
        "optimizer",
        "batch_size",
        "steps",
        "steps_low",
        "steps_high",
        "reached",
        "trials",
        "trials_reached",
        "tuning_steps",
        "cap",
        "test",
        "b_simple",
        "params",
    ]  # noqa: E501
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(columns)
    for row in rows:
        flat = {
            **row,
            "steps_low": row["steps_interval"][0],
            "steps_high": row["steps_interval"][1],
            "params": json.dumps(row["params"]),
        }  # noqa: E501
        writer.writerow([flat[c] for c in columns])
    return text.getvalue()


def report(config, rows, fits, url, wall):
    """report.md: the protocol, the budget and every number with its interval."""
    study, metric = config["study"], _metric(config)
    lines = [
        "# Steps to result against batch size", "",
        f"Workload: {_workload(config)}. Target: {metric} {'<=' if config['workload'] == 'nqm' else '>='} {study['target']:g} on the validation split ({config['validation_fraction']:g} of the training set; the NQM has none: its expected loss).",  # noqa: E501
        f"Protocol: per optimizer and batch size, {study['trials']} quasi-random trials (Optuna QMCSampler, scrambled Sobol, seed {config['seed']}) over: learning rate (log-uniform, per optimizer), " + ", ".join(f"{k} {v}" for k, v in config["search"].items() if v is not None) + f". A trial's steps: the first evaluation (every {study['eval_every']} steps) at the target, capped ({'nqm.max_steps' if config['workload'] == 'nqm' else 'study.max_epochs epochs'}); one that never reaches it counts as not reached. Schedule: linear warm-up, then {study['schedule'].replace('_', ' ')}.",  # noqa: E501
        f"The trial with the fewest steps is rerun on {study['seeds']} new seeds ({config['seed'] + 1} to {config['seed'] + study['seeds']}); steps are their mean (a rerun that did not reach counts as the cap) with a {study['confidence']:.0%} percentile bootstrap interval ({study['resamples']} resamples). The test set is evaluated once, on the first rerun.",  # noqa: E501
        f"Fit per optimizer: S(B) = S_min + E_min / B (least squares on relative error), B_crit = E_min / S_min; the critical batch is the largest within {SCALING_SLACK - 1:.0%} of perfect scaling from the smallest batch. Intervals: bootstrap over the seeds. Trials: {url}; wall time {wall:.0f} s.",  # noqa: E501
        "", "| optimizer | batch | steps | interval | seeds reached | trials reached | test | B_simple | selected |",  # noqa: E501
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    for r in rows:
        params = ", ".join(f"{k}={v:.3g}" for k, v in r["params"].items())
        reached = sum(s is not None for s in r["seed_steps"])
        cells = [r["optimizer"], r["batch_size"], _number(r["steps"], 4),
                 _interval(r["steps_interval"]), f"{reached}/{len(r['seed_steps'])}",
                 f"{r['trials_reached']}/{r['trials']}", _number(r["test"], 4),
                 _number(r["b_simple"]), params]  # fmt: skip
        lines.append(_row(cells))
    names = ("s_min", "e_min", "b_crit", "critical_batch")
    lines += ["", _row(["optimizer", "S_min", "E_min", "B_crit",
                        "critical batch (20%)", "B_simple (median)"]),
              _row(["---"] * 6)]  # fmt: skip
    for label, fit in fits.items():
        cells = [f"{_number(fit[n])} {_interval(fit[f'{n}_interval'])}" for n in names]
        lines.append(_row([label, *cells, _number(fit["b_simple"])]))
    return "\n".join(lines) + "\n"


def _row(cells):
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def _metric(config):
    return "expected loss" if config["workload"] == "nqm" else "validation accuracy"


def _workload(config):
    if config["workload"] == "nqm":
        return f"noisy quadratic model, {config['nqm']['dimensions']} dimensions (h_i = c_i = 1/i)"  # noqa: E501
    if config["workload"] == "mnist1d":
        return f"mnist1d ({config['mnist1d']['num_samples']} examples), {config['model']['name']} width {config['model']['width']}"  # noqa: E501
    return f"{config['data']['path'] or 'scikit-learn digits'}, {config['model']['name']} width {config['model']['width']}"  # noqa: E501


def _write_results(folder, config, rows, fits, url, wall):
    from tf_lars.cli.plots import plot_selected_curves, plot_steps_to_result

    record = {
        "key": study_key(config),
        "storage": url,
        "wall_seconds": wall,
        "rows": rows,
        "fits": fits,
    }  # noqa: E501
    preflight.write_text(
        folder, "results.json", json.dumps(record, indent=1, default=str)
    )  # noqa: E501
    preflight.write_text(folder, "results.csv", _table_csv(rows))
    preflight.write_text(folder, "report.md", report(config, rows, fits, url, wall))
    path = os.path.join(folder, "steps.png")
    preflight.write_file(path, lambda to: plot_steps_to_result(rows, fits, to))
    path = os.path.join(folder, "curves.png")
    target, metric = config["study"]["target"], _metric(config)
    preflight.write_file(
        path, lambda to: plot_selected_curves(rows, target, metric, to)
    )  # noqa: E501


def _check(config, data):
    """Builds every optimizer once with its range's ends (neural workloads)."""
    if config["workload"] == "nqm":
        return
    from tf_lars.cli.config import ConfigError, build_optimizer, optimizer_spec

    for index, entry in enumerate(config["optimizers"]):
        key = f"optimizers.{index}.optimizer"
        spec = optimizer_spec(entry["optimizer"], key)
        for end in entry["learning_rate"]:
            params = {
                "learning_rate": end,
                "one_minus_momentum": 0.1,
                "weight_decay": 1e-4,
            }  # noqa: E501
            arguments = optimizer_arguments(
                entry,
                {
                    k: v
                    for k, v in params.items()
                    if k == "learning_rate" or config["search"][k]
                },
            )  # noqa: E501
            try:
                build_optimizer(spec._replace(arguments=arguments), end)
            except ConfigError as error:
                raise ConfigError(f"`optimizers.{index}`: {error}") from None


def run(config, data=None, folder=None, overwrite=False, out=print):
    """`tf-lars study`: every unit's trials, then the results, in the run folder."""
    if folder is None:
        data, folder = preflight.preflight("study", config, overwrite)
    data, validation = data if data is not None else (None, None)
    _check(config, data)
    workers = config["study"]["workers"]
    workers = preflight.available_cores() if workers == "auto" else workers
    workers = max(1, min(workers, len(units(config)) * config["study"]["trials"]))
    url = storage_url(config, os.path.abspath(folder))
    preflight.write_text(folder, "config.yaml", dump_config(config))
    for name in ("INTERRUPTED",):
        if os.path.exists(os.path.join(folder, name)):
            os.remove(os.path.join(folder, name))
    out(
        f"Study {study_key(config)}: {_workload(config)}; {len(units(config))} units "
        f"x ({config['study']['trials']} trials + {config['study']['seeds']} reruns) "
        f"on {workers} worker process(es); trials in {url}"
    )
    started = time.perf_counter()
    try:
        execute(config, data, validation, url, workers)
    except KeyboardInterrupt as interrupt:
        done, total = _counts(open_storage(url), config)
        preflight.write_text(
            folder, preflight.INTERRUPTED_NOTE,
            f"Interrupted ({preflight.interruption_name(interrupt)}) after {done} of {total} trials; they are kept in {url}: run the same command again to resume.\n",  # noqa: E501
        )  # fmt: skip
        raise preflight.Interrupted(
            f"the run folder {folder} keeps config.yaml and {done} of {total} finished "
            f"trials in {url}; the same command resumes the study"
        ) from None
    wall = time.perf_counter() - started
    rows, fits = summarize(config, open_storage(url))
    _write_results(folder, config, rows, fits, url, wall)
    out(report(config, rows, fits, url, wall))
    out(
        f"Results in {folder}/ (report.md, results.csv, results.json, steps.png, "
        "curves.png, config.yaml)"
    )  # noqa: E501
    return 0
