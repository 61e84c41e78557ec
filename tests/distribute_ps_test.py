"""AGN under ParameterServerStrategy on an in-process cluster (2 workers, 1 ps).

The cluster lives in a subprocess (tests/distribute_ps_script.py): its gRPC
servers cannot be shut down, and it must not share a process with other tests.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tf_lars.distribute._process import die_with_parent

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "distribute_ps_script.py")


@pytest.fixture(scope="module")
def result():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(
        [sys.executable, SCRIPT],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=die_with_parent,
    )
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(10)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, out[-6000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_two_workers_period_one_center_moves_point_one_per_commit(result):
    seed = result["seed_reference"]
    centers = np.array(seed["centers"])
    expected = np.array([[0.1 * k, 0.5 + 0.1 * k] for k in range(7)])
    np.testing.assert_allclose(centers, expected, atol=1e-6)
    assert seed["commits"] == 6
    # Every commit went through the center optimizer exactly once (serialized
    # at the parameter server; a lost read-then-write would show here).
    assert seed["center_iterations"] == 6
    assert sum(seed["worker_local_steps"]) == 6


def test_center_on_ps_and_local_copies_on_each_worker(result):
    seed = result["seed_reference"]
    assert seed["center_placement"] == ["/job:ps/replica:0/task:0/device:CPU:0"]
    assert seed["local_types"] == ["WorkerLocalVariable"]
    # Each worker holds its own copy: after its last pull and local step
    # (sign-SGD +0.1) it is at most one commit behind the final center 0.6.
    for per_worker in seed["local_copies_per_worker"][:1]:
        assert len(per_worker) == result["num_workers"]
        for value in per_worker:
            assert 0.1 <= value <= 0.6 + 1e-6


def test_evaluate_reads_the_center(result):
    # loss = -(w0 + w1) = -(0.6 + 1.1)
    assert result["seed_reference"]["evaluate"]["loss"] == pytest.approx(-1.7, abs=1e-5)


def test_apply_is_rejected_under_parameter_servers(result):
    assert "driven round by round" in result["seed_reference"]["apply_error"]


def test_exact_commit_count_k_workers_n_steps_period_p(result):
    # K = 2 workers, N = 30 local steps each, P = 3: K*N/P = 20 commits.
    count = result["exact_count"]
    assert count["commits"] == 20
    assert count["history"]["target_commits"] == 20
    assert count["local_steps"] == 60
    assert sum(count["worker_local_steps"]) == 60
    assert all(steps > 0 for steps in count["worker_local_steps"])
    # Two float32 scalars per commit and per pull, one of each per round.
    assert count["history"]["bytes_per_commit"] == 8
    assert count["history"]["worker_bytes_sent"] == [
        steps // 3 * 8 for steps in count["worker_local_steps"]
    ]
    assert (
        count["history"]["worker_bytes_received"]
        == count["history"]["worker_bytes_sent"]
    )
    assert sum(count["history"]["worker_bytes_sent"]) == 20 * 8
    # SGD(0.01) on gradient -1: each commit moves the center by exactly 0.01.
    np.testing.assert_allclose(count["center"], [0.2, 0.7], atol=1e-5)
    progress = [line for line in count["log"] if line.startswith("[agn] commits ")]
    assert [line.split()[2] for line in progress] == ["5/20", "10/20", "15/20", "20/20"]
    assert all("local steps" in line and "loss" in line for line in progress)


def test_checkpoint_number_is_the_commit_count(result):
    count = result["exact_count"]
    # Saved every 5 commits, the last 3 kept, each numbered by its commit count.
    assert count["checkpoints"] == ["ckpt-10", "ckpt-15", "ckpt-20"]
    assert count["checkpoint_commits"] == [10, 15, 20]
    saved = [line for line in count["log"] if "checkpoint saved" in line]
    assert saved[-1].endswith("ckpt-20 (commit 20)")
    # A new trainer on the directory restores exactly that many commits.
    resumed = count["resumed"]
    assert resumed["restored_commits"] == resumed["commits"] == 20
    assert resumed["local_steps"] == 60
    np.testing.assert_allclose(resumed["center"], count["center"], atol=1e-7)


def test_checkpoint_holds_the_center_side_only(result):
    # The 0.1.0 layout: model, AGN counters and the inner optimizer's slots
    # (on the parameter servers); worker-local state is never checkpointed.
    keys = result["exact_count"]["checkpoint_keys"]
    assert "optimizer/_commits/.ATTRIBUTES/VARIABLE_VALUE" in keys
    assert "optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE" in keys
    assert "optimizer/inner_optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE" in keys
    assert not [k for k in keys if "local" in k or "accumulator" in k]
    assert not [k for k in keys if k.startswith("optimizer/_center_optimizer")]


@pytest.mark.parametrize("variant", ["lars", "loss_scale_lars"])
def test_lars_and_loss_scaled_lars_inner(result, variant):
    run = result[variant]
    assert run["commits"] == 4
    assert sum(run["worker_local_steps"]) == 8
    assert run["center_optimizer"] == "LARS"  # commits are never loss-scaled
    assert run["agn_center_optimizer"] == "LARS"
    expected_local = "LossScaleOptimizer" if variant == "loss_scale_lars" else "LARS"
    assert run["local_optimizer"] == expected_local
    # Gradient -1 everywhere: both weights only go up.
    assert run["center"][0] > 0.0 and run["center"][1] > 0.5


def _outer_path(commits):
    # Outer SGD(0.5, momentum 0.9) on a pseudo-gradient of -0.03 per commit.
    momentum, moved = 0.0, 0.0
    for _ in range(commits):
        momentum = 0.9 * momentum + 0.5 * 0.03
        moved += momentum
    return [moved, 0.5 + moved]


def test_outer_optimizer_applies_every_commit_once_on_the_ps(result):
    run = result["outer"]
    assert run["commits"] == run["outer_iterations"] == 8
    assert sum(run["worker_local_steps"]) == 24
    assert run["center_optimizer"] == "SGD"
    np.testing.assert_allclose(run["center"], _outer_path(8), atol=1e-5)
    # The outer optimizer's slots live on the parameter server, and are
    # checkpointed with the center; worker-local state is not.
    assert run["outer_placement"] == ["/job:ps/replica:0/task:0/device:CPU:0"]
    keys = run["checkpoint_keys"]
    assert "optimizer/outer_optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE" in keys
    assert [k for k in keys if k.startswith("optimizer/outer_optimizer/_variables")]
    assert not [k for k in keys if "local" in k or "pulled" in k]


def test_outer_momentum_survives_a_restart_from_the_checkpoint(result):
    run = result["outer"]
    assert run["restored_commits"] == 8
    assert run["resumed_commits"] == 9
    # Commit 9 moves by the 9th momentum only if the 8th was restored
    # (a fresh momentum would move by 0.015).
    np.testing.assert_allclose(run["resumed_center"], _outer_path(9), atol=1e-5)


def test_only_lost_connections_to_a_ps_count_as_ps_failures():
    import tensorflow as tf

    from tf_lars.distribute.trainer import _failed_ps_task

    cluster = {"ps": ["localhost:4001", "localhost:4002"], "worker": ["localhost:4003"]}
    lost = tf.errors.UnavailableError(
        None, None, "failed to connect ... from remote target /job:ps/replica:0/task:1"
    )
    assert _failed_ps_task(lost, cluster) == (
        "/job:ps/replica:0/task:1",
        "localhost:4002",
    )
    by_port = tf.errors.UnavailableError(
        None, None, "ipv4:127.0.0.1:4001: Connection refused"
    )
    assert _failed_ps_task(by_port, cluster) == (
        "/job:ps/replica:0/task:0",
        "localhost:4001",
    )
    # A compile error that mentions the ps device is not a lost server.
    compile_error = tf.errors.InvalidArgumentError(
        None, None, "unsupported op ... /job:ps/replica:0/task:0/device:CPU:0"
    )
    assert _failed_ps_task(compile_error, cluster) is None
    worker_lost = tf.errors.UnavailableError(None, None, "ipv4:127.0.0.1:4003: refused")
    assert _failed_ps_task(worker_lost, cluster) is None


def test_fit_arguments_are_validated(result):
    assert result["exact_count"]["fit_errors"] == [
        "`steps_per_worker` must be a positive multiple of `communication_period` "
        "(3). Received: steps_per_worker=31",
        "`rounds` must be an int >= 1. Received: rounds=0",
        "Pass exactly one of `steps_per_worker` and `rounds`. Received: "
        "steps_per_worker=None, rounds=None",
    ]


def test_trainer_needs_parameter_server_strategy_and_agn():
    import keras
    import tensorflow as tf

    import tf_lars
    from tf_lars.distribute import ParameterServerTrainer

    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    with pytest.raises(
        ValueError, match="`strategy` must be a `tf.distribute.Parameter"
    ):
        ParameterServerTrainer(
            model,
            "mse",
            tf_lars.AGN(keras.optimizers.SGD()),
            lambda ctx: None,
            tf.distribute.get_strategy(),
        )
