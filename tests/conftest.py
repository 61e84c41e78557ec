"""Shared test set-up: quiet TensorFlow logs and a fresh Keras state per test."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    keras.backend.clear_session()
    keras.utils.set_random_seed(1234)
    np.random.seed(1234)
    yield
