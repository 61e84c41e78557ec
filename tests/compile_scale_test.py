"""How the compiled update of LARS and LAMB grows with the number of variables.

XLA's compile time and memory follow the program TensorFlow hands it, so
these tests count that program's instructions
(`benchmarks/compile_bench.py`, `update_hlo`) over 8 and 24 tiny variables:
per added variable it must grow about as Keras's own optimizers' does, and
the range check of the norms, the trust-ratio record and the reductions must
not grow at all (docs/guides/benchmarks.md, "Compile time"). Counts, never
timings.
"""

import collections
import functools

import pytest

from tests import benchmark_scripts
from tf_lars import _trust

compile_bench = benchmark_scripts.load("compile_bench")

SMALL, LARGE = 8, 24


def program(name, count):
    """Opcode counts of one `apply` of optimizer `name` over `count` variables
    (a copy: each program is traced once per test process)."""
    return collections.Counter(_program(name, count))


@functools.cache
def _program(name, count):
    optimizer = compile_bench.make_optimizer(name)
    variables = compile_bench.tiny_variables(count)
    text = compile_bench.update_hlo(optimizer, variables)
    return collections.Counter(compile_bench.hlo_instructions(text))


def per_variable(name):
    """Instructions each added variable adds to the program."""
    small = sum(program(name, SMALL).values())
    large = sum(program(name, LARGE).values())
    return (large - small) / (LARGE - SMALL)


@pytest.mark.parametrize(
    "name, baseline",
    [("lars", "sgd"), ("lamb", "adam")],
)
def test_program_grows_per_variable_at_most_twice_as_fast_as_keras(name, baseline):
    # Measured: LARS 25 per variable against SGD(momentum)'s 15 (104 before
    # the norms were stacked by shape), LAMB 36 against Adam's 44 (235, then
    # 77 before Adam's scalars were taken once per step, 41 before small
    # directions were read as stored).
    grown, keras_grown = per_variable(name), per_variable(baseline)
    assert keras_grown > 0
    assert grown <= 2 * keras_grown, (name, grown, baseline, keras_grown)


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_one_range_check_one_record_and_fixed_reductions_per_step(name):
    small, large = program(name, SMALL), program(name, LARGE)
    # One `cond` for the range check of every norm and one scatter writing
    # every trust ratio (LAMB had one of each per variable), and reductions
    # per variable shape, not per variable (LARS had 6 per variable).
    assert (small["conditional"], large["conditional"]) == (1, 1)
    assert (small["scatter"], large["scatter"]) == (1, 1)
    assert small["reduce"] == large["reduce"] > 0


def test_lamb_takes_adams_scalars_once_per_step():
    # Adam's bias corrections (two powers, square roots) were computed three
    # times per variable; now once per step, so LAMB's program grows per
    # variable no faster than Adam's own (which computes them per variable).
    small, large = program("lamb", SMALL), program("lamb", LARGE)
    assert small["power"] == large["power"] > 0
    assert per_variable("lamb") <= per_variable("adam")


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_no_small_update_reads_its_trust_ratio_at_a_fixed_offset(name):
    # `vector[k]` put the offset k into variable k's update, so no two
    # updates compiled to the same kernel (one LLVM compile each: 9.5 of
    # LARS's 12 s over 1,000 variables); small variables' entries are read
    # at runtime positions instead (`tf_lars.backend.tensorflow.entries`), so the fixed
    # slices do not grow with the variables.
    small, large = program(name, SMALL), program(name, LARGE)
    assert small["slice"] == large["slice"], (small["slice"], large["slice"])
    assert large["gather"] - small["gather"] == LARGE - SMALL


def concatenation_widths(name, count):
    """Operand counts of the program's concatenations (`name`: a key of
    `compile_bench.BASELINES`, or an optimizer)."""
    optimizer = compile_bench.make_optimizer(name) if isinstance(name, str) else name
    text = compile_bench.update_hlo(optimizer, compile_bench.tiny_variables(count))
    return [
        line.split(" concatenate(", 1)[1].count("%")
        for line in text.splitlines()
        if " concatenate(" in line
    ]


