"""What the command-line tests share besides conftest.py's fixtures."""

import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def process_env(**extra):
    """The environment for a `tf-lars` child process: this one's, with the
    checkout first on `PYTHONPATH` and without the suite's
    `TF_CPP_MIN_LOG_LEVEL` (so that tf-lars quiets TensorFlow itself), plus
    `extra`."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    python_path = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return {**env, "PYTHONPATH": python_path, **extra}


def run_python(code, cwd, timeout=300, **env):
    """`python -c CODE` in `cwd` with `process_env(**env)`: the finished
    process, its stdout and stderr as text."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=process_env(**env),
        timeout=timeout,
    )
