"""The pieces LARS, TrustRatio and LAMB share, in `keras.ops` (every backend).

docs/algorithms.md states the rules; `tf_lars/lars.py`, `trust_ratio.py` and
`lamb.py` follow them step by step and call these functions. On the
TensorFlow backend `tf_lars/_tf_fast.py` overrides some of them (`norms`,
`momentum_step`, `scaled_step`, ...) with kernels of the same signature and
the same results (tests/backends_rules_test.py holds them equal);
`tf_lars/_kernels.py` picks each name from one module or the other.
"""

import math

import keras
import numpy as np
from keras import ops


def compute_dtype(dtype):
    """The dtype norms and ratios are computed in: float64 or float32."""
    return (
        "float64" if keras.backend.standardize_dtype(dtype) == "float64" else "float32"
    )


def is_sparse(gradient):
    """Only the TensorFlow backend has sparse gradients (`tf.IndexedSlices`)."""
    return False


# ------------------------------------------------------------------- norms


#: Tensors of fewer elements have their norms summed stacked with the
#: others of their shape (`norm_groups`).
STACKED_BELOW = 4096
# At most this many tensors in one stack (`norm_groups`): XLA's CPU compiler
# emits a concatenation as one function with a branch per operand, and its
# time grew faster than the operands (1,000 tensors of a shape in one stack
# took longer to compile than all of Keras's SGD step over 2,000 variables);
# stacks of 128 compiled fastest of 16 to 512 (docs/guides/benchmarks.md,
# "Compile time").
STACKED_ROWS = 128


def _rescaled_norm(tensor):
    """`|x| = m * |x / m|` with `m = max |x_i|`: no square overflows or
    underflows, so the norm is right wherever it is representable."""
    peak = ops.max(ops.abs(tensor))
    peak = ops.where(peak > 0, peak, ops.ones_like(peak))
    return peak * ops.sqrt(ops.sum(ops.square(tensor / peak)))


def recomputes_for_norms(tensor):
    """Whether LAMB's norm computes the direction again from `m`, `v` and
    `w` instead of reading the stored direction (`tf_lars.lamb.lamb_direction`).

    `tensor` is one the step computed (the direction). Yes when a compiler
    sees the whole step: on JAX when `tensor` is traced (`jax.jit`, the JAX
    trainer's compiled step), and under XLA on TensorFlow
    (`tf_lars._tf_fast.recomputes_for_norms`). XLA then sums the squares in
    the pass that reads `m`, `v` and `w`, instead of writing the direction
    (used twice) to memory and reading it back. Not when each op runs on
    its own (PyTorch, eager JAX): there the recomputation is extra work.
    """
    if keras.backend.backend() != "jax":
        return False
    import jax

    return isinstance(tensor, jax.core.Tracer)


def batches_trust_ratios(gradients):
    """Whether `TrustRatio` takes steps 3 to 5 (trust ratio, clip, update) at once.

    Yes when a compiler sees the whole step: under `jax.jit` (the gradients
    are traced), under `torch.compile`, and under XLA on TensorFlow
    (`tf_lars._tf_fast.batches_trust_ratios`). One `norms` call and one
    record then serve every variable, where one each made the compiled
    program, and its compile time, grow several times faster with the
    number of variables than Keras's optimizers' (and, under
    `torch.compile`, recompiled per variable shape). Not when each op runs
    on its own: there every direction would be kept until the last one is
    known, instead of each being freed after its variable's step.
    """
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return bool(gradients) and isinstance(gradients[0], jax.core.Tracer)
    if backend == "torch":
        import torch

        return torch.compiler.is_compiling()
    return False


def apart(tensors):
    """`tensors` unchanged, as values a compiler will not merge with others.

    On JAX, `jax.lax.optimization_barrier`; elsewhere the tensors
    themselves. An expression of the returned values, such as LARS's
    decayed gradient `g + wd w` in its norm, shares no term with the same
    expression written elsewhere in the step. Shared, XLA would write the
    expression to a fresh buffer as large as the variable and read it back
    for each use; apart, it computes it inside the norm's pass over `g` and
    `w` (docs/guides/backends.md, "What the JAX step costs").
    """
    tensors = tuple(tensors)
    if keras.backend.backend() == "jax":
        import jax

        return jax.lax.optimization_barrier(tensors)
    return tensors


def value_of(tensor):
    """`tensor`, or what it returns if it is a function (see `norms`)."""
    return tensor() if callable(tensor) else tensor


