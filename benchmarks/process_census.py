"""The Python processes a command starts: `python benchmarks/process_census.py`.

Not part of the installed package: run it from a source checkout.

    python benchmarks/process_census.py -- python -m pytest -q -m distributed

runs the command (the default: the second test tier) with a `sitecustomize`
first on `PYTHONPATH` that writes one line per event of every Python process
started with that environment: its start, its import of TensorFlow, and, at
a normal exit, its own CPU seconds (user + system; a process ended by a
signal or by `os._exit`, as the cluster scripts end, writes none). Then it
prints how many processes started, how many imported TensorFlow, the CPU
seconds of those that exited normally, the machine's busy and idle CPU
seconds while the command ran (`/proc/stat`, Linux), and the tests
(`PYTEST_CURRENT_TEST`) that started the most TensorFlow processes. A child
given an environment of its own without that `PYTHONPATH` is not counted,
so the counts are lower bounds.

It says where a multi-process tier's time goes: with TensorFlow's start-up
at about 4.5 CPU seconds (`benchmarks/start_cost.py`), the count of
TensorFlow processes times that is the part no test's own work can shorten.
"""

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
DEFAULT += ["-m", "distributed"]

# Written as the `sitecustomize` module of every process started.
_SITECUSTOMIZE = """
import atexit, json, os, sys

_LOG = os.environ["TF_LARS_CENSUS_LOG"]


def _write(event):
    record = {"event": event, "pid": os.getpid(),
              "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]}
    if event == "exit":
        times = os.times()
        record["cpu"] = times.user + times.system
    try:
        with open(_LOG, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\\n")
    except OSError:
        pass


class _Watch:
    # First on `sys.meta_path`: told of every module imported (not yet in
    # `sys.modules`), it finds none itself. `tensorflow.python` rather than
    # `tensorflow`: `importlib.util.find_spec("tensorflow")`, which asks
    # whether TensorFlow is installed, asks this finder too. (An audit hook
    # would see the import as well, but changes how soon a signal reaches
    # its handler.)
    seen = False

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "tensorflow.python" and not cls.seen:
            cls.seen = True
            _write("tensorflow")
        return None


_write("start")
sys.meta_path.insert(0, _Watch)
atexit.register(_write, "exit")
"""


def _cpu_seconds():
    """(busy, idle) CPU seconds of the machine so far (`/proc/stat`)."""
    with open("/proc/stat", encoding="ascii") as handle:
        fields = [int(value) for value in handle.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / tick, idle / tick


def census(command):
    """Runs `command`; its status and the census as a dict."""
    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, "sitecustomize.py"), "w") as handle:
            handle.write(_SITECUSTOMIZE)
        log = os.path.join(folder, "census.jsonl")
        env = dict(os.environ, TF_LARS_CENSUS_LOG=log)
        path = [folder, ROOT, env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(part for part in path if part)
        busy, idle, start = *_cpu_seconds(), time.perf_counter()
        status = subprocess.run(command, env=env, check=False).returncode
        busy_after, idle_after = _cpu_seconds()
        wall = time.perf_counter() - start
        with open(log, encoding="utf-8") as handle:
            records = [json.loads(line) for line in handle]
    started = {r["pid"] for r in records if r["event"] == "start"}
    tensorflow = {r["pid"]: r["test"] for r in records if r["event"] == "tensorflow"}
    exits = {r["pid"]: r["cpu"] for r in records if r["event"] == "exit"}
    tests = collections.Counter(tensorflow.values())
    return status, {
        "wall_s": wall,
        "busy_cpu_s": busy_after - busy,
        "idle_cpu_s": idle_after - idle,
        "processes": len(started),
        "tensorflow_processes": len(tensorflow),
        "tensorflow_exited_normally": sum(pid in exits for pid in tensorflow),
        "their_cpu_s": sum(exits[pid] for pid in tensorflow if pid in exits),
        "top_tests": tests.most_common(10),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", nargs="*", help="the command (default: tier 2)")
    args = parser.parse_args(argv)
    status, result = census(args.command or DEFAULT)
    print(f"command exited with status {status}, {result['wall_s']:.0f} s wall")
    print(
        f"machine CPU while it ran: {result['busy_cpu_s']:.0f} s busy, "
        f"{result['idle_cpu_s']:.0f} s idle"
    )
    print(
        f"Python processes started: {result['processes']}; importing TensorFlow: "
        f"{result['tensorflow_processes']} ({result['tensorflow_exited_normally']} "
        f"exited normally, {result['their_cpu_s']:.0f} CPU s between them)"
    )
    print("tests that started the most TensorFlow processes:")
    for test, count in result["top_tests"]:
        print(f"  {count:3d}  {test or '(the pytest processes themselves)'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
