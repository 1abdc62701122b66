"""``fullece aggregate``: shards -> bin tables (docs/design.md: "The bin tables", "Performance principles", "Scale-out").

Map then reduce:

* map, one shard at a time, into a *partial* table set kept under
  ``RUN_DIR/tables/parts/<shard-stem>/`` and keyed by the shard's sha256 in the
  manifest (plus F and the schema version), so a shard already aggregated is
  never read again and a changed shard is re-aggregated;

  - top-k store: one pass per shard (``pipeline.aggregate.topk_pass``): the
    positions file is decoded once, batch by batch, and a compiled kernel
    folds every kept entry into all four partial tables and the shard checks
    (sums in float64). Binning is ``max(ceil(float64(p) * F), 1)``, the
    metric core's ``fine_bin_index`` (``topk_part_sql`` in ``sql.py`` states
    the same tables in SQL). Per-class tail vectors enter class_bins at fine
    bin 1 (hits 0); per-position tail count/mass enter seq_bins at fine bin
    1; top-1 comes from the positions' ``top1_id``/``top1_prob``.
  - full store: row chunks of the Zarr ``logits`` stream through the metric
    core's dense/sparse split (``CalibrationAccumulator.update_logits`` with
    the stored ``logsumexp``: probability of record = float32
    ``exp(float32(logit) - logsumexp)``).

* reduce: one DuckDB ``GROUP BY ... SUM`` over every partial table of every
  run, streamed into ``OUT/*.parquet`` plus ``OUT/meta.json`` (the layout of
  ``pipeline.store.tablestore``).

Memory is bounded by DuckDB's limit (reduce) plus one chunk or batch and the
shard's tables (map), never by N or N x K. No torch here.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import DEFAULT_FINE_BINS
from pipeline.aggregate.sql import reduce_sql, sql_str
from pipeline.store import atomic, tablestore
from pipeline.store.lock import RunLock
from pipeline.store.run import (
    AggregateError,
    Run,
    Shard,
    check_shard,
    iter_logit_blocks,
    iter_positions,
    open_run,
    open_runs,
    read_class_tail,
    read_positions,
)
from pipeline.store.schema import (
    CLASS_BINS,
    SCHEMA_VERSION,
    SEQ_BINS,
    TOKENS,
    TOP1_BINS,
    SchemaVersionError,
)

TABLE_NAMES = tablestore.TABLE_NAMES
TABLE_SCHEMAS = {
    "class_bins": CLASS_BINS,
    "top1_bins": TOP1_BINS,
    "tokens": TOKENS,
    "seq_bins": SEQ_BINS,
}
META_NAME = tablestore.META_NAME
PART_META = "part.json"
TABLES_DIR = "tables"
PARTS_DIR = "parts"
DEFAULT_MEMORY_LIMIT = "1GB"
_WRITE_BATCH_ROWS = 1 << 20


# ------------------------------------------------------------------ duckdb


def _connect(memory_limit: str, temp_dir: Path, threads: int | None = None):
    import duckdb

    con = duckdb.connect(":memory:")
    con.execute(f"SET memory_limit='{memory_limit}'")
    con.execute(f"SET temp_directory='{sql_str(temp_dir)}'")
    con.execute("SET preserve_insertion_order=false")
    con.execute("SET enable_progress_bar=false")
    con.execute(f"SET threads={threads or max(1, os.cpu_count() or 1)}")
    return con


def _write_query(con, query: str, path: Path, schema: pa.Schema) -> int:
    """Stream a DuckDB query into a Parquet file of exactly `schema`, atomically."""
    rows = 0
    with atomic.atomic_path(path) as tmp:
        reader = con.sql(query).to_arrow_reader(_WRITE_BATCH_ROWS)
        with tablestore.parquet_writer(tmp, schema) as writer:
            for batch in reader:
                if batch.num_rows == 0:
                    continue
                table = pa.Table.from_batches([batch]).rename_columns(schema.names)
                writer.write_table(table.cast(schema))
                rows += batch.num_rows
    return rows


_TAIL_COLUMNS = ("tail_count", "tail_mass", "tail_max")


def _aggregate_topk_shard(
    con,
    shard: Shard,
    part_dir: Path,
    fine_bins: int,
    *,
    decode_threads: bool = True,
    kept: PartCache | None = None,
) -> dict:
    """Map one top-k shard to its partial tables in ONE pass over its kept entries.

    The positions file is decoded once, batch by batch, and every table and
    check is fed from that pass (``pipeline.aggregate.topk_pass``); `con` is
    unused here (kept for the callers' signature). Memory: one batch plus the
    tables. ``decode_threads=False`` decodes on one thread (when several shards
    are mapped at once, pyarrow's pool would only oversubscribe the cores).
    """
    from concurrent.futures import ThreadPoolExecutor

    from pipeline.aggregate.topk_pass import BATCH_ROWS, KeptEntryError, TopkShardPass

    check_shard(shard)  # checksums, schemas, rows: nothing unverified is read
    pos_path, tail_path = shard.path("positions"), shard.path("class_tail")
    k = shard.vocab_size
    state = TopkShardPass(vocab_size=k, fine_bins=fine_bins)
    columns = [
        "doc_id",
        "label",
        "top1_id",
        "top1_prob",
        "kept_ids",
        "kept_probs",
        "tail_count",
        "tail_mass",
        "tail_max",
    ]
    try:
        # the kernel checks ids, probabilities and doc_ids; the store the tail columns
        batches = iter_positions(
            shard, columns, BATCH_ROWS, use_threads=decode_threads, checked=_TAIL_COLUMNS
        )
        # decode the next batch (pyarrow, GIL released) while the kernel (nogil) folds this one
        with ThreadPoolExecutor(1) as reader:
            upcoming = reader.submit(next, batches, None)
            while (batch := upcoming.result()) is not None:
                upcoming = reader.submit(next, batches, None)
                state.add_batch(batch)
    except KeptEntryError as err:
        raise AggregateError(f"{pos_path}: row {err.row}: {err} (shard fails validation)") from err
    if state.label_rows_missing:
        raise AggregateError(
            f"{pos_path}: {state.label_rows_missing} position(s) lack their label among the "
            "kept ids (shard fails validation: the label must always be kept)"
        )
    if state.label_hits != shard.rows:
        raise AggregateError(
            f"{pos_path}: {state.label_hits - shard.rows} kept entr(ies) repeat a label "
            "(shard fails validation: each kept id appears once per position)"
        )
    if tail_path is not None:
        tail = read_class_tail(shard, ["class_id", "tail_count", "tail_mass"])
        class_ids = tail.column("class_id").to_numpy()
        tail_count = tail.column("tail_count").to_numpy()
        if class_ids.size and (class_ids.min() < 0 or class_ids.max() >= k):
            raise AggregateError(
                f"{pos_path} / {tail_path}: class id outside [0, {k}) (shard fails validation)"
            )
        class_tail_total = int(tail_count.sum())
        if class_tail_total != state.position_tail_count:
            raise AggregateError(
                f"{tail_path}: per-class tail counts sum to {class_tail_total} but the "
                f"positions' tail_count to {state.position_tail_count} (shard fails validation)"
            )
        state.add_class_tail(class_ids, tail_count, tail.column("tail_mass").to_numpy())
    if state.pairs != shard.rows * k:
        raise AggregateError(
            f"{pos_path}: kept + tail entries = {state.pairs}, expected rows x K = "
            f"{shard.rows * k} (shard fails validation)"
        )
    tables = {
        name: pa.table(columns, schema=TABLE_SCHEMAS[name])
        for name, columns in state.tables().items()
    }
    with atomic.atomic_path(part_dir) as tmp:
        tmp.mkdir()
        for name in TABLE_NAMES:
            pq.write_table(
                tables[name],
                str(tmp / f"{name}.parquet"),
                # a partial table is read once by the reduce: fast to write beats small
                compression="lz4",
                use_dictionary=False,
                column_encoding=tablestore.column_encodings(tables[name].schema),
                write_statistics=False,
            )
        meta = _part_meta(shard, fine_bins, positions=shard.rows, tail_max=state.tail_max)
        atomic.write_json(tmp / PART_META, meta)
    if kept is not None:
        kept.offer(part_dir, tables)
    return meta


def _aggregate_full_shard(shard: Shard, part_dir: Path, fine_bins: int, bar=None) -> dict:
    from pipeline.core.accumulator import CalibrationAccumulator
    from pipeline.core.checks import InputError

    check_shard(shard)  # checksums, schemas, shapes: nothing unverified is read
    zpath = shard.path("logits")
    cols = read_positions(shard, ["doc_id", "label"])
    doc_ids = cols.column("doc_id").to_numpy()
    labels = cols.column("label").to_numpy()
    acc = CalibrationAccumulator(vocab_size=shard.vocab_size, fine_bins=fine_bins)
    for start, block, lse in iter_logit_blocks(shard):
        stop = start + block.shape[0]
        try:
            acc.update_logits(block, labels[start:stop], doc_ids[start:stop], logsumexp=lse)
        except InputError as err:
            raise AggregateError(f"{zpath}: rows {start}..{stop - 1}: {err}") from err
        if bar is not None:
            bar.update(stop - start)
    tables = acc.compute()
    arrow = tables.to_arrow()
    with atomic.atomic_path(part_dir) as tmp:
        tmp.mkdir()
        for name in TABLE_NAMES:
            pq.write_table(
                arrow[name].cast(TABLE_SCHEMAS[name]),
                str(tmp / f"{name}.parquet"),
                compression="zstd",
                use_dictionary=False,
                column_encoding=tablestore.column_encodings(TABLE_SCHEMAS[name]),
            )
        meta = _part_meta(shard, fine_bins, positions=tables.positions, tail_max=tables.tail_max)
        atomic.write_json(tmp / PART_META, meta)
    return meta


def _part_meta(shard: Shard, fine_bins: int, *, positions: int, tail_max: float) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "key": shard.key(fine_bins),
        "shard": shard.index,
        "positions_file": shard.entry.get("positions"),
        "fine_bins": fine_bins,
        "vocab_size": shard.vocab_size,
        "positions": int(positions),
        "tail_max": float(tail_max),
    }


def _read_part_meta(part_dir: Path) -> dict | None:
    path = part_dir / PART_META
    if not path.exists():
        return None
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    if meta.get("schema_version") != SCHEMA_VERSION:
        return None
    if not all((part_dir / f"{name}.parquet").exists() for name in TABLE_NAMES):
        return None
    # a part is a cache: one whose files changed since they were written is rebuilt
    if meta.get("files") != _part_checksums(part_dir):
        return None
    return meta


def _part_checksums(part_dir: Path) -> dict:
    return tablestore.table_checksums(part_dir)


def _seal_part(part_dir: Path, meta: dict) -> dict:
    """Record the sha256 of a freshly written part's files in its part.json."""
    meta = dict(meta, files=_part_checksums(part_dir))
    atomic.write_json(part_dir / PART_META, meta)
    return meta


# ------------------------------------------------------------------- parts


def _writable(directory: Path) -> bool:
    probe = directory
    while not probe.exists():
        probe = probe.parent
    return os.access(probe, os.W_OK)


def parts_root(run: Run, out: Path | None) -> Path:
    """Where a run's per-shard partial tables live: RUN_DIR/tables/parts, or
    OUT/parts/<run-hash> when the run directory is not writable."""
    own = run.run_dir / TABLES_DIR / PARTS_DIR
    if _writable(run.run_dir):
        return own
    if out is None:
        raise AggregateError(f"{run.run_dir}: not writable; give --out DIR")
    tag = hashlib.sha256(str(run.run_dir.resolve()).encode()).hexdigest()[:12]
    return Path(out) / PARTS_DIR / f"{run.run_dir.name}-{tag}"


def _progress(total: int, desc: str, enabled: bool):
    from pipeline.progress import progress_bar

    return progress_bar(desc, total=total, enabled=enabled, leave=False)


# Bytes per partial-table row that the in-memory reduce holds at its peak
# (the row, its sort key and order, the gathered and summed columns, the
# Arrow output): 195 measured on the issue-14 run's two parts.
_REDUCE_ROW_BYTES = 200
_UNITS = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}  # DuckDB's: a unit is needed
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def limit_bytes(memory_limit: str) -> int | None:
    """'1GB', '512MiB', '2 gb' -> bytes; None when not a plain size."""
    import re

    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(memory_limit))
    if not m or m.group(2).lower() not in _UNITS:
        return None
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


