"""fullece: token-level calibration (ECE, cw-ECE, Full-ECE) of causal language models.

The analysis half (binning, tables, metrics, aggregation, SQL, reports) needs
no torch; only ``pipeline.extract`` and ``pipeline.demo.train`` import it, lazily.
"""

from pipeline.defaults import DEFAULT_FINE_BINS, MAX_BINS, PAPER_BINS, __version__

__all__ = [
    "DEFAULT_FINE_BINS",
    "MAX_BINS",
    "PAPER_BINS",
    "__version__",
    "open_positions",
    "open_tables",
]


def __getattr__(name):
    # Lazy re-exports: `import pipeline` stays light (no polars, pyarrow or numpy).
    if name in ("open_tables", "open_positions"):
        from pipeline.analysis import frames

        return getattr(frames, name)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
