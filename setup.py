"""Thin setuptools entry; the metadata lives in pyproject.toml's [project]."""

from setuptools import setup

setup()
