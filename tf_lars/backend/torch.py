"""`tf_lars.LARS`, `tf_lars.TrustRatio` and `tf_lars.LAMB` on the PyTorch backend.

One override, for `torch.compile` (`model.compile(jit_compile=True)`): the
norms' range check (`tf_lars._trust.norms`, one branch per step that
recomputes a norm whose squares overflowed or underflowed) is a
`torch.cond`, which Dynamo traces as one operation with both branches.
Keras's `ops.cond` on PyTorch is a Python `if` on a tensor: a graph break,
deep inside the optimizer's step, at which Dynamo traced the whole step
again once for each enclosing function, Keras's included (LAMB's first
compiled `fit` took twice as long; docs/guides/benchmarks.md, "Compile
time"). Op by op the branch stays a Python `if`: `torch.cond` out
of a compiled function compiles itself. The rules are the portable ones.
"""

import torch
from keras import ops

from tf_lars import _trust, lamb, lars, trust_ratio
from tf_lars.backend import like


def cond(pred, true_fn, false_fn):
    """`ops.cond`, as `torch.cond` where `torch.compile` traces the call."""
    if torch.compiler.is_compiling():
        return torch.cond(pred, true_fn, false_fn, ())
    return ops.cond(pred, true_fn, false_fn)


class _Norms:
    def _norms(self, tensors):
        return _trust.norms(tensors, cond=cond)


@like(lars.LARS)
class LARS(_Norms, lars.LARS):
    pass


@like(trust_ratio.TrustRatio)
class TrustRatio(_Norms, trust_ratio.TrustRatio):
    pass


@like(lamb.LAMB)
class LAMB(_Norms, lamb.LAMB):
    pass


#: Public class -> its PyTorch subclass (LAMB before TrustRatio, its base).
SUBCLASSES = {lars.LARS: LARS, lamb.LAMB: LAMB, trust_ratio.TrustRatio: TrustRatio}
