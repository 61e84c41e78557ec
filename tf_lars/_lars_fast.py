"""Speed-ups for `tf_lars.LARS`, kept beside the math they accelerate.

`tf_lars/lars.py` states the update rule (docs/algorithms.md, "LARS") step by
step; this module holds the three things that make that rule cheap on a CPU,
none of which changes a result. Figures are from `tf-lars bench`
(`python -m tf_lars.cli.bench`) on ResNet-50's 214 trainable variable shapes,
on a 2-core CPU; docs/guides/benchmarks.md ("Speed") has the full tables.

1. **Batched, folded norms** (`squared_norm`, `batched_trust_ratios`): stand in
   for one `tf.reduce_sum(tf.square(x))` per tensor and for per-variable
   scalar arithmetic. Under XLA on CPU a full reduction to a scalar is one
   serial loop with one accumulator, several times slower than memory allows
   (about 2.5 ms for a 3x3x512x512 kernel here). Folding the squared tensor
   into a `[rows, width]` matrix and multiplying by a vector of ones hands the
   work to XLA's vectorized, multi-threaded matrix-vector kernel (about
   0.3 ms for the same kernel); only `rows` partial sums remain. The ratios
   of all variables of one dtype are then computed as a few vector ops.
   Whole step: 1.46x SGD-momentum's time with folding, 2.59x without.
   Without XLA (`model.fit`'s CPU default) the fold is not the fastest form:
   there each norm is one `MatMul` of the flattened tensor with itself,
   which reads it once and makes no temporary (`_internals.in_xla_context`
   tells the two cases apart; `tf-lars bench --only no-xla` compares it
   with `reduce_sum(square(x))`).
2. **Fused momentum** (`momentum_step`): stands in for Keras's
   `self.assign(slot, mu * slot + a)` followed by
   `self.assign_sub(variable, s * slot)`. TensorFlow's `ResourceApplyMomentum`
   kernel updates the slot and the variable in one pass over `w`, `v` and the
   gradient, where two assignments read the new slot back. `scaled_step`
   does the same for `TrustRatio`'s final `w <- w - T * s`
   (`ResourceApplyGradientDescent`).
3. **Compiled eager apply** (`CompiledApply`): stands in for
   `keras.optimizers.Optimizer.apply` when it is called eagerly (custom
   loops without `tf.function`). The whole step (every variable, slot and
   the iteration counter) runs as one `tf.function(jit_compile=True)`, traced
   once per list of variables: 187.6 ms op by op versus 25.1 ms compiled
   (7.5x) on ResNet-50's shapes. Inside `tf.function`, `model.fit` and
   multi-replica strategies it steps aside.
"""

import keras
import numpy as np
import tensorflow as tf

from tf_lars import _internals
from tf_lars._wrapper import gradient_as_tensor

# -------------------------------------------------------------------- 1. norms

# Folding widths tried in order (each must divide the element count); 128
# measured fastest on ResNet-50 shapes here, wider and narrower both slower.
_WIDTHS = (128, 96, 64, 48, 32, 16, 8)
# Below this many elements a plain reduction is as fast and skips the dot.
_SMALL = 4096
#: Read when a step is traced. `tf-lars bench` turns it off to measure the
#: plain per-tensor reduction this module replaces.
FOLD_INTO_MATVEC = True


def _fold_width(size):
    for width in _WIDTHS:
        if size % width == 0 and size // width >= width // 8:
            return width
    return None


