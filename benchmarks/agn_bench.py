"""AGN on a local parameter-server cluster: period 1 versus period 10.

Not a test. Starts the same cluster twice with `tf_lars.distribute.launch`
(1 chief, 2 workers, 1 parameter server, separate processes on localhost),
trains the digits classifier of `examples/agn_digits.py` for the
same number of local steps per worker, and prints a table:

- commits and commits per second (wall time of the training loop),
- bytes pushed to the parameter server per local step: the gradient payload
  (commits x model size / local steps) and what the parameter-server
  process actually received over TCP (kernel `bytes_received` of its
  sockets, read from the kernel; includes gRPC framing and the pulls'
  requests),
- final test accuracy.

Usage:

    python benchmarks/agn_bench.py [--steps-per-worker 1000] [--periods 1 10]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_once(period, args, work_dir):
    result_path = os.path.join(work_dir, f"period{period}.json")
    command = [
        sys.executable,
        "-m",
        "tf_lars.distribute.launch",
        "--workers",
        str(args.workers),
        "--ps",
        "1",
        "--log-dir",
        os.path.join(work_dir, f"logs{period}"),
        "--",
        os.path.join(REPO, "examples", "agn_digits.py"),
        "--period",
        str(period),
        "--steps-per-worker",
        str(args.steps_per_worker),
        "--batch-size",
        str(args.batch_size),
        "--learning-rate",
        str(args.learning_rate),
        "--checkpoint-every",
        str(max(1, args.steps_per_worker * args.workers // period // 5)),
        "--result-json",
        result_path,
    ]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    start = time.perf_counter()
    proc = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"period {period}: launcher exited with {proc.returncode}")
    with open(result_path) as handle:
        result = json.load(handle)
    result["launcher_seconds"] = time.perf_counter() - start
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--periods", type=int, nargs="+", default=[1, 10])
    parser.add_argument("--steps-per-worker", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=0.5)
    args = parser.parse_args(argv)

    results = []
    with tempfile.TemporaryDirectory(prefix="agn_bench_") as work_dir:
        for period in args.periods:
            results.append(run_once(period, args, work_dir))

    header = (
        "| period | local steps | commits | train s | commits/s | local steps/s "
        "| payload B/local step | PS received B/local step | test accuracy |"
    )
    print(
        f"AGN, {args.workers} workers + 1 ps (local processes), digits MLP "
        f"({results[0]['param_bytes']} B of weights), batch {args.batch_size}, "
        f"SGD lr {args.learning_rate}, {args.steps_per_worker} local steps per worker"
    )
    print(header)
    print("|---" * 9 + "|")
    for r in results:
        steps = r["local_steps"]
        received = r["ps_bytes_received"]
        print(
            f"| {r['period']} | {steps} | {r['commits']} | {r['seconds']:.2f} | "
            f"{r['commits_per_second']:.1f} | {steps / r['seconds']:.0f} | "
            f"{r['pushed_payload_bytes'] / steps:.0f} | "
            f"{'n/a' if received is None else f'{received / steps:.0f}'} | "
            f"{r['test_accuracy']:.4f} |"
        )
    if len(results) == 2:
        a, b = results
        payload = a["pushed_payload_bytes"] / b["pushed_payload_bytes"]
        accuracy = 100 * (b["test_accuracy"] - a["test_accuracy"])
        received = ""
        if a["ps_bytes_received"] and b["ps_bytes_received"]:
            ratio = a["ps_bytes_received"] / b["ps_bytes_received"]
            received = f", {ratio:.1f}x fewer bytes received by the ps"
        print(
            f"period {b['period']} vs {a['period']}: "
            f"{a['commits'] / b['commits']:.1f}x fewer commits, "
            f"{payload:.1f}x fewer payload bytes{received}, "
            f"accuracy {accuracy:+.2f} points"
        )


if __name__ == "__main__":
    main()
