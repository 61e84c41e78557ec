"""Where Keras releases differ in what tf_lars's workarounds touch: one shim each.

Each function names the releases it covers (measured).
"""


def first_batch_iterator(epoch_iterator):
    """The iterator of an epoch's first step from Keras's TF epoch iterator.

    Keras 3.5 and 3.6 have only `enumerate_epoch()`, yielding (step,
    iterator); Keras 3.11 (3.11.3 measured) and newer iterate the epoch
    iterator itself to (begin step, end step, iterator).
    """
    if hasattr(epoch_iterator, "__iter__"):
        for _, _, batches in epoch_iterator:
            return batches
    else:
        for _, batches in epoch_iterator.enumerate_epoch():
            return batches
    return None
