"""`tf_lars.LARS` and `tf_lars.LAMB` on the JAX backend.

What `jax.jit` needs to keep each norm in the pass that reads its inputs
(docs/guides/backends.md, "What the JAX step costs"), nothing else; the
rules are the portable ones. Two overrides:

1. LARS's "decayed" ratio takes the norm of `g + wd w` from `g`, `w` and
   `-wd` passed through `jax.lax.optimization_barrier` (`apart`), so that XLA
   shares no term with the `g + wd w` of step 4 (momentum) and sums the
   squares as it reads `g` and `w`, instead of writing `g + wd w` out as
   large as the variable.
2. LAMB's norm, when traced, computes the direction again from `m`, `v` and
   `w` (`_recomputes_for_norms`) instead of reading it back.
"""

import jax
from keras import ops

from tf_lars import lamb, lars
from tf_lars.backend import like
from tf_lars.backend._compiled import RecomputedNorm


def apart(tensors):
    """`tensors` unchanged, as values XLA will not merge with others: an
    expression of them is computed again where it is used."""
    return jax.lax.optimization_barrier(tuple(tensors))


@like(lars.LARS)
class LARS(lars.LARS):
    def _decayed(self, gradient, variable, decay):
        gradient, variable, negated = apart(
            [gradient, variable, ops.convert_to_tensor(-decay, gradient.dtype)]
        )
        return lambda: gradient - negated * variable


@like(lamb.LAMB)
class LAMB(RecomputedNorm, lamb.LAMB):
    def _apart(self, tensors):
        return apart(tensors)

    def _recomputes_for_norms(self, direction):
        # Only where the compiler sees the whole step: op by op the
        # recomputation would be extra work.
        return isinstance(direction, jax.core.Tracer)


#: Public class -> its JAX subclass.
SUBCLASSES = {lars.LARS: LARS, lamb.LAMB: LAMB}
