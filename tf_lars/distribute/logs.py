"""TensorFlow's logging, in one place: levels, log files, what the terminal shows.

- Levels go through the environment, before TensorFlow is imported, so that
  every child process inherits them: `set_tensorflow_log_level` (the
  command line: `TF_CPP_MIN_LOG_LEVEL=3` unless `--tf-log`) and
  `task_environment` (the launcher's tasks: level 2 unless the user set one).
  `import_tensorflow_quietly` keeps TensorFlow's import-time C++ lines, which
  come before it reads the level, off stderr; `quiet_python_logs` sets the
  Python loggers (TensorFlow's and absl's) to ERROR.
- `log_tensorflow_records_once`: each `LEVEL:tensorflow:` record printed
  once after absl has configured the root logger.
- The launcher writes each task's whole output to `task_log_path(...)` and
  echoes one task through `echo_task_output`, whose `TerminalFilter` keeps
  the program's own lines and reduces TensorFlow's logging to a note naming
  the log file; `last_error_line` picks a failed task's reason from its log.
- `relay_worker_events`: the parameter-server coordinator's worker failures
  and recoveries, which TensorFlow reports only as log records.

Example:

```python
from tf_lars.distribute.logs import filter_lines

filter_lines([
    "WARNING: All log messages before absl::InitializeLog() is called are "
    "written to STDERR",
    "ERROR:tensorflow:Worker /job:worker/replica:0/task:1 failed with "
    "UnavailableError():Socket closed",
    ":UNKNOWN:Error received from peer  {grpc_status:14}",
    "error: parameter server /job:ps/replica:0/task:0 is unavailable",
], log_path="/tmp/logs/chief-0.log")
# ['[launch] (2 lines of TensorFlow logging hidden; full text in '
#  '/tmp/logs/chief-0.log)',
#  'error: parameter server /job:ps/replica:0/task:0 is unavailable']
```
"""

import collections
import contextlib
import logging
import os
import re
import select
import sys
import threading

LEVEL_ENV = "TF_CPP_MIN_LOG_LEVEL"


# -------------------------------------------------------------------- levels
def set_tensorflow_log_level(tf_log=False):
    """Quiets TensorFlow's C++ logging in this process and its children.

    Sets `TF_CPP_MIN_LOG_LEVEL=3` unless the user has set it or `tf_log` is
    true. It must run before TensorFlow is imported.

    Args:
        tf_log: bool, the `--tf-log` option: leave TensorFlow's own default
            (or the user's `TF_CPP_MIN_LOG_LEVEL`) in place.
    """
    if not tf_log:
        os.environ.setdefault(LEVEL_ENV, "3")


def task_environment(environ=None):
    """The environment of a launched task: C++ level 2 unless set, unbuffered.

    Args:
        environ: mapping or None, the base environment (`os.environ`).

    Returns:
        dict, a copy with `TF_CPP_MIN_LOG_LEVEL` defaulted to 2 (errors
        only) and `PYTHONUNBUFFERED=1` (lines reach the log as printed).
    """
    environ = dict(os.environ if environ is None else environ)
    environ.setdefault(LEVEL_ENV, "2")
    environ["PYTHONUNBUFFERED"] = "1"
    return environ


def _level():
    try:
        return int(os.environ.get(LEVEL_ENV, "0"))
    except ValueError:
        return 0


def import_tensorflow_quietly():
    """Imports TensorFlow; at level >= 1 its import-time C++ lines are hidden.

    TensorFlow 2.21 writes a few C++ lines while it is imported (absl's
    "WARNING: All log messages before absl::InitializeLog() ...", oneDNN,
    cudart and CPU-feature notices) before it reads `TF_CPP_MIN_LOG_LEVEL`.
    With that level at 1 or more, file descriptor 2 points at /dev/null
    during the import, so the level holds from the first line on. Python
    exceptions are unaffected.

    Returns:
        The `tensorflow` module.
    """
    if "tensorflow" not in sys.modules and _level() >= 1:
        sys.stderr.flush()
        try:
            saved = os.dup(2)
        except OSError:  # no stderr to quiet
            import tensorflow as tf

            return tf
        try:
            with open(os.devnull, "w") as devnull:
                os.dup2(devnull.fileno(), 2)
            import tensorflow  # noqa: F401 - imported for its side effect
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
    import tensorflow as tf

    return tf


