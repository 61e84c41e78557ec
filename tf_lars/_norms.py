"""Batched L2 norms for the LARS trust ratio."""

import tensorflow as tf


def _squared_norm(tensor):
    return tf.reduce_sum(tf.square(tensor))


def weight_and_gradient_norms(weights, gradients, decays, dtypes):
    """Returns `(weight_norms, gradient_norms)`, one scalar per variable.

    Args:
        weights: list of variables or tensors.
        gradients: list of dense gradients, same length.
        decays: list of floats or `None`. When given, the gradient norm is
            that of `g + decay * w` (the decayed gradient).
        dtypes: list of compute dtypes (float32 or float64), one a variable.
    """
    weight_norms = []
    gradient_norms = []
    for index, (weight, gradient, dtype) in enumerate(
        zip(weights, gradients, dtypes, strict=True)
    ):
        weight = tf.cast(weight, dtype)
        gradient = tf.cast(gradient, dtype)
        if decays is not None and decays[index] != 0.0:
            gradient = gradient + tf.constant(decays[index], dtype) * weight
        weight_norms.append(tf.sqrt(_squared_norm(weight)))
        gradient_norms.append(tf.sqrt(_squared_norm(gradient)))
    return weight_norms, gradient_norms
