"""tf_lars: LARS, loss scaling and AGN optimizers for TensorFlow 2 / Keras 3."""

__version__ = "0.1.0"

from tf_lars import callbacks as callbacks
from tf_lars import schedules as schedules
from tf_lars.agn import AGN
from tf_lars.lars import LARS
from tf_lars.loss_scale import LossScaleOptimizer
from tf_lars.schedules import WarmupPolynomialDecay

# Public names, kept sorted. Helpers add their import above and name here.
__all__ = [
    "AGN",
    "LARS",
    "LossScaleOptimizer",
    "WarmupPolynomialDecay",
]
