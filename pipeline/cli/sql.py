"""``fullece sql``: read-only DuckDB over runs (see pipeline.analysis.sql)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from pipeline.analysis.sql import SqlError, check_export_path, connect, export, format_table
from pipeline.store.manifest import RunError
from pipeline.store.schema import SchemaVersionError


def _split_args(args):
    """RUN_DIR... [QUERY]: the last argument is the query unless it is a directory."""
    args = list(args)
    if args and not Path(args[-1]).is_dir():
        return [Path(a) for a in args[:-1]], args[-1]
    return [Path(a) for a in args], None


def repl(con) -> None:  # pragma: no cover - interactive
    click.echo(
        "fullece sql: views class_bins, top1_bins, tokens, seq_bins, positions, manifest, "
        "meta. End statements with ';', quit with .quit or Ctrl-D.",
        err=True,
    )
    buf = []
    while True:
        try:
            line = input("fullece> " if not buf else "    ...> ")
        except EOFError:
            click.echo("", err=True)
            return
        if not buf and line.strip() in (".quit", ".exit", "\\q"):
            return
        buf.append(line)
        if line.rstrip().endswith(";"):
            query = "\n".join(buf)
            buf = []
            try:
                cur = con.execute(query)
                if cur.description:
                    click.echo(format_table([d[0] for d in cur.description], cur.fetchall()))
            except Exception as err:  # noqa: BLE001 - show any SQL error and continue
                click.echo(f"error: {err}", err=True)


@click.command("sql", context_settings={"ignore_unknown_options": False})
@click.argument("args", nargs=-1, required=True)
@click.option("--csv", "csv_path", type=click.Path(path_type=Path), help="Write the result as CSV.")
@click.option(
    "--json", "json_path", type=click.Path(path_type=Path), help="Write the result as a JSON array."
)
@click.option(
    "--parquet",
    "parquet_path",
    type=click.Path(path_type=Path),
    help="Write the result as Parquet.",
)
@click.option("--force", is_flag=True, help="Overwrite an existing --csv/--json/--parquet file.")
def sql(args, csv_path, json_path, parquet_path, force):
    """DuckDB over RUN_DIR... (views: class_bins, top1_bins, tokens, seq_bins,
    positions, manifest, meta). Without QUERY, an interactive prompt.

    Read-only sandbox: a query sees only these views (no other file, no
    ATTACH, COPY, INSTALL or LOAD). Exports never write inside a run directory
    and never overwrite a file without --force.

    \b
    fullece sql runs/ckpt1 "SELECT * FROM top1_bins ORDER BY bin LIMIT 5"
    """
    run_dirs, query = _split_args(args)
    if not run_dirs:
        raise click.UsageError("give at least one RUN_DIR")
    outputs = [
        (p, f) for p, f in ((csv_path, "csv"), (json_path, "json"), (parquet_path, "parquet")) if p
    ]
    try:
        for path, _ in outputs:
            check_export_path(path, run_dirs, force=force)
    except SqlError as err:
        raise click.ClickException(str(err)) from err
    try:
        con = connect(run_dirs, quiet=False)
    except (RunError, SchemaVersionError, ValueError, FileNotFoundError) as err:
        raise click.ClickException(str(err)) from err
    try:
        if query is None:
            if outputs:
                raise click.UsageError("--csv/--json/--parquet need a QUERY")
            if not sys.stdin.isatty():
                query = sys.stdin.read()
            else:  # pragma: no cover
                repl(con)
                return
        try:
            if outputs:
                for path, fmt in outputs:
                    export(con, query, path, fmt)
                    click.echo(f"wrote {path}", err=True)
            else:
                cur = con.execute(query)
                if cur.description:
                    click.echo(format_table([d[0] for d in cur.description], cur.fetchall()))
        except click.ClickException:
            raise
        except Exception as err:  # noqa: BLE001 - duckdb errors
            raise click.ClickException(f"query failed: {err}") from err
    finally:
        con.close()
