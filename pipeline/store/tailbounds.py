"""What the tables need for cw-ECE bounds when a run's per-class tail is unknown.

A run imported by ``fullece import`` (manifest ``source.class_tail_known``
false) has no per-class tail: its class_tail shards hold an *allocation* of
the tail mass (``tail_mass``, which ``fullece aggregate`` puts into class_bins
at fine bin 1 like any tail) and each class's capacity ``tail_cap``. The
aggregate sums both over the shards of such runs into
``TABLES/tail_bounds.parquet`` (class_id, tail_count, tail_mass, tail_cap) and
marks meta.json ``class_tail_known: false``; ``fullece metrics`` then reports
cw-ECE as an interval (pipeline.core.metrics.classwise_ece_bounds).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from pipeline.store.schema import SCHEMA_VERSION

TAIL_BOUNDS_NAME = "tail_bounds.parquet"
TAIL_BOUNDS_KEY = "tail_bounds"  # its sha256 in meta.json "files"
TAIL_BOUNDS = pa.schema(
    [
        pa.field("class_id", pa.int32(), nullable=False),
        pa.field("tail_count", pa.int64(), nullable=False),
        pa.field("tail_mass", pa.float64(), nullable=False),  # allocated, in class_bins bin 1
        pa.field("tail_cap", pa.float64(), nullable=False),  # the most class k can hold
    ],
    metadata={"fullece.table": "tail_bounds", "fullece.schema_version": str(SCHEMA_VERSION)},
)


def class_tail_known(manifest: dict) -> bool:
    """False for a run whose per-class tail is not measured (an imported dump)."""
    return bool((manifest.get("source") or {}).get("class_tail_known", True))


def tail_bounds_sql(files_sql: str) -> str:
    return f"""SELECT class_id, sum(tail_count), sum(tail_mass), sum(tail_cap)
        FROM {files_sql} GROUP BY class_id ORDER BY class_id"""


def reduce_tail_bounds(connect, runs, out: Path, write_query) -> dict:
    """Sum the class_tail shards of runs with an unknown per-class tail into
    OUT/tail_bounds.parquet; returns the meta.json fields to add ({} if none).
    `connect()` gives the DuckDB connection, asked for only when there is work."""
    from pipeline.aggregate.sql import sql_str

    files = [
        Path(run.run_dir) / shard.entry["class_tail"]
        for run in runs
        if not class_tail_known(run.manifest)
        for shard in run.shards
        if shard.entry.get("class_tail")
    ]
    path = Path(out) / TAIL_BOUNDS_NAME
    if not files:
        path.unlink(missing_ok=True)
        return {}
    lst = ", ".join(f"'{sql_str(p)}'" for p in files)
    write_query(connect(), tail_bounds_sql(f"read_parquet([{lst}])"), path, TAIL_BOUNDS)
    return {"class_tail_known": False, "tail_bounds": TAIL_BOUNDS_NAME}


def read_tail_bounds(tables_dir, meta: dict, vocab_size: int):
    """(tail_mass float64[K], tail_cap float64[K]) of tables whose per-class tail
    is unknown, or None when every run's per-class tail is known.

    The file is always TABLES/tail_bounds.parquet (meta.json cannot point
    elsewhere), read from the bytes checked against meta.json's sha256, and
    its values are range-checked."""
    from pipeline.store.tablestore import META_NAME, TablesError, _read_verified_file

    if meta.get("class_tail_known", True):
        return None
    meta_path = Path(tables_dir) / META_NAME
    if meta.get("tail_bounds", TAIL_BOUNDS_NAME) != TAIL_BOUNDS_NAME:
        raise TablesError(
            f"{meta_path}: field 'tail_bounds' = {meta.get('tail_bounds')!r}: expected "
            f"{TAIL_BOUNDS_NAME!r}, a file of the tables directory"
        )
    path = Path(tables_dir) / TAIL_BOUNDS_NAME
    recorded = (meta.get("files") or {}).get(TAIL_BOUNDS_KEY)
    if not recorded:
        raise TablesError(
            f"{meta_path}: field 'files' records no sha256 of {TAIL_BOUNDS_NAME} "
            "(re-run `fullece aggregate`)"
        )
    table = _read_verified_file(path, recorded)
    ids = table.column("class_id").to_numpy()
    mass = table.column("tail_mass").to_numpy()
    cap = table.column("tail_cap").to_numpy()
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size or np.unique(ids).size != ids.size):
        raise TablesError(f"{path}: class_id outside [0, {vocab_size}) or repeated")
    if not (np.all(np.isfinite(mass)) and np.all(np.isfinite(cap))):
        raise TablesError(f"{path}: tail_mass or tail_cap not finite")
    if mass.size and (mass.min() < 0 or cap.min() < 0):
        raise TablesError(f"{path}: negative tail_mass or tail_cap")
    tail_mass = np.zeros(vocab_size, dtype=np.float64)
    tail_cap = np.zeros(vocab_size, dtype=np.float64)
    tail_mass[ids] = mass
    tail_cap[ids] = cap
    return tail_mass, tail_cap
