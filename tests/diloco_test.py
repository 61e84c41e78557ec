"""DiLoCo against its NumPy reference, on any Keras backend.

Runs unchanged under `KERAS_BACKEND=jax`: everything goes through
`keras.ops`, and tolerances follow the dtype a variable really has (on JAX
without x64, float64 variables are float32). The rules are
docs/guides/low-communication.md's.
"""

import pathlib
import re

import keras
import numpy as np
import pytest
from keras import ops

import tf_lars
from tests import diloco_reference as reference
from tf_lars.diloco import (
    DiLoCo,
    error_feedback_step,
    fragment_offsets,
    payload_bytes,
    quantize,
    round_trip,
    simulate_sync,
    streaming_fragments,
    streaming_schedule,
)

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHAPES = [(3, 4), (4,), (2, 3), ()]
TOLERANCE = {"float32": 1e-5, "float64": 1e-10}


def _problem(num_workers, steps, seed=0):
    """A quadratic per worker: `g = A_m * (w - c_m) + noise_{m,step}`.

    Drawn in float32 so that both sides start from the same numbers.
    """
    rng = np.random.default_rng(seed)
    draw = lambda *shape: rng.normal(size=shape).astype("float32")  # noqa: E731
    initial = [draw(*shape) for shape in SHAPES]
    curvature = [
        [np.abs(draw(*shape)) + 0.5 for shape in SHAPES] for _ in range(num_workers)
    ]
    centre = [[draw(*shape) for shape in SHAPES] for _ in range(num_workers)]
    noise = [
        [[0.1 * draw(*shape) for shape in SHAPES] for _ in range(steps)]
        for _ in range(num_workers)
    ]

    def gradients(worker, step, weights, convert=lambda x, like: x):
        return [
            convert(a, w) * (w - convert(c, w)) + convert(n, w)
            for a, c, n, w in zip(
                curvature[worker], centre[worker], noise[worker][step], weights
            )
        ]

    return initial, gradients


def _as_dtype_of(array, tensor):
    return ops.cast(array, tensor.dtype)


def _dtype(variable):
    """The dtype the backend really holds (JAX without x64: float32)."""
    return str(ops.convert_to_numpy(variable).dtype)


def _run(workers, initial, gradients, steps, dtype):
    """Inner steps on every worker; each due fragment synced by simulate_sync."""
    worker_variables = [
        [keras.Variable(w.astype(dtype), dtype=dtype) for w in initial] for _ in workers
    ]
    for step in range(steps):
        for m, (worker, variables) in enumerate(zip(workers, worker_variables)):
            values = [ops.convert_to_tensor(v) for v in variables]
            worker.apply(gradients(m, step, values, _as_dtype_of), variables)
        for fragment in workers[0].due_fragments():
            simulate_sync(workers, worker_variables, fragment)
    return worker_variables


def _close(actual, expected, dtype):
    tolerance = TOLERANCE[dtype]
    if keras.backend.backend() == "torch" and dtype == "float64":
        # Keras's PyTorch optimizers are their own `torch._foreach` code: the
        # same rules, but Python hyperparameters at float64 (the reference
        # rounds them to float32, as the TensorFlow and JAX steps do) and
        # AdamW's decay factor `1 - wd * lr` at float32: float32's tolerance.
        tolerance = TOLERANCE["float32"]
    for a, e in zip(actual, expected, strict=True):
        np.testing.assert_allclose(
            ops.convert_to_numpy(a), e, rtol=tolerance, atol=tolerance
        )


