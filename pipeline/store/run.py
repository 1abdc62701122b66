"""The run/shard model: open a run directory, its shards, their checked readers.

A run is a directory with ``manifest.json`` and the shard files it lists
(see :mod:`pipeline.store.shards` for the layout). Every stage that reads a
run (aggregate, metrics, sql, report, validate) opens it through here.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.store.manifest import RunError, load_manifest
from pipeline.store.schema import (
    SCHEMA_VERSION,
    SchemaVersionError,
    check_table_schema,
    check_version,
)

# Rows of logits read from Zarr at once (bounded in bytes, see _logit_block_rows).
_LOGIT_BLOCK_BYTES = 64 << 20


class AggregateError(RunError):
    """A run, shard or table that cannot be read or aggregated; the message names the file."""


@dataclass
class Shard:
    run_dir: Path
    entry: dict
    store: str
    vocab_size: int

    @property
    def index(self) -> int:
        return int(self.entry.get("index", 0))

    @property
    def stem(self) -> str:
        pos = self.entry.get("positions")
        if pos:
            name = Path(pos).name.split(".")[0]
            return name.split("-", 1)[1] if "-" in name else name
        return f"{self.index:05d}"

    @property
    def rows(self) -> int:
        return int(self.entry.get("rows", 0))

    def path(self, key: str) -> Path | None:
        rel = self.entry.get(key)
        return None if not rel else self.run_dir / rel

    def key(self, fine_bins: int) -> str:
        """Identity of this shard's partial tables: its files' sha256 (from the
        manifest), the store, K, F and the table schema version."""
        ident = {
            "files": self.entry.get("files") or {},
            "stat": self._stat(),
            "rows": self.rows,
            "store": self.store,
            "vocab_size": self.vocab_size,
            "fine_bins": fine_bins,
            "schema_version": SCHEMA_VERSION,
        }
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()

    def _stat(self) -> list:
        """Size and mtime of the shard's files: a file rewritten on disk without
        a manifest update is re-aggregated too (cheap: no hashing)."""
        out = []
        for key in ("positions", "class_tail", "logits"):
            path = self.path(key)
            if path is None or not path.exists():
                continue
            probe = path / "zarr.json" if path.is_dir() else path
            st = probe.stat() if probe.exists() else path.stat()
            out.append([key, st.st_size, st.st_mtime_ns])
        return out


@dataclass
class Run:
    run_dir: Path
    manifest: dict
    shards: list[Shard] = field(default_factory=list)

    @property
    def label(self) -> str:
        return str(self.manifest.get("label") or self.run_dir.resolve().name)

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    @property
    def store(self) -> str:
        return str(self.manifest["store"])


def open_run(run_dir) -> Run:
    """Load and check a run directory's manifest (errors name the file)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise AggregateError(f"{run_dir}: no such run directory")
    manifest = load_manifest(run_dir)
    where = run_dir / "manifest.json"
    store = manifest["store"]
    if store not in ("topk", "full"):
        raise AggregateError(f"{where}: unknown store {store!r} (expected 'topk' or 'full')")
    k = manifest["vocab_size"]
    if not isinstance(k, int) or k < 1:
        raise AggregateError(f"{where}: vocab_size must be a positive integer, got {k!r}")
    run = Run(run_dir, manifest)
    for entry in manifest["shards"]:
        run.shards.append(Shard(run_dir, entry, store, k))
    if not run.shards or sum(s.rows for s in run.shards) == 0:
        raise AggregateError(f"{where}: the run has no positions (no committed shard with rows)")
    return run


def open_runs(run_dirs) -> list[Run]:
    runs = [open_run(d) for d in run_dirs]
    if not runs:
        raise AggregateError("no run directory given")
    first = runs[0]
    for run in runs[1:]:
        if run.vocab_size != first.vocab_size:
            raise AggregateError(
                f"cannot merge runs of different vocabularies: {first.run_dir} has "
                f"K={first.vocab_size}, {run.run_dir} has K={run.vocab_size}"
            )
    seen = {}
    for run in runs:
        real = run.run_dir.resolve()
        if real in seen:
            raise AggregateError(f"{run.run_dir}: given twice (its positions would count twice)")
        seen[real] = True
    return runs


