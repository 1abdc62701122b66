"""``fullece sql``: read-only DuckDB over runs (see pipeline.analysis.sql)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from pipeline.analysis.sql import (
    EMPTY_QUERY,
    SqlError,
    check_export_path,
    connect,
    export,
    fetch_head,
    format_table,
    one_line,
    statements,
)
from pipeline.store.manifest import RunError
from pipeline.store.schema import SchemaVersionError


def _split_args(args):
    """RUN_DIR... [QUERY]: the last argument is the query unless it is a directory."""
    args = list(args)
    if args and not Path(args[-1]).is_dir():
        return [Path(a) for a in args[:-1]], args[-1]
    return [Path(a) for a in args], None


def run_statement(con, statement: str) -> str | None:
    """The printed result of one statement (None when it returns no rows)."""
    head = fetch_head(con, statement)
    if head is None:
        return None
    names, rows, total = head
    return format_table(names, rows, total=total)


def run_script(con, query: str) -> None:
    """Run every statement of `query` in order and print each result; the
    first failure stops the script with a one-line error."""
    try:
        found = statements(query)
    except SqlError as err:
        raise click.ClickException(f"query failed: {err}") from err
    if not found:
        raise click.ClickException(EMPTY_QUERY)
    printed = 0
    for number, statement in enumerate(found, 1):
        try:
            text = run_statement(con, statement)
        except Exception as err:  # noqa: BLE001 - any DuckDB error, on one line
            where = f" (statement {number} of {len(found)})" if len(found) > 1 else ""
            raise click.ClickException(f"query failed{where}: {one_line(err)}") from err
        if text is not None:
            click.echo(("\n" if printed else "") + text)
            printed += 1


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
                run_script(con, query)
            except click.ClickException as err:
                click.echo(f"error: {err.message}", err=True)


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
@click.option(
    "--partial",
    is_flag=True,
    help="Query an incomplete run (complete: false in manifest.json) as it is; refused otherwise.",
)
def sql(args, csv_path, json_path, parquet_path, force, partial):
    """DuckDB over RUN_DIR... (views: class_bins, top1_bins, tokens, seq_bins,
    positions, manifest, meta). Without QUERY, an interactive prompt (or the
    statements on standard input).

    Read-only sandbox: a query sees only these views (no file, no ATTACH,
    COPY, INSTALL or LOAD). Exports write only a regular file outside every
    run, and never overwrite one without --force.

    \b
    fullece sql runs/ckpt1 "SELECT * FROM top1_bins ORDER BY bin LIMIT 5"
    """
    run_dirs, query = _split_args(args)
    if not run_dirs:
        raise click.UsageError("give at least one RUN_DIR")
    outputs = [
        (p, f) for p, f in ((csv_path, "csv"), (json_path, "json"), (parquet_path, "parquet")) if p
    ]
    if outputs and query is None:
        raise click.UsageError("--csv/--json/--parquet need a QUERY")
    try:
        for path, _ in outputs:
            check_export_path(path, run_dirs, force=force)
    except SqlError as err:
        raise click.ClickException(str(err)) from err
    try:
        con = connect(run_dirs, quiet=False, partial=partial)
    except (RunError, SchemaVersionError, ValueError, FileNotFoundError) as err:
        raise click.ClickException(str(err)) from err
    try:
        if query is None:
            if not sys.stdin.isatty():
                query = sys.stdin.read()
            else:  # pragma: no cover
                repl(con)
                return
        if not outputs:
            run_script(con, query)
            return
        for path, fmt in outputs:
            try:
                export(con, query, path, fmt, run_dirs=run_dirs, force=force)
            except SqlError as err:
                raise click.ClickException(str(err)) from err
            except Exception as err:  # noqa: BLE001 - duckdb errors, on one line
                raise click.ClickException(f"query failed: {one_line(err)}") from err
            click.echo(f"wrote {path}", err=True)
    finally:
        con.close()