def squared_norm(tensor):
    """Sum of squares of `tensor` (any rank) as a scalar of its dtype.

    Under XLA the squares are folded into a `[rows, width]` matrix times a
    vector of ones; elsewhere (graph or eager) the flat tensor is multiplied
    by itself in one `MatMul`, which reads it once and makes no temporary
    (about 0.6x the time of `reduce_sum(square(x))` on ResNet-50's shapes).
    """
    size = tensor.shape.num_elements()
    if not FOLD_INTO_MATVEC or size is None or size < _SMALL:
        return tf.reduce_sum(tf.square(tensor))
    if not _internals.in_xla_context():
        flat = tf.reshape(tensor, [1, size])
        return tf.reshape(tf.matmul(flat, flat, transpose_b=True), [])
    width = _fold_width(size)
    if width is None:
        return tf.reduce_sum(tf.square(tensor))
    rows = tf.reshape(tf.square(tensor), [size // width, width])
    partial = tf.linalg.matvec(rows, tf.ones([width], dtype=tensor.dtype))
    return tf.reduce_sum(partial)


def _needs_rescale(squares):
    """Which squared norms lost range: overflowed to inf, or so small
    (below the smallest normal float) that squares of entries underflowed."""
    tiny = tf.constant(np.finfo(squares.dtype.as_numpy_dtype).tiny, squares.dtype)
    return tf.logical_or(tf.logical_not(tf.math.is_finite(squares)), squares < tiny)


def _rescaled_norm(tensor):
    """`|x| = m * |x / m|` with `m = max |x_i|`: no square overflows or
    underflows, so the norm is right wherever it is representable."""
    peak = tf.reduce_max(tf.abs(tensor))
    peak = tf.where(peak > 0, peak, tf.ones_like(peak))
    return peak * tf.sqrt(squared_norm(tensor / peak))


def norms(tensors):
    """Euclidean norms of `tensors` (same float dtype) as one vector.

    The fast path is `sqrt(squared_norm(x))`. A squared norm that is not
    finite, or below the smallest normal float, is recomputed scaled by the
    largest entry (`_rescaled_norm`), so entries of 1e19 or 1e-30 in
    float32 give their true norm instead of inf or 0. The check is one
    vector comparison; a `tf.cond` (XLA-compatible) runs the rescaling only
    when one needs it.
    """
    squares = tf.stack([squared_norm(tensor) for tensor in tensors])
    bad = _needs_rescale(squares)

    def rescale_bad():
        # Rare (only when some norm needs it): every tensor is rescaled and
        # `tf.where` keeps the fast norm where it was fine. One branch, not
        # one `tf.cond` per tensor: hundreds of nested conditionals made
        # the step several times slower to build and run without XLA.
        rescaled = tf.stack([_rescaled_norm(tensor) for tensor in tensors])
        return tf.where(bad, rescaled, tf.sqrt(squares))

    return tf.cond(tf.reduce_any(bad), rescale_bad, lambda: tf.sqrt(squares))


def compute_dtype(variable):
    """The dtype norms and ratios are computed in: float64 or float32."""
    return tf.float64 if variable.dtype == tf.float64 else tf.float32


def batched_trust_ratios(grads, variables, adapted, decays, decay_in_norm, ratio):
    """Trust ratios of many variables from a few batched vector operations.

    Args:
        grads: list of gradients (dense tensors or `tf.IndexedSlices`).
        variables: list of variables, same length.
        adapted: list of bools: which variables get a trust ratio.
        decays: list of floats, each variable's weight decay.
        decay_in_norm: bool. The gradient norm is that of `g + decay * w`.
        ratio: function `(weight_norms, grad_norms, decays, dtype) -> ratios`,
            the trust-ratio formula on vectors (one entry per variable).

    Returns:
        A list with one scalar per variable in its compute dtype: the ratio
        of adapted dense variables, 1 for the other dense ones, and `None`
        for sparse gradients.
    """
    ratios = [None] * len(variables)
    by_dtype = {}
    for position, (grad, variable) in enumerate(zip(grads, variables, strict=True)):
        if isinstance(grad, tf.IndexedSlices):
            continue
        dtype = compute_dtype(variable)
        ratios[position] = tf.constant(1.0, dtype)
        if adapted[position]:
            by_dtype.setdefault(dtype, []).append(position)
    for dtype, positions in by_dtype.items():
        weights, grads_in_norm = [], []
        for p in positions:
            weight = tf.cast(variables[p], dtype)
            grad = tf.cast(grads[p], dtype)
            if decay_in_norm and decays[p] != 0.0:
                grad = grad + tf.constant(decays[p], dtype) * weight
            weights.append(weight)
            grads_in_norm.append(grad)
        both = norms(weights + grads_in_norm)
        vector = ratio(
            both[: len(positions)],
            both[len(positions) :],
            tf.constant([decays[p] for p in positions], dtype),
            dtype,
        )
        for k, p in enumerate(positions):
            ratios[p] = vector[k]
    return ratios


# ----------------------------------------------------------- 2. fused momentum


def momentum_step(variable, slot, gradient, rate, momentum, nesterov):
    """`v <- mu*v + gradient; w <- w - rate*v` (Nesterov: `w <- w - rate*(gradient
    + mu*v)`) in one fused kernel pass.

    Args:
        variable: the variable (`keras.Variable` or `tf.Variable`).
        slot: its momentum slot (`keras.Variable`).
        gradient: tensor added to the slot, in the variable's dtype.
        rate: scalar tensor the slot is applied with.
        momentum: float, `mu`.
        nesterov: bool.
    """
    target = variable.value if isinstance(variable, keras.Variable) else variable
    tf.raw_ops.ResourceApplyMomentum(
        var=target.handle,
        accum=slot.value.handle,
        lr=rate,
        grad=gradient,
        momentum=tf.constant(momentum, variable.dtype),
        use_locking=False,
        use_nesterov=nesterov,
    )


def scaled_step(variable, scale, step):
    """`w <- w - scale * step` in one fused kernel pass.

    Stands in for `self.assign_sub(variable, scale * step)`: TensorFlow's
    `ResourceApplyGradientDescent` reads `w` and `step` once and writes `w`
    in place, where the two ops make and read back a temporary the size of
    `w` (`TrustRatio`'s final write).

    Args:
        variable: the variable (`keras.Variable` or `tf.Variable`).
        scale: scalar tensor in the variable's dtype.
        step: tensor of the variable's shape and dtype.
    """
    target = variable.value if isinstance(variable, keras.Variable) else variable
    tf.raw_ops.ResourceApplyGradientDescent(
        var=target.handle, alpha=scale, delta=step, use_locking=False
    )


# ------------------------------------------------------ 3. compiled eager apply


class _FunctionCache(dict):
    """Compiled `apply` functions by variable list; never tracked or saved."""


class CompiledApply:
    """Mixin: an eager `apply` runs as one XLA-compiled function.

    Put it before `keras.optimizers.Optimizer` in the bases. The optimizer's
    `jit_compile` attribute (default True) switches it; it never applies
    inside `tf.function`, under a multi-replica strategy, or with a plain
    Python callable learning rate (a compiled step would freeze the value the
    callable returned when the step was traced).
    """

    def _init_compiled_apply(self):
        self.jit_compile = True
        self._compiled_apply = _FunctionCache()

    def apply(self, grads, trainable_variables=None):
        """Applies gradients; eagerly, as one compiled function.

        Same contract as `keras.optimizers.Optimizer.apply`.
        """
        if not self._should_compile_apply():
            return super().apply(grads, trainable_variables)
        grads = [gradient_as_tensor(g) for g in grads]
        if trainable_variables is None:
            if not self.built:
                return super().apply(grads, trainable_variables)
            trainable_variables = _internals.trainable_variables_of(self)
        trainable_variables = list(trainable_variables)
        if not grads:
            return None
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        _internals.check_variables_are_known(self, trainable_variables)
        key = tuple(id(v) for v in trainable_variables)
        compiled = self._compiled_apply.get(key)
        if compiled is None:

            def apply_all(gradients):
                keras.optimizers.Optimizer.apply(self, gradients, trainable_variables)

            compiled = tf.function(apply_all, jit_compile=True, autograph=False)
            self._compiled_apply[key] = compiled
        compiled(grads)
        return None

    def _should_compile_apply(self):
        if not self.jit_compile or not tf.executing_eagerly():
            return False
        learning_rate = _internals.learning_rate_setting(self)
        if callable(learning_rate) and not isinstance(
            learning_rate,
            keras.Variable | keras.optimizers.schedules.LearningRateSchedule,
        ):
            return False
        if tf.distribute.has_strategy():
            if tf.distribute.get_strategy().num_replicas_in_sync > 1:
                return False
        return True
