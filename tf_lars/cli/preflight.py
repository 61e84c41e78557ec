"""The checks of a command's config that need no TensorFlow.

`tf-lars` runs them before it imports TensorFlow (which takes seconds), so a
config, data or output-folder mistake is reported at once: the data is
loaded, batch sizes and the warm-up length are checked against it, the model
against the examples' shape, and the run folder is chosen and claimed
(`claim_run_dir`: never an existing one unless `--overwrite` is given, never
one another run holds). Every file of a run folder is written whole or not
at all (`write_file`, `write_text`). This module imports NumPy, PyYAML and
pydantic (through `config`), never TensorFlow or Keras.
"""

import contextlib
import errno
import fcntl
import math
import os
import secrets
import shutil
import time

from tf_lars.cli.config import MAX_SEED, ConfigError, run_dir

# What each command writes into its run folder: `--overwrite` removes these
# (and nothing else) first, so that no file of the earlier run is left to be
# mistaken for the new run's.
RUN_FILES = {
    "train": (
        "config.yaml", "history.json", "summary.json", "model.keras",
        "curves.png", "learning_rate.png", "trust_ratio.png", "trust_ratios.npz",
        "tensorboard", "INTERRUPTED", "backup",
    ),
    "study": (
        "config.yaml", "study.db", "study.db-wal", "study.db-shm", "results.json",
        "results.csv", "report.md", "steps.png", "curves.png", "INTERRUPTED",
    ),
    "lowcomm": (
        "config.yaml", "study.db", "study.db-wal", "study.db-shm", "results.json",
        "table.md", "report.md", "lowcomm.png", "INTERRUPTED",
    ),
}  # fmt: skip
INTERRUPTED_NOTE = "INTERRUPTED"


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, caught by a command; the message says what its folder keeps."""


def available_cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def interruption_name(interrupt):
    """The name of what a `KeyboardInterrupt` stands for: Ctrl-C or SIGTERM."""
    return getattr(interrupt, "signal_name", "Ctrl-C")


def resolve_batch_size(batch_size, num_train, key, full=True):
    """An int batch size; `"full"` (where `full`) is the whole training set."""
    if batch_size == "full":
        return num_train
    if batch_size > num_train:
        raise ConfigError(
            f"`{key}` must be at most the training set size ({num_train})"
            + (" or 'full'" if full else "")
            + f". Received: {key}={batch_size!r}",
            key=key,
        )
    return batch_size


def check_warmup(schedule_config, steps_per_epoch, epochs):
    """Refuses a warm-up that leaves no step to decay over."""
    total_steps = steps_per_epoch * epochs
    # At most the run (a larger warm-up is refused below): 1e308 epochs of
    # steps would overflow the int.
    warmup_epochs = min(schedule_config["warmup_epochs"], epochs)
    warmup_steps = int(round(warmup_epochs * steps_per_epoch))
    if total_steps - warmup_steps < 1:
        raise ConfigError(
            "`schedule.warmup_epochs` must be less than the number of epochs "
            f"({epochs}). Received: schedule.warmup_epochs="
            f"{schedule_config['warmup_epochs']!r}",
            key="schedule.warmup_epochs",
        )
    return warmup_steps


#: The `distribute.strategy` values whose tasks read `TF_CONFIG`; their run
#: folder is claimed by the chief once TensorFlow reads the cluster.
CLUSTER_STRATEGIES = ("multi_worker", "diloco", "parameter_server")


def check_distribute(distribute_config, environ=None):
    """Refuses `distribute` settings that do not go together."""
    strategy = distribute_config["strategy"]
    logical_cpus = distribute_config["logical_cpus"]
    if logical_cpus is not None and strategy != "mirrored":
        raise ConfigError(
            "`distribute.logical_cpus` applies to `distribute.strategy`=mirrored "
            f"only. Received: distribute.logical_cpus={logical_cpus!r} with "
            f"distribute.strategy={strategy!r}"
        )
    environ = os.environ if environ is None else environ
    if strategy not in CLUSTER_STRATEGIES and environ.get("TF_CONFIG"):
        raise ConfigError(
            "TF_CONFIG is set (this process is a task of a cluster), so "
            "`distribute.strategy` must be multi_worker, diloco or parameter_server "
            f"(or unset TF_CONFIG). Received: distribute.strategy={strategy!r}"
        )


def check_parameter_server(config):
    """Refuses what AGN on parameter servers does not run: a mixed-precision
    policy or the loss-scale wrapper (the rounds train in float32)."""
    if config["distribute"]["strategy"] != "parameter_server":
        return
    shown = "with distribute.strategy='parameter_server'"
    precision = config["training"]["precision"]
    if precision != "float32":
        raise ConfigError(
            "`training.precision` must be float32 on parameter servers. Received: "
            f"training.precision={precision!r} {shown}",
            key="training.precision",
        )
    if config["loss_scale"]["enabled"]:
        raise ConfigError(
            "`loss_scale.enabled` must be false on parameter servers (AGN's rounds "
            f"train in float32). Received: loss_scale.enabled=True {shown}",
            key="loss_scale.enabled",
        )


def check_model_input(model_config, input_shape):
    """Refuses a CNN for examples that are not images."""
    if model_config["name"] == "cnn" and (
        len(input_shape) not in (2, 3) or min(input_shape[:2]) < 2
    ):
        raise ConfigError(
            "`model.name`=cnn needs image examples of shape (H, W) or "
            f"(H, W, C) with H, W >= 2; the data has examples of shape "
            f"{tuple(input_shape)}. Use --set model.name=mlp"
        )


def _check_output_dir(config):
    """Refuses an `output_dir` that cannot hold a run folder, and a
    `run_name` longer than its file system's names."""
    output_dir, run_name = config["output_dir"], config["run_name"]
    shown = f"Received: output_dir={output_dir!r}"
    path = os.path.abspath(output_dir)
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = "is" if existing == path else f"is under {existing}, which is"
        raise ConfigError(f"`output_dir` {where} a file, not a folder. {shown}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"`output_dir`: cannot write in {existing} (permission denied or a "
            f"read-only file system). {shown}"
        )
    # Too long, `mkdir` fails with ENAMETOOLONG, which names no part of the
    # path: the run folder is the one name the user chose here.
    try:
        limit = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255  # Linux's and macOS's file systems
    size = len(os.fsencode(run_name or ""))
    if size > limit:
        raise ConfigError(
            f"`run_name` must be at most {limit} bytes (in UTF-8), the file "
            f"system's limit on a folder name. Received: run_name={run_name!r} "
            f"({size} bytes)",
            key="run_name",
        )


def choose_run_dir(config, command, overwrite=False):
    """The run folder a command will write: never an existing one by chance.

    A named run (`run_name`) whose folder exists is refused unless
    `overwrite`; an unnamed run whose timestamped name exists (two runs in
    the same second) gets the next free `-2`, `-3`, ... suffix.
    """
    _check_output_dir(config)
    folder = run_dir(config, command)
    if not os.path.lexists(folder):
        return folder
    if config["run_name"] is None:
        suffix = 2
        while os.path.lexists(f"{folder}-{suffix}"):
            suffix += 1
        return f"{folder}-{suffix}"
    if os.path.islink(folder) or not os.path.isdir(folder):
        kind = "a symbolic link" if os.path.islink(folder) else "a file"
        raise ConfigError(
            f"the run folder {folder} exists and is {kind}; choose another "
            f"`run_name`. Received: run_name={config['run_name']!r}"
        )
    if not overwrite:
        raise ConfigError(
            f"the run folder {folder} exists (an earlier run); choose another "
            "`run_name` (e.g. --set run_name=NAME), or give --overwrite to replace "
            f"its files. Received: run_name={config['run_name']!r}"
        )
    return folder


# The run folders this process holds: folder -> (locked descriptor, the
# folders it created for it, deepest last).
_CLAIMS = {}


def _make_parents(path):
    """`os.makedirs(path)`; returns the folders it created, deepest last."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    created = []
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder)
            created.append(folder)
    return created


def _lock(folder, attempts=1):
    """The folder's descriptor, holding its exclusive lock; None if taken.

    `flock` on the folder itself: the lock ends with the process however it
    ends (a SIGKILL included), and leaves no file behind. `attempts` > 1
    waits out another run's `_held` probe of a folder just created.
    """
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
    descriptor = os.open(folder, flags)
    for attempt in range(attempts):
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return descriptor
        except BlockingIOError:
            if attempt + 1 < attempts:
                time.sleep(0.02)
        except BaseException:
            os.close(descriptor)
            raise
    os.close(descriptor)
    return None


def _held(folder):
    """Whether another run holds the lock of an existing run folder."""
    if os.path.islink(folder) or not os.path.isdir(folder):
        return False
    descriptor = _lock(folder)
    if descriptor is not None:
        os.close(descriptor)
    return descriptor is None


def _taken(folder, run_name):
    return ConfigError(
        f"the run folder {folder} is taken: another tf-lars run is writing it; "
        f"choose another `run_name`. Received: run_name={run_name!r}"
    )


def claim_run_dir(config, command, overwrite=False):
    """Chooses the run folder (`choose_run_dir`) and claims it atomically.

    A new folder is created with `os.mkdir`, which fails when it exists: of
    two runs given one name, one gets it and the other is refused. The
    folder is then locked (`flock`) until `release_run_dirs`, so that a run
    refuses, `--overwrite` or not, a folder that another run is writing.
    """
    _check_output_dir(config)
    run_name = config["run_name"]
    created = []
    folder = run_dir(config, command)
    try:
        created += _make_parents(os.path.abspath(config["output_dir"]))
        while True:
            if run_name is not None and _held(folder):
                raise _taken(folder, run_name)
            folder = choose_run_dir(config, command, overwrite)
            try:
                os.mkdir(folder)
                new = True
            except FileExistsError:
                if run_name is None:
                    continue  # another unnamed run took this name just now
                if not overwrite:
                    raise _taken(folder, run_name) from None
                folder = choose_run_dir(config, command, overwrite)  # not a link
                new = False
            descriptor = _lock(folder, attempts=50)
            if descriptor is None:
                raise _taken(folder, run_name)
            created += [folder] if new else []
            break
    except OSError as error:
        _remove_empty(created)
        if error.errno == errno.ELOOP:
            raise ConfigError(
                f"the run folder {folder} is a symbolic link; choose another "
                f"`run_name`. Received: run_name={run_name!r}"
            ) from None
        raise ConfigError(
            f"cannot create the run folder in {config['output_dir']}: "
            f"{error.strerror or error}. Received: output_dir="
            f"{config['output_dir']!r}"
        ) from None
    except BaseException:
        _remove_empty(created)
        raise
    _CLAIMS[folder] = (descriptor, created)
    return folder


def _remove_empty(created):
    """Removes the folders of `created` (deepest last) while they are empty."""
    for folder in reversed(created):
        try:
            os.rmdir(folder)
        except OSError:
            break  # not empty: it holds what the run wrote


def release_run_dirs():
    """Unlocks the claimed run folders; removes those left empty.

    A folder (or parent) that a refused run created and wrote nothing into
    is removed, as if the run had never started.
    """
    while _CLAIMS:
        _, (descriptor, created) = _CLAIMS.popitem()
        os.close(descriptor)
        _remove_empty(created)


def open_run_dir(folder, command):
    """Creates the run folder, or empties an `--overwrite`n one of our files."""
    try:
        os.makedirs(folder, exist_ok=True)
        for name in RUN_FILES[command]:
            path = os.path.join(folder, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            elif os.path.lexists(path):
                os.remove(path)
    except OSError as error:
        raise ConfigError(
            f"cannot write the run folder {folder}: {error.strerror or error}"
        ) from None
    return folder


def write_file(path, write):
    """Writes the file `path` whole or not at all.

    `write(temporary)` writes a temporary file beside `path`, whose name
    ends as `path`'s does (Keras, Matplotlib and NumPy read the format from
    it); `os.replace` then puts it in place at once. A reader sees the old
    file or the new one; a full disk leaves the old one (or none), never a
    truncated one.
    """
    folder, name = os.path.split(path)
    stem, suffix = os.path.splitext(name)
    temporary = os.path.join(folder, f".{stem}.tmp-{secrets.token_hex(4)}{suffix}")
    try:
        write(temporary)
        os.replace(temporary, path)
    except OSError as error:
        raise ConfigError(f"cannot write {path}: {error.strerror or error}") from None
    finally:
        with contextlib.suppress(OSError):
            os.remove(temporary)


def strict_json(value):
    """`value` with each NaN or infinity as None: JSON has neither."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(item) for item in value]
    return value


