"""`tf-lars lowcomm`: what each way of training across M workers costs in
accuracy, bytes and (simulated) time, every method tuned alike.

M workers are simulated in one process, each with its own copy of the model
(all from one initialization), its own shard of the training set and its own
inner optimizer. Every method takes M x `training.steps` inner steps in all:

- `dp`: synchronous data parallel: the workers' gradients averaged at every
  step, one optimizer on the mean; a ring all-reduce, as
  `MultiWorkerMirroredStrategy` runs.
- `diloco`: synchronous DiLoCo (`tf_lars.DiLoCo`, `simulate_sync`): H inner
  steps, then the mean pseudo-gradient (an all-reduce) through the outer
  optimizer.
- `agn`, `async_diloco`: asynchronous. Each worker runs on its own simulated
  clock (`speeds`: seconds per inner step); after its H steps (with dynamic
  local updates, Liu et al. 2024, `H_w = floor(v_w / max v * H)`) it commits
  to the center and pulls it back. Commits reach the center in the order of
  the workers' clocks (ties: worker order). AGN's commit is the accumulated
  gradient / H_w through a copy of the inner optimizer; async DiLoCo's is the
  pseudo-gradient `pulled - local` through the outer optimizer at its rate / M.
  A commit's staleness is the number of commits between its pull and it.

A synchronous method's simulated time is its steps at the slowest worker's
step time (every step or round waits for it); an asynchronous one's is its
last commit's. Communication takes no simulated time: bytes are their own
column. Each *unit* (method, M, H, speeds) is tuned by `tuning.trials`
quasi-random trials (Optuna's QMCSampler) on a validation split, and the
selected trial rerun on `tuning.seeds` new seeds, which the test set
evaluates. The protocol and the measured table: docs/guides/low-communication.md.
"""

import hashlib
import heapq
import json
import math
import os
import time

import numpy as np

from tf_lars.cli import preflight, study

METHODS = ("dp", "diloco", "agn", "async_diloco")
ASYNC = ("agn", "async_diloco")
LABELS = {
    "dp": "sync data parallel",
    "diloco": "sync DiLoCo",
    "agn": "AGN",
    "async_diloco": "async DiLoCo",
}
# Not in the hash: the lists of units (a unit's own name says what it is),
# so a larger run given the same storage reuses a smaller run's units.
_UNIT_LISTS = ("workers", "sync_every", "methods", "speeds")
# For study's shared runner: the block with trials and seeds, Optuna's direction.
BLOCK, DIRECTION = "tuning", "maximize"


# ------------------------------------------------------------------ units
def key(config):
    """`study.config_key` of a lowcomm run."""
    return study.config_key(config, "tuning", _UNIT_LISTS)


def units(config):
    """`(method, M, H, speeds)` of every unit. Data parallel has H = 1; the
    synchronous methods' accuracy does not depend on the workers' speeds
    (speeds None: each profile's time is computed from the one run)."""
    found, methods = [], config["methods"]
    for workers in config["workers"]:
        if "dp" in methods:
            found.append(("dp", workers, 1, None))
        for sync_every in config["sync_every"]:
            if "diloco" in methods:
                found.append(("diloco", workers, sync_every, None))
            found += [(method, workers, sync_every, name)
                      for method in ASYNC if method in methods
                      for name in profiles(config)]  # fmt: skip
    return found


def unit_name(config, unit, part):
    method, workers, sync_every, speeds = unit
    if speeds is not None:  # the profile's times and rule, not only its name
        text = json.dumps(profiles(config)[speeds], sort_keys=True)
        speeds = f"{speeds}:{hashlib.sha256(text.encode()).hexdigest()[:6]}"
    return f"{method} M={workers} H={sync_every} {speeds} {part} [{key(config)}]"


def profiles(config):
    """The speeds profiles by name."""
    return {profile["name"]: profile for profile in config["speeds"]}


def step_times(config, speeds, workers):
    """Each worker's seconds per inner step: the profile's list, cycled."""
    times = profiles(config)[speeds]["step_times"]
    return [float(times[m % len(times)]) for m in range(workers)]