@pytest.fixture
def stacked_rows(monkeypatch):
    """A stack of at most 8 rows (128 in use), so that three stacks' worth
    of variables traces in a second instead of half a minute."""
    monkeypatch.setattr(_trust, "STACKED_ROWS", 8)
    return 8


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_no_concatenation_grows_past_a_stack_of_rows(name, stacked_rows):
    # XLA's CPU compiler emits a concatenation as one function with a
    # branch per operand; 1,000 operands compiled longer than Keras's whole
    # SGD step over 2,000 variables. Stacks hold at most STACKED_ROWS
    # tensors and the record takes the ratio vectors, not one scalar per
    # variable, so no concatenation is wider than a stack.
    widths = concatenation_widths(name, 3 * _trust.STACKED_ROWS)
    assert widths and max(widths) <= _trust.STACKED_ROWS, max(widths)


def test_a_captured_step_takes_one_unit_scale_for_all_variables(stacked_rows):
    # TrustRatio around a Keras optimizer takes each captured step with a
    # scale of 1; one per dtype and step (`TrustRatio._once_per_step`), so the
    # ratios take a scalar, not a stack of one 1 per variable.
    import keras
    import tensorflow as tf

    import tf_lars

    optimizer = tf_lars.TrustRatio(keras.optimizers.SGD(momentum=0.9))
    variables = compile_bench.tiny_variables(3 * _trust.STACKED_ROWS)
    optimizer.build(variables)
    step = tf.function(
        lambda g: optimizer.apply(g, variables), jit_compile=True, autograph=False
    )
    graph = step.get_concrete_function([tf.ones_like(v) for v in variables]).graph
    # (XLA folds a stack of constants, so the TensorFlow graph is read.)
    widest = max(len(op.inputs) for op in graph.get_operations() if op.type == "Pack")
    assert widest <= _trust.STACKED_ROWS, widest


def test_lamb_adds_at_most_one_square_root_per_variable():
    # TensorFlow lowers each Sqrt and Abs op for XLA through MLIR, about
    # 2.5 ms each here (Mul takes 0.4 ms): LAMB's norm computed its small
    # directions again (an abs, a square root) besides the step's own square
    # root. A small direction is now read as stored (it is copied into its
    # stack anyway), so LAMB adds one square root per variable, Adam two.
    small, large = program("lamb", SMALL), program("lamb", LARGE)
    grown = (large["sqrt"] + large["abs"]) - (small["sqrt"] + small["abs"])
    assert grown == LARGE - SMALL, grown


def test_instruction_count_reads_tuple_shaped_results():
    text = (
        "ENTRY %main (p: f32[4]) -> (f32[4], f32[]) {\n"
        "  %p = f32[4]{0} parameter(0)\n"
        "  %c = (f32[4]{0}, /*index=1*/f32[]) conditional(pred[] %q, %p, %p)\n"
        "  ROOT %t = (f32[4]{0}, f32[]) tuple(f32[4]{0} %p, f32[] %s)\n"
        "}\n"
    )
    assert compile_bench.hlo_instructions(text) == [
        "parameter",
        "conditional",
        "tuple",
    ]


def test_torch_case_variables_take_the_asked_number_of_shapes(capsys):
    # `--shapes 12`: more shapes than Dynamo's recompile limit of 8.
    assert {compile_bench.variable_shape(i, 12) for i in range(24)} == {
        (k,) for k in range(2, 14)
    }
    assert {compile_bench.variable_shape(i, 2) for i in range(5)} == set(
        compile_bench.SHAPES
    )
    with pytest.raises(SystemExit) as stop:
        compile_bench.parse_arguments(["--backend", "torch", "--shapes", "0"])
    assert stop.value.code == 2
    assert "--shapes must be >= 1. Received: --shapes 0" in capsys.readouterr().err
