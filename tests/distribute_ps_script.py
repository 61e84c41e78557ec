"""AGN on an in-process ParameterServerStrategy cluster (2 workers, 1 ps).

Run by tests/distribute_ps_test.py in its own process (the servers cannot be
shut down): prints one JSON line `RESULT {...}` with what it measured, then
leaves with `os._exit`.
"""

import json
import os
import sys
import tempfile
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_lars  # noqa: E402
from tf_lars.distribute import cluster  # noqa: E402
from tf_lars.distribute import trainer as trainer_lib


class TwoWeights(keras.layers.Layer):
    """w0 + w1 for every example: with loss -mean(y_pred) both gradients are -1."""

    def build(self, input_shape):
        self.w0 = self.add_weight(
            shape=(), initializer=keras.initializers.Constant(0.0), name="w0"
        )
        self.w1 = self.add_weight(
            shape=(), initializer=keras.initializers.Constant(0.5), name="w1"
        )

    def call(self, x):
        return tf.zeros_like(x) + self.w0 + self.w1


def negative_mean(y_true, y_pred):
    del y_true
    return -tf.reduce_mean(y_pred)


def dataset_fn(input_context):
    del input_context
    return tf.data.Dataset.from_tensors((tf.ones([1, 1]), tf.zeros([1, 1])))


def center(model):
    return [float(v.numpy()) for v in model.trainable_variables]


def seed_reference(strategy, coordinator):
    """Period 1, Adam(0.1, 0, 0): the center moves 0.1 per commit."""
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), TwoWeights()])
        optimizer = tf_lars.AGN(
            keras.optimizers.Adam(0.1, beta_1=0.0, beta_2=0.0), communication_period=1
        )
    trainer = trainer_lib.ParameterServerTrainer(
        model,
        negative_mean,
        optimizer,
        dataset_fn,
        strategy,
        coordinator=coordinator,
        checkpoint_every=1,
        log=lambda line: None,
    )
    centers = [center(model)]
    for commits in range(1, 7):
        trainer.fit(rounds=commits)
        centers.append(center(model))
    apply_error = None
    try:
        optimizer.apply([tf.constant(1.0), tf.constant(1.0)])
    except ValueError as error:
        apply_error = str(error)
    return {
        "centers": centers,
        "commits": int(optimizer.commits.numpy()),
        "center_iterations": int(optimizer.center_optimizer.iterations.numpy()),
        "worker_local_steps": trainer.worker_local_steps(),
        "local_types": sorted(
            {type(v.value).__name__ for v in trainer.ps_agn.local_variables}
        ),
        "local_copies_per_worker": [
            [float(x) for x in v.value.read_all()]
            for v in trainer.ps_agn.local_variables
        ],
        "center_placement": sorted({v.value.device for v in model.trainable_variables}),
        "evaluate": trainer.evaluate(
            np.ones((4, 1), np.float32), np.zeros((4, 1), np.float32)
        ),
        "apply_error": apply_error,
    }


def two_weight_trainer(
    strategy, coordinator, period, checkpoint_dir, make_outer=None, **kwargs
):
    """`(model, optimizer, trainer)`: `TwoWeights` trained by AGN over SGD(0.01)
    (with `make_outer()` as its outer optimizer, if given)."""
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), TwoWeights()])
        optimizer = tf_lars.AGN(
            keras.optimizers.SGD(0.01),
            communication_period=period,
            outer_optimizer=make_outer() if make_outer else None,
        )
    trainer = trainer_lib.ParameterServerTrainer(
        model,
        negative_mean,
        optimizer,
        dataset_fn,
        strategy,
        coordinator=coordinator,
        checkpoint_dir=checkpoint_dir,
        **kwargs,
    )
    return model, optimizer, trainer


def exact_count(strategy, coordinator, period, steps_per_worker, checkpoint_dir):
    """K workers x N local steps at period P: K*N/P commits, none lost."""
    lines = []
    model, optimizer, trainer = two_weight_trainer(
        strategy,
        coordinator,
        period,
        checkpoint_dir,
        checkpoint_every=5,
        log=lines.append,
        status=lines.append,  # the "checkpoint saved" lines
    )
    errors = []
    for kwargs in ({"steps_per_worker": steps_per_worker + 1}, {"rounds": 0}, {}):
        try:
            trainer.fit(**kwargs)
        except ValueError as error:
            errors.append(str(error))
    history = trainer.fit(steps_per_worker=steps_per_worker)
    return {
        "history": {k: v for k, v in history.items() if k != "losses"},
        "commits": int(optimizer.commits.numpy()),
        "local_steps": int(optimizer.local_steps.numpy()),
        "center": center(model),
        "worker_local_steps": trainer.worker_local_steps(),
        "log": lines,
        "fit_errors": errors,
        "checkpoints": [os.path.basename(path) for path in trainer.manager.checkpoints],
        "checkpoint_commits": [
            trainer_lib.checkpoint_commits(path) for path in trainer.manager.checkpoints
        ],
        "checkpoint_keys": sorted(
            name
            for name, _ in tf.train.list_variables(trainer.manager.latest_checkpoint)
        ),
        "resumed": resume(strategy, coordinator, period, checkpoint_dir),
    }


