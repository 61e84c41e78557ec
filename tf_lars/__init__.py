"""tf_lars: LARS, loss scaling and AGN optimizers for TensorFlow 2 / Keras 3."""

__version__ = "0.1.0"

from tf_lars.lars import LARS

# Public names, kept sorted. Helpers add their import above and name here.
__all__ = [
    "LARS",
]
