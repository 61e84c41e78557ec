"""The TensorFlow backend's subclasses of LARS, TrustRatio and LAMB.

Keras's own pattern for a backend's fast path (`keras/src/backend/torch/
optimizers/torch_adam.py` subclasses `Adam`): `tf_lars.LARS(...)` on the
TensorFlow backend constructs `LARS` below (`tf_lars/backend/__init__.py`),
which overrides methods of the portable rule with what TensorFlow runs
faster or has alone. tests/backends_rules_test.py holds each override equal
to the portable rule; `python benchmarks/bench.py` measures what each saves
(docs/guides/benchmarks.md, "Speed"):

1. **Norms** (`sum_of_squares`): under XLA a large tensor's squares are
   folded into a `[rows, width]` matrix times a vector of ones (XLA's
   multi-threaded matrix-vector kernel, where a full reduction is one
   serial loop); without XLA, one `MatMul` of the flat tensor with itself.
2. **Fused writes** (`_momentum_step`, `_scaled_step`, LAMB's `update_step`):
   TensorFlow's `ResourceApplyMomentum`, `ResourceApplyGradientDescent` and
   `ResourceApplyAdam` update a slot and a variable in one pass.
3. **Compiled eager apply** (`CompiledApply`): an eager `apply` runs as one
   `tf.function(jit_compile=True)`, traced once per list of variables.
4. **Sparse gradients** (`tf.IndexedSlices`, only TensorFlow has them):
   LARS's step 5 (sparse gradients), LAMB's sparse Adam moments,
   TrustRatio's inner step on summed rows; and LARS's cross-replica step
   under `tf.distribute`.
5. **Ratio entries at runtime positions** (`entries`), a compile-time
   matter: updates of small variables of one shape compile to one kernel.
6. **The gradient noise scale's big batch** (`GradientNoiseScale`): under a
   strategy of several replicas, the replicas' gradients as the inner
   optimizer sums them (`observed_all_reduce`), so the measurement adds no
   collective but one scalar mean; sparse gradients' rows summed.
"""

import contextlib
import threading
import weakref

import keras
import tensorflow as tf

from tf_lars import _internals, _trust, lamb, lars, noise_scale, trust_ratio
from tf_lars._validation import check_gradient_shapes
from tf_lars._wrapper import backing_variable, gradient_as_tensor, wrapped_chain
from tf_lars.backend import like
from tf_lars.backend._compiled import RecomputedNorm


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


def sum_of_squares(tensor):
    """`tf_lars._trust.sum_of_squares`: under XLA the squares folded into a
    `[rows, width]` matrix times a vector of ones; elsewhere one `MatMul` of
    the flat tensor with itself (reads it once, makes no temporary)."""
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


# Eager int32 scalars 0, 1, 2, ... (`entries`), made once per process.
_POSITIONS = []


def entries(vector, tensors):
    """`tf_lars._trust.entries`; under XLA a small variable's (`_trust.stacks`)
    at a position that is a runtime input of the program (a captured eager
    scalar), not the fixed offset `k`.

    XLA's CPU compiler compiles identical kernels once, and a fixed offset
    in each update made every small variable's update a kernel of its own
    (docs/guides/benchmarks.md, "Compile time"). Large variables keep the
    fixed offset: read at runtime positions, LARS's XLA step was slower.
    """
    if not _internals.in_xla_context():
        return _trust.entries(vector, tensors)
    with tf.init_scope():
        if not tf.executing_eagerly():
            return _trust.entries(vector, tensors)
        while len(_POSITIONS) < len(tensors):
            _POSITIONS.append(tf.constant(len(_POSITIONS), tf.int32))
    return [
        tf.gather(vector, _POSITIONS[k]) if _trust.stacks(tensor) else vector[k]
        for k, tensor in enumerate(tensors)
    ]


def norms(tensors):
    """`tf_lars._trust.norms` with `sum_of_squares` for each large tensor."""
    return _trust.norms(tensors, sum_of_squares)


# -------------------------------------------------------------- 2. fused writes


