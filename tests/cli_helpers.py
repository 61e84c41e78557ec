"""What the command-line tests share besides conftest.py's fixtures."""

import os
import pathlib
import subprocess
import sys
import textwrap

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


# `tf-lars ARGV` in a process of bounded memory: inputs that code before the
# checks turned into gigabytes fail fast there instead of taking the machine.
PROBE = textwrap.dedent(
    """
    import resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
    from tf_lars.cli.main import main
    code = main(sys.argv[1:])
    print("CODE", code, "TENSORFLOW", "tensorflow" in sys.modules)
    """
)


def refused_before_tensorflow(argv, cwd, timeout=300):
    """Runs `tf-lars ARGV` in a bounded process that must refuse it with
    status 2 before TensorFlow is imported; its one error line."""
    process = subprocess.run(
        [sys.executable, "-c", PROBE, *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=process_env(),
        timeout=timeout,
    )
    assert process.stdout.strip() == "CODE 2 TENSORFLOW False", process.stderr
    lines = process.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tf-lars {argv[0]}: error: "), lines
    return lines[0]