INNER = {
    "adamw": (
        lambda: keras.optimizers.AdamW(learning_rate=0.05, weight_decay=0.1),
        lambda: reference.AdamW(0.05, weight_decay=0.1),
    ),
    "sgd_momentum": (
        lambda: keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
        lambda: reference.SGD(0.05, momentum=0.9),
    ),
}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("inner", sorted(INNER))
@pytest.mark.parametrize("num_workers", [2, 4])
def test_diloco_matches_the_numpy_reference(num_workers, inner, dtype):
    sync_every, steps = 3, 12  # four rounds
    initial, gradients = _problem(num_workers, steps)
    make_inner, make_reference_inner = INNER[inner]
    workers = [
        DiLoCo(make_inner(), sync_every=sync_every, exchange="external")
        for _ in range(num_workers)
    ]
    worker_variables = _run(workers, initial, gradients, steps, dtype)
    theta, expected_workers = reference.diloco(
        [w.astype("float64") for w in initial],
        lambda m, step, weights: [
            g.astype("float64") for g in gradients(m, step, weights)
        ],
        make_reference_inner,
        reference.SGD(0.7, momentum=0.9, nesterov=True),
        num_workers,
        sync_every,
        steps,
    )
    actual_dtype = _dtype(worker_variables[0][0])
    assert int(ops.convert_to_numpy(workers[0].outer_optimizer.iterations)) == 4
    for worker, variables, expected in zip(
        workers, worker_variables, expected_workers, strict=True
    ):
        _close(worker.global_variables, theta, actual_dtype)
        _close(variables, expected, actual_dtype)
        assert int(ops.convert_to_numpy(worker.inner_steps)) == steps


def _regression(num_workers, shard, steps, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps, num_workers * shard, 5)).astype("float32")
    y = rng.normal(size=(steps, num_workers * shard, 2)).astype("float32")
    initial = [rng.normal(size=(5, 2)).astype("float32"), np.zeros(2, "float32")]
    return x, y, initial


def _least_squares_gradients(x, y, kernel, bias):
    """Of `mean over the batch of 0.5 * |x W + b - y|^2`, in keras.ops."""
    residual = ops.subtract(ops.matmul(x, kernel) + bias, y)
    count = x.shape[0]
    return [ops.matmul(ops.transpose(x), residual) / count, ops.mean(residual, 0)]


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_one_inner_step_and_plain_outer_sgd_is_data_parallel_sgd(momentum):
    # H = 1, inner SGD, outer SGD(1.0): theta - mean(theta - w_m) = mean(w_m),
    # linear in the gradient, so the round is one SGD step on the mean of the
    # shards' gradients, the global batch's (momentum: the mean of the
    # workers' buffers follows SGD's buffer on the mean gradient).
    num_workers, shard, steps = 4, 8, 6
    x, y, initial = _regression(num_workers, shard, steps)
    workers = [
        DiLoCo(
            keras.optimizers.SGD(learning_rate=0.1, momentum=momentum),
            outer_optimizer=keras.optimizers.SGD(learning_rate=1.0),
            sync_every=1,
            exchange="external",
        )
        for _ in range(num_workers)
    ]
    worker_variables = [[keras.Variable(w) for w in initial] for _ in workers]
    single = [keras.Variable(w) for w in initial]
    data_parallel = keras.optimizers.SGD(learning_rate=0.1, momentum=momentum)
    for step in range(steps):
        for m, (worker, variables) in enumerate(zip(workers, worker_variables)):
            rows = slice(m * shard, (m + 1) * shard)
            worker.apply(
                _least_squares_gradients(x[step, rows], y[step, rows], *variables),
                variables,
            )
        assert workers[0].due_fragments() == [0]
        simulate_sync(workers, worker_variables)
        data_parallel.apply(_least_squares_gradients(x[step], y[step], *single), single)
    for variables in worker_variables:
        _close(variables, [ops.convert_to_numpy(v) for v in single], "float32")
    assert not np.allclose(ops.convert_to_numpy(single[0]), initial[0], atol=1e-2)


# --- Compression ---


def _tensors():
    rng = np.random.default_rng(2)
    matrix = rng.normal(size=(5, 7)).astype("float32") * np.array(
        [[1.0], [1e-3], [0.0], [50.0], [0.5]], "float32"
    )
    return [matrix, rng.normal(size=(6,)).astype("float32"), np.zeros(3, "float32")]


