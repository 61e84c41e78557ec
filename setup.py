"""Packaging for tf_lars."""

import pathlib
import re

from setuptools import find_packages, setup

HERE = pathlib.Path(__file__).parent
VERSION = re.search(
    r'^__version__ = "([^"]+)"',
    (HERE / "tf_lars" / "__init__.py").read_text(encoding="utf-8"),
    re.M,
).group(1)

setup(
    name="tf_lars",
    version=VERSION,
    description=(
        "LARS, loss scaling and AGN optimizers for TensorFlow 2 / Keras 3 "
        "large-batch and distributed training"
    ),
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.11",
    packages=find_packages(include=["tf_lars", "tf_lars.*"]),
    package_data={"tf_lars": ["configs/*.yaml"]},
    include_package_data=True,
    install_requires=[
        "tensorflow==2.21.*",
        "keras>=3.15",
        "numpy",
        "absl-py",
        "pyyaml",
        "matplotlib",
        "scikit-learn",
    ],
    extras_require={
        "test": ["pytest>=8", "ruff==0.17.5"],
        "bench": ["jax", "optax"],
    },
    entry_points={"console_scripts": ["tf-lars=tf_lars.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3.11",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