_MIN_MEMORY_LIMIT = 16 * 10**6  # below it DuckDB cannot even start its reduce


def check_memory_limit(memory_limit: str) -> int:
    """Bytes of a --memory-limit such as '1GB', '512MB', '2GiB' (else an error)."""
    budget = limit_bytes(memory_limit)
    if not budget:
        raise AggregateError(f"{memory_limit!r} is not a size such as 1GB, 512MB or 2GiB")
    if budget < _MIN_MEMORY_LIMIT:
        raise AggregateError(f"--memory-limit {memory_limit!r}: at least 16MB is needed")
    return budget


class PartCache:
    """Partial tables the map step hands to the reduce in memory (so they are
    not read back from disk), up to `budget_rows` rows in all; thread-safe.
    Once the parts seen so far project past the budget for all `parts` of
    the run (the reduce would then be DuckDB's), it drops them and keeps none."""

    def __init__(self, budget_rows: int, parts: int = 1):
        import threading

        self.budget_rows = budget_rows
        self.parts = parts
        self.rows = 0
        self.offered = 0
        self.tables: dict[Path, dict[str, pa.Table]] = {}
        self._lock = threading.Lock()

    def offer(self, part_dir: Path, tables: dict[str, pa.Table]) -> None:
        rows = sum(t.num_rows for t in tables.values())
        with self._lock:
            self.offered += 1
            projected = (self.rows + rows) / self.offered * max(self.parts, self.offered)
            if projected > self.budget_rows:
                self.drop()
            elif self.rows + rows <= self.budget_rows:
                self.tables[Path(part_dir)] = tables
                self.rows += rows

    def get(self, part_dir: Path) -> dict[str, pa.Table] | None:
        return self.tables.get(Path(part_dir))

    def drop(self) -> None:
        """Keep nothing from now on (and free what was kept)."""
        self.budget_rows = self.rows = 0
        self.tables.clear()


