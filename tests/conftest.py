"""Fixtures shared by the test modules.

Models and runs built here are shared for the whole session and are read-only:
a test that changes one works on a copy (``shutil.copytree``)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest

_PYCACHE_ENV = "PYTHONPYCACHEPREFIX"
_OWN_PYCACHE: list[str] = []  # the prefix this process made (and removes at the end)


def pytest_configure(config):
    """Bytecode of the session, kept for every process the suite starts.

    `make install` compiles no bytecode for torch (docs/performance.md), and where
    PYTHONDONTWRITEBYTECODE=1 is set nothing caches it either: every `fullece
    extract`, torchrun launcher and rank the tests start compiled torch's ~2,300
    files again (about 3 s of CPU each). Here bytecode is written into one temporary
    directory (PYTHONPYCACHEPREFIX) that this process, its xdist workers and every
    child share, and that is removed at the end: the suite writes none into the
    checkout or the venv. A worker inherits the controller's prefix."""
    prefix = os.environ.get(_PYCACHE_ENV)
    if not prefix:
        prefix = tempfile.mkdtemp(prefix="fullece-tests-pycache-")
        os.environ[_PYCACHE_ENV] = prefix
        _OWN_PYCACHE.append(prefix)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.pycache_prefix = prefix
    sys.dont_write_bytecode = False


def pytest_unconfigure(config):
    for prefix in _OWN_PYCACHE:
        shutil.rmtree(prefix, ignore_errors=True)
        os.environ.pop(_PYCACHE_ENV, None)


@pytest.fixture(scope="session", autouse=True)
def _private_cache_of_the_session(tmp_path_factory):
    """The user's cache (tables of read-only runs, kept sums, verification stamps)
    in a directory of this session, for every test and every process it starts:
    the suite never writes into the real ~/.cache/fullece. A test that needs its
    own cache sets XDG_CACHE_HOME itself (monkeypatch restores this one)."""
    cache = tmp_path_factory.mktemp("xdg-cache")
    cache.chmod(0o700)
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(cache)
    yield cache
    if before is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = before


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory):
    """The tiny random-weight GPT-2 of the extraction tests (K = 512, output layer
    scaled by 0.5; tests/helpers/extract_models.py), saved once per session."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.helpers.extract_models import build_gpt2

    return build_gpt2(tmp_path_factory.mktemp("tiny-gpt2") / "gpt2", scale=0.5)