def local_steps(sync_every, times, dynamic):
    """Each worker's H: H, or with dynamic local updates (Liu et al. 2024,
    arXiv 2401.09135) `floor(v_w / max v * H)` for speed `v = 1 / time`
    (at least 1)."""
    if not dynamic:
        return [sync_every] * len(times)
    fastest = min(times)
    return [max(1, math.floor(fastest / t * sync_every)) for t in times]


def _suggest(trial, config, method):
    """The trial's hyperparameters: the inner learning rate, and for the
    methods with an outer optimizer its learning rate and 1 - momentum."""
    search = config["search"]
    params = {"inner_learning_rate": trial.suggest_float(
        "inner_learning_rate", *search["inner_learning_rate"], log=True)}  # fmt: skip
    if method in ("diloco", "async_diloco"):
        for name in ("outer_learning_rate", "outer_one_minus_momentum"):
            if search[name] is not None:
                params[name] = trial.suggest_float(name, *search[name], log=True)
    return params


# ------------------------------------------------------------------ optimizers
def _optimizer(block, key_name, learning_rate=None, one_minus_momentum=None):
    from tf_lars.cli.config import build_optimizer, optimizer_spec

    spec = optimizer_spec(block, key_name)
    if one_minus_momentum is not None:
        arguments = {**spec.arguments, "momentum": 1.0 - one_minus_momentum}
        spec = spec._replace(arguments=arguments)
    return build_optimizer(spec, learning_rate)


def optimizers(config, method, workers, sync_every, params, copies=None):
    """What `simulate` trains `method` with (`copies` workers, default M):
    data parallel's one optimizer; DiLoCo's workers; or the workers' inner
    optimizers and then the center's (AGN's: the inner one; async DiLoCo's:
    the outer one at its learning rate / M)."""
    from tf_lars.cli.config import ConfigError, one_line, optimizer_spec
    from tf_lars.diloco import DiLoCo

    copies = workers if copies is None else copies
    rate = params.get("inner_learning_rate")
    inner = lambda: _optimizer(config["inner_optimizer"], "inner_optimizer", rate)  # noqa: E731
    if method == "dp":
        return [inner()]
    outer_key = "outer_optimizer" if method == "diloco" else "async_outer_optimizer"
    outer_rate = params.get("outer_learning_rate")
    if outer_rate is None:  # not searched: the block's
        outer_rate = optimizer_spec(config[outer_key], outer_key).learning_rate
    if method == "async_diloco" and not isinstance(outer_rate, int | float):
        raise ConfigError(
            f"`{outer_key}.config.learning_rate` must be a number: it is divided by "
            f"M. Received: {outer_key}.config.learning_rate={outer_rate!r}",
            key=f"{outer_key}.config.learning_rate",
        )
    outer = lambda divide=1: _optimizer(  # noqa: E731
        config[outer_key], outer_key,
        outer_rate / divide if divide != 1 else outer_rate,
        params.get("outer_one_minus_momentum"),
    )  # fmt: skip
    if method == "agn":
        return [inner() for _ in range(copies)] + [inner()]
    if method == "async_diloco":
        return [inner() for _ in range(copies)] + [outer(workers)]
    try:  # the outer step is simulate_sync's
        return [DiLoCo(inner(), outer(), sync_every=sync_every, exchange="external")
                for _ in range(copies)]  # fmt: skip
    except ValueError as error:
        raise ConfigError(
            f"the run {LABELS[method]}, M={workers}, H={sync_every} is refused, "
            f"so no run started: {one_line(error)}",
            key="outer_optimizer",
        ) from None


# ------------------------------------------------------------------ simulation
class _Workers:
    """M models from one initialization, their shards and their batches."""

    def __init__(self, config, data, workers, seed):
        import keras

        from tf_lars.cli.train import build_model

        shape = data.x_train.shape[1:]
        self.models = []
        for _ in range(workers):
            keras.utils.set_random_seed(seed)
            self.models.append(build_model(config["model"], shape, data.num_classes))
        self.variables = [m.trainable_variables for m in self.models]
        self.payload = sum(int(np.prod(v.shape)) * 4 for v in self.variables[0])
        self.loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        rng = np.random.default_rng(seed)
        self.shards = np.array_split(rng.permutation(len(data.y_train)), workers)
        self.rngs = [np.random.default_rng([seed, m]) for m in range(workers)]
        self.orders = [r.permutation(s) for r, s in zip(self.rngs, self.shards)]
        self.at = [0] * workers
        self.data, self.size = data, config["training"]["batch_size"]

    def batch(self, m):
        """Worker `m`'s next batch from its own shard, reshuffled each pass."""
        if self.at[m] + self.size > len(self.orders[m]):
            self.orders[m], self.at[m] = self.rngs[m].permutation(self.shards[m]), 0
        rows = self.orders[m][self.at[m] : self.at[m] + self.size]
        self.at[m] += self.size
        return self.data.x_train[rows], self.data.y_train[rows]

    def gradients(self, m, x, y):
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = self.loss(y, self.models[m](x, training=True))
        return tape.gradient(loss, self.variables[m])


