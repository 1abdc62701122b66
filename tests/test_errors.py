"""fullece's own errors have one base: FulleceError, itself a ValueError (so
`except ValueError` keeps working)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from pipeline.errors import FulleceError

PIPELINE = Path(__file__).resolve().parent.parent / "pipeline"


def _error_classes():
    """(module, class name) of every class in pipeline/ that names ValueError
    or one of fullece's errors among its bases."""
    found = []
    for path in sorted(PIPELINE.rglob("*.py")):
        rel = path.relative_to(PIPELINE.parent).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
                if bases & {"ValueError", "FulleceError"} or any(
                    b.endswith("Error") for b in bases
                ):
                    found.append((rel, node.name, bases))
    return found


def test_no_error_derives_from_value_error_directly():
    direct = {
        (rel, name)
        for rel, name, bases in _error_classes()
        if "ValueError" in bases and name != "FulleceError"
    }
    assert direct == set()


@pytest.mark.parametrize(
    "module,name",
    [(rel[:-3].replace("/", "."), name) for rel, name, _ in _error_classes()],
)
def test_every_error_is_a_fullece_error_and_a_value_error(module, name):
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, FulleceError) and issubclass(cls, ValueError), cls.__mro__


def _leaf_commands(group, ctx):
    import click

    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        if isinstance(cmd, click.Group):
            yield from _leaf_commands(cmd, ctx)
        else:
            yield name, cmd


def test_every_command_has_the_one_error_handler():
    import click

    from pipeline.cli import main
    from pipeline.cli.common import Command

    ctx = click.Context(main)
    leaves = dict(_leaf_commands(main, ctx))
    assert len(leaves) >= 12
    assert {n for n, c in leaves.items() if not isinstance(c, Command)} == set()


def test_a_fullece_error_is_one_error_line(tmp_path):
    """A real RunError (no manifest) through the real command: `Error: <one
    line>` on stderr, exit 1, no traceback hint."""
    from click.testing import CliRunner

    from pipeline.cli import main

    res = CliRunner().invoke(main, ["metrics", str(tmp_path)])
    assert res.exit_code == 1
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.output
    assert str(tmp_path) in lines[0] and "--debug" not in lines[0]
