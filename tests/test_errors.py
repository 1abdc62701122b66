"""fullece's own errors have one base: FulleceError, itself a ValueError (so
`except ValueError` keeps working)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from pipeline.errors import FulleceError

PIPELINE = Path(__file__).resolve().parent.parent / "pipeline"
# DefaultError (pipeline/demo/default.py) still derives from ValueError: that file
# was another change's when FulleceError came; the lead moves it over at merge.
_NOT_YET = {("pipeline/demo/default.py", "DefaultError")}


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
    assert direct == _NOT_YET


@pytest.mark.parametrize(
    "module,name",
    [
        (rel[:-3].replace("/", "."), name)
        for rel, name, _ in _error_classes()
        if (rel, name) not in _NOT_YET and rel != "pipeline/demo/default.py"
    ],
)
def test_every_error_is_a_fullece_error_and_a_value_error(module, name):
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, FulleceError) and issubclass(cls, ValueError), cls.__mro__
