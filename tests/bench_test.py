"""The benchmark runs end to end (tiny sizes). It asserts output, never timings.

`benchmarks/bench.py` is a script of the source checkout, not a module of
the package: `tests/benchmark_scripts.py` loads it from its path.
"""

import os
import pathlib
import random
import re
import struct
import subprocess
import sys

import keras
import numpy as np
import pytest

from tests import benchmark_scripts
from tests.conftest import XLA_CACHE, XLA_CACHE_ON

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "bench.py"
bench = benchmark_scripts.load("bench")
hlo_traffic = benchmark_scripts.load("hlo_traffic")


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
    # The traffic table: read, written, total bytes per parameter, ratio.
    assert "Bytes each XLA-compiled step moves" in out
    number = r"\s+\d+\.\d\d"
    for baseline, group in bench.TRAFFIC_GROUPS:
        assert re.search(re.escape(baseline) + number * 3 + r"\s+1\.00x", out), out
        for row in group:
            assert re.search(re.escape(row) + number * 4 + "x", out), (row, out)


def test_bench_fit_mode_prints_throughput_rows(capsys):
    code = bench.main(
        [
            "--only",
            "fit",
            "--only",
            "noise-scale",
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
    # The noise-scale part: its paired table, the baseline's ratio exactly 1.
    assert "1 interleaved cycles of 4 steps" in out
    baseline = re.escape(bench.NOISE_SCALE_BASELINE)
    assert re.search(baseline + r"\s+\d+\.\d+\s+1\.00x\s+1\.00-1\.00", out), out
    row = re.escape(bench.NOISE_SCALE_ROW) + r"\s+\d+\.\d+\s+\d+\.\d+x"
    assert re.search(row, out), out


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


def test_turns_time_one_step_of_each_in_turn(monkeypatch):
    # The XLA rows' timing: `warmup` untimed turns, then one timed step of
    # each row per turn (a fake clock ticking 1 s a read).
    calls, clock = [], iter(range(100))
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(clock))
    steps = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    assert bench._turns(steps, repeats=2, warmup=1) == {"a": [1, 1], "b": [1, 1]}
    assert calls == ["a", "b"] * 3


def test_paired_table_ratio_iqr_stays_within_the_ratios(capsys):
    # Two steps each: ratios 1.0 and 1.2 (and 1.0 and 2.0). Inclusive
    # quartiles interpolate inside [min, max]: 1.05-1.15 and 1.25-1.75; the
    # extrapolating default gave 0.95-1.25 and 0.75-2.25.
    # A row timed apart (optax's) gets the ratio of medians, marked.
    rows = {"base": [1.0, 1.0], "near": [1.0, 1.2], "far": [1.0, 2.0]}
    apart = {"apart": (2.5, "base")}
    bench._print_paired_table("t", rows, (("base", ("near", "far")),), apart)
    lines = capsys.readouterr().out.splitlines()[3:]  # after "", title, header
    assert lines[0].split() == ["base", "1000.00", "1.00x", "1.00-1.00"]
    assert lines[1].split() == ["near", "1100.00", "1.10x", "1.05-1.15"]
    assert lines[2].split() == ["far", "1500.00", "1.50x", "1.25-1.75"]
    assert lines[3].split() == ["apart", "2500.00", "2.50x", "not", "paired"]


# An entry computation as TensorFlow's XLA prints it: a tuple result, a
# conditional (skipped: its branches run only when taken), a bitcast and a
# constant (skipped), an operand used twice (read once).
TF_STYLE_HLO = """HloModule a_inference_step, entry_computation_layout={...}

%fused (p: f32[1024]) -> f32[1024] {
  ROOT %p = f32[1024]{0} parameter(0)
}

ENTRY %step.9 (arg0.1: f32[1024], arg1.1: f32[1024], arg2.1: s64[]) -> (...) {
  %arg0.1 = f32[1024]{0} parameter(0), metadata={op_name="XLA_Args"}
  %arg1.1 = f32[1024]{0} parameter(1), metadata={op_name="XLA_Args"}
  %arg2.1 = s64[] parameter(2)
  %one = s64[] constant(1)
  %rows = f32[8]{0} fusion(%arg0.1), kind=kLoop, calls=%fused
  %tuple.5 = (f32[8]{0}) tuple(%rows)
  %cond = (f32[8]{0}) conditional(%arg2.1, %tuple.5, %tuple.5), true_computation=%t
  %picked = f32[8]{0} get-tuple-element(%cond), index=0
  %flat = f32[2,4]{1,0} bitcast(%picked)
  %update = f32[1024]{0} fusion(%arg0.1, %arg1.1, %flat, %arg0.1), kind=kLoop
  %count = s64[] add(%arg2.1, %one)
  ROOT %tuple.9 = (f32[1024]{0}, /*index=1*/s64[]) tuple(%update, %count)
}
"""

# As JAX prints it: a multi-output fusion, a custom (YNN) reduction, a dot.
JAX_STYLE_HLO = """HloModule jit_apply, is_scheduled=true

ENTRY %main.3 (w.1: f32[64,16], g.1: f32[64,16]) -> (f32[64,16], f32[]) {
  %w.1 = f32[64,16]{1,0} parameter(0), metadata={op_name="w"}
  %g.1 = f32[64,16]{1,0} parameter(1), metadata={op_name="g"}
  %ones = f32[16,1]{1,0} fusion(), kind=kLoop, calls=%f1
  %dot = f32[64,1]{1,0} dot(%g.1, %ones), lhs_contracting_dims={1}
  %ynn_fusion = f32[1]{0} fusion(%dot, %w.1), kind=kCustom, backend_config={}
  %both = (f32[64,16]{1,0}, f32[64,16]{1,0}) fusion(%w.1, %g.1, %ynn_fusion)
  %new = f32[64,16]{1,0} get-tuple-element(%both), index=0
  %scratch = f32[64,16]{1,0} get-tuple-element(%both), index=1
  %barrier = (f32[64,16]{1,0}) opt-barrier(%scratch)
  %norm = f32[] fusion(%ynn_fusion), kind=kLoop, calls=%f4
  ROOT %out = (f32[64,16]{1,0}, f32[]) tuple(%new, %norm)
}
"""


def test_traffic_counts_each_kernel_operand_once_and_its_result():
    # rows: reads arg0 (4096), writes 32; update: reads arg0, arg1, flat
    # (4096 + 4096 + 32), writes 4096; count: reads 8 + 8, writes 8.
    assert hlo_traffic.traffic(TF_STYLE_HLO) == hlo_traffic.Traffic(
        read=4096 + (4096 + 4096 + 32) + 16, written=32 + 4096 + 8
    )
    # ones: writes 64; dot: reads 4096 + 64, writes 256; ynn_fusion: reads
    # 256 + 4096, writes 4; both: reads 4096 * 2 + 4, writes 8192; norm:
    # reads 4, writes 4.
    assert hlo_traffic.traffic(JAX_STYLE_HLO) == hlo_traffic.Traffic(
        read=4160 + 4352 + 8196 + 4, written=64 + 256 + 4 + 8192 + 4
    )


def test_xla_floor_counts_each_pass_of_the_updates_and_the_norm():
    # The floor of LARS's XLA step on a CPU (benchmarks/xla_floor.py): per
    # entry, SGD-momentum reads g, m, w and the new m (16 B) and writes m, w
    # (8 B); LARS's update reads w once more (20 B), and written another way
    # it is the same program; its folded norm reads the tensor once.
    floor = benchmark_scripts.load("xla_floor")
    results = floor.measure(size=8192, chunk=2048, repeats=1)
    counted = {
        name: (round(read, 1), round(written, 1))
        for name, (seconds, read, written) in results.items()
        if "chunked" not in name and "reduce_sum" not in name
    }
    assert counted == {
        "norm: folded (tf_lars)": (4.0, 0.0),
        "update: SGD-momentum": (16.0, 8.0),
        "update: LARS, as written": (20.0, 8.0),
        "update: LARS, sibling": (20.0, 8.0),
    }
    assert all(seconds > 0 for seconds, _, _ in results.values())


def test_temporaries_are_large_written_values_that_are_not_outputs():
    assert hlo_traffic.temporaries(TF_STYLE_HLO, at_least=4096) == []
    # `both` writes the new weight (an output) and a scratch tensor.
    assert hlo_traffic.temporaries(JAX_STYLE_HLO, at_least=4096) == ["both"]
    assert hlo_traffic.temporaries(JAX_STYLE_HLO, at_least=200) == ["dot", "both"]


def test_traffic_of_a_compiled_function_is_its_arrays():
    # y = 2x + 1 over a million floats: one kernel reads x, writes y.
    import tensorflow as tf

    x = tf.ones([1_000_000])
    compiled = tf.function(lambda x: 2.0 * x + 1.0, jit_compile=True)
    text = compiled.experimental_get_compiler_ir(x)(stage="optimized_hlo")
    assert hlo_traffic.traffic(text) == hlo_traffic.Traffic(4_000_000, 4_000_000)


def test_traffic_rejects_text_without_an_entry_computation():
    for text in (
        "HloModule m\n",
        "ENTRY %main () -> f32[] {\n  %x = f32[] constant(1)\n",
    ):
        try:
            hlo_traffic.traffic(text)
        except ValueError as error:
            assert "ENTRY" in str(error)
        else:
            raise AssertionError("expected a ValueError")


def test_with_method_swaps_the_norms_for_that_optimizer_only():
    # The "reduce_sum norms" row: the same LARS with the portable norms. Its
    # compiled step sums squares with a reduction where LARS's own folds them
    # into a matrix-vector product; another optimizer keeps the fast norms.
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_lars
    from tf_lars import _trust

    def optimized_hlo(optimizer):
        variables = [keras.Variable(np.ones((64, 128), "float32"))]
        optimizer.build(variables)
        step = tf.function(
            lambda g: optimizer.apply(g, variables), jit_compile=True, autograph=False
        )
        grads = [tf.ones((64, 128))]
        return step.experimental_get_compiler_ir(grads)(stage="optimized_hlo")

    swapped = bench.with_method(tf_lars.LARS(0.1), "_norms", _trust.norms)
    assert " dot(" not in optimized_hlo(swapped)
    assert " dot(" in optimized_hlo(tf_lars.LARS(0.1))


# ------------------------------------------ benchmarks/compile_profile.py
compile_profile = benchmark_scripts.load("compile_profile")


def test_profile_splits_trace_from_compile_and_counts_kernels(
    capsys, monkeypatch, tmp_path
):
    # Each case runs in a fresh process; 12 tiny variables in stacks of at
    # most 4 (so three stacks per shape), and the lowering of two op types.
    # XLA's dump, in the case's temporary folder, is deleted after counting.
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert (
        compile_profile.main(
            [
                "phases",
                "--sizes",
                "12",
                "--only",
                "lars",
                "--stacked-rows",
                "4",
                "--kernels",
            ]
        )
        == 0
    )
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert len(rows) == 1 and rows[0][:3] == ["12", "lars", "4"], rows
    trace, compile_s, kernels = float(rows[0][3]), float(rows[0][4]), int(rows[0][5])
    assert trace > 0 and compile_s > 0 and kernels > 0
    assert list(tmp_path.iterdir()) == []
    assert compile_profile.main(["ops", "--ops", "Mul", "Sqrt", "--count", "3"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [row[:2] for row in rows] == [["Mul", "3"], ["Sqrt", "3"]], rows


@pytest.mark.parametrize(
    "argv, message",
    [
        (["phases", "--sizes", "0"], "--sizes must be >= 1, got 0"),
        (["phases", "--stacked-rows", "-2"], "--stacked-rows must be >= 1, got -2"),
        (["ops", "--count", "0"], "--count must be >= 1, got 0"),
    ],
)
def test_profile_refuses_bad_counts(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        compile_profile.main(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_start_cost_measures_each_case_in_a_fresh_process(capsys):
    start_cost = benchmark_scripts.load("start_cost")
    assert start_cost.main(["--repeats", "3", "--cases", "python"]) == 0
    captured = capsys.readouterr()
    rows = captured.out.strip().splitlines()
    assert rows[:2] == [
        "| case | median CPU s | min | max | runs |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    cells = [cell.strip() for cell in rows[2].strip("|").split("|")]
    assert cells[0] == "python" and cells[4] == "3" and len(rows) == 3
    low, median, high = float(cells[2]), float(cells[1]), float(cells[3])
    assert 0.0 <= low <= median <= high
    assert captured.err.splitlines()[-1] == "[3/3] repeats done"


def test_start_cost_names_the_failing_case(monkeypatch, capsys):
    start_cost = benchmark_scripts.load("start_cost")
    monkeypatch.setitem(start_cost.CASES, "python", "raise SystemExit('no')")
    with pytest.raises(SystemExit) as exited:
        start_cost.main(["--repeats", "1", "--cases", "python"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "start_cost.py: error: a case failed: no"
    )


def test_process_census_counts_processes_and_their_tensorflow(tmp_path, monkeypatch):
    census = benchmark_scripts.load("process_census")
    # A stand-in `tensorflow` first on the path (its import imports
    # `tensorflow.python`, as TensorFlow's does).
    (tmp_path / "tensorflow" / "python").mkdir(parents=True)
    (tmp_path / "tensorflow" / "__init__.py").write_text("import tensorflow.python")
    (tmp_path / "tensorflow" / "python" / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/x_test.py::test_y (call)")
    killed = "import os, signal, tensorflow; os.kill(os.getpid(), signal.SIGKILL)"
    probe = "import importlib.util; assert importlib.util.find_spec('tensorflow')"
    code = (
        "import subprocess, sys\n"
        "for child in ('import tensorflow', 'pass', *sys.argv[1:]):\n"
        "    done = subprocess.run([sys.executable, '-c', child])\n"
        "    assert done.returncode in (0, -9), child\n"
    )
    status, result = census.census([sys.executable, "-c", code, killed, probe])
    assert status == 0
    assert result["processes"] == 5
    assert result["tensorflow_processes"] == 2  # not the one that only asked
    assert result["tensorflow_exited_normally"] == 1  # not the killed one
    assert result["top_tests"] == [("tests/x_test.py::test_y", 2)]
    assert result["their_cpu_s"] >= 0 and result["busy_cpu_s"] >= 0


def test_compile_benchmarks_run_without_the_xla_cache(monkeypatch):
    compile_bench = benchmark_scripts.load("compile_bench")
    monkeypatch.setenv(
        "TF_XLA_FLAGS",
        "--tf_xla_auto_jit=2 --tf_xla_persistent_cache_directory=/x/y --tf_xla_cpu=1",
    )
    env = compile_bench.compiling_environment(KERAS_BACKEND="jax")
    assert env["TF_XLA_FLAGS"] == "--tf_xla_auto_jit=2 --tf_xla_cpu=1"
    assert env["KERAS_BACKEND"] == "jax"
    monkeypatch.setenv("TF_XLA_FLAGS", "--tf_xla_persistent_cache_directory=/x/y")
    assert "TF_XLA_FLAGS" not in compile_bench.compiling_environment()


@pytest.mark.skipif(
    keras.backend.backend() != "tensorflow" or not XLA_CACHE_ON,
    reason="the suite's XLA cache: on TensorFlow, unless off (tests/conftest.py)",
)
def test_the_suite_keeps_compiled_programs_in_its_cache():
    import tensorflow as tf

    assert (
        f"--tf_xla_persistent_cache_directory={XLA_CACHE}"
        in os.environ["TF_XLA_FLAGS"].split()
    )
    assert os.path.basename(XLA_CACHE) == f"tensorflow-{tf.__version__}"
    before = set(os.listdir(XLA_CACHE))
    # A program no earlier run compiled: not from `random`'s own generator,
    # which the suite seeds before every test.
    factor = random.SystemRandom().random()
    step = tf.function(lambda x: x * factor + 1.0, jit_compile=True)
    np.testing.assert_allclose(step(tf.ones(3)).numpy(), np.full(3, factor + 1.0))
    # Exactly one new entry holds this program (its constant, as float32):
    # other pytest-xdist workers write entries of their own meanwhile.
    constant = struct.pack("<f", factor)
    new = set(os.listdir(XLA_CACHE)) - before
    holding = [n for n in new if constant in pathlib.Path(XLA_CACHE, n).read_bytes()]
    assert len(holding) == 1, sorted(new)


def test_code_reading_follows_methods_imports_and_super(tmp_path, capsys):
    package = tmp_path / "tf_lars"
    (package / "backend").mkdir(parents=True)
    (package / "_internals.py").write_text(
        "def index(o):\n    return hidden(o)\n\n\ndef hidden(o):\n    return 0\n\n\n"
        "def keras_update_step(o):\n    return o.update_step\n"
    )
    (package / "_trust.py").write_text(
        "def norms(x):\n    return _sq(x)\n\n\ndef _sq(x):\n    return x\n\n\n"
        'def unused():\n    """A docstring."""\n    # A comment.\n    pass\n'
    )
    (package / "lars.py").write_text(
        "from tf_lars import _internals, _trust\n\n\n"
        "class LARS:\n"
        "    def _backend_update_step(self, g):\n"
        "        self.update_step(g)\n\n"
        "    def update_step(self, g):\n"
        "        _internals.index(self)\n"
        "        return (lambda: _trust.norms(g))()\n\n"
        "    def get_config(self):\n        return {}\n"
    )
    (package / "backend" / "tensorflow.py").write_text(
        "from tf_lars import lars\n\n\n"
        "class LARS(lars.LARS):\n"
        "    def update_step(self, g):\n"
        "        return super().update_step(g) + fused(g)\n\n\n"
        "def fused(g):\n    return g\n"
    )
    # Keras's loop, a fence accessor that calls the class's update_step back.
    (package / "lamb.py").write_text(
        "from tf_lars import _internals, _trust\n\n\n"
        "class LAMB:\n"
        "    def _backend_update_step(self, g):\n"
        "        _internals.keras_update_step(self)(g)\n\n"
        "    def update_step(self, g):\n"
        "        return _trust.norms(g)\n"
    )
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "a_test.py").write_text("x = 1\n")
    code_reading = benchmark_scripts.load("code_reading")
    code_reading.main(["--root", str(tmp_path), "--list"])
    rows = capsys.readouterr().out.splitlines()
    # Portable: the entry, update_step, the fence's accessor (not what it
    # calls) and the two functions of _trust the lambda reaches; not
    # get_config, not _trust.unused. Lines: 2 + 3 + 2 + 2 + 2.
    assert rows[2] == "| LARS | 5 | 11 | 3 | 3 (lars) |"
    # TensorFlow: its own update_step, the portable one through super(),
    # and its module's `fused`, besides the portable row's: 11 + 2 + 2 lines.
    assert "| LARS, TensorFlow | 7 | 15 | 4 | 2 (backend.tensorflow) |" in rows
    assert "|   | tf_lars.backend.tensorflow: fused | | | |" in rows
    assert not any("hidden" in row or "unused" in row for row in rows)
    # LAMB: the entry, the accessor, the update_step it calls back and
    # _trust's two: 2 + 2 + 2 + 2 + 2 lines.
    assert "| LAMB | 5 | 10 | 3 | 2 (lamb) |" in rows
    header = "| part | lines | code | docstrings | comments | blank | budget |"
    sizes = rows[rows.index(header) + 2 :]
    # wc -l: 10 + 12 + 13 + 10 + 9 lines, 19 of them blank; `unused`'s
    # docstring and comment are counted as such, the other 33 are code.
    assert sizes[0] == "| package `tf_lars/` | 54 | 33 | 1 | 1 | 19 | 8,000 |"
    assert sizes[1] == (
        "| core (`tf_lars/*.py`, `backend/`) | 54 | 33 | 1 | 1 | 19 | 3,500 |"
    )
    assert sizes[4] == "| `tests/` | 1 | 1 | 0 | 0 | 0 | 10,000 |"