def write_text(folder, name, text):
    """Writes one text file of a run folder, whole (`write_file`)."""

    def write(temporary):
        with open(temporary, "x", encoding="utf-8") as handle:
            handle.write(text)

    write_file(os.path.join(folder, name), write)


def check_train(config, data):
    check_distribute(config["distribute"])
    check_parameter_server(config)
    check_model_input(config["model"], data.x_train.shape[1:])
    if config["distribute"]["strategy"] != "none":
        return  # the replicas (and so the global batch) come from TensorFlow
    training = config["training"]
    batch_size = resolve_batch_size(
        training["batch_size"], len(data.x_train), "training.batch_size"
    )
    learning_rate = config["optimizer"]["config"].get("learning_rate")
    if config["schedule"]["name"] != "none" and not isinstance(learning_rate, dict):
        check_warmup(
            config["schedule"], len(data.x_train) // batch_size, training["epochs"]
        )


def _check_ranges(ranges):
    """Refuses a search range `[low, high]` (`(key, bounds, log, top)`, bounds
    None: not searched) that is empty or outside its domain: low > 0 when
    searched on a log scale (else >= 0), and high <= `top` when given."""
    for key, bounds, log, top in ranges:
        if bounds is None:
            continue
        low, high = bounds
        if low > high or (log and low <= 0) or (top is not None and high > top):
            rule = f"{'0 <' if log else '0 <='} low <= high"
            rule += f" and the high end <= {top:g}" if top is not None else ""
            raise ConfigError(
                f"`{key}` must be [low, high] with {rule}. Received: {key}={bounds!r}",
                key=key,
            )


