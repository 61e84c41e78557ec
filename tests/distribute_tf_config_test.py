"""TF_CONFIG validation: clear errors before any task starts."""

import json
import os
import subprocess
import sys
import time

import pytest

from tests.distribute_launch_helpers import EXAMPLE, REPO, launcher_env
from tf_lars.distribute import tf_config as tf_config_lib
from tf_lars.distribute._process import die_with_parent
from tf_lars.distribute.tf_config import TFConfigError, parse_tf_config

CLUSTER = {
    "chief": ["localhost:2000"],
    "worker": ["localhost:2001", "localhost:2002"],
    "ps": ["localhost:2003"],
}


def _config(task_type="worker", index=1, cluster=None, **extra):
    return json.dumps(
        {
            "cluster": cluster or CLUSTER,
            "task": {"type": task_type, "index": index},
            **extra,
        }
    )


def test_parses_a_valid_config():
    config = parse_tf_config(_config())
    assert config.task_type == "worker"
    assert config.task_index == 1
    assert config.address == "localhost:2002"
    assert config.task_name == "/job:worker/replica:0/task:1"
    assert (config.num_workers, config.num_ps) == (2, 1)
    assert json.loads(config.to_json())["task"] == {"type": "worker", "index": 1}
    assert config.for_task("ps", 0).address == "localhost:2003"


def test_reads_the_environment_and_accepts_indexed_objects():
    cluster = dict(CLUSTER, worker={"1": "localhost:2002", "0": "localhost:2001"})
    config = parse_tf_config(environ={"TF_CONFIG": _config("ps", 0, cluster)})
    assert config.cluster["worker"] == ["localhost:2001", "localhost:2002"]
    assert config.address == "localhost:2003"


@pytest.mark.parametrize(
    "text, message",
    [
        (None, "TF_CONFIG is not set"),
        ("{cluster: }", "TF_CONFIG is not valid JSON"),
        ("[1, 2]", "TF_CONFIG must be a JSON object"),
        (json.dumps({"task": {"type": "chief"}}), "TF_CONFIG has no 'cluster'"),
        (
            _config(cluster=dict(CLUSTER, master=["localhost:2004"])),
            r"Unknown task type\(s\) \['master'\] in the cluster",
        ),
        (_config("evaluator", 0), "names task type 'evaluator', which does not exist"),
        (_config("worker", 2), r"`task.index` must be an int in \[0, 2\)"),
        (_config("worker", -1), r"`task.index` must be an int in \[0, 2\)"),
        (_config("worker", True), r"`task.index` must be an int"),
        (
            _config("worker", "0"),
            r"`task.index` must be an int in \[0, 2\) for task type 'worker'\. "
            r"Received: index='0'",
        ),
        (_config("worker", 0.0), r"Received: index=0\.0"),
        (json.dumps({"cluster": CLUSTER}), "must have a 'task' object"),
        (
            _config(cluster={k: v for k, v in CLUSTER.items() if k != "ps"}),
            "The cluster has no 'ps' task",
        ),
        (
            _config(cluster=dict(CLUSTER, chief=["localhost:2000", "localhost:2005"])),
            "exactly one 'chief'",
        ),
        (
            _config(cluster=dict(CLUSTER, ps=["localhost"])),
            "must look like 'host:port'",
        ),
        (_config(cluster=dict(CLUSTER, ps=["localhost:70000"])), "port in 1..65535"),
        (_config(cluster=dict(CLUSTER, ps=[])), "non-empty list"),
        (
            _config(cluster=dict(CLUSTER, ps=["localhost:2001"])),
            "used by both worker:0 and ps:0",
        ),
        (_config(rpc_layer="grpc+verbs"), "`rpc_layer` must be 'grpc'"),
    ],
)
def test_rejects_malformed_configs(text, message):
    with pytest.raises(TFConfigError, match=message):
        parse_tf_config(environ={} if text is None else {"TF_CONFIG": text})


def test_local_addresses():
    assert tf_config_lib.is_local_address("localhost:1")
    assert tf_config_lib.is_local_address("127.0.0.2:1")
    assert tf_config_lib.is_local_address("[::1]:1")
    assert not tf_config_lib.is_local_address("10.0.0.5:1")
    assert not tf_config_lib.is_local_address("example.com:1")


def _run(args, tf_config=None, timeout=120):
    env = launcher_env()
    env.pop("TF_CONFIG", None)
    if tf_config is not None:
        env["TF_CONFIG"] = tf_config
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=True,
        preexec_fn=die_with_parent,
    )
    return proc, time.monotonic() - start


@pytest.mark.parametrize(
    "tf_config, message",
    [
        ('{"cluster": ', "error: TF_CONFIG is not valid JSON"),
        (_config("master", 0), "error: TF_CONFIG names task type 'master'"),
        (_config("worker", "0"), "error: `task.index` must be an int in [0, 2)"),
    ],
)
def test_entry_point_fails_before_any_work(tf_config, message, tmp_path):
    result = tmp_path / "result.json"
    proc, _ = _run(
        [EXAMPLE, "--result-json", str(result)],
        tf_config,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    # Nothing ran: no server line, no training line, no result.
    assert "serving on" not in proc.stdout
    assert "[agn]" not in proc.stdout
    assert not result.exists()


def test_launcher_rejects_bad_cluster_before_starting_tasks(tmp_path):
    def launch(*args):
        launcher = ["-m", "tf_lars.distribute.launch", "--log-dir", str(tmp_path)]
        return _run([*launcher, *args, "--", EXAMPLE])[0]

    cluster = json.dumps(dict(CLUSTER, evaluator=["localhost:2009"]))
    proc = launch("--cluster", cluster)
    assert proc.returncode == 2
    assert "error: Unknown task type(s) ['evaluator']" in proc.stderr
    assert os.listdir(tmp_path) == []  # no task log, no cluster.json

    proc = launch("--cluster", json.dumps(CLUSTER), "--tasks", "worker:5")
    assert proc.returncode == 2
    assert (
        "`--tasks` names 'worker:5', which is not a task of the cluster" in proc.stderr
    )
    assert os.listdir(tmp_path) == []
