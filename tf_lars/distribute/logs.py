r"""TensorFlow's logging, in one place: levels and per-task log files.

Nothing here reads TensorFlow's log output: levels decide what is printed,
and where it goes decides who sees it.

- Levels go through the environment, before TensorFlow is imported, so that
  every child process inherits them: `task_environment` (the launcher's
  tasks: `TF_CPP_MIN_LOG_LEVEL=2` unless the user set one). The command
  line sets its own (`tf_lars.cli`).
- `log_tensorflow_records_once`: each `LEVEL:tensorflow:` record printed
  once after absl has configured the root logger.
- The launcher writes each task's whole output (stdout and stderr) to
  `task_log_path(...)`. For the one task it shows, `tee_stdout` copies the
  task's stdout (the program's own lines: progress, results) to the
  terminal as well; TensorFlow and absl log to stderr, which goes to the
  log only. When a task fails, `log_tail` gives the last lines of its run.

Examples:
    ```python
    import os
    import tempfile

    from tf_lars.distribute.logs import log_tail

    path = os.path.join(tempfile.mkdtemp(), "worker-0.log")
    with open(path, "w") as log:
        log.write("[agn] commits 20/200\nTraceback ...\nerror: the loss is NaN\n")
    log_tail(path, lines=2)
    # ['Traceback ...', 'error: the loss is NaN']
    ```
"""

import logging
import os
import sys
import threading

LEVEL_ENV = "TF_CPP_MIN_LOG_LEVEL"


# -------------------------------------------------------------------- levels
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


# ----------------------------------------------------------- per-task files
_output_lock = threading.Lock()
#: How many lines of a failed task's log the launcher shows.
TAIL_LINES = 15


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


def tee_stdout(pipe, log):
    """Copies a task's stdout to its log and, line by line, to the terminal.

    Args:
        pipe: the task's stdout, binary; its stderr goes to `log` directly.
        log: binary file opened for appending, the task's log; closed at the
            end with `pipe`.
    """
    pending = b""
    try:
        while chunk := os.read(pipe.fileno(), 1 << 16):
            log.write(chunk)
            *lines, pending = (pending + chunk).split(b"\n")
            write_lines([_decode(line) for line in lines])
        write_lines([_decode(pending)] if pending else [])
    finally:
        log.close()
        pipe.close()


def _decode(line):
    return line.decode("utf-8", "replace").rstrip("\r")


def log_tail(path, offset=0, lines=TAIL_LINES):
    """The last `lines` lines of a log file after byte `offset` (a list).

    At most the last MiB is read; an unreadable file gives `[]`.

    Args:
        path: str, the log file.
        offset: int, where the run of interest starts (a restarted task
            appends to its log).
        lines: int, how many lines at most.
    """
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(offset, size - (1 << 20)))
            text = handle.read().decode("utf-8", "replace")
    except OSError:
        return []
    kept = [line.rstrip("\r") for line in text.splitlines() if line.strip()]
    return kept[-lines:] if lines > 0 else []
