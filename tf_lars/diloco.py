"""DiLoCo: local inner steps, an outer optimizer on the averaged pseudo-gradient.

`DiLoCo` is one worker's side of synchronous DiLoCo (Douillard et al. 2023):
the inner optimizer steps the worker's own variables, and every
`sync_every` inner steps the workers average their pseudo-gradients
`theta - theta_worker` and each applies the same outer step to its copy of
the global parameters `theta`. Everything is `keras.ops`, so a custom loop
calls it on any Keras backend. `simulate_sync` runs the exchange for workers
simulated in one process; the communication options (bfloat16, 8- or 4-bit
absmax quantization, error feedback) are the pure functions below, and
streaming (fragments synced at staggered steps) is `streaming_schedule`.
The rules are stated in docs/guides/low-communication.md.
"""

import functools
import sys

import keras
import numpy as np
from keras import ops

from tf_lars import _internals
from tf_lars._validation import (
    check_bool,
    check_choice,
    check_config_keys,
    check_inner_learning_rate,
    check_int,
    check_optimizer,
    check_outer_optimizer,
    is_int,
)
from tf_lars._wrapper import (
    BASE_ARGUMENT_DEFAULTS,
    load_variables,
    refuse_outer_loss_scale,
    require_built,
    track_attribute_variables,
    wrapped_chain,
)
from tf_lars.backend import eagerly
from tf_lars.schedules import check_step_count

__all__ = [
    "DiLoCo",
    "decode",
    "dequantize",
    "encode",
    "error_feedback_step",
    "fragment_offsets",
    "payload_bytes",
    "quantize",
    "round_trip",
    "simulate_sync",
    "streaming_fragments",
    "streaming_schedule",
]

#: What `compression` accepts: None sends the pseudo-gradient as it is.
COMPRESSIONS = (None, "bfloat16", "int8", "int4")
#: Absmax scaling over the whole tensor or over each row (axis 0).
GRANULARITIES = ("tensor", "row")
#: Who takes the outer step: `apply` itself, as one worker (M = 1), or a
#: driver that averages over M workers (`simulate_sync`,
#: `tf_lars.distribute.synchronize`, `tf_lars.distribute.DiLoCoSync`).
EXCHANGES = ("local", "external")
_BITS = {"bfloat16": 16, "int8": 8, "int4": 4}


# --- Compression: what a pseudo-gradient looks like after the exchange. ---


def quantize(x, bits, granularity="tensor"):
    """Symmetric absmax quantization to `bits`-bit integer codes.

    `scale = max|x| * (1 / (2**(bits-1) - 1))` (the reciprocal rounded to
    `x`'s dtype) over the whole tensor
    (`granularity="tensor"`) or over each row, the entries sharing an index
    on axis 0 (`"row"`; a tensor of rank < 2 has one scale either way);
    `codes = round(x / scale)`, rounded to nearest (ties to even), in
    `[-(2**(bits-1) - 1), 2**(bits-1) - 1]`. A zero tensor (or row) gets
    scale 0 and codes 0.

    Args:
        x: tensor. A pseudo-gradient.
        bits: int, 8 or 4.
        granularity: str, `"tensor"` or `"row"`. Defaults to `"tensor"`.

    Returns:
        `(codes, scale)`: int8 codes of `x`'s shape, and the scale in `x`'s
        dtype, of shape `()` or `(rows, 1, ...)`.
    """
    # A tensor: a NumPy `x / scale` with a CUDA tensor is a TypeError (torch).
    x = ops.convert_to_tensor(x)
    dtype = keras.backend.standardize_dtype(x.dtype)
    levels = 2 ** (bits - 1) - 1
    if granularity == "row" and len(x.shape) >= 2:
        absmax = ops.max(ops.abs(x), axis=tuple(range(1, len(x.shape))), keepdims=True)
    else:
        absmax = ops.max(ops.abs(x))
    # A product, not `absmax / levels`: XLA's vectorized division on CPU can
    # be an ulp off, and the scale must be the same on every backend.
    scale = absmax * ops.convert_to_tensor(np.asarray(1 / levels, dtype))
    levels = ops.convert_to_tensor(np.asarray(levels, dtype))
    safe_scale = ops.where(scale > 0, scale, ops.ones_like(scale))
    codes = ops.clip(ops.round(x / safe_scale), -levels, levels)
    return ops.cast(codes, "int8"), scale