def quiet_python_logs():
    """Sets TensorFlow's and absl's Python loggers to ERROR."""
    import absl.logging

    absl.logging.set_verbosity(absl.logging.ERROR)
    logging.getLogger("tensorflow").setLevel(logging.ERROR)


def log_tensorflow_records_once():
    """Stops TensorFlow's Python log records from being printed twice.

    TensorFlow gives its logger a handler of its own only when the root
    logger has none, so that each record is printed once. absl configures the
    root logger later, on the first absl log call (connecting to a cluster
    makes one), and from then on every `ERROR:tensorflow:...` record is
    printed by both. This removes TensorFlow's own stream handler once the
    root logger has a handler, restoring TensorFlow's rule. Handlers a
    program added to the `tensorflow` logger (other than a plain stream to
    stdout/stderr) are kept.
    """
    logger = logging.getLogger("tensorflow")
    if not logger.propagate or not logging.getLogger().handlers:
        return
    for handler in list(logger.handlers):
        if type(handler) is logging.StreamHandler and handler.stream in (
            sys.stderr,
            sys.stdout,
        ):
            logger.removeHandler(handler)


# ================================================================== fenced
# TensorFlow's, absl's and gRPC's wording, read from TensorFlow 2.21.0
# (absl-py 2.5.1, the abseil and gRPC 1.85 it bundles). These lines carry
# what TensorFlow says nowhere else: which output is its logging (no marker
# but the format), where a record ends, and which worker the coordinator
# lost or got back (only a log record says so).

# Printed by abseil C++ before `absl::InitializeLog`, whatever the level.
_ABSL_PREINIT = re.compile(
    r"^WARNING: All log messages before absl::InitializeLog\(\) is called"
)
# abseil C++: `E0512 14:03:12.345678  1234 file.cc:12] ` (before absl is
# initialized the seconds field holds the Unix time); TensorFlow's own
# pre-absl format (2.15 and earlier, still printed by some libraries):
# `2024-05-12 14:03:12.345678: E tensorflow/core/file.cc:12] `.
_CPP_RECORD = re.compile(
    r"^(?:(?P<glog>[IWEF])\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [^\s\]]+:\d+\]"
    r"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: (?P<tf>[IWEF]) [^\s\]]+:\d+\])"
)
# Python logging's basic format (absl's root handler), `LEVEL:logger:message`.
_PY_RECORD = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL|FATAL):([\w.]*):")
_TRACEBACK = re.compile(r"^Traceback \(most recent call last\):")
# `tf.function`'s retracing warning (tensorflow/python/eager/polymorphic_function).
_RETRACING = re.compile(
    r"^(?P<head>.*calls to <function (?P<name>\S+?)(?: at 0x[0-9a-f]+)?>"
    r" triggered tf\.function retracing)\."
)
# Lines that continue a TensorFlow log record or a traceback: blank or
# indented lines (frames, `  (0) UNAVAILABLE: ...`), the fixed phrases of
# TensorFlow's status messages (tensorflow/core/common_runtime and
# tsl/platform/errors) and gRPC's error details, and a status message that
# names a gRPC status code (`failed to connect to all addresses; last
# error: UNAVAILABLE: ...`).
_CONTINUATION = re.compile(
    r"^(?:$|\s|:"
    r"|.*\b(?:CANCELLED|UNKNOWN|INVALID_ARGUMENT|DEADLINE_EXCEEDED|NOT_FOUND"
    r"|ALREADY_EXISTS|PERMISSION_DENIED|RESOURCE_EXHAUSTED|FAILED_PRECONDITION"
    r"|ABORTED|OUT_OF_RANGE|UNIMPLEMENTED|INTERNAL|UNAVAILABLE|DATA_LOSS"
    r"|UNAUTHENTICATED):"
    r"|failed to connect to all addresses"
    r"|Encountered when executing "
    r"|Additional GRPC error information"
    r"|<stack traces unavailable>"
    r"|Detected at node "
    r"|Graph execution error"
    r"|\d+ root error\(s\) found"
    r"|\d+ successful operations"
    r"|\d+ derived errors ignored"
    r"|This (?:could happen|derived error) "
    r"|It is treated as "
    r"|\[\[\{\{node "
    r"|During handling of the above exception"
    r"|The above exception was the direct cause"
    r")"
)
# Followed by the failed op's own message, which may say anything.
_DETECTED_AT = re.compile(r"^Detected at node ")
# ClusterCoordinator's worker events (tensorflow/python/distribute/coordinator/
# cluster_coordinator.py): the caller is told nothing else.
_WORKER_EVENT = re.compile(
    r"Worker (/job:worker/replica:\d+/task:\d+) "
    r"(?:failed with (\w+)|has been (recovered))"
)
# ================================================================ end fenced

