"""``fullece sql``: DuckDB over a run's bin tables and shards, read-only.

Views (every one has a ``run`` column, the run's label, so several runs can be
queried together with ``GROUP BY run``):

    class_bins, top1_bins, tokens, seq_bins   the bin tables (docs/design.md)
    positions                                 the positions shards (one row per position)
    manifest                                  one row per run: label, store, vocab_size,
                                              positions, m_exact, tail_max, model, corpus ...
    meta                                      one row per run: the tables' fine_bins,
                                              positions, vocab_size, m_exact

The connection is a sandbox (see docs/sql-sandbox.md): every view scans files
that were verified first, and a query can read nothing else, write nothing,
ATTACH nothing and install or load no extension. Results are written only
when asked (``--csv/--json/--parquet FILE``), never inside a run directory and
never over an existing file without ``--force``.
"""

from __future__ import annotations

import json
from pathlib import Path

TABLE_VIEWS = ("class_bins", "top1_bins", "tokens", "seq_bins")


def _q(s) -> str:
    return "'" + str(s).replace("'", "''") + "'"


def _run_row(run_dir: Path, tables_dir: Path) -> tuple[dict, dict]:
    from pipeline.aggregate import read_tables_meta
    from pipeline.store.manifest import load_manifest

    manifest = load_manifest(run_dir)
    meta = read_tables_meta(tables_dir)
    label = str(manifest.get("label") or run_dir.resolve().name)
    settings = manifest.get("settings") or {}
    mrow = {
        "run": label,
        "run_dir": str(run_dir),
        "store": manifest.get("store"),
        "vocab_size": manifest.get("vocab_size"),
        "positions": manifest.get("positions"),
        "m_exact": manifest.get("m_exact"),
        "tail_max": manifest.get("tail_max"),
        "created": manifest.get("created"),
        "complete": manifest.get("complete"),
        "model_path": (manifest.get("model") or {}).get("path"),
        "corpus_path": (manifest.get("corpus") or {}).get("path"),
        "k": settings.get("k"),
        "tau": settings.get("tau"),
        "shards": len(manifest.get("shards") or []),
        "manifest_json": json.dumps(manifest),
    }
    trow = {
        "run": label,
        "fine_bins": meta["fine_bins"],
        "positions": meta["positions"],
        "vocab_size": meta["vocab_size"],
        "m_exact": meta.get("m_exact"),
        "tail_max": meta.get("tail_max"),
    }
    return mrow, trow


SANDBOX_SETTINGS = (
    # no file, network or extension access from a query: the views below are the
    # only data a query can see, and the configuration cannot be changed back
    "SET enable_external_access = false",
    "SET autoinstall_known_extensions = false",
    "SET autoload_known_extensions = false",
    "SET allow_community_extensions = false",
    "SET lock_configuration = true",
)


class SqlError(ValueError):
    """A query or an export that the sandbox refuses."""


def _dataset(paths):
    """A pyarrow dataset over Parquet files that verifies page checksums as it reads."""
    import pyarrow.dataset as ds

    fmt = ds.ParquetFileFormat(
        default_fragment_scan_options=ds.ParquetFragmentScanOptions(page_checksum_verification=True)
    )
    return ds.dataset([str(p) for p in paths], format=fmt)


