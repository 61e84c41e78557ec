"""The benchmark runs end to end (tiny sizes). It asserts output, never timings.

`benchmarks/bench.py` is a script of the source checkout, not a module of
the package: it is loaded from its path here.
"""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "bench.py"
_SPEC = importlib.util.spec_from_file_location("bench", SCRIPT)
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def test_script_help_runs_from_a_checkout_without_tensorflow(tmp_path):
    # No PYTHONPATH: the script finds the checkout's tf_lars by itself.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = (
        "import runpy, sys\n"
        f"sys.argv = [{str(SCRIPT)!r}, '--help']\n"
        "try:\n"
        f"    runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
        "except SystemExit as exit_request:\n"
        "    print('CODE', exit_request.code, 'TENSORFLOW', 'tensorflow' in "
        "sys.modules)\n"
    )
    process = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert process.returncode == 0, process.stderr
    assert process.stdout.startswith("usage: bench.py [-h] [--repeats REPEATS]")
    assert "--tf-log" in process.stdout and "--fit-jit {off,on,both}" in process.stdout
    assert process.stdout.rstrip().endswith("CODE 0 TENSORFLOW False")
    assert process.stderr == ""


def test_bench_runs_every_part_and_prints_tables(capsys):
    code = bench.main(
        [
            "--model",
            "tiny",
            "--rows",
            "2000",
            "--width",
            "8",
            "--touched",
            "64",
            "--repeats",
            "2",
            "--warmup",
            "1",
            "--no-optax",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    for row in (
        "SGD(momentum=0.9)",
        "LARS(weight_decay=1e-4)",
        "LARS(weight_decay=0)",
        "LARS(trust_ratio='decayed', weight_decay=1e-4)",
        "LARS(weight_decay=1e-4), reduce_sum norms",
        "LARS eager apply (op by op)",
        "LARS eager apply (compiled)",
        "SGD(momentum=0.9) sparse",
        "LARS sparse",
    ):
        assert re.search(re.escape(row) + r"\s+\d+\.\d+\s+\d+\.\d+x", out), (row, out)
    assert out.count("Sparse step") == 2  # XLA and plain tf.function
    for row in (
        "Adam",
        "keras Lamb",
        "tf_lars.LAMB(weight_decay=0.01)",
        "tf_lars.LAMB(weight_decay=0.01), direction stored for its norm",
    ):
        assert re.search(re.escape(row) + r"\s+\d+\.\d+\s+\d+\.\d+x", out), (row, out)


def test_bench_fit_mode_prints_throughput_rows(capsys):
    code = bench.main(
        [
            "--only",
            "fit",
            "--fit-model",
            "tiny",
            "--fit-size",
            "8",
            "--fit-batch",
            "4",
            "--fit-steps",
            "3",
            "--fit-rounds",
            "1",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "jit_compile=False" in out
    for row in bench.FIT_CONTENDERS:
        assert re.search(re.escape(row) + r"\s+\d+\.\d+\s+\d+\.\d+\s+\d\.\d+x", out), (
            row,
            out,
        )


def test_bench_no_xla_mode_prints_paired_rows(capsys):
    code = bench.main(["--only", "no-xla", "--model", "tiny", "--repeats", "3"])
    out = capsys.readouterr().out
    assert code == 0
    assert "tf.function without XLA" in out
    for baseline, group in bench.NO_XLA_GROUPS:
        # The baseline's ratio to itself is exactly 1.
        assert re.search(
            re.escape(baseline) + r"\s+\d+\.\d+\s+1\.00x\s+1\.00-1\.00", out
        )
        for row in group:
            assert re.search(re.escape(row) + r"\s+\d+\.\d+\s+\d+\.\d+x", out), (
                row,
                out,
            )


def test_bench_rejects_bad_repeats(capsys):
    try:
        bench.main(["--repeats", "0"])
    except SystemExit as exit_:
        assert exit_.code == 2
    else:
        raise AssertionError("expected a usage error")
    assert "--repeats must be >= 1" in capsys.readouterr().err


def test_paired_table_ratio_iqr_stays_within_the_ratios(capsys):
    # Two steps each: ratios 1.0 and 1.2 (and 1.0 and 2.0). Inclusive
    # quartiles interpolate inside [min, max]: 1.05-1.15 and 1.25-1.75; the
    # extrapolating default gave 0.95-1.25 and 0.75-2.25.
    rows = {"base": [1.0, 1.0], "near": [1.0, 1.2], "far": [1.0, 2.0]}
    bench._print_paired_table("t", rows, (("base", ("near", "far")),))
    lines = capsys.readouterr().out.splitlines()[3:]  # after "", title, header
    assert lines[0].split() == ["base", "1000.00", "1.00x", "1.00-1.00"]
    assert lines[1].split() == ["near", "1100.00", "1.10x", "1.05-1.15"]
    assert lines[2].split() == ["far", "1500.00", "1.50x", "1.25-1.75"]