def norm_groups(tensors):
    """Positions of `tensors` in the groups whose norms are computed together.

    Every tensor of fewer than `STACKED_BELOW` elements joins the others of
    its shape, up to `STACKED_ROWS` in a group; each larger tensor is a
    group of its own (stacking it would copy it). A compiler then builds one
    reduction per group instead of one per tensor: a model's hundreds of
    small variables (biases, scales) share a few shapes, and XLA's compile
    time and memory grew several times faster with the number of reductions
    than with the variables themselves (docs/guides/benchmarks.md, "Compile time").
    """
    groups = {}
    for position, tensor in enumerate(tensors):
        shape = tuple(tensor.shape)
        groups.setdefault(shape if stacks(tensor) else position, []).append(position)
    return [
        group[start : start + STACKED_ROWS]
        for group in groups.values()
        for start in range(0, len(group), STACKED_ROWS)
    ]


def stacks(tensor):
    """Whether `tensor`'s norm is taken stacked with others of its shape
    (`norm_groups`): a static shape of fewer than `STACKED_BELOW` elements."""
    shape = tuple(tensor.shape)
    return None not in shape and math.prod(shape) < STACKED_BELOW


def stacked(tensors, group):
    """The tensors at the positions of `group` (one shape) as `[k, size]` rows."""
    rows = ops.stack([tensors[position] for position in group])
    return ops.reshape(rows, [len(group), -1])


def stacked_groups(tensors):
    """`norm_groups` of `tensors` (values, not functions) and the `stacked`
    rows of each group (None for a group of one)."""
    groups = norm_groups(tensors)
    rows = [None if len(group) == 1 else stacked(tensors, group) for group in groups]
    return groups, rows


def group_norms(tensors, groups, rows, one, stacked_rows):
    """One vector of `one(tensor)` for each group of one and `stacked_rows`
    of each group's `rows`, in the order of `tensors` (entries may be
    functions, called here)."""
    parts = [
        ops.reshape(one(value_of(tensors[group[0]])), [1])
        if matrix is None
        else stacked_rows(matrix)
        for group, matrix in zip(groups, rows, strict=True)
    ]
    joined = parts[0] if len(parts) == 1 else ops.concatenate(parts)
    order = [position for group in groups for position in group]
    if order == sorted(order):
        return joined
    # A list, not a NumPy array: under torch.compile a NumPy array breaks
    # the graph.
    back = sorted(range(len(order)), key=order.__getitem__)
    return ops.take(joined, ops.convert_to_tensor(back, "int32"))


def _rescaled_norms(rows):
    """`_rescaled_norm` of each row of `rows` (`stacked`), as one vector."""
    peaks = ops.max(ops.abs(rows), axis=1)
    peaks = ops.where(peaks > 0, peaks, ops.ones_like(peaks))
    # Divided by sqrt(peak) twice: XLA turns a division by a broadcast into
    # a product with its reciprocal, and 1 / peak is subnormal (flushed to
    # 0) for peaks above 2**126.
    root = ops.sqrt(peaks)[:, None]
    return peaks * ops.sqrt(ops.sum(ops.square(rows / root / root), axis=1))


def norms(tensors):
    """Euclidean norms of `tensors` (one float dtype) as one vector.

    A squared norm that is not finite, or below the smallest normal float
    (its squares may have underflowed), is recomputed scaled by the largest
    entry, so entries of 1e19 or 1e-30 in float32 give their true norm
    instead of inf or 0; one `ops.cond` runs that only when one needs it.
    Small tensors are summed stacked by shape (`norm_groups`).

    An entry may be a function that returns the tensor: it is called where
    each norm is computed, so a compiler reads the tensor's inputs there
    instead of keeping the tensor in memory (`tf_lars.lamb.lamb_direction`).
    """
    values = [value_of(tensor) for tensor in tensors]
    groups, rows = stacked_groups(values)
    squares = group_norms(
        values,
        groups,
        rows,
        lambda tensor: ops.sum(ops.square(tensor)),
        lambda matrix: ops.sum(ops.square(matrix), axis=1),
    )
    dtype = np.dtype(keras.backend.standardize_dtype(squares.dtype))
    lost_range = ops.logical_or(
        ops.logical_not(ops.isfinite(squares)), squares < np.finfo(dtype).tiny
    )

    def rescale_lost():
        # A group of one computes its tensor again here (see above); the
        # stacked rows are small, and shared with the fast path.
        rescaled = group_norms(tensors, groups, rows, _rescaled_norm, _rescaled_norms)
        return ops.where(lost_range, rescaled, ops.sqrt(squares))

    return ops.cond(ops.any(lost_range), rescale_lost, lambda: ops.sqrt(squares))


# ------------------------------------------------------------- trust ratio