def _sync(sim, method, built, workers, sync_every, steps):
    """The synchronous methods: every worker's step at once; returns the
    final variables and the exchanges."""
    import tensorflow as tf

    from tf_lars.diloco import simulate_sync

    variables = sim.variables
    for optimizer, vs in zip(built, variables):
        optimizer.build(vs)

    @tf.function
    def step(x, y):
        grads = [sim.gradients(m, x[m], y[m]) for m in range(workers)]
        if method == "dp":
            mean = [tf.add_n(list(g)) / workers for g in zip(*grads, strict=True)]
            built[0].apply(mean, variables[0])
            for others in variables[1:]:
                for target, value in zip(others, variables[0], strict=True):
                    target.assign(value)
        else:
            for optimizer, g, vs in zip(built, grads, variables, strict=True):
                optimizer.apply(g, vs)

    exchange = tf.function(lambda: simulate_sync(built, variables))
    exchanges = 0
    for number in range(1, steps + 1):
        x, y = zip(*(sim.batch(m) for m in range(workers)))
        step(tf.constant(np.stack(x)), tf.constant(np.stack(y)))
        if method == "dp":
            exchanges += 1
        elif number % sync_every == 0 or number == steps:
            # A last round shorter than H is exchanged too: its steps reach
            # the evaluated model as every other round's do.
            exchange()
            exchanges += 1
    final = variables[0] if method == "dp" else built[0].global_variables
    return [v.numpy() for v in final], exchanges


def _async(sim, method, built, workers, heights, times, steps):
    """The asynchronous methods on the simulated clock; returns the final
    center, its commits, their staleness and the last commit's time."""
    import tensorflow as tf

    from tf_lars.agn import local_step, normalized, pseudo_gradients, reset

    *local, center_optimizer = built
    variables = sim.variables
    center = [tf.Variable(v) for v in variables[0]]
    center_optimizer.build(center)
    outer = method == "async_diloco"
    # AGN accumulates the gradients; async DiLoCo keeps the pulled center.
    saved = [[tf.Variable(v if outer else tf.zeros_like(v)) for v in vs]
             for vs in variables]  # fmt: skip
    for optimizer, vs in zip(local, variables):
        optimizer.build(vs)

    def make_step(m):
        accumulators = [] if outer else saved[m]  # async DiLoCo accumulates nothing
        return tf.function(
            lambda x, y: local_step(
                local[m], local[m], variables[m], accumulators, sim.gradients(m, x, y)
            )
        )

    def make_commit(m):
        def commit(count):
            grads = (pseudo_gradients(saved[m], variables[m]) if outer
                     else normalized(saved[m], count))  # fmt: skip
            center_optimizer.apply(grads, center)
            reset(local[m], variables[m], center, saved[m], keeps_center=outer)

        return tf.function(commit)

    stepping = [make_step(m) for m in range(workers)]
    commits = [make_commit(m) for m in range(workers)]
    clock = [(heights[m] * times[m], m, 0.0) for m in range(workers)]
    heapq.heapify(clock)
    version, pulled, staleness, done, last = 0, [0] * workers, [], 0, 0.0
    total = workers * steps
    while done < total:
        _, m, started = heapq.heappop(clock)
        count = min(heights[m], total - done)  # the last segment may be shorter
        for _ in range(count):
            x, y = sim.batch(m)
            stepping[m](tf.constant(x), tf.constant(y))
        done += count
        # AGN divides by its period in a shorter last segment too.
        commits[m](tf.constant(float(heights[m])))
        staleness.append(version - pulled[m])
        version += 1
        pulled[m] = version
        finish = started + count * times[m]
        last = max(last, finish)
        heapq.heappush(clock, (finish + heights[m] * times[m], m, finish))
    return [v.numpy() for v in center], staleness, last


