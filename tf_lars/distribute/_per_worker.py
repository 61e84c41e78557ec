"""Worker-local variables for `ParameterServerStrategy`.

AGN keeps a local copy of the model, the gradient accumulators and the local
optimizer slots on each worker. TensorFlow 2.21 has the mechanism for that,
`tf.Variable(..., per_worker_variable=True)` (a private `PerWorkerVariable`),
but as shipped it is unusable for an optimizer: every access to its `handle`
inside a `tf.function` captures a *new* call-time placeholder, so automatic
control dependencies see unrelated resources and reorder reads and writes
(measured: two `assign_add`s followed by a read returned the initial value).

`WorkerLocalVariable` fixes two things. It captures the worker's handle under
a stable key, so every op in a traced function refers to one placeholder and
runs in program order. And inside `tf.cond` / `tf.while_loop` bodies (which
do not forward call-time captures; TF documents per-worker variables as
unreadable in `tf.cond` branches) it captures the handle in the enclosing
function and passes it into the branch as an ordinary captured tensor, so a
loss-scale optimizer's conditional update works on worker-local variables,
with or without XLA. Everything else (creation on each worker, re-creation
when a restarted worker comes back, `read_all`) is TensorFlow's own. The
variables are created outside `strategy.scope()`, so a Keras optimizer built
on them applies its updates locally on the worker without merge calls.

Caveats (TensorFlow's, unchanged): values are lost when a worker restarts
(the variable is re-created with its initial value), they are never
checkpointed, and they must not be created inside a `tf.function`.
"""

import contextlib
import itertools

import tensorflow as tf
from tensorflow.python.distribute import ps_values
from tensorflow.python.eager import context
from tensorflow.python.framework import ops
from tensorflow.python.ops import control_flow_v2_func_graphs as control_flow_graphs
from tensorflow.python.saved_model import save_context

_ids = itertools.count()
_CONTROL_FLOW_GRAPHS = (
    control_flow_graphs.CondBranchFuncGraph,
    control_flow_graphs.WhileBodyFuncGraph,
    control_flow_graphs.WhileCondFuncGraph,
)


class WorkerLocalVariable(ps_values.PerWorkerVariable):
    """A `PerWorkerVariable` whose handle is captured once per traced function."""

    def __init__(self, strategy, next_creator, **kwargs):
        super().__init__(strategy, next_creator, **kwargs)
        # Keras optimizers key their slots by `_unique_id`; PerWorkerVariable
        # leaves it None for every instance.
        self._unique_id = f"tf_lars_worker_local_{next(_ids)}"
        self._capture_key = ("tf_lars_worker_local", self._unique_id)

    @property
    def handle(self):
        if context.executing_eagerly() or save_context.in_save_context():
            return self._coordinator_instance.handle
        self._maybe_create_per_worker_vars()
        closure, spec = self.handle_call_time_value()
        graph = ops.get_default_graph()
        function_graph = graph
        while isinstance(function_graph, _CONTROL_FLOW_GRAPHS):
            function_graph = function_graph.outer_graph
        with function_graph.as_default():
            handle = function_graph.capture_call_time_value(
                closure, spec, key=self._capture_key
            )
        if function_graph is graph:
            return handle
        return graph.capture(handle)


@contextlib.contextmanager
def worker_local_scope(strategy):
    """Variables created in this scope are `WorkerLocalVariable`s.

    Args:
        strategy: the `tf.distribute.ParameterServerStrategy`; a
            `ClusterCoordinator` must already exist for it.
    """
    if getattr(strategy, "_cluster_coordinator", None) is None:
        raise ValueError(
            "Create `tf.distribute.coordinator.ClusterCoordinator(strategy)` "
            "before building worker-local variables."
        )

    def creator(next_creator, **kwargs):
        # Colocation with a parameter-server variable and the strategy's own
        # per-worker flag do not apply: the variable lives on every worker.
        kwargs.pop("colocate_with", None)
        kwargs.pop("per_worker_variable", None)
        return WorkerLocalVariable(strategy, next_creator, **kwargs)

    with tf.variable_creator_scope(creator):
        yield
