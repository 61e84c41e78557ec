"""The TensorFlow backend's fast path for LARS, TrustRatio and LAMB.

Imported only on the TensorFlow backend (`tf_lars/_kernels.py`). Each
function here overrides the portable rule of the same name and signature
in `tf_lars/_rules.py` (or, for LAMB's direction, in `tf_lars/lamb.py`) and
gives its numbers; tests/backends_rules_test.py calls both and compares.
How much each one saves is measured by `python benchmarks/bench.py` (the
tables and their commands are in docs/guides/benchmarks.md, "Speed"); no
figure is kept here, where it would go stale.

1. **Batched, folded norms** (`norms`): under XLA on CPU a full reduction to
   a scalar is one serial loop with one accumulator, several times slower
   than memory allows. Folding the squared tensor into a `[rows, width]`
   matrix and multiplying by a vector of ones hands the work to XLA's
   vectorized, multi-threaded matrix-vector kernel. Without XLA
   (`model.fit`'s CPU default) each norm is one `MatMul` of the flattened
   tensor with itself, which reads it once and makes no temporary
   (`_internals.in_xla_context` tells the two cases apart; `python benchmarks/bench.py
   --only no-xla` compares it with `reduce_sum(square(x))`, the portable
   rule). Under XLA, LAMB's norm of its direction takes a function that
   computes the direction again from `m`, `v` and `w` (`recomputes_for_norms`,
   `tf_lars.lamb.lamb_direction`), so the folded sum reads those instead of
   a stored copy of the direction.
2. **Fused writes** (`momentum_step`, `scaled_step`, `lamb_direction`):
   TensorFlow's `ResourceApplyMomentum`, `ResourceApplyGradientDescent` and
   `ResourceApplyAdam` kernels update a slot and a variable in one pass,
   where separate assignments read the new slot back.
3. **Compiled eager apply** (`CompiledApply`): an eager `apply` (custom loops
   without `tf.function`) runs as one `tf.function(jit_compile=True)`,
   traced once per list of variables, instead of one kernel launch per op.
4. **Sparse gradients** (`tf.IndexedSlices`, only TensorFlow has them):
   LARS's row-wise momentum (`sparse_momentum_step`) and LAMB's sparse Adam
   moments (`sparse_adam_moments`), and the cross-replica step of LARS under
   `tf.distribute` (`update_with_ratios`).
5. **Ratio entries at runtime positions** (`entries`): a compile-time
   matter only. Under XLA each variable reads its trust ratio at a position
   that is an input of the compiled program, so the updates of variables of
   one shape are identical kernels, compiled once.
"""

import keras
import numpy as np
import tensorflow as tf

from tf_lars import _internals, _rules
from tf_lars._wrapper import gradient_as_tensor


def is_sparse(gradient):
    """Whether `gradient` is a `tf.IndexedSlices` (touched rows only)."""
    return isinstance(gradient, tf.IndexedSlices)


# -------------------------------------------------------------------- 1. norms

# Folding widths tried in order (each must divide the element count); 128
# measured fastest on ResNet-50 shapes here, wider and narrower both slower.
_WIDTHS = (128, 96, 64, 48, 32, 16, 8)
# Below this many elements a plain reduction is as fast and skips the dot.
_SMALL = 4096


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
    (faster than `reduce_sum(square(x))`: `python benchmarks/bench.py --only
    no-xla`).
    """
    size = tensor.shape.num_elements()
    if size is None or size < _SMALL:
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


def recomputes_for_norms(tensor):
    """Under XLA (`jit_compile`): `tf_lars._rules.recomputes_for_norms`."""
    del tensor  # the XLA context decides
    return _internals.in_xla_context()


def batches_trust_ratios(gradients):
    """Under XLA (`jit_compile`) and outside `tf.distribute`:
    `tf_lars._rules.batches_trust_ratios`. A strategy takes each variable's
    step in its own update context (`extended.update`), so there every
    variable's ratio is taken with its step."""
    del gradients  # the XLA context decides
    return _internals.in_xla_context() and not tf.distribute.has_strategy()


