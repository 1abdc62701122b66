"""The package's version and the bin counts every layer shares.

A leaf module: it imports nothing, so any module may import it without importing
the package root (``pipeline/__init__.py`` re-exports these names).
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