def _check_unique(key, values):
    """Refuses a value given twice in the list `key` (its items' `name`s)."""
    for value in values:
        if values.count(value) > 1:
            name = key.rpartition(".")[2]
            raise ConfigError(
                f"`{key}` must be unique. Received: {name}={value!r} twice",
                key=key.partition(".")[0],
            )


def _check_seeds(config, key):
    """Refuses a `seed` whose reruns (`seed + 1` to `seed + seeds`, `key`)
    pass NumPy's largest seed."""
    seeds = config[key.partition(".")[0]]["seeds"]
    if config["seed"] + seeds > MAX_SEED:
        raise ConfigError(
            f"`seed` + `{key}` must be at most {MAX_SEED} (NumPy's largest seed: the "
            f"reruns take seeds seed + 1 to seed + {key}). Received: "
            f"seed={config['seed']}, {key}={seeds}",
            key="seed",
        )


def check_storage(url, key):
    """Refuses a trials storage URL that SQLAlchemy cannot open, or a SQLite
    file in a folder that does not exist, before the run folder is claimed."""
    if url is None:
        return
    import sqlalchemy

    try:
        parsed = sqlalchemy.engine.make_url(url)
        parsed.get_dialect()
    except (sqlalchemy.exc.ArgumentError, sqlalchemy.exc.NoSuchModuleError) as error:
        raise ConfigError(
            f"`{key}` must be a database URL (e.g. sqlite:///trials.db): "
            f"{' '.join(str(error).split())}. Received: {key}={url!r}",
            key=key,
        ) from None
    database = parsed.database if parsed.get_backend_name() == "sqlite" else None
    folder = os.path.dirname(os.path.abspath(database)) if database else None
    if folder is not None and database != ":memory:" and not os.path.isdir(folder):
        raise ConfigError(
            f"`{key}`: the folder {folder} does not exist. Received: {key}={url!r}",
            key=key,
        )


