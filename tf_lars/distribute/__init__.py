"""AGN on `tf.distribute.ParameterServerStrategy`: cluster plumbing and training loop.

- `parse_tf_config` / `TFConfig` / `TFConfigError`: validate `TF_CONFIG`
  (no TensorFlow import, so errors come before any work).
- `serve`, `connect`, `in_process_cluster`: start tasks and the coordinator.
- `ParameterServerTrainer`, `ParameterServerFailure`: the AGN training loop.
- `ParameterServerAGN`: the worker side of a `tf_lars.AGN` (the trainer's).
- `enable_multi_worker_fit`, `multi_worker_strategy`, `is_chief`,
  `BackupAndRestore`: synchronous training on `MultiWorkerMirroredStrategy`
  (the last one resumes a restarted job exactly).
- `DiLoCoSync`, `DiLoCoBackup`, `synchronize`, `Traffic`: synchronous
  DiLoCo (`tf_lars.DiLoCo`) across MWMS workers, with `model.fit` or a
  custom loop, exact resumption and the bytes counted from the collective
  used (`exchange_bytes`, `all_reduce_bytes`, `all_gather_bytes`).
- `run_main(main)`: one line and exit status 2 for a bad `TF_CONFIG`, 3 for
  a lost parameter server.
- `python -m tf_lars.distribute.launch`: a local multi-process cluster that
  runs a training script (`-- examples/agn_digits.py ...`) or `-m module`.

Imports only downward: this package uses `tf_lars` (core); core never
imports it.

TensorFlow is imported lazily, on first use of a name that needs it. Without
it installed, importing this package raises one `ModuleNotFoundError` naming
the `tensorflow` extra; on another Keras backend, one `ImportError` naming it.
"""

from tf_lars import _require_tensorflow_backend

_require_tensorflow_backend("tf_lars.distribute")

from tf_lars.distribute.run import run_main  # noqa: E402, F401
from tf_lars.distribute.tf_config import (  # noqa: E402, F401
    TFConfig,
    TFConfigError,
    parse_tf_config,
)

_LAZY = {
    **dict.fromkeys(
        ("serve", "connect", "in_process_cluster", "pick_free_port"),
        "tf_lars.distribute.cluster",
    ),
    "ParameterServerAGN": "tf_lars.distribute.ps_agn",
    **dict.fromkeys(
        ("ParameterServerTrainer", "ParameterServerFailure"),
        "tf_lars.distribute.trainer",
    ),
    **dict.fromkeys(
        ("BackupAndRestore", "enable_multi_worker_fit", "multi_worker_strategy")
        + ("is_chief",),
        "tf_lars.distribute.multi_worker",
    ),
    **dict.fromkeys(
        ("DiLoCoBackup", "DiLoCoSync", "Traffic", "synchronize")
        + ("all_gather_bytes", "all_reduce_bytes", "exchange_bytes"),
        "tf_lars.distribute.diloco",
    ),
}

__all__ = sorted([*_LAZY, "TFConfig", "TFConfigError", "parse_tf_config", "run_main"])


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tf_lars.distribute' has no attribute {name!r}")
