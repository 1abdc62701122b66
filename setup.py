"""The package list, discovered: every package under pipeline/ ships, plus the
top-level schemas/ as the package data of ``pipeline.schemas`` (pyproject.toml
maps that directory). A hand-kept list once left ``pipeline.ingest`` out of the
wheel; the rest of the configuration is in pyproject.toml."""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["pipeline", "pipeline.*"]) + ["pipeline.schemas"])