def build_parts(
    runs: list[Run],
    out: Path | None,
    fine_bins: int,
    *,
    progress: bool = True,
    parts_base: Path | None = None,
    workers: int | None = None,
    kept: PartCache | None = None,
):
    """Map step: (re)compute the partial tables of every shard whose key changed.

    Returns [(run, shard, part_dir, part_meta)] and how many shards were read.
    Top-k shards are mapped `workers` at a time (default: one per core); `kept`
    receives their partial tables for an in-memory reduce.
    """
    todo, done = [], []
    if kept is not None:
        kept.parts = sum(len(run.shards) for run in runs)
    for run in runs:
        root = parts_base / run.run_dir.name if parts_base else parts_root(run, out)
        for shard in run.shards:
            part_dir = root / shard.stem
            meta = _read_part_meta(part_dir)
            if meta is not None and meta.get("key") == shard.key(fine_bins):
                done.append((run, shard, part_dir, meta))
            else:
                todo.append((run, shard, part_dir))
    if not todo:
        return done, 0
    total = sum(s.rows for _, s, _ in todo)
    topk = [t for t in todo if t[1].store == "topk"]
    metas = {}
    with _progress(total, "aggregate", progress) as bar:
        for _run, shard, part_dir in todo:
            if shard.store != "topk":
                meta = _aggregate_full_shard(shard, part_dir, fine_bins, bar)
                metas[part_dir] = _seal_part(part_dir, meta)
        metas.update(_map_topk_shards(topk, fine_bins, bar, workers, kept))
    done.extend((run, shard, part_dir, metas[part_dir]) for run, shard, part_dir in todo)
    return done, len(todo)


def _release_map_memory(*, decoded: bool = False) -> None:
    """Free the map step's pooled kernel arrays and, with `decoded`, the pages
    pyarrow's allocator keeps from decoding (before a reduce that needs them)."""
    from pipeline.aggregate.topk_pass import release_scratch

    release_scratch()
    if decoded:
        pa.default_memory_pool().release_unused()


def _map_topk_one(shard: Shard, part_dir: Path, fine_bins: int, decode_threads: bool, kept) -> dict:
    meta = _aggregate_topk_shard(
        None, shard, part_dir, fine_bins, decode_threads=decode_threads, kept=kept
    )
    return _seal_part(part_dir, meta)


def _map_topk_shards(todo, fine_bins: int, bar, workers: int | None, kept=None) -> dict:
    """Map top-k shards, `workers` at a time (default: one per core).

    The kernel is compiled ``nogil`` and pyarrow decodes without the GIL, so
    threads run the shards truly in parallel; each holds one batch (plus the one
    being decoded) and its own tables, so memory grows with the workers, never
    with the shards; each decodes on its own thread (measured 5% faster than
    sharing pyarrow's pool on 2 cores). The first failing shard (in shard order)
    raises its own error, which names its file; shards not yet started are cancelled.
    """
    workers = max(1, min(workers or os.cpu_count() or 1, len(todo)))
    if workers == 1:
        metas = {}
        for _, shard, part_dir in todo:
            metas[part_dir] = _map_topk_one(shard, part_dir, fine_bins, True, kept)
            bar.update(shard.rows)
        return metas
    from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

    with ThreadPoolExecutor(workers, thread_name_prefix="aggregate-map") as pool:
        futures = {pool.submit(_map_topk_one, s, p, fine_bins, False, kept): s for _, s, p in todo}
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, return_when=FIRST_EXCEPTION)
            bar.update(sum(futures[f].rows for f in finished if f.exception() is None))
            if any(f.exception() is not None for f in finished):
                for future in pending:
                    future.cancel()
                wait(pending)
                break
        for future in futures:  # the first failing shard in shard order raises, as serially
            if future.done() and not future.cancelled() and future.exception() is not None:
                raise future.exception()
        return {
            part_dir: future.result()
            for (_, _, part_dir), future in zip(todo, futures, strict=True)
        }


# ------------------------------------------------------------------ reduce