def momentum_step(optimizer, variable, slot, gradient, rate, momentum, nesterov):
    """`tf_lars.lars.LARS._momentum_step` in one `ResourceApplyMomentum` pass (the
    kernel writes `variable`, a `keras.Variable` or `tf.Variable`, itself)."""
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
    """`TrustRatio._scaled_step` in one `ResourceApplyGradientDescent` pass,
    which writes `w` in place (two ops make and read back a temporary)."""
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
    """The sparse gradient with each repeated row summed into one row (values
    cast to `dtype` if given; int64 rows). Keras's Adam, RMSprop and others
    square a `tf.IndexedSlices`'s rows one by one: a row given twice would
    add `a**2 + b**2` where the gradient's own row squares to `(a + b)**2`."""
    values = gradient.values if dtype is None else tf.cast(gradient.values, dtype)
    rows, position = tf.unique(tf.cast(gradient.indices, tf.int64))
    summed = tf.math.unsorted_segment_sum(values, position, tf.size(rows))
    return tf.IndexedSlices(summed, rows, gradient.dense_shape)


# ------------------------------------------------------ 5. LAMB's Adam direction

# LAMB's scratch buffers, by optimizer: one `tf.Variable` per variable shape
# and dtype (variables of one shape take their steps one after another on
# it), made when the first dense gradient of its shape arrives. Out of the
# optimizer, so neither Keras nor `tf.train.Checkpoint` tracks or saves them.
_BUFFERS = weakref.WeakKeyDictionary()


def direction_buffers(optimizer):
    """The scratch buffers `fused_adam_direction` made for `optimizer`, by key."""
    return _BUFFERS.setdefault(optimizer, {})


def fuses_adam(optimizer, variable):
    """Whether LAMB's steps 1 and 2 (inner step, decay) for `variable` take
    TensorFlow's fused Adam kernel (`fused_adam_direction`): without XLA and
    `tf.distribute`, in float32 or float64, with no `eps_root` and a non-zero
    `epsilon` (the kernel has no 0 / 0 guard)."""
    return (
        optimizer.eps_root == 0.0
        and optimizer.epsilon != 0.0
        and variable.dtype in (tf.float32, tf.float64)
        and not tf.distribute.has_strategy()
        and not _internals.in_xla_context()
    )


def fused_adam_scalars(optimizer, dtype, learning_rate):
    """`(scale, epsilon)` for `fused_adam_direction` in `dtype`: LAMB's
    `lr * m_hat / (sqrt(v_hat) + eps)` is `scale * m / (sqrt(v) + epsilon)`
    with `c1 = 1 - b1**t`, `c2 = 1 - b2**t`, `scale = lr sqrt(c2) / c1` and
    `epsilon = eps sqrt(c2)`, from LAMB's `_bias_corrections`; once per
    step."""

    def compute():
        lr, correction_1, correction_2 = optimizer._bias_corrections(
            dtype, learning_rate
        )
        root_2 = tf.sqrt(correction_2)
        epsilon = tf.constant(optimizer.epsilon, dtype) * root_2
        return lr / correction_1 * root_2, epsilon

    key = ("fused adam", tf.as_dtype(dtype).name, id(learning_rate))
    return optimizer._once_per_step(key, compute)


def fused_adam_direction(optimizer, gradient, variable, slots, epsilon, factor):
    """LAMB's Adam moments `slots = (m, v)` updated with `gradient`, and the
    direction `m / (sqrt(v) + epsilon) + factor * w` (`factor` None: no
    decay term), in one pass of TensorFlow's `ResourceApplyAdam` into a
    scratch buffer set to the decay term (its own bias correction off:
    `lr = -1`, both beta powers 0)."""
    m, v = slots
    dtype = variable.dtype
    buffers = direction_buffers(optimizer)
    key = (tuple(variable.shape), variable.dtype)
    if key not in buffers:
        with tf.init_scope():
            buffers[key] = tf.Variable(
                tf.zeros(variable.shape, dtype), trainable=False, name="lamb_direction"
            )
    buffer = buffers[key]
    if factor is None:
        buffer.assign(tf.zeros_like(variable))
    else:
        buffer.assign(factor * variable)
    zero = tf.zeros([], dtype)
    tf.raw_ops.ResourceApplyAdam(
        var=buffer.handle,
        m=m.value.handle,
        v=v.value.handle,
        beta1_power=zero,
        beta2_power=zero,
        lr=-tf.ones([], dtype),
        beta1=tf.constant(optimizer.beta_1, dtype),
        beta2=tf.constant(optimizer.beta_2, dtype),
        epsilon=epsilon,
        grad=tf.cast(gradient, dtype),
        use_locking=False,
        use_nesterov=False,
    )
    return tf.convert_to_tensor(buffer)