@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("compression", [None, "bfloat16", "int8", "int4"])
def test_round_trip_matches_the_reference(compression, granularity):
    for x in _tensors():
        actual = ops.convert_to_numpy(round_trip(x, compression, granularity))
        expected = reference.round_trip(x, compression, granularity)
        np.testing.assert_array_equal(actual, expected)
        assert actual.dtype == x.dtype
    if compression is not None:
        x = _tensors()[0]
        assert not np.array_equal(
            ops.convert_to_numpy(round_trip(x, compression, granularity)), x
        )


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_codes_and_scales(bits):
    levels = 2 ** (bits - 1) - 1
    x = np.array([[-2.0, 1.0, 0.5], [0.0, 0.0, 0.0], [0.3, -0.1, 0.2]], "float32")
    codes, scale = quantize(x, bits, "row")
    expected_codes, expected_scale = reference.quantize(x, bits, "row")
    np.testing.assert_array_equal(ops.convert_to_numpy(codes), expected_codes)
    np.testing.assert_array_equal(ops.convert_to_numpy(scale), expected_scale)
    assert ops.convert_to_numpy(codes)[0, 0] == -levels
    assert ops.convert_to_numpy(codes)[1].tolist() == [0, 0, 0]
    np.testing.assert_allclose(
        ops.convert_to_numpy(scale)[:, 0], [2 / levels, 0, 0.3 / levels], rtol=1e-6
    )
    codes, scale = quantize(x, bits)
    assert ops.convert_to_numpy(scale).shape == ()
    assert np.abs(ops.convert_to_numpy(codes)).max() == levels


def test_bfloat16_rounds_to_nearest_even():
    # 1 + 2**-8 is halfway between bfloat16's 1 and 1 + 2**-7: ties to 1.
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-9], "float32")
    assert ops.convert_to_numpy(round_trip(x, "bfloat16")).tolist() == [
        1.0,
        1 + 2**-6,
        1.0,
    ]
    np.testing.assert_array_equal(reference.bfloat16_round(x), [1.0, 1 + 2**-6, 1.0])


def test_error_feedback_carries_what_was_lost():
    x, error = _tensors()[0], _tensors()[0] * 0.01
    sent, new_error = error_feedback_step(ops.convert_to_tensor(x), error, "int4")
    sent, new_error = ops.convert_to_numpy(sent), ops.convert_to_numpy(new_error)
    np.testing.assert_array_equal(sent, reference.round_trip(x + error, "int4"))
    np.testing.assert_array_equal(new_error, (x + error) - sent)
    assert np.abs(new_error).max() > 0


def test_payload_bytes():
    assert payload_bytes((5, 7)) == 140
    assert payload_bytes((5, 7), dtype="float64") == 280
    assert payload_bytes((5, 7), "bfloat16") == 70
    assert payload_bytes((5, 7), "int8") == 35 + 4
    assert payload_bytes((5, 7), "int8", "row") == 35 + 20
    assert payload_bytes((5, 7), "int4") == 18 + 4
    assert payload_bytes((), "int4") == 1 + 4


COMPRESSED = [
    ("bfloat16", "tensor", False),
    ("int8", "tensor", True),
    ("int4", "row", True),
    ("int4", "tensor", False),
]


@pytest.mark.parametrize("compression, granularity, error_feedback", COMPRESSED)
def test_compressed_diloco_matches_the_reference(
    compression, granularity, error_feedback
):
    num_workers, sync_every, steps = 2, 2, 8
    initial, gradients = _problem(num_workers, steps, seed=3)
    workers = [
        DiLoCo(
            keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
            sync_every=sync_every,
            compression=compression,
            granularity=granularity,
            error_feedback=error_feedback,
            exchange="external",
        )
        for _ in range(num_workers)
    ]
    worker_variables = _run(workers, initial, gradients, steps, "float32")
    theta, expected_workers = reference.diloco(
        initial,
        gradients,
        lambda: reference.SGD(0.05, momentum=0.9),
        reference.SGD(0.7, momentum=0.9, nesterov=True),
        num_workers,
        sync_every,
        steps,
        compression=compression,
        granularity=granularity,
        error_feedback=error_feedback,
    )
    for worker, variables, expected in zip(workers, worker_variables, expected_workers):
        _close(worker.global_variables, theta, "float32")
        _close(variables, expected, "float32")
    if error_feedback:
        assert any(np.abs(ops.convert_to_numpy(e)).max() > 0 for e in workers[0].errors)