def _rescaled_norms(rows):
    """`_rescaled_norm` of each row of `rows` (`_rules.stacked`), as one vector."""
    peaks = tf.reduce_max(tf.abs(rows), axis=1)
    peaks = tf.where(peaks > 0, peaks, tf.ones_like(peaks))
    root = tf.sqrt(peaks)[:, None]  # twice, as in `tf_lars._rules._rescaled_norms`
    return peaks * tf.sqrt(tf.reduce_sum(tf.square(rows / root / root), axis=1))


# Eager int32 scalars 0, 1, 2, ... (`entries`), made once per process.
_POSITIONS = []


def entries(vector, tensors):
    """`tf_lars._rules.entries`: `vector[k]` for the `k`-th of `tensors`.

    Under XLA each variable's update is one kernel, and XLA's CPU compiler
    compiles identical kernels once (Keras's SGD: one per variable shape).
    `vector[k]` puts the offset `k` into the kernel of variable `k`, making
    every kernel distinct: one compile each, which dominated LARS's and
    LAMB's compile time over many small variables. For a small variable
    (`_rules.stacks`: the biases and scales a model has hundreds of) the
    offset is read instead from a captured eager scalar, a runtime input of
    the compiled program, so the kernels of small variables of one shape
    are identical again (`python benchmarks/compile_bench.py`). A large
    variable keeps the fixed offset: with every ratio read at a runtime
    position LARS's XLA step over ResNet-50's shapes was slower
    (docs/guides/benchmarks.md, "Compile time"), and large shapes repeat
    less. Elsewhere, and where the outermost context is not eager, plain
    indexing.
    """
    if not _internals.in_xla_context():
        return _rules.entries(vector, tensors)
    with tf.init_scope():
        if not tf.executing_eagerly():
            return _rules.entries(vector, tensors)
        while len(_POSITIONS) < len(tensors):
            _POSITIONS.append(tf.constant(len(_POSITIONS), tf.int32))
    return [
        tf.gather(vector, _POSITIONS[k]) if _rules.stacks(tensor) else vector[k]
        for k, tensor in enumerate(tensors)
    ]


def norms(tensors):
    """Euclidean norms of `tensors` (same float dtype) as one vector.

    An entry may be a function returning the tensor, called where each norm
    is computed (`tf_lars._rules.norms` says why).

    The fast path is `sqrt(squared_norm(x))`; tensors under
    `_rules.STACKED_BELOW` elements are summed stacked by shape, one
    reduction per shape (`_rules.norm_groups`). A squared norm that is not
    finite, or below the smallest normal float, is recomputed scaled by the
    largest entry (`_rescaled_norm`), so entries of 1e19 or 1e-30 in
    float32 give their true norm instead of inf or 0. The check is one
    vector comparison; a `tf.cond` (XLA-compatible) runs the rescaling only
    when one needs it.
    """
    values = [_rules.value_of(t) for t in tensors]
    groups, rows = _rules.stacked_groups(values)
    squares = _rules.group_norms(
        values,
        groups,
        rows,
        squared_norm,
        lambda matrix: tf.reduce_sum(tf.square(matrix), axis=1),
    )
    bad = _needs_rescale(squares)

    def rescale_bad():
        # Rare (only when some norm needs it): every tensor is rescaled and
        # `tf.where` keeps the fast norm where it was fine. One branch, not
        # one `tf.cond` per tensor: hundreds of nested conditionals made
        # the step several times slower to build and run without XLA.
        rescaled = _rules.group_norms(
            tensors, groups, rows, _rescaled_norm, _rescaled_norms
        )
        return tf.where(bad, rescaled, tf.sqrt(squares))

    return tf.cond(tf.reduce_any(bad), rescale_bad, lambda: tf.sqrt(squares))


# -------------------------------------------------------------- 2. fused writes