def sparse_adam_moments(optimizer, gradient, variable, slots):
    """LAMB's Adam moments `slots = (m, v)` updated with a sparse gradient:
    its repeated rows summed before they are squared, and every row of `m`
    and `v` decays (Adam on the summed dense gradient, never densified)."""
    m, v = slots
    dtype = variable.dtype
    gradient = summed_rows(gradient, dtype)
    rows, summed = gradient.indices, gradient.values
    optimizer.assign(m, m * tf.constant(optimizer.beta_1, dtype))
    added = summed * tf.constant(1 - optimizer.beta_1, dtype)
    optimizer.assign_add(m, tf.IndexedSlices(added, rows))
    optimizer.assign(v, v * tf.constant(optimizer.beta_2, dtype))
    added = tf.square(summed) * tf.constant(1 - optimizer.beta_2, dtype)
    optimizer.assign_add(v, tf.IndexedSlices(added, rows))


# ------------------------------------------------------ 3. compiled eager apply


def _settings(optimizer):
    """`optimizer`'s public Python numbers, flags and strings."""
    return tuple(
        (name, value)
        for name, value in vars(optimizer).items()
        if not name.startswith("_") and isinstance(value, bool | int | float | str)
    )


class CompiledApply:
    """Mixin (first in the bases): an eager `apply` runs as one XLA-compiled
    function, switched by `jit_compile` (default True); not inside
    `tf.function`, under several replicas, or with a plain callable learning
    rate (a compiled step would freeze the value it returned)."""

    def apply(self, grads, trainable_variables=None):
        """`keras.optimizers.Optimizer.apply`, eagerly as one compiled function."""
        if not self._should_compile_apply() or (
            trainable_variables is None and not self.built
        ):
            return super().apply(grads, trainable_variables)
        grads = [gradient_as_tensor(g) for g in grads]
        if trainable_variables is None:
            trainable_variables = list(_internals.trainable_variables_of(self))
            if len(grads) == len(trainable_variables):
                check_gradient_shapes(grads, trainable_variables)
        else:
            trainable_variables = list(trainable_variables)
            check_gradient_shapes(grads, trainable_variables)
        if not grads:
            return None
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        _internals.check_variables_are_known(self, trainable_variables)
        # Traced again for a new learning rate object or hyperparameter of
        # the chain, which the traced step holds as constants.
        settings = tuple(
            (id(_internals.learning_rate_setting(one)), *_settings(one))
            for one in wrapped_chain(self)
        )
        key = (tuple(id(v) for v in trainable_variables), settings)
        # Kept in `__dict__`: never tracked by Keras or TensorFlow, or saved.
        cache = self.__dict__.setdefault("_compiled_apply", {})
        compiled = cache.get(key)
        if compiled is None:

            def apply_all(gradients):
                keras.optimizers.Optimizer.apply(self, gradients, trainable_variables)

            compiled = tf.function(apply_all, jit_compile=True, autograph=False)
            cache[key] = compiled
        compiled(grads)
        return None

    def _should_compile_apply(self):
        if not self.jit_compile or not tf.executing_eagerly():
            return False
        # A plain callable rate, this optimizer's or one it wraps (TrustRatio's
        # and LAMB's is their inner optimizer's), is read at every step.
        for optimizer in wrapped_chain(self):
            learning_rate = _internals.learning_rate_setting(optimizer)
            if callable(learning_rate) and not isinstance(
                learning_rate,
                keras.Variable | keras.optimizers.schedules.LearningRateSchedule,
            ):
                return False
        if tf.distribute.has_strategy():
            if tf.distribute.get_strategy().num_replicas_in_sync > 1:
                return False
        return True


# --------------------------------------------------------------- the subclasses


class _Norms:
    """The folded norms and the ratio entries at runtime positions (1, 5)."""

    def _norms(self, tensors):
        return norms(tensors)

    def _entries(self, vector, tensors):
        return entries(vector, tensors)


