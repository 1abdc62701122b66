"""Bin tables on disk: ``DIR/{class_bins,top1_bins,tokens,seq_bins}.parquet``
plus ``DIR/meta.json`` (schema version, F, K, N, tail_max, m_exact, sources).

Parquet is the source of truth (any DuckDB/Polars/Spark reads it); meta.json
carries the scalars the tables cannot (N counts positions, not rows).
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from pipeline import __version__
from pipeline.core.binning import m_exact_from_tail_max
from pipeline.core.tables import BinTables
from pipeline.store import atomic
from pipeline.store.schema import SCHEMA_VERSION, check_table_schema, check_version

TABLE_NAMES = ("class_bins", "top1_bins", "tokens", "seq_bins")
META_NAME = "meta.json"


def save_tables(tables: BinTables, directory, extra_meta: dict | None = None) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, table in tables.to_arrow().items():
        with atomic.atomic_path(directory / f"{name}.parquet") as tmp:
            pq.write_table(table, tmp, compression="zstd")
    meta = tables_meta(
        fine_bins=tables.fine_bins,
        vocab_size=tables.vocab_size,
        positions=tables.positions,
        tail_max=tables.tail_max,
        sources=tables.sources,
    )
    meta.update(extra_meta or {})
    atomic.write_json(directory / META_NAME, meta)  # last: marks the tables complete
    return directory


def tables_meta(*, fine_bins, vocab_size, positions, tail_max, sources) -> dict:
    """The scalars of meta.json that no table column can carry."""
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": {"name": "fullece", "version": __version__},
        "fine_bins": int(fine_bins),
        "vocab_size": int(vocab_size),
        "positions": int(positions),
        "tail_max": float(tail_max),
        "m_exact": m_exact_from_tail_max(tail_max),
        "sources": list(sources),
    }


class TablesError(ValueError):
    """Bin tables that are missing, damaged or of another layout."""


def read_meta(directory) -> dict:
    path = Path(directory) / META_NAME
    if not path.exists():
        raise TablesError(f"{path}: no bin tables here (run `fullece aggregate` first)")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise TablesError(f"{path}: not valid JSON ({err})") from err
    check_version(meta.get("schema_version"), str(path))
    return meta


def load_tables(directory) -> BinTables:
    directory = Path(directory)
    meta = read_meta(directory)
    arrow = {}
    for name in TABLE_NAMES:
        path = directory / f"{name}.parquet"
        if not path.exists():
            raise TablesError(f"{path}: missing bin table (re-run `fullece aggregate`)")
        table = pq.read_table(path)
        check_table_schema(table.schema, name, str(path))
        arrow[name] = table
    return BinTables.from_arrow(
        arrow,
        fine_bins=meta["fine_bins"],
        vocab_size=meta["vocab_size"],
        positions=meta["positions"],
        tail_max=meta["tail_max"],
        sources=meta.get("sources"),
    )
