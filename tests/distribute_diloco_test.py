"""Synchronous DiLoCo on MWMS with real processes (tests/distribute_diloco_script.py
through `python -m tf_lars.distribute.launch --mode sync`): `model.fit` with
`DiLoCoSync` equals the one-process simulation; a worker killed mid-epoch,
the job restarted, ends bit for bit where an uninterrupted job ends; a
custom loop with int4 codes, error feedback and streaming (all-gathered)
equals the simulation bit for bit; bfloat16 (all-reduced in bfloat16) equals
a simulation that sums in bfloat16 bit for bit; H = 1 with outer SGD(1.0)
(all-reduced in float32) is data-parallel SGD and, at M = 2, the simulation
bit for bit; with four workers, float32 equals it to rounding (the ring's
order) and int8 bit for bit; the bytes are the collectives' hand counts.
The counting itself, for every compression and M, in one process
(`exchange_bytes`). Bad arguments: tests/diloco_test.py and below."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import distribute_diloco_script as script
from tests.distribute_launch_helpers import run_sync_jobs, worker_logs
from tf_lars.diloco import DiLoCo, simulate_sync
from tf_lars.distribute.diloco import (
    DiLoCoBackup,
    DiLoCoSync,
    Traffic,
    _wire,
    all_gather_bytes,
    all_reduce_bytes,
    exchange_bytes,
    synchronize,
)

SCRIPT = os.path.join("tests", "distribute_diloco_script.py")
TIMEOUT = 300
PARAMETERS = 5 * 6 + 6 + 6 * 2 + 2  # the model's trainable entries


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    return run_sync_jobs(
        {
            name: (str(tmp_path_factory.mktemp(name)), SCRIPT, arguments)
            for name, arguments in (
                ("uninterrupted", ("all",)),
                ("interrupted", ("fit", "--kill", "2:1")),
            )
        },
        TIMEOUT,
    )


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("four"))
    jobs = run_sync_jobs({"four": (root, SCRIPT, ("four",))}, TIMEOUT, workers=4)
    return jobs["four"]


def _load(job, name):
    with np.load(os.path.join(job["out"], f"{name}.npz")) as data:
        return dict(data)


def _weights(saved):
    return [saved[k] for k in sorted(saved) if k.startswith("net|")]


def _sum_in_bfloat16(optimizers, worker_variables, fragment):
    """`synchronize`'s bfloat16 exchange at M = 2, in one process: the ring's
    one addition is `a + b` in bfloat16 (the collective's own `Add` kernel),
    then decoded to float32 and divided by 2."""
    payloads = [
        optimizer.encode(optimizer.pseudo_gradient(variables, fragment), fragment)
        for optimizer, variables in zip(optimizers, worker_variables, strict=True)
    ]
    mean = [
        tf.cast(a + b, tf.float32) / 2 for (a,), (b,) in zip(*payloads, strict=True)
    ]
    for optimizer, variables in zip(optimizers, worker_variables, strict=True):
        optimizer.outer_step(mean, variables, fragment)


def _simulate(make_optimizer, steps, sync=simulate_sync, workers=2):
    """The job in one process: every worker from worker 0's initial weights,
    the same batches, `sync` (`simulate_sync`) at each step."""
    models, optimizers = [], []
    for _ in range(workers):
        model = script.make_model(1)
        optimizer = make_optimizer()
        optimizer.build(model.trainable_variables)
        models.append(model)
        optimizers.append(optimizer)
    streams = [script.batches(worker, workers) for worker in range(workers)]
    for _ in range(steps):
        for model, optimizer, stream in zip(models, optimizers, streams, strict=True):
            x, y = next(stream)
            script.loop_step(model, optimizer, tf.constant(x), tf.constant(y))
        for fragment in optimizers[0].due_fragments():
            sync(optimizers, [m.trainable_variables for m in models], fragment)
    return models


def _numbers(model):
    return [v.numpy() for v in sorted(model.trainable_variables, key=lambda v: v.path)]


@pytest.mark.slow
def test_fit_with_diloco_sync_equals_the_one_process_simulation(jobs):
    models = _simulate(script.fit_optimizer, script.STEPS * script.EPOCHS)
    for worker in range(2):
        saved = _load(jobs["uninterrupted"], f"fit-worker{worker}")
        assert int(saved["diloco|iteration"]) == 16
        for got, want in zip(_weights(saved), _numbers(models[worker]), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # After the last outer step (step 15) both workers took one more inner
    # step on their own shard: they differ, their theta does not.
    zero, one = (_load(jobs["uninterrupted"], f"fit-worker{w}") for w in range(2))
    assert not np.allclose(_weights(zero)[0], _weights(one)[0])
    for key in [k for k in zero if "|global_" in k]:
        np.testing.assert_array_equal(zero[key], one[key])


@pytest.mark.slow
def test_fit_bytes_are_counted_per_outer_step(jobs):
    # H = 3 over 16 steps: outer steps at 3, 6, 9, 12, 15; float32 payload
    # P = 4 x PARAMETERS, all-reduced: 2 (M - 1) / M x P = P each way at M = 2.
    saved = _load(jobs["uninterrupted"], "fit-worker0")
    assert int(saved["outer_steps"]) == 5
    assert int(saved["bytes_sent"]) == 5 * 4 * PARAMETERS
    assert int(saved["bytes_received"]) == 5 * 4 * PARAMETERS


@pytest.mark.slow
def test_killed_worker_restarted_job_ends_bit_for_bit_as_uninterrupted(jobs):
    assert "[worker 1] SIGKILL" in worker_logs(jobs["interrupted"]["root"], tail=None)
    for worker in range(2):
        alone = _load(jobs["uninterrupted"], f"fit-worker{worker}")
        resumed = _load(jobs["interrupted"], f"fit-worker{worker}")
        assert (int(resumed["restart"]), int(resumed["restored_epoch"])) == (1, 2)
        assert (int(alone["restart"]), int(alone["restored_epoch"])) == (0, 0)
        keys = sorted(k for k in alone if "|" in k)
        assert keys == sorted(k for k in resumed if "|" in k)
        # Every variable: weights, theta, outer momentum, inner momentum, count.
        assert any("|global_" in k for k in keys)
        for key in keys:
            np.testing.assert_array_equal(resumed[key], alone[key], err_msg=key)
        np.testing.assert_array_equal(resumed["loss"], alone["loss"][2:])


@pytest.mark.slow
def test_a_worker_refusing_its_backup_stops_every_worker(jobs):
    # After the restarted job's `fit`, worker 1 resumes with another DiLoCo:
    # it refuses its backup, and worker 0 (whose backup matches) stops too
    # instead of waiting for it in the first collective.
    job = jobs["interrupted"]
    path = os.path.join(job["backup"], "worker-1", "epoch-4.weights.h5")
    refusals = []
    for worker in range(2):
        with open(os.path.join(job["out"], f"refusal-worker{worker}.txt")) as handle:
            refusals.append(handle.read())
    assert refusals == [
        "DiLoCoBackup: another worker refused its backup of epoch 4 (its error "
        "says what differs); this worker stops too.",
        f"DiLoCoBackup: the backup {path} does not match this training: the "
        "optimizer config differs: sync_every=3 in the backup, 4 here. It was not "
        "loaded and is kept; delete it (or pass another `backup_dir`) to start "
        "from the beginning.",
    ]
    assert os.path.exists(path)


@pytest.mark.slow
def test_custom_loop_int4_streaming_equals_the_simulation(jobs):
    # All-gathered, decoded and summed in worker order, as `simulate_sync`
    # does: the same bits (for every M).
    models = _simulate(script.loop_optimizer, script.STEPS * script.EPOCHS)
    for worker in range(2):
        saved = _load(jobs["uninterrupted"], f"loop-worker{worker}")
        for got, want in zip(_weights(saved), _numbers(models[worker]), strict=True):
            np.testing.assert_array_equal(got, want)
    # Fragment 0 (the kernels (5, 6) and (6, 2)) syncs at steps 4, 8, 12, 16,
    # fragment 1 (the biases) at 2, 6, 10, 14. int4 codes two to a byte,
    # padded to 4-byte words, one float32 scale per row (per tensor for the
    # biases): kernels 16 + 20 + 8 + 24 bytes, biases 4 + 4 + 4 + 4. An
    # all-gather: each worker sends its payload and receives the other's.
    saved = _load(jobs["uninterrupted"], "loop-worker1")
    assert int(saved["outer_steps"]) == 8
    assert int(saved["bytes_sent"]) == 4 * 68 + 4 * 16
    assert int(saved["bytes_received"]) == int(saved["bytes_sent"])


@pytest.mark.slow
def test_custom_loop_bfloat16_is_summed_in_bfloat16(jobs):
    # All-reduced as bfloat16: the sum rounds to bfloat16 too, so the run is
    # the simulation that adds in bfloat16 bit for bit, and `simulate_sync`
    # (which adds the decoded float32 values) only to bfloat16 rounding.
    steps = script.STEPS * script.EPOCHS
    ring = _simulate(script.bfloat16_optimizer, steps, sync=_sum_in_bfloat16)
    exact = _simulate(script.bfloat16_optimizer, steps)
    for worker in range(2):
        saved = _load(jobs["uninterrupted"], f"bf16-worker{worker}")
        for got, want, float32_sum in zip(
            _weights(saved),
            _numbers(ring[worker]),
            _numbers(exact[worker]),
            strict=True,
        ):
            np.testing.assert_array_equal(got, want)
            np.testing.assert_allclose(got, float32_sum, rtol=2**-8, atol=2**-9)
    assert not all(
        np.array_equal(a, b)
        for a, b in zip(_numbers(ring[0]), _numbers(exact[0]), strict=True)
    )
    # H = 2 over 16 steps: 8 exchanges of P = 2 x PARAMETERS bytes (bfloat16),
    # all-reduced: 2 (M - 1) / M x P = P each way at M = 2.
    saved = _load(jobs["uninterrupted"], "bf16-worker0")
    assert int(saved["outer_steps"]) == 8
    assert int(saved["bytes_sent"]) == 8 * 2 * PARAMETERS
    assert int(saved["bytes_received"]) == 8 * 2 * PARAMETERS


@pytest.mark.slow
def test_one_inner_step_and_outer_sgd_one_is_data_parallel_sgd(jobs):
    model = script.make_model(1)
    streams = [script.batches(worker) for worker in range(2)]
    for _ in range(script.STEPS * script.EPOCHS):
        grads = []
        for stream in streams:
            x, y = next(stream)
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(
                    keras.losses.mean_squared_error(y, model(x, training=True))
                )
            grads.append(tape.gradient(loss, model.trainable_variables))
        for variable, pair in zip(model.trainable_variables, zip(*grads), strict=True):
            variable.assign(variable - 0.1 * (pair[0] + pair[1]) / 2)
    # The float32 all-reduce's one addition at M = 2 is `a + b`, what
    # `simulate_sync` adds: the same bits.
    simulated = _simulate(script.dp_optimizer, script.STEPS * script.EPOCHS)
    for worker in range(2):
        saved = _load(jobs["uninterrupted"], f"dp-worker{worker}")
        for got, want in zip(_weights(saved), _numbers(model), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        for got, want in zip(_weights(saved), _numbers(simulated[worker]), strict=True):
            np.testing.assert_array_equal(got, want)
        # 16 all-reduces of 4 x PARAMETERS bytes: 2 (M - 1) / M x P = P each way.
        assert int(saved["bytes_sent"]) == 16 * 4 * PARAMETERS
        assert int(saved["bytes_received"]) == 16 * 4 * PARAMETERS


@pytest.mark.slow
def test_four_workers_all_reduce_to_rounding_all_gather_bit_for_bit(four):
    steps = script.STEPS * script.EPOCHS
    summed = _simulate(script.four_optimizer, steps, workers=4)
    gathered = _simulate(script.int8_optimizer, steps, workers=4)
    states = {"f32x4": [], "int8x4": []}
    for worker in range(4):
        # float32, all-reduced: at M > 2 the ring adds each chunk in its own
        # order, not `simulate_sync`'s worker order, so the two agree to
        # float32 rounding (a few ulps, carried through 8 outer and 16 Adam
        # steps), not bit for bit.
        saved = _load(four, f"f32x4-worker{worker}")
        for got, want in zip(_weights(saved), _numbers(summed[worker]), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        states["f32x4"].append(saved)
        # int8, all-gathered and summed in worker order: the same bits.
        saved = _load(four, f"int8x4-worker{worker}")
        for got, want in zip(_weights(saved), _numbers(gathered[worker]), strict=True):
            np.testing.assert_array_equal(got, want)
        states["int8x4"].append(saved)
    # Either collective gives every worker the same mean: theta and the outer
    # optimizer's slots are equal bit for bit.
    for saved in states.values():
        keys = [k for k in saved[0] if "|global_" in k]
        assert keys
        for other in saved[1:]:
            for key in keys:
                np.testing.assert_array_equal(other[key], saved[0][key], err_msg=key)
    # 8 exchanges (H = 2 over 16 steps). float32: P = 4 x PARAMETERS,
    # 2 (M - 1) / M x P = 1.5 P each way. int8 codes by row, in int32 words:
    # 32 + 8 + 12 + 4 bytes, and 13 float32 scales: P sent, 3 P received.
    f32, int8 = states["f32x4"][1], states["int8x4"][1]
    assert int(f32["outer_steps"]) == int(int8["outer_steps"]) == 8
    assert int(f32["bytes_sent"]) == int(f32["bytes_received"]) == 8 * 6 * PARAMETERS
    assert int(int8["bytes_sent"]) == 8 * (56 + 4 * 13)
    assert int(int8["bytes_received"]) == 3 * 8 * (56 + 4 * 13)


def test_one_worker_fit_and_backup_resume_in_one_process(tmp_path):
    # strategy=None: one worker, the outer step alone; a second fit resumes
    # from the backup of the first.
    x, y = script.shard(0)
    model = script.make_model(1)
    model.compile(script.fit_optimizer(), "mse")
    backup = DiLoCoBackup(str(tmp_path / "backup"))
    assert isinstance(backup, keras.callbacks.BackupAndRestore)
    sync = DiLoCoSync()
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
              callbacks=[backup, sync])  # fmt: skip
    # One worker exchanges nothing: two outer steps, no bytes.
    assert sync.traffic.as_dict() == {
        "outer_steps": 2, "bytes_sent": 0, "bytes_received": 0
    }  # fmt: skip
    assert sorted(os.listdir(tmp_path / "backup" / "worker-0")) == [
        "epoch-2.weights.h5"
    ]
    again = script.make_model(7)
    again.compile(script.fit_optimizer(), "mse")
    backup = DiLoCoBackup(str(tmp_path / "backup"))
    again.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
              callbacks=[backup, DiLoCoSync()])  # fmt: skip
    assert backup.restored_epoch == 2
    for a, b in zip(model.optimizer.variables, again.optimizer.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # Kept when `fit` ends (Keras's deletes `backup_dir`): a restarted job's.
    assert sorted(os.listdir(tmp_path / "backup" / "worker-0")) == [
        "epoch-2.weights.h5"
    ]
    # The parent's refusals: another DiLoCo, a fit shorter than the backup.
    path = tmp_path / "backup" / "worker-0" / "epoch-2.weights.h5"
    other = script.fit_optimizer(sync_every=4)
    late = "it is of epoch 2, after this fit's last (epochs=1)"
    for optimizer, epochs, what in [
        (other, 2, "the optimizer config differs: sync_every=3 in the backup, 4 here"),
        (script.fit_optimizer(), 1, late),
    ]:
        again = script.make_model(7)
        again.compile(optimizer, "mse")
        callbacks = [DiLoCoBackup(str(tmp_path / "backup")), DiLoCoSync()]
        with pytest.raises(ValueError) as raised:
            again.fit(x, y, batch_size=8, epochs=epochs, verbose=0, callbacks=callbacks)
        assert str(raised.value) == (
            f"DiLoCoBackup: the backup {path} does not match this training: {what}. "
            "It was not loaded and is kept; delete it (or pass another `backup_dir`) "
            "to start from the beginning."
        )
        assert path.exists()


def test_an_agreed_refusal_survives_a_peer_that_ends_after_it(tmp_path, monkeypatch):
    # Two workers' agreement, played in one process: the other worker
    # refused (the MIN is 0), then ended its program during the collective
    # taken after the agreement; this worker still raises the refusal.
    x, y = script.shard(0)
    model = script.make_model(1)
    model.compile(script.fit_optimizer(), "mse")
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
              callbacks=[DiLoCoBackup(str(tmp_path)), DiLoCoSync()])  # fmt: skip
    calls = []

    def agreed(self, value):
        calls.append(value)
        if len(calls) == 3:
            raise tf.errors.UnavailableError(None, None, "Socket closed")
        return 0 if len(calls) == 2 else value

    monkeypatch.setattr(DiLoCoBackup, "_agreed", agreed)
    again = script.make_model(7)
    again.compile(script.fit_optimizer(), "mse")
    with pytest.raises(ValueError, match="another worker refused its backup of epoch"):
        again.fit(x, y, batch_size=8, epochs=2, verbose=0,
                  callbacks=[DiLoCoBackup(str(tmp_path)), DiLoCoSync()])  # fmt: skip
    assert calls == [2, 1, 0]  # the epoch, this worker's "no refusal", one more


def _payloads(compression, granularity="tensor"):
    """One worker's payloads for the script's model (shapes (5, 6), (6,),
    (6, 2), (2,)), as `DiLoCo.encode` makes them."""
    model = script.make_model(1)
    diloco = DiLoCo(
        keras.optimizers.SGD(0.1),
        compression=compression,
        granularity=granularity,
        exchange="external",
    )
    diloco.build(model.trainable_variables)
    deltas = [tf.fill(v.shape, 0.25) for v in model.trainable_variables]
    return diloco.encode(deltas)


@pytest.mark.parametrize("workers", [1, 2, 4, 8])
@pytest.mark.parametrize(
    "compression, granularity, collective, payload",
    [
        # One float vector of all the fragment's entries.
        (None, "tensor", "all_reduce", 4 * PARAMETERS),
        (None, "row", "all_reduce", 4 * PARAMETERS),
        ("bfloat16", "tensor", "all_reduce", 2 * PARAMETERS),
        # Codes as int32 words (each tensor padded), plus a float32 scale per
        # tensor (or per row): 32 + 8 + 12 + 4 code bytes.
        ("int8", "tensor", "all_gather", 32 + 8 + 12 + 4 + 4 * 4),
        ("int8", "row", "all_gather", 32 + 8 + 12 + 4 + 4 * (5 + 1 + 6 + 1)),
        # Two codes a byte: 15, 3, 6, 1 bytes, padded to 16, 4, 8, 4.
        ("int4", "tensor", "all_gather", 16 + 4 + 8 + 4 + 4 * 4),
        ("int4", "row", "all_gather", 16 + 4 + 8 + 4 + 4 * (5 + 1 + 6 + 1)),
    ],
)
def test_exchange_bytes_counts_the_collective_of_each_compression(
    compression, granularity, collective, payload, workers
):
    payloads = _payloads(compression, granularity)
    counted = exchange_bytes(payloads, compression, workers)
    # The hand counts: a ring all-reduce's 2 (M - 1) / M x P each way (exact
    # here: P is a multiple of 4 and M divides 2P), an all-gather's P sent
    # and (M - 1) x P received; one worker moves nothing.
    if collective == "all_reduce":
        each = 2 * (workers - 1) * payload // workers
        assert counted == (collective, each, each)
        assert counted[1:] == all_reduce_bytes(payload, workers)
    else:
        sent = payload if workers > 1 else 0
        assert counted == (collective, sent, (workers - 1) * payload)
        assert counted[1:] == all_gather_bytes(payload, workers)
        # What the count reads from the shapes is what `synchronize` hands
        # to the all-gather.
        wires = [
            _wire(tensor, compression == "int4" and index == 0)[0]
            for each in payloads
            for index, tensor in enumerate(each)
        ]
        assert sum(int(np.prod(w.shape)) * w.dtype.size for w in wires) == payload
    traffic = Traffic()
    for _ in range(3):
        traffic.add(*counted[1:])
    assert traffic.as_dict() == {
        "outer_steps": 3, "bytes_sent": 3 * counted[1], "bytes_received": 3 * counted[2]
    }  # fmt: skip
    assert all(isinstance(value, int) for value in traffic.as_dict().values())


def test_exchange_bytes_rounds_the_all_reduce_and_sums_one_per_dtype():
    # 3 bfloat16 entries at M = 8: 2 x 7 / 8 x 6 = 10.5 bytes, rounded up.
    three = [(tf.zeros([3], tf.bfloat16),)]
    assert exchange_bytes(three, "bfloat16", 8) == ("all_reduce", 11, 11)
    # float16 and float32 payloads in one fragment: one all-reduce each.
    mixed = [(tf.zeros([3], tf.float16),), (tf.zeros([2]),)]
    assert exchange_bytes(mixed, None, 4) == ("all_reduce", 9 + 12, 9 + 12)
    with pytest.raises(
        ValueError, match=r"`workers` must be an int >= 1\. Received: workers=0"
    ):
        exchange_bytes(three, "bfloat16", 0)
    with pytest.raises(
        ValueError, match=r"`compression` must be one of .*compression='fp8'"
    ):
        exchange_bytes(three, "fp8", 2)


def test_bad_arguments_are_refused_naming_them():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with pytest.raises(ValueError, match=r"`strategy` must be a .*Received: strategy="):
        DiLoCoSync(strategy)
    with pytest.raises(ValueError, match=r"`backup_dir` must be a non-empty str\. "):
        DiLoCoBackup("")
    with pytest.raises(ValueError, match=r"`diloco` must be a `tf_lars.DiLoCo`\. "):
        synchronize(keras.optimizers.SGD(), [])
    model = script.make_model(1)
    model.compile(keras.optimizers.SGD(), "mse")
    x, y = script.shard(0)
    with pytest.raises(ValueError, match=r"`model.optimizer` must be a"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[DiLoCoSync()])
    model.compile(script.fit_optimizer(), "mse", steps_per_execution=2)
    with pytest.raises(ValueError, match="steps_per_execution=1"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[DiLoCoSync()])
