"""Fixtures shared by the test modules.

Models and runs built here are shared for the whole session and are read-only:
a test that changes one works on a copy (``shutil.copytree``)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory):
    """The tiny random-weight GPT-2 of the extraction tests (K = 512, output layer
    scaled by 0.5; tests/helpers/extract_models.py), saved once per session."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.helpers.extract_models import build_gpt2

    return build_gpt2(tmp_path_factory.mktemp("tiny-gpt2") / "gpt2", scale=0.5)