# --- Streaming ---


def test_streaming_schedule_staggers_the_fragments():
    assert fragment_offsets(2, 4) == [0, 2]
    assert fragment_offsets(3, 6) == [0, 2, 4]
    due = [streaming_schedule(step, 2, 4) for step in range(10)]
    assert due == [[], [], [1], [], [0], [], [1], [], [0], []]
    plain = [streaming_schedule(step, 1, 3) for step in range(7)]
    assert plain == [[], [], [], [0], [], [], [0]]
    assert streaming_fragments(5, 2) == [[0, 2, 4], [1, 3]]


def test_streaming_diloco_matches_the_reference():
    num_workers, sync_every, steps = 3, 4, 13
    initial, gradients = _problem(num_workers, steps, seed=4)
    workers = [
        DiLoCo(
            keras.optimizers.AdamW(learning_rate=0.05),
            sync_every=sync_every,
            compression="int8",
            error_feedback=True,
            num_fragments=2,
            exchange="external",
        )
        for _ in range(num_workers)
    ]
    worker_variables = _run(workers, initial, gradients, steps, "float32")
    theta, expected_workers = reference.diloco(
        initial,
        gradients,
        lambda: reference.AdamW(0.05, weight_decay=0.004),
        reference.SGD(0.7, momentum=0.9, nesterov=True),
        num_workers,
        sync_every,
        steps,
        compression="int8",
        error_feedback=True,
        num_fragments=2,
    )
    assert workers[0].fragments == [[0, 2], [1, 3]]
    # Syncs at steps 2, 4, 6, 8, 10, 12: three outer steps per fragment.
    assert int(ops.convert_to_numpy(workers[0].outer_optimizer.iterations)) == 6
    for worker, variables, expected in zip(workers, worker_variables, expected_workers):
        _close(worker.global_variables, theta, "float32")
        _close(variables, expected, "float32")


# --- Configuration and bad arguments ---


def test_default_outer_optimizer_is_the_paper_s_nesterov_sgd():
    worker = DiLoCo(keras.optimizers.AdamW(1e-3))
    outer = worker.outer_optimizer
    assert isinstance(outer, keras.optimizers.SGD)
    assert (outer.momentum, outer.nesterov) == (0.9, True)
    assert float(ops.convert_to_numpy(outer.learning_rate)) == pytest.approx(0.7)
    assert worker.sync_every == 500


def test_get_config_round_trips():
    worker = DiLoCo(
        keras.optimizers.AdamW(learning_rate=1e-3, weight_decay=0.1),
        outer_optimizer=keras.optimizers.SGD(0.5, momentum=0.8),
        sync_every=7,
        compression="int4",
        granularity="row",
        error_feedback=True,
        num_fragments=3,
        name="worker_0",
        exchange="external",
    )
    config = worker.get_config()
    assert config["inner_optimizer"]["class_name"] == "AdamW"
    assert config["outer_optimizer"]["config"]["momentum"] == 0.8
    restored = DiLoCo.from_config(config)
    assert restored.get_config() == config
    assert isinstance(restored.inner_optimizer, keras.optimizers.AdamW)
    assert restored.inner_optimizer is not worker.inner_optimizer
    serialized = keras.saving.serialize_keras_object(worker)
    assert serialized["registered_name"] == "tf_lars>DiLoCo"
    again = keras.saving.deserialize_keras_object(serialized)
    assert isinstance(again, DiLoCo) and again.get_config() == config


# Unknown config keys and numbers beyond float32, refused for every class
# (this file's tests of them are there): tests/contract_test.py,
# `test_from_config_refuses_an_unknown_key`,
# `test_numbers_beyond_float32_are_refused`,
# `test_an_inner_learning_rate_beyond_float32_is_refused`.


