"""Versioned on-disk formats: the one place that names every column.

Run directory (written by ``fullece extract``)::

    RUN_DIR/manifest.json                  run identity, settings, shards, m_exact
    RUN_DIR/shards/positions-00000.parquet one row per position (both stores)
    RUN_DIR/shards/class_tail-00000.parquet per-class tail count/mass (both stores)
    RUN_DIR/shards/logits-00000.zarr       full store: logits [n, K] + logsumexp [n]
    RUN_DIR/tables/*.parquet               bin tables (written by ``fullece aggregate``)

``schemas/`` holds the JSON renderings of these definitions (``python -m
pipeline.store.schema`` regenerates them); readers refuse versions they do not know.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa

from pipeline.core.tables import BIN_TABLE_SCHEMAS, SCHEMA_VERSION
from pipeline.errors import FulleceError

SUPPORTED_VERSIONS = (1,)
# The positions table has its own version: v2 adds `sum_p2`; v3 declares the
# kept lists' elements non-null (they never held a null: the values and their
# meaning are v2's), which pyarrow decodes with 17-27% less CPU (no validity
# bitmap to build from definition levels; docs/performance.md). Runs
# written before (v1, v2) still open everywhere; writers write the newest they
# can (an import without Σp² per position writes v1).
POSITIONS_VERSION = 3


class SchemaVersionError(FulleceError):
    """A file was written under a schema version this tool does not know."""


def check_version(version, where: str) -> None:
    if version not in SUPPORTED_VERSIONS:
        raise SchemaVersionError(
            f"{where}: schema version {version!r} is not supported by this fullece "
            f"(supported: {', '.join(map(str, SUPPORTED_VERSIONS))}); "
            "upgrade fullece or re-extract the run"
        )


# One row per scored position. `kept_probs` is the probability of record
# (float32); binning always uses float64(p) (see pipeline.core.binning).
_POSITIONS_V1_FIELDS = [
    pa.field("doc_id", pa.int64(), nullable=False),  # document index in the corpus
    pa.field("window", pa.int32(), nullable=False),  # sliding-window index in the doc
    pa.field("offset", pa.int32(), nullable=False),  # token index of the label in the doc (>= 1)
    pa.field("label", pa.int32(), nullable=False),
    pa.field("label_prob", pa.float32(), nullable=False),
    pa.field("top1_id", pa.int32(), nullable=False),  # argmax, first index among ties
    pa.field("top1_prob", pa.float32(), nullable=False),
    pa.field("entropy", pa.float32(), nullable=False),  # nats, of the full distribution
    pa.field("kept_ids", pa.list_(pa.int32()), nullable=False),  # label always among them
    pa.field("kept_probs", pa.list_(pa.float32()), nullable=False),  # (v3: non-null elements)
    pa.field("tail_count", pa.int32(), nullable=False),
    pa.field("tail_mass", pa.float64(), nullable=False),
    pa.field("tail_max", pa.float32(), nullable=False),  # 0 when the tail is empty
]
POSITIONS_V1 = pa.schema(
    _POSITIONS_V1_FIELDS,
    metadata={"fullece.table": "positions", "fullece.schema_version": "1"},
)
# v2: + sum_p2 = sum over the whole vocabulary of p_k**2 (float64 sum of the
# float32 probabilities of record, computed on the device), so the Brier score
# of a top-k run is exact.
_SUM_P2 = pa.field("sum_p2", pa.float64(), nullable=False)
POSITIONS_V2 = pa.schema(
    [*_POSITIONS_V1_FIELDS, _SUM_P2],
    metadata={"fullece.table": "positions", "fullece.schema_version": "2"},
)


def _non_null_elements(field: pa.Field) -> pa.Field:
    """`field`, a list's elements declared non-null (any other field as it is)."""
    if not pa.types.is_list(field.type):
        return field
    element = field.type.value_field.with_nullable(False)
    return field.with_type(pa.list_(element))


# v3: v2's columns, the kept lists' elements declared non-null.
POSITIONS = pa.schema(
    [_non_null_elements(f) for f in POSITIONS_V2],
    metadata={"fullece.table": "positions", "fullece.schema_version": str(POSITIONS_VERSION)},
)
# Every version of a table that readers accept (tables not listed: SCHEMA_VERSION only).
TABLE_VERSIONS = {"positions": {1: POSITIONS_V1, 2: POSITIONS_V2, POSITIONS_VERSION: POSITIONS}}

# Per shard, per class: tail pairs summed over the shard's positions (both stores;
# in the full store it describes the positions table's kept lists, while the
# Zarr logits remain the source of truth for aggregation).
CLASS_TAIL = pa.schema(
    [
        pa.field("class_id", pa.int32(), nullable=False),
        pa.field("tail_count", pa.int64(), nullable=False),
        pa.field("tail_mass", pa.float64(), nullable=False),
    ],
    metadata={"fullece.table": "class_tail", "fullece.schema_version": str(SCHEMA_VERSION)},
)


