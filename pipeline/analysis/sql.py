"""``fullece sql``: DuckDB over a run's bin tables and shards, read-only.

Views (every one has a ``run`` column, the run's label, so several runs can be
queried together with ``GROUP BY run``):

    class_bins, top1_bins, tokens, seq_bins   the bin tables (docs/design.md)
    positions                                 the positions shards (one row per position)
    manifest                                  one row per run: label, store, vocab_size,
                                              positions, m_exact, tail_max, model, corpus ...
    meta                                      one row per run: the tables' fine_bins,
                                              positions, vocab_size, m_exact

Views over Parquet files cannot modify them; nothing is written unless asked
(``--csv/--json/--parquet FILE``).
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.store.manifest import RunError

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


def connect(run_dirs, *, quiet: bool = True):
    """A DuckDB connection with the read-only views over `run_dirs`."""
    import duckdb

    from pipeline.aggregate import ensure_tables, open_run

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
            pos = shard.path("positions")
            if pos is None or not pos.exists():
                raise RunError(f"{pos}: shard file missing (listed in {run_dir / 'manifest.json'})")
            pos_files.append((trow["run"], pos))
    for name, items in per_table.items():
        union = " UNION ALL ".join(
            f"SELECT {_q(label)} AS run, * FROM read_parquet({_q(path)})" for label, path in items
        )
        con.execute(f"CREATE VIEW {name} AS {union}")
    union = " UNION ALL ".join(
        f"SELECT {_q(label)} AS run, * FROM read_parquet({_q(path)})" for label, path in pos_files
    )
    con.execute(f"CREATE VIEW positions AS {union}")
    for view, rows in (("manifest", mrows), ("meta", trows)):
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
        con.execute(f"CREATE VIEW {view} AS SELECT * FROM (VALUES {values}) t({', '.join(cols)})")
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


def export(con, query: str, path: Path, fmt: str) -> None:
    from pipeline.store import atomic

    query = query.strip().rstrip(";")
    options = {
        "csv": "FORMAT csv, HEADER true",
        "json": "FORMAT json, ARRAY true",
        "parquet": "FORMAT parquet",
    }[fmt]
    with atomic.atomic_path(path) as tmp:
        con.execute(f"COPY ({query}) TO {_q(tmp)} ({options})")