# `tf_lars.LARS` on TensorFlow: fused momentum, folded norms, sparse rows
# (step 5 (sparse gradients)) and the cross-replica step. (`like` gives the
# subclasses the public class's docstring.)
@like(lars.LARS)
class LARS(_Norms, CompiledApply, lars.LARS):
    def _is_dense(self, gradient):
        return not is_sparse(gradient)

    def _momentum_step(self, variable, slot, gradient, rate):
        momentum_step(
            self, variable, slot, gradient, rate, self.momentum, self.nesterov
        )

    def _decayed(self, gradient, variable, decay):
        # `g - (-wd) w` (the same values): an expression XLA does not share
        # with the `g + wd w` of step 4 (momentum), so the norm sums it in its
        # own pass instead of reading it back as large as the variable.
        negated = tf.constant(-decay, gradient.dtype)
        return lambda: gradient - negated * variable

    def update_step(self, gradient, variable, learning_rate, ratio=None):
        if is_sparse(gradient):  # Step 5 (sparse gradients).
            index = _internals.variable_index(self, variable)
            slot = self.momentums[index] if self.momentum != 0 else None
            sparse_momentum_step(self, gradient, variable, learning_rate, slot)
            return
        super().update_step(gradient, variable, learning_rate, ratio=ratio)

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        # Under any `tf.distribute` strategy: the ratios of the gradients
        # summed across replicas, in replica context (the same on every
        # replica), then each variable's update through the strategy, as
        # Keras's own TensorFlow optimizer does.
        tf_variables = [backing_variable(v) for v in trainable_variables]
        grads_and_vars = _internals.all_reduce_sum_gradients(
            self, list(zip(grads, tf_variables))
        )
        grads = [g for g, _ in grads_and_vars]
        ratios, recorded = self._trust_ratios(grads, tf_variables)
        self._record_trust_ratios(tf_variables, recorded)

        def update(distribution, grads_and_vars, ratios, learning_rate):
            for (gradient, variable), ratio in zip(grads_and_vars, ratios, strict=True):
                distribution.extended.update(
                    variable,
                    lambda v, g, r, lr: self.update_step(g, v, lr, ratio=r),
                    args=(gradient, ratio, learning_rate),
                    group=False,
                )

        _internals.maybe_merge_call(
            update,
            _internals.distribution_strategy(self),
            grads_and_vars,
            ratios,
            learning_rate,
        )


class _TrustRatioSteps(_Norms, CompiledApply):
    """TrustRatio's and LAMB's overrides: folded norms, fused writes, ratios
    batched outside `tf.distribute` (a strategy steps each variable in its
    own update context), and sparse gradients."""

    def _scaled_step(self, variable, scale, step):
        scaled_step(self, variable, scale, step)

    def _batches_trust_ratios(self):
        return not tf.distribute.has_strategy()

    def update_step(self, gradient, variable, learning_rate):
        if not is_sparse(gradient):
            return super().update_step(gradient, variable, learning_rate)
        # LAMB's step 6 (sparse gradients): the inner optimizer's own update, on the
        # gradient with repeated rows summed.
        inner = self.inner_optimizer
        type(inner).update_step(inner, summed_rows(gradient), variable, learning_rate)


@like(trust_ratio.TrustRatio)
class TrustRatio(_TrustRatioSteps, trust_ratio.TrustRatio):
    pass


# `tf_lars.LAMB` on TensorFlow: also Adam's fused kernel and sparse rows.
@like(lamb.LAMB)
class LAMB(RecomputedNorm, _TrustRatioSteps, lamb.LAMB):
    def _recomputes_for_norms(self, direction):
        return _internals.in_xla_context()

    def update_step(self, gradient, variable, learning_rate):
        if is_sparse(gradient):
            return self._sparse_step(gradient, variable, learning_rate)
        if not fuses_adam(self, variable):
            return lamb.LAMB.update_step(self, gradient, variable, learning_rate)
        index = _internals.variable_index(self, variable)
        slots = _internals.adam_slots(self.inner_optimizer, index)
        decay = self._variable_weight_decay[index]
        # LAMB's steps 1 and 2 (inner step, decay) in one pass of the kernel:
        # lr * u = scale * (m / (sqrt(v) + epsilon) + factor * w).
        scale, epsilon = fused_adam_scalars(self, variable.dtype, learning_rate)
        factor = None
        if decay != 0.0:
            factor = _trust.decay_factor(scale, learning_rate, decay)
        direction = fused_adam_direction(
            self, gradient, variable, slots, epsilon, factor
        )
        # LAMB's steps 3 to 5 (trust ratio, clip, update).
        self._take_step(index, variable, scale, direction, learning_rate)

    def _sparse_step(self, gradient, variable, learning_rate):
        # LAMB's step 6 (sparse gradients): Adam's step, no ratio, no decay.
        index = _internals.variable_index(self, variable)
        m, v = _internals.adam_slots(self.inner_optimizer, index)
        sparse_adam_moments(self, gradient, variable, (m, v))
        lr, correction_1, correction_2 = self._bias_corrections(
            variable.dtype, learning_rate
        )
        update = self._direction(
            m, v, correction_1, correction_2, self.epsilon, self.eps_root
        )
        self.assign_sub(variable, lr * update)


