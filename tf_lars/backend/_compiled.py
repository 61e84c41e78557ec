"""What the compiled backends' LAMB subclasses share (TensorFlow under XLA,
JAX under `jax.jit`): the norm of step 3 (trust ratio) computes `u` again
from `m`, `v` and `w`, summed in the pass that reads them, instead of
writing `u` out and reading it back (docs/guides/benchmarks.md, "LAMB under
XLA"). For models of at least `RECOMPUTED_FROM` parameters: below, the
tensors stay in the CPU's caches and computing `u` twice costs more than
storing it (docs/guides/backends.md, "LAMB's jitted step").
"""

import math

from keras import ops

from tf_lars import _trust

RECOMPUTED_FROM = 2**22


class RecomputedNorm:
    """Mixin for a LAMB subclass; the subclass says when a compiler sees the
    whole step (`_recomputes_for_norms`) and how to keep values apart."""

    def _apart(self, tensors):
        return tuple(tensors)

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        size = sum(math.prod(variable.shape) for variable in variables)
        self._recomputes = size >= RECOMPUTED_FROM

    def _for_norm(self, update, m, v, variable, correction_1, correction_2, decay):
        # A small `u` is copied into its shape's stack for the norm anyway.
        if not (
            self._recomputes
            and self._recomputes_for_norms(update)
            and not _trust.stacks(update)
        ):
            return update
        return _recomputed(self, m, v, variable, correction_1, correction_2, decay)


def _recomputed(optimizer, m, v, variable, correction_1, correction_2, decay):
    """A function computing LAMB's `u` again from `m`, `v` and `w`.

    The same values as `LAMB.update_step`'s `u`; `abs` (v >= 0) only makes
    the expression a different one, so that XLA does not share the two. The
    scalars pass `_apart` with `v`: on JAX, XLA would otherwise fold their
    arithmetic into a broadcast and write it out as large as `v` before the
    norm reads it (docs/guides/backends.md).
    """
    dtype = variable.dtype
    m, v, weights = (ops.convert_to_tensor(x) for x in (m, v, variable))
    scalars = [correction_1, correction_2] + [
        ops.convert_to_tensor(x, dtype)
        for x in (optimizer.epsilon, optimizer.eps_root, decay)
    ]

    def for_norm():
        v_kept, c_1, c_2, epsilon, eps_root, wd = optimizer._apart([v, *scalars])
        update = optimizer._direction(m, ops.abs(v_kept), c_1, c_2, epsilon, eps_root)
        return update if decay == 0.0 else update + wd * weights

    return for_norm