def _accuracy(model, weights, x, y):
    for variable, value in zip(model.trainable_variables, weights, strict=True):
        variable.assign(value)
    logits = model(x, training=False)
    return float(np.mean(np.argmax(logits, axis=-1) == y))


def simulate(config, data, validation, unit, params, seed, test=False):
    """Trains one unit's method with `params` from `seed`: its result."""
    from tf_lars.distribute.diloco import all_reduce_bytes

    method, workers, sync_every, speeds = unit
    started = time.perf_counter()
    sim = _Workers(config, data, workers, seed)
    built = optimizers(config, method, workers, sync_every, params)
    steps, payload = config["training"]["steps"], sim.payload
    result = {"staleness_mean": 0.0, "staleness_max": 0}
    if method in ASYNC:
        times = step_times(config, speeds, workers)
        dynamic = profiles(config)[speeds]["dynamic_local_updates"]
        heights = local_steps(sync_every, times, dynamic)
        final, staleness, wall = _async(
            sim, method, built, workers, heights, times, steps
        )
        commits = len(staleness)
        # Each commit pushes the payload and pulls the center: per worker,
        # the mean over the workers.
        sent = received = payload * commits / workers
        result.update(
            exchanges=commits, simulated_seconds=wall, local_steps=heights,
            staleness_mean=float(np.mean(staleness)), staleness_max=max(staleness),
        )  # fmt: skip
    else:
        final, exchanges = _sync(sim, method, built, workers, sync_every, steps)
        each = all_reduce_bytes(payload, workers)
        sent, received = each[0] * exchanges, each[1] * exchanges
        result.update(exchanges=exchanges)
    model = sim.models[0]
    result.update(
        validation=_accuracy(model, final, *validation),
        test=_accuracy(model, final, data.x_test, data.y_test) if test else None,
        bytes_sent=sent, bytes_received=received, payload=payload,
        seconds=time.perf_counter() - started,
    )  # fmt: skip
    return result


# ------------------------------------------------------------------ tuning
def evaluate(config, unit, trial, seed, rerun):
    """One trial of a unit (study's shared runner): its simulation, and the
    validation accuracy as its objective; a rerun also takes the test set."""
    params = _suggest(trial, config, unit[0])
    context = study._CONTEXT  # noqa: SLF001 - the worker's data
    result = simulate(
        config, context["data"], context["validation"], unit, params, seed, test=rerun
    )
    return result, result["validation"]


# ------------------------------------------------------------------ results
def sync_seconds(config, unit, speeds):
    """A synchronous method's simulated time under the profile `speeds`:
    its steps at the slowest worker's step time."""
    return config["training"]["steps"] * max(step_times(config, speeds, unit[1]))


def _timings(config):
    """One profile per distinct list of step times: what a synchronous
    unit's rows differ by (dynamic local updates are asynchronous only)."""
    first = {}
    for profile in config["speeds"]:
        first.setdefault(tuple(profile["step_times"]), profile["name"])
    return list(first.values())


