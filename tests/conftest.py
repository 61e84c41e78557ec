"""Shared test set-up: quiet TensorFlow logs, a fresh Keras state per test,
the command line's harness (`run_cli`, `one_line_error`) as fixtures, and a
marker per part of the project (`PARTS`: `pytest -m optimizers` runs the
optimizer tests alone)."""

import atexit
import importlib.metadata
import inspect
import os
import shutil
import signal
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# A run started in the background by a shell without job control (`cmd &`
# in a script) inherits SIGINT ignored, which `tf-lars` keeps
# (cli_hostile_test.py tests that), and the Ctrl-C tests would then send a
# SIGINT nothing receives. The suite takes Python's own handler instead;
# the processes it starts (pytest-xdist's workers among them) then begin
# with SIGINT's default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Every process of a run (pytest's, its xdist workers', and each one a test
# starts, which inherit the environment) keeps its temporary files in one
# folder that the run deletes at its end. TensorFlow's autograph writes a
# module there per converted function and deletes it at exit, which a
# process ended by a signal or by `os._exit` (the cluster scripts) never
# reaches. pytest's own folders (`tmp_path`) stay where they were.
if "TF_LARS_TEST_TMPDIR" not in os.environ:
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    os.environ["TF_LARS_TEST_TMPDIR"] = tempfile.mkdtemp(prefix="tf_lars_tests_")
    os.environ["TMPDIR"] = os.environ["TF_LARS_TEST_TMPDIR"]
    tempfile.tempdir = None
    atexit.register(shutil.rmtree, os.environ["TMPDIR"], ignore_errors=True)

# XLA's compiled programs are kept between runs, in TensorFlow's persistent
# cache: keyed by the program (not the function's name), so a step compiled
# once, by this run or an earlier one, in a test or in a process a test
# starts (the environment is inherited), is read back instead of compiled
# again. It lives in pytest's cache folder (git-ignored): `pytest
# --cache-clear` or deleting `.pytest_cache/` starts cold, and
# `TF_LARS_TEST_XLA_CACHE=0` runs without it (docs/guides/development.md).
# One folder per TensorFlow release: an entry is keyed by its program, not by
# the compiler that wrote it.
try:
    _TENSORFLOW = importlib.metadata.version("tensorflow")
except importlib.metadata.PackageNotFoundError:
    _TENSORFLOW = None
XLA_CACHE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    ".pytest_cache",
    "d",
    "xla",
    f"tensorflow-{_TENSORFLOW}",
)
_XLA_FLAGS = os.environ.get("TF_XLA_FLAGS", "")
_XLA_CACHE_FLAG = f"--tf_xla_persistent_cache_directory={XLA_CACHE}"
#: Whether this run keeps its programs in `XLA_CACHE`: not without a
#: `tensorflow` distribution (a nightly's is `tf-nightly`), not when turned
#: off, and not where `TF_XLA_FLAGS` names a cache of its own (a pytest-xdist
#: worker inherits this one's flag from the controller).
XLA_CACHE_ON = (
    _TENSORFLOW is not None
    and os.environ.get("TF_LARS_TEST_XLA_CACHE", "1") != "0"
    and (
        "tf_xla_persistent_cache_directory" not in _XLA_FLAGS
        or _XLA_CACHE_FLAG in _XLA_FLAGS.split()
    )
)
if XLA_CACHE_ON and _XLA_CACHE_FLAG not in _XLA_FLAGS.split():
    os.makedirs(XLA_CACHE, exist_ok=True)
    os.environ["TF_XLA_FLAGS"] = f"{_XLA_FLAGS} {_XLA_CACHE_FLAG}".strip()

