"""The `tf-lars` command line: `train`, `study` and `lowcomm`.

`tf-lars [--tf-log] COMMAND [--config FILE] [--set key=value ...] [--overwrite]`;
`--help` says what each command does and docs/guides/cli.md gives every
config key. A configuration, data or output-folder problem (or, for a
multi-worker `train`, a bad `TF_CONFIG`) is one line on stderr and status 2;
Ctrl-C is one line and status 130, SIGTERM 143, the run folder keeping what
finished. This module imports no TensorFlow, Keras or NumPy, so that
`--help` answers at once; each command imports its module when it runs.
"""

import argparse
import atexit
import contextlib
import gc
import importlib
import importlib.util
import signal
import sys
import threading

from tf_lars.cli import quiet_python_logs, set_tensorflow_log_level

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143, as shells report a SIGTERM
# Top-level modules of the `cli` extra (pyproject.toml), which brings the
# `tensorflow` extra too.
_CLI_EXTRA = (
    "yaml", "pydantic", "matplotlib", "sklearn", "rich", "tensorflow", "absl",
    "optuna", "mnist1d", "requests",
)  # fmt: skip

_DESCRIPTION = (
    "Large-batch training experiments with tf_lars (LARS for Keras 3): "
    "train one model, or study steps to a target against batch size per "
    "optimizer. (The optimizer step benchmarks are "
    "benchmarks/bench.py of a source checkout.)"
)
_TF_LOG = "--tf-log"
_TF_LOG_HELP = (
    "leave TensorFlow's C++ logging on (by default TF_CPP_MIN_LOG_LEVEL=3 "
    "unless set in the environment)"
)


def _parser():
    parser = argparse.ArgumentParser(prog="tf-lars", description=_DESCRIPTION)
    parser.add_argument(_TF_LOG, action="store_true", help=_TF_LOG_HELP)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    for name, help_text in (
        (
            "train",
            "train a Keras model with the configured optimizer and write a run "
            "folder (config, history, model, plots)",
        ),
        (
            "study",
            "steps to a target against batch size for each optimizer of the "
            "config (by default Nesterov, AdamW, LARS and LAMB), each tuned with "
            "the same number of quasi-random Optuna trials; the fit of "
            "S(B) = S_min + E_min/B, B_crit and the gradient noise scale; a "
            "report, tables and plots",
        ),
        (
            "lowcomm",
            "compare synchronous data parallel, AGN, asynchronous and synchronous "
            "DiLoCo with M workers simulated in one process, each method tuned by "
            "Optuna on a validation split and rerun on new seeds: test accuracy with "
            "intervals, bytes per worker, simulated time; a report, table and plot",
        ),
    ):
        example = {"train": "training.epochs=20", "study": "study.trials=4"}.get(
            name, "training.steps=300"
        )
        command = commands.add_parser(name, help=help_text, description=help_text)
        command.add_argument(
            "--config",
            metavar="FILE",
            help=f"YAML config merged over the default (configs/{name}.yaml)",
        )
        command.add_argument(
            "--set",
            dest="overrides",
            metavar="KEY=VALUE",
            action="append",
            default=[],
            help=f"override one config key, e.g. --set {example} "
            "(value parsed as YAML; repeatable)",
        )
        command.add_argument(
            "--overwrite",
            action="store_true",
            help="reuse the run folder of an earlier run with the same run_name "
            "(its files are replaced); without it such a run is refused",
        )
        command.add_argument(
            _TF_LOG, action="store_true", default=argparse.SUPPRESS, help=_TF_LOG_HELP
        )
        if name == "study":
            command.add_argument(
                "--quick",
                action="store_true",
                help="merge configs/study-quick.yaml first: a small study of the "
                "noisy quadratic model (seconds)",
            )
        if name == "lowcomm":
            command.add_argument(
                "--full",
                action="store_true",
                help="merge configs/lowcomm-full.yaml first: the whole table, "
                "M in {2, 4, 8} and H in {1, 10, 50, 100} (about an hour on 2 cores)",
            )
    return parser


def _removed_command(argv):
    """The one-line error of a command that is gone, or None."""
    words = [word for word in argv if not word.startswith("-")]
    if words[:1] == ["sweep"]:
        return _error(
            "sweep",
            "`tf-lars sweep` was removed; use `tf-lars study` (steps to a target "
            "against batch size, each optimizer tuned by Optuna; its --help says more)",
        )
    return None