def summarize(config, storage):
    """A row per finished unit and speeds profile (a synchronous unit's
    row repeated per profile with that profile's time)."""
    tuning, rows = config["tuning"], []
    interval = lambda values: study.bootstrap_interval(  # noqa: E731
        values, tuning["confidence"], tuning["resamples"])  # fmt: skip
    finished = {}
    for unit in units(config):
        found = study.finished(storage, config, unit, __name__)
        if found is None:
            continue
        trials, best, results = found
        finished[unit] = [r["test"] for r in results]
        method, workers, sync_every, speeds = unit
        for profile in [speeds] if speeds else _timings(config):
            test = [r["test"] for r in results]
            rows.append({
                "method": method, "label": LABELS[method], "workers": workers,
                "sync_every": sync_every, "speeds": profile,
                "dynamic_local_updates": bool(speeds) and profiles(config)[profile][
                    "dynamic_local_updates"],
                "trials": len(trials), "params": best.params,
                "tuning_validation": best.value,
                "validation": float(np.mean([r["validation"] for r in results])),
                "seed_test": test, "test": float(np.mean(test)),
                "test_interval": interval(test),
                "bytes_sent": results[0]["bytes_sent"],
                "bytes_received": results[0]["bytes_received"],
                "exchanges": results[0]["exchanges"],
                "simulated_seconds": (
                    float(np.mean([r["simulated_seconds"] for r in results]))
                    if speeds else sync_seconds(config, unit, profile)),
                "staleness_mean": float(np.mean([r["staleness_mean"]
                                                 for r in results])),
                "staleness_max": max(r["staleness_max"] for r in results),
                "local_steps": results[0].get("local_steps"),
                "seconds": sum(t.user_attrs["result"]["seconds"] for t in trials)
                + sum(r["seconds"] for r in results),
            })  # fmt: skip
    for row in rows:  # against data parallel at the same M, on the same seeds
        base = finished.get(("dp", row["workers"], 1, None))
        row["versus_dp"] = row["versus_dp_interval"] = row["bytes_ratio"] = None
        if base is not None and row["method"] != "dp":
            difference = np.subtract(row["seed_test"], base)
            row["versus_dp"] = float(np.mean(difference))
            row["versus_dp_interval"] = interval(difference)
        dp = next((r for r in rows if r["method"] == "dp"
                   and r["workers"] == row["workers"]), None)  # fmt: skip
        total = row["bytes_sent"] + row["bytes_received"]
        if dp is not None and total:
            row["bytes_ratio"] = (dp["bytes_sent"] + dp["bytes_received"]) / total
    return rows


def _shown(interval, sign=""):
    """` [low, high]` in points, or nothing for one seed (no interval)."""
    low, high = interval
    if low is None:
        return ""
    return f" [{100 * low:{sign}.2f}, {100 * high:{sign}.2f}]"


def format_table(rows):
    """The Markdown table: one row per unit and speeds profile."""
    header = ("method", "M", "H", "speeds", "test accuracy (%)", "vs DP (points)",
              "sent / worker (MB)", "received / worker (MB)", "fewer bytes than DP",
              "simulated time (s)", "staleness (mean / max)")  # fmt: skip
    lines = []
    for r in rows:
        versus = "-"
        if r["versus_dp"] is not None:
            interval = _shown(r["versus_dp_interval"], "+")
            versus = f"{100 * r['versus_dp']:+.2f}{interval}"
        ratio = f"{r['bytes_ratio']:.1f}x" if r["bytes_ratio"] else "-"
        stale = "-"
        if r["method"] in ASYNC:
            stale = f"{r['staleness_mean']:.1f} / {r['staleness_max']}"
        speeds = r["speeds"] + (" + DyLU" if r["dynamic_local_updates"] else "")
        lines.append((
            r["label"], r["workers"], r["sync_every"], speeds,
            f"{100 * r['test']:.2f}" + _shown(r["test_interval"]), versus,
            f"{r['bytes_sent'] / 1e6:,.2f}", f"{r['bytes_received'] / 1e6:,.2f}",
            ratio, f"{r['simulated_seconds']:,.0f}", stale,
        ))  # fmt: skip
    return study._markdown(header, lines)  # noqa: SLF001


PROTOCOL = """\
# Low-communication comparison

Problem: {problem}; {model}. Each of M workers takes {steps} inner steps of batch
{batch} on its own shard ({total} inner steps in all per method); inner optimizer
{inner}.

Protocol: per unit (method, M, H, speeds), {trials} quasi-random trials (Optuna
QMCSampler, scrambled Sobol, seed {seed}) over: the inner learning rate (log-uniform
{inner_range}) and, for sync and async DiLoCo, the outer learning rate (log-uniform
{outer_range}; async DiLoCo's divided by M per commit) and 1 - outer momentum
(log-uniform {momentum_range}); AGN and data parallel search the inner rate alone
with the same number of trials. Selected on validation accuracy ({fraction:.0%} of the
training set held out); the selected trial rerun on {seeds} new seeds ({first} to
{last}), each evaluated on the test set: the mean with a {confidence:.0%} percentile
bootstrap interval ({resamples} resamples; none for one seed: over few seeds it holds
the mean less often than {confidence:.0%}, about 75% at 3 seeds for 95%: read it as the
seeds' spread). "vs DP": the mean paired difference from data parallel at the same M on
the same seeds, with its interval.

Bytes per worker: data parallel and sync DiLoCo send and receive a ring all-reduce's
2 (M - 1) / M x P per exchange (P the float32 parameters' bytes); an asynchronous
commit pushes P and pulls P (per worker: the mean over the workers). Simulated time:
the seconds per inner step of each speeds profile ({profiles}); a synchronous
method waits for the slowest worker at every step; an asynchronous one ends at its last
commit; communication takes no simulated time. Staleness: commits between a worker's
pull and its commit.

Time: {wall:.0f} s on {workers} worker process(es).

{table}
"""