def _reduce(
    parts,
    out: Path,
    runs: list[Run],
    fine_bins: int,
    memory_limit: str,
    temp_dir: Path,
    kept: PartCache | None = None,
) -> dict:
    """Sum the partial tables into the tables at `out`: in memory with the
    metric core's merge (``sparse_merge_arrow``, ``BinTables``) when every
    partial row fits `memory_limit` at _REDUCE_ROW_BYTES each, else with
    DuckDB, which spills to `temp_dir`."""
    k = runs[0].vocab_size
    out.mkdir(parents=True, exist_ok=True)
    rows = sum(_part_rows(part_dir, kept) for _, _, part_dir, _ in parts)
    positions = sum(int(m["positions"]) for _, _, _, m in parts)
    tail_max = max((float(m["tail_max"]) for _, _, _, m in parts), default=0.0)
    con = None

    def connect():
        nonlocal con
        con = con or _connect(duckdb_memory_limit(memory_limit), temp_dir)
        return con

    if reduce_engine(rows, memory_limit) == "memory":
        _reduce_in_memory(parts, out, k, fine_bins, positions, tail_max, kept)
    else:
        if kept is not None:
            kept.drop()  # DuckDB reads the part files; free the memory for it
        _release_map_memory(decoded=True)

        def files(name):
            lst = ", ".join(f"'{sql_str(p / f'{name}.parquet')}'" for _, _, p, _ in parts)
            return f"read_parquet([{lst}])"

        for name in TABLE_NAMES:
            _write_query(
                connect(),
                reduce_sql(name, files(name), k),
                out / f"{name}.parquet",
                TABLE_SCHEMAS[name],
            )
    # imported runs (per-class tail unknown): per-class tail allocation and capacity
    from pipeline.store.tailbounds import reduce_tail_bounds

    tail_meta = reduce_tail_bounds(connect, runs, out, _write_query)
    if con is not None:
        con.close()

    meta = tablestore.tables_meta(
        fine_bins=fine_bins,
        vocab_size=k,
        positions=positions,
        tail_max=tail_max,
        sources=[f"{run.label}:{shard.entry.get('positions')}" for run, shard, _, _ in parts],
    )
    meta["runs"] = [_run_record(run, out) for run in runs]
    meta.update(tail_meta)
    tablestore.write_meta(out, meta)  # last: marks the tables complete
    return tablestore.read_meta(out)


def _resident_bytes() -> int | None:
    """This process's resident memory now (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def duckdb_memory_limit(memory_limit: str) -> str:
    """DuckDB's share of `memory_limit`: what this process does not already
    hold, at least 16MB: the whole process, not DuckDB alone, then stays near
    the limit, and DuckDB spills the rest to disk (measured at 10M positions,
    K = 128,000: peak 1.36 GB with DuckDB given all of 1GB on top of the
    ~0.4 GB the process holds after the map step, 1.02 GB now)."""
    budget, resident = limit_bytes(memory_limit), _resident_bytes()
    if budget is None or resident is None:
        return memory_limit
    return f"{max(budget - resident, _MIN_MEMORY_LIMIT) // 10**6}MB"


def memory_rows(memory_limit: str) -> int:
    """Partial-table rows the in-memory reduce may hold within `memory_limit`."""
    return (limit_bytes(memory_limit) or 0) // _REDUCE_ROW_BYTES


def reduce_engine(partial_rows: int, memory_limit: str) -> str:
    """'memory' when `partial_rows` partial-table rows fit `memory_limit` at
    _REDUCE_ROW_BYTES each (the reduce then runs in numpy), else 'duckdb'."""
    return "memory" if partial_rows <= memory_rows(memory_limit) else "duckdb"


def _part_rows(part_dir: Path, kept: PartCache | None) -> int:
    """Rows of a shard's partial tables (from memory or the Parquet footers)."""
    tables = kept.get(part_dir) if kept else None
    if tables is not None:
        return sum(t.num_rows for t in tables.values())
    return sum(pq.read_metadata(part_dir / f"{name}.parquet").num_rows for name in TABLE_NAMES)


def _reduce_in_memory(parts, out: Path, k: int, fine_bins: int, positions, tail_max, kept):
    """The metric core's merge of the partial tables: class_bins and seq_bins
    each summed and written by a thread of its own (numpy sorts and sums and
    pyarrow encodes without the GIL), tokens and top1_bins meanwhile here."""
    from concurrent.futures import ThreadPoolExecutor

    from pipeline.core.tables import BinTables, sparse_merge_arrow, sparse_to_arrow

    def part_tables(part_dir):
        tables = kept.get(part_dir) if kept else None
        return tables or {n: pq.read_table(part_dir / f"{n}.parquet") for n in TABLE_NAMES}

    loaded = [part_tables(part_dir) for _, _, part_dir, _ in parts]

    def summed(name):
        return pa.concat_tables([t[name] for t in loaded])

    def write(table, name):
        tablestore.write_table_file(table, out / f"{name}.parquet")

    def sparse(name):
        merged = sparse_merge_arrow([t[name] for t in loaded], name, fine_bins, k)
        write(sparse_to_arrow(merged, name), name)

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(sparse, name) for name in ("class_bins", "seq_bins")]
        dense = BinTables.from_arrow(
            {
                "class_bins": TABLE_SCHEMAS["class_bins"].empty_table(),
                "seq_bins": TABLE_SCHEMAS["seq_bins"].empty_table(),
                "tokens": summed("tokens"),
                "top1_bins": summed("top1_bins"),
            },
            fine_bins=fine_bins,
            vocab_size=k,
            positions=positions,
            tail_max=tail_max,
        ).to_arrow()
        for name in ("tokens", "top1_bins"):
            write(dense[name], name)
        for future in futures:
            future.result()


def _run_inputs(run: Run) -> dict:
    """{relative path: sha256} of every shard file of a run, from its manifest."""
    inputs = {}
    for shard in run.shards:
        inputs.update(shard.entry.get("files") or {})
    return dict(sorted(inputs.items()))


