"""The one thing pyproject.toml cannot say: the checkout's top-level configs/ travels in the wheel as
the package data of experiments.configs, so that an installed specdec finds its Hydra configs under
its own name (experiments/common/config_dir.py) instead of a top-level ``configs`` folder."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["specdec*", "drafters*", "verifiers*", "experiments*", "benchmarks*"])
    + ["experiments.configs"],
    package_dir={"experiments.configs": "configs"},
)