# Bin tables (docs/design.md, "The bin tables"); `bin` is the 1-based fine bin
# in 1..F. seq_bins is per sequence (document), per fine bin: pooled over
# classes (Full-ECE) and top-1 (ECE), so bootstrap over sequences needs nothing else.
# The names of the bin tables (class_bins, top1_bins, tokens, seq_bins), in the
# order every writer and reader walks them: taken from their one declaration,
# pipeline.core.tables.TABLE_FIELDS (the accumulator's arrays are built from it,
# and the core imports nothing from the store).
BIN_TABLE_NAMES = tuple(BIN_TABLE_SCHEMAS)
CLASS_BINS, TOP1_BINS, TOKENS, SEQ_BINS = (BIN_TABLE_SCHEMAS[n] for n in BIN_TABLE_NAMES)

# Every table of the formats above, by name: the run's own two, then the bin tables.
TABLE_SCHEMAS = {
    "positions": POSITIONS,
    "class_tail": CLASS_TAIL,
    **{name: BIN_TABLE_SCHEMAS[name] for name in BIN_TABLE_NAMES},
}

# Full store: Zarr v3 group per shard (attribute fullece.schema_version).
ZARR_ARRAYS = {
    "logits": {
        "shape": "[n, K]",
        "dtype": "float16 | float32",
        "chunks": "[rows, K]",
        "codecs": "bytes + blosc(zstd, clevel=1, shuffle)",
    },
    "logsumexp": {
        "shape": "[n]",
        "dtype": "float32",
        "note": "p = exp(float32(logit) - logsumexp), computed in float32",
    },
}


def check_table_schema(schema: pa.Schema, name: str, where: str) -> None:
    """Refuse a Parquet file whose version or columns are not those of `name`."""
    meta = schema.metadata or {}
    version = meta.get(b"fullece.schema_version")
    expected = TABLE_SCHEMAS[name]
    versions = TABLE_VERSIONS.get(name)
    if versions is not None:
        if version is None:
            # no version stamp: the newest layout it matches, else the oldest
            # (whose check then names what is missing or of another type)
            fits = [v for v, s in versions.items() if _has_fields(schema, s)]
            version = max(fits, default=min(versions))
        elif int(version) not in versions:
            raise SchemaVersionError(
                f"{where}: {name} schema version {int(version)} is not supported by this "
                f"fullece (supported: {', '.join(map(str, versions))}); "
                "upgrade fullece or re-extract the run"
            )
        expected = versions[int(version)]
    elif version is not None:
        check_version(int(version), where)
    missing = [f.name for f in expected if f.name not in schema.names]
    if missing:
        raise ValueError(f"{where}: not a {name} table: missing column(s) {', '.join(missing)}")
    for field in expected:
        got = schema.field(field.name).type
        if got != field.type:
            raise ValueError(
                f"{where}: column {field.name!r} has type {got}, expected {field.type}"
            )


def _has_fields(schema: pa.Schema, expected: pa.Schema) -> bool:
    """Whether `schema` has every column of `expected`, of its type."""
    return all(f.name in schema.names and schema.field(f.name).type == f.type for f in expected)


def table_version(schema: pa.Schema) -> int:
    """The schema version a table's metadata declares (SCHEMA_VERSION when absent)."""
    version = (schema.metadata or {}).get(b"fullece.schema_version")
    return int(version) if version is not None else SCHEMA_VERSION


def schema_as_json(schema: pa.Schema) -> dict:
    meta = {k.decode(): v.decode() for k, v in (schema.metadata or {}).items()}
    return {
        "table": meta.get("fullece.table"),
        "schema_version": table_version(schema),
        "columns": [{"name": f.name, "type": str(f.type), "nullable": f.nullable} for f in schema],
    }


def write_schema_files(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    schemas = [*TABLE_SCHEMAS.items(), ("positions", POSITIONS_V1), ("positions", POSITIONS_V2)]
    for name, schema in schemas:
        path = directory / f"{name}.v{table_version(schema)}.json"
        path.write_text(json.dumps(schema_as_json(schema), indent=2) + "\n")
    (directory / f"zarr_full.v{SCHEMA_VERSION}.json").write_text(
        json.dumps({"schema_version": SCHEMA_VERSION, "arrays": ZARR_ARRAYS}, indent=2) + "\n"
    )


if __name__ == "__main__":
    from pipeline.store.schemafiles import CHECKOUT_SCHEMAS

    write_schema_files(CHECKOUT_SCHEMAS)