def _run_record(run: Run, tables_dir: Path) -> dict:
    """What the tables were built from: the run (path RELATIVE to the tables
    directory, so a moved run keeps its tables) and its shard files' sha256."""
    try:
        rel = os.path.relpath(run.run_dir.resolve(), Path(tables_dir).resolve())
    except ValueError:  # another drive (Windows)
        rel = str(run.run_dir.resolve())
    return {
        "run_dir": Path(rel).as_posix(),
        "label": run.label,
        "store": run.store,
        "positions": sum(s.rows for s in run.shards),
        "complete": run.manifest.get("complete") is True,
        "manifest_sha256": _manifest_sha256(run.run_dir),
        "inputs": _run_inputs(run),
    }


def _manifest_sha256(run_dir: Path) -> str:
    return hashlib.sha256((Path(run_dir) / "manifest.json").read_bytes()).hexdigest()


# ------------------------------------------------------------------ public


def default_tables_dir(run_dir) -> Path:
    return Path(run_dir) / TABLES_DIR


def aggregate(
    run_dirs,
    out=None,
    fine_bins: int = DEFAULT_FINE_BINS,
    memory_limit: str = DEFAULT_MEMORY_LIMIT,
    *,
    progress: bool = True,
    keep_parts: bool = True,
    allow_mixed_models: bool = False,
) -> tuple[Path, dict]:
    """Aggregate runs into tables at `out` (default RUN_DIR/tables for one run).

    Returns (tables directory, meta). With ``keep_parts=False`` the per-shard
    partial tables go to a temporary directory that is removed afterwards.
    Runs that overlap (a shard file of the same content, or the same model and
    corpus with overlapping slices) are refused, and so are runs of different
    models unless ``allow_mixed_models``.
    """
    from pipeline.core.binning import check_n_bins

    fine_bins = check_n_bins(fine_bins)
    check_memory_limit(memory_limit)
    if isinstance(run_dirs, (str, os.PathLike)):
        run_dirs = [run_dirs]
    check_out_arg(out)
    runs = open_runs(run_dirs)
    if out is None:
        if len(runs) > 1:
            raise AggregateError("several runs aggregate into one output: give --out DIR")
        out = default_tables_dir(runs[0].run_dir)
    out = Path(out)
    check_mergeable(runs, allow_mixed_models=allow_mixed_models)
    if keep_parts and _current_tables(runs, out, fine_bins) is None:
        return out, tablestore.verify_tables(out)  # every shard unchanged: nothing to do
    _check_out_dir(out, runs)
    if not _writable(out):
        raise AggregateError(f"{out}: not writable (a read-only run?); give --out DIR elsewhere")
    out.mkdir(parents=True, exist_ok=True)
    # one writer per tables directory: a second aggregate into it is refused
    # while this one runs, so the directory never holds tables of two merges
    with RunLock(out, purpose="aggregate", tables=True):
        temp_dir = scratch_dir(out)
        parts_base = None if keep_parts else temp_dir / "parts"
        try:
            kept = PartCache(memory_rows(memory_limit))
            parts, _ = build_parts(
                runs, out, fine_bins, progress=progress, parts_base=parts_base, kept=kept
            )
            meta = _reduce(parts, out, runs, fine_bins, memory_limit, temp_dir, kept)
            from pipeline.analysis.positions import write_scores

            write_scores(runs, out, meta)  # NLL, Brier, entropy sums: metrics never rescans
        finally:
            _release_map_memory()  # nothing of the map step outlives the call
            shutil.rmtree(temp_dir, ignore_errors=True)
    return out, meta


def aggregate_runs(
    run_dirs,
    out=None,
    fine_bins: int = DEFAULT_FINE_BINS,
    memory_limit: str = DEFAULT_MEMORY_LIMIT,
    *,
    progress: bool = False,
):
    """Aggregate and return the tables (``pipeline.core.tables.BinTables``)."""
    out, _ = aggregate(run_dirs, out, fine_bins, memory_limit, progress=progress)
    return load_run_tables(out)


def tables_dir_of(path) -> Path:
    """A tables directory (has meta.json) or a run directory's tables/."""
    path = Path(path)
    if (path / META_NAME).exists():
        return path
    if (path / TABLES_DIR / META_NAME).exists() or (path / "manifest.json").exists():
        return path / TABLES_DIR
    return path


def _as_aggregate_error(err: ValueError) -> ValueError:
    if isinstance(err, SchemaVersionError):
        return err
    return AggregateError(str(err))


def read_tables_meta(path) -> dict:
    try:
        return tablestore.read_meta(tables_dir_of(path))
    except ValueError as err:
        raise _as_aggregate_error(err) from err


def load_run_tables(run_dir_or_tables_dir):
    """Read bin tables (checking schema versions) into a ``BinTables``."""
    try:
        return tablestore.load_tables(tables_dir_of(run_dir_or_tables_dir))
    except ValueError as err:
        raise _as_aggregate_error(err) from err


def tables_status(
    run_dirs, tables_dir=None, fine_bins: int | None = DEFAULT_FINE_BINS, *, verify: bool = True
) -> str | None:
    """None when the tables at `tables_dir` are current for `run_dirs`, else why not.

    Current means: built from exactly these runs' shard files (their manifest
    sha256s, whatever the directory is called now), N equal to the runs'
    positions, and (with ``verify``) table files unchanged since they were
    written. Invariants are checked on load (``tablestore.load_tables``).
    ``fine_bins=None`` accepts the tables' own F.
    """
    runs = open_runs(run_dirs)
    if tables_dir is None:
        tables_dir = default_tables_dir(runs[0].run_dir)
    tables_dir = Path(tables_dir)
    meta_path = tables_dir / META_NAME
    if not meta_path.exists():
        return "no tables yet"
    try:
        meta = json.loads(meta_path.read_bytes())
    except (ValueError, UnicodeDecodeError, RecursionError):
        return f"{meta_path} is unreadable"
    if not isinstance(meta, dict):
        return f"{meta_path} is not a tables meta.json"
    if meta.get("schema_version") != SCHEMA_VERSION:
        return f"tables of schema version {meta.get('schema_version')}"
    try:
        tablestore.read_meta(tables_dir)
    except SchemaVersionError:
        raise
    except ValueError as err:
        return str(err)
    if fine_bins is not None and meta.get("fine_bins") != fine_bins:
        return f"tables at F={meta.get('fine_bins')}"
    records = meta.get("runs") or []
    if not all(isinstance(r, dict) and "inputs" in r for r in records) or not records:
        return "tables without the checksums of their inputs (built by an older fullece)"
    want = sorted(json.dumps(_run_inputs(r), sort_keys=True) for r in runs)
    have = sorted(json.dumps(r.get("inputs"), sort_keys=True) for r in records)
    if want != have:
        return "shards changed since the tables were built"
    if sorted(_manifest_sha256(r.run_dir) for r in runs) != sorted(
        str(r.get("manifest_sha256")) for r in records
    ):
        return "manifest.json changed since the tables were built"
    positions = sum(s.rows for r in runs for s in r.shards)
    if meta.get("positions") != positions:
        return f"tables count {meta.get('positions')} positions, the runs {positions}"
    if not all((tables_dir / f"{n}.parquet").exists() for n in TABLE_NAMES):
        return "a table file is missing"
    if verify:
        problems = tablestore.checksum_problems(tables_dir, meta)
        if problems:
            return problems[0]
    return None