def check_study(config):
    """Refuses search ranges that are empty or out of their domain, repeated
    labels and batch sizes, seeds past NumPy's, a storage that cannot open,
    and optimizers the NQM has no closed form for."""
    search = config["search"]
    _check_ranges(
        [(f"optimizers.{i}.learning_rate", e["learning_rate"], True, None)
         for i, e in enumerate(config["optimizers"])]
        + [("search.one_minus_momentum", search["one_minus_momentum"], True, 1.0),
           ("search.warmup_share", search["warmup_share"], False, 0.99),
           ("search.weight_decay", search["weight_decay"], True, None)]
    )  # fmt: skip
    _check_unique("optimizers.*.label", [e["label"] for e in config["optimizers"]])
    _check_unique("study.batch_sizes", config["study"]["batch_sizes"])
    _check_seeds(config, "study.seeds")
    check_storage(config["study"]["storage"], "study.storage")
    if config["workload"] == "nqm":
        for index, entry in enumerate(config["optimizers"]):
            name = entry["optimizer"]["class_name"]
            if name != "SGD":
                raise ConfigError(
                    f"`optimizers.{index}.optimizer.class_name` must be SGD with "
                    "workload nqm (its closed form covers SGD, with or without "
                    f"Nesterov momentum). Received: class_name={name!r}",
                    key=f"optimizers.{index}.optimizer.class_name",
                )
    elif config["study"]["target"] > 1:
        raise ConfigError(
            "`study.target` is a validation accuracy and must be at most 1. "
            f"Received: study.target={config['study']['target']!r}",
            key="study.target",
        )


