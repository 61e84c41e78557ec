"""The benchmark runs end to end (tiny sizes). It asserts output, never timings."""

import re

from tf_lars.cli import bench


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
        "LARS(weight_decay=1e-4), reduce_sum norms",
        "LARS eager apply (op by op)",
        "LARS eager apply (compiled)",
        "SGD(momentum=0.9) sparse",
        "LARS sparse",
    ):
        assert re.search(re.escape(row) + r"\s+\d+\.\d+\s+\d+\.\d+x", out), (row, out)
    assert out.count("Sparse step") == 2  # XLA and plain tf.function


def test_bench_rejects_bad_repeats(capsys):
    try:
        bench.main(["--repeats", "0"])
    except SystemExit as exit_:
        assert exit_.code == 2
    else:
        raise AssertionError("expected a usage error")
    assert "--repeats must be >= 1" in capsys.readouterr().err
