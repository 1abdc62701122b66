"""The package's version, the bin counts every layer shares and the memory
limit's default (with its parse: the commands' options check it without
importing the aggregation).

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

# --memory-limit: DuckDB's units (a unit is needed)
DEFAULT_MEMORY_LIMIT = "1GB"
MIN_MEMORY_LIMIT = 16 * 10**6  # below it DuckDB cannot even start its reduce
# The map's share of it for the first shard, taken twice at most: its batches
# decoded ahead of the map, and its positions file read whole by the prehash
# (``pipeline.store.hashes``) when it fits: 1/FIRST_READ_SHARE each
FIRST_READ_SHARE = 8
_UNITS = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def size_bytes(text: str) -> int | None:
    """'1GB', '512MiB', '2 gb' -> bytes; None when not a plain size."""
    import re

    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        return None
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def memory_limit_problem(memory_limit: str) -> str | None:
    """What is wrong with a --memory-limit such as '1GB', '512MB', '2GiB' (None: nothing)."""
    budget = size_bytes(memory_limit)
    if not budget:
        return f"{memory_limit!r} is not a size such as 1GB, 512MB or 2GiB"
    if budget < MIN_MEMORY_LIMIT:
        return f"--memory-limit {memory_limit!r}: at least 16MB is needed"
    return None