def check_mergeable(runs: list[Run], *, allow_mixed_models: bool = False) -> None:
    """Refuse runs whose positions would count twice, or of different models.

    Overlap: a positions or logits file of identical content (same sha256) in two runs, or
    two runs of the same model and corpus (sha256s) whose corpus slices
    share documents. Different models (model file sha256s) are refused
    unless `allow_mixed_models`.
    """
    if len(runs) < 2:
        return
    owner: dict[str, tuple[Run, str]] = {}
    for run in runs:
        # positions (and logits) identify positions; class_tail files of two
        # runs can legitimately be equal (all-zero tails, say)
        kept = {
            shard.entry.get(key)
            for shard in run.shards
            for key in ("positions", "logits")
            if shard.entry.get(key)
        }
        for rel, digest in _run_inputs(run).items():
            if rel not in kept:
                continue
            if digest in owner and owner[digest][0] is not run:
                other, other_rel = owner[digest]
                raise AggregateError(
                    f"{run.run_dir}/{rel} has the same content (sha256 {digest[:12]}…) as "
                    f"{other.run_dir}/{other_rel}: the runs overlap and their positions would "
                    "count twice; aggregate each run once"
                )
            owner.setdefault(digest, (run, rel))
    models = {}
    for run in runs:
        model = run.manifest.get("model") or {}
        if model.get("files"):  # runs without model checksums cannot be compared
            models.setdefault(json.dumps(model["files"], sort_keys=True), run)
    if len(models) > 1 and not allow_mixed_models:
        a, b = list(models.values())[:2]
        raise AggregateError(
            f"{a.run_dir} and {b.run_dir} come from different models (model file sha256s "
            "differ): their tables would mix two models; pass --allow-mixed-models if "
            "that is what you want"
        )
    for i, a in enumerate(runs):
        for b in runs[i + 1 :]:
            if _same_source(a, b) and _slices_overlap(a, b):
                raise AggregateError(
                    f"{a.run_dir} and {b.run_dir} are the same model on the same corpus with "
                    f"overlapping slices ({_slice(a)} and {_slice(b)}): documents would count "
                    "twice; aggregate disjoint slices only"
                )


def _same_source(a: Run, b: Run) -> bool:
    ma, mb = a.manifest.get("model") or {}, b.manifest.get("model") or {}
    ca, cb = a.manifest.get("corpus") or {}, b.manifest.get("corpus") or {}
    same_model = bool(ma.get("files")) and ma.get("files") == mb.get("files")
    return same_model and bool(ca.get("sha256")) and ca.get("sha256") == cb.get("sha256")


def _slice(run: Run) -> tuple[int, int]:
    value = (run.manifest.get("settings") or {}).get("slice") or [0, 1]
    return int(value[0]), max(1, int(value[1]))


def _slices_overlap(a: Run, b: Run) -> bool:
    """Slice (i, n) holds documents d with d % n == i: two slices share one
    exactly when i1 ≡ i2 (mod gcd(n1, n2)) (Chinese remainder theorem)."""
    import math

    (i1, n1), (i2, n2) = _slice(a), _slice(b)
    return (i1 - i2) % math.gcd(n1, n2) == 0


def _check_out_dir(out: Path, runs: list[Run]) -> None:
    """Tables go to a directory of their own: never a run directory itself, nor
    a regular file, nor inside a run's shards/."""
    if out.exists() and not out.is_dir():
        raise AggregateError(f"{out}: exists and is not a directory (give --out DIR)")
    if (out / "manifest.json").exists():
        raise AggregateError(f"{out}: is a run directory; tables go to RUN_DIR/tables or --out DIR")
    real = out.resolve()
    for run in runs:
        shards = (run.run_dir / "shards").resolve()
        if real == shards or shards in real.parents:
            raise AggregateError(f"{out}: inside {run.run_dir}/shards; choose another --out")


SCRATCH_DIR = ".fullece-tmp"


def scratch_dir(out: Path) -> Path:
    """A fresh scratch directory for DuckDB's spill files and temporary parts:
    OUT/.fullece-tmp/<pid>-… when OUT is writable (leftovers of killed
    processes are removed here, at the next start), else the system temp dir."""
    base = Path(out) / SCRATCH_DIR
    if _writable(Path(out)):
        try:
            base.mkdir(parents=True, exist_ok=True)
            _clean_scratch(base)
            return Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=base))
        except OSError:
            pass
    return Path(tempfile.mkdtemp(prefix="fullece-aggregate-"))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _clean_scratch(base: Path) -> None:
    for entry in base.iterdir():
        pid = entry.name.split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)


def check_out_arg(out) -> None:
    """`--out ""` (or a blank path) would put the tables in the current directory."""
    if out is not None and not str(out).strip():
        raise AggregateError(
            "--out: empty path (it would write the tables into the current directory); "
            "give --out DIR"
        )


CACHE_ENV = "XDG_CACHE_HOME"