def report(config, data, rows, times):
    """report.md: the protocol, the budget and the table."""
    tuning, search = config["tuning"], config["search"]
    fmt = lambda r: f"[{r[0]:g}, {r[1]:g}]" if r else "not searched"  # noqa: E731
    inner = config["inner_optimizer"]["class_name"]
    speeds = "; ".join(
        f"{p['name']}: {p['step_times']}" + (" with dynamic local updates"
                                             if p["dynamic_local_updates"] else "")
        for p in config["speeds"]
    )  # fmt: skip
    return PROTOCOL.format(
        problem=data.source, model="{name} width {width}".format(**config["model"]),
        steps=config["training"]["steps"], batch=config["training"]["batch_size"],
        total="M x " + str(config["training"]["steps"]), inner=inner,
        trials=tuning["trials"], seed=config["seed"],
        inner_range=fmt(search["inner_learning_rate"]),
        outer_range=fmt(search["outer_learning_rate"]),
        momentum_range=fmt(search["outer_one_minus_momentum"]),
        fraction=config["validation_fraction"], seeds=tuning["seeds"],
        first=config["seed"] + 1, last=config["seed"] + tuning["seeds"],
        confidence=tuning["confidence"], resamples=tuning["resamples"],
        profiles=speeds, wall=times["wall"], workers=times["workers"],
        table=format_table(rows),
    )  # fmt: skip


def _write_results(folder, config, data, rows, times):
    from tf_lars.cli.plots import plot_communication

    record = {"key": key(config), "source": data.source, "times": times, "rows": rows}
    text = json.dumps(preflight.strict_json(record), indent=1, allow_nan=False)
    preflight.write_text(folder, "results.json", text)
    preflight.write_text(folder, "table.md", format_table(rows) + "\n")
    preflight.write_text(folder, "report.md", report(config, data, rows, times))
    if rows:
        preflight.write_file(
            os.path.join(folder, "lowcomm.png"), lambda to: plot_communication(rows, to)
        )


def _check(config):
    """Builds every unit's optimizers once, at both ends of the ranges: a
    block that one unit refuses is one line before any trial."""
    search = config["search"]
    for unit in units(config):
        for end in (0, 1):
            params = {name: bounds[end] for name, bounds in search.items() if bounds}
            optimizers(config, unit[0], unit[1], unit[2], params, copies=1)


def run(config, data=None, folder=None, overwrite=False, out=print):
    """`tf-lars lowcomm`: every unit's trials and reruns, then report.md,
    table.md, results.json and lowcomm.png in the run folder (after a
    Ctrl-C: the finished units')."""
    if folder is None:
        data, folder = preflight.preflight("lowcomm", config, overwrite)
    _check(config)

    def write(url, times):
        rows = summarize(config, study.open_storage(url))
        _write_results(folder, config, data[0], rows, times)
        return rows

    what = f"lowcomm {key(config)}: {data[0].source}"
    url, times = study.run_units(
        __name__, config, data, folder, len(units(config)), what, out,
        keep=lambda url, times: f" and the {len(write(url, times))} finished rows "
        "in table.md",
    )  # fmt: skip
    rows = summarize(config, study.open_storage(url))
    # The report before the files: a full disk (one line, status 2) keeps it.
    out(report(config, data[0], rows, times))
    _write_results(folder, config, data[0], rows, times)
    out(f"Results in {folder}/ (report.md, table.md, results.json, lowcomm.png, "
        "config.yaml)")  # fmt: skip
    return 0
