"""Where the JSON schema files are: package data of ``pipeline.schemas`` in an
installed wheel, the top-level ``schemas/`` directory in a checkout."""

from __future__ import annotations

from pathlib import Path

CHECKOUT_SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"


INSTALLED_SCHEMAS = Path(__file__).resolve().parents[1] / "schemas"


def schemas_dir() -> Path:
    # pipeline/schemas/ in a wheel (package data without an __init__.py, so
    # importlib.resources would see a namespace package: look at the folder).
    return INSTALLED_SCHEMAS if INSTALLED_SCHEMAS.is_dir() else CHECKOUT_SCHEMAS


def schema_file(name: str) -> Path:
    path = schemas_dir() / name
    if not path.exists():
        raise FileNotFoundError(f"{path}: schema file missing from the installation")
    return path