# ------------------------------------------------ 6. the gradient noise scale


# The observer of the thread in an `observed_all_reduce` block, if any.
_OBSERVERS = threading.local()
_ALL_REDUCE = "_all_reduce_sum_gradients"


@contextlib.contextmanager
def observed_all_reduce(optimizer, observe):
    """For the block, `observe(grads_and_vars, reduced)` sees each cross-replica
    gradient sum of `optimizer` and of the optimizers it wraps, taken in the
    thread that entered it (MirroredStrategy runs each replica in a thread).

    What it relies on: Keras's `TFOptimizer._backend_update_step` (Keras 3.8
    to 3.15.1) sums the replicas' gradients in replica context by calling
    `self._all_reduce_sum_gradients(grads_and_vars)`, and so do tf_lars's
    LARS and, through their inner optimizer's step, TrustRatio and LAMB. The
    method is wrapped once on each instance (`__dict__`, untracked) and
    passes everything through outside a block. A release that sums another
    way leaves nothing observed, which `GradientNoiseScale` refuses
    (tests/mirrored_script.py, `noise_scale`, fails).
    """
    for wrapped in wrapped_chain(optimizer):
        if not isinstance(wrapped, keras.optimizers.Optimizer):
            break
        if _ALL_REDUCE not in vars(wrapped):
            reduce = _internals.private_member(
                wrapped, _ALL_REDUCE, "GradientNoiseScale"
            )

            def observed(grads_and_vars, reduce=reduce):
                reduced = reduce(grads_and_vars)
                observer = getattr(_OBSERVERS, "observe", None)
                if observer is not None:
                    observer(list(grads_and_vars), reduced)
                return reduced

            wrapped.__dict__[_ALL_REDUCE] = observed
    outer = getattr(_OBSERVERS, "observe", None)
    _OBSERVERS.observe = observe
    try:
        yield
    finally:
        _OBSERVERS.observe = outer


@like(noise_scale.GradientNoiseScale)
class GradientNoiseScale(noise_scale.GradientNoiseScale):
    def _replicas(self):
        context = tf.distribute.get_replica_context()
        return 1 if context is None else context.num_replicas_in_sync

    def _squared_norm(self, grads):
        total = tf.zeros((), tf.float32)
        for gradient in grads:
            if gradient is None:
                continue
            if is_sparse(gradient):
                gradient = summed_rows(gradient).values
            total += sum_of_squares(tf.cast(gradient, tf.float32))
        return total

    def _step_norms(self, grads, trainable_variables):
        # Under R replicas: `fit` divides each replica's loss by R, so a
        # replica's batch has the gradient R * g_r, and the sum the inner
        # optimizer applies is the big batch's.
        replicas = self._replicas()
        if replicas == 1:
            return super()._step_norms(grads, trainable_variables)
        sums = []

        def observe(grads_and_vars, reduced):
            own = self._squared_norm([g for g, _ in grads_and_vars])
            sums.append(
                (own * float(replicas**2), self._squared_norm([g for g, _ in reduced]))
            )

        with observed_all_reduce(self.inner_optimizer, observe):
            self.inner_optimizer.apply(grads, trainable_variables)
        if len(sums) != 1:
            raise ValueError(
                "GradientNoiseScale reads the big batch's gradient from the "
                "inner optimizer's cross-replica sum, which "
                f"{type(self.inner_optimizer).__name__} did not take once "
                f"(taken {len(sums)} times). Received: "
                f"inner_optimizer={self.inner_optimizer!r}"
            )
        ((small, big),) = sums
        context = tf.distribute.get_replica_context()
        small = context.all_reduce(tf.distribute.ReduceOp.MEAN, small)
        return small, big, float(replicas)


#: Public class -> its TensorFlow subclass; LAMB before TrustRatio (its base),
#: so that a user's subclass of LAMB gets LAMB's.
SUBCLASSES = {
    lars.LARS: LARS,
    lamb.LAMB: LAMB,
    trust_ratio.TrustRatio: TrustRatio,
    noise_scale.GradientNoiseScale: GradientNoiseScale,
}