# A program's own lines, never part of a log record: its one-line error and
# tagged progress lines (`[agn] ...`, `[launch] ...`).
_OWN_LINE = re.compile(r"^(?:error:|\[\w)")
# The exception line that ends a traceback's frames: `ValueError: ...`,
# `errors_impl.OutOfRangeError: ...` (a dotted module path, as TensorFlow prints).
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(?::|$)")
# An exception's class name (`UnavailableError`, `ValueError`).
_ERROR_NAME = re.compile(r"\b[A-Z]\w*Error\b")
_ERROR_LEVELS = ("ERROR", "CRITICAL", "FATAL")

# Record kinds: QUIET ones are dropped without a note, HIDDEN ones counted in
# the note of their run, LOUD ones (and tracebacks) make the run worth a note.
_QUIET, _HIDDEN, _LOUD, _TRACEBACK_KIND, _RETRACE, _LOG = range(6)


def _classify(line):
    """The kind of record `line` starts, or None for a program's own line."""
    if _ABSL_PREINIT.match(line):
        return _QUIET
    match = _CPP_RECORD.match(line)
    if match:
        severity = match.group("glog") or match.group("tf")
        return _HIDDEN if severity in "EF" else _QUIET
    if _TRACEBACK.match(line):
        return _TRACEBACK_KIND
    match = _PY_RECORD.match(line)
    if not match:
        return None
    level, logger = match.groups()
    if _RETRACING.match(line):
        return _RETRACE
    tensorflow = logger in ("tensorflow", "absl") or logger.startswith("tensorflow.")
    return _LOUD if tensorflow and level in _ERROR_LEVELS else _LOG


def _ends_frames(previous, line):
    """Whether `line` is an exception line right after a traceback's frame."""
    return (
        previous[:1].isspace()
        and bool(line)
        and not line[:1].isspace()
        and bool(_EXCEPTION.match(line))
        and not _CONTINUATION.match(line)
    )


