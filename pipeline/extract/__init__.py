"""Extraction stage: run a causal LM once over a corpus and write shards.

``run_extraction(model, corpus, out, **settings) -> manifest`` is the Python
API (the ``fullece extract`` command wraps it). torch and transformers are
imported only when it runs.
"""

from __future__ import annotations

from pipeline.extract.errors import ExtractError, NonFiniteLogitsError

__all__ = ["ExtractError", "NonFiniteLogitsError", "run_extraction"]


def run_extraction(model, corpus, out, **settings) -> dict:
    """Extract `corpus` with the local causal LM directory `model` into run dir `out`.

    See :func:`pipeline.extract.run.run_extraction` for the settings.
    """
    from pipeline.extract.run import run_extraction as _run

    return _run(model, corpus, out, **settings)
