"""A run's bin tables and positions as Polars LazyFrames, for notebook analysis.

Nothing is read until a query is collected (``pl.scan_parquet``). Columns are
those of docs/design.md ("The bin tables") and ``schemas/positions.v3.json``
(a v1 run: without ``sum_p2``).
Polars sums float32 in float32: cast float32 columns (``label_prob``,
``top1_prob``, ``kept_probs``, ``tail_max``, ``entropy``) to ``pl.Float64``
before summing them. The bin tables' masses are float64 already.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from pipeline.store.manifest import RunError, load_manifest
from pipeline.store.schema import check_table_schema
from pipeline.store.tablestore import TABLE_NAMES, read_meta, tables_dir_of

__all__ = ["open_tables", "open_positions"]


def open_tables(run_dir) -> dict:
    """``{"class_bins", "top1_bins", "tokens", "seq_bins"}`` -> ``pl.LazyFrame``.

    `run_dir` is a run directory (its ``tables/``) or a tables directory. The
    version in ``meta.json`` and every file's columns are checked first; a
    missing table raises RunError naming it (run ``fullece aggregate`` first).
    """
    import polars as pl

    directory = tables_dir_of(run_dir)
    try:
        read_meta(directory)
    except ValueError as err:
        raise RunError(str(err)) from err
    frames = {}
    for name in TABLE_NAMES:
        path = directory / f"{name}.parquet"
        if not path.exists():
            raise RunError(f"{path}: missing bin table (run `fullece aggregate` first)")
        check_table_schema(pq.read_schema(path), name, str(path))
        frames[name] = pl.scan_parquet(path)
    return frames


def open_positions(run_dir):
    """Every committed shard's positions (manifest order) as one ``pl.LazyFrame``.

    Each file is verified first by the store (its sha256 against the manifest,
    schema, rows, document range); Polars reads them lazily afterwards, so the
    value ranges that metrics checks batch by batch are not checked here."""
    import polars as pl

    from pipeline.store.run import open_positions as verified_positions
    from pipeline.store.run import open_verified_run

    load_manifest(run_dir)  # "not a fullece run" before anything else
    run = open_verified_run(run_dir)
    paths = [str(verified_positions(shard)[0]) for shard in run.shards if shard.rows]
    if not paths:
        raise RunError(f"{Path(run_dir) / 'manifest.json'}: the run has no committed shard")
    return pl.scan_parquet(paths)