def connect(run_dirs, *, quiet: bool = True):
    """A sandboxed DuckDB connection with read-only views over `run_dirs`.

    The bin tables are verified (checksums, invariants) and so are the positions
    shards (manifest sha256) before any view exists. The views scan Arrow
    datasets registered from Python, so DuckDB itself needs no file access:
    external access (files, ATTACH, COPY, network), extension install/load and
    configuration changes are then switched off.
    """
    import duckdb

    from pipeline.aggregate import ensure_tables, open_run
    from pipeline.store.run import check_shard

    con = duckdb.connect(":memory:")
    mrows, trows, per_table, pos_files = [], [], {n: [] for n in TABLE_VIEWS}, []
    for run_dir in run_dirs:
        run_dir = Path(run_dir)
        run = open_run(run_dir)
        tables_dir = ensure_tables(run_dir, quiet=quiet)
        mrow, trow = _run_row(run_dir, tables_dir)
        mrows.append(mrow)
        trows.append(trow)
        for name in TABLE_VIEWS:
            per_table[name].append((trow["run"], tables_dir / f"{name}.parquet"))
        for shard in run.shards:
            check_shard(shard)
            pos_files.append((trow["run"], shard.path("positions")))
    registered = 0

    def view(name, items):
        nonlocal registered
        parts = []
        for label, path in items:
            handle = f"_fullece_src_{registered}"
            registered += 1
            con.register(handle, _dataset([path]))
            parts.append(f"SELECT {_q(label)} AS run, * FROM {handle}")
        con.execute(f"CREATE VIEW {name} AS {' UNION ALL '.join(parts)}")

    for name, items in per_table.items():
        view(name, items)
    view("positions", pos_files)
    for view_name, rows in (("manifest", mrows), ("meta", trows)):
        cols = list(rows[0])
        values = ", ".join(
            "("
            + ", ".join(
                "NULL"
                if r[c] is None
                else _q(r[c])
                if isinstance(r[c], str)
                else str(r[c]).lower()
                if isinstance(r[c], bool)
                else repr(r[c])
                for c in cols
            )
            + ")"
            for r in rows
        )
        con.execute(
            f"CREATE VIEW {view_name} AS SELECT * FROM (VALUES {values}) t({', '.join(cols)})"
        )
    for statement in SANDBOX_SETTINGS:
        con.execute(statement)
    return con


def run_query(run_dirs, query: str, *, quiet: bool = True):
    """(column names, rows) of `query` over the views of `run_dirs`."""
    con = connect(run_dirs, quiet=quiet)
    try:
        cur = con.execute(query)
        names = [d[0] for d in cur.description] if cur.description else []
        return names, cur.fetchall()
    finally:
        con.close()


def format_table(names, rows, max_rows: int = 200) -> str:
    def cell(v):
        if v is None:
            return "NULL"
        if isinstance(v, float):
            return f"{v:.6g}"
        return str(v)

    body = [[cell(v) for v in r] for r in rows[:max_rows]]
    widths = [max([len(n)] + [len(r[i]) for r in body]) for i, n in enumerate(names)]
    line = "  ".join(n.ljust(w) for n, w in zip(names, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    for r in body:
        out.append("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)))
    if len(rows) > max_rows:
        out.append(f"... {len(rows) - max_rows} more row(s)")
    out.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(out)


def check_export_path(path, run_dirs, *, force: bool = False) -> Path:
    """Refuse an export target inside a run directory (it would damage the run)
    and an existing file unless `force`."""
    path = Path(path)
    real = path.resolve()
    for run_dir in run_dirs:
        root = Path(run_dir).resolve()
        if real == root or root in real.parents:
            raise SqlError(
                f"{path}: inside the run directory {run_dir}; exports never write into a "
                "run (choose a path outside it)"
            )
    if path.exists() and path.is_dir():
        raise SqlError(f"{path}: is a directory")
    if path.exists() and not force:
        raise SqlError(f"{path}: exists; pass --force to overwrite it")
    if not path.parent.is_dir():
        raise SqlError(f"{path.parent}: no such directory")
    return path


def export(con, query: str, path: Path, fmt: str) -> int:
    """Write the result of `query` to `path` (csv, json array or parquet), atomically.

    The rows stream from the sandboxed connection as Arrow batches and are
    written here, in Python: DuckDB itself never touches the file system."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    from pipeline.store import atomic

    query = query.strip().rstrip(";")
    reader = con.sql(query).to_arrow_reader(1 << 16)
    rows = 0
    with atomic.atomic_path(path) as tmp:
        if fmt == "parquet":
            with pq.ParquetWriter(str(tmp), reader.schema, write_page_checksum=True) as writer:
                for batch in reader:
                    writer.write_batch(batch)
                    rows += batch.num_rows
        elif fmt == "csv":
            options = pacsv.WriteOptions(quoting_header="none")
            with pacsv.CSVWriter(str(tmp), reader.schema, write_options=options) as writer:
                for batch in reader:
                    writer.write_batch(batch)
                    rows += batch.num_rows
        elif fmt == "json":
            from pipeline.store.jsonsafe import json_safe

            with open(tmp, "w", encoding="utf-8") as f:
                f.write("[")
                for batch in reader:
                    for row in pa.Table.from_batches([batch]).to_pylist():
                        f.write(
                            ("\n" if rows == 0 else ",\n") + json.dumps(json_safe(row), default=str)
                        )
                        rows += 1
                f.write("\n]\n")
        else:
            raise SqlError(f"unknown export format {fmt!r}")
    return rows
