"""Helpers shared by the command modules: errors to one line, JSON output."""

from __future__ import annotations

import click

from pipeline.store.jsonsafe import dumps


def fail(err: Exception):
    """Re-raise a library error as a one-line click error (exit status 1)."""
    raise click.ClickException(str(err)) from err


def dumps_json(result) -> str:
    return dumps(result)
