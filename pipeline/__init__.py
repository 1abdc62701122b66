"""fullece: token-level calibration (ECE, cw-ECE, Full-ECE) of causal language models.

The analysis half (binning, tables, metrics, aggregation, SQL, reports) needs
no torch; only ``pipeline.extract`` and ``pipeline.demo.train`` import it, lazily.
"""

__version__ = "0.1.0"

DEFAULT_FINE_BINS = 1000
# The paper's M set (Table 1); every value divides DEFAULT_FINE_BINS.
PAPER_BINS = (5, 10, 20, 50, 100, 200, 500)
# The largest M a command accepts: an M that does not divide F is aggregated from
# the shards with dense per-bin arrays (O(M) memory per class row of seq/top-1
# tables), so M is capped (docs/design.md). Here, not in pipeline.analysis, so that
# the commands' options need no import of the analysis modules.
MAX_BINS = 1_000_000


def __getattr__(name):
    # Lazy re-exports: `import pipeline` stays light (no polars, pyarrow or numpy).
    if name in ("open_tables", "open_positions"):
        from pipeline.analysis import frames

        return getattr(frames, name)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
