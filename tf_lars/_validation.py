"""Type predicates shared by the argument checks of tf_lars's modules."""

import numbers


def is_real(value):
    """A real number (Python or NumPy), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_int(value):
    """An integer (Python or NumPy), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