_SAME = keras.optimizers.SGD(0.1)
BAD_ARGUMENTS = [
    (
        {"inner_optimizer": _SAME, "outer_optimizer": _SAME},
        "`outer_optimizer` must be another",
    ),
    ({"sync_every": 0}, "`sync_every` must be an int >= 1. Received: sync_every=0"),
    ({"sync_every": True}, "Received: sync_every=True"),
    ({"sync_every": 2.0}, "Received: sync_every=2.0"),
    ({"sync_every": 2**70}, "`sync_every` must be at most 9223372036854775807"),
    ({"exchange": "ring"}, "`exchange` must be one of ['local', 'external']. Rec"),
    (
        {"inner_optimizer": DiLoCo(keras.optimizers.SGD(0.1))},
        "`inner_optimizer` must not be a DiLoCo or an AGN",
    ),
    (
        {"outer_optimizer": DiLoCo(keras.optimizers.SGD(0.1))},
        "`outer_optimizer` must not be a DiLoCo or an AGN",
    ),
    ({"inner_optimizer": "adam"}, "Received: inner_optimizer='adam'"),
    ({"outer_optimizer": "sgd"}, "`outer_optimizer` must be a `keras.optimizers"),
    (
        {"outer_optimizer": keras.optimizers.SGD(learning_rate=0.0)},
        "`outer_optimizer.learning_rate` must be a finite number > 0. "
        "Received: outer_optimizer=SGD with learning_rate=0.0",
    ),
    (
        {"outer_optimizer": keras.optimizers.SGD(learning_rate=-0.7)},
        "Received: outer_optimizer=SGD with learning_rate=-0.7",
    ),
    (
        {"outer_optimizer": keras.optimizers.SGD(learning_rate=1e300)},
        "Received: outer_optimizer=SGD with learning_rate=inf",
    ),
    (
        {"inner_optimizer": keras.optimizers.Adam(learning_rate=1e300)},
        "`inner_optimizer.learning_rate` must be finite",
    ),
    ({"compression": "int2"}, "`compression` must be one of [None, 'bfloat16', "),
    # `sync_every` counts `apply` calls (the same on every worker, a skipped
    # non-finite step included): an accumulating inner optimizer would end a
    # round inside an accumulation.
    (
        {
            "inner_optimizer": tf_lars.LossScaleOptimizer(
                keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)
            )
        },
        "`inner_optimizer` must not accumulate gradients: `sync_every` counts "
        "DiLoCo's `apply` calls, and a round ending inside an accumulation would "
        "carry its partial gradient past the outer step (give the k micro-batches "
        "as one batch). Received: SGD(gradient_accumulation_steps=2)",
    ),
    ({"sync_period": 2}, "`sync_period` is not an argument of DiLoCo. Received"),
    (  # it skipped every other outer step, and the round's progress with it
        {"outer_optimizer": keras.optimizers.SGD(0.7, gradient_accumulation_steps=2)},
        "`outer_optimizer.gradient_accumulation_steps` must be unset: the outer "
        "optimizer takes one step a round, and the weights are reset to its "
        "result. Received: outer_optimizer.gradient_accumulation_steps=2",
    ),
    (
        {"outer_optimizer": keras.optimizers.SGD(0.7, use_ema=True)},
        "Received: outer_optimizer.use_ema=True",
    ),
    ({"granularity": "column"}, "Received: granularity='column'"),
    ({"error_feedback": True}, "Received: error_feedback=True, compression=None"),
    ({"error_feedback": 1, "compression": "int8"}, "Received: error_feedback=1"),
    ({"num_fragments": 0}, "`num_fragments` must be an int >= 1"),
    (
        {"num_fragments": 4, "sync_every": 3},
        "`num_fragments` must be <= sync_every (3), so that each fragment has "
        "its own offset. Received: num_fragments=4",
    ),
]


@pytest.mark.parametrize("arguments, message", BAD_ARGUMENTS)
def test_bad_arguments_are_refused_naming_them(arguments, message):
    arguments = {"inner_optimizer": keras.optimizers.SGD(0.1), **arguments}
    with pytest.raises(ValueError) as error:
        DiLoCo(**arguments)
    assert message in str(error.value)