class TerminalFilter:
    """Filters one task's output lines for the terminal.

    Feed it the task's lines in order (without their line ends); it returns
    the lines to show, some of them later than they came (a record is held
    until its last line is known). Call `flush` when the output pauses and
    at its end. What it shows and hides: docs/guides/multi-worker.md, "What
    the terminal shows".

    Args:
        log_path: str, the task's log file, named in the notes.
    """

    def __init__(self, log_path):
        if not isinstance(log_path, str) or not log_path:
            raise ValueError(
                f"`log_path` must be a non-empty str. Received: log_path={log_path!r}"
            )
        self.log_path = log_path
        self._kind = None  # kind of the record being held
        self._record = []
        self._run_lines = 0  # lines hidden since the last line shown
        self._run_loud = self._run_tracebacks = False
        self._exception = None  # the last exception line of the run
        self._recent = collections.deque(maxlen=4)
        self._retraced = set()
        self._op_message_due = False

    def feed(self, line):
        """Takes one output line; returns the lines to show now (a list)."""
        if self._kind is not None and self._continues(line):
            self._record.append(line)
            return []
        shown = self._finish_record()
        kind = _classify(line)
        if kind is None:
            shown += self._end_run(line)
            self._recent.clear()
            shown.append(line)
        else:
            self._kind, self._record = kind, [line]
        return shown

    def flush(self):
        """The held record (if shown) and the note of a run of hidden lines."""
        return self._finish_record() + self._end_run(None)

    def _continues(self, line):
        if _OWN_LINE.match(line) or _classify(line) is not None:
            return False
        if _DETECTED_AT.match(line):
            self._op_message_due = True
            return True
        if self._op_message_due and line and not line[:1].isspace():
            self._op_message_due = False
            return True
        if _CONTINUATION.match(line):
            return True
        return self._kind == _TRACEBACK_KIND and _ends_frames(self._record[-1], line)

    def _finish_record(self):
        kind, record = self._kind, self._record
        self._kind, self._record = None, []
        self._op_message_due = False
        if kind in (None, _QUIET):
            return []
        if kind in (_HIDDEN, _LOUD, _TRACEBACK_KIND):
            self._run_lines += len(record)
            self._run_loud = self._run_loud or kind != _HIDDEN
            if kind == _TRACEBACK_KIND:
                self._run_tracebacks = True
                ends = [b for a, b in zip(record, record[1:]) if _ends_frames(a, b)]
                self._exception = (ends or [self._exception])[-1]
            return []
        if kind == _RETRACE:
            match = _RETRACING.match(record[0])
            if match.group("name") in self._retraced:
                return []
            self._retraced.add(match.group("name"))
            return self._end_run(None) + [
                f"{match.group('head')} (shown once per function; full text in "
                f"{self.log_path})"
            ]
        text = "\n".join(record)
        if text in self._recent:
            return []
        self._recent.append(text)
        return self._end_run(None) + record

    def _end_run(self, next_line):
        shown = []
        if self._run_loud:
            what = "TensorFlow logging" + (
                " and tracebacks" if self._run_tracebacks else ""
            )
            lines = "line" if self._run_lines == 1 else "lines"
            shown.append(
                f"[launch] ({self._run_lines} {lines} of {what} hidden; full text "
                f"in {self.log_path})"
            )
            # The program's own `error: ...` line says it better.
            if self._exception and not (next_line or "").startswith("error:"):
                shown.append(self._exception)
        self._run_lines = 0
        self._run_loud = self._run_tracebacks = False
        self._exception = None
        return shown


def filter_lines(lines, log_path):
    """The lines of a whole output that `TerminalFilter` shows (a list)."""
    terminal = TerminalFilter(log_path)
    shown = []
    for line in lines:
        shown += terminal.feed(line)
    return shown + terminal.flush()


def last_error_line(text, limit=300):
    """The line of a task's output that best says why it failed, or None.

    In order of preference: the last line that starts with `error:` (the
    one-line message of `tf_lars.distribute.run_main` and of the examples),
    the exception line of the last traceback, the last Python log record of
    level ERROR or CRITICAL or line that names an exception class (its log
    prefix removed). C++ log lines and gRPC error details are skipped: a
    process killed by a signal usually leaves no error line at all.

    Args:
        text: str, the output.
        limit: int, the longest line returned (longer ones are cut).
            Defaults to 300.

    Returns:
        str or None.
    """
    lines = text.splitlines()
    found = next((line for line in reversed(lines) if line.startswith("error:")), None)
    if found is None:
        found = _last_traceback_exception(lines)
    for line in reversed(lines) if found is None else ():
        record = _PY_RECORD.match(line)
        if record and record.group(1) in _ERROR_LEVELS:
            found = line[record.end() :]
            break
        if _ERROR_NAME.search(line) and not (
            _CPP_RECORD.match(line) or _CONTINUATION.match(line)
        ):
            found = line[record.end() :] if record else line
            break
    if found is None:
        return None
    found = found.strip()
    return found if len(found) <= limit else found[: limit - 3] + "..."