def trust_ratio(weight_norm, update_norm, trust_coefficient, epsilon, defined=None):
    """`T = eta |w| / (|u| + eps)`, and 1 where `defined` is False.

    The one trust ratio of LARS, TrustRatio and LAMB, on scalars or vectors.
    `defined` defaults to `|w| > 0 and |u| > 0`; LARS's "paper" ratio passes
    its own (`|w| > 0 and |g| > 0`, docs/algorithms.md).
    """
    if defined is None:
        defined = ops.logical_and(weight_norm > 0, update_norm > 0)
    one = ops.ones_like(weight_norm)
    numerator = ops.where(defined, trust_coefficient * weight_norm, one)
    denominator = ops.where(defined, update_norm + epsilon, one)
    # The division last (1 / 1 where undefined): XLA copies cheap ops such
    # as selects into each consumer, here every variable's update, but
    # never a division; so each update reads its ratio from one vector.
    return numerator / denominator


def entries(vector, tensors):
    """The entries of `vector`, one per tensor of `tensors` (the variables
    they belong to), as scalars.

    `tf_lars._tf_fast.entries` reads them under XLA so that the updates of
    small variables of one shape compile to one kernel (a compile-time
    matter only: the values are the same).
    """
    return [vector[k] for k in range(len(tensors))]


def placed(vector, positions, values):
    """`vector` with `values` written at `positions` (a list of ints); the
    values themselves when they fill the whole vector in order."""
    if list(positions) == list(range(vector.shape[0])):
        return values
    indices = ops.convert_to_tensor([[p] for p in positions], "int32")
    return ops.scatter_update(vector, indices, values)


def record_trust_ratios(optimizer, indices, ratios):
    """Writes `ratios` (scalars, or one vector) at `indices` of
    `optimizer.trust_ratios` (one assign).

    A full assign rather than a scatter: what mirrored variables support
    from replica context, and what `stateless_apply` records.
    """
    positions = ops.convert_to_tensor([[index] for index in indices], "int32")
    if isinstance(ratios, list | tuple):
        values = ops.stack([ops.cast(ratio, "float32") for ratio in ratios])
    else:
        values = ops.cast(ratios, "float32")
    current = ops.convert_to_tensor(optimizer.trust_ratios)
    optimizer.assign(
        optimizer.trust_ratios, ops.scatter_update(current, positions, values)
    )


# ----------------------------------------------------------------- writes


def momentum_step(optimizer, variable, slot, gradient, rate, momentum, nesterov):
    """`v <- mu v + gradient; w <- w - rate v` (Nesterov: `w <- w - rate
    (gradient + mu v)`, with the new `v`).

    Args:
        optimizer: the optimizer whose `assign*` methods write.
        variable: the variable.
        slot: its momentum slot.
        gradient: tensor added to the slot, in the variable's dtype.
        rate: scalar tensor the slot is applied with.
        momentum: float, `mu`.
        nesterov: bool.
    """
    mu = ops.convert_to_tensor(momentum, variable.dtype)
    velocity = mu * ops.convert_to_tensor(slot) + gradient
    optimizer.assign(slot, velocity)
    if nesterov:
        optimizer.assign_sub(variable, rate * (gradient + mu * velocity))
    else:
        optimizer.assign_sub(variable, rate * velocity)


def scaled_step(optimizer, variable, scale, step):
    """`w <- w - scale * step` (`scale` a scalar tensor of the variable's dtype)."""
    optimizer.assign_sub(variable, scale * step)


def update_with_ratios(optimizer, grads, variables, learning_rate, rule):
    """A step that takes every variable's trust ratio first: `rule.ratios(
    grads, variables)` gives each variable's ratio and the vector to record,
    `rule.record(variables, vector)` records it, then `rule.update(gradient,
    variable, learning_rate, ratio)` updates each variable (LARS).
    `tf_lars._tf_fast.update_with_ratios` does the same across replicas
    under `tf.distribute`."""
    del optimizer  # the rule's methods are bound to it
    ratios, recorded = rule.ratios(grads, variables)
    rule.record(variables, recorded)
    for gradient, variable, ratio in zip(grads, variables, ratios, strict=True):
        rule.update(gradient, variable, learning_rate, ratio)


def lamb_fusable(variable):
    """Whether LAMB's direction is one fused kernel pass: TensorFlow only
    (`tf_lars._tf_fast.lamb_fusable`)."""
    del variable
    return False


def direction_buffers():
    """LAMB's scratch space for the fused kernel: TensorFlow only
    (`tf_lars._tf_fast.DirectionBuffers`)."""
    return None


class PlainApply:
    """`apply` as Keras has it; `tf_lars._tf_fast.CompiledApply` on TensorFlow."""

    def _init_compiled_apply(self):
        # Kept on every backend so configs and code that set it still run;
        # only the TensorFlow backend's eager `apply` reads it.
        self.jit_compile = True


Apply = PlainApply