def resume(strategy, coordinator, period, checkpoint_dir):
    """A new trainer on the same directory restores the latest checkpoint."""
    model, optimizer, trainer = two_weight_trainer(
        strategy, coordinator, period, checkpoint_dir, log=lambda line: None
    )
    return {
        "restored_commits": trainer.restored_commits,
        "commits": int(optimizer.commits.numpy()),
        "local_steps": int(optimizer.local_steps.numpy()),
        "center": center(model),
    }


def inner_variant(strategy, coordinator, make_inner):
    """A few rounds with another inner optimizer (LARS, loss-scaled LARS)."""
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), TwoWeights()])
        optimizer = tf_lars.AGN(make_inner(), communication_period=2)
    trainer = trainer_lib.ParameterServerTrainer(
        model,
        negative_mean,
        optimizer,
        dataset_fn,
        strategy,
        coordinator=coordinator,
        checkpoint_every=4,
        log=lambda line: None,
    )
    trainer.fit(rounds=4)
    return {
        "commits": int(optimizer.commits.numpy()),
        "center": center(model),
        "local_optimizer": type(trainer.ps_agn.local_optimizer).__name__,
        "center_optimizer": type(trainer.ps_agn.center_optimizer).__name__,
        "agn_center_optimizer": type(optimizer.center_optimizer).__name__,
        "worker_local_steps": trainer.worker_local_steps(),
    }


def outer_nesterov_free(strategy, coordinator, checkpoint_dir):
    """AGN with an outer SGD(0.5, momentum 0.9), inner SGD(0.01), period 3.

    Every local step moves a weight by +0.01, so every commit's
    pseudo-gradient is -0.03 whatever the staleness: the center's path is
    known exactly (momentum m_k = 0.9 m_{k-1} + 0.015) if every commit is
    applied once, and a resumed trainer continues it only if the outer
    momentum was restored.
    """

    def make():
        return two_weight_trainer(
            strategy,
            coordinator,
            3,
            checkpoint_dir,
            make_outer=lambda: keras.optimizers.SGD(0.5, momentum=0.9),
            checkpoint_every=4,
            log=lambda line: None,
        )

    model, optimizer, trainer = make()
    trainer.fit(rounds=8)
    first = {
        "commits": int(optimizer.commits.numpy()),
        "outer_iterations": int(optimizer.outer_optimizer.iterations.numpy()),
        "center": center(model),
        "worker_local_steps": trainer.worker_local_steps(),
        "center_optimizer": type(trainer.ps_agn.center_optimizer).__name__,
        "outer_placement": sorted(
            {v.value.device for v in optimizer.outer_optimizer.variables}
        ),
        "checkpoint_keys": sorted(
            name
            for name, _ in tf.train.list_variables(trainer.manager.latest_checkpoint)
        ),
    }
    model, optimizer, trainer = make()
    restored = trainer.restored_commits
    trainer.fit(rounds=9)
    return {
        **first,
        "restored_commits": restored,
        "resumed_center": center(model),
        "resumed_commits": int(optimizer.commits.numpy()),
    }


def main():
    strategy, coordinator = cluster.in_process_cluster(num_workers=2, num_ps=1)
    with (
        tempfile.TemporaryDirectory(prefix="tf_lars_ps_test_") as checkpoint_dir,
        tempfile.TemporaryDirectory(prefix="tf_lars_ps_outer_") as outer_dir,
    ):
        result = {
            "num_workers": 2,
            "seed_reference": seed_reference(strategy, coordinator),
            "exact_count": exact_count(
                strategy,
                coordinator,
                period=3,
                steps_per_worker=30,
                checkpoint_dir=checkpoint_dir,
            ),
            "lars": inner_variant(
                strategy,
                coordinator,
                lambda: tf_lars.LARS(learning_rate=0.1, momentum=0.9),
            ),
            "loss_scale_lars": inner_variant(
                strategy,
                coordinator,
                lambda: tf_lars.LossScaleOptimizer(
                    tf_lars.LARS(learning_rate=0.1, momentum=0.9), initial_scale=1024.0
                ),
            ),
            "outer": outer_nesterov_free(strategy, coordinator, outer_dir),
        }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    status = 0
    try:
        main()
    except BaseException:  # noqa: BLE001 - reported to the test, then exit
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