# ------------------------------------------------------------ shard checks


def require_file(path: Path | None, shard: Shard, what: str) -> Path:
    if path is None:
        raise AggregateError(
            f"{shard.run_dir / 'manifest.json'}: shard {shard.index} lists no {what} file"
        )
    if not path.exists():
        raise AggregateError(
            f"{path}: shard file missing (listed in {shard.run_dir / 'manifest.json'})"
        )
    return path


def check_positions(shard: Shard) -> Path:
    path = require_file(shard.path("positions"), shard, "positions")
    try:
        pf = pq.ParquetFile(str(path))
    except Exception as err:  # noqa: BLE001 - pyarrow raises several types
        raise AggregateError(f"{path}: not a readable Parquet file ({err})") from err
    try:
        check_table_schema(pf.schema_arrow, "positions", str(path))
    except SchemaVersionError:
        raise
    except ValueError as err:
        raise AggregateError(f"shard fails validation: {err}") from err
    rows = pf.metadata.num_rows
    if rows != shard.rows:
        raise AggregateError(
            f"{path}: {rows} rows but the manifest says {shard.rows} (shard fails validation)"
        )
    return path


def check_class_tail(shard: Shard) -> Path | None:
    path = shard.path("class_tail")
    if path is None:
        if shard.store == "topk":
            require_file(None, shard, "class_tail")
        return None
    require_file(path, shard, "class_tail")
    try:
        schema = pq.read_schema(str(path))
        check_table_schema(schema, "class_tail", str(path))
    except SchemaVersionError:
        raise
    except (ValueError, OSError, pa.ArrowException) as err:
        raise AggregateError(f"shard fails validation: {path}: {err}") from err
    return path


def open_zarr(shard: Shard):
    import zarr

    path = require_file(shard.path("logits"), shard, "logits")
    try:
        group = zarr.open_group(str(path), mode="r")
        version = group.attrs.get("fullece.schema_version")
        if version is not None:
            check_version(version, str(path))
        logits, lse = group["logits"], group["logsumexp"]
    except SchemaVersionError:
        raise
    except Exception as err:  # noqa: BLE001 - zarr raises many types
        raise AggregateError(f"{path}: not a readable Zarr v3 logits store ({err})") from err
    if logits.ndim != 2 or logits.shape != (shard.rows, shard.vocab_size):
        raise AggregateError(
            f"{path}/logits: shape {logits.shape}, expected [rows, K] = "
            f"[{shard.rows}, {shard.vocab_size}] (shard fails validation)"
        )
    if lse.shape != (shard.rows,):
        raise AggregateError(f"{path}/logsumexp: shape {lse.shape}, expected [{shard.rows}]")
    if np.dtype(logits.dtype) not in (np.float16, np.float32):
        raise AggregateError(f"{path}/logits: dtype {logits.dtype}, expected float16 or float32")
    return path, logits, lse


def _logit_block_rows(logits) -> int:
    chunk = int(logits.chunks[0])
    row_bytes = int(logits.shape[1]) * 4
    per = max(1, _LOGIT_BLOCK_BYTES // (row_bytes * chunk))
    return chunk * per


def iter_logit_blocks(shard: Shard, block_rows: int | None = None):
    """Yield (start, logits [r, K] as stored, logsumexp float32 [r]) in row blocks."""
    _, logits, lse = open_zarr(shard)
    n = logits.shape[0]
    step = block_rows or _logit_block_rows(logits)
    for start in range(0, n, step):
        stop = min(n, start + step)
        yield start, logits[start:stop], np.asarray(lse[start:stop], dtype=np.float32)


def run_label(run_dir) -> str:
    """A run's label: the manifest's ``label``, else the directory name."""
    run_dir = Path(run_dir)
    try:
        return str(load_manifest(run_dir).get("label") or run_dir.resolve().name)
    except (RunError, OSError, ValueError):
        return run_dir.resolve().name


def is_run(path) -> bool:
    """True when `path` is a run directory (holds manifest.json)."""
    return (Path(path) / "manifest.json").exists()