def _split_data(config, kind):
    """`(training, (x_validation, y_validation))` of a `study` or `lowcomm`
    run: `kind` ("synthetic", "mnist1d" or "data") made or loaded, the model
    checked against its examples, the validation split held out."""
    from tf_lars.cli import data as data_lib

    seed = config["data"]["split_seed"]
    if kind == "synthetic":
        data = data_lib.synthetic_data(config["seed"])
    elif kind == "mnist1d":
        data = data_lib.load_mnist1d(config["mnist1d"]["num_samples"], seed)
    else:
        data = data_lib.load_data(config["data"])
    check_model_input(config["model"], data.x_train.shape[1:])
    fraction = config["validation_fraction"]
    try:
        return data_lib.split_validation(data, fraction, seed)
    except ValueError as error:  # too few examples of a class to split
        raise ConfigError(f"`validation_fraction`: {error}") from None


def study_data(config):
    """`(training, (x_validation, y_validation))` of a study, or None (NQM)."""
    if config["workload"] == "nqm":
        return None
    training, validation = _split_data(config, config["workload"])
    for index, batch in enumerate(config["study"]["batch_sizes"]):
        key = f"study.batch_sizes.{index}"
        resolve_batch_size(batch, len(training.x_train), key, full=False)
    return training, validation


#: Keys a resumed study or lowcomm run may change: where the trials live,
#: how many processes run them and how the intervals are drawn.
MAY_CHANGE = ("storage", "workers", "confidence", "resamples")


def _resumes(config, overwrite, command="study"):
    """Whether a named study's (or lowcomm's) folder holds this same run (its
    config.yaml is this config, but for `MAY_CHANGE`): then it is taken
    again, its trials kept."""
    import yaml

    if overwrite or config["run_name"] is None:
        return False
    block = "study" if command == "study" else "tuning"

    def kept(values):
        inner = {k: v for k, v in values[block].items() if k not in MAY_CHANGE}
        return {**values, block: inner}

    try:
        with open(os.path.join(run_dir(config, command), "config.yaml")) as handle:
            earlier = yaml.safe_load(handle)
        return kept(earlier) == kept(config)
    except (OSError, yaml.YAMLError, TypeError, KeyError, AttributeError):
        return False


def check_lowcomm(config):
    """Refuses empty or out-of-domain search ranges, repeated units (a
    number of workers, an H, a method, a speeds name) and an H longer than
    the run."""
    search = config["search"]
    _check_ranges(
        (f"search.{name}", search[name], True, top)
        for name, top in (("inner_learning_rate", None), ("outer_learning_rate", None),
                          ("outer_one_minus_momentum", 1.0))
    )  # fmt: skip
    _check_unique("speeds.*.name", [profile["name"] for profile in config["speeds"]])
    for key in ("workers", "sync_every", "methods"):
        _check_unique(key, config[key])
    _check_seeds(config, "tuning.seeds")
    check_storage(config["tuning"]["storage"], "tuning.storage")
    steps = config["training"]["steps"]
    if max(config["sync_every"]) > steps:
        raise ConfigError(
            f"`sync_every` must hold at most `training.steps` ({steps}) inner steps "
            f"per exchange, or no exchange runs. Received: sync_every="
            f"{config['sync_every']!r}",
            key="sync_every",
        )


def lowcomm_data(config):
    """`(training, (x_validation, y_validation))` of `tf-lars lowcomm`."""
    training, validation = _split_data(config, config["problem"])
    smallest = len(training.x_train) // max(config["workers"])
    if config["training"]["batch_size"] > smallest:
        raise ConfigError(
            "`training.batch_size` must be at most the smallest worker's shard "
            f"({len(training.x_train)} training examples / {max(config['workers'])} "
            f"workers = {smallest}). Received: training.batch_size="
            f"{config['training']['batch_size']}",
            key="training.batch_size",
        )
    return training, validation


def preflight(command, config, overwrite=False):
    """Every check of a validated config that needs no TensorFlow."""
    from tf_lars.cli.data import load_data

    if command in ("study", "lowcomm"):
        if command == "study":
            check_study(config)
            data = study_data(config)
        else:
            check_lowcomm(config)
            data = lowcomm_data(config)
        resume = _resumes(config, overwrite, command)
        folder = claim_run_dir(config, command, overwrite or resume)
        if not resume:
            open_run_dir(folder, command)
        return data, folder
    data = load_data(config["data"])
    check_train(config, data)
    multi_worker = command == "train" and (
        config["distribute"]["strategy"] in CLUSTER_STRATEGIES
    )
    folder = None if multi_worker else claim_run_dir(config, command, overwrite)
    return data, folder
