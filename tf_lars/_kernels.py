"""The kernels the update rules call, chosen once per process by backend.

`tf_lars._rules` holds every kernel in `keras.ops` (every backend). On the
TensorFlow backend `tf_lars._tf_fast` overrides the ones TensorFlow runs
faster or differently (sparse rows, `tf.distribute`, fused writes, the
compiled eager apply), under the same names and signatures and with the
same results (tests/backends_rules_test.py holds them equal). `lars.py`,
`lamb.py` and `trust_ratio.py` import this module as `_kernels` and never
ask which backend they run on.
"""

import keras

if keras.backend.backend() == "tensorflow":
    from tf_lars._tf_fast import (  # noqa: F401
        Apply,
        adam_direction,
        batches_trust_ratios,
        entries,
        is_sparse,
        momentum_step,
        norms,
        recomputes_for_norms,
        scaled_step,
        sparse_momentum_step,
        summed_rows,
        update_with_ratios,
    )
else:
    from tf_lars._rules import (  # noqa: F401
        Apply,
        adam_direction,
        batches_trust_ratios,
        entries,
        is_sparse,
        momentum_step,
        norms,
        recomputes_for_norms,
        scaled_step,
        update_with_ratios,
    )
