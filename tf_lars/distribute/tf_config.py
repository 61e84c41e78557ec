"""Parse and validate `TF_CONFIG` for parameter-server training.

This module imports neither TensorFlow nor Keras, so a malformed `TF_CONFIG`
is reported in a fraction of a second, before any process starts a gRPC server
or connects to a cluster.

A parameter-server cluster has exactly one `chief` (it runs the
`ClusterCoordinator` and the training loop), one or more `worker`s and one or
more `ps` (parameter-server) tasks:

```json
{"cluster": {"chief": ["host0:2222"],
             "worker": ["host1:2222", "host2:2222"],
             "ps": ["host3:2222"]},
 "task": {"type": "worker", "index": 1}}
```
"""

import dataclasses
import ipaddress
import json
import os
import socket

TASK_TYPES = ("chief", "worker", "ps")
"""Task types of a parameter-server cluster, in launch order of importance."""

_LOCAL_HOSTS = ("localhost", "ip6-localhost")
_LOOPBACK = "<loopback>"
# No valid TF_CONFIG number (a task index, an object key) is longer; int()
# refuses more than 4,300 digits with an error of its own.
_MAX_INT_DIGITS = 100


class TFConfigError(ValueError):
    """`TF_CONFIG` (or a cluster given on the command line) is unusable."""


@dataclasses.dataclass(frozen=True)
class TFConfig:
    """A validated `TF_CONFIG`.

    Attributes:
        cluster: dict mapping each task type to its list of `"host:port"`
            addresses.
        task_type: str, the type of this process's task.
        task_index: int, the index of this process's task within its type.
        rpc_layer: str, the RPC protocol (`"grpc"`).
    """

    cluster: dict
    task_type: str
    task_index: int
    rpc_layer: str = "grpc"
    mode: str = "ps"

    @property
    def address(self):
        """The `"host:port"` of this task."""
        return self.cluster[self.task_type][self.task_index]

    @property
    def task_name(self):
        """The task's device prefix, e.g. `/job:ps/replica:0/task:0`."""
        return f"/job:{self.task_type}/replica:0/task:{self.task_index}"

    @property
    def num_workers(self):
        return len(self.cluster["worker"])

    @property
    def num_ps(self):
        return len(self.cluster.get("ps", []))

    def to_json(self):
        """The `TF_CONFIG` string for this task."""
        return json.dumps(
            {
                "cluster": self.cluster,
                "task": {"type": self.task_type, "index": self.task_index},
                "rpc_layer": self.rpc_layer,
            }
        )

    def for_task(self, task_type, task_index):
        """The same cluster seen from another task (validated again)."""
        other = dataclasses.replace(self, task_type=task_type, task_index=task_index)
        return parse_tf_config(other.to_json(), mode=self.mode)


class _LongInteger(str):
    """A JSON integer of more than `_MAX_INT_DIGITS` digits, kept as its text."""

    def __repr__(self):
        return f"<an integer of {len(self.lstrip('-'))} digits>"


def _parse_int(text):
    return int(text) if len(text) <= _MAX_INT_DIGITS else _LongInteger(text)


def load_json(text):
    """`json.loads` that keeps over-long integers as text (see `_LongInteger`).

    Raises:
        TFConfigError: `text` is not JSON, or nests deeper than Python recurses.
    """
    try:
        return json.loads(text, parse_int=_parse_int)
    except (TypeError, ValueError, RecursionError) as error:
        reason = "nested too deeply" if isinstance(error, RecursionError) else error
        raise TFConfigError(f"not valid JSON ({reason})") from None


def _short(text, limit=300):
    text = str(text)
    return text if len(text) <= limit else text[:limit] + "..."