def dequantize(codes, scale, dtype):
    """The values `codes * scale` that `quantize` encoded, in `dtype`."""
    return ops.cast(codes, dtype) * ops.cast(scale, dtype)


def encode(x, compression, granularity="tensor"):
    """The payload a worker sends for `x`: a tuple of tensors.

    `None`: `(x,)`; `"bfloat16"`: `(x rounded to bfloat16,)` (to nearest,
    ties to even; float64 goes through float32 first); `"int8"`/`"int4"`:
    `quantize(x, bits, granularity)`, `(codes, scale)`.
    """
    x = ops.convert_to_tensor(x)
    if compression is None:
        return (x,)
    if compression == "bfloat16":
        return (ops.cast(ops.cast(x, "float32"), "bfloat16"),)
    return quantize(x, _BITS[compression], granularity)


def decode(payload, dtype):
    """The values a payload of `encode` stands for, in `dtype`."""
    if len(payload) == 2:
        return dequantize(*payload, dtype)
    return ops.cast(payload[0], dtype)


def round_trip(x, compression, granularity="tensor"):
    """`x` as the other workers receive it under `compression`:
    `decode(encode(x, compression, granularity))`, in `x`'s dtype."""
    x = ops.convert_to_tensor(x)
    return decode(encode(x, compression, granularity), x.dtype)


def error_feedback_step(pseudo_gradient, error, compression, granularity="tensor"):
    """One exchange with error feedback: `(sent, new_error)`.

    `sent = round_trip(pseudo_gradient + error)` and
    `new_error = pseudo_gradient + error - sent`: what the compression lost
    in round `r` is added to the pseudo-gradient of round `r + 1`.
    """
    corrected = ops.convert_to_tensor(pseudo_gradient) + ops.cast(
        error, pseudo_gradient.dtype
    )
    sent = round_trip(corrected, compression, granularity)
    return sent, corrected - sent


def payload_bytes(shape, compression=None, granularity="tensor", dtype="float32"):
    """Bytes one worker sends for a pseudo-gradient of `shape`.

    Entries at 32 bits (64 for float64) uncompressed, 16 in bfloat16, 8 or
    4 quantized (4-bit codes packed two to a byte, rounded up), plus one
    float32 scale per tensor or per row.
    """
    count = 1
    for dimension in shape:
        count *= int(dimension)
    if compression is None:
        return count * (8 if dtype == "float64" else 4)
    bits = _BITS[compression]
    if compression == "bfloat16":
        return count * 2
    rows = int(shape[0]) if granularity == "row" and len(shape) >= 2 else 1
    return (count * bits + 7) // 8 + 4 * rows


# --- Streaming: fragments of the variables synced at staggered steps. ---


def streaming_fragments(num_variables, num_fragments):
    """The variable indices of each fragment, strided: fragment `f` holds
    indices `f, f + F, f + 2F, ...` (Streaming DiLoCo's strided pattern,
    over the variables in model order)."""
    return [list(range(f, num_variables, num_fragments)) for f in range(num_fragments)]


