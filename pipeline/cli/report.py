"""``fullece report``."""

from __future__ import annotations

from pathlib import Path

import click

from pipeline.analysis.report import write_report
from pipeline.cli.common import fail
from pipeline.store.manifest import RunError
from pipeline.store.schema import SchemaVersionError


@click.command("report")
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "--out",
    "out_dir",
    type=click.Path(path_type=Path),
    required=True,
    help="Output directory for the PNG figures and report.html.",
)
@click.option("--quiet", is_flag=True, help="No progress bar or notices.")
def report(run_dirs, out_dir, quiet):
    """PNG figures and a self-contained HTML page for one or several runs."""
    try:
        path = write_report(list(run_dirs), out_dir, quiet=quiet)
    except (RunError, SchemaVersionError, ValueError, FileNotFoundError) as err:
        fail(err)
    click.echo(str(path))
