"""The pieces LARS, TrustRatio and LAMB share, in `keras.ops` (every backend).

docs/algorithms.md states the rules; `tf_lars/lars.py`, `trust_ratio.py` and
`lamb.py` follow them step by step and call these functions. On the
TensorFlow backend `tf_lars/_tf_fast.py` stands in for `norms`,
`momentum_step` and `scaled_step` with kernels of the same signature and
the same results (tests/backends_rules_test.py holds them equal); `kernels()`
returns the module to use.
"""

import keras
import numpy as np
from keras import ops


def kernels():
    """`tf_lars._tf_fast` on the TensorFlow backend, else this module."""
    if keras.backend.backend() == "tensorflow":
        from tf_lars import _tf_fast

        return _tf_fast
    import sys

    return sys.modules[__name__]


def compute_dtype(dtype):
    """The dtype norms and ratios are computed in: float64 or float32."""
    return (
        "float64" if keras.backend.standardize_dtype(dtype) == "float64" else "float32"
    )


def is_sparse(gradient):
    """Only the TensorFlow backend has sparse gradients (`tf.IndexedSlices`)."""
    return False


# ------------------------------------------------------------------- norms


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


def norms(tensors):
    """Euclidean norms of `tensors` (one float dtype) as one vector.

    A squared norm that is not finite, or below the smallest normal float
    (its squares may have underflowed), is recomputed scaled by the largest
    entry, so entries of 1e19 or 1e-30 in float32 give their true norm
    instead of inf or 0; one `ops.cond` runs that only when one needs it.

    An entry may be a function that returns the tensor: it is called where
    each norm is computed, so a compiler reads the tensor's inputs there
    instead of keeping the tensor in memory (`tf_lars.lamb.lamb_direction`).
    """
    squares = ops.stack([ops.sum(ops.square(value_of(tensor))) for tensor in tensors])
    dtype = np.dtype(keras.backend.standardize_dtype(squares.dtype))
    lost_range = ops.logical_or(
        ops.logical_not(ops.isfinite(squares)), squares < np.finfo(dtype).tiny
    )

    def rescale_lost():
        rescaled = ops.stack([_rescaled_norm(value_of(t)) for t in tensors])
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
    denominator = ops.where(defined, update_norm + epsilon, one)
    return ops.where(defined, trust_coefficient * weight_norm / denominator, one)


def record_trust_ratios(optimizer, indices, ratios):
    """Writes `ratios` at `indices` of `optimizer.trust_ratios` (one assign).

    A full assign rather than a scatter: what mirrored variables support
    from replica context, and what `stateless_apply` records.
    """
    positions = ops.convert_to_tensor([[index] for index in indices], "int32")
    values = ops.stack([ops.cast(ratio, "float32") for ratio in ratios])
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


class PlainApply:
    """`apply` as Keras has it; `tf_lars._tf_fast.CompiledApply` on TensorFlow."""

    def _init_compiled_apply(self):
        # Kept on every backend so configs and code that set it still run;
        # only the TensorFlow backend's eager `apply` reads it.
        self.jit_compile = True