def _last_traceback_exception(lines):
    exception = None
    in_traceback = False
    for previous, line in zip(["", *lines], lines, strict=False):
        if _TRACEBACK.match(line):
            in_traceback = True
        elif in_traceback and _ends_frames(previous, line):
            exception = line
            in_traceback = False
    return exception


# ----------------------------------------------------------- per-task files
# An echoed task that prints nothing for this long gets its held lines (and
# the note of hidden ones) shown: a hung job should still say what it hid.
_IDLE_FLUSH_SECONDS = 2.0
_output_lock = threading.Lock()


def task_log_path(log_dir, task_type, task_index):
    """Where the launcher writes a task's whole output."""
    return os.path.join(log_dir, f"{task_type}-{task_index}.log")


def write_lines(lines):
    """Prints whole lines to stdout, one writer at a time."""
    if not lines:
        return
    data = "".join(f"{line}\n" for line in lines)
    with _output_lock:
        buffer = getattr(sys.stdout, "buffer", None)
        if buffer is None:
            sys.stdout.write(data)
        else:
            sys.stdout.flush()
            buffer.write(data.encode("utf-8", "replace"))
        sys.stdout.flush()


def echo_task_output(pipe, log, log_path):
    """Copies a task's output to its log and, filtered, to the terminal.

    Args:
        pipe: the task's stdout (stderr joined), binary.
        log: binary file, the task's log, closed at the end with `pipe`.
        log_path: str, the log's path, named in the terminal's notes.
    """
    terminal = TerminalFilter(log_path)
    fd = pipe.fileno()
    pending = b""
    try:
        while True:
            ready, _, _ = select.select([fd], [], [], _IDLE_FLUSH_SECONDS)
            if not ready:
                write_lines(terminal.flush())
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            log.write(chunk)
            *lines, pending = (pending + chunk).split(b"\n")
            shown = []
            for line in lines:
                shown += terminal.feed(_decode(line))
            write_lines(shown)
        write_lines(terminal.feed(_decode(pending)) if pending else [])
        write_lines(terminal.flush())
    finally:
        log.close()
        pipe.close()


def _decode(line):
    return line.decode("utf-8", "replace").rstrip("\r")


# ------------------------------------------------------------ worker events
class _WorkerEvents(logging.Filter):
    """Relays the coordinator's worker failure and recovery log records.

    Installed as a filter on TensorFlow's logger: it sees every record first,
    reports the ones about workers, and drops the INFO records that the
    logger's previous level would have dropped anyway.
    """

    def __init__(self, log, previous_level):
        super().__init__()
        self._log = log
        self._previous_level = previous_level
        self._reported = set()

    def filter(self, record):
        try:
            match = _WORKER_EVENT.search(record.getMessage())
        except Exception:  # noqa: BLE001 - a logging filter must not raise
            return True
        if match:
            worker, error_name, recovered = match.groups()
            # The coordinator logs each event from more than one place.
            key = (worker, bool(recovered), int(record.created))
            if key not in self._reported:
                self._reported.add(key)
                self._log(
                    f"[agn] worker {worker} recovered and rejoined"
                    if recovered
                    else f"[agn] worker {worker} failed ({error_name}); "
                    "its round is rescheduled, the other workers go on"
                )
        return record.levelno >= self._previous_level


@contextlib.contextmanager
def relay_worker_events(log):
    """Passes the coordinator's worker events to `log` as `[agn] ...` lines."""
    import tensorflow as tf

    logger = tf.get_logger()
    own_level = logger.level
    previous_level = logger.getEffectiveLevel()
    events = _WorkerEvents(log, previous_level)
    logger.addFilter(events)
    # "has been recovered" is an INFO record; it must be created to be seen.
    logger.setLevel(min(previous_level, logging.INFO))
    try:
        yield
    finally:
        logger.removeFilter(events)
        logger.setLevel(own_level)
