"""`run_main`: the exit statuses of a distributed training program.

A program started on every task of a cluster (by hand, by
`python -m tf_lars.distribute.launch`, or by a scheduler) should end a bad
`TF_CONFIG` or a lost parameter server with one line on stderr and a
status the launcher and schedulers can act on, not a traceback.
"""

import sys

from tf_lars.distribute.tf_config import TFConfigError

#: Exit status of a bad `TF_CONFIG` (a usage error).
EXIT_CONFIG = 2
#: Exit status of a lost parameter server (`ParameterServerFailure`).
EXIT_CLUSTER = 3


def run_main(main, *args, **kwargs):
    """Runs `main(*args, **kwargs)` and exits with a status for the cluster.

    - returns normally: exit status `int(result or 0)`;
    - `TFConfigError`: `error: <message>` on stderr, status 2;
    - `ParameterServerFailure`: `error: <message>` on stderr, status 3.

    Anything else propagates (a traceback and status 1: a bug to read).

    Args:
        main: callable, the program.
        *args: positional arguments for `main`.
        **kwargs: keyword arguments for `main`.

    Raises:
        SystemExit: always, with the status above.

    Examples:
        ```python
        from tf_lars import distribute

        def main():
            config = distribute.parse_tf_config(mode="sync")
            ...

        if __name__ == "__main__":
            distribute.run_main(main)
        ```
    """
    if not callable(main):
        raise ValueError(f"`main` must be callable. Received: main={main!r}")
    try:
        result = main(*args, **kwargs)
    except TFConfigError as error:
        _fail(error, EXIT_CONFIG)
    except Exception as error:
        if lost_parameter_server(error):
            _fail(error, EXIT_CLUSTER)
        raise
    sys.exit(int(result or 0))


def lost_parameter_server(error):
    """Whether `error` is a `ParameterServerFailure` (without importing
    TensorFlow: only a loaded trainer raises one)."""
    trainer = sys.modules.get("tf_lars.distribute.trainer")
    return trainer is not None and isinstance(error, trainer.ParameterServerFailure)


def _fail(error, status):
    message = " ".join(str(error).split())
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(status)