# Generated data sets (mnist1d) are kept beside it, not in the user's cache
# (tf_lars/cli/data.py, `cache_folder`): generated once per run folder of
# pytest, read back by every test and process after.
os.environ.setdefault(
    "TF_LARS_CACHE",
    os.path.join(os.path.dirname(os.path.dirname(XLA_CACHE)), "tf_lars"),
)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# Keras's state is reset before every test. `clear_session()`'s default also
# runs a full `gc.collect()`, which is slow once TensorFlow is loaded (a
# fifth of the optimizer tests' time, measured in the closing note of this
# change) and resets nothing Keras keeps; Python's own collector still runs.
_CLEAR = {"free_memory": False}
if "free_memory" not in inspect.signature(keras.backend.clear_session).parameters:
    _CLEAR = {}


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    keras.backend.clear_session(**_CLEAR)
    keras.utils.set_random_seed(1234)
    np.random.seed(1234)
    yield


@pytest.fixture
def run_cli(capsys):
    """`run_cli(*argv)`: `tf-lars ARGV` in this process, as `(code, out, err)`."""
    from tf_lars.cli.main import main

    def run(*argv):
        code = main(list(argv))
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


def _one_line_error(code, err, command="train"):
    """The one error line of a refused `tf-lars COMMAND`, checked.

    Exit status 2, no traceback, and stderr exactly one line that starts
    with `tf-lars COMMAND: error: `; returns that line.
    """
    assert code == 2, err
    assert "Traceback" not in err, err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    line = err.rstrip("\n")
    assert line.startswith(f"tf-lars {command}: error: "), err
    return line


@pytest.fixture
def one_line_error():
    """`one_line_error(code, err, command="train")`: the checked error line."""
    return _one_line_error


#: Every test file, by the part of the project it tests: the optimizers
#: (`tf_lars/*.py`, on any backend), the distribution tooling
#: (`tf_lars/distribute/`, AGN on parameter servers), the command line
#: (`tf_lars/cli/`), and the project itself (docs, build, benchmarks,
#: packaging). Each test gets its file's part as a marker.
PARTS = {
    "optimizers": [
        "accumulation",
        "backends_imports",
        "backends_loss_scale",
        "backends_rules",
        "backends",
        "callbacks",
        "compile_scale",
        "contract",
        "diloco",
        "internals",
        "lamb",
        "lars",
        "loss_scale",
        "noise_scale",
        "optimizer_hostile",
        "saved_across_versions",
        "saved_v0_1_0",
        "schedules",
        "step_labels",
        "trust_ratio",
    ],
    "distribute": [
        "agn_outer",
        "agn",
        "distribute_diloco",
        "distribute_fault",
        "distribute_hostile",
        "distribute_launch_sync",
        "distribute_launch",
        "distribute_multi_worker",
        "distribute_preempt",
        "distribute_ps",
        "distribute_tf_config",
        "examples_tfjob",
    ],
    "cli": [
        "cli_distribute",
        "cli_docs",
        "cli_hostile",
        "cli_lowcomm",
        "cli_plots",
        "cli_safety",
        "cli_study",
        "cli",
    ],
    "project": [
        "bench",
        "build",
        "docs_examples",
        "docs_stale",
        "docs",
        "docstrings",
        "examples",
        "init",
        "no_tensorflow",
        "public_api",
    ],
}
_PART_OF = {f"{name}_test.py": part for part, names in PARTS.items() for name in names}

