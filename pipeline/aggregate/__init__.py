"""Stage 2: shards -> bin tables, map (per shard) then reduce (sum).

``sql`` holds the pure SQL builders, ``executor`` runs them (DuckDB) and the
dense path for full-vocabulary shards (the metric core's accumulator).
"""

from pipeline.aggregate.executor import (
    DEFAULT_MEMORY_LIMIT,
    TABLE_NAMES,
    aggregate,
    aggregate_runs,
    build_parts,
    default_tables_dir,
    ensure_tables,
    load_run_tables,
    read_tables_meta,
    tables_dir_of,
    tables_status,
)
from pipeline.aggregate.sql import bin_sql
from pipeline.store.run import AggregateError, iter_logit_blocks, open_run, open_runs

__all__ = [
    "DEFAULT_MEMORY_LIMIT",
    "TABLE_NAMES",
    "AggregateError",
    "aggregate",
    "aggregate_runs",
    "bin_sql",
    "build_parts",
    "default_tables_dir",
    "ensure_tables",
    "iter_logit_blocks",
    "load_run_tables",
    "open_run",
    "open_runs",
    "read_tables_meta",
    "tables_dir_of",
    "tables_status",
]