def test_bad_calls_are_refused_naming_the_argument():
    worker = DiLoCo(keras.optimizers.SGD(0.1), sync_every=4, num_fragments=2)
    variables = [keras.Variable(np.ones(2, "float32")) for _ in range(3)]
    with pytest.raises(ValueError, match="diloco is not built: call `build"):
        worker.compress([np.zeros(2, "float32")] * 3)
    worker.build(variables)
    with pytest.raises(ValueError, match=r"`fragment` must be an int in \[0, 2\)\. "):
        worker.pseudo_gradient(variables, fragment=2)
    with pytest.raises(ValueError, match="Received: fragment=True"):
        worker.pseudo_gradient(variables, fragment=True)
    with pytest.raises(ValueError, match="`variables` must hold 3 tensors"):
        worker.pseudo_gradient(variables[:2])
    with pytest.raises(ValueError, match="`mean_pseudo_gradient` must hold 2 "):
        worker.outer_step([np.zeros(2, "float32")], variables, fragment=0)
    with pytest.raises(ValueError, match="one variable list per worker. Received: 1"):
        simulate_sync([worker, worker], [variables])
    # A variable it was not built with (here of another shape, which would
    # broadcast against theta: (3, 1) - (2,)) is refused; so is one twice.
    other = [keras.Variable(np.ones((2, 1), "float32"), name="other")] + variables[1:]
    message = "`variables` must be the 3 variables diloco was built with, each once"
    with pytest.raises(
        ValueError, match=message + r"\. Received: <Variable path=other"
    ):
        worker.pseudo_gradient(other)
    with pytest.raises(ValueError, match=message + r"\. Received: a variable twice"):
        worker.outer_step([np.zeros(2, "float32")] * 3, [variables[0]] * 3)
    with pytest.raises(ValueError, match="`mean_pseudo_gradient` must match"):
        worker.outer_step([np.zeros((2, 1), "float32")] * 2, variables, fragment=0)
    too_many = DiLoCo(keras.optimizers.SGD(0.1), sync_every=4, num_fragments=4)
    with pytest.raises(ValueError, match=r"number of variables \(3\)\. Received"):
        too_many.build(variables)


def test_variables_in_another_order_keep_their_own_theta():
    # Keras's optimizers take their variables in any order; DiLoCo paired
    # theta with them by position, and swapped a's and b's (0.2.x).
    a = keras.Variable(np.zeros(2, "float32"))
    b = keras.Variable(np.full(2, 10.0, "float32"))
    worker = DiLoCo(keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.5), sync_every=1)
    worker.build([a, b])
    one = ops.ones((2,))
    worker.apply([one, 2 * one], [a, b])  # theta: 0 - 0.5 (0.1), 10 - 0.5 (0.2)
    worker.apply_gradients([(2 * one, b), (one, a)])
    for variable, want in ((a, -0.1), (b, 9.8)):
        np.testing.assert_allclose(ops.convert_to_numpy(variable), [want] * 2, 1e-6)
    theta = [ops.convert_to_numpy(t) for t in worker.global_variables]
    np.testing.assert_allclose(theta, [[-0.1] * 2, [9.8] * 2], 1e-6)
    # The exchange's own methods pair them the same way.
    delta = worker.pseudo_gradient([b, a])
    np.testing.assert_allclose(ops.convert_to_numpy(delta[0]), [0.0] * 2)


