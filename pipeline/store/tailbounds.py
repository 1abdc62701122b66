"""What the tables need for cw-ECE bounds when a run's per-class tail is unknown.

A run imported by ``fullece import`` (manifest ``source.class_tail_known``
false) has no per-class tail: its class_tail shards hold an *allocation* of
the tail mass (``tail_mass``, which ``fullece aggregate`` puts into class_bins
at fine bin 1 like any tail) and each class's capacity ``tail_cap``. The
aggregate sums both over the shards of such runs into
``TABLES/tail_bounds.parquet`` (class_id, tail_count, tail_mass, tail_cap) and
marks meta.json ``class_tail_known: false``; ``fullece metrics`` then reports
cw-ECE as an interval (pipeline.core.metrics.classwise_ece_bounds).

This module declares the file; ``pipeline.aggregate.reduce.reduce_tail_bounds``
writes it and ``pipeline.store.tablestore.read_tail_bounds`` reads it.
"""

from __future__ import annotations

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