def user_cache_dir() -> Path:
    """The current user's fullece cache: $XDG_CACHE_HOME/fullece (an absolute
    XDG_CACHE_HOME only, as the XDG spec says), else ~/.cache/fullece."""
    base = os.environ.get(CACHE_ENV, "")
    root = Path(base) if os.path.isabs(base) else Path.home() / ".cache"
    return root / "fullece"


def _safe_ancestors(path: Path) -> None:
    """Every directory leading to `path` (symbolic links resolved) is owned by
    root or this user and writable by no one else unless sticky (/tmp): no
    other user can swap a component for one of theirs."""
    uid = os.getuid()
    probe = Path(os.path.realpath(path))
    for directory in [*reversed(probe.parents), probe]:
        try:
            st = directory.stat()
        except FileNotFoundError:
            return
        foreign_write = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if st.st_uid not in (0, uid) or (foreign_write and not st.st_mode & stat.S_ISVTX):
            raise AggregateError(
                f"{directory}: the tables cache {path} would lie in a directory another "
                "user can change (owned by uid "
                f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); set {CACHE_ENV} to a "
                "directory of your own"
            )


def _private_dir(path: Path) -> Path:
    """`path` as a directory of this user only: created 0700 if missing, then
    refused unless it is a real directory (not a symbolic link) owned by the
    current uid that no one else can write."""
    try:
        path.mkdir(mode=0o700, exist_ok=True)
    except OSError as err:
        raise AggregateError(f"{path}: cannot create the tables cache ({err})") from None
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise AggregateError(
            f"{path}: the tables cache is a symbolic link or not a directory; "
            "refused (remove it: fullece recreates it)"
        )
    if st.st_uid != os.getuid():
        raise AggregateError(
            f"{path}: the tables cache is owned by uid {st.st_uid}, not by you "
            f"(uid {os.getuid()}); refused (remove it, or set {CACHE_ENV})"
        )
    if st.st_mode & 0o077:
        raise AggregateError(
            f"{path}: the tables cache has mode {stat.S_IMODE(st.st_mode):o}, open to "
            "other users; refused (chmod 700 it, or remove it)"
        )
    return path


def private_cache_dir(*names: str) -> Path:
    """``user_cache_dir()/<names...>``, every component this user's own (see
    _private_dir): what fullece derives from runs it could not write into, and
    the sums it keeps, live only here, never where another user could pre-seed
    them or point them elsewhere."""
    base = user_cache_dir()
    _safe_ancestors(base.parent)
    base.parent.mkdir(parents=True, exist_ok=True)
    _safe_ancestors(base.parent)
    directory = _private_dir(base)
    for name in names:
        directory = _private_dir(directory / name)
    return directory


def _tables_cache(run_dirs) -> Path:
    """Where tables of runs that cannot hold them (read-only) are kept: the
    user's own cache (``user_cache_dir()/tables/<sha256 of the runs' real
    paths>``), every component checked (see _private_dir), never a shared
    temp directory another user could pre-seed or point elsewhere."""
    tag = hashlib.sha256("\0".join(str(Path(d).resolve()) for d in run_dirs).encode()).hexdigest()[
        :16
    ]
    return private_cache_dir("tables", tag)


# Tables directories whose tables this process checked against their runs'
# shards: (stat key of the tables, the runs' manifest sha256s).
_AGREES_WITH_SHARDS: set = set()


def _input_digest(runs: list[Run], fine_bins: int) -> tuple[tablestore.InputDigest, float]:
    """The digest of the runs' verified positions shards, and the tail_max the
    tables must record (that of the top-k stores). The manifest's tail_max and m_exact (run and shard) are checked
    against the shards here: an edited manifest is refused, naming the field."""
    from pipeline.core.binning import m_exact_from_tail_max

    digest = tablestore.InputDigest(fine_bins, runs[0].vocab_size)
    overall = 0.0
    for run in runs:
        where = run.run_dir / "manifest.json"
        run_tail = 0.0
        for i, shard in enumerate(run.shards):
            check_shard(shard)
            path = shard.path("positions")
            shard_tail, before = 0.0, digest.positions
            try:
                # the store's verified reader: values range-checked, rows named
                for batch in iter_positions(shard, list(tablestore.DIGEST_COLUMNS)):
                    cols = {n: batch.column(n).to_numpy() for n in tablestore.DIGEST_COLUMNS}
                    full = run.store == "full"
                    shard_tail = max(shard_tail, digest.add(cols, full_store=full))
            except (OSError, pa.ArrowException, tablestore.TablesError) as err:
                raise AggregateError(f"{path}: {err}") from None
            if digest.positions - before != shard.rows:
                raise AggregateError(
                    f"{where}: field 'shards[{i}].rows' = {shard.rows!r}, but {path.name} "
                    f"holds {digest.positions - before} positions"
                )
            recorded = shard.entry.get("tail_max")
            if recorded is not None and _f32(recorded) != shard_tail:
                raise AggregateError(
                    f"{where}: field 'shards[{i}].tail_max' = {recorded!r}, but "
                    f"{path.name} holds tail_max up to {shard_tail!r}"
                )
            run_tail = max(run_tail, shard_tail)
        positions = sum(s.rows for s in run.shards)
        if run.manifest.get("positions") != positions:
            raise AggregateError(
                f"{where}: field 'positions' = {run.manifest.get('positions')!r}, but the "
                f"shards hold {positions} positions"
            )
        recorded = (_f32(run.manifest.get("tail_max", 0.0)), run.manifest.get("m_exact"))
        if run.store == "full" and recorded == (0.0, None):
            continue  # a full store may record no tail at all: every M is exact from logits
        if recorded[0] != run_tail:
            raise AggregateError(
                f"{where}: field 'tail_max' = {run.manifest.get('tail_max')!r}, but the "
                f"positions shards hold tail_max up to {run_tail!r}"
            )
        if recorded[1] != m_exact_from_tail_max(run_tail):
            raise AggregateError(
                f"{where}: field 'm_exact' = {run.manifest.get('m_exact')!r}, but the "
                f"shards' tail_max {run_tail!r} gives {m_exact_from_tail_max(run_tail)!r}"
            )
        if run.store == "topk":  # a full store has no tail: its tables' tail_max is 0
            overall = max(overall, run_tail)
    return digest, overall