def test_a_driver_refuses_a_worker_that_took_its_own_outer_step():
    # exchange="local" (the default) took the outer step of round 1 itself:
    # simulate_sync would take a second one. Before any outer step, a driver
    # takes the exchange over.
    variables = [keras.Variable(np.ones(2, "float32"))]
    alone = DiLoCo(keras.optimizers.SGD(0.1), sync_every=1)
    alone.apply([ops.ones(2)], variables)
    with pytest.raises(ValueError, match="simulate_sync takes diloco's outer steps"):
        simulate_sync([alone], [variables])
    fresh = DiLoCo(keras.optimizers.SGD(0.1), sync_every=2)
    fresh.apply([ops.ones(2)], variables)
    fresh.take_over_exchange("a driver")  # as `synchronize` does at every step
    assert fresh.exchange == "external"
    fresh.apply([ops.ones(2)], variables)  # round 1 ends: no own step
    assert int(ops.convert_to_numpy(fresh.outer_optimizer.iterations)) == 0
    simulate_sync([fresh], [variables])
    assert int(ops.convert_to_numpy(fresh.outer_optimizer.iterations)) == 1


def _guide_example():
    text = (ROOT / "docs" / "guides" / "low-communication.md").read_text()
    # The first block is the self-contained one; the second is a fragment.
    return re.findall(r"```python\n(.*?)```", text, re.DOTALL)[0]


def test_the_guide_s_example_runs_as_pasted(capsys):
    exec(compile(_guide_example(), "low-communication.md", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("loss before training: ")
    before, after = (float(line.split(": ")[1]) for line in lines[:2])
    assert lines[1].startswith("loss after training: ") and after < before / 100
    assert lines[2].startswith("outer steps: 30, largest error: 0.00")
    assert lines[3] == "workers agree: True"


# On TensorFlow also under XLA, where Keras builds the optimizer inside the
# first compiled step: DiLoCo's copies of the weights could not be lifted out
# of it (`UnimplementedError`, 0.2.x); a GPU's `jit_compile="auto"` is XLA.
FIT_JIT = [False, True] if keras.backend.backend() == "tensorflow" else ["auto"]


@pytest.mark.parametrize("jit_compile", FIT_JIT)
def test_model_fit_takes_the_outer_step_every_h_steps_as_one_worker(
    jit_compile, tmp_path
):
    # On every backend: `model.fit` with a DiLoCo alone is one worker (M = 1):
    # an outer step (the paper's Nesterov SGD) every 3 inner steps, after
    # steps 3 and 6 of 8, as the NumPy reference takes them; a `.keras` file
    # restores all of its state.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1))).astype("float32")

    def fit(optimizer):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        initial = [np.array(w) for w in model.get_weights()]
        model.compile(optimizer, "mse", jit_compile=jit_compile)
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        return model, initial

    def mse_gradients(worker, step, weights):
        rows = slice(16 * (step % 4), 16 * (step % 4 + 1))
        residual = x[rows] @ weights[0] + weights[1] - y[rows]
        return [2 * x[rows].T @ residual / 16, 2 * residual.mean(axis=0)]

    model, initial = fit(DiLoCo(keras.optimizers.SGD(0.05, momentum=0.9), sync_every=3))
    theta, (expected,) = reference.diloco(
        [w.astype("float64") for w in initial],
        mse_gradients,
        lambda: reference.SGD(0.05, momentum=0.9),
        reference.SGD(0.7, momentum=0.9, nesterov=True),
        num_workers=1,
        sync_every=3,
        steps=8,
    )
    _close(model.optimizer.global_variables, theta, "float32")
    _close(model.trainable_variables, expected, "float32")
    assert int(ops.convert_to_numpy(model.optimizer.inner_steps)) == 8
    assert int(ops.convert_to_numpy(model.optimizer.outer_optimizer.iterations)) == 2
    # Two steps past the last outer step: not the inner optimizer alone.
    alone, _ = fit(keras.optimizers.SGD(0.05, momentum=0.9))
    assert not np.allclose(model.get_weights()[0], alone.get_weights()[0], atol=1e-3)
    path = str(tmp_path / "diloco.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, DiLoCo)
    assert loaded.optimizer.sync_every == 3
    names = [v.path for v in model.optimizer.variables]
    assert names[:4] == ["diloco/iteration", "diloco/learning_rate"] + [
        "diloco/global_0",
        "diloco/global_1",
    ]
    assert len(loaded.optimizer.variables) == len(names)
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables, strict=True):
        np.testing.assert_array_equal(ops.convert_to_numpy(a), ops.convert_to_numpy(b))