#: The second tier (`python -m pytest -q -m distributed`, which `.ci/run`
#: runs too): every test that starts a process running TensorFlow (the
#: multi-process fault and equality scenarios, and the runs of scripts,
#: examples, documentation blocks and the command line in fresh
#: interpreters), less one smoke test per distributed feature. The README's
#: command (`-m "not distributed"` in pyproject.toml's addopts) runs the rest:
#: what runs in pytest's own processes, the processes that end before
#: TensorFlow is imported (a fraction of a second each), and the smoke tests.
#: Whole files, less what is named: the smoke tests (parameter servers:
#: distribute_ps_test, one cluster for the file; `model.fit` on
#: MultiWorkerMirroredStrategy and synchronous DiLoCo through the launcher;
#: the launcher's job restart; no process left behind a killed run) and the
#: tests that start no TensorFlow process. A name without parameters names
#: every parameter of the test.
SECOND_TIER = {
    "cli_distribute_test.py": {
        "test_two_workers_through_the_launcher_equal_one_process",
        "test_two_workers_train_with_diloco_through_the_launcher[float32]",
        "test_no_strategy_records_one_replica",
        "test_fit_takes_the_epoch_orders_of_make_dataset",
        "test_global_batch_size",
        "test_global_batch_size_errors",
        "test_describe_batches_names_the_dropped_examples",
        "test_evaluation_batch_size",
        "test_evaluation_needs_an_example_per_replica",
        "test_bad_distribute_config",
        "test_logical_cpus_once_devices_are_initialized",
        "test_an_agreed_signal_takes_one_collective_more_whose_loss_is_ignored",
        "test_bad_tf_config_is_one_line",
        "test_a_period_longer_than_an_epoch_is_refused",
        "test_a_diloco_round_longer_than_the_run_is_refused",
        "test_a_lost_parameter_server_is_one_line_status_3_and_a_note",
        "test_a_resumed_runs_trust_ratios_hold_the_earlier_epochs",
    },
    "distribute_diloco_test.py": {
        "test_one_worker_fit_and_backup_resume_in_one_process",
        "test_an_agreed_refusal_survives_a_peer_that_ends_after_it",
        "test_exchange_bytes_counts_the_collective_of_each_compression",
        "test_exchange_bytes_rounds_the_all_reduce_and_sums_one_per_dtype",
        "test_bad_arguments_are_refused_naming_them",
    },
    "distribute_fault_test.py": {
        "test_unreachable_parameter_server_is_found_by_its_port",
    },
    "distribute_hostile_test.py": {
        "test_a_killed_test_run_leaves_no_launcher_or_task_behind",
        "test_agn_period_beyond_the_int64_step_counter_is_refused",
        "test_agn_largest_period_takes_a_step_without_committing",
        "test_backup_of_a_later_epoch_than_fit_runs_is_refused_and_kept",
        "test_backup_of_another_learning_rate_is_refused",
        "test_backup_of_another_optimizer_class_is_refused",
        "test_backup_with_another_optimizer_variable_count_is_refused",
        "test_matching_backup_resumes_with_its_step_count_and_learning_rate",
        "test_end_of_fit_deletes_the_backups_and_keeps_other_files",
    },
    "distribute_launch_sync_test.py": {
        "test_killed_worker_restarts_the_whole_job_on_the_same_addresses",
        "test_the_task_cap_counts_every_task_started_here",
        "test_tasks_starts_only_the_named_worker",
    },
    "distribute_launch_test.py": {
        "test_tee_copies_every_byte_to_the_log_and_each_line_to_the_terminal",
        "test_log_tail_is_the_last_lines_of_the_latest_run",
        "test_launcher_runs_a_script_path_or_a_module",
        "test_a_launcher_made_cluster_names_free_ports_on_its_host",
        "test_a_log_that_cannot_be_opened_is_a_usage_error_leaving_nothing",
    },
    "distribute_multi_worker_test.py": set(),
    "distribute_preempt_test.py": {
        "test_one_process_resume_equals_uninterrupted",
        "test_newest_complete_backup_is_loaded_and_a_cut_off_write_ignored",
        "test_a_fit_without_backup_starts_at_0_after_a_resumed_fit_raised",
        "test_keras_save_freq_int_repeats_the_batches_of_the_interrupted_epoch",
        "test_broadcast_bits_round_trip_exactly",
        "test_unsynchronized_batch_norm_layers_are_found_in_nested_models",
        "test_arguments_are_checked",
    },
    "examples_test.py": set(),
    "examples_tfjob_test.py": {
        "test_manifest_is_a_config_map_a_claim_and_a_kubeflow_v1_tfjob",
        "test_only_worker_replicas_at_least_two_restarted_by_exit_code",
        "test_container_is_named_tensorflow_with_the_tfjob_port",
        "test_every_pod_gets_a_tf_config_the_sync_mode_accepts",
        "test_worker_zero_is_the_only_chief",
        "test_a_ps_replica_makes_every_synchronous_parse_fail",
        "test_one_replica_gets_no_tf_config_which_multi_worker_refuses",
        "test_command_runs_the_wrapper_on_the_mounted_config",
        "test_the_config_is_one_tf_lars_train_accepts",
        "test_exit_statuses_follow_the_operator_rule_and_the_launcher",
    },
}
#: ... and single tests of the other files (every parameter of each).
SECOND_TIER_TESTS = {
    "backends_imports_test.py": {"test_tensorflow_loads_only_where_keras_runs_on_it"},
    "bench_test.py": {"test_profile_splits_trace_from_compile_and_counts_kernels"},
    "cli_hostile_test.py": {
        "test_two_runs_started_together_with_one_name",
        "test_a_full_disk_is_one_line_and_leaves_no_partial_file",
        "test_a_study_storage_that_cannot_be_written_is_one_line",
    },
    "cli_lowcomm_test.py": {
        "test_the_command_tunes_reruns_and_writes_the_report",
        "test_ctrl_c_keeps_the_finished_trials_and_the_run_resumes",
    },
    "cli_study_test.py": {
        "test_two_processes_share_one_study",
        "test_ctrl_c_keeps_finished_trials_and_a_rerun_resumes",
    },
    "cli_safety_test.py": {
        "test_ctrl_c_in_train_keeps_the_config_and_history",
    },
    "cli_test.py": {
        "test_console_script_train_writes_no_tensorflow_log_lines",
        "test_tf_log_leaves_tensorflow_logging_on",
    },
    "docs_examples_test.py": {
        "test_block_runs_as_pasted",
        "test_the_training_example_learns",
        "test_the_monitor_example_learns",
    },
    "distribute_tf_config_test.py": {"test_entry_point_fails_before_any_work"},
    "init_test.py": {
        "test_core_imports_without_the_command_line_extras",
        "test_every_process_defers_tensorflow_until_asked",
        "test_a_saved_file_loads_in_a_process_that_only_imported_tf_lars",
    },
    "internals_test.py": {"test_import_tf_lars_loads_no_private_module"},
    "lars_test.py": {"test_mirrored_strategy_uses_all_reduced_gradient"},
    "loss_scale_test.py": {"test_mirrored_strategy_replicas_agree"},
    "noise_scale_test.py": {"test_mirrored_strategy_measures_the_replicas_batches"},
    "no_tensorflow_test.py": {
        "test_no_tensorflow_script_refuses_an_environment_with_tensorflow",
    },
    "optimizer_hostile_test.py": {"test_loading_a_saved_model_needs_import_tf_lars"},
}


def pytest_collection_modifyitems(config, items):
    """Marks each test with its file's part, and the second tier's with
    `distributed`; a file in no part is an error."""
    for item in items:
        part = _PART_OF.get(item.path.name)
        if part is None:
            raise pytest.UsageError(
                f"{item.path.name} is in no part of tests/conftest.py's PARTS: "
                "add it to the part it tests"
            )
        item.add_marker(getattr(pytest.mark, part))
        first = SECOND_TIER.get(item.path.name)
        if (first is not None and not {item.name, item.originalname} & first) or (
            item.originalname in SECOND_TIER_TESTS.get(item.path.name, ())
        ):
            item.add_marker(pytest.mark.distributed)
    # A test whose `skipif` holds here is for another backend or setup: it is
    # not collected (it runs where it applies, such as .ci/run's JAX and
    # PyTorch legs), so no run reports a skipped test.
    here, elsewhere = [], []
    for item in items:
        holds = (m.args and m.args[0] is True for m in item.iter_markers("skipif"))
        (elsewhere if any(holds) else here).append(item)
    if elsewhere:
        config.hook.pytest_deselected(items=elsewhere)
        items[:] = here