def _f32(value) -> float | None:
    try:
        return float(np.float32(value))
    except (TypeError, ValueError):
        return None


def _shard_problem(runs: list[Run], tables_dir: Path) -> str | None:
    """Why the tables at `tables_dir` disagree with the runs' shards, or None.
    Raises AggregateError when the runs' own manifests contradict their shards
    (no rebuild can help)."""
    key = (tablestore._stat_key(tables_dir), tuple(_manifest_sha256(r.run_dir) for r in runs))
    if key[0] is not None and key in _AGREES_WITH_SHARDS:
        return None
    try:
        meta, arrow = tablestore._verified(tables_dir)
    except SchemaVersionError:
        raise
    except ValueError as err:
        return f"the tables fail verification: {err}"
    digest, tail_max = _input_digest(runs, meta["fine_bins"])
    found = digest.problems(arrow, meta)
    if _f32(meta["tail_max"]) != tail_max:  # full stores: no tail in the tables
        found.append(f"tail_max = {meta['tail_max']!r}, the shards' {tail_max!r}")
    if found:
        return (
            f"{tables_dir}: the tables disagree with the shards they were built from: "
            + "; ".join(found)
        )
    if key == (tablestore._stat_key(tables_dir), key[1]):
        _AGREES_WITH_SHARDS.add(key)
    return None


def tables_disagree(run_dirs, tables_dir) -> str | None:
    """Why the tables at `tables_dir` disagree with the runs' shards (the
    digest of their positions columns, the manifests' tail_max and m_exact),
    or None (``fullece validate``)."""
    try:
        return _shard_problem(open_runs(run_dirs), Path(tables_dir))
    except SchemaVersionError:
        raise
    except ValueError as err:
        return str(err)


def _current_tables(runs: list[Run], tables_dir: Path, fine_bins: int | None) -> str | None:
    """None when the tables at `tables_dir` are those of `runs`' shards as they
    are now (checksums, manifests, invariants and the shards' digest), else why not."""
    reason = tables_status([r.run_dir for r in runs], tables_dir, fine_bins)
    return reason if reason is not None else _shard_problem(runs, tables_dir)


def _runs_of_tables(tables_dir: Path) -> list[Path]:
    """The run directories a plain tables directory (an `aggregate --out DIR`)
    was built from: its meta.json's runs[].run_dir, relative to it. Tables are
    only ever used beside their runs (checked against their shards)."""
    try:
        meta = tablestore.read_meta(tables_dir)
    except ValueError as err:
        raise _as_aggregate_error(err) from err
    records = meta.get("runs") or []
    meta_path = tables_dir / META_NAME
    if not records:
        raise AggregateError(
            f"{meta_path}: field 'runs' is empty (tables from an older fullece): "
            "aggregate the runs again"
        )
    found = []
    for i, record in enumerate(records):
        rel = record.get("run_dir")
        path = tables_dir / str(rel) if isinstance(rel, str) else None
        if path is None or not (path / "manifest.json").is_file():
            raise AggregateError(
                f"{meta_path}: field 'runs[{i}].run_dir' = {rel!r}: no run there; tables "
                "are checked against the shards they came from: keep them beside their "
                "runs, or aggregate again"
            )
        found.append(path)
    return found


def ensure_tables(run_dirs, out=None, *, quiet: bool = False) -> Path:
    """Tables directory for `run_dirs`, aggregating first (with a one-line notice
    on stderr) when they are missing, stale, fail verification (checksums,
    invariants) or disagree with the shards' digest. A plain tables directory
    (no manifest) is checked against the runs its meta.json names, and rebuilt
    in place when stale. When a run directory is not writable, rebuilt tables
    go to the user's own cache (see _tables_cache), never into the run."""
    if isinstance(run_dirs, (str, os.PathLike)):
        run_dirs = [run_dirs]
    run_dirs = [Path(d) for d in run_dirs]
    check_out_arg(out)
    if len(run_dirs) == 1 and not (run_dirs[0] / "manifest.json").exists():
        if (run_dirs[0] / META_NAME).exists():
            tables_dir = run_dirs[0]
            try:
                runs = _runs_of_tables(tables_dir)
            except AggregateError as missing:
                try:  # damaged tables are named first: that is what to fix
                    tablestore.verify_tables(tables_dir)
                except ValueError as err:
                    raise _as_aggregate_error(err) from err
                raise missing from None
            return _ensure(runs, tables_dir, quiet, plain=True)
        open_run(run_dirs[0])  # raises the error naming the missing manifest
    if out is None and len(run_dirs) > 1:
        raise AggregateError("several runs: give --out DIR for their merged tables")
    tables_dir = Path(out) if out is not None else default_tables_dir(run_dirs[0])
    return _ensure(run_dirs, tables_dir, quiet, plain=out is not None)


def _ensure(run_dirs: list[Path], tables_dir: Path, quiet: bool, *, plain: bool) -> Path:
    runs = open_runs(run_dirs)
    reason = _current_tables(runs, tables_dir, None)
    if reason is None:
        return tables_dir
    if not plain and not _writable(tables_dir):
        cache = _tables_cache(run_dirs)
        if _current_tables(runs, cache, None) is None:
            return cache
        reason += f"; {run_dirs[0]} is not writable, tables go to {cache}"
        tables_dir = cache
    if not quiet:
        names = ", ".join(str(d) for d in run_dirs)
        print(f"fullece: aggregating {names} ({reason}) ...", file=sys.stderr)
    fine = _existing_fine_bins(tables_dir)
    aggregate(run_dirs, tables_dir, fine_bins=fine, progress=not quiet, allow_mixed_models=plain)
    problem = _shard_problem(runs, tables_dir)
    if problem is not None:  # just built from these shards: never expected
        raise AggregateError(problem)
    return tables_dir


def _existing_fine_bins(tables_dir: Path) -> int:
    try:
        value = json.loads((Path(tables_dir) / META_NAME).read_bytes()).get("fine_bins")
    except (OSError, ValueError, AttributeError, RecursionError):
        return DEFAULT_FINE_BINS
    return value if isinstance(value, int) and value >= 1 else DEFAULT_FINE_BINS
