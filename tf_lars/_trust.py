"""The only rule code LARS, TrustRatio and LAMB share, in `keras.ops`.

Norms (with the overflow-safe rescaled fallback), the trust ratio and its
record, and the decay factor of a scaled step. docs/algorithms.md states the
rules; each rule file (`lars.py`, `trust_ratio.py`, `lamb.py`) calls these. The
TensorFlow backend's subclasses (`tf_lars/backend/tensorflow.py`) pass their
own `sum_of_squares` to `norms`, the PyTorch backend's their own `cond`;
tests/backends_rules_test.py holds each equal to the portable one.
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


# ------------------------------------------------------------------- norms


#: Tensors of fewer elements have their norms summed stacked with the
#: others of their shape, at most `STACKED_ROWS` in a stack (`_norm_groups`;
#: docs/guides/benchmarks.md, "Compile time", has the measured sizes).
STACKED_BELOW = 4096
STACKED_ROWS = 128


def sum_of_squares(tensor):
    """`sum(x**2)` of one tensor as a scalar (the TensorFlow backend passes
    its own to `norms`: `tf_lars.backend.tensorflow.sum_of_squares`)."""
    return ops.sum(ops.square(tensor))


def _rescaled_norm(tensor, squares_of=sum_of_squares):
    """`|x| = m * |x / m|` with `m = max |x_i|`: no square overflows or
    underflows, so the norm is right wherever it is representable."""
    if math.prod(tensor.shape) == 0:  # no entries: no peak (`amax` fails)
        return ops.sum(tensor)
    peak = ops.amax(ops.abs(tensor))
    peak = ops.where(peak > 0, peak, ops.ones_like(peak))
    return peak * ops.sqrt(squares_of(tensor / peak))


def value_of(tensor):
    """`tensor`, or what it returns if it is a function (see `norms`)."""
    return tensor() if callable(tensor) else tensor


def stacks(tensor):
    """Whether `tensor`'s norm is summed stacked with others of its shape: a
    static shape of fewer than `STACKED_BELOW` elements. A model's hundreds
    of small variables (biases, scales) share a few shapes, and a compiler
    builds one reduction per stack instead of one per tensor; a larger
    tensor is not stacked (that would copy it)."""
    shape = tuple(tensor.shape)
    return None not in shape and math.prod(shape) < STACKED_BELOW


def _norm_groups(values):
    """`values`' positions grouped for their norms (`stacks`), with the
    stacked `[k, size]` rows of each group of several (None for one)."""
    by_shape = {}
    for position, tensor in enumerate(values):
        key = tuple(tensor.shape) if stacks(tensor) else position
        by_shape.setdefault(key, []).append(position)
    groups = [
        group[start : start + STACKED_ROWS]
        for group in by_shape.values()
        for start in range(0, len(group), STACKED_ROWS)
    ]
    rows = [
        None
        if len(group) == 1
        else ops.reshape(ops.stack([values[p] for p in group]), [len(group), -1])
        for group in groups
    ]
    return groups, rows


def _rescaled_norms(rows):
    """`_rescaled_norm` of each row of `rows` (`stacked`), as one vector."""
    if rows.shape[1] == 0:  # rows of no entries: no peaks (`amax` fails)
        return ops.sum(rows, axis=1)
    peaks = ops.amax(ops.abs(rows), axis=1)
    peaks = ops.where(peaks > 0, peaks, ops.ones_like(peaks))
    # Divided by sqrt(peak) twice: XLA turns a division by a broadcast into
    # a product with its reciprocal, and 1 / peak is subnormal (flushed to
    # 0) for peaks above 2**126.
    root = ops.sqrt(peaks)[:, None]
    return peaks * ops.sqrt(ops.sum(ops.square(rows / root / root), axis=1))


def norms(tensors, squares_of=sum_of_squares, cond=ops.cond):
    """Euclidean norms of `tensors` (one float dtype) as one vector.

    A squared norm that is not finite, or below the smallest normal float
    (its squares may have underflowed), is recomputed scaled by the largest
    entry, so entries of 1e19 or 1e-30 in float32 give their true norm
    instead of inf or 0; one `cond` (`ops.cond`; the PyTorch backend passes
    its own) for all the tensors runs that only when one needs it. Small
    tensors are summed stacked by shape (`stacks`); `squares_of` sums the
    squares of each other one.

    An entry may be a function that returns the tensor: it is called where
    each norm is computed, so a compiler reads the tensor's inputs there
    instead of keeping the tensor in memory (LAMB's direction under XLA).
    """
    values = [value_of(tensor) for tensor in tensors]
    groups, rows = _norm_groups(values)
    order = [position for group in groups for position in group]
    # A list, not a NumPy array: under torch.compile a NumPy array breaks
    # the graph. Made once, outside `cond`: a constant made in a branch of
    # `torch.cond` reaches inductor's compiled branch as a non-tensor.
    back = None
    if order != sorted(order):
        back = sorted(range(len(order)), key=order.__getitem__)
        back = ops.convert_to_tensor(back, "int32")

    def per_group(one, of_rows):
        parts = [
            ops.reshape(one(value_of(tensors[group[0]])), [1])
            if matrix is None
            else of_rows(matrix)
            for group, matrix in zip(groups, rows, strict=True)
        ]
        joined = parts[0] if len(parts) == 1 else ops.concatenate(parts)
        return joined if back is None else ops.take(joined, back)

    squares = per_group(squares_of, lambda matrix: ops.sum(ops.square(matrix), axis=1))
    dtype = np.dtype(keras.backend.standardize_dtype(squares.dtype))
    lost_range = ops.logical_or(
        ops.logical_not(ops.isfinite(squares)), squares < np.finfo(dtype).tiny
    )

    def rescale_lost():
        # A group of one computes its tensor again here (see above); the
        # stacked rows are small, and shared with the fast path.
        rescaled = per_group(
            lambda tensor: _rescaled_norm(tensor, squares_of), _rescaled_norms
        )
        return ops.where(lost_range, rescaled, ops.sqrt(squares))

    return cond(ops.any(lost_range), rescale_lost, lambda: ops.sqrt(squares))


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
    they belong to), as scalars."""
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


def decay_factor(scale, learning_rate, decay):
    """`lr * wd / scale`, so that `lr (d + wd w) = scale * (d' + factor * w)`
    for a step kept as `scale * d'` (0 where scale is 0: nothing moves)."""
    dtype = scale.dtype
    divisor = ops.where(ops.equal(scale, 0), ops.ones_like(scale), scale)
    return (
        ops.cast(learning_rate, dtype) * ops.convert_to_tensor(decay, dtype) / divisor
    )