def momentum_step(optimizer, variable, slot, gradient, rate, momentum, nesterov):
    """`_rules.momentum_step` in one fused kernel pass (`ResourceApplyMomentum`).

    Args:
        optimizer: unused (the kernel writes the variables itself).
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


def scaled_step(optimizer, variable, scale, step):
    """`_rules.scaled_step` in one fused kernel pass.

    TensorFlow's `ResourceApplyGradientDescent` reads `w` and `step` once and
    writes `w` in place, where the two ops make and read back a temporary the
    size of `w` (`TrustRatio`'s final write).

    Args:
        optimizer: unused (the kernel writes the variable itself).
        variable: the variable (`keras.Variable` or `tf.Variable`).
        scale: scalar tensor in the variable's dtype.
        step: tensor of the variable's shape and dtype.
    """
    target = variable.value if isinstance(variable, keras.Variable) else variable
    tf.raw_ops.ResourceApplyGradientDescent(
        var=target.handle, alpha=scale, delta=step, use_locking=False
    )


# ------------------------------------------------------- 4. sparse, replicas


def sparse_momentum_step(optimizer, gradient, variable, learning_rate, slot):
    """LARS's step 5 (sparse gradients): momentum on the touched rows only.

    No sort and no `tf.unique` (slow under XLA): scatter-adds sum repeated
    rows by themselves, and every other write is a scatter-update of
    values that are identical for repeated rows. Gathers go through the
    backing `tf.Variable`: reading a `keras.Variable` as a tensor would
    read every row.
    """
    dtype = variable.dtype
    rows = gradient.indices
    values = tf.cast(gradient.values, dtype)
    rate = tf.cast(learning_rate, dtype)
    target = variable.value if isinstance(variable, keras.Variable) else variable
    if slot is None:
        optimizer.assign_sub(variable, tf.IndexedSlices(rate * values, rows))
        return
    mu = tf.constant(optimizer.momentum, dtype)
    # v[i] <- mu v[i] (idempotent), then += (rate *) g once per occurrence.
    optimizer.assign(slot, tf.IndexedSlices(mu * tf.gather(slot.value, rows), rows))
    added = rate * values if optimizer.classic_momentum else values
    optimizer.assign_add(slot, tf.IndexedSlices(added, rows))
    velocity = tf.gather(slot.value, rows)
    if optimizer.nesterov:
        # The gradient part of the Nesterov step, summed over duplicates.
        optimizer.assign_sub(variable, tf.IndexedSlices(rate * values, rows))
        step = mu * velocity if optimizer.classic_momentum else rate * mu * velocity
    else:
        step = velocity if optimizer.classic_momentum else rate * velocity
    optimizer.assign(variable, tf.IndexedSlices(tf.gather(target, rows) - step, rows))


def summed_rows(gradient, dtype=None):
    """The sparse gradient with each repeated row summed into one row (its
    values cast to `dtype` first, if given; int64 row indices).

    `TrustRatio` hands this to its inner optimizer: Keras's Adam, RMSprop
    and others square the rows of a `tf.IndexedSlices` one by one, so a row
    that appears twice would contribute `a**2 + b**2` where the gradient's
    own row is `(a + b)**2` (measured: TrustRatio(Adam) moved that row 0.11
    away from Adam on the summed gradient in three steps). LAMB's sparse
    moments square the summed rows the same way (`sparse_adam_moments`).
    """
    values = gradient.values if dtype is None else tf.cast(gradient.values, dtype)
    rows, position = tf.unique(tf.cast(gradient.indices, tf.int64))
    summed = tf.math.unsorted_segment_sum(values, position, tf.size(rows))
    return tf.IndexedSlices(summed, rows, gradient.dense_shape)


def sparse_adam_moments(optimizer, gradient, m, v, one_minus_1, one_minus_2):
    """LAMB's Adam moments for a sparse gradient: repeated rows summed
    before they are squared, every row of `m` and `v` decayed (as Adam on
    the summed dense gradient), the gradient never densified."""
    dtype = m.dtype
    gradient = summed_rows(gradient, dtype)
    summed, rows = gradient.values, gradient.indices
    optimizer.assign(m, m * tf.constant(optimizer.beta_1, dtype))
    optimizer.assign_add(m, tf.IndexedSlices(summed * one_minus_1, rows))
    optimizer.assign(v, v * tf.constant(optimizer.beta_2, dtype))
    optimizer.assign_add(v, tf.IndexedSlices(tf.square(summed) * one_minus_2, rows))


def update_with_ratios(optimizer, grads, variables, learning_rate, rule):
    """`tf_lars._rules.update_with_ratios` under `tf.distribute` too (any
    strategy, or none).

    The gradients are summed across replicas; the ratios are computed in
    replica context on the summed gradients (every replica gets the same
    ratios, each computed once per step), then each variable is updated
    through the strategy, as Keras's own TensorFlow optimizer does.
    """
    tf_variables = [_internals.backing_variable(v) for v in variables]
    grads_and_vars = _internals.all_reduce_sum_gradients(
        optimizer, list(zip(grads, tf_variables))
    )
    grads = [g for g, _ in grads_and_vars]
    ratios, recorded = rule.ratios(grads, tf_variables)
    rule.record(tf_variables, recorded)

    def update(distribution, grads_and_vars, ratios, learning_rate):
        for (gradient, variable), ratio in zip(grads_and_vars, ratios, strict=True):
            distribution.extended.update(
                variable,
                lambda v, g, r, lr: rule.update(g, v, lr, r),
                args=(gradient, ratio, learning_rate),
                group=False,
            )

    _internals.maybe_merge_call(
        update,
        _internals.distribution_strategy(optimizer),
        grads_and_vars,
        ratios,
        learning_rate,
    )


# ------------------------------------------------------ 5. LAMB's fused Adam


def lamb_fusable(variable):
    """Whether LAMB's direction can be one `ResourceApplyAdam` pass: float32
    or float64, not under XLA (it compiles the plain ops as well) and not
    under `tf.distribute` (the kernel writes a scratch buffer)."""
    return (
        variable.dtype in (tf.float32, tf.float64)
        and not tf.distribute.has_strategy()
        and not _internals.in_xla_context()
    )


def lamb_direction(lamb, gradient, variable, learning_rate, decay):
    """`tf_lars.lamb.lamb_direction` in one kernel pass (see `lamb_fusable`).

    A scratch `tf.Variable` of the variable's shape (`DirectionBuffers`) is
    set to the decay term; TensorFlow's `ResourceApplyAdam` kernel then
    updates `m` and `v` exactly as the portable rule does and adds
    `m / (sqrt(v) + eps * sqrt(1 - b2**t))` to it, in one pass over the
    gradient, `m`, `v` and the buffer (its own bias correction is switched
    off: `lr = -1`, both beta powers 0, so it adds the direction).
    Returns `(scale, direction, direction)`: the norm reads the buffer too.
    """
    adam = lamb.inner_optimizer
    dtype = variable.dtype
    m, v = _internals.adam_slots(adam, _internals.variable_index(adam, variable))
    # The scale depends on the step count and the rate only, so it is known
    # before the kernel runs (the decay term needs it).
    scale = adam.direction_scale(dtype, learning_rate)
    buffer = lamb._direction_buffers.get(variable)
    if decay == 0.0:
        buffer.assign(tf.zeros_like(variable))
    else:
        buffer.assign(lamb._decay_factor(scale, learning_rate, decay) * variable)
    zero = tf.zeros([], dtype)
    tf.raw_ops.ResourceApplyAdam(
        var=buffer.handle,
        m=m.value.handle,
        v=v.value.handle,
        beta1_power=zero,
        beta2_power=zero,
        lr=-tf.ones([], dtype),
        beta1=tf.constant(adam.beta_1, dtype),
        beta2=tf.constant(adam.beta_2, dtype),
        epsilon=adam.bias_corrected_epsilon(dtype),
        grad=tf.cast(gradient, dtype),
        use_locking=False,
        use_nesterov=False,
    )
    direction = tf.convert_to_tensor(buffer)
    return scale, direction, direction


def direction_buffers():
    """`tf_lars._rules.direction_buffers`: LAMB's scratch buffers."""
    return DirectionBuffers()


class DirectionBuffers:
    """One scratch `tf.Variable` per variable shape and dtype, for `LAMB`.

    `lamb_direction` writes the direction into a buffer; variables of one
    shape share it (their updates run one after another on it). A buffer is
    made the first time a dense gradient of its shape arrives, so
    sparse-only variables (embedding tables) never get one. A plain object,
    not a list or dict: neither Keras nor `tf.train.Checkpoint` tracks it,
    so buffers are never saved and checkpoints are unchanged.
    """

    def __init__(self):
        self._buffers = {}

    def get(self, variable):
        key = (tuple(variable.shape), variable.dtype)
        buffer = self._buffers.get(key)
        if buffer is None:
            with tf.init_scope():
                buffer = tf.Variable(
                    tf.zeros(variable.shape, variable.dtype),
                    trainable=False,
                    name="lamb_direction",
                )
            self._buffers[key] = buffer
        return buffer

    def __len__(self):
        return len(self._buffers)


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


Apply = CompiledApply