def fragment_offsets(num_fragments, sync_every):
    """Fragment `f`'s offset `floor(f * H / F)`: the fragments spread evenly
    over the `H = sync_every` inner steps of a round."""
    return [(f * sync_every) // num_fragments for f in range(num_fragments)]


def streaming_schedule(step, num_fragments, sync_every):
    """The fragments due at inner step `step` (the count of inner steps taken).

    Fragment `f` syncs at every `step >= 1` where
    `(step - offset_f) % sync_every == 0`; with one fragment, at every
    multiple of `sync_every` (plain DiLoCo).
    """
    offsets = fragment_offsets(num_fragments, sync_every)
    return [
        f
        for f, offset in enumerate(offsets)
        if step >= 1 and step >= offset and (step - offset) % sync_every == 0
    ]


# --- The worker. ---


def _check_arguments(inner_optimizer, outer_optimizer, kwargs):
    """Refuses the optimizers DiLoCo cannot hold, and Keras base arguments
    (they belong on the inner optimizer; a config written by Keras carries
    them at their defaults)."""
    for key, value in kwargs.items():
        if key not in BASE_ARGUMENT_DEFAULTS:  # a misspelt argument, say
            raise ValueError(
                f"`{key}` is not an argument of DiLoCo. Received: {key}={value!r}"
            )
        if value != BASE_ARGUMENT_DEFAULTS[key]:
            raise ValueError(
                f"Argument `{key}` is not supported by DiLoCo; set it on "
                f"`inner_optimizer`. Received: {key}={value!r}"
            )
    check_optimizer("inner_optimizer", inner_optimizer)
    check_outer_optimizer(outer_optimizer, inner_optimizer)
    for argument, value in (("inner", inner_optimizer), ("outer", outer_optimizer)):
        if takes_outer_steps(value):
            raise ValueError(
                f"`{argument}_optimizer` must not be a DiLoCo or an AGN: each "
                "takes outer steps of its own. Received: "
                f"{argument}_optimizer={value!r}"
            )
    check_inner_learning_rate(inner_optimizer)
    for optimizer in wrapped_chain(inner_optimizer):
        steps = getattr(optimizer, "gradient_accumulation_steps", None)
        if steps:
            raise ValueError(
                "`inner_optimizer` must not accumulate gradients: `sync_every` "
                "counts DiLoCo's `apply` calls, and a round ending inside an "
                "accumulation would carry its partial gradient past the outer "
                "step (give the k micro-batches as one batch). Received: "
                f"{type(optimizer).__name__}(gradient_accumulation_steps={steps!r})"
            )


@keras.saving.register_keras_serializable(package="tf_lars")
class DiLoCo(keras.optimizers.Optimizer):
    """One worker of synchronous DiLoCo, on any Keras backend.

    Each worker takes `sync_every` (H) inner steps with its own inner
    optimizer (which keeps its state across rounds), then the workers
    average their pseudo-gradients `Delta_m = theta - theta_m`
    (`pseudo_gradient`), and every worker applies the same outer step to its
    copy of the global parameters `theta` and copies `theta` into its
    variables (`outer_step`).

    Who averages (`exchange`): by default (`"local"`) one process is one
    worker, and `apply` itself takes the outer step every `sync_every` inner
    steps with M = 1 (the outer optimizer alone, as SNOO does). A driver
    that averages over M workers (`simulate_sync` in one process,
    `tf_lars.distribute.DiLoCoSync` or `tf_lars.distribute.synchronize`
    across processes) sets `exchange="external"` (`take_over_exchange`), and
    refuses where the inner step just taken ended a round, whose outer step
    this optimizer then took itself; a loop that calls a driver only where
    rounds end, or with H = 1, constructs its workers with
    `exchange="external"`.

    `model.compile(optimizer=DiLoCo(...))` takes the inner and outer steps
    in `model.fit`; the model's saving and checkpoints hold the whole state
    (`theta`, both optimizers' slots, the error buffers, the inner-step
    count `iterations`). `learning_rate` is the inner optimizer's. Under
    `mixed_float16`, `compile` wraps it in Keras's loss scale, whose skipped
    steps never reach DiLoCo and so do not count toward a round; a
    `tf_lars.LossScaleOptimizer` inside it (`DiLoCo(LossScaleOptimizer(...))`)
    counts them, as workers that must agree on rounds need. Several replicas
    of one process (`MirroredStrategy.scope()`) are not supported (TensorFlow
    refuses the outer step's `merge_call`): workers are processes, on MWMS.

    Args:
        inner_optimizer: `keras.optimizers.Optimizer`. Each worker's own
            optimizer for the inner steps (AdamW in the paper; any Keras or
            tf_lars optimizer).
        outer_optimizer: `keras.optimizers.Optimizer` or None. Applied to
            `theta` with the mean pseudo-gradient as its gradient; its slots
            are built over `theta`. Defaults to `None`: the paper's
            `SGD(learning_rate=0.7, momentum=0.9, nesterov=True)`.
        sync_every: int >= 1. H, the inner steps between outer steps.
            Defaults to `500` (the paper's).
        compression: str or None. How pseudo-gradients are exchanged: `None`
            (as they are), `"bfloat16"`, `"int8"` or `"int4"` (absmax
            quantization, see `quantize`). Defaults to `None`.
        granularity: str. `"tensor"` or `"row"`: one quantization scale per
            tensor or per row. Defaults to `"tensor"`.
        error_feedback: bool. Adds what compression lost in one round to the
            next round's pseudo-gradient (`error_feedback_step`); needs
            `compression`. Defaults to `False`.
        num_fragments: int in [1, sync_every]. Streaming: the variables split
            into this many strided fragments, fragment `f` synced at its own
            offset (`streaming_schedule`). Defaults to `1` (plain DiLoCo).
        name: str. Defaults to `"diloco"`.
        exchange: str, keyword only. `"local"`: `apply` takes the outer step
            itself as the only worker; `"external"`: a driver takes it (see
            above). Defaults to `"local"`.

    References:
        - Douillard et al., 2023. DiLoCo: Distributed Low-Communication
          Training of Language Models. arXiv:2311.08105.
        - Douillard et al., 2025. Streaming DiLoCo with overlapping
          communication. arXiv:2501.18512.

    Examples:
        >>> import keras, numpy as np
        >>> from tf_lars.diloco import DiLoCo
        >>> worker = DiLoCo(keras.optimizers.SGD(0.1), sync_every=2)
        >>> w = [keras.Variable(np.ones(3, "float32"))]
        >>> for _ in range(2):  # one worker: the outer step after the 2nd
        ...     worker.apply([np.ones(3, "float32")], w)
        >>> np.round(keras.ops.convert_to_numpy(w[0]), 4)
        array([0.734, 0.734, 0.734], dtype=float32)
        >>> int(keras.ops.convert_to_numpy(worker.outer_optimizer.iterations))
        1
    """

    def __init__(
        self,
        inner_optimizer,
        outer_optimizer=None,
        sync_every=500,
        compression=None,
        granularity="tensor",
        error_feedback=False,
        num_fragments=1,
        name="diloco",
        *,
        exchange="local",
        **kwargs,
    ):
        if outer_optimizer is None:
            outer_optimizer = keras.optimizers.SGD(
                learning_rate=0.7, momentum=0.9, nesterov=True, name="outer_sgd"
            )
        _check_arguments(inner_optimizer, outer_optimizer, kwargs)
        sync_every = check_step_count(
            "sync_every", check_int("sync_every", sync_every, 1)
        )
        check_choice("compression", compression, COMPRESSIONS)
        check_choice("granularity", granularity, GRANULARITIES)
        check_bool("error_feedback", error_feedback)
        check_choice("exchange", exchange, EXCHANGES)
        if error_feedback and compression is None:
            raise ValueError(
                "`error_feedback` needs a `compression` (without one nothing "
                "is lost). Received: error_feedback=True, compression=None"
            )
        num_fragments = check_int("num_fragments", num_fragments, 1)
        if num_fragments > sync_every:
            raise ValueError(
                f"`num_fragments` must be <= sync_every ({sync_every}), so "
                "that each fragment has its own offset. Received: "
                f"num_fragments={num_fragments}"
            )
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer
        self.outer_optimizer = outer_optimizer
        self.sync_every = sync_every
        self.compression = compression
        self.granularity = granularity
        self.error_feedback = error_feedback
        self.num_fragments = num_fragments
        self.exchange = exchange
        self.global_variables, self.errors, self.fragments = [], [], []

    def build(self, variables):
        """Makes `theta` (copies of `variables`), the outer optimizer's slots
        over it, the error buffers, and builds the inner optimizer."""
        refuse_outer_loss_scale(self)
        if self.built:
            return
        variables = list(variables)
        if self.num_fragments > len(variables):
            raise ValueError(
                f"`num_fragments` must be <= the number of variables "
                f"({len(variables)}). Received: num_fragments={self.num_fragments}"
            )
        super().build(variables)
        self.global_variables = eagerly(
            lambda: [
                self.add_variable(
                    shape=variable.shape,
                    dtype=variable.dtype,
                    # A copy: on PyTorch a Variable would share the tensor.
                    initializer=lambda shape, dtype=None, v=variable: ops.cast(
                        ops.copy(v), dtype or v.dtype
                    ),
                    name=f"global_{index}",
                )
                for index, variable in enumerate(variables)
            ]
        )
        if self.error_feedback:
            self.errors = [
                self.add_variable(shape=v.shape, dtype=v.dtype, name=f"error_{i}")
                for i, v in enumerate(self.global_variables)
            ]
        self.fragments = streaming_fragments(len(variables), self.num_fragments)
        self.inner_optimizer.build(variables)
        self.outer_optimizer.build(self.global_variables)
        track_attribute_variables(self.inner_optimizer, variables)
        track_attribute_variables(self.outer_optimizer, self.global_variables)

    @property
    def inner_steps(self):
        """Inner steps taken so far (Keras's `iterations`), an int variable."""
        return self.iterations

    def load_own_variables(self, store):
        # A file of tf_lars 0.2.x: without the inner optimizers' attribute
        # variables (`_internals.track_attribute_variables`).
        load_variables(self, store, super().load_own_variables)

    @property
    def variables(self):
        # Saved and restored in this order by Keras, all of the state.
        return (
            super().variables
            + self.inner_optimizer.variables
            + self.outer_optimizer.variables
        )

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def apply(self, grads, trainable_variables=None):
        """One inner step: the inner optimizer's `apply`, counted; with
        `exchange="local"`, then the outer step of every fragment due.

        Args:
            grads: list of gradients, one per variable.
            trainable_variables: list of the worker's variables. Defaults to
                `None`: those the optimizer was built with.
        """
        if trainable_variables is None:
            require_built(self)
            variables = list(_internals.trainable_variables_of(self))
        else:
            variables = list(trainable_variables)
            self.build(variables)
        self._check_length("variables", variables, len(self.global_variables))
        self.inner_optimizer.apply(grads, variables)
        variables = self._in_build_order(variables)
        self.iterations.assign_add(1)
        if self.exchange == "local":
            self._local_outer_steps(variables)

    def _local_outer_steps(self, variables):
        """The outer step of each fragment due now, as the only worker
        (`simulate_sync([self], [variables])`), decided on the device: the
        step count is a tensor inside `fit`'s compiled step."""
        step = ops.convert_to_tensor(self.iterations)
        offsets = fragment_offsets(self.num_fragments, self.sync_every)
        for fragment, offset in enumerate(offsets):
            due = ops.logical_and(
                step >= max(offset, 1),
                ops.equal((step - offset) % self.sync_every, 0),
            )
            fragment = None if self.num_fragments == 1 else fragment
            indices = self._indices(fragment)
            state = [self.global_variables[i] for i in indices]
            state += [self.errors[i] for i in indices if self.errors]
            state += list(self.outer_optimizer.variables)
            state += [variables[i] for i in indices]
            _when(due, functools.partial(self._sync_alone, variables, fragment), state)

    def _sync_alone(self, variables, fragment):
        mean = self.compress(self.pseudo_gradient(variables, fragment), fragment)
        self.outer_step(mean, variables, fragment)

    def take_over_exchange(self, driver):
        """Called by an exchange driver (`driver`: its name) right after an
        inner step: sets `exchange="external"`. Refused, in one `ValueError`,
        where that step ended a round under `exchange="local"`: this
        optimizer took the round's outer step itself, and the driver would
        take a second one. Eager: reads the step count."""
        if self.exchange == "external":
            return
        if self.built and self.due_fragments():
            raise ValueError(
                f"{driver} takes {self.name}'s outer steps, but {self.name} "
                "took this round's outer step itself (exchange='local': one "
                "worker). Construct it with `exchange='external'`. Received: "
                "exchange='local'"
            )
        self.exchange = "external"

    def apply_gradients(self, grads_and_vars):
        grads, trainable_variables = zip(*grads_and_vars, strict=True)
        self.apply(grads, trainable_variables)
        return self.iterations

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def due_fragments(self):
        """The fragments to sync now (`streaming_schedule` at `inner_steps`);
        `[0]` or `[]` with one fragment. Eager: reads the counter."""
        step = int(ops.convert_to_numpy(self.iterations))
        return streaming_schedule(step, self.num_fragments, self.sync_every)

    def pseudo_gradient(self, variables, fragment=None):
        """`theta - variables`, over `fragment`'s variables (all if None)."""
        variables = self._checked(variables)
        return [
            ops.convert_to_tensor(self.global_variables[i])
            - ops.cast(variables[i], self.global_variables[i].dtype)
            for i in self._indices(fragment)
        ]

    def encode(self, pseudo_gradient, fragment=None):
        """The payloads this worker sends (one `encode` tuple per variable
        of `fragment`); with error feedback, adds the error first and keeps
        what the compression lost for the next round."""
        indices = self._indices(fragment)
        self._check_length("pseudo_gradient", pseudo_gradient, len(indices))
        payloads = []
        for i, delta in zip(indices, pseudo_gradient, strict=True):
            delta = ops.convert_to_tensor(delta)
            if self.error_feedback:
                delta = delta + ops.cast(self.errors[i], delta.dtype)
            payload = encode(delta, self.compression, self.granularity)
            if self.error_feedback:
                self.errors[i].assign(delta - decode(payload, delta.dtype))
            payloads.append(payload)
        return payloads

    def compress(self, pseudo_gradient, fragment=None):
        """The pseudo-gradient as the other workers receive it, after
        `compression` (`decode(encode(...))`); with error feedback, updates
        this worker's error."""
        payloads = self.encode(pseudo_gradient, fragment)
        return [
            decode(payload, ops.convert_to_tensor(delta).dtype)
            for payload, delta in zip(payloads, pseudo_gradient, strict=True)
        ]

    def outer_step(self, mean_pseudo_gradient, variables, fragment=None):
        """Applies the outer optimizer to `theta` with `mean_pseudo_gradient`
        (already averaged across workers), then copies `theta` into
        `variables` (over `fragment`'s variables, all if None)."""
        variables = self._checked(variables)
        indices = self._indices(fragment)
        self._check_length("mean_pseudo_gradient", mean_pseudo_gradient, len(indices))
        self._check_shapes("mean_pseudo_gradient", mean_pseudo_gradient, indices)
        theta = [self.global_variables[i] for i in indices]
        grads = [
            ops.cast(delta, target.dtype)
            for delta, target in zip(mean_pseudo_gradient, theta, strict=True)
        ]
        self.outer_optimizer.apply(grads, theta)
        for i in indices:
            value = ops.copy(self.global_variables[i])  # never aliased
            variables[i].assign(ops.cast(value, variables[i].dtype))

    def _indices(self, fragment):
        if not self.built:
            raise ValueError(
                f"{self.name} is not built: call `build(variables)` (or `apply`, "
                "`pseudo_gradient`) before `compress`."
            )
        if fragment is None:
            return list(range(len(self.global_variables)))
        if not is_int(fragment) or not 0 <= fragment < self.num_fragments:
            raise ValueError(
                f"`fragment` must be an int in [0, {self.num_fragments}). "
                f"Received: fragment={fragment!r}"
            )
        return self.fragments[fragment]

    def _checked(self, variables):
        """`variables` as a list in `theta`'s order, after building on them."""
        variables = list(variables)
        self.build(variables)
        self._check_length("variables", variables, len(self.global_variables))
        return self._in_build_order(variables)  # each of its `theta`'s shape

    def _in_build_order(self, variables):
        """`variables`, those `theta` copies in any order (as Keras's
        optimizers take them), in `theta`'s order: found by identity."""
        by_index = {}
        for variable in variables:
            try:
                index = _internals.variable_index(self, variable)
            except KeyError:
                index = None
            if index is None or index in by_index:
                raise ValueError(
                    f"`variables` must be the {len(variables)} variables "
                    f"{self.name} was built with, each once. Received: "
                    f"{'a variable twice' if index is not None else variable}"
                )
            by_index[index] = variable
        return [by_index[i] for i in range(len(variables))]

    def _check_shapes(self, name, values, indices):
        """Refuses a tensor of another shape than its `theta` (which would
        broadcast, silently or in the backend's own words)."""
        for value, i in zip(values, indices, strict=True):
            shape = tuple(self.global_variables[i].shape)
            if tuple(ops.shape(value)) != shape:
                raise ValueError(
                    f"`{name}` must match the variables {self.name} was built "
                    f"with: entry {i} must have shape {shape}. Received: shape "
                    f"{tuple(ops.shape(value))}"
                )

    def _check_length(self, name, values, expected):
        if len(values) != expected:
            raise ValueError(
                f"`{name}` must hold {expected} tensors, one per variable of "
                f"{self.name}. Received: {len(values)} tensors"
            )

    def get_config(self):
        config = {
            key: _internals.portable_optimizer_config(getattr(self, key))
            for key in ("inner_optimizer", "outer_optimizer")
        }
        keys = ("sync_every", "compression", "granularity", "error_feedback")
        keys += ("num_fragments", "name", "exchange")
        return {**config, **{key: getattr(self, key) for key in keys}}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        check_config_keys(cls, config)
        config = dict(config)
        for key in ("inner_optimizer", "outer_optimizer"):
            config[key] = keras.saving.deserialize_keras_object(
                config[key], custom_objects=custom_objects
            )
        return cls(**config)


def takes_outer_steps(optimizer):
    """Whether `optimizer` is a DiLoCo or an AGN (AGN only exists where
    `tf_lars.agn` was imported)."""
    agn = sys.modules.get("tf_lars.agn")
    return isinstance(optimizer, DiLoCo) or (
        agn is not None and isinstance(optimizer, agn.AGN)
    )


def _when(condition, step, state):
    """Runs `step()` (which writes `state`, a list of variables) where the
    scalar bool tensor `condition` holds, on any backend.

    TensorFlow: `tf.cond`, whose branches may write variables (inside XLA
    too). PyTorch runs eagerly: a Python `if`. JAX traces `fit`'s step under
    a stateless scope where a branch of `lax.cond` cannot write: the step is
    taken on every call and each written value kept only where `condition`
    holds, as Keras's own JAX optimizer does for gradient accumulation.
    """
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        tf.cond(condition, lambda: step() and None, lambda: None)
    elif backend == "jax":
        before = [ops.copy(ops.convert_to_tensor(v)) for v in state]
        step()
        for variable, old in zip(state, before, strict=True):
            new = ops.convert_to_tensor(variable)
            variable.assign(ops.where(condition, new, old))
    elif bool(ops.convert_to_numpy(condition)):
        step()


def simulate_sync(workers, worker_variables, fragment=None):
    """One synchronization of workers simulated in one process.

    Each worker's pseudo-gradient (compressed as the worker sends it,
    decoded to the variable's dtype), their sum in worker order divided by
    M, and the same outer step on every worker. Across processes,
    `tf_lars.distribute.synchronize` gives this mean bit for bit where it
    all-gathers (int8/int4) or all-reduces two workers' uncompressed
    pseudo-gradients, and to rounding otherwise (a ring's order for M > 2;
    bfloat16 is summed in bfloat16). Returns the mean pseudo-gradient
    applied.

    Args:
        workers: list of `DiLoCo`, one per simulated worker, configured
            alike.
        worker_variables: list of variable lists, one per worker, in the
            same order.
        fragment: int or None. The fragment to sync; all variables if None.
    """
    workers, worker_variables = list(workers), list(worker_variables)
    if len(workers) != len(worker_variables) or not workers:
        raise ValueError(
            "`worker_variables` must hold one variable list per worker. "
            f"Received: {len(worker_variables)} lists for {len(workers)} workers"
        )
    for worker in workers:
        worker.take_over_exchange("simulate_sync")
    sent = [
        worker.compress(worker.pseudo_gradient(variables, fragment), fragment)
        for worker, variables in zip(workers, worker_variables, strict=True)
    ]
    mean = [
        ops.sum(ops.stack(deltas), axis=0) / len(workers)
        for deltas in zip(*sent, strict=True)
    ]
    for worker, variables in zip(workers, worker_variables, strict=True):
        worker.outer_step(mean, variables, fragment)
    return mean