def _error(command, message):
    print(f"tf-lars {command}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Python is running, to be handled as Ctrl-C is."""

    signal_name = "SIGTERM"


class _Signals:
    """SIGINT and SIGTERM while `main` runs, raised where it is safe.

    Python raises a signal's exception between any two bytecodes. One raised
    inside TensorFlow's own Python code (a dataset iterator being made or
    deleted at an epoch's start) can leave its C++ state half built, and the
    process then dies of heap corruption instead of exiting 130 or 143. So
    inside `deferred()` (training and evaluation) the first signal is only
    recorded, and raised at the next safe point: a Keras batch or epoch end
    (`raise_pending`, from a callback) or the end of the block. Elsewhere it
    is raised at once. A second Ctrl-C is raised at once everywhere (a way
    out of a step that does not end); later SIGTERMs are counted and not
    raised, so the first one's handling (the INTERRUPTED note) is not cut
    short: Kubernetes and Slurm send SIGTERM to preempt a job, SIGKILL after.
    Once the run is complete (`run_finished`) no signal is raised: stopping
    then would only report a finished run as interrupted.
    """

    def __init__(self):
        self.received = []
        self.deferring = 0
        self.raised = False
        self.finished = None  # the complete run's folder (`run_finished`)

    def handle(self, signum, frame):
        self.received.append(signum)
        if self.finished is not None:
            return
        if len(self.received) == 1:
            if not self.deferring:
                self.raise_pending()
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt()

    def raise_pending(self):
        if self.received and not self.raised and self.finished is None:
            self.raised = True
            raise Terminated() if self.terminated else KeyboardInterrupt()

    @property
    def terminated(self):
        return bool(self.received) and self.received[0] == signal.SIGTERM


_SIGNALS = None  # the `_Signals` of the `main` running in the main thread


def pending_signal():
    """The signal `deferred()` holds back and has not raised yet, or None."""
    if _SIGNALS is None or _SIGNALS.raised or not _SIGNALS.received:
        return None
    return _SIGNALS.received[0]


def raise_pending(signum=None):
    """Raises the interrupt a signal left pending inside `deferred()`, if any.

    Called from a Keras callback at every batch and epoch end: a point where
    TensorFlow holds no half-built state. A no-op outside `main`.
    """
    if _SIGNALS is not None:
        if signum and not _SIGNALS.received:
            _SIGNALS.received.append(signum)
        _SIGNALS.raise_pending()


def run_finished(folder):
    """Marks the command's run complete: `folder` holds every file of it.

    A signal from then on (or held back by `deferred()` until then) stops
    nothing: `main` says in one line that it came after the run finished,
    and exits 0. A no-op outside `main`.
    """
    if _SIGNALS is not None:
        _SIGNALS.finished = folder


@contextlib.contextmanager
def deferred():
    """Holds SIGINT and SIGTERM back to the safe points inside the block.

    A signal pending at the block's end is raised there. A no-op outside
    `main` (the library used from a user's own program).
    """
    if _SIGNALS is None:
        yield
        return
    _SIGNALS.deferring += 1
    try:
        yield
    finally:
        _SIGNALS.deferring -= 1
    _SIGNALS.raise_pending()


@contextlib.contextmanager
def _signals_handled():
    """`_Signals` installed for SIGTERM, and for SIGINT unless it is ignored.

    A process started in the background by a shell without job control
    inherits SIGINT ignored, and that choice is kept.
    """
    global _SIGNALS
    if threading.current_thread() is not threading.main_thread():
        yield _Signals()  # signal handlers can be set in the main thread only
        return
    handled = _Signals()
    names = [signal.SIGTERM]
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        names.append(signal.SIGINT)
    previous = {name: signal.signal(name, handled.handle) for name in names}
    _SIGNALS = handled
    try:
        yield handled
    finally:
        _SIGNALS = None
        for name, handler in previous.items():
            signal.signal(name, handler)


def _no_collection_at_exit():
    """Leaves the objects of the ending process to the operating system.

    Python's exit collects every object in a reference cycle, and TensorFlow
    and Keras make hundreds of thousands: 0.9 s after the last line of a
    Ctrl-C'd `train` on an idle machine, 10 to 19 s beside two busy
    processes on 2 cores (docs/guides/cli.md). Every file of the run is
    closed by then, and the memory is freed with the process.
    """
    gc.disable()
    gc.freeze()


def main(argv=None):
    """Runs the `tf-lars` command line.

    Args:
        argv: list of str, the arguments after the program name. Defaults to
            `sys.argv[1:]`.

    Returns:
        The exit status: 0 on success, 2 for a bad command line, config,
        data or output folder, a Keras backend other than TensorFlow, or a
        file of the run folder that cannot be written (a full disk), each
        with a one-line message on stderr; 130 after a Ctrl-C, 143 after a
        SIGTERM (0, and a line saying so, for one that came once the run
        was complete: `run_finished`); 3, with one line, when a parameter
        server was lost (`distribute.strategy=parameter_server`).

    Examples:
        >>> from tf_lars.cli.main import main
        >>> main(["train", "--set", "training.epochs=20"])  # doctest: +SKIP
        0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    removed = _removed_command(argv)
    if removed is not None:
        return removed
    try:
        arguments = _parser().parse_args(argv)
    except SystemExit as exit_request:
        return int(exit_request.code or 0)

    from tf_lars import _keras_backend

    backend = _keras_backend()
    if backend != "tensorflow":
        # Both fixes in one line: the extra's check comes only after this one.
        missing = [n for n in _CLI_EXTRA if importlib.util.find_spec(n) is None]
        extra = (
            'install the `cli` extra (pip install "tf_lars[cli]"; no module named '
            f"{missing[0]!r}) and "
            if missing
            else ""
        )
        return _error(
            arguments.command,
            "the command line needs Keras's TensorFlow backend, and Keras is set "
            f"to the {backend!r} backend (KERAS_BACKEND or keras.json); "
            f"{extra}set KERAS_BACKEND=tensorflow",
        )
    # Run at exit after TensorFlow's own handlers (registered later, run
    # first); once however often `main` runs in one process.
    atexit.unregister(_no_collection_at_exit)
    atexit.register(_no_collection_at_exit)
    with _signals_handled() as signals:
        try:
            set_tensorflow_log_level(arguments.tf_log)
            code = _run(arguments)
        except KeyboardInterrupt as interrupt:
            kept = str(interrupt)
            print(
                f"tf-lars {arguments.command}: interrupted "
                f"({'SIGTERM' if signals.terminated else 'Ctrl-C'})"
                + (f"; {kept}" if kept else ""),
                file=sys.stderr,
                flush=True,
            )
            return EXIT_TERMINATED if signals.terminated else EXIT_INTERRUPTED
        except ModuleNotFoundError as error:
            if (error.name or "").partition(".")[0] not in _CLI_EXTRA:
                raise
            return _error(
                arguments.command,
                'the command line needs the `cli` extra: pip install "tf_lars[cli]" '
                f"(no module named {error.name!r})",
            )
        if signals.received and signals.finished is not None:
            print(
                f"tf-lars {arguments.command}: "
                f"{'SIGTERM' if signals.terminated else 'Ctrl-C'} arrived after the "
                f"run finished; the run folder {signals.finished} is complete",
                file=sys.stderr,
                flush=True,
            )
        return code


def _run(arguments):
    from tf_lars.cli.config import (
        ConfigError,
        load_config,
        located_message,
        unused_settings,
    )
    from tf_lars.cli.data import DataError
    from tf_lars.cli.preflight import release_run_dirs
    from tf_lars.distribute.tf_config import TFConfigError

    try:
        preset = "study-quick" if getattr(arguments, "quick", False) else None
        preset = "lowcomm-full" if getattr(arguments, "full", False) else preset
        config = load_config(
            arguments.command, arguments.config, arguments.overrides, preset
        )
        # Everything that needs no TensorFlow is checked before it is imported
        # (seconds), so a mistake is reported at once.
        from tf_lars.cli.preflight import preflight

        data, folder = preflight(arguments.command, config, arguments.overwrite)
        for line in unused_settings(
            arguments.command, config, arguments.config, arguments.overrides
        ):
            print(f"tf-lars {arguments.command}: warning: {line}", file=sys.stderr)
        if config.get("workload") != "nqm":  # the NQM is NumPy alone
            from tf_lars.cli import import_tensorflow

            import_tensorflow()
            quiet_python_logs()
        command = importlib.import_module(f"tf_lars.cli.{arguments.command}")
        return command.run(config, data, folder, arguments.overwrite)
    except (ConfigError, DataError, TFConfigError) as error:
        # A bad TF_CONFIG (distribute.strategy=multi_worker) is a usage error
        # too: one line and status 2, as `tf_lars.distribute.run_main` ends it.
        return _error(
            arguments.command,
            located_message(error, arguments.config, arguments.overrides),
        )
    except Exception as error:
        # A lost parameter server: one line and status 3, as `run_main` ends
        # it (the launcher and schedulers do not restart it).
        from tf_lars.distribute.run import EXIT_CLUSTER, lost_parameter_server

        if not lost_parameter_server(error):
            raise
        kept = getattr(error, "kept", "")
        _error(arguments.command, " ".join(f"{error}; {kept}".split()).rstrip(";"))
        return EXIT_CLUSTER
    finally:
        # The folder's lock ends with the run; a folder this run created and
        # left empty (refused before writing) is removed.
        release_run_dirs()


if __name__ == "__main__":
    sys.exit(main())