def split_address(address):
    """Splits `"host:port"` (IPv6 hosts in brackets) into `(host, port)`.

    Raises:
        TFConfigError: if the address has no host or no port in 1..65535
            (ASCII digits only: `int()` would also read "²" or "٢٢").
    """
    shown = _short(repr(address))
    if not isinstance(address, str) or isinstance(address, _LongInteger) or not address:
        raise TFConfigError(
            "Each cluster address must be a non-empty 'host:port' string. "
            f"Received: {shown}"
        )
    if address.startswith("["):
        host, sep, rest = address[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise TFConfigError(f"Address {shown} must look like '[ipv6]:port'.")
        port_text = rest[1:]
    else:
        host, sep, port_text = address.rpartition(":")
        if not sep:
            raise TFConfigError(
                f"Address {shown} must look like 'host:port' (no port given)."
            )
    if not host or any(c.isspace() for c in host):
        raise TFConfigError(f"Address {shown} has no valid host.")
    if not (
        port_text.isascii()
        and port_text.isdigit()
        and len(port_text) <= 5
        and 1 <= int(port_text) <= 65535
    ):
        raise TFConfigError(f"Address {shown} must end with a port in 1..65535.")
    return host, int(port_text)


def is_local_address(address):
    """Whether `"host:port"` names this machine's loopback interface."""
    return _socket_key(*split_address(address))[0] == _LOOPBACK


def _socket_key(host, port):
    # TensorFlow's server listens on every interface of its machine ([::]:port)
    # whatever host the address names, so on one machine two tasks with one
    # port collide: every loopback address (127.0.0.0/8, ::1, localhost) and
    # the unspecified ones (0.0.0.0, ::) name this machine. Other hosts are
    # compared by name, case-blind (no DNS lookup here).
    host = host.lower()
    return (
        _LOOPBACK if host in _LOCAL_HOSTS or _names_this_machine(host) else host,
        port,
    )


def _names_this_machine(host):
    """Whether an IP literal is a loopback or unspecified address."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        try:
            # The short IPv4 forms the resolver also reads ("127.1", "0").
            address = ipaddress.ip_address(socket.inet_aton(host))
        except OSError:
            return False
    mapped = getattr(address, "ipv4_mapped", None)
    address = mapped or address
    return address.is_loopback or address.is_unspecified


def _address_list(task_type, addresses):
    """A cluster entry as a non-empty list (TF also accepts {"0": "h:p"})."""
    if isinstance(addresses, dict):
        try:
            keys = sorted(addresses, key=int)
        except (TypeError, ValueError):
            raise TFConfigError(
                f"Cluster entry '{task_type}' given as an object must use "
                f"integer indices. Received: {_short(addresses)!r}"
            ) from None
        if [int(k) for k in keys] != list(range(len(keys))):
            raise TFConfigError(
                f"Cluster entry '{task_type}' must number its tasks 0..n-1. "
                f"Received indices: {keys}"
            )
        addresses = [addresses[k] for k in keys]
    if not isinstance(addresses, list) or not addresses:
        raise TFConfigError(
            f"Cluster entry '{task_type}' must be a non-empty list of "
            f"'host:port' strings. Received: {_short(addresses)!r}"
        )
    return list(addresses)


def _claim_sockets(seen, task_type, addresses):
    """Records each address's socket in `seen`; raises on one used twice."""
    for index, address in enumerate(addresses):
        key = _socket_key(*split_address(address))
        if key in seen:
            raise TFConfigError(
                f"Address {address!r} is used by both {seen[key]} and "
                f"{task_type}:{index}."
            )
        seen[key] = f"{task_type}:{index}"


def validate_cluster(cluster, mode="ps"):
    """Checks a cluster dict and returns a normalized copy.

    Args:
        cluster: dict from task type to addresses.
        mode: "ps" (parameter servers: one chief, workers, ps) or "sync"
            (`MultiWorkerMirroredStrategy`: workers, at most one chief, no
            ps). Defaults to "ps".

    Raises:
        TFConfigError: on an unknown task type, a missing chief, worker or ps,
            more than one chief, a malformed or duplicated address.
    """
    if not isinstance(cluster, dict) or not cluster:
        raise TFConfigError(
            "`cluster` must be a non-empty object mapping task types to lists "
            f"of 'host:port' addresses. Received: cluster={_short(cluster)!r}"
        )
    if mode not in ("ps", "sync"):
        raise ValueError(f"`mode` must be 'ps' or 'sync'. Received: mode={mode!r}")
    if mode == "sync" and "ps" in cluster:
        raise TFConfigError(
            "The cluster has 'ps' tasks, but synchronous multi-worker training "
            "(MultiWorkerMirroredStrategy) uses only 'worker' tasks (and at "
            "most one 'chief'); remove 'ps' or use parameter-server training."
        )
    unknown = sorted(set(cluster) - set(TASK_TYPES))
    if unknown:
        raise TFConfigError(
            f"Unknown task type(s) {unknown} in the cluster: parameter-server "
            f"training uses only {list(TASK_TYPES)}."
        )
    normalized = {}
    seen = {}
    for task_type in TASK_TYPES:
        addresses = cluster.get(task_type)
        if addresses is None and mode == "sync" and task_type != "worker":
            continue
        if addresses is None:
            raise TFConfigError(
                f"The cluster has no '{task_type}' task; parameter-server training "
                "needs one 'chief', at least one 'worker' and at least one 'ps'."
            )
        normalized[task_type] = _address_list(task_type, addresses)
        _claim_sockets(seen, task_type, normalized[task_type])
    chiefs = len(normalized.get("chief", []))
    if mode == "sync" and chiefs > 1:
        raise TFConfigError(
            f"The cluster may have at most one 'chief'. Received {chiefs}."
        )
    if mode == "ps" and chiefs != 1:
        raise TFConfigError(
            "The cluster must have exactly one 'chief' (it runs the coordinator). "
            f"Received {chiefs}."
        )
    return normalized


def parse_tf_config(text=None, environ=None, mode="ps"):
    """Parses and validates a `TF_CONFIG` JSON string.

    Args:
        text: str or None, the JSON; `None` reads `environ["TF_CONFIG"]`.
            Defaults to None.
        environ: mapping or None, the environment to read; `None` is
            `os.environ`. Defaults to None.
        mode: "ps" (parameter-server training) or "sync"
            (`MultiWorkerMirroredStrategy`: workers only, no `ps`). Defaults
            to "ps".

    Returns:
        A `TFConfig`.

    Raises:
        TFConfigError: when `TF_CONFIG` is missing, is not JSON, has no
            `cluster` or `task`, names a task type that does not exist, or an
            index that is not a JSON int (the string "0" too) or out of range.
    """
    config, text = _read_json(text, environ)
    cluster = validate_cluster(config["cluster"], mode)
    task_type, task_index = _task_of(config.get("task"), cluster)
    rpc_layer = config.get("rpc_layer", "grpc") or "grpc"
    if rpc_layer != "grpc":
        raise TFConfigError(
            f"`rpc_layer` must be 'grpc'. Received: rpc_layer={rpc_layer!r}"
        )
    return TFConfig(cluster, task_type, task_index, rpc_layer, mode)


def _read_json(text, environ):
    """`(object, text)` of a `TF_CONFIG` with a cluster (`environ`'s if None)."""
    if text is None:
        environ = os.environ if environ is None else environ
        text = environ.get("TF_CONFIG")
        if not text:
            raise TFConfigError(
                "TF_CONFIG is not set. Set it to the cluster description "
                '(e.g. {"cluster": {"chief": [...], "worker": [...], "ps": [...]}, '
                '"task": {"type": "worker", "index": 0}}) or start the tasks '
                "with `python -m tf_lars.distribute.launch`."
            )
    try:
        config = load_json(text)
    except TFConfigError as error:
        raise TFConfigError(
            f"TF_CONFIG is {error}. Received: TF_CONFIG={_short(text)!r}"
        ) from None
    if not isinstance(config, dict):
        raise TFConfigError(
            f"TF_CONFIG must be a JSON object. Received: TF_CONFIG={_short(text)!r}"
        )
    if "cluster" not in config:
        raise TFConfigError(
            f"TF_CONFIG has no 'cluster'. Received: TF_CONFIG={_short(text)!r}"
        )
    return config, text


def _task_of(task, cluster):
    """`(task_type, task_index)` of TF_CONFIG's `task`, checked against `cluster`."""
    if not isinstance(task, dict) or "type" not in task:
        raise TFConfigError(
            "TF_CONFIG must have a 'task' object with a 'type' and an 'index'. "
            f"Received: task={_short(task)!r}"
        )
    task_type = task["type"]
    if not isinstance(task_type, str):
        raise TFConfigError(
            f"`task.type` must be a string, one of {sorted(cluster)}. "
            f"Received: type={_short(repr(task_type))}"
        )
    if task_type not in cluster:
        raise TFConfigError(
            f"TF_CONFIG names task type {task_type!r}, which does not exist in "
            f"the cluster (task types: {sorted(cluster)})."
        )
    if "index" not in task:
        raise TFConfigError(
            "TF_CONFIG's 'task' must have an 'index' (the task's position in "
            f"its list). Received: task={_short(task)!r}"
        )
    # Only a JSON int is an index: a string such as "0" is a malformed
    # TF_CONFIG (a quoting mistake upstream), refused rather than guessed at.
    task_index = task["index"]
    if (
        isinstance(task_index, bool)
        or not isinstance(task_index, int)
        or not 0 <= task_index < len(cluster[task_type])
    ):
        raise TFConfigError(
            f"`task.index` must be an int in [0, {len(cluster[task_type])}) for "
            f"task type {task_type!r}. Received: index={task_index!r}"
        )
    return task_type, task_index
